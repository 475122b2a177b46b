"""Llama and transformers in one process: exact logits and greedy tokens, a rotary-layout slip caught, a
bitwise lossless round trip, RoPE positions under the KV cache, and scoring selected positions.

The reference is `llama_reference`'s random `LlamaForCausalLM`, whose q and k weights are scaled up so
attention is sharp and a rotary-layout slip shows in the logits.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import LOGIT_TOL, hf_llama, logits_and_greedy

from shardlm.checkpoint import load_model
from shardlm.checkpoint.hf import from_hf, to_hf
from shardlm.parallel import ParallelContext


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The HF model, its saved directory, the converted shardlm file, and reference logits and tokens."""
    return hf_llama(tmp_path_factory.mktemp("llama"))


# -------------------------------------------------------------------------------------- HF interop

def test_tp1_logits_match_transformers(hf_model):
    logits, tokens = logits_and_greedy(hf_model["converted"], ParallelContext.single(), hf_model["tokens"])
    assert hf_model["logits"].std() > 0.1, "reference logits too flat to tell layouts apart"
    assert (logits - hf_model["logits"]).abs().max() < LOGIT_TOL
    assert tokens == hf_model["greedy"]


def test_a_rotary_permutation_bug_would_be_caught(hf_model):
    """Meta's interleaved pairing of channels instead of HF's rotate-half halves (the classic conversion
    bug) moves the logits far beyond the tolerance, so the comparisons with transformers test the layout."""
    model, _ = load_model(hf_model["converted"], ParallelContext.single())
    with torch.no_grad():
        for layer in model.layers.values():
            for weight in (layer.attn.q.weight, layer.attn.k.weight):  # rows (heads, 2 halves, 8) -> (heads, 8, 2)
                weight.copy_(weight.view(-1, 2, 8, 96).transpose(1, 2).reshape(weight.shape))
        logits = model.full_logits(model(hf_model["tokens"]))
    assert (logits - hf_model["logits"]).abs().max() > 100 * LOGIT_TOL


def test_round_trip_to_hf_is_lossless(hf_model, tmp_path):
    from transformers import LlamaForCausalLM

    back = to_hf(hf_model["converted"], tmp_path / "back")
    reloaded = LlamaForCausalLM.from_pretrained(back)
    original = hf_model["model"].state_dict()
    assert reloaded.state_dict().keys() == original.keys()
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert reloaded.config.num_key_value_heads == 2 and reloaded.config.tie_word_embeddings is False
    again = from_hf(back, tmp_path / "again.safetensors")
    from safetensors.torch import load_file

    first, second = load_file(str(hf_model["converted"])), load_file(str(again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


# -------------------------------------------------------------------------------------- KV cache

def test_rope_positions_under_the_kv_cache_equal_the_uncached_forward(hf_model):
    model, _ = load_model(hf_model["converted"], ParallelContext.single())
    tokens = hf_model["tokens"]
    cache = model.new_kv_cache()
    with torch.no_grad():
        full = model(tokens)
        pieces = [model(tokens[:, :9], cache=cache)]
        pieces += [model(tokens[:, i:i + 1], cache=cache) for i in range(9, 14)]
        pieces.append(model(tokens[:, 14:], cache=cache))
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-5
    assert tuple(cache.layers[0].keys.shape)[:2] == (2, 2)  # the KV heads only, not one copy per query head


def test_evaluation_scores_selected_positions_of_a_llama(hf_model):
    """`logits_at` / `last_logits` (what wikitext, lambada and generate call) run Llama's output layer on the
    selected positions only, equal to the full forward there."""
    from shardlm.eval.head import last_logits, logits_at

    model, _ = load_model(hf_model["converted"], ParallelContext.single())
    tokens = hf_model["tokens"]
    keep = torch.zeros_like(tokens, dtype=torch.bool)
    keep[:, 5::7] = True
    with torch.no_grad():
        full = model(tokens)
        assert torch.allclose(logits_at(model, tokens, keep), full[keep], atol=1e-6)
        assert torch.allclose(last_logits(model, tokens), full[:, -1], atol=1e-6)
