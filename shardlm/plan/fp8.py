"""FP8 GEMMs as DeepSeek-V3 trained them, and the rates DeepSeek measured for its FP8 kernels on an H800.

DeepSeek-V3's report (DeepSeek-AI 2024, arXiv 2412.19437, section 3.3.1) runs "most core computation kernels,
i.e., GEMM operations" in FP8 (E4M3, 1 x 128 activation and 128 x 128 weight scaling): all three GEMMs of each
Linear operator (Fprop, Dgrad, Wgrad), and keeps BF16 or FP32 for "the embedding module, the output head, MoE
gating modules, normalization operators, and attention operators". So the FP8 GEMMs are a layer's attention
projections and its MLP or experts (and a multi-token-prediction depth's, with its eh_proj); the attention core,
the output head and the router stay at the planner's BF16 rates.

Rates: DeepGEMM, DeepSeek's FP8 GEMM library (github.com/deepseek-ai/DeepGEMM, README "Performance", H800, NVCC
12.8), measured on exactly DeepSeek-V3's shapes: the normal GEMMs at M = 4096 (a 4096-token micro-batch through
q_a + kv_a, q_b, kv_b, o and the shared expert's gate/up and down) and the grouped contiguous GEMMs of the
experts' training forward (gate/up N = 4096, K = 7168; down N = 7168, K = 2048). Each kind's rate is the
FLOP-weighted harmonic mean of its rows (the time their FLOPs take together), so the mix of DeepSeek-V3's shapes
is the rows' own: 1,132 TFLOP/s for the dense GEMMs, 1,220 for the experts'. The table measures forward shapes;
the backward's Dgrad and Wgrad GEMMs are charged the same rates (DeepGEMM published its weight-gradient kernels
later, without a table). The library was published in 2025, after the run; it is the measured source there is.
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig, mla_weights

# (M, N, K, TFLOP/s): DeepGEMM README, "Normal GEMMs for dense models", the M = 4096 rows
DEEPGEMM_DENSE_ROWS = ((4096, 2112, 7168, 1058), (4096, 24576, 1536, 990), (4096, 32768, 512, 590),
                       (4096, 7168, 16384, 1358), (4096, 4096, 7168, 1304), (4096, 7168, 2048, 1025))
# (groups, M per group, N, K, TFLOP/s): "Grouped GEMMs for MoE models (contiguous layout)"
DEEPGEMM_GROUPED_ROWS = ((4, 8192, 4096, 7168, 1297), (4, 8192, 7168, 2048, 1099), (8, 4096, 4096, 7168, 1288),
                         (8, 4096, 7168, 2048, 1093))


def _harmonic(rows: list[tuple[float, float]]) -> float:
    """The rate at which (FLOPs, TFLOP/s) rows run together: all their FLOPs over the sum of their times."""
    return sum(f for f, _ in rows) / sum(f / rate for f, rate in rows)


DEEPGEMM_DENSE_TFLOPS = _harmonic([(2 * m * n * k, rate) for m, n, k, rate in DEEPGEMM_DENSE_ROWS])
"""DeepGEMM's FP8 normal GEMMs on DeepSeek-V3's shapes at M = 4096 on an H800, together: 1,132 TFLOP/s."""
DEEPGEMM_GROUPED_TFLOPS = _harmonic([(2 * g * m * n * k, rate) for g, m, n, k, rate in DEEPGEMM_GROUPED_ROWS])
"""DeepGEMM's FP8 grouped GEMMs of DeepSeek-V3's experts on an H800, together: 1,220 TFLOP/s."""


def fp8_gemm_flops_per_token(cfg: ModelConfig) -> tuple[float, float]:
    """(dense, expert) forward FLOPs per token of the GEMMs DeepSeek-V3 runs in FP8: every layer's attention
    projections (MLA's matrices, or q, k, v and o) and dense MLP (3 h f) or, in an MoE layer, its top-k routed
    experts (expert) and shared experts (dense), not the router; each multi-token-prediction depth's layer and
    its 2h x h eh_proj. 2 FLOPs per multiply-add."""
    h = cfg.hidden_size
    if cfg.arch == "llama" and cfg.attention == "mla":
        attention = mla_weights(cfg)
    else:
        a, kv = cfg.num_heads * cfg.attention_head_dim, cfg.kv_heads * cfg.attention_head_dim
        attention = 2 * h * a + 2 * h * kv
    matrices = 3 if cfg.arch == "llama" else 2
    dense = expert = 0.0
    for index in range(cfg.num_layers + cfg.mtp_layers):
        dense += 2 * attention + (4 * h * h if index >= cfg.num_layers else 0)
        if cfg.is_moe_layer(index):
            expert += 2 * matrices * cfg.moe_top_k * cfg.moe_ffn_size * h
            dense += 2 * matrices * cfg.moe_shared_experts * cfg.moe_ffn_size * h
        else:
            dense += 2 * matrices * cfg.ffn_size * h
    return dense, expert


def fp8_gemm_seconds(cfg: ModelConfig, tokens: float, recompute: bool, bf16_flops_per_s: float) -> tuple[float, float]:
    """(seconds at the BF16 GEMM rate, seconds at DeepGEMM's FP8 rates) of the FP8 GEMMs of `tokens` tokens'
    training (forward, Dgrad and Wgrad: 3x the forward, 4x with the recomputed forward) on one GPU."""
    dense, expert = fp8_gemm_flops_per_token(cfg)
    passes = tokens * (4 if recompute else 3)
    fp8 = passes * (dense / (DEEPGEMM_DENSE_TFLOPS * 1e12) + expert / (DEEPGEMM_GROUPED_TFLOPS * 1e12))
    return passes * (dense + expert) / bf16_flops_per_s, fp8


def _dense_rate(n: int, k: int) -> float:
    """DeepGEMM's measured FP8 rate of an (M = 4096) x n x k GEMM when the table has the shape, else the dense
    rows' together (TFLOP/s)."""
    return next((rate for _, rn, rk, rate in DEEPGEMM_DENSE_ROWS if (rn, rk) == (n, k)), DEEPGEMM_DENSE_TFLOPS)


def mla_up_recompute_seconds(cfg: ModelConfig, tokens: float) -> float:
    """GPU-seconds of recomputing MLA's up-projections (q_b and kv_b) in the backward for `tokens` tokens, every
    layer and MTP depth, in FP8: DeepSeek-V3's report, section 3.3.4 ("Recomputation of RMSNorm and MLA
    Up-Projection"), which keeps their outputs out of memory. 0 without MLA."""
    if cfg.arch != "llama" or cfg.attention != "mla":
        return 0.0
    heads, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q_n, kv_n = heads * qk, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    per_token = 2 * kv_n * cfg.kv_lora_rank / (_dense_rate(kv_n, cfg.kv_lora_rank) * 1e12)
    if cfg.q_lora_rank:
        per_token += 2 * q_n * cfg.q_lora_rank / (_dense_rate(q_n, cfg.q_lora_rank) * 1e12)
    return tokens * (cfg.num_layers + cfg.mtp_layers) * per_token
