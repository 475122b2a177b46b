"""`shardlm plan`'s presets of the 2026 families (Mistral Small 4, MiniMax-M2, OLMo 3 7B and 32B, OLMo 2 7B, 13B
and 32B): their parameter totals equal transformers' meta-device builds of the published configs (the classes'
defaults, the OLMo shapes written in), so the planner's memory and FLOPs start from the right model."""

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
    if name.startswith("olmo-3"):  # allenai/Olmo-3-1025-7B, Olmo-3-1125-32B config.json (the class defaults are 7B's
        # shape with OLMo 2's vocabulary)
        shape = {"olmo-3-7b": (4096, 11008, 32, 32, 32), "olmo-3-32b": (5120, 27648, 64, 40, 8)}[name]
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        return transformers.Olmo3Config(vocab_size=100278, max_position_embeddings=65536, rms_norm_eps=1e-6,
                                        **dict(zip(keys, shape))), transformers.Olmo3ForCausalLM
    if name.startswith("olmo-2"):  # allenai/OLMo-2-1124-7B, -13B, OLMo-2-0325-32B config.json
        shape = {"olmo-2-7b": (4096, 11008, 32, 32, 32), "olmo-2-13b": (5120, 13824, 40, 40, 40),
                 "olmo-2-32b": (5120, 27648, 64, 40, 8)}[name]
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        return transformers.Olmo2Config(vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                        **dict(zip(keys, shape))), transformers.Olmo2ForCausalLM
    raise KeyError(name)


def hf_count(config, model_class) -> int:
    """Parameters of the model built on the meta device (tied weights once), and the score-correction biases, which
    transformers holds as buffers and shardlm as parameters."""
    with torch.device("meta"):
        model = model_class(config)
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + biases


@pytest.mark.parametrize("name", ["mistral-small-4", "minimax-m2", "olmo-3-7b", "olmo-3-32b", "olmo-2-7b", "olmo-2-13b",
                                  "olmo-2-32b"])
def test_preset_parameter_total_equals_transformers(name):
    cfg, (hf, model_class) = MODEL_PRESETS[name], hf_model(name)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_embeddings) == \
        (hf.num_hidden_layers, hf.hidden_size, hf.vocab_size, hf.tie_word_embeddings)
    padding = (cfg.padded_vocab_size(1) - cfg.vocab_size) * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    assert parameter_count(cfg, 1).total == hf_count(hf, model_class) + padding  # (shardlm's rows up to 128 x TP)
    if name.startswith("olmo"):  # the preset is what shardlm's converter reads from that config (but the sequence)
        import dataclasses

        from shardlm.checkpoint.hf_llama import model_config_from_hf

        assert dataclasses.replace(model_config_from_hf(hf.to_dict()), seq_length=cfg.seq_length) == cfg


def test_olmo2_presets_have_their_published_sizes():
    """OLMo 2's model cards: 7.3B, 13.7B and 32.2B parameters."""
    for name, billions in (("olmo-2-7b", 7.3), ("olmo-2-13b", 13.7), ("olmo-2-32b", 32.2)):
        total = parameter_count(MODEL_PRESETS[name], 1).total / 1e9
        assert abs(total - billions) < 0.05, (name, total)


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


def test_every_preset_validates_as_a_training_config():
    """A preset is a model shardlm trains: each passes `validate` as the [model] of a run (the hybrid presets once
    stated their layer pattern once, which the model repeats but validation refuses)."""
    from shardlm.config import RunConfig
    from shardlm.errors import UserError
    from shardlm.validation import validate

    for name, model in MODEL_PRESETS.items():
        config = RunConfig(model=model)
        config.data.text_file = "unused"
        try:
            validate(config, 1, check_paths=False)
        except UserError as error:
            pytest.fail(f"{name}: {error}")
