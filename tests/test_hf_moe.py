"""Mixtral and Qwen3-MoE against transformers: conversion both ways, logits and greedy tokens at every layout.

A random `MixtralForCausalLM` and a random `Qwen3MoeForCausalLM` (4 experts, top-2; Qwen3-MoE with
head_dim 12 at hidden 32, q/k norms, norm_topk_prob) are saved and converted. shardlm's logits equal
transformers' within 1e-4 at TP=1, TP=2 and EP=2 (experts split over 2 ranks, tokens dispatched by
all-to-all), greedy generation with the KV cache gives transformers' tokens, and converting back gives
bitwise the saved tensors under the same names, with a config transformers reads. Routing either model
lacks is refused in one line, converting either way.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import (
    assert_converted_matches,
    assert_layout_matches,
    assert_round_trip,
    hf_reference,
    layout_worker,
)

from shardlm.checkpoint.hf_llama import ARCHITECTURES, hf_config_from_model, model_config_from_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

from multiproc import run_workers

VOCAB = 300
KINDS = ("mixtral", "qwen3_moe")


def hf_model_of(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500.0,
                  tie_word_embeddings=False)
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, **common))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                              head_dim=12, norm_topk_prob=True, **common))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Per kind: the saved HF directory, the converted file, reference logits and greedy tokens (`hf_reference`)."""
    out = {}
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    for kind in KINDS:
        torch.manual_seed(0)
        model = hf_model_of(kind).eval()
        with torch.no_grad():  # sharp attention and routing, so a slip in either moves the logits
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8.0)
                layer.self_attn.k_proj.weight.mul_(8.0)
                layer.mlp.gate.weight.mul_(30.0)  # the router (saved as block_sparse_moe.gate by Mixtral)
        out[kind] = hf_reference(model, tmp_path_factory.mktemp(kind), tokens)
    out["tokens"] = tokens
    return out


@pytest.fixture(scope="module")
def world2(hf_models):
    """TP=2 and EP=2 logits and greedy tokens of each converted model (`layout_checks`)."""
    paths = {kind: hf_models[kind]["converted"] for kind in KINDS}
    return run_workers(2, layout_worker, paths, hf_models["tokens"], timeout=300)


@pytest.mark.parametrize("kind", KINDS)
def test_conversion_reads_the_routing(hf_models, kind):
    config, tensors = load_consolidated(hf_models[kind]["converted"])
    m = config.model
    assert (m.moe_num_experts, m.moe_top_k, m.moe_score, m.moe_norm_topk_prob) == (4, 2, "softmax", True)
    assert m.moe_ffn_size == (48 if kind == "mixtral" else 24) and m.qk_norm == (kind == "qwen3_moe")
    assert tensors["model/layers.1.mlp.router.weight"].shape == (4, 32)
    assert tensors["model/layers.0.mlp.experts.down.3"].shape == (32, m.moe_ffn_size)


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_logits_and_greedy_tokens_match_transformers(hf_models, kind):
    assert_converted_matches(hf_models[kind])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("kind", KINDS)
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, hf_models, layout, kind):
    assert_layout_matches(world2, f"{layout} {kind}", hf_models[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(hf_models, kind, tmp_path):
    assert_round_trip(hf_models[kind], tmp_path / "back", type(hf_model_of(kind)))


def moe_model(kind: str, **routing):
    """shardlm's [model] of a small Mixtral (kind "mixtral") or Qwen3-MoE ("qwen3_moe": q/k norms), with `routing`."""
    return ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, seq_length=64,
                       vocab_size=VOCAB, ffn_hidden_size=48, dropout=0.0, moe_num_experts=4, moe_top_k=2,
                       moe_norm_topk_prob=True, qk_norm=kind == "qwen3_moe", **routing)


@pytest.mark.parametrize("routing,words", [
    ({"moe_shared_experts": 1}, "shared experts"),
    ({"moe_groups": 2, "moe_topk_groups": 1}, "group-limited routing"),
    ({"moe_expert_bias_rate": 1e-3}, "expert bias"),
    ({"moe_routed_scaling": 2.5}, "moe_routed_scaling"),
    ({"moe_layer_interval": 2}, "moe_layer_interval > 1"),
])
@pytest.mark.parametrize("kind", KINDS)
def test_routing_neither_model_has_does_not_export(kind, routing, words):
    """A shardlm MoE model whose routing Mixtral and Qwen3-MoE do not compute (shared experts, groups, an expert
    bias, routed scaling, MoE layers at an interval) is refused in one line naming it, instead of an export that
    transformers would run differently; the same model without it exports as its kind."""
    assert hf_config_from_model(moe_model(kind))["model_type"] == kind
    with pytest.raises(UserError, match=f"{ARCHITECTURES[kind]} has no .*{words}") as error:
        hf_config_from_model(moe_model(kind, **routing))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind,change,words", [
    ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
])
def test_routing_neither_model_has_does_not_import(kind, change, words):
    """A Mixtral config with router jitter noise, a Qwen3-MoE config whose MoE layers are not "every layer after
    the first k": a one-line UserError naming the key (the config without the change converts)."""
    hf = hf_config_from_model(moe_model(kind))
    assert model_config_from_hf(hf).moe_num_experts == 4
    with pytest.raises(UserError, match=words) as error:
        model_config_from_hf(hf | change)
    assert "\n" not in str(error.value)
