"""Model presets for the planner: the paper's GPT-2 and BERT models, its weak-scaling configs, Llama 3,
the Mixture-of-Experts models Mixtral 8x7B, Qwen3-30B-A3B and Qwen3-235B-A22B, and the DeepSeek-V3-shaped
models (multi-head latent attention, DeepSeek routing) DeepSeek-V3 and Moonlight-16B-A3B, with DeepSeek Sparse
Attention DeepSeek-V3.2 and GLM-5 (docs/plan-sparse-attention.md), DeepSeek-V4-Flash (hyper-connections and
compressed attention, `shardlm.plan.deepseek_v4`), GLM-4.5, gpt-oss
(sliding-window layers, attention sinks, biased experts), and the hybrid linear-attention models Qwen3-Next-80B-A3B
and Qwen3.5 (27B dense, 35B-A3B and 397B-A17B: three Gated DeltaNet layers before each gated full-attention one),
Kimi Linear 48B-A3B (Kimi Delta Attention beside MLA) and Nemotron-H 8B and Nemotron 3 Nano 30B-A3B (Mamba-2,
attention and MLP or MoE blocks; `shardlm.plan.recurrent`).

`--model` takes a preset name or a shardlm TOML config (its `[model]` section). BERT presets use
the same transformer layer as GPT (`shardlm.models.bert` builds it from the same parallel layers; the
time model charges bidirectional attention what the FLOP formula charges causal attention) plus the
BERT heads, counted exactly in `parameters.parameter_count`; activations are those of the GPT layer stack.
The MoE presets take the published shapes (their Hugging Face configs; a test counts the same totals
with transformers) and a training sequence of 4096 tokens (not their longer context windows). The DeepSeek
presets leave out the multi-token-prediction module of DeepSeek-V3's released weights (transformers' model does
not build it either; docs/plan.md), and so do the GLM-4.5, Qwen3-Next and Qwen3.5 presets (`mtp_layers=1` in a TOML
config counts it: `parameters.mtp_parameter_count`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from shardlm.config import LoraConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

GPT2_VOCAB = 50257
BERT_VOCAB = 30522
LLAMA3_VOCAB = 128256
MIXTRAL_VOCAB = 32000
GLM45_VOCAB = 151552
GLM5_VOCAB = 154880
QWEN3_VOCAB = 151936
DEEPSEEK_V3_VOCAB = 129280
MOONLIGHT_VOCAB = 163840
GPT_OSS_VOCAB = 201088
QWEN35_VOCAB = 248320
MISTRAL4_VOCAB = 131072
MINIMAX_M2_VOCAB = 200064
OLMO3_VOCAB = 100278
KIMI_LINEAR_VOCAB = 163840
NEMOTRON_H_VOCAB = 131072
SCALING_VOCAB = 51200  # paper §4: GPT-2's vocabulary padded to a multiple of 1024


def _gpt(layers: int, hidden: int, heads: int, vocab: int = GPT2_VOCAB, seq: int = 1024) -> ModelConfig:
    return ModelConfig(arch="gpt", num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=seq,
                       vocab_size=vocab)


def _llama3(layers: int, hidden: int, heads: int, ffn: int) -> ModelConfig:
    """Llama 3's shape: 8 KV heads, 128,256-token vocabulary, sequence 8192, untied output layer, theta 500,000."""
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=8,
                       seq_length=8192, vocab_size=LLAMA3_VOCAB, ffn_hidden_size=ffn, rope_theta=500000.0,
                       layernorm_epsilon=1e-5, dropout=0.0)


def _mixtral_8x7b() -> ModelConfig:
    """Mixtral 8x7B: Mistral's 7B attention (32 layers, h 4096, 32 heads, 8 KV heads) with 8 SwiGLU experts
    of width 14,336 in every layer, top-2 with the two weights renormalised, untied, theta 1e6."""
    return ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                       seq_length=4096, vocab_size=MIXTRAL_VOCAB, ffn_hidden_size=14336, rope_theta=1e6,
                       layernorm_epsilon=1e-5, dropout=0.0, moe_num_experts=8, moe_top_k=2,
                       moe_ffn_hidden_size=14336, moe_norm_topk_prob=True)


def _qwen3_moe(layers: int, hidden: int, heads: int, dense_ffn: int, expert_ffn: int) -> ModelConfig:
    """Qwen3-MoE: 4 KV heads of 128 channels with q/k RMSNorm, 128 experts top-8 (norm_topk_prob) in every
    layer, no shared experts, 151,936-token vocabulary, untied, theta 1e6. `dense_ffn` (intermediate_size)
    is the width a dense layer would have; all layers are MoE."""
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=4,
                       head_dim=128, qk_norm=True, seq_length=4096, vocab_size=QWEN3_VOCAB,
                       ffn_hidden_size=dense_ffn, rope_theta=1e6, layernorm_epsilon=1e-6, dropout=0.0,
                       moe_num_experts=128, moe_top_k=8, moe_ffn_hidden_size=expert_ffn, moe_norm_topk_prob=True)


def _deepseek_v3() -> ModelConfig:
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json, DeepseekV3ForCausalLM): 61 layers, h 7168, 128 heads of
    multi-head latent attention (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128); the first 3
    layers dense (intermediate_size 18432), the other 58 with 256 routed experts of width 2048 (top-8, sigmoid
    scores, expert bias, 8 groups of which the best 4, routed_scaling_factor 2.5, norm_topk_prob) and 1 shared
    expert; vocabulary 129,280, untied; RMSNorm epsilon 1e-6. Sequence 4096 (its pretraining length, before the
    YaRN extension); the multi-token-prediction module (num_nextn_predict_layers 1) is not counted."""
    return ModelConfig(arch="llama", attention="mla", num_layers=61, hidden_size=7168, num_heads=128,
                       q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                       seq_length=4096, vocab_size=DEEPSEEK_V3_VOCAB, ffn_hidden_size=18432, layernorm_epsilon=1e-6,
                       dropout=0.0, moe_num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, moe_shared_experts=1,
                       moe_first_dense_layers=3, moe_score="sigmoid", moe_norm_topk_prob=True, moe_routed_scaling=2.5,
                       moe_groups=8, moe_topk_groups=4, moe_expert_bias_rate=0.001)


def _deepseek_v32() -> ModelConfig:
    """DeepSeek-V3.2 (transformers' DeepseekV32Config defaults, DeepseekV32ForCausalLM): DeepSeek-V3's shape
    (`_deepseek_v3`) with DeepSeek Sparse Attention in every layer: a lightning indexer of 64 heads of 128 channels
    (index_n_heads, index_head_dim) chooses each query's 2048 keys (index_topk). Sequence 4096 as the other presets
    (the indexer pays off at long sequences: docs/plan-sparse-attention.md); the multi-token-prediction module is not
    counted."""
    return replace(_deepseek_v3(), index_topk=2048, index_heads=64, index_head_dim=128)


def _deepseek_v4_flash() -> ModelConfig:
    """DeepSeek-V4-Flash (transformers' DeepseekV4Config defaults, whose docstring names the checkpoint
    deepseek-ai/DeepSeek-V4-Flash-Base; DeepseekV4ForCausalLM): 43 layers, h 4096, 4 hyper-connection streams
    (hc_mult, 20 Sinkhorn iterations, eps 1e-6); attention of 64 heads of 512 (head_dim; the rotary on the last 64,
    partial_rotary_factor 64 / 512) over one shared key = value head, q_lora_rank 1024, a sliding window of 128
    tokens, per-head sinks, 8 output groups projected to 1024 (o_groups, o_lora_rank); its default layer_types,
    2 HCA layers (128:1, compress_rates) and then CSA (4:1 with an indexer of 64 heads of 128 choosing 512 entries)
    and HCA alternating; rope_theta 1e4, compress_rope_theta 160,000; MoE in every layer: 256 routed experts of
    2048 (top-6, sqrt(softplus) scores, norm_topk_prob, routed_scaling_factor 1.5, the score-correction bias) and
    one shared expert of 2048, the first 3 hash-routed (its default mlp_layer_types), swiglu_limit 10; vocabulary
    129,280, untied; RMSNorm epsilon 1e-6. Sequence 4096 as the other presets (`--seq-length` for longer); the
    multi-token-prediction layer (num_nextn_predict_layers 1) is not counted (transformers does not build it)."""
    ratios = [128, 128] + [4 if i % 2 else 128 for i in range(41)]
    return ModelConfig(arch="llama", num_layers=43, hidden_size=4096, num_heads=64, num_kv_heads=1, head_dim=512,
                       seq_length=4096, vocab_size=DEEPSEEK_V3_VOCAB, ffn_hidden_size=2048, dropout=0.0,
                       layernorm_epsilon=1e-6, q_lora_rank=1024, qk_rope_head_dim=64, sliding_window=128,
                       attention_sinks=True, rope_theta=10000.0, global_rope_theta=160000.0, hc_mult=4,
                       compress_ratios=ratios, output_groups=8, output_rank=1024, index_topk=512, index_heads=64,
                       index_head_dim=128, moe_num_experts=256, moe_top_k=6, moe_ffn_hidden_size=2048,
                       moe_shared_experts=1, moe_score="sqrtsoftplus", moe_routed_scaling=1.5, moe_expert_bias=True,
                       moe_hash_layers=3, swiglu_clip=10.0)


def _glm5() -> ModelConfig:
    """GLM-5 (transformers' GlmMoeDsaConfig defaults, GlmMoeDsaForCausalLM): 78 layers, h 6144, 64 heads of
    multi-head latent attention (q_lora_rank 2048, kv_lora_rank 512, qk_nope 192 + qk_rope 64, v 256) with
    DeepSeek Sparse Attention (an indexer of 32 heads of 128 channels choosing 2048 keys); its indexer_types, by
    default (index_topk_freq 1), "full" in every layer (a "shared" layer would reuse the last full layer's choice
    and hold no indexer); the first 3 layers dense (intermediate_size 12288), the other 75 with 256 routed experts
    of width 2048 (top-8, sigmoid scores with the score-correction bias, one group, routed_scaling_factor 2.5,
    norm_topk_prob) and 1 shared expert; vocabulary 154,880, untied; RMSNorm epsilon 1e-5. Sequence 4096; the
    multi-token-prediction layer is not counted."""
    return ModelConfig(arch="llama", attention="mla", num_layers=78, hidden_size=6144, num_heads=64,
                       q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                       seq_length=4096, vocab_size=GLM5_VOCAB, ffn_hidden_size=12288, layernorm_epsilon=1e-5,
                       dropout=0.0, moe_num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, moe_shared_experts=1,
                       moe_first_dense_layers=3, moe_score="sigmoid", moe_norm_topk_prob=True, moe_routed_scaling=2.5,
                       moe_expert_bias=True, index_topk=2048, index_heads=32, index_head_dim=128,
                       index_layer_types=["full"] * 78)


def _moonlight_16b_a3b() -> ModelConfig:
    """Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json, DeepseekV3ForCausalLM): 27 layers, h 2048,
    16 heads of multi-head latent attention without the query's low-rank path (q_lora_rank null), kv_lora_rank
    512, qk_nope 128 + qk_rope 64, v 128; the first layer dense (intermediate_size 11264), the other 26 with 64
    routed experts of width 1408 (top-6, sigmoid scores, expert bias, one group, routed_scaling_factor 2.446,
    norm_topk_prob) and 2 shared experts; vocabulary 163,840, untied; rope_theta 50,000; sequence 4096."""
    return ModelConfig(arch="llama", attention="mla", num_layers=27, hidden_size=2048, num_heads=16,
                       q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                       seq_length=4096, vocab_size=MOONLIGHT_VOCAB, ffn_hidden_size=11264, rope_theta=50000.0,
                       layernorm_epsilon=1e-5, dropout=0.0, moe_num_experts=64, moe_top_k=6,
                       moe_ffn_hidden_size=1408, moe_shared_experts=2, moe_first_dense_layers=1, moe_score="sigmoid",
                       moe_norm_topk_prob=True, moe_routed_scaling=2.446, moe_expert_bias_rate=0.001)


def _gemma4_e4b() -> ModelConfig:
    """Gemma 4 E4B (google/gemma-4-E4B-it's text model, as NVIDIA's Megatron Bridge recipe describes it, with
    Gemma4TextConfig's defaults for the rest): 42 layers, h 2560, MLP 10240 (tanh GeLU), 8 query heads; sliding
    layers (window 512) of 2 KV heads of 256 at base 1e4, every sixth layer full, of 2 KV heads of 512 with
    proportional RoPE on a quarter of the frequencies at base 1e6; per-layer inputs of 256 from a 262,144-row table;
    the last 18 layers sharing keys and values; logits soft-capped at 30; vocabulary 262,144, tied. Sequence 8192."""
    layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(42)]
    return ModelConfig(arch="llama", sandwich_norms=True, num_layers=42, hidden_size=2560, num_heads=8,
                       num_kv_heads=2, head_dim=256, global_head_dim=512, global_kv_heads=2, seq_length=8192,
                       vocab_size=262144, ffn_hidden_size=10240, activation="gelu_tanh", layernorm_epsilon=1e-6,
                       dropout=0.0, attention_dropout=0.0, tie_embeddings=True, qk_norm=True, value_norm=True,
                       attention_scale=1.0, embedding_scale=True, sliding_window=512, layer_types=layer_types,
                       rope_theta=1e4,
                       global_rope_theta=1e6, global_rope_fraction=0.25, per_layer_input_size=256,
                       per_layer_vocab_size=262144, kv_shared_layers=18, final_logit_softcap=30.0)


def _mistral_small_4() -> ModelConfig:
    """Mistral Small 4 (mistralai/Mistral-Small-4-119B-2603's text model; transformers' Mistral4Config defaults): 36
    layers, h 4096, 32 heads of multi-head latent attention with the query's low-rank path (q_lora_rank 1024),
    kv_lora_rank 256, qk_nope 64 + qk_rope 64, v 128; every layer an MoE layer of 128 routed experts of width 2048
    (top-4, softmax scores renormalized, one group) and 1 shared expert; YaRN factor 128 over 8192 positions with
    Llama 4's query scaling (beta 0.1); vocabulary 131,072, untied; RMSNorm epsilon 1e-6. Sequence 8192."""
    return ModelConfig(arch="llama", attention="mla", num_layers=36, hidden_size=4096, num_heads=32,
                       q_lora_rank=1024, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
                       seq_length=8192, vocab_size=MISTRAL4_VOCAB, ffn_hidden_size=12288, layernorm_epsilon=1e-6,
                       dropout=0.0, moe_num_experts=128, moe_top_k=4, moe_ffn_hidden_size=2048, moe_shared_experts=1,
                       moe_score="softmax", moe_norm_topk_prob=True, moe_group_score="top2_sum",
                       rope_yarn_factor=128.0, rope_yarn_original_positions=8192, rope_yarn_mscale_all_dim=1.0,
                       query_scale_beta=0.1, query_scale_positions=8192)


def _minimax_m2() -> ModelConfig:
    """MiniMax-M2 (MiniMaxAI/MiniMax-M2's config.json; transformers' MiniMaxM2Config defaults): 62 layers, h 3072, 48
    query heads and 8 KV heads of 128 channels with QK RMSNorm over whole projections, RoPE (theta 5e6) on the first
    64 channels of each head; every layer an MoE layer of 256 experts of width 1536 (top-8, sigmoid scores with the
    score-correction bias, renormalized), no shared expert; vocabulary 200,064, untied; RMSNorm epsilon 1e-6.
    Sequence 4096. The multi-token-prediction modules are not counted."""
    return ModelConfig(arch="llama", num_layers=62, hidden_size=3072, num_heads=48, num_kv_heads=8, head_dim=128,
                       qk_norm=True, qk_norm_scope="projection", rope_fraction=0.5, seq_length=4096,
                       vocab_size=MINIMAX_M2_VOCAB, ffn_hidden_size=1536, rope_theta=5e6, layernorm_epsilon=1e-6,
                       dropout=0.0, moe_num_experts=256, moe_top_k=8, moe_ffn_hidden_size=1536, moe_score="sigmoid",
                       moe_norm_topk_prob=True, moe_expert_bias=True)


def _olmo2(*shape: int) -> ModelConfig:
    """OLMo 2 (allenai/OLMo-2-1124-7B and -13B, OLMo-2-0325-32B, Olmo2ForCausalLM): `_olmo3`'s block of that shape
    without sliding windows, vocabulary 100,352 (dolma2, padded), sequence 4096."""
    return replace(_olmo3(*shape), vocab_size=100352, seq_length=4096, sliding_window=0, layer_types=[])


def _olmo3(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> ModelConfig:
    """OLMo 3 (allenai/Olmo-3-1025-7B and Olmo-3-1125-32B, Olmo3ForCausalLM): norms after the attention and MLP
    outputs (`norm_placement = "post"`), QK RMSNorm over whole projections, sliding windows of 4096 on 3 of every 4
    layers (the 4th full), RoPE theta 5e5, SwiGLU; vocabulary 100,278 (dolma2), untied; RMSNorm epsilon 1e-6. Sequence
    8192 (pretraining's; the long-context stage extends it)."""
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                       seq_length=8192, vocab_size=OLMO3_VOCAB, ffn_hidden_size=ffn, layernorm_epsilon=1e-6,
                       dropout=0.0, attention_dropout=0.0, rope_theta=5e5, qk_norm=True, qk_norm_scope="projection",
                       norm_placement="post", sliding_window=4096,
                       layer_types=["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(layers)])


def _glm45(layers: int, hidden: int, dense_ffn: int, experts: int, expert_ffn: int, dense_layers: int,
           qk_norm: bool) -> ModelConfig:
    """GLM-4.5 (zai-org/GLM-4.5 and GLM-4.5-Air, Glm4MoeForCausalLM): 96 query heads and 8 KV heads of 128
    channels with q/k/v biases, RoPE on the first half of each head (theta 1e6), the first `dense_layers`
    dense, the others with `experts` routed experts (top-8, sigmoid scores with the score-correction bias)
    and one shared expert of the same width; vocabulary 151,552, untied; sequence 4096. The
    multi-token-prediction layer is not counted."""
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=96, num_kv_heads=8,
                       head_dim=128, qk_norm=qk_norm, attention_bias=True, rope_fraction=0.5, seq_length=4096,
                       vocab_size=GLM45_VOCAB, ffn_hidden_size=dense_ffn, rope_theta=1e6, layernorm_epsilon=1e-5,
                       dropout=0.0, moe_num_experts=experts, moe_top_k=8, moe_ffn_hidden_size=expert_ffn,
                       moe_shared_experts=1, moe_first_dense_layers=dense_layers, moe_score="sigmoid",
                       moe_norm_topk_prob=True, moe_routed_scaling=2.5 if qk_norm else 1.0, moe_expert_bias=True)


def _gpt_oss(layers: int, experts: int) -> ModelConfig:
    """gpt-oss (openai/gpt-oss-20b and gpt-oss-120b config.json, GptOssForCausalLM; transformers' GptOssConfig
    defaults are the 120b's): h 2880, 64 query heads and 8 KV heads of 64 channels with q/k/v and output biases
    and a learned sink per head; layers alternate sliding-window (128 tokens, first) and full attention; every
    layer an MoE layer of `experts` experts of width 2880, top-4 (softmax over the top-4 logits), with a router
    bias, gate/up and down biases and the clamped SwiGLU (limit 7, alpha 1.702); vocabulary 201,088, untied;
    RoPE theta 150,000 with YaRN factor 32 over 4096 positions (no truncation), 131,072 positions. Sequence 4096
    (YaRN's original length)."""
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                       attention_bias=True, attention_output_bias=True, attention_sinks=True, sliding_window=128,
                       layer_types=["sliding_attention", "full_attention"] * (layers // 2), seq_length=4096,
                       vocab_size=GPT_OSS_VOCAB, ffn_hidden_size=2880, rope_theta=150000.0, rope_yarn_factor=32.0,
                       rope_yarn_original_positions=4096, rope_yarn_truncate=False, layernorm_epsilon=1e-5,
                       dropout=0.0, moe_num_experts=experts, moe_top_k=4, moe_ffn_hidden_size=2880,
                       moe_norm_topk_prob=True, moe_router_bias=True, moe_linear_bias=True, swiglu_limit=7.0,
                       swiglu_alpha=1.702)


def _qwen3_hybrid(layers: int, hidden: int, heads: int, kv_heads: int, value_heads: int, vocab: int,
                  dense_ffn: int = 0, experts: int = 0, top_k: int = 0, expert_ffn: int = 0) -> ModelConfig:
    """Qwen3-Next / Qwen3.5 (their config.json; transformers' Qwen3NextForCausalLM, Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM): of every four layers three Gated DeltaNet layers (16 key heads and `value_heads` value
    heads of 128 channels, a 4-tap convolution) and one gated full-attention layer (`heads` query heads and
    `kv_heads` KV heads of 256 channels, q/k RMSNorm, RoPE on the first quarter of each head, theta 1e7);
    zero-centred RMSNorms (epsilon 1e-6); untied embeddings. MoE models: every layer routes to `top_k` of
    `experts` experts of width `expert_ffn` (softmax, norm_topk_prob) plus one shared expert of the same width
    behind a sigmoid gate; dense ones a SwiGLU of width `dense_ffn` (intermediate_size, which Qwen3-Next's MoE
    config also states without a dense layer using it). Sequence 4096 (not their 262,144-token
    window). The multi-token-prediction layer (mtp_num_hidden_layers 1) and Qwen3.5's vision tower are not
    counted."""
    moe = {}
    if experts:
        moe = dict(moe_num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=expert_ffn, moe_norm_topk_prob=True,
                   moe_shared_experts=1, moe_shared_ffn_hidden_size=expert_ffn, moe_shared_expert_gate=True)
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=256, qk_norm=True, rope_fraction=0.25, seq_length=4096, vocab_size=vocab,
                       ffn_hidden_size=dense_ffn or expert_ffn, rope_theta=1e7, layernorm_epsilon=1e-6, dropout=0.0,
                       layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                       linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel=4, attention_output_gate=True,
                       norm_zero_centered=True, **moe)


def _kimi_linear_48b_a3b() -> ModelConfig:
    """Kimi Linear 48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json; transformers' KimiLinearConfig):
    27 layers, h 2304; Kimi Delta Attention in 20 of them (32 heads of 128 channels, a 4-tap convolution) and MLA
    without positions in layers 4, 8, 12, 16, 20, 24 and 27 (1-based; 32 heads, no query low-rank path,
    kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128); the first layer a dense SwiGLU of 9216, the others 256
    routed experts of width 1024 (top-8, sigmoid scores with the score-correction bias, renormalized, scaled by
    2.446) and one shared expert; vocabulary 163,840, untied; RMSNorm epsilon 1e-5. Sequence 4096."""
    full = {4, 8, 12, 16, 20, 24, 27}
    layer_types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(27)]
    return ModelConfig(arch="llama", attention="mla", mla_nope=True, num_layers=27, hidden_size=2304, num_heads=32,
                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, seq_length=4096,
                       vocab_size=KIMI_LINEAR_VOCAB, ffn_hidden_size=9216, layernorm_epsilon=1e-5, dropout=0.0,
                       layer_types=layer_types, linear_attention_rule="kimi_delta", linear_num_key_heads=32,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel=4, moe_num_experts=256, moe_top_k=8, moe_ffn_hidden_size=1024,
                       moe_first_dense_layers=1, moe_shared_experts=1, moe_score="sigmoid", moe_expert_bias=True,
                       moe_norm_topk_prob=True, moe_routed_scaling=2.446)


def _nemotron_h(pattern: str, hidden: int, kv_heads: int, mamba_heads: int, ffn: int = 0, experts: int = 0,
                top_k: int = 0, expert_ffn: int = 0, shared_ffn: int = 0) -> ModelConfig:
    """Nemotron-H and Nemotron 3 (their config.json; transformers' NemotronHConfig): one mixer a block as
    `pattern` (hybrid_override_pattern) says: Mamba-2 ("M": `mamba_heads` heads of 64 channels, 8 groups of a
    128-channel state, a 4-tap convolution with biases, chunks of 128), attention without positions ("*": 32
    query heads and `kv_heads` KV heads of 128 channels), a ReLU^2 MLP of `ffn` ("-") or an MoE layer ("E":
    `experts` ReLU^2 experts of `expert_ffn`, top-`top_k`, sigmoid scores with the score-correction bias,
    renormalized, scaled by 2.5, one shared expert of `shared_ffn`); vocabulary 131,072, untied; RMSNorm epsilon
    1e-5. Sequence 8192."""
    moe = {}
    if experts:
        moe = dict(moe_num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=expert_ffn, moe_shared_experts=1,
                   moe_shared_ffn_hidden_size=shared_ffn, moe_score="sigmoid", moe_expert_bias=True,
                   moe_norm_topk_prob=True, moe_routed_scaling=2.5)
    return ModelConfig(arch="llama", num_layers=len(pattern), hidden_size=hidden, num_heads=32, num_kv_heads=kv_heads,
                       head_dim=0 if hidden == 32 * 128 else 128, seq_length=8192,
                       vocab_size=NEMOTRON_H_VOCAB, ffn_hidden_size=ffn or expert_ffn,
                       layernorm_epsilon=1e-5, dropout=0.0, layer_pattern=pattern, mamba_num_heads=mamba_heads,
                       mamba_head_dim=64, mamba_state_size=128, mamba_groups=8, mamba_conv_kernel=4,
                       mamba_chunk_size=128, **moe)


def _bert(layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(arch="bert", num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=512,
                       vocab_size=BERT_VOCAB)


MODEL_PRESETS: dict[str, ModelConfig] = {
    "gpt2-355m": _gpt(24, 1024, 16),
    "gpt2-2.5b": _gpt(54, 1920, 20),
    "gpt2-8.3b": _gpt(72, 3072, 24),
    "bert-336m": _bert(24, 1024, 16),
    "bert-1.3b": _bert(24, 2048, 32),
    "bert-3.9b": _bert(48, 2560, 40),
    # paper §4 / Table 1: hidden per head 96, vocab 51,200, sequence 1024
    "scaling-1.2b": _gpt(40, 1536, 16, SCALING_VOCAB),
    "scaling-2.5b": _gpt(54, 1920, 20, SCALING_VOCAB),
    "scaling-4.2b": _gpt(64, 2304, 24, SCALING_VOCAB),
    "scaling-8.3b": _gpt(72, 3072, 32, SCALING_VOCAB),
    "llama3-8b": _llama3(32, 4096, 32, 14336),
    "llama3-70b": _llama3(80, 8192, 64, 28672),
    "mixtral-8x7b": _mixtral_8x7b(),
    "qwen3-30b-a3b": _qwen3_moe(48, 2048, 32, 6144, 768),
    "qwen3-235b-a22b": _qwen3_moe(94, 4096, 64, 12288, 1536),
    "deepseek-v3": _deepseek_v3(),
    "deepseek-v3.2": _deepseek_v32(),
    "glm-5": _glm5(),
    # transformers' DeepseekV4Config defaults (deepseek-ai/DeepSeek-V4-Flash-Base), 284B; V4-Pro's layer and expert
    # counts are not in transformers (only its attention: 128 heads, 16 output groups, h 7168), so no preset
    "deepseek-v4": _deepseek_v4_flash(),
    "deepseek-v4-flash": _deepseek_v4_flash(),
    "mistral-small-4": _mistral_small_4(),
    "minimax-m2": _minimax_m2(),
    "olmo-2-7b": _olmo2(32, 4096, 32, 32, 11008),
    "olmo-2-13b": _olmo2(40, 5120, 40, 40, 13824),
    "olmo-2-32b": _olmo2(64, 5120, 40, 8, 27648),
    "olmo-3-7b": _olmo3(32, 4096, 32, 32, 11008),
    "olmo-3-32b": _olmo3(64, 5120, 40, 8, 27648),
    "gemma-4-e4b": _gemma4_e4b(),
    "moonlight-16b-a3b": _moonlight_16b_a3b(),
    "glm-4.5": _glm45(92, 5120, 12288, 160, 1536, 3, qk_norm=True),
    "glm-4.5-air": _glm45(46, 4096, 10944, 128, 1408, 1, qk_norm=False),
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (transformers' Qwen3NextConfig defaults are its shape; THUDM/slime
    # scripts/models/qwen3-next-80B-A3B.sh): 48 layers, h 2048, 16 heads / 2 KV, 32 value heads, 512 experts top-10
    "qwen3-next-80b-a3b": _qwen3_hybrid(48, 2048, 16, 2, 32, QWEN3_VOCAB, dense_ffn=5120, experts=512, top_k=10,
                                        expert_ffn=512),
    # Qwen/Qwen3.5-27B config.json text_config (THUDM/slime scripts/models/qwen3.5-27B.sh): dense, SwiGLU 17408
    "qwen3.5-27b": _qwen3_hybrid(64, 5120, 24, 4, 48, QWEN35_VOCAB, dense_ffn=17408),
    # Qwen/Qwen3.5-35B-A3B text_config (transformers' Qwen3_5MoeTextConfig defaults; slime qwen3.5-35B-A3B.sh)
    "qwen3.5-35b-a3b": _qwen3_hybrid(40, 2048, 16, 2, 32, QWEN35_VOCAB, experts=256, top_k=8, expert_ffn=512),
    # Qwen/Qwen3.5-397B-A17B text_config (slime scripts/models/qwen3.5-397B-A17B.sh): 64 value heads, 512 experts
    "qwen3.5-397b-a17b": _qwen3_hybrid(60, 4096, 32, 2, 64, QWEN35_VOCAB, experts=512, top_k=10, expert_ffn=1024),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: KDA in 20 of 27 layers, MLA (NoPE) in 7, 256 experts top-8
    "kimi-linear-48b-a3b": _kimi_linear_48b_a3b(),
    # nvidia/Nemotron-H-8B-Base-8K config.json: 52 blocks (24 Mamba-2, 4 attention, 24 ReLU^2 MLPs of 21504),
    # h 4096, 128 Mamba heads, 8 KV heads (NemotronHConfig's defaults are this shape)
    "nemotron-h-8b": _nemotron_h("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 4096, 8, 128, ffn=21504),
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B config.json: 52 blocks (23 Mamba-2, 6 attention, 23 MoE of 128 experts
    # of 1856, top-6, a shared expert of 3712), h 2688, 64 Mamba heads, 2 KV heads
    "nemotron-3-nano-30b-a3b": _nemotron_h("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", 2688, 2, 64,
                                           experts=128, top_k=6, expert_ffn=1856, shared_ffn=3712),
}
# Narayanan et al. 2021 (SC21), Table 1: GPT with sequence 2048 and vocabulary 51,200; name -> (layers, hidden, heads)
SC21_SHAPES = {"1.7b": (24, 2304, 24), "3.6b": (30, 3072, 32), "7.5b": (36, 4096, 32), "18.4b": (40, 6144, 48),
               "39.1b": (48, 8192, 64), "76.1b": (60, 10240, 80), "145.6b": (80, 12288, 96),
               "310.1b": (96, 16384, 128), "529.6b": (105, 20480, 128), "1008b": (128, 25600, 160)}
MODEL_PRESETS.update({f"sc21-{name}": _gpt(*shape, vocab=SCALING_VOCAB, seq=2048)
                      for name, shape in SC21_SHAPES.items()})

TOKENIZER_VOCAB = {"gpt2": GPT2_VOCAB, "bert": BERT_VOCAB}


@dataclass(frozen=True)
class PlannedModel:
    """A model the planner sizes: its shape and where it came from."""

    name: str
    """Preset name or config path."""
    config: ModelConfig
    """Layers, hidden size, heads, sequence length, vocabulary (real, before padding)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """A TOML config's `[lora]` section: with rank > 0 only adapters train (`shardlm.plan.lora`)."""


def resolve_model(spec: str) -> PlannedModel:
    """A preset name (case-insensitive) or a path to a shardlm TOML config."""
    if spec.lower() in MODEL_PRESETS:
        return PlannedModel(spec.lower(), MODEL_PRESETS[spec.lower()])
    path = Path(spec)
    if not path.suffix == ".toml" and not path.exists():
        raise UserError(f"--model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a TOML config file")
    from shardlm.config import load_config

    run = load_config(path)
    model = run.model
    if model.vocab_size <= 0:
        if run.data.tokenizer not in TOKENIZER_VOCAB:
            raise UserError(f"{path}: set model.vocab_size (the planner cannot read a {run.data.tokenizer} "
                            "tokenizer's size)")
        model = ModelConfig(**{**model.__dict__, "vocab_size": TOKENIZER_VOCAB[run.data.tokenizer]})
    return PlannedModel(str(path), model, run.lora)


def check_model(cfg: ModelConfig) -> None:
    """Reject shapes the model cannot have; UserError naming the field."""
    for key in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size"):
        if getattr(cfg, key) < 1:
            raise UserError(f"model.{key}={getattr(cfg, key)} must be at least 1")
    if cfg.moe_num_experts:
        if cfg.arch not in ("gpt", "llama"):
            raise UserError(f'model.moe_num_experts needs model.arch="gpt" or "llama", not "{cfg.arch}"')
        if not 1 <= cfg.moe_top_k <= cfg.moe_num_experts:
            raise UserError(f"model.moe_top_k={cfg.moe_top_k} must be between 1 and "
                            f"model.moe_num_experts={cfg.moe_num_experts}")
        if cfg.moe_layer_interval < 1 or cfg.moe_first_dense_layers < 0 or cfg.moe_shared_experts < 0:
            raise UserError("model.moe_layer_interval must be >= 1, model.moe_first_dense_layers and "
                            "model.moe_shared_experts >= 0")
    if cfg.hidden_size % cfg.num_heads and not (cfg.arch == "llama" and (cfg.head_dim or cfg.attention == "mla")):
        raise UserError(f"model.hidden_size={cfg.hidden_size} is not divisible by model.num_heads={cfg.num_heads}")
    if cfg.hc_mult:  # DeepSeek-V4: the model's own check (imports torch)
        from shardlm.models.deepseek_v4 import check_deepseek_v4

        if (problem := check_deepseek_v4(cfg)) is not None:
            raise UserError(problem)
    elif cfg.index_topk or cfg.index_heads or cfg.index_layer_types:  # the model's own check (imports torch)
        from shardlm.models.sparse_attention import check_sparse_attention

        if (problem := check_sparse_attention(cfg)) is not None:
            raise UserError(problem)
