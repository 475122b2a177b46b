"""gpt-oss (`GptOssForCausalLM`) against transformers: conversion both ways (MXFP4 experts too), logits and
greedy tokens at every layout, and training at every layout equal to one process.

A random gpt-oss-shaped model: grouped-query attention with q/k/v/o biases, a sink logit per head, a sliding
window of 4 tokens on alternate layers (sliding first, as gpt-oss), YaRN (factor 4 over 16 positions,
truncate off), 4 experts top-2 with a router bias, biased experts with the clamped SwiGLU (limit 1.5, so
the clamp binds). Biases, sinks and the router are made visible. shardlm's logits equal transformers' within
1e-4 at TP=1, TP=2 (heads, sinks and expert widths split) and EP=2 over 20 tokens (past the window), greedy
generation (KV-cached, windows and sinks in the cached step) gives transformers' tokens, and converting back
gives bitwise the saved tensors. The same model with its experts in MXFP4 (blocks and scales as the
released checkpoints store them) reads to transformers' own dequantization. The same shapes train at TP=2
with SP, CP=2 (the ring with the sink and the window), EP=2, EP=2 x TP=2 with SP, PP=2, DP=2 with FSDP, and with
selective and full recomputation, within 1e-5 of one process.
"""

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
    layout_checks,
    logits_and_greedy,
)
from test_moe_parallel import STEPS, assert_same_run, full_parameters, run, train_layout

from shardlm.checkpoint import load_model
from shardlm.checkpoint.hf import from_hf
from shardlm.checkpoint.hf_gpt_oss import dequantize_mxfp4
from shardlm.checkpoint.state import load_consolidated
from shardlm.config import from_dict
from shardlm.parallel import ParallelContext

from multiproc import check_result, run_checks, run_workers

VOCAB = 300
ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 500.0}


def hf_model():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64, rope_parameters=ROPE,
                          swiglu_limit=1.5, tie_word_embeddings=False)
    return GptOssForCausalLM(config)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(0)
    model = hf_model().eval()
    with torch.no_grad():  # sharp attention and routing, visible biases and sinks
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj.weight.mul_(6.0)
            attn.k_proj.weight.mul_(6.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.normal_(0, 0.1)
            attn.sinks.normal_(0, 1.0)
            mlp.router.weight.mul_(30.0)
            mlp.router.bias.normal_(0, 0.5)
            mlp.experts.gate_up_proj.normal_(0, 0.5)
            for param in (mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias):
                param.normal_(0, 0.1)
        model.model.embed_tokens.weight.mul_(30.0)  # tokens, not the biases, decide the greedy continuation
        model.lm_head.weight.mul_(30.0)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    return hf_reference(model, tmp_path_factory.mktemp("gpt_oss"), tokens) | {"model": model}


def gpt_oss_config(tp: int = 1, ep: int = 1, cp: int = 1, sp: bool = False, pp: int = 1, **train):
    return from_dict({
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                  "head_dim": 8, "seq_length": 16, "vocab_size": 100, "dropout": 0.0, "attention_bias": True,
                  "attention_output_bias": True, "attention_sinks": True, "sliding_window": 3,
                  "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 500.0,
                  "rope_yarn_factor": 4.0, "rope_yarn_original_positions": 8, "rope_yarn_truncate": False,
                  "moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "moe_router_bias": True,
                  "moe_linear_bias": True, "swiglu_limit": 1.5, "moe_aux_loss_coeff": 0.01},
        "parallel": {"tensor": tp, "expert": ep, "context": cp, "sequence_parallel": sp, "pipeline": pp},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": 4, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": 1e-6, "seed": 7, **train},
    })


def training(tp: int = 1, ep: int = 1, cp: int = 1, sp: bool = False, **train):
    def check():
        ctx = ParallelContext.from_process_group(tp, expert_parallel=ep, context_parallel=cp)
        return train_layout(ctx, gpt_oss_config(tp, ep, cp, sp, **train))[:2]
    return check


def worker_world2(path, tokens: torch.Tensor, checkpoint_dir: str) -> dict:
    checks = layout_checks({"gpt_oss": path}, tokens)
    checks |= {"train tp2 sp": training(tp=2, sp=True), "train cp2": training(cp=2), "train ep2": training(ep=2),
               "train fsdp dp2": training(data_sharding="full"), "train pp2": run(gpt_oss_config(pp=2), pp=2),
               "save tp2": run(gpt_oss_config(tp=2), tp=2, save=checkpoint_dir)}
    return run_checks(checks)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpt_oss_ckpt")


@pytest.fixture(scope="module")
def world2(reference, checkpoint_dir):
    return run_workers(2, worker_world2, reference["converted"], reference["tokens"], str(checkpoint_dir),
                       timeout=600)


def test_checkpoint_saved_at_tp2_loads_in_one_process(world2, checkpoint_dir):
    """The sinks and expert widths split over TP, each expert's down bias whole on every TP rank (written once):
    one process reads back bitwise what the TP=2 run ended with."""
    saved = check_result(world2, "save tp2")[0][1]
    loaded = full_parameters(load_model(checkpoint_dir, ParallelContext.single())[0])
    assert loaded.keys() == saved.keys()
    assert any(name.endswith("experts.down_bias") for name in saved)
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)


def test_conversion_reads_the_gpt_oss_pieces(reference):
    config, tensors = load_consolidated(reference["converted"])
    m = config.model
    assert (m.attention_sinks, m.attention_output_bias, m.sliding_window, m.layer_types) == (
        True, True, 4, ["sliding_attention", "full_attention"])
    assert (m.rope_yarn_factor, m.rope_yarn_truncate, m.swiglu_limit, m.moe_router_bias, m.moe_linear_bias) == (
        4.0, False, 1.5, True, True)
    hf = reference["model"].model.layers[1]
    assert torch.equal(tensors["model/layers.1.attn.sinks"], hf.self_attn.sinks)
    assert torch.equal(tensors["model/layers.1.mlp.experts.up.3"], hf.mlp.experts.gate_up_proj[3][:, 1::2].t())
    assert torch.equal(tensors["model/layers.1.mlp.experts.down_bias.2"], hf.mlp.experts.down_proj_bias[2])


def test_tp1_logits_and_greedy_tokens_match_transformers(reference):
    tokens = assert_converted_matches(reference, min_std=1.0)
    assert len({t for row in tokens for t in row}) > 2, "greedy continuation too uniform to check anything"


def test_without_the_sinks_or_the_window_the_logits_differ(reference, tmp_path):
    """Controls: the same weights with the sinks at -inf (no sink) or without the window give other logits."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(reference["converted"]))
    for change in ("sinks", "window"):
        config, _ = load_consolidated(reference["converted"])
        changed = dict(tensors)
        if change == "sinks":
            changed |= {k: torch.full_like(v, -1e4) for k, v in tensors.items() if k.endswith("attn.sinks")}
        else:
            config.model.sliding_window = 0
        path = tmp_path / f"{change}.safetensors"
        import dataclasses
        import json
        save_file(changed, str(path), metadata={"format": "shardlm-consolidated-v1", "step": "0",
                                                "config": json.dumps(dataclasses.asdict(config))})
        logits, _ = logits_and_greedy(path, ParallelContext.single(), reference["tokens"])
        assert (logits - reference["logits"]).abs().max() > 100 * LOGIT_TOL, change


def test_the_hf_directory_itself_loads_without_converting(reference):
    assert_read_in_place(reference)


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, reference, layout):
    assert_layout_matches(world2, f"{layout} gpt_oss", reference)


def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(reference, tmp_path):
    assert_round_trip(reference, tmp_path / "back", type(hf_model()))


def test_mxfp4_experts_read_as_transformers_dequantizes_them(reference, tmp_path):
    """Random MXFP4 blocks and scales in the released checkpoints' names: shardlm's own dequantization equals
    transformers' `convert_moe_packed_tensors` bitwise, and a directory holding them reads to those values."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (4, 32, 1, 16), dtype=torch.uint8, generator=gen)  # (E, 2f, h / 32, 16)
    scales = torch.randint(118, 130, (4, 32, 1), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, h, 2f): gate_up_proj's layout
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks[..., :8], scales)

    # the directory: gate_up_proj in MXFP4 (down_proj's blocks run along f, 16 here, too short for one block)
    quantized = tmp_path / "mxfp4"
    shutil.copytree(reference["root"] / "hf", quantized)
    tensors = load_file(str(quantized / "model.safetensors"))
    for i in range(2):
        h = f"model.layers.{i}.mlp.experts"
        del tensors[f"{h}.gate_up_proj"]
        tensors |= {f"{h}.gate_up_proj_blocks": blocks.clone(), f"{h}.gate_up_proj_scales": scales.clone()}
    save_file(tensors, str(quantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    assert (config["hidden_size"], 2 * config["intermediate_size"]) == (32, 32)
    _, ours = load_consolidated(from_hf(quantized, tmp_path / "mxfp4.safetensors"))
    assert torch.equal(ours["model/layers.1.mlp.experts.gate.2"], theirs[2][:, 0::2].t())
    assert torch.equal(ours["model/layers.0.mlp.experts.up.1"], theirs[1][:, 1::2].t())


@pytest.fixture(scope="module")
def one_process():
    return train_layout(ParallelContext.single(), gpt_oss_config())[:2]


@pytest.mark.parametrize("name", ["train tp2 sp", "train cp2", "train ep2", "train fsdp dp2", "train pp2"])
def test_gpt_oss_shapes_train_as_one_process(world2, one_process, name):
    results = check_result(world2, name)
    assert len(results) == 2
    for run_result in results:
        assert_same_run(run_result, one_process)


def worker_world4() -> dict:
    return run_checks({"train ep2 tp2 sp": training(tp=2, ep=2, sp=True)})


def test_gpt_oss_at_ep2_x_tp2_trains_as_one_process(one_process):
    """EP=2 x TP=2 with SP (4 ranks): each expert's down bias is whole on every TP rank of a split expert, so the
    gradient norm must count it once, not once per TP rank (the clipped steps would differ)."""
    results = check_result(run_workers(4, worker_world4, timeout=300), "train ep2 tp2 sp")
    for run_result in results:
        assert_same_run(run_result, one_process)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_trains_bitwise_the_same(one_process, recompute):
    curve, params = train_layout(ParallelContext.single(), gpt_oss_config(recompute=recompute))[:2]
    assert curve == one_process[0]
    assert all(torch.equal(params[name], one_process[1][name]) for name in params)


@pytest.mark.parametrize("change,message", [
    ({"layer_types": ["sliding_attention"]}, "model.layer_types must list 2 entries"),
    ({"layer_types": ["sliding", "full"]}, "model.layer_types must list 2 entries"),
    ({"sliding_window": -1}, "model.sliding_window=-1 must be >= 0"),
    ({"attention_dropout": 0.1}, "attention dropout is not supported with attention sinks or sliding windows"),
    ({"swiglu_limit": -1.0}, "model.swiglu_limit must be >= 0"),
    ({"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
      "num_kv_heads": 0, "head_dim": 0}, 'need model.arch="llama" with model.attention="mha"'),
    ({"arch": "gpt", "attention_sinks": False, "sliding_window": 0, "attention_bias": False, "num_kv_heads": 0,
      "head_dim": 0, "attention_output_bias": False}, "model.moe_linear_bias and model.swiglu_limit are for SwiGLU"),
])
def test_bad_gpt_oss_keys_are_one_line_errors(change, message):
    from shardlm.errors import UserError
    from shardlm.validation import validate

    config = gpt_oss_config()
    for key, value in change.items():
        setattr(config.model, key, value)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate(config, 1, check_paths=False)
    assert "\n" not in str(error.value)


def test_cli_round_trip_says_what_it_writes(reference, tmp_path, capsys):
    """`shardlm convert --from-hf` then `--to-hf`: the export names the architecture and its format (fp32,
    experts unquantized), and transformers loads it to the reference logits; `checkpoint inspect` names the
    sinks and the sliding layers."""
    from shardlm.cli import main

    converted = tmp_path / "oss.safetensors"
    assert main(["convert", "--from-hf", str(reference["root"] / "hf"), "--output", str(converted)]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "back"), "--checkpoint", str(converted)]) == 0
    assert "(GptOssForCausalLM, fp32 safetensors; experts unquantized (not MXFP4))" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(converted)]) == 0
    assert "attention: a sink logit per head, sliding window 4 on layers [0]" in capsys.readouterr().out
    reloaded = type(hf_model()).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(reference["tokens"]).logits, reference["logits"])


def test_sliding_layers_count_the_window_in_the_flop_count():
    """MFU's count: a sliding layer's score and value products see min(s, window) keys, not s. Two layers at
    s = 16, window 3, one sliding: the attention term drops by 4 (16 - 3) a per token, forward, x 3 for
    training; without the window both layers count 4 s a."""
    import dataclasses

    from shardlm.plan.flops import flops_per_token

    m = gpt_oss_config().model
    a = m.num_heads * m.attention_head_dim
    full = flops_per_token(dataclasses.replace(m, sliding_window=0))
    assert full - flops_per_token(m) == 3 * 4 * (16 - 3) * a
    assert flops_per_token(dataclasses.replace(m, sliding_window=100)) == full  # a window past s changes nothing
