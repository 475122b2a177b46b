"""What a DeepSeek Sparse Attention layer (DeepSeek-V3.2, GLM-5: `shardlm.models.mla`'s `sparse` path) saves for the
backward, against the dense MLA layer `memory.mla_activation_bytes` counts.

For one micro-batch of b rows on one TP rank (T queries a row, S = C T key positions under context parallelism,
N = b T, H = heads / t, qk = qk_nope + qk_rope, r = kv_lora_rank, k = index_topk, e the GEMM dtype's bytes), the
sparse layer keeps, in place of dense MLA's kv_b output, SDPA's q, k, output and log-sum-exp (and on the CPU the
output's copy) and kv_b's autocast weight copy:

    the core    (`sparse_attention.sparse_latent_attention`, its chunks recomputed in the backward): its inputs, the
                rotated q N H qk, the row's latents and rotated shared keys b S (r + qk_rope) (gathered over CP),
                each query's chosen keys (int32) and their validity (bool) N k each; kv_b's weight enters as it is
    output      o's input N H v_head_dim
    indexer     on a layer with its own indexer (not GLM-5's "shared" ones) when it trains (a frozen one runs without
                a graph): its keys' LayerNorm input (GEMM dtype; on the rank's chunk under SP) and its two statistics
                a token, its loss's gradients taken in the forward (fp32): the queries' N H_i D_i, the weights' N H_i
                and the row's keys b S D_i; in half precision its queries' and keys' rotations' copies of cos and
                sin (4 T qk_rope); under autocast its wk and weights_proj copies of the (detached) layer input, h a
                token each (their weights need no copy: their inputs carry no gradient)

Under CP each whole-row gather (`parallel.gather_zigzag_rows`: the latents, and a trained indexer's keys) keeps its
zigzag order, S int64. GLM-5's "shared" layers keep the same core inputs, their chosen keys being the full layer's
(no bytes of their own). The dense warm-up stage (`model.index_stage = "warmup"`) runs dense MLA: counted as such.
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig
from shardlm.plan.formats import NumericFormat


def dsa_attention_bytes(cfg: ModelConfig, index: int, tp: int, micro_batch: int, fmt: NumericFormat,
                        context: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes DSA layer `index`'s attention keeps beyond what it shares with dense MLA (the module docstring);
    `cfg.seq_length` is the rank's T tokens a row."""
    b, T, h, e = micro_batch, cfg.seq_length, cfg.hidden_size, fmt.matmul_bytes
    N, row_tokens, heads = b * T, b * T * context, cfg.num_heads // tp
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    k = min(cfg.index_topk, T * context)
    saved = N * heads * (qk + cfg.v_head_dim) * e + row_tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * e
    saved += N * k * 5  # the chosen keys (int32) and their validity
    gathers = T * context * 8 if context > 1 else 0  # a whole-row gather's zigzag order (int64), kept per gather
    saved += gathers
    if cfg.index_source(index) == index:  # its own indexer
        heads_i, dim_i = cfg.index_heads, cfg.index_head_dim
        if cfg.index_loss_coeff > 0:  # its keys' LayerNorm input and statistics (on the rank's chunk under SP), its
            # loss's gradients, its keys' gather order; in half precision its two rotations' copies of cos and sin
            chunk = N // tp if sequence_parallel and tp > 1 else N
            saved += chunk * (dim_i * e + 8) + N * heads_i * (dim_i + 1) * 4 + row_tokens * dim_i * 4 + gathers
            saved += 4 * T * cfg.qk_rope_head_dim * e if e != 4 else 0
            saved += 2 * chunk * h * e if fmt.weight_cast_bytes else 0  # wk's and weights_proj's input copies
    return saved


def dense_attention_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat, backend: str) -> int:
    """What `memory.mla_activation_bytes` counts for dense MLA's attention that the sparse layer does not keep:
    kv_b's output N H (qk_nope + v), SDPA's rotated q and k N H qk each, its output N H v and log-sum-exp (fp32, one
    a head), on the CPU o's copy of the output, and kv_b's autocast weight copy."""
    b, s, e = micro_batch, cfg.seq_length, fmt.matmul_bytes
    heads = cfg.num_heads // tp
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kv_b = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    dense = b * s * heads * (cfg.qk_nope_head_dim + 2 * cfg.v_head_dim + 2 * qk) * e + b * heads * s * 4
    dense += b * s * heads * cfg.v_head_dim * e if backend != "cuda" else 0
    return dense + fmt.weight_cast_bytes * kv_b * cfg.kv_lora_rank


def dsa_activation_change(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat, backend: str,
                          context: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes the largest DSA layer saves beyond the dense MLA layer's (`activations.shardlm_memory` charges every
    layer the largest)."""
    largest = max(dsa_attention_bytes(cfg, i, tp, micro_batch, fmt, context, sequence_parallel) for i in {
        cfg.index_source(i) == i: i for i in range(cfg.num_layers)}.values())
    return largest - dense_attention_bytes(cfg, tp, micro_batch, fmt, backend)
