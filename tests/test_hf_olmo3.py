"""OLMo 3 (`Olmo3ForCausalLM`) and OLMo 2 (`Olmo2ForCausalLM`) against transformers: conversion both ways, logits
and greedy tokens at TP=1 and TP=2, a run started from the directory, and the controls that show each OLMo piece is
computed.

Four random models, every norm weight drawn from U(0.5, 2) (`hf_reference`), a large embedding (tokens decide the
greedy continuation) and output layer (logits far from flat), on rows of 20 tokens, so a window of 5 matters:
- "gqa": 4 layers (3 sliding : 1 full), hidden 64, 4 query heads over 2 KV heads (split at TP=2);
- "uneven": 2 layers (sliding, full), 6 query heads of 8 channels over 3 KV heads: at TP=2 the KV heads are
  replicated and the ranks' query heads read overlapping KV heads (0-1 and 1-2), so k_norm normalizes all 3 heads
  on each rank before each keeps its own;
- "yarn": "gqa" as the long-context checkpoints rotate: YaRN on the full-attention layer only (`rope_yarn_layers =
  "full"`), with the checkpoint's attention factor;
- "olmo2": OLMo 2 (`Olmo2ForCausalLM`), the "gqa" block without windows.
shardlm's logits equal transformers' within 1e-4 and its greedy tokens (KV cache) equal transformers', in one process
and at TP=2 (q_norm's statistic all-reduced over the ranks' heads); converting back is bitwise, to the same family,
and transformers loads it; a run started from the directory (`checkpoint.init_from`) gives transformers' first loss,
in one process and at TP=2. Controls: the same weights as a pre-norm model, with each head's own QK-norm statistic,
or without the window, and the "yarn" weights with YaRN on every layer, on none, or with the derived attention
factor, move the logits by more than 100 x 1e-4. What does not convert fails in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_matches_transformers,
    assert_read_in_place,
    assert_round_trip,
    hf_reference,
    logits_and_greedy,
)
from test_hf_start import BATCH, hf_loss, run_config, started_run
from test_training import VOCAB, synthetic_data

from shardlm.checkpoint import hf_gpt_oss, hf_llama
from shardlm.checkpoint.files import write_consolidated
from shardlm.checkpoint.state import load_consolidated
from shardlm.errors import UserError
from shardlm.models import llama
from shardlm.parallel import ParallelContext
from shardlm.training.data import micro_batches

from multiproc import check_result, run_checks, run_workers

SHAPES = {
    "gqa": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2),
    "uneven": dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=3, head_dim=8, layer_types=["sliding_attention", "full_attention"]),
}
ROPE = {kind: {"rope_type": "default", "rope_theta": 500.0} for kind in ("full_attention", "sliding_attention")}
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "attention_factor": 1.3, "beta_fast": 32.0, "beta_slow": 1.0}
"""The long-context checkpoints' rotary at the tests' size: YaRN x4 over 8 pretraining positions (rows of 20 reach
past it), with an attention factor of its own (the derived one would be 0.1 ln 4 + 1 = 1.139)."""
SHAPES["yarn"] = SHAPES["gqa"] | {"rope_parameters": ROPE | {"full_attention": YARN}}
SHAPES["olmo2"] = SHAPES["gqa"]
"""OLMo 2 (`Olmo2ForCausalLM`): the "gqa" block without windows, one rotary embedding."""


def model_class(shape: str):
    from transformers import Olmo2ForCausalLM, Olmo3ForCausalLM

    return Olmo2ForCausalLM if shape == "olmo2" else Olmo3ForCausalLM


def hf_config(shape: str, **changes):
    """A tiny Olmo3Config of `SHAPES[shape]`: a window of 5, one rotary embedding for both kinds of layer (named per
    layer type: Olmo3Config's rope_theta argument sets the full layers' only; "yarn": YaRN on the full layers only),
    no special tokens."""
    from transformers import Olmo2Config, Olmo3Config

    common = {"vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "pad_token_id": None,
              "eos_token_id": None}
    if shape == "olmo2":
        return Olmo2Config(**(common | {"rope_parameters": ROPE["full_attention"]} | SHAPES[shape] | changes))
    return Olmo3Config(**(common | {"sliding_window": 5, "rope_parameters": ROPE} | SHAPES[shape] | changes))


def hf_model(shape: str):
    torch.manual_seed({"gqa": 0, "uneven": 1, "yarn": 2, "olmo2": 3}[shape])
    model = model_class(shape)(hf_config(shape)).eval()
    with torch.no_grad():  # (q and k need no sharpening: their norms undo any scale of q_proj and k_proj)
        model.model.embed_tokens.weight.mul_(30.0)  # tokens decide the greedy continuation
        model.lm_head.weight.mul_(10.0)  # logits far from flat: a loss far from log(VOCAB)
    return model


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    return {shape: hf_reference(hf_model(shape), tmp_path_factory.mktemp(shape), tokens) for shape in SHAPES}


def worker_world2(paths: dict, hf_dir) -> dict:
    """TP=2: each reference's logits and greedy tokens, and a run started from the "gqa" directory."""
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    checks = {f"tp2 {shape}": (lambda path=path: logits_and_greedy(path, ParallelContext.from_process_group(2),
                                                                  tokens)) for shape, path in paths.items()}
    checks["tp2 start"] = lambda: started_run(ParallelContext.from_process_group(2), run_config(hf_dir, tp=2))["curve"]
    return run_checks(checks)


@pytest.fixture(scope="module")
def world2(references):
    paths = {shape: ref["converted"] for shape, ref in references.items()}
    return run_workers(2, worker_world2, paths, references["gqa"]["root"] / "hf", timeout=600)


def test_conversion_reads_post_norms_projection_norms_and_windows(references):
    config, tensors = load_consolidated(references["gqa"]["converted"])
    m = config.model
    assert (m.norm_placement, m.qk_norm, m.qk_norm_scope, m.sliding_window, m.rope_theta) == (
        "post", True, "projection", 5, 500.0)
    assert m.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert tensors["model/layers.0.attn.q_norm.weight"].shape == (64,)
    assert tensors["model/layers.0.attn.k_norm.weight"].shape == (32,)
    from safetensors.torch import load_file

    saved = load_file(str(references["gqa"]["root"] / "hf" / "model.safetensors"))
    for ours, theirs in (("ln_1", "post_attention_layernorm"), ("ln_2", "post_feedforward_layernorm")):
        assert torch.equal(tensors[f"model/layers.2.{ours}.weight"], saved[f"model.layers.2.{theirs}.weight"])
    assert not any("input_layernorm" in name for name in saved)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp1_logits_and_greedy_tokens_match_transformers(references, shape):
    assert_converted_matches(references[shape])


def test_the_hf_directory_itself_loads_without_converting(references):
    assert_read_in_place(references["gqa"])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp2_logits_and_greedy_tokens_match_transformers(world2, references, shape):
    assert_matches_transformers(check_result(world2, f"tp2 {shape}"), references[shape])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(references, tmp_path, shape):
    """Back to the reference's own family: OLMo 3 with windows, OLMo 2 without."""
    assert_round_trip(references[shape], tmp_path / "back", model_class(shape))
    import json

    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == hf_config(shape).model_type


def hf_batch_loss(ref: dict) -> float:
    """transformers' loss of the first training batch, from the saved directory."""
    from transformers import Olmo3ForCausalLM

    batch = micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]
    return hf_loss(Olmo3ForCausalLM.from_pretrained(ref["root"] / "hf").eval(), batch)


def test_a_run_started_from_the_directory_gives_transformers_first_loss(references, world2):
    """`checkpoint.init_from=DIR` with [model] left empty, in one process and at TP=2 (each rank reading its rows of
    q_norm and k_norm from the directory): the first step's loss is transformers' on the same batch within 1e-5, and
    the run learns."""
    ref = references["gqa"]
    expected = hf_batch_loss(ref)
    one = [loss for loss, _ in started_run(ParallelContext.single(), run_config(ref["root"] / "hf"))["curve"]]
    assert abs(one[0] - expected) <= 1e-5 * expected and one[-1] < one[0]
    for curve in check_result(world2, "tp2 start"):
        assert abs(curve[0][0] - expected) <= 1e-5 * expected


def variant(ref: dict, path, **model) -> torch.Tensor:
    """One process's logits from the converted weights under a [model] section changed by `model`."""
    config, tensors = load_consolidated(ref["converted"])
    config.model = dataclasses.replace(config.model, **model)
    write_consolidated(path, {k: v.contiguous() for k, v in tensors.items()}, dataclasses.asdict(config))
    return logits_and_greedy(path, ParallelContext.single(), ref["tokens"])[0]


def per_head_mean_square(head_dim: int):
    """`llama.projection_mean_square` as a per-head QK-norm computes it: each head's own mean of squares."""
    def mean_square(x: torch.Tensor, tp, split: bool) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, head_dim))
        return heads.pow(2).mean(-1, keepdim=True).expand_as(heads).flatten(-2)
    return mean_square


def per_head_rms_norm(head_dim: int):
    """`llama.rms_norm` (a whole projection's norm on one rank) with each head's own statistic."""
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, head_dim))
        return torch.nn.functional.rms_norm(heads, (head_dim,), None, eps).flatten(-2) * weight
    return norm


def test_controls_move_the_logits_far(references, tmp_path, monkeypatch):
    """The same weights as a pre-norm model, with each head's own QK-norm statistic (the weights still per channel),
    or with every layer attending to all earlier tokens: the logits move by more than 100 x LOGIT_TOL."""
    ref = references["gqa"]
    moved = {"pre-norm": variant(ref, tmp_path / "pre.safetensors", norm_placement="pre"),
             "no window": variant(ref, tmp_path / "full.safetensors", sliding_window=0, layer_types=[])}
    head_dim = SHAPES["gqa"]["hidden_size"] // SHAPES["gqa"]["num_attention_heads"]
    monkeypatch.setattr(llama, "projection_mean_square", per_head_mean_square(head_dim))
    monkeypatch.setattr(llama, "rms_norm", per_head_rms_norm(head_dim))
    moved["per-head statistic"] = logits_and_greedy(ref["converted"], ParallelContext.single(), ref["tokens"])[0]
    distances = {name: (logits - ref["logits"]).abs().max().item() for name, logits in moved.items()}
    assert min(distances.values()) > 100 * LOGIT_TOL, distances


def test_yarn_reads_for_the_full_layers_only_and_each_piece_moves_the_logits(references, tmp_path):
    """The "yarn" directory reads as YaRN on the full-attention layers with the checkpoint's factors; the same
    weights with YaRN on every layer too, on none, or with the factor derived from the scaling move the logits by
    more than 100 x LOGIT_TOL."""
    ref = references["yarn"]
    m = load_consolidated(ref["converted"])[0].model
    assert (m.rope_yarn_layers, m.rope_yarn_factor, m.rope_yarn_original_positions, m.rope_yarn_attention_factor,
            m.rope_theta) == ("full", 4.0, 8, 1.3, 500.0)
    moved = {"every layer": variant(ref, tmp_path / "all.safetensors", rope_yarn_layers="all"),
             "no yarn": variant(ref, tmp_path / "none.safetensors", rope_yarn_factor=0.0),
             "derived factor": variant(ref, tmp_path / "derived.safetensors", rope_yarn_attention_factor=0.0)}
    distances = {name: (logits - ref["logits"]).abs().max().item() for name, logits in moved.items()}
    assert min(distances.values()) > 100 * LOGIT_TOL, distances


def one_line_error(call) -> str:
    with pytest.raises(UserError) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


def test_what_does_not_convert_fails_in_one_line(references):
    """Import (an older config.json, one rope_theta and no layer_types, reads as transformers 4 reads it, its
    rope_scaling YaRN on the full layers as the long-context checkpoints ship it): the two layer types at two bases
    (what Olmo3Config(rope_theta=...) writes), YaRN on the sliding layers only, unlike YaRN on the two, another rope
    type, biases, unknown layer types. Export: post-norms or a whole-projection QK-norm without the other, or with
    experts; YaRN on the full layers only to gpt-oss. Build: qk_norm_scope="projection" without qk_norm; an unknown
    rope_yarn_layers."""
    from transformers import Olmo3Config

    from shardlm.config import RunConfig
    from shardlm.models import build_model
    from shardlm.validation import validate

    base = hf_config("gqa").to_dict()
    assert hf_llama.model_config_from_hf(base).qk_norm_scope == "projection"
    older = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")} | {"rope_theta": 1e4}
    read = hf_llama.model_config_from_hf(older)  # a transformers 4 config.json: one rope_theta, default layer types
    assert (read.rope_theta, read.layer_types) == (1e4, ["sliding_attention"] * 3 + ["full_attention"])
    split_rope = Olmo3Config(**{k: v for k, v in base.items() if k != "rope_parameters"}, rope_theta=500.0).to_dict()
    shipped = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 32,
               "beta_slow": 1, "attention_factor": 1.2079441541679836}  # OLMo 3's long-context config.json
    yarn = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 500000.0, "rope_scaling": shipped}
    read = hf_llama.model_config_from_hf(yarn)
    assert (read.rope_theta, read.rope_yarn_layers, read.rope_yarn_factor, read.rope_yarn_original_positions,
            read.rope_yarn_attention_factor) == (500000.0, "full", 8.0, 8192, 1.2079441541679836)
    assert "rotate differently" in one_line_error(lambda: hf_llama.model_config_from_hf(split_rope))
    rope = base["rope_parameters"]
    for wrong in ({"sliding_attention": YARN}, {"full_attention": YARN, "sliding_attention": YARN | {"factor": 2.0}},
                  {"full_attention": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}}):
        message = one_line_error(lambda: hf_llama.model_config_from_hf(base | {"rope_parameters": rope | wrong}))  # noqa: B023
        assert "rotate differently" in message, message
    both = hf_llama.model_config_from_hf(base | {"rope_parameters": {kind: YARN for kind in rope}})
    assert (both.rope_yarn_layers, both.rope_yarn_factor) == ("all", 4.0)
    assert "biases" in one_line_error(lambda: hf_llama.model_config_from_hf(base | {"attention_bias": True}))
    bad_types = base | {"layer_types": ["sliding_attention", "chunked_attention"] * 2}
    assert "layer_types" in one_line_error(lambda: hf_llama.model_config_from_hf(bad_types))

    cfg = hf_llama.model_config_from_hf(base)
    for change, words in ((dict(qk_norm_scope="head"), 'qk_norm_scope="head"'),
                          (dict(norm_placement="pre"), 'norm_placement="pre"'),
                          (dict(moe_num_experts=4), "experts")):
        changed = dataclasses.replace(cfg, **change)
        message = one_line_error(lambda: hf_llama.hf_config_from_model(changed))  # noqa: B023
        assert message.startswith("Olmo3ForCausalLM has no") and words in message, message
    no_norms = dataclasses.replace(cfg, qk_norm=False)
    assert "qk_norm = true" in one_line_error(lambda: build_model(no_norms, ParallelContext.single()))
    full_only = dataclasses.replace(cfg, rope_yarn_factor=4.0, rope_yarn_original_positions=8, rope_yarn_layers="full",
                                    norm_placement="pre", qk_norm=False, qk_norm_scope="head", attention_sinks=True,
                                    moe_num_experts=4, moe_router_bias=True, moe_linear_bias=True,
                                    attention_bias=True, attention_output_bias=True)
    assert "full-attention layers only" in one_line_error(lambda: hf_gpt_oss.hf_config_from_model(full_only))
    unknown = dataclasses.replace(cfg, rope_yarn_factor=4.0, rope_yarn_original_positions=8, rope_yarn_layers="some")
    assert 'rope_yarn_layers="some"' in one_line_error(lambda: validate(RunConfig(model=unknown), 1, check_paths=False))
