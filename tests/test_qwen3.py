"""Qwen3 (Llama with per-head q/k RMSNorm and an explicit head size) against transformers, and trained
at TP=2 and TP=2 with sequence parallelism against one process.

A random `Qwen3ForCausalLM` (head_dim 24, not hidden / heads = 16; 4 query heads over 2 KV heads) is
saved and converted: shardlm's logits equal transformers' within 1e-4 at TP=1 and TP=2, greedy
generation with the KV cache gives transformers' tokens, and the round trip back to HF is bitwise.
The q/k norm weights are shared by heads that live on different TP ranks, so their gradients must
be summed over TP: a tiny Qwen3-shaped model trains 8 steps at TP=2 (with and without sequence
parallelism) equal to one process within 1e-5, norms included.
"""

from __future__ import annotations

import json

import pytest
import torch
from llama_reference import spread_norm_weights
from safetensors.torch import load_file
from test_llama import full_parameters, logits_and_greedy, synthetic_data
from test_training import assert_same_run

from shardlm.checkpoint.hf import from_hf, to_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.config import RunConfig, from_dict
from shardlm.models import build_model
from shardlm.parallel import ParallelContext
from shardlm.plan.parameters import parameter_count
from shardlm.training.trainer import Trainer

from multiproc import run_workers

HF_VOCAB, PROMPT, NEW_TOKENS, LOGIT_TOL, STEPS = 1000, 6, 12, 1e-4, 8


def hf_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                       rms_norm_eps=1e-6, rope_theta=500.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The HF model, its saved directory, the converted shardlm file, and reference logits and tokens."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config()).eval()
    with torch.no_grad():  # sharp attention, and norm weights away from 1, so a norm left out shows
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    assert len(spread_norm_weights(model, low=0.5, high=3.0, norms=("q_norm", "k_norm"))) == 2 * len(model.model.layers)
    root = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(root / "hf")
    converted = from_hf(root / "hf", root / "qwen3.safetensors")
    tokens = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
        greedy = model.generate(tokens[:, :PROMPT], attention_mask=torch.ones(2, PROMPT, dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return {"root": root, "converted": converted, "tokens": tokens, "logits": logits,
            "greedy": greedy[:, PROMPT:].tolist()}


def tiny_config(tp: int = 1, sp: bool = False) -> RunConfig:
    return from_dict({
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                  "head_dim": 12, "qk_norm": True, "ffn_hidden_size": 64, "seq_length": 16, "vocab_size": 100,
                  "dropout": 0.0},
        "parallel": {"tensor": tp, "sequence_parallel": sp},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": 8, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 3, "clip_grad": 0.5, "adam_eps": 1e-6, "seed": 7},
    })


def train_run(ctx: ParallelContext, config: RunConfig):
    trainer = Trainer(config, ctx, synthetic_data())
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    return curve, full_parameters(trainer.model)


def worker_world2(hf: dict) -> dict:
    ctx = ParallelContext.from_process_group(2)
    out = {"hf_tp2": logits_and_greedy(hf["converted"], ctx, hf["tokens"])}
    for sp in (False, True):
        ctx.rng = None
        out[f"train_sp{int(sp)}"] = train_run(ctx, tiny_config(tp=2, sp=sp))
    return out


@pytest.fixture(scope="module")
def world2(hf_model):
    return run_workers(2, worker_world2, {k: hf_model[k] for k in ("converted", "tokens")}, timeout=300)


def test_conversion_reads_head_dim_and_qk_norm(hf_model):
    config, tensors = load_consolidated(hf_model["converted"])
    assert (config.model.head_dim, config.model.qk_norm, config.model.num_kv_heads) == (24, True, 2)
    assert tensors["model/layers.0.attn.q.weight"].shape == (4 * 24, 64)
    assert tensors["model/layers.1.attn.k_norm.weight"].shape == (24,)


def test_tp1_logits_and_greedy_tokens_match_transformers(hf_model):
    logits, tokens = logits_and_greedy(hf_model["converted"], ParallelContext.single(), hf_model["tokens"])
    assert hf_model["logits"].std() > 0.1, "reference logits too flat to tell layouts apart"
    assert (logits - hf_model["logits"]).abs().max() < LOGIT_TOL
    assert tokens == hf_model["greedy"]


def test_leaving_out_the_qk_norm_would_be_caught(hf_model):
    """The same model with unit norm weights is far from transformers' logits, so the comparison tests them."""
    from shardlm.checkpoint import load_model

    model, _ = load_model(hf_model["converted"], ParallelContext.single())
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attn.q_norm.weight.fill_(1.0)
            layer.attn.k_norm.weight.fill_(1.0)
        logits = model.full_logits(model(hf_model["tokens"]))
    assert (logits - hf_model["logits"]).abs().max() > 100 * LOGIT_TOL


@pytest.mark.slow
def test_tp2_logits_and_greedy_tokens_match_transformers(world2, hf_model):
    for rank in world2:
        logits, tokens = rank["hf_tp2"]
        assert (logits - hf_model["logits"]).abs().max() < LOGIT_TOL
        assert tokens == hf_model["greedy"]


def test_round_trip_to_hf_is_bitwise(hf_model, tmp_path):
    out = to_hf(hf_model["converted"], tmp_path / "back")
    original = load_file(str(hf_model["root"] / "hf" / "model.safetensors"))
    back = load_file(str(out / "model.safetensors"))
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(back[name], value), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return train_run(ctx, tiny_config())


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_training_with_qk_norm_matches_one_process(world2, reference, sp):
    """The q/k norm weights get the whole gradient on every TP rank (summed over the heads of both ranks)."""
    for rank in world2:
        assert_same_run(rank[f"train_sp{int(sp)}"], reference, STEPS)
    assert any(name.endswith("attn.q_norm.weight") for name in reference[1])


def test_planner_counts_the_built_model(hf_model):
    """The planner's parameter count (head_dim and q/k norms included) equals the built model's, at TP=1 and 2."""
    config, _ = load_consolidated(hf_model["converted"])
    model = build_model(config.model, ParallelContext.single(), seed=1)
    count = parameter_count(config.model, 1)
    assert count.sharded + count.replicated == sum(p.numel() for p in model.parameters())
    assert count.tensors == len(list(model.parameters()))
