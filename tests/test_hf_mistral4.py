"""Mistral Small 4 (`mistral4`) against transformers: DeepSeek-V3's shape (MLA and MoE with a shared expert) with
softmax routing whose groups rank by their two best experts and whose top-k is renormalized, and Llama 4's
long-context query scaling (queries at position p times 1 + beta log(1 + floor(p / original positions))).

A random tiny `Mistral4ForCausalLM` (3 layers, the first dense, 8 experts in 2 groups, top-2 in the best group,
routed scaling 1.5, YaRN with factor 4 over 8 original positions, llama_4_scaling_beta 0.4, so rows of 20 tokens
cross two scaling steps): shardlm's logits equal transformers' within 1e-4 at TP=1, TP=2 and EP=2 and greedy
decoding gives its tokens; converting back gives transformers' tensors bitwise (its experts stacked) and a
Mistral4ForCausalLM config; a run started from the directory gives transformers' first loss. Controls: without the
query scaling, or ranking groups by their best expert (DeepSeek-V2's rule), the logits move far.

The published model is a multimodal directory (Mistral 3's format: the language model under `language_model.model.`,
its output layer `language_model.lm_head`, beside a vision tower). transformers' text class loads such a directory
without an error but drops every language-model weight; shardlm reads them all and gives the text model's logits,
and a directory holding a language-model weight it would not read is refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_layout_matches,
    assert_round_trip,
    hf_reference,
    layout_worker,
    logits_and_greedy,
)

from shardlm.checkpoint import load_model
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext

from multiproc import run_workers

VOCAB = 300
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}


def hf_config():
    from transformers import Mistral4Config

    return Mistral4Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        num_experts_per_tok=2, routed_scaling_factor=1.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=64,
        rope_parameters=dict(ROPE), tie_word_embeddings=False)


def sharpened(model):
    """Sharp attention and random routing, in place (a slip in either then moves the logits)."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_b_proj.weight.mul_(8.0)
            attn.kv_a_proj_with_mqa.weight.mul_(4.0)
            attn.kv_b_proj.weight.mul_(4.0)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.6)
    return model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import Mistral4ForCausalLM

    torch.manual_seed(0)
    model = sharpened(Mistral4ForCausalLM(hf_config()).eval())
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = hf_reference(model, tmp_path_factory.mktemp("mistral4"), tokens, norm_seed=1)
    ref["model"] = model
    return ref


@pytest.fixture(scope="module")
def world2(hf_model):
    return run_workers(2, layout_worker, {"mistral4": hf_model["converted"]}, hf_model["tokens"])


def test_conversion_reads_routing_and_query_scaling(hf_model):
    from shardlm.checkpoint.state import load_consolidated

    cfg = load_consolidated(hf_model["converted"])[0].model
    assert (cfg.moe_score, cfg.moe_group_score, cfg.moe_norm_topk_prob, cfg.moe_expert_bias) == \
        ("softmax", "top2_sum", True, False)
    assert (cfg.query_scale_beta, cfg.query_scale_positions, cfg.moe_routed_scaling) == (0.4, 8, 1.5)


def test_tp1_logits_and_greedy_tokens_match_transformers(hf_model):
    assert_converted_matches(hf_model)


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, hf_model, layout):
    assert_layout_matches(world2, f"{layout} mistral4", hf_model)


def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(hf_model, tmp_path):
    from transformers import Mistral4ForCausalLM

    assert_round_trip(hf_model, tmp_path / "back", Mistral4ForCausalLM)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "mistral4" and config["rope_parameters"]["llama_4_scaling_beta"] == 0.4


@pytest.mark.parametrize("change", ["no query scaling", "groups by their best expert"])
def test_the_query_scaling_and_the_group_rule_matter(hf_model, change):
    model, _ = load_model(hf_model["converted"], ParallelContext.single())
    if change == "no query scaling":
        model.cfg.query_scale_beta = 0.0
    else:
        model.cfg.moe_group_score = "max"
    with torch.no_grad():
        logits = model.full_logits(model(hf_model["tokens"]))
    assert (logits - hf_model["logits"]).abs().max() > 100 * LOGIT_TOL


def test_a_run_started_from_the_directory_gives_transformers_first_loss(hf_model):
    from test_hf_sparse_attention import training_batch
    from test_hf_start import hf_loss, run_config, started_run

    expected = hf_loss(hf_model["model"], training_batch())
    run = started_run(ParallelContext.single(), run_config(hf_model["root"] / "hf"), steps=1)
    assert abs(run["curve"][0][0] - expected) <= 1e-5 * expected, (run["curve"][0][0], expected)


def multimodal(hf_model, root, extra: dict | None = None):
    """The reference model's language model in a Mistral 3 multimodal directory (a tiny vision tower beside it),
    with `extra` tensors added to its weights."""
    from safetensors.torch import load_file, save_file
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=16, head_dim=8)
    model = Mistral3ForConditionalGeneration(Mistral3Config(text_config=hf_config(), vision_config=vision,
                                                            tie_word_embeddings=False))
    model.model.language_model.load_state_dict(hf_model["model"].model.state_dict())
    model.lm_head.load_state_dict(hf_model["model"].lm_head.state_dict())
    model.save_pretrained(root)
    if extra:
        weights = load_file(str(root / "model.safetensors"))
        save_file({**weights, **extra}, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def test_a_multimodal_directory_gives_its_language_models_logits(hf_model, tmp_path):
    from safetensors import safe_open

    root = multimodal(hf_model, tmp_path / "mm")
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("language_model.model.") for n in names) and any("vision_tower" in n for n in names)
    logits, greedy = logits_and_greedy(root, ParallelContext.single(), hf_model["tokens"])
    assert (logits - hf_model["logits"]).abs().max() < LOGIT_TOL and greedy == hf_model["greedy"]


def test_a_directory_with_weights_shardlm_would_not_read_is_refused(hf_model, tmp_path):
    root = multimodal(hf_model, tmp_path / "extra",
                      {"language_model.model.layers.0.self_attn.q_norm.weight": torch.ones(24)})
    with pytest.raises(UserError, match="holds 1 weights shardlm would not read") as error:
        load_model(root, ParallelContext.single())
    assert "\n" not in str(error.value) and "q_norm" in str(error.value)


def test_a_head_dim_that_narrows_the_rotary_part_is_refused():
    """An explicit head_dim makes transformers rotate int(head_dim x partial_rotary_factor) channels per head, not
    qk_rope_head_dim (8 x 1/3: 2 of 8; the logits then differ by 0.8%): refused in one line, before any weight."""
    from shardlm.checkpoint.hf_deepseek import model_config_from_hf

    hf = {**hf_config().to_dict(), "head_dim": 8}
    with pytest.raises(UserError, match="rotary width of 2 channels .* unlike qk_rope_head_dim=8") as error:
        model_config_from_hf(hf)
    assert "\n" not in str(error.value)
    assert model_config_from_hf({**hf_config().to_dict(), "head_dim": 24}).qk_rope_head_dim == 8  # nope + rope
