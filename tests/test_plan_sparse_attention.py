"""`shardlm plan` with DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5; `shardlm.plan.sparse_attention`).

Claims: the deepseek-v3.2 and glm-5 presets have the parameter totals transformers counts for its meta-device
builds from DeepseekV32Config's and GlmMoeDsaConfig's defaults (GLM-5's "shared" layers hold no indexer);
`flops_per_token` of a tiny DSA model is the count by hand, and each DSA term is what torch's FLOP counter
measures in the model's own functions; at 128K tokens DeepSeek-V3.2's attention and indexers take a small
fraction of dense MLA's attention FLOPs and the indexers' O(s^2) scoring is counted (docs/plan-sparse-attention.md);
the pipeline, kernel and context-parallel parts of the planner read the same counts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.plan.flops import flops_per_token, mla_weights
from shardlm.plan.models import MODEL_PRESETS, check_model
from shardlm.plan.parameters import layer_parameter_count, layers_parameter_count, parameter_count
from shardlm.plan.sparse_attention import attention_comparison, has_indexer, sparse_attention_flops

SEQ_128K = 131072


def _hf(name: str, **overrides):
    """transformers' config for a preset: its defaults (with `overrides`), and the causal-LM class."""
    if name == "deepseek-v3.2":
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

        return DeepseekV32Config(**overrides), DeepseekV32ForCausalLM
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    return GlmMoeDsaConfig(**overrides), GlmMoeDsaForCausalLM


def _hf_count(config, model_class) -> int:
    """Parameters (and the expert-bias buffers, which shardlm holds as parameters) of the model built on the meta
    device; tied weights count once (`parameters()` deduplicates them; both configs untie by default)."""
    with torch.device("meta"):
        model = model_class(config)
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + biases


@pytest.mark.parametrize("name", ["deepseek-v3.2", "glm-5"])
def test_dsa_preset_parameter_total_equals_transformers(name):
    """TP = 1 (both vocabularies are multiples of 128): the planner's total is transformers' count of the default
    config, whose indexer keys the preset carries. Neither class builds the multi-token-prediction layer, and the
    preset leaves it out; both untie the output layer."""
    cfg, (hf, model_class) = MODEL_PRESETS[name], _hf(name)
    assert (cfg.index_topk, cfg.index_heads, cfg.index_head_dim) == (hf.index_topk, hf.index_n_heads,
                                                                     hf.index_head_dim)
    assert (cfg.num_layers, cfg.hidden_size, cfg.tie_embeddings) == (hf.num_hidden_layers, hf.hidden_size,
                                                                     hf.tie_word_embeddings)
    if name == "glm-5":
        assert cfg.index_layer_types == hf.indexer_types  # all "full" by default
    assert parameter_count(cfg, 1).total == _hf_count(hf, model_class)


def test_dsa_preset_figures():
    """DeepSeek-V3.2 is DeepSeek-V3 plus 61 indexers of 13,959,424 parameters each (851.5M in all: 671.88B); GLM-5
    has 743.91B parameters with 78 indexers of 9,371,904."""
    v32, v3, glm = (MODEL_PRESETS[n] for n in ("deepseek-v3.2", "deepseek-v3", "glm-5"))
    indexer = 64 * 128 * 1536 + 128 * 7168 + 64 * 7168 + 2 * 128
    assert indexer == 13_959_424
    assert parameter_count(v32, 1).total - parameter_count(v3, 1).total == 61 * indexer
    assert parameter_count(v32, 1).total == 671_877_944_064
    assert parameter_count(glm, 1).total == 743_911_218_432
    assert 32 * 128 * 2048 + 128 * 6144 + 32 * 6144 + 2 * 128 == 9_371_904


def test_glm5_shared_layers_hold_no_indexer():
    """GLM-5 with a sparser indexer_types pattern (index_topk_freq 4: "ff" then "sssf" repeated, 21 full layers):
    the total is still transformers', and a shared layer's parameters are a full layer's less one indexer, by
    index, over the layers of a pipeline rank and in the whole model."""
    hf, model_class = _hf("glm-5", index_topk_freq=4)
    assert hf.indexer_types.count("full") == 21
    cfg = dataclasses.replace(MODEL_PRESETS["glm-5"], index_layer_types=list(hf.indexer_types))
    assert parameter_count(cfg, 1).total == _hf_count(hf, model_class)
    assert [has_indexer(cfg, i) for i in range(6)] == [True, True, False, False, False, True]
    full, shared = layer_parameter_count(cfg, 5, 8, 8), layer_parameter_count(cfg, 4, 8, 8)
    assert full.total - shared.total == 9_371_904 and full.replicated - shared.replicated == 9_371_904
    ends = parameter_count(dataclasses.replace(cfg, num_layers=0), 8, 8)
    assert layers_parameter_count(cfg, range(78), 8, 8).total + ends.total == parameter_count(cfg, 8, 8).total


TINY = ModelConfig(arch="llama", attention="mla", num_layers=3, hidden_size=32, num_heads=4, seq_length=16,
                   vocab_size=100, dropout=0.0, ffn_hidden_size=48, q_lora_rank=16, kv_lora_rank=16,
                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, index_topk=5, index_heads=2,
                   index_head_dim=8, index_layer_types=["full", "shared", "full"])
"""Three layers, the middle one "shared" (GLM-5's kind); each query keeps 5 of up to 16 keys."""


def test_tiny_dsa_flops_equal_the_count_by_hand():
    """Per token, with H = 4, r = 16, rope = 4, s = 16, k = 5, H_i = 2, D = 8: each layer's matrices
    2 (mla_weights + 3 h f) trained 3x; the absorbed attention over 5 keys, 2 H (r + rope) + 2 H r = 288 a key,
    3x; on the two full layers the indexer's 576 weights (wq_b 16 x 16, wk 32 x 8, weights_proj 32 x 2) at 2
    forward and 2 backward (weight gradients only), its choice over all 16 keys, 2 H_i (D + 1) 16 = 576, forward
    only, and its KL pass over the 5 chosen, 180, 3x; the output layer 2 h V, 3x. The indexer's weights are the
    built model's."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    model = build_model(TINY, ParallelContext.single(), seed=0)
    built = sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n and p.ndim == 2)
    assert built == 2 * (16 * 2 * 8 + 32 * 8 + 32 * 2) == 2 * 576
    layer = 2 * (mla_weights(TINY) + 3 * 32 * 48)
    attention = 5 * (2 * 4 * (16 + 4) + 2 * 4 * 16)
    indexer = (2 + 2) * 576 + 2 * 2 * (8 + 1) * 16 + 3 * 2 * 2 * (8 + 1) * 5
    by_hand = 3 * (3 * layer + 3 * attention + 2 * 32 * 100) + 2 * indexer
    assert flops_per_token(TINY) == by_hand
    # full recomputation runs the layers' forward again, the indexers' choice and KL pass included
    forward = 3 * layer + 3 * attention + 2 * (2 * 576 + 576 + 180)
    assert flops_per_token(TINY, recompute=True) == by_hand + forward
    # untrained indexers (coefficient 0): no KL pass and no weight gradients
    frozen = dataclasses.replace(TINY, index_loss_coeff=0.0)
    assert flops_per_token(frozen) == by_hand - 2 * (2 * 576 + 3 * 180)
    # the dense warm-up: dense MLA over all 16 keys, 2 H (qk_nope + rope + v) = 192 a key; no choice; the target,
    # the absorbed query 2 H qk_nope r and its scores 2 H (r + rope) 16, forward only; the KL pass over 16 keys
    warmup = dataclasses.replace(TINY, index_stage="warmup")
    target = 2 * 4 * 8 * 16 + 2 * 4 * (16 + 4) * 16
    assert flops_per_token(warmup) == 3 * (3 * layer + 3 * 16 * 192 + 2 * 32 * 100) + 2 * (
        4 * 576 + target + 3 * 2 * 2 * (8 + 1) * 16)
    assert flops_per_token(dataclasses.replace(warmup, index_loss_coeff=0.0)) == flops_per_token(
        dataclasses.replace(TINY, index_topk=0))  # an untrained warm-up is dense MLA
    # a multi-token-prediction depth runs its own indexer
    depth = dataclasses.replace(TINY, mtp_layers=1)
    assert flops_per_token(depth) - flops_per_token(TINY) == 3 * (layer + attention + 4 * 32 * 32
                                                                  + 2 * 32 * 100) + indexer


def test_dsa_terms_are_what_the_model_functions_execute():
    """torch's FLOP counter on the model's own sparse-attention functions, 2 rows of 16 tokens: the indexer's
    choice scores every query against all 16 keys (`index_scores` over the row), the attention runs over the 5
    chosen keys absorbed (`sparse_latent_attention`), and the KL pass scores the chosen keys again
    (`indexer_divergence`), each per token as `sparse_attention_flops` counts it forward; the warm-up's target
    scores all 16 latents (`dense_target`) and its KL pass all 16 keys."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardlm.models import sparse_attention as dsa
    from shardlm.parallel import ParallelContext

    counts = sparse_attention_flops(TINY, 0)
    B, T, H, r, rope, Hi, D, k = 2, 16, 4, 16, 4, 2, 8, 5
    g = torch.Generator().manual_seed(0)
    q, weights, keys = torch.randn(B, T, Hi, D, generator=g), torch.randn(B, T, Hi, generator=g), \
        torch.randn(B, T, D, generator=g)
    visible = dsa.visible_keys(torch.arange(T), T, None)
    with FlopCounterMode(display=False) as choice:
        scores = dsa.index_scores(q, weights, keys)
    indices, valid = dsa.select_top_k(scores, visible.expand(B, T, T), k)
    assert choice.get_total_flops() == B * T * counts.scoring
    query, latents = torch.randn(B, H, T, r + rope, generator=g), torch.randn(B, T, r + rope, generator=g)
    with FlopCounterMode(display=False) as attention:
        _, mass = dsa.sparse_latent_attention(query, latents, indices, valid, 0.1, r)
    assert attention.get_total_flops() == B * T * counts.attention
    with FlopCounterMode(display=False) as divergence:
        dsa.indexer_divergence(q, weights, keys, lambda p: (indices[:, p], valid[:, p]),
                               lambda p: (mass / mass.sum(-1, keepdim=True))[:, p], k)
    assert divergence.get_total_flops() == B * T * counts.divergence
    warm = sparse_attention_flops(dataclasses.replace(TINY, index_stage="warmup"), 0)
    every = visible.expand(B, T, T)
    with FlopCounterMode(display=False) as target:
        probs = dsa.dense_target(query, latents, every, 0.1, ParallelContext.single().tp)
    absorption = 2 * H * 8 * r  # the absorbed query, q_nope W_UK (`LatentAttention.absorbed_query`)
    assert target.get_total_flops() == B * T * (warm.target - absorption)
    with FlopCounterMode(display=False) as dense_divergence:
        dsa.indexer_divergence(q, weights, keys, lambda p: (None, every[:, p]), lambda p: probs[:, p], T)
    assert dense_divergence.get_total_flops() == B * T * warm.divergence


def test_128k_deepseek_v32_attention_far_below_dense():
    """docs/plan-sparse-attention.md: DeepSeek-V3.2 at 131,072 tokens, training FLOPs per token over its 61 layers.
    Dense MLA's scores and values: 3 x 61 x 2 s H (192 + 128) = 1,964.9 GFLOPs; DSA's attention over 2,048 keys
    104.4, the indexers' choice (2 H_i (D + 1) s per layer, forward only) 132.0, their weights and KL pass 9.6:
    246.0 in all, 12.5% of dense, of which the indexers are 57.6%. The model: 2,184.7 GFLOPs a token dense, 465.7
    with DSA (4.7x less). The indexers' choice is linear in s per token (O(s^2) per sequence)."""
    cfg = dataclasses.replace(MODEL_PRESETS["deepseek-v3.2"], seq_length=SEQ_128K)
    c = attention_comparison(cfg)
    assert c.dense_attention == 3 * 61 * 2 * SEQ_128K * 128 * (192 + 128)
    assert c.indexer_scoring == 61 * 2 * 64 * (128 + 1) * SEQ_128K
    assert c.sparse_attention == 3 * 61 * 2048 * 2 * 128 * (2 * 512 + 64)
    assert c.sparse_total < c.dense_attention / 7
    assert c.indexer_scoring > c.sparse_attention  # the O(s^2) term dominates DSA's at 128K
    assert c.model_dense - c.model_sparse == c.dense_attention - c.sparse_total
    assert c.model_sparse == flops_per_token(cfg)
    figures = [x / 1e9 for x in (c.dense_attention, c.sparse_attention, c.indexer_scoring, c.indexer_rest,
                                 c.sparse_total, c.model_dense, c.model_sparse)]
    assert figures == pytest.approx([1964.95, 104.39, 132.02, 9.59, 246.00, 2184.70, 465.75], abs=0.01)
    assert c.indexer_share == pytest.approx(0.5757, abs=1e-4)
    doubled = attention_comparison(dataclasses.replace(cfg, seq_length=2 * SEQ_128K))
    assert doubled.indexer_scoring == 2 * c.indexer_scoring and doubled.sparse_attention == c.sparse_attention


def test_dsa_costs_more_than_dense_below_about_8k_tokens():
    """The absorbed attention costs 2 H (2 r + rope) = 278,528 FLOPs a key against dense MLA's 2 H (qk + v) =
    81,920, so DeepSeek-V3.2's DSA saves FLOPs only from 8,151 tokens on (at its preset's 4096 the model counts 20%
    more than dense)."""
    cfg = MODEL_PRESETS["deepseek-v3.2"]

    def saves(s: int) -> bool:
        c = attention_comparison(dataclasses.replace(cfg, seq_length=s))
        return c.sparse_total < c.dense_attention

    assert not saves(8150) and saves(8151)
    short = attention_comparison(cfg)
    assert short.model_sparse / short.model_dense == pytest.approx(1.20, abs=0.005)


def test_pipeline_fsdp_kernels_and_windows_read_the_dsa_count():
    """GLM-5 with shared layers and its MTP depth: DualPipe's stages sum to `flops_per_token` (a DSA layer counts
    a third of its training FLOPs); FSDP gathers the larger layer, one with an indexer. DeepSeek-V3.2 under
    DeepSeek's kernels: the flash kernel's counted attention is DSA's core over min(s, k) keys, executed over
    k s - k^2 / 2 pairs, its values (the latents) not padded; a window-free DSA model saves no window FLOPs."""
    from shardlm.plan import dualpipe
    from shardlm.plan.fsdp import fsdp_units
    from shardlm.plan.kernels import DEEPSEEK_KERNELS
    from shardlm.plan.stages import pipeline_layers
    from shardlm.plan.windows import attended_keys, window_saved_flops

    cfg = dataclasses.replace(MODEL_PRESETS["glm-5"], index_layer_types=["full", "full"] + ["shared"] * 3 * 19
                              + ["full"] * 19, mtp_layers=1, seq_length=SEQ_128K)
    layers = pipeline_layers(cfg.num_layers, 8, 1)
    flops = [dualpipe.stage_flops(cfg, stage, s == 7) for s, stage in enumerate(layers)]
    assert 3 * sum(flops) == pytest.approx(flops_per_token(cfg), rel=1e-12)
    last_shared = dataclasses.replace(cfg, index_layer_types=["full"] * 4 + ["shared"] * 74, mtp_layers=0)
    assert fsdp_units(last_shared, 8, ep=8).layer == layer_parameter_count(last_shared, 3, 8, 8).total  # MoE, full
    v32 = dataclasses.replace(MODEL_PRESETS["deepseek-v3.2"], seq_length=SEQ_128K)
    assert attended_keys(v32, 3) == 2048
    core = sum(sparse_attention_flops(v32, i).attention for i in range(v32.num_layers))
    assert DEEPSEEK_KERNELS.counted_attention_flops(v32, 2, False) == 3 * 2 * SEQ_128K * core
    assert window_saved_flops(v32, 2, False) == 0
    assert DEEPSEEK_KERNELS.attention_seconds(v32, 2, False, 1.0, 1.0, 1.0) == pytest.approx(
        3.5 * 2 * SEQ_128K * core * (1 - 2048 / 2 / SEQ_128K), rel=1e-12)


def test_context_parallel_gathers_whole_rows_instead_of_the_ring():
    """Under CP C a DSA layer all-gathers b T (r + rope) latents in bf16 and, with an indexer, b T D indexer keys
    in fp32, and reduce-scatters their gradients: no ring. DeepSeek-V3.2 at 128K, C = 8, 1 GB/s, no latency; the
    planner's step (H800s, C = 8 on NVLink) charges exactly these gathers."""
    from shardlm.plan.context import sparse_gather_seconds
    from shardlm.plan.generations import HOPPER_CALIBRATION
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.links import direction_bandwidth
    from shardlm.plan.memory import numeric_format
    from shardlm.plan.timing import Layout, context_ring_seconds

    cfg = dataclasses.replace(MODEL_PRESETS["deepseek-v3.2"], seq_length=SEQ_128K)
    one = 7 / 8 * SEQ_128K * (576 * 2 + 128 * 4) / 1e9
    assert sparse_gather_seconds(cfg, 8, 1, 2, False, 1e9, 0.0) == pytest.approx(2 * one, rel=1e-12)
    assert sparse_gather_seconds(cfg, 8, 1, 2, True, 1e9, 0.0) == pytest.approx(3 * one, rel=1e-12)
    assert sparse_gather_seconds(cfg, 1, 1, 2, False, 1e9, 0.0) == 0.0
    # the dense warm-up (with its ring): the indexer's keys and, detached, the latents for its target
    warmup = dataclasses.replace(cfg, index_stage="warmup")
    assert sparse_gather_seconds(warmup, 8, 1, 2, False, 1e9, 0.0) == pytest.approx(
        7 / 8 * SEQ_128K * (576 * 2 + 2 * 128 * 4) / 1e9, rel=1e-12)
    layout, gpu = Layout(tp=1, dp=1, micro_batch=1, checkpointing=False, cp=8), gpu_preset("h800")
    exposed, total = context_ring_seconds(cfg, layout, gpu, numeric_format("bf16"), HOPPER_CALIBRATION)
    assert exposed == total > 0
    bandwidth, latency = direction_bandwidth(gpu, HOPPER_CALIBRATION)[0], HOPPER_CALIBRATION.intra_node_latency_s
    assert exposed == pytest.approx(sparse_gather_seconds(cfg, 8, 1, 2, False, bandwidth, latency), rel=1e-12)


def test_plan_refuses_a_broken_dsa_config_in_one_line():
    with pytest.raises(UserError, match="index_layer_types"):
        check_model(dataclasses.replace(TINY, index_layer_types=["full", "shared"]))
    check_model(MODEL_PRESETS["glm-5"])


def test_128k_plans_of_the_doc():
    """docs/plan-sparse-attention.md's step at 128K on 1,024 H800s, 512 sequences, half parameters, PP 16 and EP 64:
    DeepSeek-V3.2 takes CP 16 x DP 4, 174.9 s a step (74.6 s compute, 9.0 s of row gathers); DeepSeek-V3 CP 8 x
    DP 8, 468.3 s (307.0 s compute)."""
    from shardlm.plan.generations import default_calibration
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.planner import PlanRequest, plan

    gpu = gpu_preset("h800")
    found = {}
    for name in ("deepseek-v3.2", "deepseek-v3"):
        cfg = dataclasses.replace(MODEL_PRESETS[name], seq_length=SEQ_128K)
        request = PlanRequest(PlannedModel(name, cfg), gpu, 1024, 512, param_dtype="half", pipeline=16, expert=64,
                              calibration=default_calibration(gpu))
        best = plan(request).recommended
        time = best.choice.time
        found[name] = ((best.pp, best.cp, best.dp, best.ep), (time.total_s, time.compute_s, time.cp_comm_s))
    assert found["deepseek-v3.2"][0] == (16, 16, 4, 64)
    assert found["deepseek-v3.2"][1] == pytest.approx((174.9, 74.6, 9.0), abs=0.05)
    assert found["deepseek-v3"][0] == (16, 8, 8, 64)
    assert found["deepseek-v3"][1] == pytest.approx((468.3, 307.0, 0.0), abs=0.05)


DSA_SAVES = [("16 tokens", {}, 2), ("64 tokens, 1 row", dict(seq_length=64), 1),
             ("frozen indexers", dict(seq_length=64, index_loss_coeff=0.0), 1),
             ("128 tokens, k = 8", dict(seq_length=128, index_topk=8), 2)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case,changes,micro", DSA_SAVES, ids=[c[0] for c in DSA_SAVES])
def test_each_dsa_layer_saves_what_the_planner_counts(case, changes, micro, precision):
    """On the CPU, the tiny model's layers with their own indexer keep for the backward exactly the planner's
    per-layer bytes (`dsa_activations`: the sparse core's inputs, the chosen keys, the indexer's LayerNorm input,
    gradients and copies when it trains, in place of dense MLA's SDPA terms); its "shared" layer (GLM-5's) keeps
    that less its indexer's bytes and the choice it reuses, in fp32 and under bf16 autocast."""
    from test_plan_linear_attention import saved_by_layer

    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext
    from shardlm.plan.activations import LayerSetting, shardlm_memory
    from shardlm.plan.dsa_activations import dsa_attention_bytes
    from shardlm.plan.measure import autocast_context
    from shardlm.plan.memory import numeric_format

    cfg, fmt = dataclasses.replace(TINY, **changes), numeric_format(precision)
    model = build_model(cfg, ParallelContext.single(), seed=0).train()
    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_length), generator=torch.Generator().manual_seed(0))

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    saved = saved_by_layer(model, forward)
    N = micro * cfg.seq_length
    planned = shardlm_memory(cfg, 1, micro, fmt, LayerSetting(), backend="cpu").per_layer
    reused = dsa_attention_bytes(cfg, 0, 1, micro, fmt) - dsa_attention_bytes(cfg, 1, 1, micro, fmt)
    assert [saved[i] for i in range(3)] == [planned, planned - reused - N * cfg.index_topk * 5, planned]
    assert reused > 0 or cfg.index_loss_coeff == 0
