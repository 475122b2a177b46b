"""Nemotron-H (`NemotronHForCausalLM`) against transformers: conversion both ways, logits and greedy tokens at TP=1,
TP=2 and EP=2, a run started from the directory, decoding against the full forward.

Random small models: "dense", 5 layers "M*-M-" (Mamba-2, attention without positions, ReLU^2 MLP), 4 Mamba heads
of 8 channels in 2 groups with a 16-channel state, a kernel of 4 with its bias; 4 query heads and 2 KV heads; and
"moe" (Nemotron 3), "ME*E": 4 ReLU^2 experts in 2 groups (one chosen per token, then the top 2 in it) beside a
shared expert, sigmoid scores with a random score-correction bias, the top-2 renormalized and scaled by 2.5.
`A_log`, `dt_bias`, `D` and the convolution's bias drawn from N(0, 1) (visible decays and skips), norms from
U(0.5, 2) (the gated norm's per group too), the embedding scaled up (tokens decide the greedy continuation).
80 tokens: three chunks of the scan (the config's chunk_size 32, which shardlm reads as mamba_chunk_size).
shardlm's logits equal transformers' (its PyTorch path) within 1e-4 at TP=1, TP=2 (heads, groups and the
convolution's channels split) and EP=2, greedy generation (the SSM state and the convolution's window as the
cache) gives transformers' tokens, and converting back gives bitwise the saved tensors under the same names,
with a config transformers reads."""

from __future__ import annotations

import json

import pytest
import torch
from llama_reference import (
    assert_converted_matches,
    assert_layout_matches,
    assert_read_in_place,
    assert_round_trip,
    assert_router_without_bias_exports,
    hf_reference,
    layout_worker,
    variant_logits,
)

from shardlm.checkpoint import load_model
from shardlm.checkpoint.hf_nemotron_h import model_config_from_hf
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext

from multiproc import run_workers

VOCAB = 300
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, layers_block_type=["linear_attention", "full_attention", "mlp",
                                                                    "linear_attention", "mlp"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
              mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=32,
              max_position_embeddings=128, tie_word_embeddings=False)
MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2,
           topk_group=1, routed_scaling_factor=2.5)
FAMILIES = ("dense", "moe")


def hf_model(family: str):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**(CONFIG | (MOE if family == "moe" else {})))).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = layer.mixer
            if hasattr(mixer, "A_log"):  # visible decays and skips, and Mamba layers that weigh in the logits
                for param in (mixer.A_log, mixer.dt_bias, mixer.D, mixer.conv1d.bias):
                    param.copy_(torch.randn(param.shape, generator=generator))
                mixer.in_proj.weight.mul_(8.0)
                mixer.out_proj.weight.mul_(4.0)
            elif hasattr(mixer, "q_proj"):  # sharp attention
                mixer.q_proj.weight.mul_(4.0)
                mixer.k_proj.weight.mul_(4.0)
            elif hasattr(mixer, "experts"):  # a bias that changes the choice, experts that weigh in
                mixer.gate.e_score_correction_bias.copy_(torch.rand(4, generator=generator) * 0.2)
                mixer.experts.up_proj.mul_(4.0)
        model.model.embeddings.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tokens = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(1))
    return {family: hf_reference(hf_model(family), tmp_path_factory.mktemp(family), tokens) for family in FAMILIES}


@pytest.fixture(scope="module")
def reference(references):
    return references["dense"]


@pytest.fixture(scope="module")
def world2(references):
    paths = {family: ref["converted"] for family, ref in references.items()}
    return run_workers(2, layout_worker, paths, references["dense"]["tokens"], timeout=600)


def test_conversion_reads_the_pattern_and_the_mamba_layers(references):
    from shardlm.checkpoint.state import load_consolidated

    reference = references["dense"]
    config, tensors = load_consolidated(reference["converted"])
    m = config.model
    assert (m.layer_pattern, m.mamba_num_heads, m.mamba_head_dim, m.mamba_state_size, m.mamba_groups) == (
        "M*-M-", 4, 8, 16, 2)
    assert tensors["model/layers.0.mixer.conv_B"].shape == (32, 4) and tensors["model/layers.0.mixer.dt.weight"].shape \
        == (4, 32)
    moe = load_consolidated(references["moe"]["converted"])[0].model
    assert (moe.layer_pattern, moe.moe_num_experts, moe.moe_groups, moe.moe_topk_groups, moe.moe_score,
            moe.moe_expert_bias, moe.moe_routed_scaling) == ("ME*E", 4, 2, 1, "sigmoid", True, 2.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_logits_and_greedy_tokens_match_transformers(references, family):
    assert_converted_matches(references[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hf_directory_itself_loads_without_converting(references, family):
    assert_read_in_place(references[family])


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, references, layout, family):
    assert_layout_matches(world2, f"{layout} {family}", references[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(references, family, tmp_path):
    from transformers import NemotronHForCausalLM

    assert_round_trip(references[family], tmp_path / "back", NemotronHForCausalLM)


def test_a_router_trained_without_its_bias_exports_with_a_zero_one(references, tmp_path):
    from transformers import NemotronHForCausalLM

    assert_router_without_bias_exports(references["moe"], tmp_path, NemotronHForCausalLM)


def test_controls_the_conversion_can_fail(references, tmp_path):
    """in_proj's B and C rows swapped, the convolution's bias dropped, or the MoE's score-correction bias dropped
    (the choice then differs), move the logits far beyond 1e-4."""
    reference = references["dense"]
    def swap(tensors):
        tensors["model/layers.0.mixer.B.weight"], tensors["model/layers.0.mixer.C.weight"] = (
            tensors["model/layers.0.mixer.C.weight"], tensors["model/layers.0.mixer.B.weight"])

    def no_bias(tensors):
        tensors["model/layers.3.mixer.conv_x_bias"] = torch.zeros_like(tensors["model/layers.3.mixer.conv_x_bias"])

    for i, change in enumerate((swap, no_bias)):
        assert (variant_logits(reference, tmp_path / f"v{i}.safetensors", change) - reference["logits"]).abs().max() \
            > 1e-2

    def no_choice_bias(tensors):
        tensors["model/layers.1.mixer.router.expert_bias"] = torch.zeros(4)

    moe = references["moe"]
    assert (variant_logits(moe, tmp_path / "v2.safetensors", no_choice_bias) - moe["logits"]).abs().max() > 1e-2


def test_decoding_token_by_token_equals_the_full_forward(reference):
    """The cache (each Mamba layer's SSM state and convolution window, the attention's keys and values, the MLP
    layers' count) fed one token at a time, after a prompt of 7, gives the full forward's logits within 1e-5."""
    model, _ = load_model(reference["converted"], ParallelContext.single())
    tokens = reference["tokens"][:, :20]
    with torch.no_grad():
        full = model.full_logits(model(tokens))
        cache = model.new_kv_cache(32)
        steps = [model.full_logits(model(tokens[:, :7], cache=cache))]
        steps += [model.full_logits(model(tokens[:, t:t + 1], cache=cache)) for t in range(7, 20)]
    assert cache.length == 20 and (torch.cat(steps, 1) - full).abs().max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_started_from_the_directory_gives_transformers_loss_and_learns(references, family):
    """`checkpoint.init_from=DIR` with [model] left empty: the first step's loss is transformers' on the same batch
    (within 1e-5), and three steps lower it."""
    from test_hf_start import BATCH, hf_loss, run_config, started_run
    from test_training import synthetic_data
    from transformers import NemotronHForCausalLM

    from shardlm.training.data import micro_batches

    reference = references[family]
    batch = micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]
    model = NemotronHForCausalLM.from_pretrained(reference["root"] / "hf").eval()
    run = started_run(ParallelContext.single(), run_config(reference["root"] / "hf"))
    losses = [loss for loss, _ in run["curve"]]
    assert abs(losses[0] - hf_loss(model, batch)) <= 1e-5 * losses[0] and losses[-1] < losses[0]


@pytest.mark.parametrize("change, message", [
    ({"moe_latent_size": 16}, "latent projections"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"use_bias": True}, "biases"),
    ({"time_step_limit": [0.0, 0.1]}, "time_step_limit"),
])
def test_what_shardlm_does_not_compute_is_refused_in_one_line(reference, change, message):
    hf = json.loads((reference["root"] / "hf" / "config.json").read_text()) | change
    with pytest.raises(UserError, match=message) as caught:
        model_config_from_hf(hf)
    assert "\n" not in str(caught.value)
