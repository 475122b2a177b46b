"""Exporting refuses what the Hugging Face class would load the weights without: each case is a published model's
preset (`shardlm plan`'s, whose export is checked as it stands) with one piece of another family set, a piece that
changes shardlm's forward but has no key in that class's config.json. Before, each of these wrote a directory that
transformers loads and computes as another model (logits up to 10 off on tiny models), or failed with a traceback.
The check reads no weights (`hf.check_convertible`); `shardlm convert --to-hf` runs it before consolidating a
checkpoint directory. Also the model keys that validation now refuses before a model is built, and the GPT-2
configs whose attention or output layer shardlm's GPT does not compute, refused on import."""

from __future__ import annotations

import dataclasses

import pytest

from shardlm.checkpoint.hf import check_convertible
from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.plan.models import MODEL_PRESETS
from shardlm.validation import validate

CASES = {
    "deepseek-v3": [
        ({"norm_placement": "post"}, "DeepseekV3ForCausalLM has no post-norms"),
        ({"norm_zero_centered": True}, "zero-centred norms"),
        ({"mla_nope": True}, "MLA without RoPE"),
        ({"swiglu_limit": 0.5}, "clamped SwiGLU"),
        ({"swiglu_clip": 0.5}, "clipped SwiGLU"),
        ({"moe_shared_expert_gate": True}, "gate on the shared expert"),
        ({"moe_group_score": "max"}, "groups ranked by their best expert"),
        ({"moe_score": "sqrtsoftplus"}, 'moe_score="sqrtsoftplus"'),
        ({"moe_shared_ffn_hidden_size": 1000}, "shared-expert width"),
    ],
    "qwen3.5-35b-a3b": [
        ({"norm_placement": "post"}, "Qwen3_5MoeForCausalLM has no post-norms"),
        ({"moe_routed_scaling": 2.0}, "scale on the routed experts"),
        ({"swiglu_limit": 0.5}, "clamped SwiGLU"),
        ({"swiglu_clip": 0.5}, "clipped SwiGLU"),
        ({"moe_layer_interval": 2}, "MoE layers at an interval"),
        ({"qk_norm_scope": "projection"}, "QK-norm over whole projections"),
    ],
    "nemotron-3-nano-30b-a3b": [
        ({"attention_sinks": True}, "NemotronHForCausalLM has no attention sinks"),
        ({"attention_output_gate": True}, "attention output gate"),
        ({"moe_shared_expert_gate": True}, "gate on the shared expert"),
        ({"moe_groups": 8, "moe_topk_groups": 4, "moe_group_score": "max"}, "groups ranked by their best expert"),
    ],
    "kimi-linear-48b-a3b": [
        ({"norm_placement": "post"}, "KimiLinearForCausalLM has no post-norms"),
        ({"swiglu_limit": 0.5}, "clamped SwiGLU"),
        ({"swiglu_clip": 0.5}, "clipped SwiGLU"),
        ({"moe_shared_expert_gate": True}, "gate on the shared expert"),
        ({"query_scale_beta": 0.4, "query_scale_positions": 4}, "query scaling"),
        ({"rope_yarn_factor": 4.0, "rope_yarn_original_positions": 8, "rope_yarn_mscale_all_dim": 1.0}, "YaRN"),
        ({"moe_shared_ffn_hidden_size": 1000}, "shared-expert width"),
    ],
    "deepseek-v4": [
        ({"moe_shared_expert_gate": True}, "DeepseekV4ForCausalLM has no gate on the shared expert"),
        ({"moe_shared_experts": 2}, "one shared expert"),
        ({"moe_shared_ffn_hidden_size": 1000}, "shared-expert width"),
    ],
    "mixtral-8x7b": [
        ({"moe_routed_scaling": 2.0}, "MixtralForCausalLM has no moe_routed_scaling"),
        ({"moe_shared_expert_gate": True}, "gate on the shared expert"),
        ({"swiglu_clip": 0.5}, "clipped SwiGLU"),
    ],
    "llama3-8b": [
        ({"rope_fraction": 0.5}, "LlamaForCausalLM has no partial rotary embeddings"),
        ({"norm_zero_centered": True}, "zero-centred norms"),
    ],
    "gpt2-355m": [
        ({"arch": "bert"}, 'GPT2LMHeadModel has no model.arch="bert"'),
        ({"moe_num_experts": 4}, "GPT2LMHeadModel has no experts"),
    ],
}


def preset(name: str, **change):
    """`MODEL_PRESETS[name]` with `change`."""
    return dataclasses.replace(MODEL_PRESETS[name], **change)


def test_every_preset_here_exports_as_it_stands():
    """The bases convert: each refusal below is the change's."""
    for name in CASES:
        assert check_convertible(preset(name))["architectures"]


@pytest.mark.parametrize("name,change,words", [(name, change, words) for name, cases in CASES.items()
                                               for change, words in cases],
                         ids=[f"{name}-{next(iter(change))}" for name, cases in CASES.items() for change, _ in cases])
def test_a_piece_the_class_lacks_is_refused_in_one_line(name, change, words):
    model = preset(name, **change)
    config = RunConfig(model=model)
    config.data.text_file = "unused"
    if model.arch == "llama":  # a model shardlm trains (GPT-2's experts and BERT are refused by the exporter alone)
        validate(config, 1, check_paths=False)
    with pytest.raises(UserError) as error:
        check_convertible(model)
    message = str(error.value)
    assert words in message and "\n" not in message, message


@pytest.mark.parametrize("change,words", [
    ({"make_vocab_size_divisible_by": 0}, "model.make_vocab_size_divisible_by=0 must be at least 1"),
    ({"rope_yarn_factor": 4.0}, "rope_yarn_original_positions >= 1"),
])
def test_keys_a_model_cannot_be_built_with_are_refused_by_validation(change, words):
    """Before, a vocabulary multiple of 0 failed in the build with ZeroDivisionError, and DeepSeek-V4's YaRN without
    its pretraining length with a math domain error."""
    config = RunConfig(model=preset("deepseek-v4", **change))
    config.data.text_file = "unused"
    with pytest.raises(UserError) as error:
        validate(config, 1, check_paths=False)
    assert words in str(error.value)


@pytest.mark.parametrize("change,words", [
    ({"tie_word_embeddings": False}, "tie_word_embeddings = false"),
    ({"scale_attn_weights": False}, "scale_attn_weights = false"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx = true"),
])
def test_gpt2_configs_shardlm_does_not_compute_are_refused_on_import(change, words):
    """Each changes transformers' logits (an output layer of its own: 0.7 on a tiny model; no 1 / sqrt(d): 0.02;
    attention scaled by 1 / (layer + 1): 0.002 at 4 layers), and shardlm's GPT computes the default."""
    from transformers import GPT2Config

    from shardlm.checkpoint.hf import model_config_from_hf

    base = GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4).to_dict()
    assert model_config_from_hf(base).arch == "gpt"
    with pytest.raises(UserError) as error:
        model_config_from_hf(base | change)
    assert words in str(error.value) and "\n" not in str(error.value)
