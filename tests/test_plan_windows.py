"""`shardlm plan` with gpt-oss: presets whose totals are transformers' counts, and what a sliding window bounds.

Claims: the gpt-oss-20b and gpt-oss-120b presets hold exactly the parameters transformers' `GptOssForCausalLM`
builds from the published configs (openai/gpt-oss-20b and gpt-oss-120b config.json: 24 / 36 layers, 32 / 128
experts; the rest is transformers' `GptOssConfig` defaults, which are the 120b's), 3.6B and 5.1B of them active
per token as OpenAI's model card counts them (without the input embedding); a sliding window of w tokens bounds a
layer's counted attention FLOPs to s x w per sequence (s x s on a full layer) and the step's compute with it, and
leaves the saved activations as they are (the fused kernels save per token, not per score).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlm.plan.experts import activated_parameter_count
from shardlm.plan.flops import flops_per_step
from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.parameters import parameter_count
from shardlm.plan.windows import attended_keys, executed_pairs, window_saved_flops

# openai/gpt-oss-20b and gpt-oss-120b config.json: what differs from transformers' GptOssConfig defaults
HF_CONFIGS = {"gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
              "gpt-oss-120b": dict(num_hidden_layers=36, num_local_experts=128)}


def _hf_count(name: str) -> int:
    """Parameters of transformers' GptOssForCausalLM for the published config, built on the meta device."""
    from transformers import GptOssConfig, GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(GptOssConfig(**HF_CONFIGS[name]))
    return sum(p.numel() for p in model.parameters())


def test_gpt_oss_config_defaults_are_the_published_shape():
    """transformers' GptOssConfig defaults carry the numbers the presets take (the 120b's) and build the 20b's
    alternating layer types, sliding first."""
    from transformers import GptOssConfig

    hf = GptOssConfig(**HF_CONFIGS["gpt-oss-20b"])
    cfg = MODEL_PRESETS["gpt-oss-20b"]
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (2880, 64, 8, 64)
    assert (hf.intermediate_size, hf.num_experts_per_tok, hf.vocab_size, hf.sliding_window) == (2880, 4, 201088, 128)
    assert hf.layer_types == cfg.layer_types and cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert hf.rope_parameters["factor"] == cfg.rope_yarn_factor == 32
    assert hf.rope_parameters["original_max_position_embeddings"] == cfg.rope_yarn_original_positions == 4096
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta and not hf.tie_word_embeddings
    assert (hf.swiglu_limit, hf.swiglu_alpha) == (cfg.swiglu_limit, cfg.swiglu_alpha)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_gpt_oss_preset_parameter_total_equals_transformers(name):
    """TP = 1 (the vocabulary is a multiple of 128): the planner's total is transformers' count, sinks, o, router
    and expert biases included (20,914,757,184 and 116,829,156,672)."""
    assert parameter_count(MODEL_PRESETS[name], 1).total == _hf_count(name)


@pytest.mark.parametrize("name, active", [("gpt-oss-20b", 3.61e9), ("gpt-oss-120b", 5.13e9)])
def test_gpt_oss_active_parameters(name, active):
    """OpenAI's model card: 3.6B and 5.1B active parameters per token, which leaves out the input embedding."""
    cfg = MODEL_PRESETS[name]
    embedding = cfg.vocab_size * cfg.hidden_size
    assert activated_parameter_count(cfg) - embedding == pytest.approx(active, rel=0.002)


def test_gpt_oss_biases_split_with_their_weights():
    """At TP 2 x EP 4: the sinks split with the heads, o's bias replicated, the router bias whole, each local
    expert's gate/up bias split with its columns and its down bias whole; the TP ranks sum to TP = 1 less what
    is replicated."""
    cfg = dataclasses.replace(MODEL_PRESETS["gpt-oss-20b"], num_layers=2, layer_types=["sliding_attention",
                                                                                       "full_attention"])
    plain = dataclasses.replace(cfg, attention_output_bias=False, attention_sinks=False, moe_router_bias=False,
                                moe_linear_bias=False)
    diff = parameter_count(cfg, 2, 4).total - parameter_count(plain, 2, 4).total
    h, experts = cfg.hidden_size, cfg.moe_num_experts // 4
    assert diff == 2 * (h + 64 // 2 + cfg.moe_num_experts + experts * (2 * 2880 // 2 + h))


def test_window_bounds_counted_attention_flops():
    """gpt-oss-20b at 4096 tokens, window 128 on every other layer: each sliding layer counts 4096 x 128 (query,
    key) pairs instead of 4096 x 4096, and the step's FLOPs fall by exactly that; a causal kernel executes
    128 x 4096 - 128^2 / 2 of them; a window longer than the sequence changes nothing."""
    cfg = MODEL_PRESETS["gpt-oss-20b"]
    assert [attended_keys(cfg, i) for i in range(4)] == [128, 4096, 128, 4096]
    assert executed_pairs(cfg, 0) == 128 * 4096 - 128 ** 2 / 2 and executed_pairs(cfg, 1) == 4096 ** 2 / 2
    per_key = 4 * 64 * 64  # QK^T and PV over 64 heads of 64 channels
    saved = window_saved_flops(cfg, 8, recompute=False)
    assert saved == 3 * 8 * 4096 * per_key * 12 * (4096 - 128)
    assert window_saved_flops(dataclasses.replace(cfg, sliding_window=8192), 8, False) == 0
    assert flops_per_step(dataclasses.replace(cfg, sliding_window=0), 8) - flops_per_step(cfg, 8) == saved


def test_window_shortens_the_step_and_keeps_the_memory():
    """The same layout of gpt-oss-20b on 8 H100s with and without its window: the predicted compute falls by the
    windowed FLOPs at the same rate, and the busiest GPU's memory is unchanged."""
    from shardlm.plan.evaluate import Evaluator
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.planner import PlanRequest
    from shardlm.plan.timing import Layout

    cfg = MODEL_PRESETS["gpt-oss-20b"]
    gpu = gpu_preset("h100")
    layout = Layout(tp=1, dp=1, micro_batch=1, checkpointing=False, pp=8, ep=1)
    windowed, full = (Evaluator(PlanRequest(PlannedModel("gpt-oss-20b", c), gpu, 8, 64, param_dtype="half"))
                      .choice(layout) for c in (cfg, dataclasses.replace(cfg, sliding_window=0)))
    saved = window_saved_flops(cfg, 64, recompute=False)
    assert full.time.model_flops - windowed.time.model_flops == pytest.approx(saved)
    assert windowed.time.compute_s / full.time.compute_s == pytest.approx(windowed.time.model_flops
                                                                         / full.time.model_flops)
    assert windowed.total_bytes == full.total_bytes
