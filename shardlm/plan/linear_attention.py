"""Linear-attention (Gated DeltaNet) layers in the planner: Qwen3-Next's and Qwen3.5's three of every four layers
(`shardlm.models.linear_attention`).

- parameters: `parameters._linear_attention_count` (projections, convolutions, gates, the gated norm);
- FLOPs: `plan.flops.flops_per_token` counts a linear layer's projections and the chunked delta rule, linear in
  the sequence (`rule_flops_per_token`), instead of attention's 4 s a: no (query, key) pairs, so the windows'
  `attended_keys` is 0 there and neither the flash kernel's causal skip nor context parallelism's K/V ring applies
  (`attention_layer_share` scales the ring's time to the full-attention layers);
- memory: what a linear layer saves for its backward (`linear_activation_bytes`), which replaces a full layer's
  attention share of `memory.layer_activation_bytes` (`activations.shardlm_memory` charges every layer the larger
  of the two kinds, as it does dense and MoE layers). The recurrent state (`recurrent_state_bytes`) is what a
  sequence carries from chunk to chunk, and what decoding keeps per layer instead of keys and values.

Nothing here imports torch: `CHUNK` is `shardlm.models.delta_rule.CHUNK` (a test checks it).
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig
from shardlm.plan import recurrent
from shardlm.plan.flops import mla_weights
from shardlm.plan.formats import NumericFormat

CHUNK = 64
"""Tokens per chunk of the chunked delta rule (`shardlm.models.delta_rule.CHUNK`)."""


def linear_layer_count(cfg: ModelConfig) -> int:
    """Layers that are Gated DeltaNet layers (`cfg.is_linear_layer`)."""
    return sum(cfg.is_linear_layer(i) for i in range(cfg.num_layers))


def attention_layer_share(cfg: ModelConfig) -> float:
    """Share of the layers that attend over (query, key) pairs: 1 without linear layers, 1/4 in Qwen3-Next, 7/27
    in Kimi Linear; in Nemotron-H its attention blocks ("*" in `layer_pattern`), 4/52 in Nemotron-H-8B."""
    if cfg.layer_pattern:
        return cfg.layer_pattern.count("*") / cfg.num_layers
    return (cfg.num_layers - linear_layer_count(cfg)) / cfg.num_layers


def linear_weights(cfg: ModelConfig) -> int:
    """Entries of one linear layer's projections (TP = 1): q, k (h x n_k d_k each), v, z (h x n_v d_v each), b, a
    (h x n_v each) and o (n_v d_v x h)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return cfg.hidden_size * (2 * nk * dk + 2 * nv * dv + 2 * nv + nv * dv)


def attention_weights(cfg: ModelConfig, index: int) -> int:
    """Entries of layer `index`'s attention projections (TP = 1): a KDA layer's (`recurrent.kda_weights`), MLA's
    (`mla_weights`), a linear layer's (`linear_weights`), or q (2a x h with the output gate), k, v and o."""
    h = cfg.hidden_size
    if recurrent.is_kda_layer(cfg, index):
        return recurrent.kda_weights(cfg)
    if cfg.arch == "llama" and cfg.attention == "mla":
        return mla_weights(cfg)
    if cfg.is_linear_layer(index):
        return linear_weights(cfg)
    a, kv = cfg.num_heads * cfg.attention_head_dim, cfg.kv_heads * cfg.attention_head_dim
    return h * a * (2 if cfg.attention_output_gate else 1) + 2 * h * kv + h * a


def rule_flops_per_token(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of one linear layer's chunked delta rule: per value head 5 C d_k + 3 C d_v + 6 d_k d_v
    (`plan.flops.flops_per_token` derives it; C = `CHUNK`); KDA's: `recurrent.kda_rule_flops_per_token`."""
    if cfg.linear_attention_rule == "kimi_delta":
        return recurrent.kda_rule_flops_per_token(cfg)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return cfg.linear_num_value_heads * (5 * CHUNK * dk + 3 * CHUNK * dv + 6 * dk * dv)


def conv_channels(cfg: ModelConfig, tp: int) -> int:
    """Channels of the short convolution on one TP rank: q, k and v, (2 n_k d_k + n_v d_v) / t."""
    return (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim) // tp


def recurrent_state_bytes(cfg: ModelConfig, tp: int, element_bytes: int) -> int:
    """What one sequence carries through one linear layer on one TP rank: the fp32 state (n_v / t heads of
    d_k x d_v) and the convolution's last kernel - 1 inputs (conv channels, `element_bytes` each). Decoding keeps
    this per layer instead of keys and values, whatever the sequence length. KDA's: `recurrent.kda_state_bytes`."""
    if cfg.linear_attention_rule == "kimi_delta":
        return recurrent.kda_state_bytes(cfg, tp, element_bytes)
    heads = cfg.linear_num_value_heads // tp
    return heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 \
        + (cfg.linear_conv_kernel - 1) * conv_channels(cfg, tp) * element_bytes


def linear_activation_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                            selective: bool = False) -> int:
    """Bytes one Gated DeltaNet layer saves for one micro-batch on one TP rank beyond its input norm's output (which
    its six input GEMMs save, as attention's three do): b sequences of s = n C tokens, H = n_v / t value heads of
    the rank, c = conv channels, e = the GEMM dtype's bytes, fp32 unless named.

      convolution: its weights (c x kernel, e), the input with the kernel - 1 earlier positions (b (s + kernel - 1)
          c, e: the convolution state at every start), the SiLU's input (e) and output (fp32: the rule's q, k, v);
      q and k's L2 norms, one factor per head and token; beta, softplus's input and output (b s H each), the decay;
      the chunked rule (`_rule_bytes`): per token and head the chunk's decays, the products K_beta K^T and Q K^T
          and what they become (5 C), q and k (one per value head), K_beta, W and the products' operands (d_k
          each), U and U - W S (d_v each), three exponentials of the decay; per chunk its incoming state
          (`recurrent_state_bytes`' fp32 state) and the C x C causal mask (bytes);
      output: the gated norm's input, statistic and output (residual dtype), z's SiLU input and output, the norm's
          output and the product o reads (b s H d_v each, o's input in e);
      autocast's half copies of the rank's q, k, v, z, b, a and o (`linear_weights` / t).

    With `selective` (recomputation of `GatedDeltaNet.core`) the convolution and the rule keep only their inputs:
    the concatenated q, k, v (c), b and a (H each), e. Derived from the code and equal to what autograd saves on the
    CPU, in fp32 and under bf16 autocast (`tests/test_plan_linear_attention.py`; under autocast each of the six
    input GEMMs casts the norm's output anew, which the block counts once for them, as it does for attention's
    three)."""
    if cfg.linear_attention_rule == "kimi_delta":  # Kimi Delta Attention: `recurrent.kda_activation_bytes`
        return recurrent.kda_activation_bytes(cfg, tp, micro_batch, fmt, selective)
    b, s, e = micro_batch, cfg.seq_length, fmt.matmul_bytes
    tokens = b * s
    heads, channels = cfg.linear_num_value_heads // tp, conv_channels(cfg, tp)
    dv, kernel = cfg.linear_value_head_dim, cfg.linear_conv_kernel
    output = tokens * heads * (4 * dv + 4 + fmt.residual_bytes * dv + 4 * dv + 4 * dv + 4 * dv + e * dv)
    output += fmt.weight_cast_bytes * linear_weights(cfg) // tp
    if selective:
        return tokens * (channels + 2 * heads) * e + output
    conv = channels * kernel * e + b * (s + kernel - 1) * channels * e + tokens * channels * (e + 4)
    gates = tokens * (2 * cfg.linear_num_key_heads // tp + 3 * heads) * 4 + 2 * heads * 4
    return conv + gates + _rule_bytes(cfg, heads, b, e) + output


def _rule_bytes(cfg: ModelConfig, heads: int, b: int, e: int) -> int:
    """What `chunk_gated_delta_rule` saves for b sequences of `heads` value heads (e = the GEMM dtype's bytes).

    In fp32 (e = 4): per token and head the decays between the chunk's tokens, K_beta K^T and the system it becomes,
    Q K^T and the chunk's attention (5 C); q, k, K_beta, W (4 d_k) and, when (b, heads, chunks) do not fold into one
    batch dimension, the batched products' copies of K_beta, K^T (twice) and Q (4 d_k); Q_read and K_write, read
    against the state of every chunk but the first (Q_read) and the last (K_write: the end state is dropped), whole
    with one sequence, else as a copy of each such chunk; U and each chunk's U - W S (2 d_v); each chunk's incoming
    state (the first one zero).

    Under autocast the products run in the half dtype and each casts its operands: K_beta K^T, Q K^T and each
    chunk's attention (3 C, e) beside the fp32 decays and system (2 C); the casts of K_beta and K^T, Q and K^T
    (4 d_k, e); per chunk the casts of W, Q_read (every chunk but the first), K_write (every chunk but the last),
    U - W S (twice, once in the last chunk) and the state (twice), and the fp32 states of every chunk but the
    last."""
    s, dk, dv = cfg.seq_length, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    chunks = -(-s // CHUNK)
    rows = b * heads  # one (sequence, head) pair each
    later = chunks - 1  # chunks that read an incoming state that needs a gradient
    fixed = rows * s * (4 * dk + dv + 3) * 4 + rows * chunks * 4 + CHUNK * CHUNK  # q, k, K_beta, W, U, exps, mask
    if e == 4:
        copies = 4 * dk if b * chunks > 1 else 0
        reads = 0 if chunks == 1 else 2 * dk * (s if b == 1 else later * CHUNK)
        return fixed + rows * (s * (5 * CHUNK + copies + dv) + reads + chunks * dk * dv) * 4
    half = s * (3 * CHUNK + 4 * dk) + later * CHUNK * 3 * dk + (2 * chunks - 1) * CHUNK * dv + 2 * chunks * dk * dv
    return fixed + rows * (s * 2 * CHUNK * 4 + half * e + later * dk * dv * 4)
