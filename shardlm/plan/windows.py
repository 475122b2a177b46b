"""Sliding-window attention in the planner: what a window bounds (gpt-oss alternates sliding and full layers).

On a sliding layer (`ModelConfig.is_sliding_layer`) a query attends to its last w = `sliding_window` tokens, itself
included, instead of every earlier one. FLOPs are counted in the same square convention as the rest of the planner
and as PaLM's MFU (Chowdhery et al. 2023, appendix B) counts a full layer, each query against s keys, 4 s a per
token forward for QK^T and PV (`plan.flops.flops_per_token`): a sliding layer counts each query against
min(s, w) keys, 4 min(s, w) a per token. So a window bounds the layer's attention FLOPs to s x w per sequence
instead of s^2 (of which a causal kernel executes about s^2 / 2 on a full layer and s w - w^2 / 2 on a sliding one).

Memory: the fused attention kernels the planner assumes (shardlm's SDPA, Megatron-Core's flash) save q, k, v, the
output and the log-sum-exp per token, nothing per score, so a window changes no saved activation: what it bounds is
the work, not the bytes (`tests/test_plan_windows.py` checks both).

A linear-attention layer (`ModelConfig.is_linear_layer`, Qwen3-Next's Gated DeltaNet) attends over no keys: its
recurrence is linear in s (`plan.flops.flops_per_token`, `plan.linear_attention`), so it counts 0 keys here.

A DeepSeek Sparse Attention layer (`index_topk`, `plan.sparse_attention`) counts each query against its
min(s, index_topk) chosen keys at the absorbed form's cost per key (in the dense warm-up all s keys, dense MLA's
cost); its indexer is no attention core here.
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig
from shardlm.plan.sparse_attention import sparse_attention_flops


def attended_keys(cfg: ModelConfig, index: int) -> int:
    """Keys each query of layer `index` is counted against: the sequence, min(s, w) on a sliding layer, 0 on a
    linear-attention layer, min(s, index_topk) with sparse attention (s in its dense warm-up)."""
    s = cfg.seq_length
    if cfg.is_linear_layer(index):
        return 0
    if cfg.index_topk and cfg.attention == "mla":
        return sparse_attention_flops(cfg, index).keys
    return min(s, cfg.sliding_window) if cfg.arch == "llama" and cfg.is_sliding_layer(index) else s


def key_share(cfg: ModelConfig) -> float:
    """Counted attention over the full-square count, averaged over the layers: 1 without a window."""
    return sum(attended_keys(cfg, i) for i in range(cfg.num_layers)) / (cfg.seq_length * cfg.num_layers)


def executed_pairs(cfg: ModelConfig, index: int) -> float:
    """(query, key) pairs a causal kernel executes per sequence on layer `index`: s^2 / 2 on a full layer (the
    half FlashAttention-2's causal mask leaves), w s - w^2 / 2 on a sliding one."""
    s, keys = cfg.seq_length, attended_keys(cfg, index)
    return s * s / 2 if keys == s else keys * s - keys * keys / 2


def causal_share(cfg: ModelConfig) -> float:
    """Executed pairs over the counted ones (s x keys per layer), over all layers: 1/2 without a window."""
    counted = sum(cfg.seq_length * attended_keys(cfg, i) for i in range(cfg.num_layers))
    if not counted:  # every layer a linear-attention layer: no pairs at all
        return 0.5
    return sum(executed_pairs(cfg, i) for i in range(cfg.num_layers)) / counted


def attention_flops_per_key(cfg: ModelConfig) -> float:
    """Forward FLOPs of one query against one key in one layer (QK^T and PV): 4 a (Llama: a = heads x head size;
    GPT and BERT: h), 2 H (qk_nope + qk_rope + v_head_dim) with multi-head latent attention, 2 H (2 kv_lora_rank +
    qk_rope) absorbed with sparse attention (`plan.sparse_attention`; dense MLA's in its warm-up)."""
    if cfg.arch == "llama" and cfg.attention == "mla" and cfg.index_topk:
        return sparse_attention_flops(cfg, 0).per_key
    if cfg.arch == "llama" and cfg.attention == "mla":
        return 2 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 4 * (cfg.num_heads * cfg.attention_head_dim if cfg.arch == "llama" else cfg.hidden_size)


def window_saved_flops(cfg: ModelConfig, global_batch: int, recompute: bool) -> float:
    """FLOPs a window takes out of the full-square count (`flops_per_step` of the same model without the window;
    with it, `flops_per_token` already counts a sliding layer's min(s, w) keys): per sliding layer and token
    (s - min(s, w)) keys' worth, forward, backward (2x) and the recomputed forward."""
    missing = sum(cfg.seq_length - attended_keys(cfg, i) for i in range(cfg.num_layers) if cfg.is_sliding_layer(i))
    passes = 4 if recompute else 3
    return passes * global_batch * cfg.seq_length * attention_flops_per_key(cfg) * missing
