"""Predicted time of one training step for a PP x TP x DP (x EP, x CP) layout.

    step = compute + elementwise + tp_comm + ep_comm + cp_comm + bubble + p2p + optimizer + exposed dp_comm

- compute: the matmul FLOP count (`shardlm.plan.flops.flops_per_step`: 72 B s l h^2 (1 + s/6h +
  V/12lh), plus the layers' forward again with activation recomputation, padded vocabulary) divided
  over all GPUs, at `compute_efficiency` of
  the GPU's peak. It covers everything that splits over TP (GEMMs, attention, GeLU).
- elementwise: the work every TP rank repeats on the full b x s x h activations (LayerNorms,
  dropouts, residual adds, row-parallel bias adds: `ELEMENTWISE_PASSES` reads/writes of b s h
  elements per layer, forward and backward, again when recomputing), memory-bound at the HBM
  bandwidth. This is what makes TP scale below linear even with free communication.
- tp_comm: per layer and micro-batch 2 all-reduces forward and 2 backward (+2 forward when
  recomputing), plus the embedding's forward and the LM head's backward all-reduce, each of
  b x s x h elements, and the cross-entropy's 3 b s floats; ring cost
  2 (p-1)/p * bytes / bandwidth + 2 (p-1) * latency over the intra-node link. Not overlapped: each
  all-reduce sits on the critical path between two GEMMs.
- dp_comm: one ring all-reduce of this rank's gradients over the DP group. A DP group is strided
  by TP, so a node hosts `gpus_per_node / tp` of its ranks and `tp` such groups at once; when a
  group spans nodes, each node's network carries 2 (p-1)/p * gradient bytes for each of its tp
  groups. shardlm's DDP starts bucket all-reduces during the last micro-batch's backward: a fraction
  `dp_overlap` of the all-reduce hides behind that backward (capped by its length), the rest is
  exposed.
- expert parallelism (MoE models, E = `Layout.ep`): the expert FLOPs are in the FLOP count (top-k and
  shared experts, router); each MoE layer adds its all-to-all (`all_to_all_seconds`, of a CP rank's
  T / C tokens), and the DP all-reduce splits into the dense gradients over DP x CP and the expert
  gradients over the DP x CP / E expert-DP ranks (`dp_comm_seconds`).
- context parallelism (C = `Layout.cp`): the per-token work (elementwise, TP collectives, pipeline
  transfers) is that of T / C tokens, the FLOPs split over all GPUs as before, the gradient all-reduce
  and the distributed optimizer span DP x C ranks, and each layer adds the ring's exposed K/V
  transfers (`shardlm.plan.context.ring_seconds`).
- optimizer: AdamW, clipping and precision copies stream the per-rank state once (memory-bound;
  1/DP of it with the distributed optimizer). With Muon (`muon_s`, `shardlm.plan.muon`) the step adds its TP
  and data-sharding collectives and the Newton-Schulz iterations, not overlapped.
- FSDP (`Layout.full_sharding`): per layer 1 + m all-gathers and one reduce-scatter on the DP group's
  link instead of the gradient all-reduce, each overlapping the layer's forward or backward as the
  all-reduce overlaps the backward (`shardlm.plan.fsdp.fsdp_seconds`); the optimizer streams 1/DP. With
  a pipeline the units are the rank's and the reduce-scatters come after the flush (exposed); split
  experts gather over expert-DP; hybrid sharding (`Layout.fsdp_shard_size`) gathers over its S ranks and
  all-reduces the gradient shards across the groups (`fsdp.fsdp_groups`).
- pipeline (P > 1): a rank runs the layers of its stages, so compute, elementwise and TP work divide
  by P (the busiest rank's ceil(L / P) layers set the pace when P does not divide L); the flush adds
  the bubble (P - 1) / (V m) of that work; every micro-batch crosses each of the
  rank's V stage boundaries forward and backward (`p2p_seconds`), not overlapped. The DP all-reduce
  runs after the flush (shardlm's pipeline runner and Megatron's local DDP): nothing hides it.
- sequence parallelism: the same TP volume (all-gather + reduce-scatter instead of all-reduce), the
  elementwise work split over TP. Selective recomputation repeats the attention core's forward
  (4 b s^2 h FLOPs per layer, and the softmax passes where scores are materialized).
- `attention_scores` (Megatron 2021's unfused softmax): the s x s scores are written and read by the
  softmax and dropout kernels, 11 bytes per score forward and 11 backward (again when recomputing),
  at the HBM bandwidth.

- `kernels` (`--implementation megatron-core`, `kernels.CORE_KERNELS`): the attention core by a causal flash
  kernel's executed FLOPs at its own measured rates, context parallelism by an exposed K/V all-gather, and
  the distributed optimizer's reduce-scatter overlapped with the backward also under a pipeline.
  `kernels.DEEPSEEK_KERNELS` (DeepSeek-V3's stack): the layers' GEMMs at DeepGEMM's FP8 rates (`fp8`), compute
  on the SMs the communication kernels leave, node-limited routing with FP8 dispatch, and DualPipe (the
  all-to-all and transfers behind the compute as far as it lasts, its own bubble).
- sliding windows (`windows`): a sliding layer's attention core counts s x min(s, w), not s x s.
- linear attention (`linear_attention`, Qwen3-Next and Qwen3.5's Gated DeltaNet layers): no attention core; the
  FLOP count has their recurrence instead (selective recomputation runs it again), and the K/V ring of context
  parallelism and the flash kernel's GQA passes are those of the full-attention layers only (the linear layers'
  state summaries they exchange under CP are small and not counted). Kimi Linear's KDA layers likewise; Nemotron-H
  (`layer_pattern`): the FLOPs of each block's one mixer, selective recomputation running the attention blocks'
  cores and the Mamba-2 blocks' scans again (`_pattern_selective_flops`).
- multi-token prediction (`mtp`): the last pipeline rank runs its layers and the depths; the busiest rank's
  layers set the pace.
- DeepSeek Sparse Attention (`sparse_attention`): the FLOP count has the attention over the chosen keys and the
  lightning indexers; context parallelism all-gathers whole rows of latents and indexer keys instead of the ring
  (`context.sparse_gather_seconds`).

The three calibrated constants and what they were fitted on are in `PAPER_CALIBRATION`; the Hopper constants
in `generations.HOPPER_CALIBRATION`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from shardlm.models.config import ModelConfig
from shardlm.plan import dualpipe
from shardlm.plan.context import allgather_seconds, compressed_gather_seconds, ring_seconds, sparse_gather_seconds
from shardlm.plan.experts import all_to_all_bytes, moe_layer_count
from shardlm.plan.flops import flops_per_step
from shardlm.plan.fp8 import cast_bytes_per_token, fp8_gemm_seconds, mla_up_recompute_seconds
from shardlm.plan.fsdp import FSDPUnits, fsdp_groups, fsdp_optimizer_seconds, fsdp_seconds, fsdp_units
from shardlm.plan.hardware import GPUSpec
from shardlm.plan.kernels import SC21_KERNELS, Kernels
from shardlm.plan.layout import PAPER_CALIBRATION, Calibration, Layout  # noqa: F401 (re-exported)
from shardlm.plan.linear_attention import attention_layer_share, linear_layer_count, rule_flops_per_token
from shardlm.plan.links import direction_bandwidth as _direction_bandwidth
from shardlm.plan.links import over_dp_group as _over_dp_group
from shardlm.plan.links import ring_allreduce_seconds
from shardlm.plan.memory import NumericFormat
from shardlm.plan.mtp import busiest_rank_layers
from shardlm.plan.parameters import ParameterCount
from shardlm.plan.stages import bubble_fraction
from shardlm.plan.windows import key_share

# Bytes per attention score of the unfused softmax + dropout: forward reads the fp16 scores and
# writes the probabilities (4), dropout reads them, writes the result and a 1-byte mask (5), the
# next GEMM reads them... (2); backward the mirror image (11).
SCORE_BYTES_FORWARD = 11
SCORE_BYTES_BACKWARD = 11

# Reads + writes of b x s x h elements per layer that every TP rank repeats (derived from the layer,
# not fitted): forward LN1 2, bias add 2, dropout 2, residual add 3, the same again after the MLP
# (18); backward: LayerNorms 3 + 3, dropouts 2 + 2, bias gradients 1 + 1, residual-gradient adds
# 3 + 3 (18); a recomputed forward repeats the 18 forward passes.
ELEMENTWISE_PASSES_FORWARD = 18
ELEMENTWISE_PASSES_BACKWARD = 18


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part."""

    compute_s: float
    elementwise_s: float
    tp_comm_s: float
    optimizer_s: float
    dp_comm_s: float
    """The whole DP all-reduce (with FSDP: every all-gather and reduce-scatter), before overlap."""
    dp_exposed_s: float
    """The part of the DP all-reduce (FSDP's collectives) not hidden behind the compute."""
    model_flops: float
    """Matmul FLOPs of the step (`flops_per_step`, recomputed forwards included when checkpointing)."""
    bubble_s: float = 0.0
    """Pipeline flush: (P - 1) / (V m) of the rank's compute, elementwise and TP time."""
    p2p_s: float = 0.0
    """Point-to-point transfers between pipeline stages on the critical path."""
    ep_comm_s: float = 0.0
    """All-to-all of the MoE layers (dispatch and combine), not overlapped."""
    cp_comm_s: float = 0.0
    """The context-parallel ring's K/V transfers not hidden behind the attention blocks."""
    cp_ring_s: float = 0.0
    """The whole ring transfer time, before overlap."""
    muon_s: float = 0.0
    """Muon's step beyond AdamW's (`shardlm.plan.muon.muon_cost`): its collectives and Newton-Schulz iterations."""

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.elementwise_s + self.tp_comm_s + self.ep_comm_s + self.cp_comm_s + self.bubble_s
                + self.p2p_s + self.optimizer_s + self.dp_exposed_s + self.muon_s)

    def tflops_per_gpu(self, gpus: int) -> float:
        return self.model_flops / self.total_s / gpus / 1e12


def tp_comm_seconds(cfg: ModelConfig, layout: Layout, gpu: GPUSpec, fmt: NumericFormat,
                    calibration: Calibration, layers: int | None = None) -> float:
    """TP all-reduce time of one micro-batch (forward + backward [+ recomputation]) over `layers` layers (default
    ceil(L / P))."""
    if layout.tp == 1:
        return 0.0
    intra, _ = _direction_bandwidth(gpu, calibration)
    tokens = layout.micro_batch * cfg.seq_length
    layers = layers or -(-cfg.num_layers // layout.pp)
    forward_calls = 2 * layers * (2 if layout.checkpointing else 1)
    calls = ((tokens * cfg.hidden_size * fmt.tp_forward_bytes, forward_calls),
             (tokens * cfg.hidden_size * fmt.tp_backward_bytes, 2 * layers + 1),  # layers + LM head
             (tokens * cfg.hidden_size * fmt.residual_bytes, 1),  # embedding
             (tokens * 4, 1), (2 * tokens * 4, 1))  # cross-entropy MAX and SUM
    return sum(count * ring_allreduce_seconds(n, layout.tp, intra, calibration.intra_node_latency_s)
               for n, count in calls)


def p2p_seconds(cfg: ModelConfig, layout: Layout, gpu: GPUSpec, fmt: NumericFormat, calibration: Calibration,
                scatter_gather: bool = False) -> float:
    """Point-to-point time of one micro-batch on one pipeline rank: b s h activations (forward dtype)
    sent forward and their gradients backward across each of its V stage boundaries. Stages are
    TP x DP ranks apart, so they sit on different servers once that fills a server: then every GPU
    sends over its share of the node's network (the SC21 servers have one 200 Gb/s adapter per GPU).
    `scatter_gather` (Megatron): each TP rank sends 1/t of the tensor and the receivers all-gather it
    over NVLink; shardlm's TP ranks each send the whole tensor."""
    if layout.pp == 1:
        return 0.0
    intra, inter = _direction_bandwidth(gpu, calibration)
    nbytes = layout.micro_batch * cfg.seq_length * cfg.hidden_size * fmt.tp_forward_bytes
    across = layout.tp * layout.dp >= gpu.gpus_per_node
    bandwidth = inter / gpu.gpus_per_node if across else intra
    latency = calibration.inter_node_latency_s if across else calibration.intra_node_latency_s
    one = (nbytes / layout.tp if scatter_gather else nbytes) / bandwidth + latency
    if scatter_gather and layout.tp > 1:
        one += (layout.tp - 1) / layout.tp * nbytes / intra + (layout.tp - 1) * calibration.intra_node_latency_s
    return 2 * layout.virtual * one


def all_to_all_seconds(cfg: ModelConfig, layout: Layout, gpu: GPUSpec, fmt: NumericFormat,
                       calibration: Calibration, moe_layers: int | None = None,
                       kernels: Kernels = SC21_KERNELS) -> float:
    """All-to-all time of one micro-batch on one pipeline rank (ceil(MoE layers / P) layers): each MoE
    layer dispatches and combines forward, sends both gradients back in the backward, and dispatches and
    combines again when recomputing (full); bytes from `experts.all_to_all_bytes`. An EP group is E ranks
    TP apart: on NVLink while TP x E GPUs fit in a node. Beyond, the rows bound for other nodes travel on
    this GPU's share (1 / gpus_per_node) of the node's network, since every GPU of the node exchanges at
    once, and the rest on NVLink; the slower bounds each exchange, plus (E - 1) latencies."""
    if layout.ep == 1 or not cfg.moe_num_experts:
        return 0.0
    intra, inter = _direction_bandwidth(gpu, calibration)
    ep = layout.ep
    local = min(ep, max(1, gpu.gpus_per_node // layout.tp))  # EP ranks of the group in this rank's node
    remote = (ep - local) / (ep - 1)

    def seconds(nbytes: float) -> float:
        if remote == 0:
            return nbytes / intra + (ep - 1) * calibration.intra_node_latency_s
        network = nbytes * remote / (inter / gpu.gpus_per_node)
        return max(nbytes * (1 - remote) / intra, network) + (ep - 1) * calibration.inter_node_latency_s

    dispatch, combine = all_to_all_bytes(cfg, layout.micro_batch, ep, fmt)
    if kernels.moe_dispatch_bytes:
        dispatch *= kernels.moe_dispatch_bytes / fmt.residual_bytes
    if kernels.node_limited_routing and remote:
        return node_limited_seconds(cfg, layout, gpu, calibration, kernels, dispatch, combine, moe_layers)
    passes = 3 if layout.checkpointing else 2  # forward, backward (+ recomputed forward)
    layers = moe_layers or -(-moe_layer_count(cfg) // layout.pp)
    return layers * passes * (seconds(dispatch) + seconds(combine))


def node_limited_seconds(cfg: ModelConfig, layout: Layout, gpu: GPUSpec, calibration: Calibration, kernels: Kernels,
                         dispatch: float, combine: float, moe_layers: int | None) -> float:
    """`all_to_all_seconds` under node-limited routing (`Kernels.node_limited_routing` = M): the EP group spans
    n = TP x E / gpus_per_node nodes; a token's experts lie on min(M, n) of them, each remote with probability
    (n - 1) / n, and it crosses this GPU's share of the network once per remote target node; NVLink carries its
    k copies to the experts (`dispatch` and `combine` are the bytes of those k copies, (E - 1) / E of them remote
    ranks'). The slower link bounds each exchange."""
    intra, inter = _direction_bandwidth(gpu, calibration)
    nodes = -(-layout.tp * layout.ep // gpu.gpus_per_node)
    copies = cfg.moe_top_k * (layout.ep - 1) / layout.ep
    network_share = min(kernels.node_limited_routing, nodes) * (nodes - 1) / nodes / copies

    def seconds(nbytes: float) -> float:
        network = nbytes * network_share / (inter / gpu.gpus_per_node)
        return max(nbytes / intra, network) + (layout.ep - 1) * calibration.inter_node_latency_s

    passes = 3 if layout.checkpointing else 2
    layers = moe_layers or -(-moe_layer_count(cfg) // layout.pp)
    return layers * passes * (seconds(dispatch) + seconds(combine))


def _reduction_seconds(elements: int, ranks: int, stride: int, layout: Layout, gpu: GPUSpec, fmt: NumericFormat,
                       calibration: Calibration) -> float:
    """Ring all-reduce of `elements` gradients over `ranks` ranks `stride` apart (a node hosts
    gpus_per_node / stride of them and `stride` such groups at once; a group that spans nodes puts
    each group's 2 (p-1)/p x bytes on the node's network). With the distributed optimizer: a
    reduce-scatter of the gradients and an all-gather of the parameters, each half the traffic."""
    if ranks == 1:
        return 0.0
    grad_bytes = elements * fmt.grad_bytes
    if layout.distributed_optimizer:
        grad_bytes = elements * (fmt.grad_bytes + fmt.weight_bytes) / 2
    return _over_dp_group(ring_allreduce_seconds, grad_bytes, ranks, stride, gpu, calibration)


def dp_comm_seconds(params: ParameterCount, layout: Layout, gpu: GPUSpec, fmt: NumericFormat,
                    calibration: Calibration) -> float:
    """Gradient all-reduce over the DP group (ring, its ranks TP apart), limited by NVLink or by the
    node's network (`_reduction_seconds`). Under expert parallelism the routed experts' gradients
    (`params.expert`) are reduced over their DP x CP / E expert-DP ranks (TP x E apart) after the dense ones."""
    if layout.ep == 1 or not params.expert:  # over DP x CP (ranks TP apart) with context parallelism
        return _reduction_seconds(params.total, layout.dp * layout.cp, layout.tp, layout, gpu, fmt, calibration)
    ranks = layout.dp * layout.cp  # EP folds over DP x CP: expert-DP is DP x CP / E ranks, TP x E apart
    return (_reduction_seconds(params.dense, ranks, layout.tp, layout, gpu, fmt, calibration)
            + _reduction_seconds(params.expert, ranks // layout.ep, layout.tp * layout.ep, layout, gpu, fmt,
                                 calibration))


def context_ring_seconds(cfg: ModelConfig, layout: Layout, gpu: GPUSpec, fmt: NumericFormat,
                         calibration: Calibration, kernels: Kernels = SC21_KERNELS) -> tuple[float, float]:
    """(exposed, total) ring seconds of one layer and micro-batch (`shardlm.plan.context.ring_seconds`) on
    `cfg`'s full sequence: NVLink while the CP group's TP x C GPUs fit in a server, else this GPU's share of
    the node's network. With `kernels.cp_allgather`: Llama 3's exposed all-gather (`context.allgather_seconds`).
    Sparse attention's all-gathers of whole rows (`context.sparse_gather_seconds`), whatever the kernels, replace
    the ring, or in the dense warm-up come on top of it; DeepSeek-V4's (`context.compressed_gather_seconds`) replace
    it."""
    if layout.cp == 1:
        return 0.0, 0.0
    intra, inter = _direction_bandwidth(gpu, calibration)
    across = layout.tp * layout.cp > gpu.gpus_per_node
    bandwidth = inter / gpu.gpus_per_node if across else intra
    latency = calibration.inter_node_latency_s if across else calibration.intra_node_latency_s
    if cfg.hc_mult:  # DeepSeek-V4: the all-gather of the keys' projections, no ring
        gathers = compressed_gather_seconds(cfg, layout.cp, layout.micro_batch, fmt.matmul_bytes,
                                            layout.checkpointing, bandwidth, latency)
        return gathers, gathers
    gathers = 0.0
    if cfg.index_topk and cfg.attention == "mla":
        gathers = sparse_gather_seconds(cfg, layout.cp, layout.micro_batch, fmt.matmul_bytes, layout.checkpointing,
                                        bandwidth, latency)
        if cfg.index_stage != "warmup":  # no ring: every layer attends to gathered rows
            return gathers, gathers
    if kernels.cp_allgather:
        exposed = allgather_seconds(cfg, layout.cp, layout.tp, layout.micro_batch, fmt.matmul_bytes,
                                    layout.checkpointing, bandwidth, latency)
        return exposed + gathers, exposed + gathers
    flops_per_s = gpu.peak_tflops * 1e12 * calibration.compute_efficiency
    exposed, total = ring_seconds(cfg, layout.cp, layout.tp, layout.micro_batch, fmt.matmul_bytes,
                                  layout.checkpointing, bandwidth, latency, flops_per_s)
    return exposed + gathers, total + gathers


def optimizer_bytes_per_parameter(fmt: NumericFormat, dp_shards: int = 1) -> float:
    """Bytes streamed per parameter per step: AdamW reads weight, gradient and both moments and
    writes weight and moments (7 x 4); clipping reads the gradient for the norm and scales it
    (3 x grad); mixed precision also writes the half weight copy. With the optimizer sharded over
    `dp_shards` ranks, AdamW touches 1/dp_shards of the parameters."""
    half_copy = fmt.weight_bytes if fmt.weight_bytes != 4 else 0
    return (7 * 4 + half_copy) / dp_shards + 3 * fmt.grad_bytes


def _changed(cfg: ModelConfig, **changes) -> ModelConfig:
    """`dataclasses.replace` without running `__init__` over the config's 150 fields again (ModelConfig has no
    `__post_init__`): the planner builds two such copies for each of the tens of thousands of layouts it scores."""
    out = copy.copy(cfg)
    out.__dict__.update(changes)
    return out


def _pattern_selective_flops(cfg: ModelConfig, global_batch: int) -> float:
    """What selective recomputation runs again in Nemotron-H (`layer_pattern`) for the step's B sequences of s
    tokens: each attention block's core, QK^T and attention x V (4 s a per token, a = heads x head_dim), and each
    Mamba-2 block's chunked scan (`recurrent.ssd_flops_per_token`: `Mamba2.core` is recomputed)."""
    from shardlm.plan.recurrent import mamba_layer_count, ssd_flops_per_token

    s, a = cfg.seq_length, cfg.num_heads * cfg.attention_head_dim
    per_token = 4 * s * a * cfg.layer_pattern.count("*") + ssd_flops_per_token(cfg) * mamba_layer_count(cfg)
    return global_batch * s * per_token


def _remembered(memo: dict | None, key: tuple, compute):
    """`compute()`, kept in `memo` under `key` (computed each time without a memo)."""
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _step_flops(full_sequence: ModelConfig, cfg: ModelConfig, padded: ModelConfig, layout: Layout,
                global_batch: int) -> float:
    """Matmul FLOPs of one step of `global_batch` sequences on `layout`: the model's (`padded`: its vocabulary padded
    for the TP size; sliding layers count s x w) and what the layout's recomputation runs again (`cfg`: a CP rank's)."""
    flops = flops_per_step(padded, global_batch, recompute=layout.checkpointing)
    if layout.recompute == "selective" and cfg.layer_pattern:
        flops += _pattern_selective_flops(full_sequence, global_batch)
    elif layout.recompute == "selective":  # QK^T and attention x V again: 4 b s^2 h per layer (s x w when sliding;
        # none on a linear-attention layer, which runs its recurrence again)
        flops += (4 * global_batch * full_sequence.seq_length ** 2 * cfg.hidden_size * cfg.num_layers
                  * key_share(full_sequence))
        flops += global_batch * full_sequence.seq_length * rule_flops_per_token(cfg) * linear_layer_count(cfg)
    return flops


def step_time(cfg: ModelConfig, layout: Layout, global_batch: int, gpu: GPUSpec, fmt: NumericFormat,
              params: ParameterCount, calibration: Calibration, attention_scores: bool = False,
              scatter_gather: bool = False, units: FSDPUnits | None = None, kernels: Kernels = SC21_KERNELS,
              memo: dict | None = None) -> StepTime:
    """Predicted time of one optimizer step of `global_batch` sequences on `layout`; `params` are the
    busiest rank's (the first pipeline stage's). `attention_scores`: the implementation materializes
    the s x s attention scores (Megatron 2021); `scatter_gather`: Megatron's pipeline transfers. `units`: with
    FSDP, the FSDP units of the rank `params` describe (None: the whole model's, `fsdp.fsdp_units`). `memo`: a
    dict kept across the calls of one `cfg` (a planner's tens of thousands of layouts), in which the FLOPs and the
    busiest rank's layers, which depend on a few of the layout's sizes only, are counted once each."""
    accumulation = global_batch // (layout.dp * layout.micro_batch)
    full_sequence, cfg = cfg, _changed(cfg, seq_length=cfg.seq_length // layout.cp)  # a CP rank's tokens
    padded = _changed(full_sequence, vocab_size=cfg.padded_vocab_size(layout.tp))
    flops = _remembered(memo, ("flops", layout.cp, layout.tp, layout.checkpointing, layout.recompute, global_batch),
                        lambda: _step_flops(full_sequence, cfg, padded, layout, global_batch))
    # per pipeline rank: the busiest holds ceil(L / P) layers, (L + 2) / P with Llama 3's short end stages, and
    # the last one its layers plus the multi-token-prediction depths (`mtp.busiest_rank_layers`)
    if kernels.dualpipe and layout.pp > 1:  # a rank runs half the micro-batches through each of its two stages
        layers, moe_layers, imbalance = dualpipe.pace(full_sequence, layout.pp)
    else:
        layers, moe_layers = _remembered(
            memo, ("layers", layout.pp, layout.virtual, layout.end_trim, layout.v_shaped),
            lambda: busiest_rank_layers(cfg, layout.pp, layout.virtual, layout.end_trim, layout.v_shaped))
        imbalance = layers * layout.pp / (cfg.num_layers + cfg.mtp_layers)  # 1 when P divides the layers
    peak = gpu.peak_tflops * 1e12
    compute = flops / (peak * calibration.compute_efficiency)
    if kernels.causal_skip:  # the attention core by the flash kernel's own FLOPs and rates
        gemm = calibration.compute_efficiency
        counted = kernels.counted_attention_flops(full_sequence, global_batch, layout.checkpointing)
        compute -= counted / (peak * gemm)
        compute += kernels.attention_seconds(full_sequence, global_batch, layout.checkpointing, peak,
                                             calibration.attention_efficiency or gemm,
                                             calibration.attention_backward_efficiency or gemm)
    if kernels.fp8_gemms:  # the layers' GEMMs at DeepGEMM's FP8 rates instead of the BF16 GEMM rate (`fp8`)
        bf16_s, fp8_s = fp8_gemm_seconds(full_sequence, global_batch * full_sequence.seq_length, layout.checkpointing,
                                         peak * calibration.compute_efficiency)
        compute += fp8_s - bf16_s
        if kernels.recompute_mla_up and not layout.checkpointing:  # full recomputation reruns them anyway
            compute += mla_up_recompute_seconds(full_sequence, global_batch * full_sequence.seq_length)
    compute *= imbalance / layout.gpus / kernels.compute_sm_share

    passes = ELEMENTWISE_PASSES_FORWARD * (2 if layout.checkpointing else 1) + ELEMENTWISE_PASSES_BACKWARD
    tokens = layout.micro_batch * cfg.seq_length
    split = layout.tp if layout.sequence_parallel else 1
    elementwise_bytes = passes * layers * tokens * cfg.hidden_size * fmt.residual_bytes / split
    if attention_scores:
        scores = layout.micro_batch * cfg.num_heads // layout.tp * full_sequence.seq_length * cfg.seq_length
        recomputed = layout.recompute != "none"
        elementwise_bytes += layers * scores * (SCORE_BYTES_FORWARD * (2 if recomputed else 1) + SCORE_BYTES_BACKWARD)
    # the rank's layers that attend over keys (not linear ones)
    attending = layers * _remembered(memo, ("attention share",), lambda: attention_layer_share(cfg))
    elementwise_bytes += attending * kernels.gqa_expanded_bytes(full_sequence, layout.tp, layout.micro_batch,
                                                               layout.cp, fmt.matmul_bytes)
    hbm = gpu.hbm_gbps * 1e9 * calibration.memory_efficiency
    elementwise = accumulation * elementwise_bytes / hbm
    if kernels.fp8_storage:  # the casts around the FP8 GEMMs: the step's tokens split over the GPUs as its FLOPs
        # are (a TP rank casting whole inputs, or a recomputed forward casting again, is not counted), at the pace
        cast_tokens = global_batch * full_sequence.seq_length * imbalance / layout.gpus
        elementwise += cast_tokens * cast_bytes_per_token(full_sequence) / hbm

    tp_comm = accumulation * tp_comm_seconds(cfg, layout, gpu, fmt, calibration, layers)
    ep_comm = accumulation * all_to_all_seconds(cfg, layout, gpu, fmt, calibration, moe_layers, kernels)
    cp_exposed, cp_ring = (accumulation * attending * t for t in context_ring_seconds(full_sequence, layout, gpu, fmt,
                                                                                      calibration, kernels))
    p2p = accumulation * p2p_seconds(cfg, layout, gpu, fmt, calibration, scatter_gather)
    fraction = bubble_fraction(layout.pp, layout.virtual, accumulation, layout.schedule, layout.checkpointing)
    if kernels.dualpipe:  # all-to-all and transfers behind the other chunk's compute, as far as it lasts
        ep_comm, p2p = max(0.0, ep_comm + p2p - compute - elementwise), 0.0
        fraction = dualpipe.bubble_fraction(layout.pp, accumulation)
    bubble = fraction * (compute + elementwise + tp_comm + ep_comm + cp_exposed)
    shards = layout.dp * layout.cp if layout.distributed_optimizer else 1
    expert_shards = layout.dp * layout.cp // layout.ep if layout.distributed_optimizer and params.expert else shards
    optimizer = (params.dense * optimizer_bytes_per_parameter(fmt, shards)
                 + params.expert * optimizer_bytes_per_parameter(fmt, expert_shards)) / hbm

    backward_share = 3 / 4 if layout.checkpointing else 2 / 3  # (recompute +) backward of fwd+bwd FLOPs
    if layout.full_sharding:  # FSDP: per-layer gathers and reduce-scatters instead of the gradient all-reduce
        units = units or fsdp_units(full_sequence, layout.tp, ep=layout.ep)
        optimizer = fsdp_optimizer_seconds(units, layout, hbm)
        head_flops = 6 * global_batch * full_sequence.seq_length * cfg.hidden_size * padded.vocab_size
        layer_s = (compute * (1 - head_flops / flops) + elementwise + tp_comm) / (accumulation * layers)
        dp_exposed, dp_comm = fsdp_seconds(
            units, accumulation, fmt.weight_bytes, fsdp_groups(layout, gpu, calibration),
            (1 - backward_share) * layer_s, backward_share * layer_s, calibration.dp_overlap,
            reduce_after_flush=layout.pp > 1)
    else:
        dp_comm = dp_comm_seconds(params, layout, gpu, fmt, calibration)
        last_backward = backward_share * (compute + elementwise + tp_comm + ep_comm + cp_exposed) / accumulation
        hidden = 0.0 if layout.pp > 1 and not kernels.dp_overlap_pipeline else min(calibration.dp_overlap * dp_comm,
                                                                                      last_backward)
        dp_exposed = dp_comm - hidden
    return StepTime(compute_s=compute, elementwise_s=elementwise, tp_comm_s=tp_comm, optimizer_s=optimizer,
                    dp_comm_s=dp_comm, dp_exposed_s=dp_exposed, model_flops=flops, bubble_s=bubble,
                    p2p_s=p2p, ep_comm_s=ep_comm, cp_comm_s=cp_exposed, cp_ring_s=cp_ring)
