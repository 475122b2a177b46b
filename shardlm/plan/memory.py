"""Per-rank memory of shardlm's GPT: gradients, optimizer state and activations (the parameters each rank holds
are `plan.parameters`'s).

Everything is derived from the code, not from rules of thumb:

- state bytes per parameter: shardlm keeps fp32 parameters, fp32 gradients (DDP buckets are the
  gradients) and AdamW's two fp32 moments plus one fp32 `step` scalar per tensor, in every
  precision (autocast only changes activations): 4 + 4 + 8 bytes. Megatron's mixed precision
  (the paper's implementation) keeps half-precision weights and gradients, an fp32 master copy and
  the two moments: 2 + 2 + 12 bytes;
- activations: exactly what autograd saves in shardlm's transformer layer for one micro-batch
  (listed in `layer_activation_bytes`), assuming a fused SDPA kernel (flash / memory-efficient:
  q, k, v, the output and the fp32 log-sum-exp; dropout masks regenerated from the RNG) of a dense
  layer; `experts.moe_layer_activation_bytes` has the MoE layer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.config import ModelConfig
from shardlm.plan.formats import (  # noqa: F401 (re-exported: callers name them here)
    IMPLEMENTATIONS,
    PARAM_DTYPES,
    PRECISIONS,
    NumericFormat,
    numeric_format,
)
from shardlm.plan.muon import MuonCount, MuonPart
from shardlm.plan.parameters import ParameterCount, _kv_rows, _mla_count

GB = 1e9


@dataclass(frozen=True)
class StateMemory:
    """Bytes of parameters, gradients and optimizer state on one rank."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def __add__(self, other: StateMemory) -> StateMemory:
        return StateMemory(self.parameters + other.parameters, self.gradients + other.gradients,
                           self.optimizer + other.optimizer)


def state_memory(params: ParameterCount, fmt: NumericFormat, dp: int = 1, distributed_optimizer: bool = False,
                 dp_rank: int | None = None, sizes: list[int] | None = None, ep: int = 1,
                 muon: MuonCount | None = None) -> StateMemory:
    """Per-rank bytes of weights, gradients and optimizer state (AdamW; with `muon`, Muon for those matrices).

    shardlm with half parameters or the distributed optimizer (`training.master_weights`) keeps flat
    parameter and fp32 gradient buffers of all N elements padded to a multiple of d (d = dp with the
    distributed optimizer, else 1); a rank's optimizer covers its N/d range: fp32 master weights (half
    parameters only), AdamW's two moments of the real elements in the range and one 4-byte step per
    parameter segment in it. So 18 -> 6 + 12/d bytes per parameter with half weights. `sizes` (the
    parameter tensors' element counts in order) and `dp_rank` make the segment count exact; without
    them the rank is the first and the segments are estimated as tensors / d + 1.

    Expert parallelism (`ep` = E > 1): the routed experts' `params.expert` elements (already 1/E of
    them, see `parameter_count`) form a second set of buffers (`JointMasterOptimizer`) whose
    optimizer state the distributed optimizer shards over the DP / E expert-DP ranks instead of DP;
    `sizes` then describe the dense buffer. Without the distributed optimizer nothing is sharded.

    Muon (`muon`, `plan.muon.muon_count` of the rank's layers): its matrices are buffers of their own (shardlm's
    `parallelize._master_weights`: per set, AdamW's rest and Muon's matrices) whose state is one fp32 momentum
    per element, no step (`fmt.optimizer_bytes` - 4 a parameter); `sizes` then describe the dense AdamW buffer.
    """
    expert_dp = dp // ep
    muon = muon or MuonCount()
    if not params.expert or ep == 1:  # one set of buffers (shardlm splits the experts' off only at EP > 1)
        return _state_set(params.total, params.tensors, fmt, dp, distributed_optimizer, dp_rank, sizes, muon.total)
    dense_tensors = params.tensors - muon.expert.tensors if sizes is None else len(sizes) + muon.dense.tensors
    dense = _state_set(params.dense, dense_tensors, fmt, dp, distributed_optimizer, dp_rank, sizes, muon.dense)
    return dense + _state_set(params.expert, 1 + muon.expert.tensors, fmt, expert_dp, distributed_optimizer,
                              None, None, muon.expert)


def _state_set(n: int, tensors: int, fmt: NumericFormat, dp: int, distributed_optimizer: bool,
               dp_rank: int | None, sizes: list[int] | None, muon: MuonPart) -> StateMemory:
    """One set of buffers (dense, or split experts): AdamW's part of its n elements in `tensors` tensors and, when
    `muon` has elements, Muon's matrices among them (their own buffers)."""
    adamw = _state_part(n - muon.elements, tensors - muon.tensors, fmt, dp, distributed_optimizer, dp_rank, sizes)
    if not muon.elements:
        return adamw
    return adamw + _state_part(muon.elements, muon.tensors, fmt, dp, distributed_optimizer, dp_rank, None,
                               momentum_only=True)


def _state_part(n: int, tensors: int, fmt: NumericFormat, dp: int, distributed_optimizer: bool,
                dp_rank: int | None, sizes: list[int] | None, momentum_only: bool = False) -> StateMemory:
    """`state_memory` of n elements in `tensors` tensors whose state is sharded over `dp` ranks; `momentum_only`:
    Muon's one fp32 momentum per element instead of AdamW's two moments, and no step scalars."""
    if n == 0:  # no such buffer (split experts that are all Muon matrices)
        return StateMemory(0, 0, 0)
    moments = 4 if momentum_only else 8
    step_scalars = 4 * tensors if fmt.adam_step_scalar and not momentum_only else 0
    if not (fmt.name.startswith("shardlm") and (fmt.weight_bytes == 2 or distributed_optimizer)):
        optimizer_elements = -(-n // dp) if distributed_optimizer else n
        return StateMemory(parameters=n * fmt.weight_bytes, gradients=n * fmt.grad_bytes,
                           optimizer=optimizer_elements * (fmt.optimizer_bytes - 8 + moments) + step_scalars)
    d = dp if distributed_optimizer else 1
    padded = -(-n // d) * d
    lo = (dp_rank or 0) * padded // d
    hi = lo + padded // d
    if sizes is not None:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        segments = sum(1 for start, size in zip(starts, sizes) if max(start, lo) < min(start + size, hi))
    else:
        segments = min(tensors, tensors // d + 1)
    master = 4 * padded // d if fmt.weight_bytes == 2 else 0
    steps = 0 if momentum_only else 4 * segments
    return StateMemory(parameters=fmt.weight_bytes * padded, gradients=4 * padded,
                       optimizer=master + moments * max(0, min(hi, n) - lo) + steps)


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes one rank keeps for the backward pass of one micro-batch."""

    per_layer: int
    """What one transformer layer saves (also what a checkpointed layer rebuilds in its backward)."""
    layer_input: int
    """A layer's input: all that a checkpointed layer keeps until its backward."""
    outside_layers: int
    """Embedding, final LayerNorm, LM head and cross-entropy."""
    transient: int
    """Not saved but alive at the end of the forward pass (0: the fused loss turns the logits into their
    gradient, which it saves)."""
    num_layers: int
    embedding: int = 0
    """The part of `outside_layers` the first pipeline stage saves (token ids, embedding dropout mask);
    the rest (final LayerNorm, LM head, loss) is the last stage's."""

    def stored(self, checkpointing: bool) -> int:
        """Saved bytes held between the forward and the backward pass."""
        layers = self.layer_input if checkpointing else self.per_layer
        return self.num_layers * layers + self.outside_layers

    def peak(self, checkpointing: bool) -> int:
        """Most saved bytes alive at once: with checkpointing, the kept layer inputs plus one layer
        being recomputed (its input is already among the kept ones)."""
        if not checkpointing:
            return self.stored(False)
        return self.stored(True) + self.per_layer - self.layer_input


def _mask_bytes(cfg: ModelConfig, fmt: NumericFormat, backend: str) -> int:
    """Bytes per element of a residual dropout mask: CUDA's fused dropout saves a bool mask, the CPU
    kernel saves the scaled mask in the input's dtype; no mask without dropout."""
    if cfg.dropout <= 0:
        return 0
    return 1 if backend == "cuda" else fmt.residual_bytes


def norm_normalized_bytes(input_bytes: int, backend: str) -> int:
    """Bytes per element of the normalized values a weighted RMSNorm saves for its weight's gradient, beside its
    input and fp32 statistic, for an input of `input_bytes` bytes per element as `shardlm.models.norms.rms_norm`
    receives it. 0 on CUDA (the fused `F.rms_norm` saves x, the statistic and the weight) and on the CPU for an
    fp32 input (shardlm's own RMSNorm saves the same). 4 on the CPU for a half input, which takes `F.rms_norm`'s
    unfused composite: it upcasts x (autocast or not) and saves the fp32 normalized values the weight multiplies,
    and that fp32 copy of x in place of x (counted where autocast makes the copy anyway, the q/k and latent norms'
    inputs; with half parameters on the CPU the block norms' copies are counted at x's 2 bytes). Batch-invariant
    runs take the composite in fp32 too (not modelled)."""
    return 0 if backend == "cuda" or input_bytes == 4 else 4


def layer_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                           backend: str = "cuda") -> int:
    """Bytes autograd saves in one `TransformerBlock` forward on one TP rank (b = micro_batch, s, h,
    a heads, f = ffn, t = tp):

      replicated over TP (b s h elements each):  LN1 input, LN2 input (residual dtype);
          LN1 and LN2 outputs as saved by the QKV and fc GEMMs (GEMM dtype); 2 dropout masks;
      split over TP:  QKV output 3 b s h/t, SDPA output b s h/t (also the output projection's input:
          the kernel's (b, s, a, d) layout makes the reshape a view), fc output and GeLU output
          2 x b s f/t, all in the GEMM dtype;
      small: LayerNorm mean and rstd 2 x 2 b s fp32, SDPA log-sum-exp b a/t s fp32;
      autocast: the half copies of this rank's four GEMM weights.
    """
    if cfg.attention_dropout_p > 0 and backend != "cuda":
        raise ValueError("attention dropout on CPU runs the unfused SDPA (it saves s x s matrices); "
                         "measure with model.attention_dropout=0")
    h, f, b, s = cfg.hidden_size, cfg.ffn_size, micro_batch, cfg.seq_length
    tokens = b * s
    replicated = tokens * h * (2 * fmt.residual_bytes + 2 * fmt.matmul_bytes + 2 * _mask_bytes(cfg, fmt, backend))
    if cfg.arch == "llama" and cfg.attention == "mla":
        return replicated + mla_activation_bytes(cfg, tp, micro_batch, fmt, backend)
    if cfg.arch == "llama":
        # SwiGLU's gate, silu(gate), up and their product (4 f/t); one fp32 RMSNorm stat per token and norm, and
        # each norm's normalized values where it saves them (`norm_normalized_bytes`: on the CPU for half inputs
        # only); zero-centred norms (Qwen3-Next) normalize x.float() with the weight 1 + w folded in: they save that
        # fp32 copy (in place of a half x) and the 1 + w vector, no normalized values; the attention's share is
        # `attention_activation_bytes` (a linear-attention layer's: `linear_attention.linear_activation_bytes`,
        # `activations.shardlm_memory`)
        mlp = tokens * 4 * f // tp * fmt.matmul_bytes + fmt.weight_cast_bytes * 3 * f * h // tp
        if cfg.norm_zero_centered:
            norms = 2 * tokens * (4 + h * (4 - fmt.residual_bytes)) + 2 * h * 4
        else:
            norms = 2 * tokens * (4 + h * norm_normalized_bytes(fmt.residual_bytes, backend))
        return replicated + norms + mlp + attention_activation_bytes(cfg, tp, micro_batch, fmt, backend)
    split = tokens * (4 * h // tp + 2 * f // tp) * fmt.matmul_bytes
    small = 2 * 2 * tokens * 4 + b * (cfg.num_heads // tp) * s * 4
    weights = fmt.weight_cast_bytes * (4 * h * h + 2 * f * h) // tp
    return replicated + split + small + weights


def attention_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                               backend: str = "cuda") -> int:
    """What a Llama layer's grouped-query attention saves for one micro-batch on one TP rank beyond its input norm's
    output (a = the rank's heads x head_dim, kv = its KV heads' rows, GEMM dtype unless named): SDPA's rotated q
    and k, v and its output (2 a + 2 kv per token; the kernel's (b, s, heads, d) layout makes the output projection's
    input a view), its fp32 log-sum-exp (one per head), RoPE's cos and sin (s x the rotated channels each, cast for
    q and for k under autocast; the rotation's inputs are not saved, the angles need no gradient) and autocast's
    copies of q, k, v and o.
    Qwen3-Next's output gate (`attention_output_gate`): sigmoid(gate) and the gated output o reads (2 a). q/k
    RMSNorm (`qk_norm`): the norms' inputs (q's projection output, gate rows included, and k's; under autocast, and
    zero-centred in half precision, their fp32 copies of q and k), an fp32 statistic per head and token, the 1 + weight
    vectors of zero-centred norms (folded into the norm, which then saves no normalized values) and the normalized
    values of plain ones where they save them (`norm_normalized_bytes`: on the CPU when q and k are half)."""
    b, s, h, e = micro_batch, cfg.seq_length, cfg.hidden_size, fmt.matmul_bytes
    tokens = b * s
    heads, head_dim = cfg.num_heads // tp, cfg.attention_head_dim
    a, kv = heads * head_dim, _kv_rows(cfg, tp)[1]
    q_rows = 2 * a if cfg.attention_output_gate else a
    rope = (2 if e == 4 else 4) * s * int(head_dim * cfg.rope_fraction) * e  # q's and k's own casts under autocast
    saved = tokens * (2 * a + 2 * kv) * e + b * heads * s * 4 + rope
    if cfg.rope_fraction < 1 and backend != "cuda":  # q is a concatenation: the CPU kernel's output keeps its
        saved += tokens * a * e  # (b, heads, s, d) layout, so o's input (or the gate's operand) is a copy
    saved += fmt.weight_cast_bytes * ((q_rows + a) * h + 2 * kv * h)
    if cfg.attention_output_gate:
        saved += tokens * 2 * a * e
    if cfg.qk_norm:  # zero-centred norms and autocast's run in fp32, on fp32 copies of half q and k
        in_fp32 = cfg.norm_zero_centered or fmt.weight_cast_bytes > 0
        inputs = (a + kv) * 4 if in_fp32 and e != 4 else (q_rows + kv) * e  # else the projections' outputs
        normalized = (a + kv) * norm_normalized_bytes(4 if cfg.norm_zero_centered else e, backend)
        saved += tokens * (inputs + normalized + (heads + kv // head_dim) * 4)
        saved += 2 * head_dim * 4 if cfg.norm_zero_centered else 0  # the 1 + weight vectors
    return saved


def mla_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                         backend: str = "cuda") -> int:
    """What a Llama layer with multi-head latent attention saves beyond its norms' inputs and outputs (the
    `replicated` part of `layer_activation_bytes`), per token of one micro-batch on one TP rank (H/t local
    heads, qk = qk_nope + qk_rope, r_q = q_lora_rank, r_kv = kv_lora_rank), in the GEMM dtype unless named:

      replicated (the down-projections run on every rank): q_a's output r_q (q_a_norm's input), kv_a's
          output r_kv + qk_rope (the latent c, kv_a_norm's input, is a view of it), and the normed latents
          q_a_norm(.), kv_a_norm(c) with the RoPE key, r_q + r_kv + qk_rope, one tensor that q_b and kv_b
          save; one fp32 statistic per latent norm; under autocast the norms save fp32 copies of their
          inputs instead (r_q + r_kv, 4 bytes each), and without the query's low-rank path the two GEMMs that
          read the first norm's output (q and kv_a) each save their own half copy of it (h more; q_a and kv_a
          share one: `decoder.autocast_copies`);
      split over TP: kv_b's output H/t (qk_nope + v_head_dim) (its value half is SDPA's v), SDPA's
          rotated q and k H/t qk each, its output H/t v_head_dim (o's input, a view on CUDA; a copy on the
          CPU), the log-sum-exp (fp32, one per local head); SwiGLU's four f/t;
      RoPE's fp32 cos and sin (s x qk_rope each); autocast's half copies of q_a, q_b (or q), kv_a, kv_b, o
          and the MLP's three matrices; the norms' normalized values where they save them (`norm_normalized_bytes`:
          on the CPU those of half inputs, as the latent norms' under autocast, r_q + r_kv in fp32).

    Without the query's low-rank path (r_q = 0) q's output is not saved (RoPE rebuilds q). Measured against
    autograd on the CPU in fp32 and under bf16 autocast (`tests/test_plan_deepseek.py`) with v_head_dim =
    qk_nope + qk_rope: the CPU's fused kernel needs equal head sizes (unequal ones, as DeepSeek-V3's 192 and
    128, run the unfused kernel there, which saves the s x s probabilities); on CUDA the memory-efficient
    kernel takes unequal ones."""
    b, s, f, h = micro_batch, cfg.seq_length, cfg.ffn_size, cfg.hidden_size
    tokens = b * s
    heads = cfg.num_heads // tp
    q_rank, kv_rank, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + rope
    autocast = fmt.weight_cast_bytes > 0
    # the latent norms' inputs: kv_a's output (c is a view of it) and q_a's, or under autocast, whose norms run
    # in fp32, the fp32 copies of c and q_a's output
    norm_inputs = tokens * (q_rank + kv_rank) * 4 if autocast else \
        tokens * (q_rank + kv_rank + rope) * fmt.matmul_bytes
    # without the query's low-rank path q reads the input past `f` and kv_a the input itself: each its own copy
    second_cast = tokens * h * fmt.matmul_bytes if autocast and not q_rank else 0
    latents = q_rank + kv_rank + rope
    split = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim + 2 * qk + cfg.v_head_dim) + 4 * f // tp
    norms = (2 if q_rank else 1) * tokens * 4 + 2 * tokens * 4
    lse = b * heads * s * 4
    angles = 2 * s * rope * 4
    normalized = tokens * (2 * h * norm_normalized_bytes(fmt.residual_bytes, backend)
                           + (q_rank + kv_rank) * norm_normalized_bytes(fmt.matmul_bytes, backend))
    # the CPU kernel's output keeps q's (b, H, s, d) layout (q is a concatenation), so o's input is a copy
    output_copy = 0 if backend == "cuda" else tokens * heads * cfg.v_head_dim * fmt.matmul_bytes
    weights = fmt.weight_cast_bytes * (_mla_count(cfg, tp).matrix + 3 * f * h // tp)
    return (tokens * (latents + split) * fmt.matmul_bytes + norm_inputs + second_cast + norms + lse + angles
            + normalized + output_copy + weights)


def activation_memory(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat, backend: str = "cuda",
                      rank: int | None = None) -> ActivationMemory:
    """Activation bytes of TP rank `rank` (default: the last, which holds the vocabulary padding).

    Outside the layers: token ids (int64; at TP > 1 the local ids and the out-of-range mask of the
    vocabulary-parallel lookup), the embedding dropout mask, the final LayerNorm's input and stats,
    and the output layer fused with the loss (`linear_cross_entropy`): its input in the GEMM dtype, the
    half copy of this rank's real vocabulary rows under autocast, the logits' gradient over those rows
    in the GEMM dtype and a bool mask; nothing else of the loss stays alive.
    """
    rank = tp - 1 if rank is None else rank
    h, b, s = cfg.hidden_size, micro_batch, cfg.seq_length
    tokens = b * s
    vocab_local = cfg.padded_vocab_size(tp) // tp
    ids = tokens * 8 + (tokens if tp > 1 else 0)
    embedding = ids + tokens * h * _mask_bytes(cfg, fmt, backend)
    final_norm = tokens * h * fmt.residual_bytes + 2 * tokens * 4
    real_rows = max(0, min(vocab_local, cfg.vocab_size - rank * vocab_local))
    lm_head = tokens * h * fmt.matmul_bytes + fmt.weight_cast_bytes * real_rows * h
    cross_entropy = tokens * real_rows * fmt.matmul_bytes + tokens
    return ActivationMemory(
        per_layer=layer_activation_bytes(cfg, tp, micro_batch, fmt, backend),
        layer_input=tokens * h * fmt.residual_bytes,
        outside_layers=embedding + final_norm + lm_head + cross_entropy,
        transient=0,
        num_layers=cfg.num_layers,
        embedding=embedding,
    )
