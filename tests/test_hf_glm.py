"""GLM-4.5 (`Glm4MoeForCausalLM`) against transformers: conversion both ways, logits and greedy tokens at every
layout, and training at every layout equal to one process.

A random GLM-4.5-shaped model: q/k/v biases (made visible), RoPE on the first half of each head
(partial_rotary_factor 0.5), q/k norms, grouped-query attention, a dense first layer, then DeepSeek-V3-style
routing (8 sigmoid-scored experts in 4 groups, the best 2 groups, top-2, a shared expert, routed scaling 2.5,
a visible score-correction bias). shardlm's logits equal transformers' within 1e-4 at TP=1, TP=2 (KV heads
and biases split) and EP=2, greedy generation gives transformers' tokens, and converting back gives
bitwise the saved tensors under the same names, with a config transformers reads. The same shapes train at
TP=2 with SP, CP=2 and EP=2 within 1e-5 of one process.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import (
    assert_converted_matches,
    assert_layout_matches,
    assert_read_in_place,
    assert_round_trip,
    hf_reference,
    layout_checks,
)
from test_moe_parallel import STEPS, assert_same_run, train_layout

from shardlm.checkpoint.hf import from_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.config import from_dict
from shardlm.parallel import ParallelContext

from multiproc import check_result, run_checks, run_workers

VOCAB = 300


def hf_model():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64,
                           rope_theta=500.0, tie_word_embeddings=False, num_nextn_predict_layers=0)
    return Glm4MoeForCausalLM(config)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(0)
    model = hf_model().eval()
    with torch.no_grad():  # sharp attention and routing, visible biases, so a slip in any moves the logits
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(6.0)
            attn.k_proj.weight.mul_(6.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.normal_(0, 0.5)
        moe = model.model.layers[1].mlp
        moe.gate.weight.mul_(30.0)
        moe.gate.e_score_correction_bias.normal_(0, 0.3)
        model.model.embed_tokens.weight.mul_(30.0)  # tokens, not the biases, decide the greedy continuation
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    return hf_reference(model, tmp_path_factory.mktemp("glm"), tokens)


def glm_config(tp: int = 1, ep: int = 1, cp: int = 1, sp: bool = False):
    return from_dict({
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                  "head_dim": 8, "qk_norm": True, "attention_bias": True, "rope_fraction": 0.5, "seq_length": 16,
                  "vocab_size": 100, "dropout": 0.0, "ffn_hidden_size": 48, "moe_num_experts": 8, "moe_top_k": 2,
                  "moe_ffn_hidden_size": 16, "moe_score": "sigmoid", "moe_shared_experts": 1,
                  "moe_first_dense_layers": 1, "moe_groups": 4, "moe_topk_groups": 2, "moe_routed_scaling": 2.5,
                  "moe_expert_bias_rate": 0.01, "moe_aux_loss_coeff": 0.001},
        "parallel": {"tensor": tp, "expert": ep, "context": cp, "sequence_parallel": sp},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": 4, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": 1e-6, "seed": 7},
    })


def training(tp: int = 1, ep: int = 1, cp: int = 1, sp: bool = False):
    def check():
        ctx = ParallelContext.from_process_group(tp, expert_parallel=ep, context_parallel=cp)
        return train_layout(ctx, glm_config(tp, ep, cp, sp))[:2]
    return check


def worker_world2(path, tokens: torch.Tensor) -> dict:
    checks = layout_checks({"glm": path}, tokens)
    checks |= {"train tp2 sp": training(tp=2, sp=True), "train cp2": training(cp=2), "train ep2": training(ep=2)}
    return run_checks(checks)


@pytest.fixture(scope="module")
def world2(reference):
    return run_workers(2, worker_world2, reference["converted"], reference["tokens"], timeout=600)


def test_conversion_reads_glm_attention_and_routing(reference):
    config, tensors = load_consolidated(reference["converted"])
    m = config.model
    assert (m.attention_bias, m.rope_fraction, m.qk_norm, m.moe_score, m.moe_shared_experts) == (
        True, 0.5, True, "sigmoid", 1)
    assert (m.moe_groups, m.moe_topk_groups, m.moe_routed_scaling, m.moe_first_dense_layers) == (4, 2, 2.5, 1)
    assert tensors["model/layers.0.attn.k.bias"].shape == (16,)
    assert tensors["model/layers.1.mlp.router.expert_bias"].abs().max() > 0


def test_tp1_logits_and_greedy_tokens_match_transformers(reference):
    assert_converted_matches(reference)


def test_the_hf_directory_itself_loads_without_converting(reference):
    """What `checkpoint.init_from=DIR` and `--checkpoint DIR` read: the directory in place gives the same logits."""
    assert_read_in_place(reference)


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, reference, layout):
    assert_layout_matches(world2, f"{layout} glm", reference)


def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(reference, tmp_path):
    assert_round_trip(reference, tmp_path / "back", type(hf_model()))


@pytest.fixture(scope="module")
def one_process():
    return train_layout(ParallelContext.single(), glm_config())[:2]


@pytest.mark.parametrize("name", ["train tp2 sp", "train cp2", "train ep2"])
def test_glm_shapes_train_as_one_process(world2, one_process, name):
    for run in check_result(world2, name):
        assert_same_run(run, one_process)


# zai-org/GLM-4.5 and GLM-4.5-Air: the fields that shape parameters
GLM45_CONFIGS = {
    "glm-4.5": dict(vocab_size=151552, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                    num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                    n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                    attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, tie_word_embeddings=False),
    "glm-4.5-air": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                        n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                        attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", list(GLM45_CONFIGS))
def test_planner_presets_count_what_transformers_builds(name):
    """The planner's total at TP=1 equals transformers' Glm4MoeForCausalLM built on the meta device from the
    published shape (its expert-bias buffers counted, as shardlm holds them as parameters); both leave out
    the multi-token-prediction layer. The published totals (355B, 106B) include it. So do the activated
    parameters (33.6B and 13.4B): transformers' total less, in each MoE layer, the routed experts a token
    does not visit (its experts' elements over the expert count, times experts less top-k)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from shardlm.plan.experts import activated_parameter_count
    from shardlm.plan.models import MODEL_PRESETS
    from shardlm.plan.parameters import parameter_count

    hf = GLM45_CONFIGS[name]
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(Glm4MoeConfig(**hf))
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    expected = sum(p.numel() for p in model.parameters()) + biases
    assert parameter_count(MODEL_PRESETS[name], 1).total == expected
    assert expected == pytest.approx({"glm-4.5": 352e9, "glm-4.5-air": 105e9}[name], rel=0.02)
    moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(moe_layers) == hf["num_hidden_layers"] - hf["first_k_dense_replace"]
    per_expert = sum(p.numel() for p in moe_layers[0].experts.parameters()) // hf["n_routed_experts"]
    skipped = hf["n_routed_experts"] - hf["num_experts_per_tok"]
    activated = expected - len(moe_layers) * skipped * per_expert
    assert activated_parameter_count(MODEL_PRESETS[name]) == activated
    assert activated == pytest.approx({"glm-4.5": 33.6e9, "glm-4.5-air": 13.4e9}[name], rel=2e-3)


def test_multi_token_prediction_layer_reads_and_writes_under_glm_names(reference, tmp_path, capsys):
    """GLM-4.5 ships one MTP depth as layer num_hidden_layers (DeepSeek-V3's enorm, hnorm, eh_proj,
    shared_head.norm, and a decoder layer of its own). A directory holding it converts to `mtp.0.*`, builds a
    model that reads every tensor, and converts back bitwise under the same names; transformers' own save
    (no MTP module) converts without it, with a note."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from shardlm.checkpoint import load_model
    from shardlm.checkpoint.hf import to_hf

    plain = tmp_path / "no_mtp"
    shutil.copytree(reference["root"] / "hf", plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    _, without = load_consolidated(from_hf(plain, tmp_path / "no_mtp.safetensors"))
    assert "has no multi-token prediction weights" in capsys.readouterr().err
    assert not any(name.startswith("model/mtp.") for name in without)

    with_mtp = tmp_path / "mtp"
    shutil.copytree(plain, with_mtp)
    tensors = load_file(str(with_mtp / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    extra = {name.replace("model.layers.1.", "model.layers.2."): torch.randn(value.shape, generator=gen)
             for name, value in tensors.items() if name.startswith("model.layers.1.")}
    extra |= {f"model.layers.2.{name}": torch.randn(shape, generator=gen) for name, shape in
              (("enorm.weight", (32,)), ("hnorm.weight", (32,)), ("eh_proj.weight", (32, 64)),
               ("shared_head.norm.weight", (32,)))}
    save_file(tensors | extra, str(with_mtp / "model.safetensors"))
    converted = from_hf(with_mtp, tmp_path / "mtp.safetensors")
    saved_config, ours = load_consolidated(converted)
    assert saved_config.model.mtp_layers == 1
    assert torch.equal(ours["model/mtp.0.eh_proj"], extra["model.layers.2.eh_proj.weight"])
    assert torch.equal(ours["model/mtp.0.block.attn.q.bias"], extra["model.layers.2.self_attn.q_proj.bias"])
    model, _ = load_model(converted, ParallelContext.single())
    assert model.mtp is not None and torch.equal(model.mtp[0].post_norm.weight,
                                                 extra["model.layers.2.shared_head.norm.weight"])
    back = load_file(str(to_hf(converted, tmp_path / "back") / "model.safetensors"))
    assert back.keys() == (tensors | extra).keys()
    assert all(torch.equal(back[name], value) for name, value in (tensors | extra).items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
