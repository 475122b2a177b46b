"""Llama and transformers in one process: exact logits and greedy tokens, a rotary-layout slip caught, a
bitwise lossless round trip, RoPE positions under the KV cache, scoring selected positions, and one-line
refusals of HF configs shardlm's llama does not compute.

The reference is `llama_reference`'s random `LlamaForCausalLM`, whose q and k weights are scaled up so
attention is sharp and a rotary-layout slip shows in the logits.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import LOGIT_TOL, hf_llama, logits_and_greedy

from shardlm.checkpoint import load_model
from shardlm.checkpoint.hf import from_hf, to_hf
from shardlm.checkpoint.hf_llama import model_config_from_hf
from shardlm.errors import UserError
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


# -------------------------------------------------------------------------------------- YaRN

QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8}
"""Qwen3's long-context setting (its model cards' rope_scaling) at the tests' size: rows of 24 reach 3x past the 8
pretraining positions."""


def test_qwen3_with_yarn_matches_transformers_both_ways(tmp_path):
    """A random Qwen3 with YaRN reads as `rope_yarn_*` (the factor 0.1 ln 4 + 1 derived, on every layer), gives
    transformers' logits and greedy tokens, converts back bitwise with the same rotary (transformers reloads the same
    logits); the same weights without YaRN move the logits by more than 100 x LOGIT_TOL."""
    import dataclasses

    from llama_reference import assert_converted_matches, assert_round_trip, hf_reference
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from shardlm.checkpoint.files import write_consolidated
    from shardlm.checkpoint.state import load_consolidated

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters=QWEN3_YARN, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30.0)  # tokens decide the greedy continuation
        model.lm_head.weight.mul_(10.0)
    ref = hf_reference(model, tmp_path, torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1)))
    config, tensors = load_consolidated(ref["converted"])
    m = config.model
    assert (m.rope_yarn_factor, m.rope_yarn_original_positions, m.rope_yarn_attention_factor, m.rope_yarn_layers,
            m.qk_norm) == (4.0, 8, 0.0, "all", True)
    assert_converted_matches(ref)
    assert_round_trip(ref, tmp_path / "back", Qwen3ForCausalLM)
    config.model = dataclasses.replace(m, rope_yarn_factor=0.0)
    write_consolidated(tmp_path / "plain.safetensors", tensors, dataclasses.asdict(config))
    plain, _ = logits_and_greedy(tmp_path / "plain.safetensors", ParallelContext.single(), ref["tokens"])
    assert (plain - ref["logits"]).abs().max() > 100 * LOGIT_TOL


def sharp_llama_reference(root, rope: dict) -> dict:
    """`hf_reference` of a random 2-layer `LlamaForCausalLM` (hidden 64, 4 heads over 2 KV heads) rotating by `rope`
    (its rope_parameters), on 2 rows of 24 tokens: sharp attention (q, k x 8), tokens that decide the greedy
    continuation (embedding x 30) and logits far from flat (output x 10), so a rotary slip shows."""
    from llama_reference import hf_reference
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_parameters=rope,
        tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30.0)
        model.lm_head.weight.mul_(10.0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return hf_reference(model, root, torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1)))


LLAMA31_TINY = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
"""Llama 3.1's rope scaling at the tests' size: over 16 pretraining positions, 16-channel heads at theta 500 have
wavelengths from 6 to 1,500 positions, so some frequencies stay, some are divided by 8 and some are blended."""


def test_llama31_rope_scaling_matches_transformers_both_ways(tmp_path):
    """A random Llama with Llama 3.1's scaling (rope_scaling type "llama3") reads as `rope_llama3_*`, gives
    transformers' logits and greedy tokens and converts back bitwise (transformers reloads the same logits); the
    same weights without the scaling move the logits by more than 100 x LOGIT_TOL, and so does each frequency band
    handled as the other (the blend's bounds swapped)."""
    import dataclasses

    from llama_reference import assert_converted_matches, assert_round_trip
    from transformers import LlamaForCausalLM

    from shardlm.checkpoint.files import write_consolidated
    from shardlm.checkpoint.state import load_consolidated

    ref = sharp_llama_reference(tmp_path, LLAMA31_TINY)
    config, tensors = load_consolidated(ref["converted"])
    m = config.model
    assert (m.rope_llama3_factor, m.rope_llama3_low_freq_factor, m.rope_llama3_high_freq_factor,
            m.rope_llama3_original_positions, m.rope_yarn_factor) == (8.0, 1.0, 4.0, 16, 0.0)
    assert_converted_matches(ref)
    assert_round_trip(ref, tmp_path / "back", LlamaForCausalLM)
    for name, change in (("plain", {"rope_llama3_factor": 0.0}),
                         ("bands swapped", {"rope_llama3_low_freq_factor": 4.0, "rope_llama3_high_freq_factor": 1.0})):
        config.model = dataclasses.replace(m, **change)
        write_consolidated(tmp_path / f"{name}.safetensors", tensors, dataclasses.asdict(config))
        other = logits_and_greedy(tmp_path / f"{name}.safetensors", ParallelContext.single(), ref["tokens"])[0]
        assert (other - ref["logits"]).abs().max() > 100 * LOGIT_TOL, name


# -------------------------------------------------------------------------------------- export refusals

@pytest.mark.parametrize("change,words", [
    ({"sliding_window": 4}, "LlamaForCausalLM has no sliding windows"),
    ({"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "qk_norm": True},
     "Qwen3ForCausalLM has no sliding windows"),
    ({"norm_zero_centered": True}, "LlamaForCausalLM has no zero-centred norms"),
], ids=["llama-window", "qwen3-window", "zero-centred"])
def test_pieces_a_llama_class_would_drop_are_refused_on_export(tmp_path, change, words, capsys):
    """`shardlm convert --to-hf` of a checkpoint directory whose model has a piece the HF class it would become does
    not compute (each moves the logits: the class would load and compute another model): exit 2, one line naming it,
    and nothing written beside or at the output."""
    from test_training import synthetic_data, tiny_config

    from shardlm.checkpoint import save_checkpoint
    from shardlm.cli import main
    from shardlm.training.trainer import Trainer

    config = tiny_config(micro=8, steps=1)
    for key, value in ({"arch": "llama", "num_kv_heads": 2, "layer_types": []} | change).items():
        setattr(config.model, key, value)
    config.model.num_layers = 2
    save_checkpoint(Trainer(config, ParallelContext.single(), synthetic_data()), tmp_path / "run")
    out = tmp_path / "exports" / "hf"
    assert main(["convert", "--to-hf", str(out), "--checkpoint", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip()
    assert words in error and "\n" not in error, error
    assert not (tmp_path / "exports").exists() or not any((tmp_path / "exports").iterdir())


# A Llama 3 config.json as Meta's checkpoints ship it (rope_theta and rope_scaling at the top level), made small.
LLAMA3_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
                 "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                 "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def test_partial_rotary_factor_is_read_where_transformers_reads_it(tmp_path):
    """transformers' Llama rotates whole heads whatever partial_rotary_factor says (GLM-4.5 and MiniMax-M2 read it):
    a random Llama with partial_rotary_factor 0.5 converts to a whole-head rotary and gives transformers' logits; a
    shardlm Llama with partial rotary is refused on export (LlamaForCausalLM would rotate every channel)."""
    import dataclasses

    from llama_reference import assert_converted_matches

    from shardlm.checkpoint.hf_llama import hf_config_from_model
    from shardlm.checkpoint.state import load_consolidated

    ref = sharp_llama_reference(tmp_path, {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})
    m = load_consolidated(ref["converted"])[0].model
    assert m.rope_fraction == 1.0
    assert_converted_matches(ref)
    with pytest.raises(UserError, match="LlamaForCausalLM has no partial rotary embeddings"):
        hf_config_from_model(dataclasses.replace(m, rope_fraction=0.5))


def test_llama31_config_json_reads_its_rope_scaling():
    """Meta's Llama 3.1 config.json (rope_scaling at the top level) and transformers 5's (rope_parameters) read
    alike."""
    for hf in (LLAMA3_CONFIG | {"rope_scaling": LLAMA31_ROPE},
               LLAMA3_CONFIG | {"rope_parameters": {"rope_theta": 500000.0, **LLAMA31_ROPE}}):
        m = model_config_from_hf(hf)
        assert (m.rope_theta, m.rope_llama3_factor, m.rope_llama3_low_freq_factor, m.rope_llama3_high_freq_factor,
                m.rope_llama3_original_positions) == (500000.0, 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "no low_freq_factor, high_freq_factor"),
    ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "longrope", "factor": 8.0}}, "rope type 'longrope'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "rope type 'dynamic'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "no original_max_position_embeddings"),
    ({"attention_bias": True}, "biases"),
    ({"mlp_bias": True}, "biases"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 32}, "sliding-window"),
    ({"model_type": "mixtral", "sliding_window": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
     "sliding-window"),
], ids=["llama3-incomplete", "longrope-rope-parameters", "dynamic", "yarn-without-length", "attention-bias",
        "mlp-bias", "gelu", "qwen3-window", "mixtral-window"])
def test_configs_llama_does_not_compute_are_refused_in_one_line(change, words):
    """Rope scaling other than YaRN and Llama 3.1's (dynamic NTK, longrope), either without its settings,
    attention or MLP biases, an activation other than silu and
    sliding-window attention: a one-line UserError naming it, not a model that computes something else. The
    config without the change converts."""
    assert model_config_from_hf(LLAMA3_CONFIG).rope_theta == 500000.0
    with pytest.raises(UserError) as error:
        model_config_from_hf(LLAMA3_CONFIG | change)
    assert words in str(error.value) and "\n" not in str(error.value)
