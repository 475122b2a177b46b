"""Per-rank memory of shardlm's GPT: parameters, gradients, optimizer state and activations.

Everything is derived from the code, not from rules of thumb:

- parameters: which weights `shardlm.models.gpt` splits over the TP group (fused QKV and the first
  MLP GEMM by columns, with their biases; the two residual projections by rows; the vocabulary
  embedding, tied to the LM head, by rows of the padded vocabulary) and which it replicates
  (LayerNorms, the row-parallel biases, learned positions); MoE layers' routers, experts (1/EP of
  them, split over TP) and shared experts (`_mlp_count`);
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

from dataclasses import dataclass, replace

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.plan.formats import (  # noqa: F401 (re-exported: callers name them here)
    IMPLEMENTATIONS,
    PARAM_DTYPES,
    PRECISIONS,
    NumericFormat,
    numeric_format,
)

GB = 1e9


@dataclass(frozen=True)
class ParameterCount:
    """Parameter elements held by one TP rank."""

    sharded: int
    """Elements of split weights (this rank's shard)."""
    replicated: int
    """Elements of weights every TP rank holds in full."""
    tensors: int
    """Number of parameter tensors (the optimizer keeps one `step` scalar per tensor)."""
    matrix: int
    """Elements of this rank's GEMM weights inside the layers (autocast saves half copies of them)."""
    expert: int = 0
    """Elements of routed-expert weights among `sharded` (split over TP and EP; their gradients are reduced,
    and with the distributed optimizer their state sharded, over expert-DP = DP / EP ranks, not DP)."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    @property
    def dense(self) -> int:
        """Elements of every weight that is not a routed expert's (reduced and sharded over DP)."""
        return self.total - self.expert


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise UserError(f"{what}={size} is not divisible by tensor parallel size {tp}")
    return size // tp


def _mlp_count(cfg: ModelConfig, index: int, tp: int, ep: int, gated: bool) -> ParameterCount:
    """Parameters of layer `index`'s MLP on one rank. Dense: gated (Llama) gate and up (f x h) split by
    rows and down (h x f) by columns, no biases; GPT fc (f x h + f) by rows, proj (h x f) by columns
    with its h bias replicated. MoE (`cfg.is_moe_layer`): the router (E x h, and E expert biases with
    aux-loss-free balancing) replicated; E / ep experts of width f_e, split over TP like a dense MLP
    without biases; shared experts one dense MLP of width shared x f_e."""
    h = cfg.hidden_size

    def dense(width: int) -> ParameterCount:
        f_local = _split(width, tp, "ffn size")
        if gated:
            return ParameterCount(3 * f_local * h, 0, 3, 3 * f_local * h)
        return ParameterCount(2 * f_local * h + f_local, h, 4, 2 * f_local * h)

    if not cfg.is_moe_layer(index):
        return dense(cfg.ffn_size)
    experts = cfg.moe_num_experts
    if experts % ep:
        raise UserError(f"model.moe_num_experts={experts} is not divisible by parallel.expert={ep}")
    f_local = _split(cfg.moe_ffn_size, tp, "expert ffn size")
    matrices = (3 if gated else 2) * (experts // ep) * f_local * h
    bias = experts if cfg.moe_expert_bias_rate > 0 or cfg.moe_expert_bias else 0  # as `Router` builds it
    bias += experts if cfg.moe_router_bias else 0  # gpt-oss: a bias on the gate logits
    # gpt-oss: per local expert a gate/up bias split with its columns and a down bias of h
    linear_bias = (experts // ep) * ((2 if gated else 1) * f_local + h) if cfg.moe_linear_bias else 0
    tensors = 1 + (cfg.moe_expert_bias_rate > 0 or cfg.moe_expert_bias) + cfg.moe_router_bias \
        + (3 if gated else 2) + 2 * cfg.moe_linear_bias
    count = ParameterCount(matrices + linear_bias, experts * h + bias, tensors, matrices, matrices + linear_bias)
    if cfg.moe_shared_experts:
        count = add_counts(count, dense(cfg.moe_shared_experts * cfg.moe_ffn_size))
    return count


def add_counts(a: ParameterCount, b: ParameterCount, sign: int = 1) -> ParameterCount:
    """a + sign x b, field by field."""
    return ParameterCount(a.sharded + sign * b.sharded, a.replicated + sign * b.replicated,
                          a.tensors + sign * b.tensors, a.matrix + sign * b.matrix, a.expert + sign * b.expert)


def _mlps(cfg: ModelConfig, tp: int, ep: int, gated: bool) -> ParameterCount:
    """Every layer's MLP (`_mlp_count`) on one rank, summed."""
    total = ParameterCount(0, 0, 0, 0)
    for index in range(cfg.num_layers):
        total = add_counts(total, _mlp_count(cfg, index, tp, ep, gated))
    return total


def parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of `shardlm.models.gpt.GPT` at tensor-parallel size `tp` (and expert-parallel
    size `ep`, which splits the experts of MoE layers).

    Per layer: QKV (3h x h weight + 3h bias) split by columns, the attention output projection (h x h)
    split by rows with its h bias replicated, two LayerNorms (2h each) replicated, and the MLP
    (`_mlp_count`: fc f x h + f by columns, proj h x f by rows with its bias replicated; or an MoE
    layer). Outside: the vocabulary embedding (V_padded x h, V_padded a multiple of 128 x tp) split
    by rows and tied to the LM head, positions (s x h) and the final LayerNorm replicated. arch="bert"
    counts `shardlm.models.bert.BERT`: the same layers and embeddings plus token types (2 x h), pooler
    and LM-head transform (h x h + h each), the LM-head LayerNorm, the sentence head (2 x h + 2) and
    the output bias, split like the vocabulary. Multi-token-prediction depths (`cfg.mtp_layers`) add
    `mtp.mtp_parameter_count`.
    """
    if cfg.mtp_layers:
        from shardlm.plan.mtp import mtp_parameter_count  # it counts layers through this function

        return add_counts(parameter_count(replace(cfg, mtp_layers=0), tp, ep), mtp_parameter_count(cfg, tp, ep))
    if cfg.arch == "llama":
        return _llama_parameter_count(cfg, tp, ep)
    h, layers = cfg.hidden_size, cfg.num_layers
    h_local = _split(h, tp, "hidden_size")
    vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
    matrix = 3 * h_local * h + h * h_local
    layer_sharded = matrix + 3 * h_local
    layer_replicated = 2 * h + 2 * h + h  # ln_1, ln_2, attention output bias
    sharded = layers * layer_sharded + vocab_local * h
    replicated = layers * layer_replicated + cfg.seq_length * h + 2 * h
    tensors = 8 * layers + 4
    if cfg.arch == "bert":
        sharded += vocab_local  # output-layer bias, split like the vocabulary
        replicated += 2 * h + (h * h + h) + (h * h + h) + 2 * h + (2 * h + 2)
        tensors += 10
    return add_counts(ParameterCount(sharded, replicated, tensors, layers * matrix), _mlps(cfg, tp, ep, gated=False))


def _kv_rows(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(rows of the k (or v) weight a rank holds, rows its GEMM uses) of `shardlm.models.llama`: num_kv_heads x
    head_dim split over TP when TP divides num_kv_heads, else held whole and only the heads of the rank's
    query heads used (rank 0's count)."""
    from shardlm.models.llama import kv_head_range, kv_heads_are_split

    head_dim = cfg.attention_head_dim
    first, last = kv_head_range(cfg.num_heads, cfg.kv_heads, tp, 0)
    used = (last - first) * head_dim
    return (used, used) if kv_heads_are_split(cfg.kv_heads, tp) else (cfg.kv_heads * head_dim, used)


def _mla_count(cfg: ModelConfig, tp: int) -> ParameterCount:
    """One layer's attention and two RMSNorms in `shardlm.models.mla.LatentAttention` on one TP rank (H heads,
    qk = qk_nope + qk_rope): q_a (q_lora_rank x h) with its RMSNorm (q_lora_rank) and kv_a ((kv_lora_rank +
    qk_rope) x h) with its RMSNorm (kv_lora_rank) replicated; q_b (H qk x q_lora_rank; or q, H qk x h, without
    the query's low-rank path) and kv_b (H (qk_nope + v_head_dim) x kv_lora_rank) split by rows over TP, o (h x H
    v_head_dim) by columns; the layer's two RMSNorms (h each) replicated. Its matrices sum to
    `models.config.mla_weights` at TP = 1."""
    h, q_rank, kv_rank = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    heads = _split(cfg.num_heads, tp, "num_heads")
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    sharded = heads * qk * (q_rank or h) + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * kv_rank \
        + h * heads * cfg.v_head_dim
    replicated_matrices = (q_rank * h if q_rank else 0) + (kv_rank + cfg.qk_rope_head_dim) * h
    replicated = replicated_matrices + q_rank + kv_rank + 2 * h
    tensors = (3 if q_rank else 1) + 3 + 1 + 2
    return ParameterCount(sharded, replicated, tensors, sharded + replicated_matrices)


def _llama_parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of `shardlm.models.llama.Llama`: q (a x h, a = num_heads x head_dim, h unless head_dim
    is set) split by rows, o (h x a) by columns, k and v (num_kv_heads x head_dim x h each) split or replicated
    (see `_kv_rows`), two RMSNorm weights per layer (and the q and k norms of head_dim each with qk_norm) and
    the final one replicated, the SwiGLU MLP or MoE layer (`_mlp_count`), the embedding and the untied output
    layer (V_padded x h each) split by vocabulary rows; q/k/v biases with `attention_bias` (GLM-4.5), o's bias
    (replicated) and per-head sinks (split) with `attention_output_bias` and `attention_sinks` (gpt-oss). With
    multi-head latent attention the layer's
    attention is `_mla_count`'s."""
    h, layers = cfg.hidden_size, cfg.num_layers
    if cfg.attention == "mla":
        vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
        outputs = 1 if cfg.tie_embeddings else 2
        attention = _mla_count(cfg, tp)
        attention = ParameterCount(layers * attention.sharded + outputs * vocab_local * h,
                                   layers * attention.replicated + h, layers * attention.tensors + 1 + outputs,
                                   layers * attention.matrix)
        return add_counts(attention, _mlps(cfg, tp, ep, gated=True))
    a_local = _split(cfg.num_heads * cfg.attention_head_dim, tp, "attention width")
    vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
    kv_held, kv_used = _kv_rows(cfg, tp)
    kv_split = kv_held == kv_used and cfg.kv_heads % tp == 0
    layer_sharded = 2 * a_local * h + (2 * kv_held * h if kv_split else 0)
    norms = 2 if cfg.qk_norm else 0
    layer_replicated = 2 * h + norms * cfg.attention_head_dim + (0 if kv_split else 2 * kv_held * h)
    biases = 3 if cfg.attention_bias else 0  # q (split with its heads), k and v (split or replicated as their weights)
    if biases:
        layer_sharded += a_local + (2 * kv_held if kv_split else 0)
        layer_replicated += 0 if kv_split else 2 * kv_held
    if cfg.attention_output_bias:  # o's bias, added after the row-parallel reduction: replicated
        layer_replicated += h
        biases += 1
    if cfg.attention_sinks:  # one learned logit per query head, split with the heads
        layer_sharded += _split(cfg.num_heads, tp, "num_heads")
        biases += 1
    outputs = 1 if cfg.tie_embeddings else 2
    attention = ParameterCount(sharded=layers * layer_sharded + outputs * vocab_local * h,
                               replicated=layers * layer_replicated + h,
                               tensors=(6 + norms + biases) * layers + 1 + outputs,
                               matrix=layers * (2 * a_local * h + 2 * kv_used * h))
    return add_counts(attention, _mlps(cfg, tp, ep, gated=True))


@dataclass(frozen=True)
class StateMemory:
    """Bytes of parameters, gradients and optimizer state on one rank."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def state_memory(params: ParameterCount, fmt: NumericFormat, dp: int = 1, distributed_optimizer: bool = False,
                 dp_rank: int | None = None, sizes: list[int] | None = None, ep: int = 1) -> StateMemory:
    """Per-rank bytes of weights, gradients and optimizer state (AdamW).

    shardlm with half parameters or the distributed optimizer (`training.master_weights`) keeps flat
    parameter and fp32 gradient buffers of all N elements padded to a multiple of d (d = dp with the
    distributed optimizer, else 1); a rank's optimizer covers its N/d range: fp32 master weights (half
    parameters only), AdamW's two moments of the real elements in the range and one 4-byte step per
    parameter segment in it. So 18 -> 6 + 12/d bytes per parameter with half weights. `sizes` (the
    parameter tensors' element counts in order) and `dp_rank` make the segment count exact; without
    them the rank is the first and the segments are estimated as tensors / d + 1.

    Expert parallelism (`ep` = E > 1): the routed experts' `params.expert` elements (already 1/E of
    them, see `parameter_count`) form a second set of buffers (`DenseAndExpertOptimizer`) whose
    optimizer state the distributed optimizer shards over the DP / E expert-DP ranks instead of DP;
    `sizes` then describe the dense buffer. Without the distributed optimizer nothing is sharded.
    """
    expert_dp = dp // ep
    if not params.expert or ep == 1:  # one set of buffers (shardlm splits the experts' off only at EP > 1)
        return _state_part(params.total, params.tensors, fmt, dp, distributed_optimizer, dp_rank, sizes)
    dense_tensors = params.tensors if sizes is None else len(sizes)
    dense = _state_part(params.dense, dense_tensors, fmt, dp, distributed_optimizer, dp_rank, sizes)
    experts = _state_part(params.expert, 1, fmt, expert_dp, distributed_optimizer, None, None)
    return StateMemory(dense.parameters + experts.parameters, dense.gradients + experts.gradients,
                       dense.optimizer + experts.optimizer)


def _state_part(n: int, tensors: int, fmt: NumericFormat, dp: int, distributed_optimizer: bool,
                dp_rank: int | None, sizes: list[int] | None) -> StateMemory:
    """`state_memory` of n elements in `tensors` tensors whose state is sharded over `dp` ranks."""
    step_scalars = 4 * tensors if fmt.adam_step_scalar else 0
    if not (fmt.name.startswith("shardlm") and (fmt.weight_bytes == 2 or distributed_optimizer)):
        optimizer_elements = -(-n // dp) if distributed_optimizer else n
        return StateMemory(parameters=n * fmt.weight_bytes, gradients=n * fmt.grad_bytes,
                           optimizer=optimizer_elements * fmt.optimizer_bytes + step_scalars)
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
    return StateMemory(parameters=fmt.weight_bytes * padded, gradients=4 * padded,
                       optimizer=master + 8 * (min(hi, n) - lo) + 4 * segments)


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
        # SDPA's rotated q and k, v and its output (2 h/t + 2 kv, kv = the rank's KV heads x head_dim); SwiGLU's
        # gate, silu(gate), up and their product (4 f/t); RoPE's cos and sin (s x head_dim each; the rotation's
        # inputs are not saved, the angles need no gradient); one fp32 RMSNorm stat per token and norm, and on
        # the CPU, whose rms_norm is not fused, each norm's normalized input too.
        kv = _kv_rows(cfg, tp)[1]
        split = tokens * (2 * h // tp + 2 * kv + 4 * f // tp) * fmt.matmul_bytes
        rope = 2 * s * (h // cfg.num_heads) * fmt.matmul_bytes
        unfused_norms = 0 if backend == "cuda" else 2 * tokens * h * fmt.residual_bytes
        small = 2 * tokens * 4 + b * (cfg.num_heads // tp) * s * 4 + rope + unfused_norms
        weights = fmt.weight_cast_bytes * (2 * h * h // tp + 2 * kv * h + 3 * f * h // tp)
        return replicated + split + small + weights
    split = tokens * (4 * h // tp + 2 * f // tp) * fmt.matmul_bytes
    small = 2 * 2 * tokens * 4 + b * (cfg.num_heads // tp) * s * 4
    weights = fmt.weight_cast_bytes * (4 * h * h + 2 * f * h) // tp
    return replicated + split + small + weights


def mla_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                         backend: str = "cuda") -> int:
    """What a Llama layer with multi-head latent attention saves beyond its norms' inputs and outputs (the
    `replicated` part of `layer_activation_bytes`), per token of one micro-batch on one TP rank (H/t local
    heads, qk = qk_nope + qk_rope, r_q = q_lora_rank, r_kv = kv_lora_rank), in the GEMM dtype unless named:

      replicated (the down-projections run on every rank): q_a's output r_q (q_a_norm's input), kv_a's
          output r_kv + qk_rope (the latent c, kv_a_norm's input, is a view of it), and the normed latents
          q_a_norm(.), kv_a_norm(c) with the RoPE key, r_q + r_kv + qk_rope, one tensor that q_b and kv_b
          save; one fp32 statistic per latent norm; under autocast the norms save fp32 copies of their
          inputs instead (r_q + r_kv, 4 bytes each), and the two GEMMs that read the first norm's output
          (q_a or q, and kv_a) each save their own half copy of it (h more);
      split over TP: kv_b's output H/t (qk_nope + v_head_dim) (its value half is SDPA's v), SDPA's
          rotated q and k H/t qk each, its output H/t v_head_dim (o's input, a view on CUDA; a copy on the
          CPU), the log-sum-exp (fp32, one per local head); SwiGLU's four f/t;
      RoPE's fp32 cos and sin (s x qk_rope each); autocast's half copies of q_a, q_b (or q), kv_a, kv_b, o
          and the MLP's three matrices; on the CPU the unfused norms' normalized inputs (2 h + r_q + r_kv).

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
    # in fp32, the fp32 copies of c and q_a's output; autocast also casts the first norm's output once for
    # each of the two GEMMs that read it (q_a or q, and kv_a)
    norm_inputs = tokens * (q_rank + kv_rank) * 4 if autocast else \
        tokens * (q_rank + kv_rank + rope) * fmt.matmul_bytes
    second_cast = tokens * h * fmt.matmul_bytes if autocast else 0
    latents = q_rank + kv_rank + rope
    split = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim + 2 * qk + cfg.v_head_dim) + 4 * f // tp
    norms = (2 if q_rank else 1) * tokens * 4 + 2 * tokens * 4
    lse = b * heads * s * 4
    angles = 2 * s * rope * 4
    unfused = 0 if backend == "cuda" else tokens * (2 * h + q_rank + kv_rank) * fmt.residual_bytes
    # the CPU kernel's output keeps q's (b, H, s, d) layout (q is a concatenation), so o's input is a copy
    output_copy = 0 if backend == "cuda" else tokens * heads * cfg.v_head_dim * fmt.matmul_bytes
    weights = fmt.weight_cast_bytes * (_mla_count(cfg, tp).matrix + 3 * f * h // tp)
    return (tokens * (latents + split) * fmt.matmul_bytes + norm_inputs + second_cast + norms + lse + angles
            + unfused + output_copy + weights)


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
