"""Kimi Delta Attention (Kimi Linear) and Mamba-2 (Nemotron-H) layers in the planner: their weights, matmul FLOPs,
parameters, recurrent state and what they save for the backward, derived from `shardlm.models.kimi_delta`,
`shardlm.models.kda_rule`, `shardlm.models.mamba` and `shardlm.models.ssd` (`tests/test_plan_recurrent.py` checks
each against the code, transformers' builds and autograd).

- FLOPs: `plan.flops.flops_per_token` counts a KDA layer's projections (`kda_weights`) and its chunked rule
  (`kda_rule_flops_per_token`), a Mamba-2 layer's (`mamba_weights`, `ssd_flops_per_token`), and a Nemotron-H
  model's layers by `layer_pattern` (`pattern_layer_flops`); all linear in the sequence.
- parameters: `recurrent_parameter_count` (Kimi Linear: KDA layers beside MLA ones; Nemotron-H: one mixer a block);
- state: `kda_state_bytes` and `mamba_state_bytes`, what one sequence carries through a layer (and decoding keeps);
- activations: `kda_activation_bytes` and `mamba_activation_bytes`, what a mixer keeps for its backward
  (`linear_attention.linear_activation_bytes` gives KDA's); whole layers: `kda_layer_activation_bytes` (a Kimi Linear
  KDA layer with its dense MLP) and `pattern_block_activation_bytes` (Nemotron-H's Mamba-2, attention and MLP
  blocks), in fp32 and under bf16 autocast.

The planner's own paths call them: `parameters.parameter_count` (`recurrent_parameter_count`),
`activations.shardlm_memory` (a Kimi Linear KDA layer's `kda_layer_activation_bytes`; Nemotron-H's largest block,
`pattern_block_activation_bytes`, its MoE blocks estimated by `moe_block_activation_bytes`), `dualpipe.layer_flops`
(`pattern_layer_flops`) and `timing` (selective recomputation reruns the Mamba-2 scans, `ssd_flops_per_token`).

Nothing here imports torch at import time.
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig
from shardlm.plan.formats import NumericFormat
from shardlm.plan.parameters import ParameterCount, _mla_count, _split, add_counts

KDA_CHUNK = 64
"""Tokens per chunk of `chunk_kda_rule` (`shardlm.models.delta_rule.CHUNK`; a test checks it)."""
KDA_BLOCK = 16
"""Tokens per sub-block of `kda_rule.pairwise` (`shardlm.models.kda_rule.BLOCK`)."""


def is_kda_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether layer `index` is a Kimi Delta Attention layer (`linear_attention_rule = "kimi_delta"`)."""
    return cfg.linear_attention_rule == "kimi_delta" and cfg.is_linear_layer(index)


def layer_kind(cfg: ModelConfig, index: int) -> str:
    """A Nemotron-H layer's mixer (`model.layer_pattern`): "M" Mamba-2, "*" attention, "-" MLP, "E" MoE."""
    return cfg.layer_pattern[index]


def mamba_layer_count(cfg: ModelConfig) -> int:
    """Layers that are Mamba-2 layers ("M" in `layer_pattern`)."""
    return cfg.layer_pattern.count("M")


def kda_weights(cfg: ModelConfig) -> int:
    """Entries of one KDA layer's matrices (TP = 1; H heads of d channels): q, k, v (h x H d each), b (h x H), the
    forget and output gates' low-rank pairs f_a, g_a (d x h) and f_b, g_b (H d x d), o (H d x h)."""
    h, heads, d = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    return h * (3 * heads * d + heads) + 2 * (d * h + heads * d * d) + heads * d * h


def kda_rule_flops_per_token(cfg: ModelConfig) -> int:
    """Forward matmul FLOPs per token of one KDA layer's chunked rule (`chunk_kda_rule`, C = `KDA_CHUNK`): per chunk
    and head `pairwise` runs one (C x d)(d x C) product for the system K_beta K^T and one for Q K^T (its sub-block
    terms are elementwise: 2 C^2 d each), the two unit-triangular solves for U and W (C^2 d each), and
    `chunks_carried` W S, Q_read S and K_write^T (U - W S) (2 C d^2 each) and the chunk's attention times U - W S
    (2 C^2 d): per token and head 8 C d + 6 d^2 (the gated delta rule's 5 C d_k + 3 C d_v + 6 d_k d_v with
    d_k = d_v = d)."""
    d = cfg.linear_key_head_dim
    return cfg.linear_num_value_heads * (8 * KDA_CHUNK * d + 6 * d * d)


def mamba_weights(cfg: ModelConfig) -> int:
    """Entries of one Mamba-2 layer's matrices (TP = 1; H heads of P channels, G groups of N): Hugging Face's in_proj
    as shardlm's z, x (h x H P each), B, C (h x G N each) and dt (h x H), and out_proj o (H P x h)."""
    h, inner = cfg.hidden_size, cfg.mamba_num_heads * cfg.mamba_head_dim
    return h * (2 * inner + 2 * cfg.mamba_groups * cfg.mamba_state_size + cfg.mamba_num_heads) + inner * h


def ssd_flops_per_token(cfg: ModelConfig) -> int:
    """Forward matmul FLOPs per token of one Mamba-2 layer's chunked scan (`ssd.chunk_scan`, L =
    `mamba_chunk_size`; B and C per group): per chunk and group C B^T (2 L^2 N); per chunk and head the masked
    decayed scores times x dt (2 L^2 P), the chunk's end state (x dt decayed)^T B (2 L P N) and what the chunk
    reads of the incoming state C S^T (2 L N P): per token 2 L N G + H (2 L P + 4 P N) (the convolution, the
    discretization, D x and the gated norm are not matmuls; a last chunk padded to L is not counted)."""
    L, P, N = cfg.mamba_chunk_size, cfg.mamba_head_dim, cfg.mamba_state_size
    return 2 * L * N * cfg.mamba_groups + cfg.mamba_num_heads * (2 * L * P + 4 * P * N)


def pattern_layer_flops(cfg: ModelConfig, index: int) -> float:
    """Forward matmul FLOPs per token of Nemotron-H's layer `index` (`layer_pattern`): Mamba-2 2 `mamba_weights` +
    `ssd_flops_per_token`; attention without positions 2 (2 h a + 2 h kv) + 4 s a (a = heads x head_dim, kv = KV
    heads x head_dim); the ReLU^2 MLP 2 (2 h f); an MoE layer the router (2 h E), its top-k ReLU^2 experts (2 x 2 h
    f_e each) and the shared one (2 x 2 h f_s)."""
    h, kind = cfg.hidden_size, layer_kind(cfg, index)
    if kind == "M":
        return 2 * mamba_weights(cfg) + ssd_flops_per_token(cfg)
    if kind == "*":
        a, kv = cfg.num_heads * cfg.attention_head_dim, cfg.kv_heads * cfg.attention_head_dim
        return 2 * (2 * h * a + 2 * h * kv) + 4 * cfg.seq_length * a
    if kind == "-":
        return 2 * 2 * h * cfg.ffn_size
    shared = cfg.shared_ffn_size if cfg.moe_shared_experts else 0
    return 2 * h * (2 * (cfg.moe_top_k * cfg.moe_ffn_size + shared) + cfg.moe_num_experts)


def _kda_count(cfg: ModelConfig, tp: int) -> ParameterCount:
    """One KDA layer (`KimiDeltaAttention`) and its block's two RMSNorms on one TP rank: q, k, v (H d / t x h each),
    b (H / t x h), f_b and g_b (H d / t x d), o (h x H d / t), the convolutions of q, k and v (3 H d / t x kernel),
    A_log (H / t) and dt_bias (H d / t) split with the heads; f_a and g_a (d x h), the gated norm's weight (d) and
    the two RMSNorms (h each) replicated."""
    h, d = cfg.hidden_size, cfg.linear_key_head_dim
    heads = _split(cfg.linear_num_value_heads, tp, "linear_num_value_heads")
    sharded_matrices = (3 * heads * d + heads) * h + 2 * heads * d * d + h * heads * d
    replicated_matrices = 2 * d * h
    sharded = sharded_matrices + 3 * heads * d * cfg.linear_conv_kernel + heads + heads * d
    return ParameterCount(sharded, replicated_matrices + d + 2 * h, 7 + 2 + 3 + 2 + 1 + 2,
                          sharded_matrices + replicated_matrices)


def _mamba_count(cfg: ModelConfig, tp: int) -> ParameterCount:
    """One Mamba-2 layer (`mamba.Mamba2`) on one TP rank: z, x (H P / t x h each), B, C (G N / t x h each), dt
    (H / t x h), o (h x H P / t), the convolution over x, B and C ((H P + 2 G N) / t x kernel, with as many biases
    under `mamba_conv_bias`), A_log, dt_bias and D (H / t each) and the gated norm's weight (H P / t), all split
    with the heads and groups."""
    h, K = cfg.hidden_size, cfg.mamba_conv_kernel
    inner = _split(cfg.mamba_num_heads * cfg.mamba_head_dim, tp, "mamba inner width")
    heads = _split(cfg.mamba_num_heads, tp, "mamba_num_heads")
    state = _split(cfg.mamba_groups * cfg.mamba_state_size, tp, "mamba_groups x mamba_state_size")
    matrices = (2 * inner + 2 * state + heads) * h + inner * h
    channels = inner + 2 * state
    biases = 3 if cfg.mamba_conv_bias else 0
    sharded = matrices + channels * K + (channels if biases else 0) + 3 * heads + inner
    return ParameterCount(sharded, 0, 6 + 3 + biases + 3 + 1, matrices)


def _pattern_layer_count(cfg: ModelConfig, index: int, tp: int, ep: int) -> ParameterCount:
    """Nemotron-H's block `index` on one (TP, EP) rank: its RMSNorm (h, replicated) and its mixer: Mamba-2
    (`_mamba_count`); attention without positions (q and o split by heads, k and v by KV heads); the ReLU^2 MLP (up
    f / t x h, down h x f / t); or the MoE layer: the router (E x h) and its score-correction bias (E, where the
    model has one) replicated, E / ep experts of up (f_e / t x h) and down (h x f_e / t), the shared expert's up and
    down (f_s / t)."""
    h, kind = cfg.hidden_size, layer_kind(cfg, index)
    norm = ParameterCount(0, h, 1, 0)
    if kind == "M":
        return add_counts(norm, _mamba_count(cfg, tp))
    if kind == "*":
        a = _split(cfg.num_heads * cfg.attention_head_dim, tp, "attention width")
        kv = _split(cfg.kv_heads * cfg.attention_head_dim, tp, "KV width (num_kv_heads x head_dim)")
        matrices = (2 * a + 2 * kv) * h
        return add_counts(norm, ParameterCount(matrices, 0, 4, matrices))
    if kind == "-":
        f = _split(cfg.ffn_size, tp, "ffn size")
        return add_counts(norm, ParameterCount(2 * f * h, 0, 2, 2 * f * h))
    experts = cfg.moe_num_experts
    if experts % ep:
        from shardlm.errors import UserError

        raise UserError(f"model.moe_num_experts={experts} is not divisible by parallel.expert={ep}")
    routed = 2 * (experts // ep) * _split(cfg.moe_ffn_size, tp, "expert ffn size") * h
    shared = 2 * _split(cfg.shared_ffn_size, tp, "shared ffn size") * h if cfg.moe_shared_experts else 0
    bias = experts if cfg.moe_expert_bias_rate > 0 or cfg.moe_expert_bias else 0  # as `Router` builds it
    tensors = 1 + (bias > 0) + 2 + (2 if shared else 0)
    return add_counts(norm, ParameterCount(routed + shared, experts * h + bias, tensors, routed + shared, routed))


def recurrent_parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of a Kimi Linear or Nemotron-H model: the embedding and the untied output layer
    (V_padded / t x h each), the final RMSNorm, and the layers. Nemotron-H (`layer_pattern`): one block a layer,
    `_pattern_layer_count`. Kimi Linear: KDA layers (`_kda_count`) where `layer_types` says "linear_attention",
    MLA (`parameters._mla_count`) in the others, and each layer's SwiGLU MLP or MoE layer
    (`parameters._mlp_count`)."""
    from shardlm.plan.parameters import _mlps, _times

    h = cfg.hidden_size
    vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
    outputs = 1 if cfg.tie_embeddings else 2
    total = ParameterCount(outputs * vocab_local * h, h, 1 + outputs, 0)
    if cfg.layer_pattern:
        for index in range(cfg.num_layers):
            total = add_counts(total, _pattern_layer_count(cfg, index, tp, ep))
        return total
    linear = sum(is_kda_layer(cfg, i) for i in range(cfg.num_layers))
    total = add_counts(total, _times(_kda_count(cfg, tp), linear))
    total = add_counts(total, _times(_mla_count(cfg, tp), cfg.num_layers - linear))
    return add_counts(total, _mlps(cfg, tp, ep, gated=True))


def kda_state_bytes(cfg: ModelConfig, tp: int, element_bytes: int) -> int:
    """What one sequence carries through one KDA layer on one TP rank: the fp32 state (H / t heads of d x d) and the
    convolution's last kernel - 1 inputs (3 H d / t channels, `element_bytes` each). Decoding keeps this per layer
    instead of keys and values, whatever the sequence length."""
    heads, d = cfg.linear_num_value_heads // tp, cfg.linear_key_head_dim
    return heads * d * d * 4 + (cfg.linear_conv_kernel - 1) * 3 * heads * d * element_bytes


def mamba_conv_channels(cfg: ModelConfig, tp: int) -> int:
    """Channels of a Mamba-2 layer's convolution on one TP rank: x, B and C, (H P + 2 G N) / t."""
    return (cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.mamba_groups * cfg.mamba_state_size) // tp


def mamba_state_bytes(cfg: ModelConfig, tp: int, element_bytes: int) -> int:
    """What one sequence carries through one Mamba-2 layer on one TP rank: the fp32 SSM state (H / t heads of
    P x N) and the convolution's last kernel - 1 inputs (`mamba_conv_channels`, `element_bytes` each)."""
    heads = cfg.mamba_num_heads // tp
    return heads * cfg.mamba_head_dim * cfg.mamba_state_size * 4 \
        + (cfg.mamba_conv_kernel - 1) * mamba_conv_channels(cfg, tp) * element_bytes


def recurrent_state_bytes_per_sequence(cfg: ModelConfig, tp: int, element_bytes: int) -> int:
    """The whole model's recurrent state for one sequence on one TP rank: every KDA and Mamba-2 layer's."""
    kda = sum(is_kda_layer(cfg, i) for i in range(cfg.num_layers)) * kda_state_bytes(cfg, tp, element_bytes)
    mamba = mamba_layer_count(cfg) * mamba_state_bytes(cfg, tp, element_bytes) if cfg.layer_pattern else 0
    return kda + mamba


def kda_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                         selective: bool = False) -> int:
    """Bytes one KDA layer saves for one micro-batch on one TP rank beyond its input norm's output (which its input
    GEMMs save, as attention's do): b sequences of s = n C tokens, H = heads / t, d channels, c = 3 H d conv
    channels, C = `KDA_CHUNK`, sub-blocks of 16 (`KDA_BLOCK`, C / 16 of them); fp32 (4 bytes) but where the GEMM
    dtype is named (m bytes: 2 under bf16 autocast, else 4). Derived from the code; equal to what autograd saves on
    the CPU in fp32 and under bf16 autocast (`tests/test_plan_recurrent.py`):

      the low-rank gates' d-wide middles (f_a's and g_a's outputs, which f_b and g_b read; m);
      convolution: its weights (c x kernel; m, under autocast one cast per tap), the input with kernel - 1 earlier
          positions and the SiLU's input (m), its output as the rule reads it (q, k, v: fp32; their fp32 copies
          under autocast); the norms' factors (2 per head and token), q scaled and k normalized, beta, the forget
          gate's softplus input and output, exp(A_log) and its negation;
      the rule (`_kda_rule_bytes`);
      output: the gated norm's input, statistic and weighted values (its weight folded into the norm, which saves
          no normalized values of its fp32 input: `memory.norm_normalized_bytes`), the output gate's sigmoid (fp32)
          and the product o reads (m); autocast's half copies of the rank's projections (`kda_weights`: f_a and
          g_a whole on every rank).

    With `selective` (recomputation of `KimiDeltaAttention.core`) the convolution and the rule keep only their
    inputs: q, k, v before the convolution (c), b (H) and the forget gate's f_b output (H d), m."""
    b, s, e = micro_batch, cfg.seq_length, 4
    heads, d, kernel = cfg.linear_num_value_heads // tp, cfg.linear_key_head_dim, cfg.linear_conv_kernel
    m = fmt.matmul_bytes
    tokens, channels = b * s, 3 * heads * d
    casts = fmt.weight_cast_bytes * ((kda_weights(cfg) - 2 * d * cfg.hidden_size) // tp + 2 * d * cfg.hidden_size)
    gates = 2 * tokens * d * m
    output = tokens * heads * ((3 * d + 1) * e + d * m) + casts
    if selective:
        return gates + tokens * (channels + heads + heads * d) * m + output
    conv = channels * kernel * m + b * (s + kernel - 1) * channels * m + tokens * channels * (m + e)
    inputs = tokens * heads * (2 + 1 + 2 * d + 2 * d) * e + 2 * heads * e
    return gates + conv + inputs + _kda_rule_bytes(cfg, heads, b, m) + output


def _kda_rule_bytes(cfg: ModelConfig, heads: int, b: int, m: int = 4) -> int:
    """What `chunk_kda_rule` saves for b sequences of `heads` heads (s a multiple of C; m = the GEMM dtype's bytes,
    the rest fp32). Per token and head: K_beta (d); each of the two `pairwise` calls' right factors and their decays
    (d each; the factors as the batched product reads them, m), left factors and their decays (d C / 16 each; the
    factors m), sub-block products and their decays (2 x 16 d) and its subnormal mask (C bytes); the system (C) and
    the chunk's attention (C, m); U, W and the decays W and Q_read read (4 d); each chunk's U - W S (d, m); the
    chunk's outputs (d, read by the gated norm). Q_read and K_write, read against the state of every chunk but the
    first (Q_read) and the last (K_write: the end state is dropped): in fp32 whole with one sequence, else (and under
    autocast) each such chunk (2 d per token of s, or of s - C). Per chunk and head the decay to its end (d) and
    its incoming state (d x d; under autocast cast twice, for W S and Q_read S, and the fp32 state the decay
    multiplies, but the last's). Fixed: the masks of the sub-blocks (C^2 / 16 + 16^2 bytes) and their 0/1 placement
    ((C / 16)^2 floats), each call."""
    s, d, C, block = cfg.seq_length, cfg.linear_key_head_dim, KDA_CHUNK, KDA_BLOCK
    chunks, nb = -(-s // C), C // block
    per_token = (d + 2 * (d + d * nb + 2 * block * d) + C + 4 * d + d) * 4 + (2 * (d + d * nb) + C + d) * m
    reads = 0 if chunks == 1 else 2 * d * (s if b == 1 and m == 4 else s - C) * 4
    states = chunks * d * d * 4 if m == 4 else 2 * chunks * d * d * m + (chunks - 1) * d * d * 4
    fixed = 2 * (nb * C + block * block + nb * nb * 4)
    return b * heads * (s * per_token + reads + s * 2 * C + chunks * d * 4 + states) + fixed


def mamba_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                           selective: bool = False) -> int:
    """Bytes one Mamba-2 mixer saves for one micro-batch on one TP rank beyond its block norm's output (which its
    input GEMMs save): b sequences of s = n L tokens (L = `mamba_chunk_size`), H = heads / t of P channels, N
    state channels, G = groups / t, c = `mamba_conv_channels`; e = the GEMM dtype's bytes, fp32 unless named.
    Derived from the code; equal to what autograd saves on the CPU in fp32 and under bf16 autocast
    (`tests/test_plan_recurrent.py`):

      convolution: its weights (c x kernel; under autocast one cast per tap), the input with kernel - 1 earlier
          positions and the SiLU's input (e); in fp32 the SiLU's output (x, B and C), under autocast instead two
          fp32 copies of x (the scan's x dt and the skip D x each cast it anew); the step: softplus's input and
          output and the clamped step (3 per head and token, fp32); exp(A_log) and its negation;
      the scan (`_ssd_bytes`);
      the gated norm (fp32): z (its fp32 copy under autocast), y, silu(z), their product, the normalized values
          (5 H P per token), one statistic per group and token; the product o reads (H P, e); autocast's half
          copies of the rank's projections (`mamba_weights` / t).

    With `selective` (recomputation of `Mamba2.core`) the convolution and the scan keep only their inputs: x, B
    and C before the convolution (c) and dt (H), e."""
    b, s, e = micro_batch, cfg.seq_length, fmt.matmul_bytes
    heads, P, kernel = cfg.mamba_num_heads // tp, cfg.mamba_head_dim, cfg.mamba_conv_kernel
    groups, channels, tokens = cfg.mamba_groups // tp, mamba_conv_channels(cfg, tp), micro_batch * cfg.seq_length
    output = tokens * (5 * heads * P * 4 + heads * P * e + groups * 4) \
        + fmt.weight_cast_bytes * mamba_weights(cfg) // tp
    if selective:
        return tokens * (channels + heads) * e + output
    silu_output = tokens * channels * 4 if e == 4 else 2 * tokens * heads * P * 4
    conv = channels * kernel * e + b * (s + kernel - 1) * channels * e + tokens * channels * e + silu_output
    step = 3 * tokens * heads * 4 + 2 * heads * 4
    return conv + step + _ssd_bytes(cfg, heads, b, e) + output


def _ssd_bytes(cfg: ModelConfig, heads: int, b: int, e: int) -> int:
    """What `ssd.chunk_scan` saves for b sequences of `heads` heads in `heads` / (H / G) groups (s a multiple of L;
    e = the GEMM dtype's bytes). B and C stay per group, so their terms are per token and group.

    Per token and head: the chunk's decays between its tokens (fp32) and their product with C B^T (L, e); x dt as
    the chunk's product reads it (P, e); what each token reads of the incoming state (P, e); two decays (to the
    chunk's end and from its start, fp32); with more than one chunk also each token's decayed x dt as the end
    state's product reads it (P, e) and, under autocast, the fp32 x dt that decay multiplied (P; in fp32 the same
    tensor as the first). Per token and group: C B^T (L, e), and C and B as it reads them (N each, e); with more than
    one chunk C and B again under autocast (each product casts anew: C as the state is read, B as it is written).
    Per chunk, head and sequence: the decay over the chunk (fp32) and the state it starts from as the product that
    reads it saves it (P x N, e); but the first, each incoming state as its decay multiplies it (P x N, fp32). A single
    chunk's state is only the dropped end state: nothing writing it is kept. Fixed: the two L x L masks of
    `segment_sums` (bytes)."""
    s, L, P, N = cfg.seq_length, cfg.mamba_chunk_size, cfg.mamba_head_dim, cfg.mamba_state_size
    groups, chunks = heads // (cfg.mamba_num_heads // cfg.mamba_groups), -(-s // L)
    several = chunks > 1
    per_head = 4 * L + L * e + 2 * P * e + 2 * 4 + several * (P * e + (P * 4 if e != 4 else 0))
    per_group = L * e + 2 * N * e + (2 * N * e if several and e != 4 else 0)
    states = chunks * (4 + P * N * e) + (chunks - 1) * P * N * 4
    return b * (s * (heads * per_head + groups * per_group) + heads * states) + 2 * L * L


def kda_layer_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                               backend: str = "cuda", selective: bool = False) -> int:
    """What a whole Kimi Linear KDA layer with a dense SwiGLU saves: a Llama layer's norms and MLP
    (`memory.layer_activation_bytes` less its attention share) and `kda_activation_bytes` in place of the attention.
    `activations.shardlm_memory` subtracts `memory.attention_activation_bytes`, grouped-query attention's share,
    from an MLA layer, which is not MLA's share: this is the figure it should charge a Kimi Linear KDA layer."""
    from dataclasses import replace

    from shardlm.plan.memory import attention_activation_bytes, layer_activation_bytes

    gqa = replace(cfg, attention="mha", layer_types=[])
    rest = layer_activation_bytes(gqa, tp, micro_batch, fmt, backend) \
        - attention_activation_bytes(gqa, tp, micro_batch, fmt, backend)
    return rest + kda_activation_bytes(cfg, tp, micro_batch, fmt, selective)


def mamba_block_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                                 backend: str = "cuda", selective: bool = False) -> int:
    """What a whole Nemotron-H Mamba-2 block saves: its RMSNorm's input (residual dtype), output (as the input GEMMs
    save it: under autocast one copy its five input GEMMs, z, x, B, C and dt, share) and fp32 statistic (and
    its normalized values where it saves them: `memory.norm_normalized_bytes`, on the CPU for a half input only) and
    `mamba_activation_bytes`."""
    from shardlm.plan.memory import norm_normalized_bytes

    h, tokens = cfg.hidden_size, micro_batch * cfg.seq_length
    norm = tokens * (h * fmt.residual_bytes + h * fmt.matmul_bytes + 4  # (`decoder.autocast_copies`)
                     + h * norm_normalized_bytes(fmt.residual_bytes, backend))
    return norm + mamba_activation_bytes(cfg, tp, micro_batch, fmt, selective)


def pattern_block_activation_bytes(cfg: ModelConfig, index: int, tp: int, micro_batch: int, fmt: NumericFormat,
                                   backend: str = "cuda", selective: bool = False) -> int:
    """What Nemotron-H's block `index` saves for one micro-batch on one TP rank: its RMSNorm (input, statistic, the
    normalized values where it saves them, `memory.norm_normalized_bytes`, and the output as its input GEMMs save
    it, one copy they share under autocast) and its mixer. Mamba-2: `mamba_block_activation_bytes`. Attention without
    positions: `memory.attention_activation_bytes` without RoPE's cos and sin (with `selective`, without SDPA's
    log-sum-exp too). The ReLU^2 MLP: up's output (which ReLU keeps and squares) and the square down reads (2 f / t,
    GEMM dtype), autocast's copies of up and down. The MoE blocks ("E") are not counted here (ValueError;
    `moe_block_activation_bytes` estimates them)."""
    kind = layer_kind(cfg, index)
    if kind == "M":
        return mamba_block_activation_bytes(cfg, tp, micro_batch, fmt, backend, selective)
    if kind == "E":
        raise ValueError("the activation bytes of Nemotron-H's MoE blocks are not modelled")
    from dataclasses import replace

    from shardlm.plan.memory import attention_activation_bytes, norm_normalized_bytes

    h, tokens, e = cfg.hidden_size, micro_batch * cfg.seq_length, fmt.matmul_bytes
    norm = tokens * (h * fmt.residual_bytes + h * e + 4  # under autocast q, k and v share one copy
                     + h * norm_normalized_bytes(fmt.residual_bytes, backend))
    if kind == "*":
        plain = replace(cfg, layer_pattern="", mamba_num_heads=0, moe_num_experts=0)
        rope = (2 if e == 4 else 4) * cfg.seq_length * cfg.attention_head_dim * e
        lse = micro_batch * (cfg.num_heads // tp) * cfg.seq_length * 4 if selective else 0
        return norm + attention_activation_bytes(plain, tp, micro_batch, fmt, backend) - rope - lse
    f = cfg.ffn_size // tp
    return norm + tokens * 2 * f * e + fmt.weight_cast_bytes * 2 * f * h


MOE_BLOCK_NOTE = ("Nemotron-H's MoE blocks: activations estimated as shardlm's other MoE layers save them (SwiGLU "
                  "experts, 4 f_e per routed row where ReLU^2 keeps 2; an upper bound), not from its own code")
"""The one line the planner reports for models with Nemotron-H MoE blocks ("E" in `layer_pattern`)."""


def moe_block_activation_bytes(cfg: ModelConfig, tp: int, ep: int, micro_batch: int, fmt: NumericFormat,
                               sequence_parallel: bool = False, backend: str = "cuda") -> int:
    """What Nemotron-H's MoE block ("E") saves for one micro-batch on one (TP, EP) rank, not derived from its own
    code (`pattern_block_activation_bytes` refuses it): its RMSNorm (input, fp32 statistic, the normalized values
    where it saves them, `memory.norm_normalized_bytes`; the router saves its own fp32 copy of the output) and the
    MoE share of `experts.moe_layer_activation_bytes` (router, routed rows, shared expert;
    `memory.layer_activation_bytes` less its dense MLP removed), which counts SwiGLU experts: b s k rows of 4 f_e / t
    and 3 weight copies per expert where ReLU^2 ones keep 2 f_e / t and 2, an upper bound (`MOE_BLOCK_NOTE`)."""
    from dataclasses import replace

    from shardlm.plan.experts import _mlp_activation_bytes, moe_layer_activation_bytes
    from shardlm.plan.memory import layer_activation_bytes, norm_normalized_bytes

    plain = replace(cfg, layer_pattern="", mamba_num_heads=0)
    h, tokens = cfg.hidden_size, micro_batch * cfg.seq_length
    dense_mlp = _mlp_activation_bytes(plain, plain.ffn_size, tp, tokens, 1, fmt)
    share = moe_layer_activation_bytes(plain, tp, ep, micro_batch, fmt, sequence_parallel, backend) \
        - layer_activation_bytes(plain, tp, micro_batch, fmt, backend) + dense_mlp
    norm = tokens * (h * fmt.residual_bytes + 4 + h * norm_normalized_bytes(fmt.residual_bytes, backend))
    return norm + share
