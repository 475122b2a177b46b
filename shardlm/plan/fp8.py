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

from shardlm.models.config import ModelConfig
from shardlm.plan.linear_attention import attention_weights

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
    projections (`linear_attention.attention_weights`: MLA's matrices, a linear layer's, or q, k, v and o) and dense
    MLP (3 h f) or, in an MoE layer, its top-k routed experts (expert) and shared experts (dense), not the router;
    each multi-token-prediction depth's layer and its 2h x h eh_proj. 2 FLOPs per multiply-add."""
    h = cfg.hidden_size
    matrices = 3 if cfg.arch == "llama" else 2
    dense = expert = 0.0
    for index in range(cfg.num_layers + cfg.mtp_layers):
        dense += 2 * attention_weights(cfg, index) + (4 * h * h if index >= cfg.num_layers else 0)
        if cfg.is_moe_layer(index):
            expert += 2 * matrices * cfg.moe_top_k * cfg.moe_ffn_size * h
            dense += 2 * matrices * (cfg.shared_ffn_size if cfg.moe_shared_experts else 0) * h
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


FP8_BYTES = 1 + 4 / 128
"""An FP8 element with its share of its 1 x 128 tile's fp32 scale (the report, 3.3.2)."""
E5M6_BYTES = 1.5 + 4 / 128
"""An element of the attention output, the one activation cached in DeepSeek's 12-bit E5M6 (3.3.4), with its
tile's scale."""


def _gemms(cfg: ModelConfig, index: int) -> list[tuple[int, int, int, int]]:
    """The FP8 GEMMs of layer `index` (a multi-token-prediction depth past the layers) as (input width K, output
    width N, rows per token, input rows its forward casts per token): GEMMs that read one tensor count its cast
    once (q_a with kv_a, gate with up; the routed experts' input, cast once before the dispatch, with the
    shared experts')."""
    h, heads = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        first = (h, (cfg.q_lora_rank or heads * qk) + latent, 1, 1)
        ups = [(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), 1, 1)]
        if cfg.q_lora_rank:
            ups.append((cfg.q_lora_rank, heads * qk, 1, 1))
        gemms = [first, *ups, (heads * cfg.v_head_dim, h, 1, 1)]
    else:
        a, kv = cfg.num_heads * cfg.attention_head_dim, cfg.kv_heads * cfg.attention_head_dim
        gemms = [(h, a + 2 * kv, 1, 1), (a, h, 1, 1)]
    if index >= cfg.num_layers:
        gemms.append((2 * h, h, 1, 1))  # eh_proj
    if cfg.is_moe_layer(index):
        shared, routed, k = cfg.shared_ffn_size if cfg.moe_shared_experts else 0, cfg.moe_ffn_size, cfg.moe_top_k
        gemms += [(h, 2 * routed, k, 1), (routed, h, k, k)]
        if shared:
            gemms += [(h, 2 * shared, 1, 0), (shared, h, 1, 1)]
    else:
        gemms += [(h, 2 * cfg.ffn_size, 1, 1), (cfg.ffn_size, h, 1, 1)]
    return gemms


def cast_bytes_per_token(cfg: ModelConfig) -> float:
    """HBM bytes per token of the FP8 casts around the GEMMs of every layer and depth, outside the GEMMs
    (DeepGEMM's rates take FP8 operands): the forward reads each input in BF16 and writes it in FP8 (the routed
    experts' once, before the dispatch); the backward reads each row's cached FP8 input and writes it again
    transposed into 128 x 1 tiles for the weight gradient, and casts each output gradient twice from BF16, into
    1 x 128 tiles for the input gradient and 128 x 1 for the weight gradient (the report, 3.3.2 and 3.5.2); the
    recomputed up-projections cast their inputs again."""
    total = 0.0
    for index in range(cfg.num_layers + cfg.mtp_layers):
        for k, n, rows, cast_rows in _gemms(cfg, index):
            total += cast_rows * k * (2 + FP8_BYTES) + rows * (2 * k * FP8_BYTES + 2 * n * (2 + FP8_BYTES))
        if cfg.attention == "mla":
            total += (cfg.q_lora_rank + cfg.kv_lora_rank) * (2 + FP8_BYTES)
    return total


def fp8_layer_bytes(cfg: ModelConfig, tp: int, micro_batch: int, sequence_parallel: bool, recompute: str) -> int:
    """What one layer keeps for its backward in DeepSeek-V3's stack, for one micro-batch on one TP rank (the
    larger of a dense and an MoE layer in a model that mixes them). Per token (H/t local heads, SP: the sequence
    split over t):

      BF16, split with SP: the layer input and the residual after attention (the two RMSNorms' inputs: the
          norms and their outputs are recomputed, 3.2.3), and MLA's latents, q_a's output (r_q) and kv_a's
          (r_kv + qk_rope), which the recomputed up-projections start from (3.2.3);
      the attention output H/t v in E5M6 (3.3.4) and its fp32 log-sum-exp per head (q, k and v come back from
          the recomputed up-projections);
      MoE: the router's fp32 scores E (split with SP); each of the top-k routed rows' FP8 input h and FP8
          SwiGLU input 2 f_e / t ("we cache the inputs of the SwiGLU operator and recompute its output", 3.3.4),
          the shared experts' FP8 SwiGLU input; the gate weight taken as applied to the SwiGLU output inside
          the expert, so that the recomputed output serves its gradient (where the report does not say; applied
          after the down projection instead, each row would keep its h-wide BF16 output as well);
      a dense layer: its FP8 SwiGLU input 2 f / t.

    Under full recomputation a layer keeps its input only."""
    tokens, h = micro_batch * cfg.seq_length, cfg.hidden_size
    split = tp if sequence_parallel else 1
    if recompute == "full":
        return round(tokens * 2 * h / split)
    residual = 2 * (2 * h) / split
    if cfg.attention == "mla":
        residual += 2 * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim) / split
    heads = cfg.num_heads // tp
    attention = heads * (cfg.v_head_dim or cfg.attention_head_dim) * E5M6_BYTES + 4 * heads
    dense = 2 * cfg.ffn_size / tp * FP8_BYTES
    moe = 0.0
    if cfg.moe_num_experts:
        rows = cfg.moe_top_k * (h + 2 * cfg.moe_ffn_size / tp) * FP8_BYTES
        shared = cfg.shared_ffn_size if cfg.moe_shared_experts else 0
        moe = 4 * cfg.moe_num_experts / split + rows + 2 * shared / tp * FP8_BYTES
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    mlp = moe if moe_layers == cfg.num_layers else max(dense, moe) if moe_layers else dense
    return round(tokens * (residual + attention + mlp))
