"""`shardlm plan`'s presets of the 2026 families (Mistral Small 4, MiniMax-M2): their parameter totals equal
transformers' meta-device builds of the published configs (the classes' defaults), so the planner's memory and FLOPs
start from the right model."""

from __future__ import annotations

import pytest
import torch

from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.parameters import parameter_count


def hf_model(name: str):
    """transformers' config and model class of a preset's published model."""
    import transformers

    if name == "mistral-small-4":
        return transformers.Mistral4Config(), transformers.Mistral4ForCausalLM
    if name == "minimax-m2":
        return transformers.MiniMaxM2Config(), transformers.MiniMaxM2ForCausalLM
    raise KeyError(name)


def hf_count(config, model_class) -> int:
    """Parameters of the model built on the meta device (tied weights once), and the score-correction biases, which
    transformers holds as buffers and shardlm as parameters."""
    with torch.device("meta"):
        model = model_class(config)
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + biases


@pytest.mark.parametrize("name", ["mistral-small-4", "minimax-m2"])
def test_preset_parameter_total_equals_transformers(name):
    cfg, (hf, model_class) = MODEL_PRESETS[name], hf_model(name)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_embeddings) == \
        (hf.num_hidden_layers, hf.hidden_size, hf.vocab_size, hf.tie_word_embeddings)
    assert parameter_count(cfg, 1).total == hf_count(hf, model_class)


def test_mistral_small_4_is_119b():
    """Mistral-Small-4-119B: 119.0B parameters (about 6.5B activated: 4 of 128 experts and the shared one)."""
    count = parameter_count(MODEL_PRESETS["mistral-small-4"], 1)
    assert 118.5e9 < count.total < 119.5e9, count.total


def test_olmo3_whole_projection_norms_are_counted_as_transformers_builds_them():
    """OLMo 3's q_norm spans every head's queries and k_norm every KV head's keys (not one head's channels): the
    planner's total equals transformers' build, and the per-rank counts at TP=2 add up to the same model."""
    import dataclasses

    from transformers import Olmo3Config, Olmo3ForCausalLM

    from shardlm.checkpoint.hf_llama import model_config_from_hf

    hf = Olmo3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, sliding_window=16)
    cfg = model_config_from_hf(hf.to_dict())
    assert (cfg.qk_norm_scope, cfg.norm_placement) == ("projection", "post")
    assert parameter_count(cfg, 1).total == hf_count(hf, Olmo3ForCausalLM)
    per_head = dataclasses.replace(cfg, qk_norm_scope="head")
    assert parameter_count(cfg, 1).total - parameter_count(per_head, 1).total == 4 * (64 + 32 - 2 * 16)
