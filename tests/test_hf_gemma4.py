"""Gemma 4's text model (`Gemma4ForCausalLM`) against transformers: conversion both ways, logits and greedy tokens at
TP=1, TP=2 and EP=2, KV-cached decoding, a run started from the directory, the multimodal directory's language model,
and the controls that show each Gemma piece is computed.

Two random Gemma 4s on rows of 20 tokens, every norm weight drawn from U(0.5, 2) (`hf_reference`), the routers'
scales, the experts' scales and each layer's scalar drawn too, and a large tied embedding (tokens decide the greedy
continuation; the final soft-cap of 30 then bends the logits):
- "dense": 5 layers (sliding, sliding, full, sliding, full; a window of 5), 4 query heads; the sliding layers 2 KV
  heads of 16 channels (split at TP=2), the full ones 1 KV head of 32 (replicated at TP=2) whose values are its keys
  (attention_k_eq_v) and proportional RoPE on a quarter of the frequencies at their own base; the last 2 layers share
  the keys and values of layers 1 (sliding, across a full layer) and 2 (full), with MLPs twice as wide; per-layer
  inputs of 8 channels;
- "moe": 2 layers (sliding, full), 4 experts (top 2) beside each dense MLP, no soft-cap.
shardlm's logits equal transformers' within 1e-4 and its greedy tokens (KV cache) equal transformers', in one process,
at TP=2 and (MoE) EP=2; decoding token by token with the KV cache gives the uncached forward's logits; converting back
is bitwise and transformers loads it; a run started from the directory gives transformers' first loss (one process and
TP=2). Controls: the same weights without the soft-cap, the embedding scale, the value norm, the proportional RoPE or
the softmax scale of 1 move the logits by more than 100 x 1e-4. Also: the multimodal directory's language model read in
place (the towers left out with a note), the planner's E4B preset against transformers' meta build, and `generate
--chat` with Gemma 4's own chat template.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_layout_matches,
    assert_matches_transformers,
    assert_read_in_place,
    assert_round_trip,
    hf_reference,
    layout_checks,
    logits_and_greedy,
)
from test_hf_start import BATCH, hf_loss, run_config, started_run
from test_training import VOCAB, synthetic_data

from shardlm.checkpoint import hf_gemma4, load_model
from shardlm.checkpoint.files import write_consolidated
from shardlm.checkpoint.state import load_consolidated
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.data import micro_batches

from multiproc import check_result, run_checks, run_workers

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 100.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000.0}}
SHAPES = {
    "dense": dict(num_hidden_layers=5, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], num_key_value_heads=2,
                  global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                  use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                  final_logit_softcapping=30.0),
    "moe": dict(num_hidden_layers=2, layer_types=[SLIDING, FULL], num_key_value_heads=2, global_head_dim=16,
                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                hidden_size_per_layer_input=0),
}


def hf_config(shape: str, **changes):
    """A tiny Gemma4TextConfig of `SHAPES[shape]` (hidden 64, 4 query heads of 16 channels, a window of 5), no special
    tokens."""
    from transformers import Gemma4TextConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
                  max_position_embeddings=64, sliding_window=5, rope_parameters=ROPE, rms_norm_eps=1e-6,
                  pad_token_id=None, eos_token_id=None, bos_token_id=None, tie_word_embeddings=True)
    return Gemma4TextConfig(**(common | SHAPES[shape] | changes))


def hf_model(shape: str):
    """The random Gemma4ForCausalLM of `shape`, its router scales, expert scales and layer scalars drawn."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed({"dense": 0, "moe": 1}[shape])
    model = Gemma4ForCausalLM(hf_config(shape)).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        # tied output: logits far from flat, yet the stream not so dominated by the token's own embedding (the
        # sublayers' outputs are normalized) that the greedy continuation echoes its last token
        model.model.embed_tokens.weight.mul_({"dense": 10.0, "moe": 3.0}[shape])
        for layer in model.model.layers:
            layer.layer_scalar.copy_(torch.rand(1, generator=generator) + 0.5)
            if shape == "moe":
                layer.router.scale.copy_(torch.rand(64, generator=generator) * 1.5 + 0.5)
                layer.router.per_expert_scale.copy_(torch.rand(4, generator=generator) * 1.5 + 0.5)
                layer.router.proj.weight.mul_(20.0)  # routing far from uniform: a wrong choice shows
    return model


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    return {shape: hf_reference(hf_model(shape), tmp_path_factory.mktemp(shape), tokens) for shape in SHAPES}


def first_batch():
    return micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]


def worker_world2(paths: dict, hf_dir) -> dict:
    """TP=2 and EP=2: each reference's logits and greedy tokens; a run started from the "dense" directory at TP=2."""
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    checks = layout_checks(paths, tokens)
    del checks["ep2 dense"]
    checks["tp2 start"] = lambda: started_run(ParallelContext.from_process_group(2), run_config(hf_dir, tp=2))["curve"]
    return run_checks(checks)


@pytest.fixture(scope="module")
def world2(references):
    paths = {shape: ref["converted"] for shape, ref in references.items()}
    return run_workers(2, worker_world2, paths, references["dense"]["root"] / "hf", timeout=600)


def test_conversion_reads_every_gemma_piece(references):
    config, tensors = load_consolidated(references["dense"]["converted"])
    m = config.model
    assert (m.sandwich_norms, m.embedding_scale, m.attention_scale, m.value_norm, m.attention_k_eq_v) == (
        True, True, 1.0, True, True)
    assert (m.head_dim, m.global_head_dim, m.num_kv_heads, m.global_kv_heads) == (16, 32, 2, 1)
    assert (m.rope_theta, m.global_rope_theta, m.global_rope_fraction) == (100.0, 1000.0, 0.25)
    assert (m.kv_shared_layers, m.kv_shared_double_mlp, m.per_layer_input_size, m.final_logit_softcap) == (
        2, True, 8, 30.0)
    assert "model/layers.2.attn.v.weight" not in tensors and "model/layers.1.attn.v.weight" in tensors
    assert "model/layers.3.attn.k.weight" not in tensors and tensors["model/layers.3.mlp.up.weight"].shape == (192, 64)
    moe = load_consolidated(references["moe"]["converted"])[0].model
    assert (moe.moe_beside_mlp, moe.moe_num_experts, moe.moe_top_k, moe.moe_ffn_size) == (True, 4, 2, 24)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp1_logits_and_greedy_tokens_match_transformers(references, shape):
    assert_converted_matches(references[shape])


def test_the_hf_directory_itself_loads_without_converting(references):
    assert_read_in_place(references["dense"])


@pytest.mark.parametrize("name", ["tp2 dense", "tp2 moe", "ep2 moe"])
def test_two_rank_logits_and_greedy_tokens_match_transformers(world2, references, name):
    assert_layout_matches(world2, name, references[name.split()[1]])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kv_cached_decoding_equals_the_uncached_forward(references, shape):
    """Token by token through the KV cache (the sharing layers reading their producers' caches), then 4 at once:
    every position's logits equal the whole row's uncached forward within 1e-4 (sums in another order)."""
    ref = references[shape]
    model, _ = load_model(ref["converted"], ParallelContext.single())
    tokens = ref["tokens"]
    with torch.no_grad():
        whole = model.full_logits(model(tokens))
        cache = model.new_kv_cache()
        steps = [model.full_logits(model(tokens[:, i:i + 1], cache=cache)) for i in range(16)]
        steps.append(model.full_logits(model(tokens[:, 16:], cache=cache)))
    assert (torch.cat(steps, dim=1) - whole).abs().max() < LOGIT_TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(references, tmp_path, shape):
    from transformers import Gemma4ForCausalLM

    assert_round_trip(references[shape], tmp_path / "back", Gemma4ForCausalLM)


def test_a_run_started_from_the_directory_gives_transformers_first_loss(references, world2):
    """`checkpoint.init_from=DIR` with [model] left empty, in one process and at TP=2: the first step's loss is
    transformers' on the same batch within 1e-5 (the soft-capped logits in the loss), and the run learns."""
    from transformers import Gemma4ForCausalLM

    ref = references["dense"]
    expected = hf_loss(Gemma4ForCausalLM.from_pretrained(ref["root"] / "hf").eval(), first_batch())
    one = [loss for loss, _ in started_run(ParallelContext.single(), run_config(ref["root"] / "hf"))["curve"]]
    assert abs(one[0] - expected) <= 1e-5 * expected and one[-1] < one[0]
    for curve in check_result(world2, "tp2 start"):
        assert abs(curve[0][0] - expected) <= 1e-5 * expected


def multimodal_directory(ref: dict, folder, extra: dict | None = None):
    """The "dense" reference as the published multimodal layout: config.json a Gemma4Config with the text model as
    text_config, its weights under model.language_model., a vision and an audio tower beside them (and `extra`)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    text = json.loads((ref["root"] / "hf" / "config.json").read_text())
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
              "vision_config": {"model_type": "gemma4_vision"}, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    weights = {name.replace("model.", "model.language_model.", 1): value
               for name, value in load_file(str(ref["root"] / "hf" / "model.safetensors")).items()}
    weights |= {"model.vision_tower.encoder.layers.0.mlp.fc.weight": torch.ones(2, 2),
                "model.audio_tower.conv.weight": torch.ones(2), **(extra or {})}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def test_the_multimodal_directory_gives_its_language_model(references, tmp_path, capsys):
    """Read in place: transformers' logits and greedy tokens, a note naming the towers left out; a language-model
    weight that no shardlm tensor reads is refused in one line; exporting the towers is refused naming them."""
    ref = references["dense"]
    folder = multimodal_directory(ref, tmp_path / "mm")
    assert_matches_transformers([logits_and_greedy(folder, ParallelContext.single(), ref["tokens"])], ref)
    note = capsys.readouterr().err
    assert "model.vision_tower" in note and "model.audio_tower" in note
    stray = multimodal_directory(ref, tmp_path / "stray", {"model.language_model.layers.3.self_attn.k_proj.weight":
                                                           torch.ones(16, 64)})
    assert "layers.3.self_attn.k_proj" in one_line_error(lambda: hf_gemma4.open_hf(stray))
    config, tensors = load_consolidated(ref["converted"])
    message = one_line_error(lambda: hf_gemma4.to_hf(config, tensors, tmp_path / "out", include_towers=True))
    assert "model.vision_tower" in message and "model.audio_tower" in message


def variant(ref: dict, path, **model) -> torch.Tensor:
    """One process's logits from the converted weights under a [model] section changed by `model`."""
    config, tensors = load_consolidated(ref["converted"])
    config.model = dataclasses.replace(config.model, **model)
    write_consolidated(path, {k: v.contiguous() for k, v in tensors.items()}, dataclasses.asdict(config))
    return logits_and_greedy(path, ParallelContext.single(), ref["tokens"])[0]


CONTROLS = {"no soft-cap": dict(final_logit_softcap=0.0), "unscaled embedding": dict(embedding_scale=False),
            "no value norm": dict(value_norm=False), "whole-head RoPE": dict(global_rope_fraction=1.0),
            "1/sqrt(d) scale": dict(attention_scale=0.0)}


def test_controls_move_the_logits_far(references, tmp_path):
    """Each Gemma piece dropped from the same weights moves the logits by more than 100 x LOGIT_TOL."""
    ref = references["dense"]
    distances = {name: (variant(ref, tmp_path / f"{i}.safetensors", **change) - ref["logits"]).abs().max().item()
                 for i, (name, change) in enumerate(CONTROLS.items())}
    assert min(distances.values()) > 100 * LOGIT_TOL, distances


def one_line_error(call) -> str:
    with pytest.raises(UserError) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


def test_what_does_not_convert_fails_in_one_line(references):
    """Import: biases, another activation, bidirectional attention, a scaled or other rotary embedding. Build: Gemma
    keys without the sandwich block, sharing with no earlier layer of the kind, a per-layer table TP does not divide.
    Export: attention biases."""
    from shardlm.models import build_model

    base = hf_config("dense").to_dict()
    assert hf_gemma4.model_config_from_hf(base).per_layer_input_size == 8
    for change, words in (({"attention_bias": True}, "biases"), ({"hidden_activation": "silu"}, "hidden_activation"),
                          ({"use_bidirectional_attention": "all"}, "bidirectional"),
                          ({"rope_parameters": {**ROPE, FULL: {"rope_type": "yarn", "rope_theta": 1e4}}}, "rope")):
        assert words in one_line_error(lambda: hf_gemma4.model_config_from_hf(base | change))  # noqa: B023
    cfg = hf_gemma4.model_config_from_hf(base)
    for change, words in ((dict(sandwich_norms=False), "model.embedding_scale is Gemma 4's"),
                          (dict(norm_placement="post"), 'needs model.norm_placement="pre"'),
                          (dict(kv_shared_layers=4), "no earlier layer of its kind"),
                          (dict(per_layer_vocab_size=101), "divide by parallel.tensor")):
        changed = dataclasses.replace(cfg, **change)
        ctx = ParallelContext.single()
        if "per_layer_vocab_size" in change:
            from shardlm.models.gemma_config import check_gemma
            assert words in one_line_error(lambda: check_gemma(changed, 2))  # noqa: B023
            continue
        assert words in one_line_error(lambda: build_model(changed, ctx))  # noqa: B023
    biased = dataclasses.replace(cfg, attention_bias=True)
    assert "attention biases" in one_line_error(lambda: hf_gemma4.hf_config_from_model(biased) and
                                                hf_gemma4.check_exportable(biased))


def test_planner_preset_counts_transformers_build():
    """`shardlm plan --model gemma-4-e4b`: Gemma4TextConfig from the E4B model card's values (its defaults for the
    rest) reads as the preset, and the planner's parameter total equals transformers' meta-device build (the layer
    scalars, buffers there, counted: shardlm holds them as parameters); at TP=2 the ranks' shares add up to it; the
    planner skips pipeline splits the model refuses."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from shardlm.plan.models import MODEL_PRESETS
    from shardlm.plan.parameters import parameter_count

    hf = Gemma4TextConfig(num_hidden_layers=42, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
                          num_kv_shared_layers=18, final_logit_softcapping=30.0)
    preset = MODEL_PRESETS["gemma-4-e4b"]
    assert dataclasses.replace(hf_gemma4.model_config_from_hf(hf.to_dict()), seq_length=8192) == preset
    with torch.device("meta"):
        model = Gemma4ForCausalLM(hf)
    expected = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("layer_scalar"))
    assert parameter_count(preset, 1).total == expected
    half = parameter_count(preset, 2)
    assert 2 * half.sharded + half.replicated == expected
    from shardlm.plan.gemma import gemma_pipeline_problem  # every split runs (stages hand shared K/V and per-layer
    # inputs on: `Gemma4.stage_handoff`)
    assert gemma_pipeline_problem(preset, 2) is None and gemma_pipeline_problem(preset, 3) is None


def test_generate_chat_with_gemma_template_answers_as_transformers(tmp_path, capsys):
    """`shardlm generate --chat` on a tiny untied "dense" Gemma 4 with Gemma 4's own chat template (TRL's copy of
    the published one, a small BPE tokenizer with its special tokens: `test_generate_chat_families`): the prompt ids
    are transformers', and the reply is transformers' greedy one, stopped at `<turn|>` (generation_config.json's
    eos ids; the tokenizer's eos_token is `<eos>`), that token excluded."""
    from test_generate_chat_families import CONVERSATION, NEW_TOKENS, ends_a_reply, greedy, write_tokenizer
    from transformers import AutoTokenizer, Gemma4ForCausalLM

    from shardlm.cli import main

    hf = tmp_path / "hf"
    write_tokenizer(hf, "gemma4")
    tokenizer = AutoTokenizer.from_pretrained(hf)
    end, stops = tokenizer.convert_tokens_to_ids("<turn|>"), json.loads((hf / "generation_config.json").read_text())
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(hf_config("dense", vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer),
                                        max_position_embeddings=256, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)
        model.lm_head.weight.mul_(20.0)  # peaked choices: no near ties between fp32 implementations
        model.lm_head.weight[stops["eos_token_id"]] = 0.0  # no stop before `ends_a_reply` makes `<turn|>` one
        ends_a_reply(model, ids, end)
    model.save_pretrained(hf)
    (hf / "generation_config.json").write_text(json.dumps(stops))  # save_pretrained rewrote it
    reply = greedy(Gemma4ForCausalLM.from_pretrained(hf).eval(), ids, stops["eos_token_id"])
    assert reply[-1] == end and 2 <= len(reply) < NEW_TOKENS, reply
    (tmp_path / "messages.json").write_text(json.dumps(CONVERSATION))
    assert main(["generate", "--checkpoint", str(hf), "--chat", "--messages", str(tmp_path / "messages.json"),
                 "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu", "--json"]) == 0
    (ours,) = json.loads(capsys.readouterr().out)["generations"]
    assert ours["prompt_tokens"] == ids
    assert ours["tokens"] == reply[:-1] and ours["finish_reason"] == "end_of_turn", (ours, reply)


def test_flops_count_each_gemma_piece():
    """`flops_per_token` of a Gemma 4 whose pieces are all neutral (one head size and KV head count, no sharing, no
    per-layer inputs, no experts) is the Llama formula's; then each piece changes it by its own matrices: k = v drops
    the full layers' v (2 h kv d each), sharing drops the consumers' k and v and doubles their MLP, the full layers'
    wider heads, the per-layer inputs' gate, projection and embedding projection."""
    from shardlm.plan.flops import flops_per_token

    cfg = hf_gemma4.model_config_from_hf(hf_config("dense").to_dict())
    h, s, V, f, L, d = cfg.hidden_size, cfg.seq_length, cfg.vocab_size, cfg.ffn_size, cfg.num_layers, 16
    plain = dataclasses.replace(cfg, global_head_dim=16, global_kv_heads=2, attention_k_eq_v=False, kv_shared_layers=0,
                                kv_shared_double_mlp=False, per_layer_input_size=0)
    llama = dataclasses.replace(plain, sandwich_norms=False, embedding_scale=False, attention_scale=0.0,
                                value_norm=False, global_head_dim=0, global_kv_heads=0, global_rope_theta=0.0,
                                global_rope_fraction=1.0, per_layer_vocab_size=0, final_logit_softcap=0.0)
    assert flops_per_token(plain) == flops_per_token(llama)
    k_eq_v = dataclasses.replace(plain, attention_k_eq_v=True)
    assert flops_per_token(plain) - flops_per_token(k_eq_v) == 3 * 2 * (2 * h * 2 * d)  # 2 full layers' v
    shared = dataclasses.replace(plain, kv_shared_layers=2, kv_shared_double_mlp=True)
    assert flops_per_token(shared) - flops_per_token(plain) == 3 * 2 * (6 * h * f - 2 * (2 * h * 2 * d))
    ple = dataclasses.replace(plain, per_layer_input_size=8)
    assert flops_per_token(ple) - flops_per_token(plain) == 3 * (L * 4 * h * 8 + 2 * h * L * 8)
    assert (s, V) == (64, VOCAB)
