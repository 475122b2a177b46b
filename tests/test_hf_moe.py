"""Mixtral and Qwen3-MoE against transformers: conversion both ways, logits and greedy tokens at every layout.

A random `MixtralForCausalLM` and a random `Qwen3MoeForCausalLM` (4 experts, top-2; Qwen3-MoE with
head_dim 12 at hidden 32, q/k norms, norm_topk_prob) are saved and converted. shardlm's logits equal
transformers' within 1e-4 at TP=1, TP=2 and EP=2 (experts split over 2 ranks, tokens dispatched by
all-to-all), greedy generation with the KV cache gives transformers' tokens, and converting back gives
bitwise the saved tensors under the same names, with a config transformers reads.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import NEW_TOKENS, PROMPT, assert_round_trip, logits_and_greedy

from shardlm.checkpoint.hf import from_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.parallel import ParallelContext

from multiproc import run_workers

VOCAB, LOGIT_TOL = 300, 1e-4
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
    """Per kind: the saved HF directory, the converted file, reference logits and greedy tokens."""
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
        root = tmp_path_factory.mktemp(kind)
        model.save_pretrained(root / "hf")
        with torch.no_grad():
            logits = model(tokens).logits
            greedy = model.generate(tokens[:, :PROMPT], attention_mask=torch.ones(2, PROMPT, dtype=torch.long),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        out[kind] = {"root": root, "converted": from_hf(root / "hf", root / "model.safetensors"),
                     "logits": logits, "greedy": greedy[:, PROMPT:].tolist()}
    out["tokens"] = tokens
    return out


def worker_world2(paths: dict, tokens: torch.Tensor) -> dict:
    """TP=2 and EP=2 (DP=2: both ranks see the same tokens and must give the same logits)."""
    out = {}
    for name, ctx in (("tp2", ParallelContext.from_process_group(2)),
                      ("ep2", ParallelContext.from_process_group(1, expert_parallel=2))):
        for kind, path in paths.items():
            out[(name, kind)] = logits_and_greedy(path, ctx, tokens)
    return out


@pytest.fixture(scope="module")
def world2(hf_models):
    paths = {kind: hf_models[kind]["converted"] for kind in KINDS}
    return run_workers(2, worker_world2, paths, hf_models["tokens"], timeout=300)


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
    ref = hf_models[kind]
    logits, tokens = logits_and_greedy(ref["converted"], ParallelContext.single(), hf_models["tokens"])
    assert ref["logits"].std() > 0.1, "reference logits too flat to tell layouts apart"
    assert (logits - ref["logits"]).abs().max() < LOGIT_TOL
    assert tokens == ref["greedy"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("kind", KINDS)
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, hf_models, layout, kind):
    for rank in world2:
        logits, tokens = rank[(layout, kind)]
        assert (logits - hf_models[kind]["logits"]).abs().max() < LOGIT_TOL
        assert tokens == hf_models[kind]["greedy"]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(hf_models, kind, tmp_path):
    ref = hf_models[kind]
    assert_round_trip(ref["converted"], ref["root"] / "hf", tmp_path / "back", type(hf_model_of(kind)),
                      hf_models["tokens"], ref["logits"])
