"""Qwen3-Next (`Qwen3NextForCausalLM`), Qwen3.5 (`Qwen3_5ForCausalLM`, text) and Qwen3.5-MoE
(`Qwen3_5MoeForCausalLM`) against transformers: conversion both ways, logits and greedy tokens at every layout,
the multi-token-prediction layer kept, a multimodal Qwen3.5 directory's language model read.

Random small models of each: 4 layers (three Gated DeltaNet, then gated full attention), 2 key heads and 4 value
heads, partial RoPE, grouped-query attention; the MoE ones with 4 experts and a gated shared expert. `A_log` and
`dt_bias` drawn from N(0, 1) (visible decays), norms from U(0.5, 2) (the zero-centred ones then scale by 1.5-3),
q and k scaled up (sharp attention), the embedding scaled up (tokens decide the greedy continuation). 80 tokens:
two chunks of the chunked rule. shardlm's logits equal transformers' (its PyTorch path) within 1e-4 at TP=1,
TP=2 (heads and convolution channels split) and EP=2, greedy generation (the recurrent state as the cache) gives
transformers' tokens, and converting back gives bitwise the saved tensors under the same names, with a config
transformers reads. The MTP layer, which transformers does not run, gives the logits of its computation by hand
(its three zero-centred norms, each from its own tensor, around transformers' decoder layer) within 1e-4."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_layout_matches,
    assert_read_in_place,
    assert_round_trip,
    hf_reference,
    layout_checks,
    logits_and_greedy,
)

from shardlm.checkpoint.hf import from_hf, to_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.parallel import ParallelContext

from multiproc import run_checks, run_workers

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, intermediate_size=48, max_position_embeddings=128, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def hf_classes(family: str):
    """(config class, model class, config keys) of a family."""
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        return Qwen3NextConfig, Qwen3NextForCausalLM, COMMON | MOE
    if family == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        return Qwen3_5TextConfig, Qwen3_5ForCausalLM, COMMON
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, {k: v for k, v in (COMMON | MOE).items()
                                                         if k != "intermediate_size"}


def hf_model(family: str, **changes):
    """A random model of `family` (its config keys with `changes`): visible decays, sharp attention, tokens that
    decide the greedy continuation."""
    config_class, model_class, keys = hf_classes(family)
    torch.manual_seed(0)
    model = model_class(config_class(**(keys | changes))).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.normal_(0, 1)
                layer.linear_attn.dt_bias.normal_(0, 1)
            else:
                layer.self_attn.q_proj.weight.mul_(4.0)
                layer.self_attn.k_proj.weight.mul_(4.0)
        model.model.embed_tokens.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tokens = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(1))
    return {family: hf_reference(hf_model(family), tmp_path_factory.mktemp(family), tokens) for family in FAMILIES}


def worker_world2(paths: dict, tokens: torch.Tensor) -> dict:
    return run_checks(layout_checks(paths, tokens))


@pytest.fixture(scope="module")
def world2(references):
    paths = {family: ref["converted"] for family, ref in references.items()}
    return run_workers(2, worker_world2, paths, references["qwen3_next"]["tokens"], timeout=600)


def test_conversion_reads_the_hybrid_layers(references):
    config, tensors = load_consolidated(references["qwen3_next"]["converted"])
    m = config.model
    assert m.layer_types == ["linear_attention"] * 3 + ["full_attention"] and m.hf_linear_projections == "grouped"
    assert (m.attention_output_gate, m.norm_zero_centered, m.rope_fraction, m.moe_shared_expert_gate) == (
        True, True, 0.25, True)
    assert tensors["model/layers.0.attn.conv_v"].shape == (32, 4) and tensors["model/layers.3.attn.q.weight"].shape == (
        64, 32)
    assert load_consolidated(references["qwen3_5"]["converted"])[0].model.hf_linear_projections == "separate"


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_logits_and_greedy_tokens_match_transformers(references, family):
    assert_converted_matches(references[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hf_directory_itself_loads_without_converting(references, family):
    """What `checkpoint.init_from=DIR` (starting SFT from the directory) reads: the directory in place."""
    assert_read_in_place(references[family])


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, references, layout, family):
    assert_layout_matches(world2, f"{layout} {family}", references[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(references, family, tmp_path):
    assert_round_trip(references[family], tmp_path / "back", hf_classes(family)[1])


def test_qwen35_router_renormalizes_whatever_its_config_says(tmp_path):
    """Qwen3.5-MoE's router divides the chosen scores by their sum even with norm_topk_prob = false in its config:
    such a directory reads as moe_norm_topk_prob = true and gives transformers' logits (a sharp router makes the
    difference show: 0.02 when read as stated); exporting a Qwen3.5-MoE without renormalization is refused."""
    import dataclasses

    from shardlm.checkpoint.hf import check_convertible
    from shardlm.errors import UserError

    model = hf_model("qwen3_5_moe", norm_topk_prob=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10.0)
    ref = hf_reference(model, tmp_path, torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(1)))
    m = load_consolidated(ref["converted"])[0].model
    assert m.moe_norm_topk_prob
    assert_converted_matches(ref)
    with pytest.raises(UserError, match="renormalizes the chosen scores"):
        check_convertible(dataclasses.replace(m, moe_norm_topk_prob=False))
    with pytest.raises(UserError, match="experts in every layer"):
        check_convertible(dataclasses.replace(m, moe_first_dense_layers=1))


def test_qwen35_moe_reads_past_the_dense_layer_keys_its_class_drops(tmp_path):
    """Qwen3_5MoeConfig drops mlp_only_layers and decoder_sparse_step (every layer has experts): a directory whose
    config.json states them converts with experts in every layer and gives transformers' logits."""
    import json
    import shutil

    from shardlm.checkpoint.hf import from_hf

    tokens = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(1))
    ref = hf_reference(hf_model("qwen3_5_moe"), tmp_path / "ref", tokens)
    folder = tmp_path / "stated"
    shutil.copytree(ref["root"] / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [0], "decoder_sparse_step": 2}))
    converted = from_hf(folder, tmp_path / "stated.safetensors")
    assert load_consolidated(converted)[0].model.moe_first_dense_layers == 0
    logits = logits_and_greedy(converted, ParallelContext.single(), tokens)[0]
    assert (logits - ref["logits"]).abs().max() < LOGIT_TOL


def test_yarn_converts_both_ways(tmp_path):
    """Qwen3.5 with YaRN x4 over 16 positions (on half of each head's channels, rows of 80): shardlm's logits and
    greedy tokens are transformers', the directory written back loads to the same logits bitwise, and the same
    weights without YaRN move the logits by more than 100 x LOGIT_TOL."""
    import dataclasses

    from shardlm.checkpoint.files import write_consolidated

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "partial_rotary_factor": 0.5}
    model = hf_model("qwen3_5", rope_parameters=rope)
    ref = hf_reference(model, tmp_path, torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(1)))
    config, tensors = load_consolidated(ref["converted"])
    assert (config.model.rope_yarn_factor, config.model.rope_yarn_original_positions, config.model.rope_fraction) == (
        4.0, 16, 0.5)
    assert_converted_matches(ref)
    assert_round_trip(ref, tmp_path / "back", hf_classes("qwen3_5")[1])
    config.model = dataclasses.replace(config.model, rope_yarn_factor=0.0)
    write_consolidated(tmp_path / "plain.safetensors", tensors, dataclasses.asdict(config))
    plain = logits_and_greedy(tmp_path / "plain.safetensors", ParallelContext.single(), ref["tokens"])[0]
    assert (plain - ref["logits"]).abs().max() > 100 * LOGIT_TOL


def test_the_multi_token_prediction_layer_is_kept(references, tmp_path):
    """Qwen3-Next ships one MTP layer (`mtp.fc`, its two input norms, a full-attention MoE layer, `mtp.norm`),
    which transformers neither runs nor saves. A directory holding it converts to `mtp.0.*`, builds a model that
    reads every tensor and gives transformers' next-token logits still, and converts back bitwise; the depth's own
    logits are `mtp_reference_logits`' within 1e-4."""
    from safetensors.torch import load_file, save_file

    from shardlm.checkpoint import load_model

    ref = references["qwen3_next"]
    folder = tmp_path / "with_mtp"
    shutil.copytree(ref["root"] / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(4)
    mtp = {"mtp.fc.weight": torch.randn(32, 64, generator=generator),
           "mtp.pre_fc_norm_embedding.weight": torch.rand(32, generator=generator),
           "mtp.pre_fc_norm_hidden.weight": torch.rand(32, generator=generator),
           "mtp.norm.weight": torch.rand(32, generator=generator)}
    mtp |= {name.replace("model.layers.3.", "mtp.layers.0."): torch.randn(value.shape, generator=generator)
            for name, value in weights.items() if name.startswith("model.layers.3.")}
    save_file(weights | mtp, str(folder / "model.safetensors"))
    converted = from_hf(folder, tmp_path / "mtp.safetensors")
    config, tensors = load_consolidated(converted)
    assert config.model.mtp_layers == 1 and torch.equal(tensors["model/mtp.0.eh_proj"], mtp["mtp.fc.weight"])
    model, _ = load_model(converted, ParallelContext.single())
    tokens = ref["tokens"]
    with torch.no_grad():
        assert (model.full_logits(model(tokens)) - ref["logits"]).abs().max() < 1e-4
        rolled = torch.cat((tokens[:, 1:], torch.zeros_like(tokens[:, :1])), dim=1)  # depth 1 reads t_{i+1}
        depth = model.mtp[0](model.embed(rolled, 0, None), model.hidden_states(tokens))
        ours = model.full_logits(model.output_layer(depth))[:, :-1]
    want = mtp_reference_logits(folder, mtp, tmp_path / "block", tokens)
    assert want.std() > 0.1 and (ours - want).abs().max() < 1e-4, (ours - want).abs().max()
    back = load_file(str(to_hf(converted, tmp_path / "back") / "model.safetensors"))
    assert back.keys() == (weights | mtp).keys()
    assert all(torch.equal(back[name], value) for name, value in (weights | mtp).items())


def mtp_reference_logits(folder, mtp: dict, scratch, tokens: torch.Tensor) -> torch.Tensor:
    """The MTP depth's logits of position i (predicting t_{i+2}) for i < T - 1, computed outside shardlm, as the
    published Qwen3-Next MTP runs (vLLM's `Qwen3NextMTP`): h = transformers' final-norm output of `tokens`,
    e = its embedding of t_{i+1}; x = fc([norm_e(e); norm_h(h)]); the block, a full-attention MoE decoder layer
    (transformers' own, loaded with `mtp.layers.0.*`, at positions 0..T-2 under the causal mask); then `mtp.norm`
    and the output layer. The three norms by hand: Qwen3-Next's zero-centred RMSNorm, x / rms(x) * (1 + w), each
    with its own tensor (`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextForCausalLM

    # transformers' decoder layer 3 (full attention, MoE) with the MTP block's weights: the saved directory with
    # layer 3's tensors replaced, loaded as transformers loads any (its per-expert tensors fused on the way in)
    shutil.copytree(folder, scratch)
    weights = load_file(str(folder / "model.safetensors"))
    save_file(weights | {name.replace("mtp.layers.0.", "model.layers.3."): value for name, value in mtp.items()
                         if name.startswith("mtp.layers.0.")}, str(scratch / "model.safetensors"))
    hf = Qwen3NextForCausalLM.from_pretrained(folder).eval()
    block = Qwen3NextForCausalLM.from_pretrained(scratch).eval().model.layers[3]
    eps = hf.config.rms_norm_eps

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)

    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state[:, :-1]
        embedded = hf.model.embed_tokens(tokens[:, 1:])
        x = torch.cat((norm(embedded, mtp["mtp.pre_fc_norm_embedding.weight"]),
                       norm(hidden, mtp["mtp.pre_fc_norm_hidden.weight"])), dim=-1) @ mtp["mtp.fc.weight"].t()
        length = x.shape[1]
        positions = torch.arange(length).unsqueeze(0)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        y = block(x, position_embeddings=hf.model.rotary_emb(x, positions), attention_mask=causal,
                  position_ids=positions)
        return hf.lm_head(norm(y, mtp["mtp.norm.weight"]))


def test_a_multimodal_qwen35_directory_gives_its_language_model(references, tmp_path):
    """Qwen3.5's published checkpoints are image-text models: config.json nests the language model as
    `text_config`, its weights sit under `model.language_model.` beside a vision tower. The language model
    converts, the vision tower is left out, and the logits are the text model's."""
    from safetensors.torch import load_file, save_file

    ref = references["qwen3_5"]
    folder = tmp_path / "multimodal"
    folder.mkdir()
    text = json.loads((ref["root"] / "hf" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures": [
        "Qwen3_5ForConditionalGeneration"], "text_config": text, "vision_config": {"depth": 1},
        "tie_word_embeddings": False}))
    weights = load_file(str(ref["root"] / "hf" / "model.safetensors"))
    renamed = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: value
               for name, value in weights.items()}
    save_file(renamed | {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3)}, str(folder / "model.safetensors"))
    logits, tokens = logits_and_greedy(folder, ParallelContext.single(), ref["tokens"])
    assert (logits - ref["logits"]).abs().max() < 1e-4 and tokens == ref["greedy"]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_run_started_from_the_directory_gives_transformers_loss_and_learns(references, family):
    """`checkpoint.init_from=DIR` with [model] left empty: the first step's loss is transformers' on the same batch
    (within 1e-5), and three steps lower it."""
    from test_hf_start import BATCH, hf_loss, run_config, started_run
    from test_training import synthetic_data

    from shardlm.training.data import micro_batches

    ref = references[family]
    batch = micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]
    model = hf_classes(family)[1].from_pretrained(ref["root"] / "hf").eval()
    run = started_run(ParallelContext.single(), run_config(ref["root"] / "hf"))
    losses = [loss for loss, _ in run["curve"]]
    assert abs(losses[0] - hf_loss(model, batch)) <= 1e-5 * losses[0] and losses[-1] < losses[0]
