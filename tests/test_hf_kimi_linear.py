"""Kimi Linear (`KimiLinearForCausalLM`) against transformers: conversion both ways, logits and greedy tokens at TP=1,
TP=2 and EP=2, a round trip bitwise, and a run started from the directory giving transformers' first loss.

A random small model: 4 layers alternating Kimi Delta Attention (4 heads of 8 channels, a kernel of 4) and MLA
without positions (4 heads, latent 16, nope 8 + rope 4 key channels, values 8); the first layer's MLP dense, the
others MoE (4 experts, top 2, a shared expert, sigmoid routing with a random score-correction bias). `A_log` and
`dt_bias` drawn from N(0, 1) and the low-rank gates' weights scaled up (visible decays, different per channel, and
output gates away from 1/2), norms from U(0.5, 2) (the KDA output's gated
norm among them), MLA's q and kv_b scaled up (sharp attention), the embedding scaled up (the tokens decide the
greedy continuation). 80 tokens: two chunks of the chunked rule. The controls: the same file with a KDA layer's
f_a and g_a swapped, or its dt_bias reversed per head, moves the logits far off."""

from __future__ import annotations

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_layout_matches,
    assert_read_in_place,
    assert_round_trip,
    hf_reference,
    layout_worker,
    variant_logits,
)

from shardlm.checkpoint.state import load_consolidated
from shardlm.parallel import ParallelContext

from multiproc import run_workers

VOCAB = 300
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
              intermediate_size=48, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, routed_scaling_factor=2.0, linear_num_heads=4, linear_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=128, tie_word_embeddings=False,
              layer_types=["linear_attention", "full_attention"] * 2,
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hf_model():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**CONFIG)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "forget_gate"):
                attn.forget_gate.A_log.normal_(0, 1)
                attn.forget_gate.dt_bias.normal_(0, 1)
                gates = (attn.forget_gate.f_a_proj, attn.forget_gate.f_b_proj, attn.g_a_proj, attn.g_b_proj)
                for projection in gates:  # low-rank gates that matter: softplus and sigmoid inputs of O(1)
                    projection.weight.mul_(10.0)
            else:
                attn.q_proj.weight.mul_(4.0)
                attn.kv_b_proj.weight.mul_(4.0)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        model.model.embed_tokens.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tokens = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(1))
    return hf_reference(hf_model(), tmp_path_factory.mktemp("kimi_linear"), tokens)


@pytest.fixture(scope="module")
def world2(reference):
    return run_workers(2, layout_worker, {"kimi": reference["converted"]}, reference["tokens"], timeout=600)


def test_conversion_reads_the_kda_and_mla_layers(reference):
    config, tensors = load_consolidated(reference["converted"])
    m = config.model
    assert (m.linear_attention_rule, m.attention, m.mla_nope, m.moe_first_dense_layers, m.moe_score) == (
        "kimi_delta", "mla", True, 1, "sigmoid")
    assert m.layer_types == ["linear_attention", "full_attention"] * 2 and m.moe_expert_bias
    assert tensors["model/layers.0.attn.conv_v"].shape == (32, 4) and tensors["model/layers.0.attn.A_log"].shape == (4,)
    assert tensors["model/layers.2.attn.f_a"].shape == (8, 32) and tensors["model/layers.2.attn.dt_bias"].shape == (32,)


def test_tp1_logits_and_greedy_tokens_match_transformers(reference):
    assert_converted_matches(reference)


def test_the_hf_directory_itself_loads_without_converting(reference):
    assert_read_in_place(reference)


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, reference, layout):
    assert_layout_matches(world2, f"{layout} kimi", reference)


def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(reference, tmp_path):
    from transformers import KimiLinearForCausalLM

    assert_round_trip(reference, tmp_path / "back", KimiLinearForCausalLM)


def test_transformers_in_memory_names_give_the_same_tensors(reference, tmp_path):
    """A directory in transformers' in-memory names (`forget_gate.*`, one `conv1d` of [q | k | v], `mlp.*`, stacked
    experts: a state_dict saved as is) converts to bitwise the tensors of the saved directory."""
    import shutil

    from safetensors.torch import save_file
    from transformers import KimiLinearForCausalLM

    from shardlm.checkpoint.hf import from_hf

    folder = tmp_path / "in_memory"
    folder.mkdir()
    shutil.copy(reference["root"] / "hf" / "config.json", folder / "config.json")
    state = KimiLinearForCausalLM.from_pretrained(reference["root"] / "hf").state_dict()
    assert {"model.layers.0.self_attn.conv1d.weight", "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.0.self_attn.forget_gate.A_log"} <= state.keys()
    save_file({name: value.contiguous() for name, value in state.items()}, str(folder / "model.safetensors"))
    _, theirs = load_consolidated(from_hf(folder, tmp_path / "in_memory.safetensors"))
    _, ours = load_consolidated(reference["converted"])
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[name], ours[name]) for name in ours)


PUBLISHED_STYLE = dict(model_type="kimi_linear", vocab_size=300, hidden_size=32, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48,
                       moe_intermediate_size=16, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                       moe_renormalize=True, routed_scaling_factor=2.0, first_k_dense_replace=1, moe_layer_freq=1,
                       model_max_length=128, mla_use_nope=True, moe_router_activation_func="sigmoid",
                       linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 8,
                                           "num_heads": 4, "short_conv_kernel_size": 4})
"""A config.json in the published checkpoints' style: the linear layers in linear_attn_config (1-based), the MoE keys
under their own names, first_k_dense_replace instead of mlp_layer_types."""


def test_a_published_style_config_reads_as_transformers_reads_it():
    """The published style and transformers' own config.json of the same model (KimiLinearConfig's parse of it,
    saved) give the same [model] section."""
    from transformers import KimiLinearConfig

    from shardlm.checkpoint.hf_kimi_linear import model_config_from_hf

    theirs = KimiLinearConfig(**{k: v for k, v in PUBLISHED_STYLE.items() if k != "model_type"}).to_dict()
    ours = model_config_from_hf(PUBLISHED_STYLE)
    assert ours == model_config_from_hf(theirs)
    assert ours.layer_types == ["linear_attention", "full_attention"] * 2 and ours.moe_first_dense_layers == 1


@pytest.mark.parametrize("change,message", [
    ({"attention_bias": True}, "attention biases"), ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"moe_router_activation_func": "softmax"}, "a router other than sigmoid"),
    ({"mla_use_nope": False}, "MLA with rotary embeddings"), ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, "mix dense and MoE layers"),
])
def test_what_shardlm_does_not_compute_is_refused_in_one_line(change, message):
    from shardlm.checkpoint.hf_kimi_linear import model_config_from_hf
    from shardlm.errors import UserError

    with pytest.raises(UserError, match=message) as error:
        model_config_from_hf(PUBLISHED_STYLE | change)
    assert "\n" not in str(error.value)


def swap_low_rank_downs(tensors: dict) -> None:
    tensors["model/layers.0.attn.f_a"], tensors["model/layers.0.attn.g_a"] = (
        tensors["model/layers.0.attn.g_a"], tensors["model/layers.0.attn.f_a"])


def reverse_dt_bias(tensors: dict) -> None:
    tensors["model/layers.2.attn.dt_bias"] = tensors["model/layers.2.attn.dt_bias"].view(4, 8).flip(-1).flatten()


@pytest.mark.parametrize("change", [swap_low_rank_downs, reverse_dt_bias])
def test_controls_move_the_logits(reference, tmp_path, change):
    """A converter that swapped the two low-rank gates' down-projections, or read dt_bias's channels in another
    order within each head, would be caught: the logits move far beyond the tolerance."""
    logits = variant_logits(reference, tmp_path / "variant.safetensors", change)
    assert (logits - reference["logits"]).abs().max() > 100 * LOGIT_TOL


def test_a_run_started_from_the_directory_gives_transformers_loss_and_learns(reference):
    """`checkpoint.init_from=DIR` with [model] left empty: the first step's loss is transformers' on the same batch
    (within 1e-5), and the steps lower it."""
    from test_hf_start import BATCH, hf_loss, run_config, started_run
    from test_training import synthetic_data
    from transformers import KimiLinearForCausalLM

    from shardlm.training.data import micro_batches

    batch = micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]
    model = KimiLinearForCausalLM.from_pretrained(reference["root"] / "hf").eval()
    run = started_run(ParallelContext.single(), run_config(reference["root"] / "hf"))
    losses = [loss for loss, _ in run["curve"]]
    assert abs(losses[0] - hf_loss(model, batch)) <= 1e-5 * losses[0] and losses[-1] < losses[0]
