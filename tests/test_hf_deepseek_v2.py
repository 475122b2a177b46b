"""DeepSeek-V2's routing and DeepSeek-V3's sequence-wise balance loss, against transformers and Megatron-Core.

- `DeepseekV2ForCausalLM` (MLA with interleaved RoPE, softmax scores, groups ranked by their best expert
  (`group_limited_greedy`), no top-k renormalization, routed scaling, a shared expert, a dense first layer)
  and a V2-Lite-shaped one (no query low-rank path, plain top-k): shardlm's logits equal transformers' within
  1e-4 and its greedy tokens at TP=1, TP=2 and EP=2; converting back gives bitwise the saved tensors, a
  config transformers reads. The same weights routed with the groups ranked by their two best experts' sum
  (the rule DeepSeek-V3 uses with sigmoid scores) move the logits by more than 100 times that tolerance, so
  the test can tell the rules apart.
- The sequence-wise balance loss equals Megatron-Core's `seq_aux_loss` on the same logits (its
  `compute_routing_scores_for_aux_loss` and `switch_load_balancing_loss_func` over the [s, b] layout it
  uses), for softmax and sigmoid scores; a model with it trains at TP=2 with SP and CP=2 equal to one process.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_layout_matches,
    assert_round_trip,
    hf_reference,
    layout_checks,
    logits_and_greedy,
    variant_logits,
)
from test_mla_parallel import mla_config
from test_moe_parallel import STEPS, assert_same_run, train_layout

from shardlm.checkpoint.state import load_consolidated
from shardlm.models.moe import route, sequence_balance_loss
from shardlm.parallel import ParallelContext

from multiproc import check_result, import_or_skip, run_checks, run_workers

VOCAB = 300
KINDS = ("v2", "v2_lite")


def hf_model(kind: str):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64,
                  routed_scaling_factor=2.0, tie_word_embeddings=False, aux_loss_alpha=0.001)
    if kind == "v2":
        return DeepseekV2ForCausalLM(DeepseekV2Config(q_lora_rank=16, n_group=4, topk_group=2,
                                                      topk_method="group_limited_greedy", **common))
    return DeepseekV2ForCausalLM(DeepseekV2Config(q_lora_rank=None, topk_method="greedy", **common))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = {"tokens": torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))}
    for kind in KINDS:
        torch.manual_seed(0)
        model = hf_model(kind).eval()
        with torch.no_grad():  # sharp routing and loud experts, so a wrong group or expert moves the logits
            model.model.layers[1].mlp.gate.weight.mul_(30.0)
            model.model.layers[1].mlp.experts.down_proj.mul_(20.0)
        out[kind] = hf_reference(model, tmp_path_factory.mktemp(kind), out["tokens"])
    return out


def worker_world2(paths: dict, tokens: torch.Tensor) -> dict:
    checks = layout_checks(paths, tokens)
    checks["train tp2 sp"] = lambda: train_layout(ParallelContext.from_process_group(2),
                                                  sequence_config(tp=2, sp=True))[:2]
    checks["train cp2"] = lambda: train_layout(ParallelContext.from_process_group(1, context_parallel=2),
                                               sequence_config(cp=2))[:2]
    return run_checks(checks)


@pytest.fixture(scope="module")
def world2(reference):
    return run_workers(2, worker_world2, {k: reference[k]["converted"] for k in KINDS}, reference["tokens"],
                       timeout=600)


def test_conversion_reads_v2_routing(reference):
    m = load_consolidated(reference["v2"]["converted"])[0].model
    assert (m.moe_score, m.moe_norm_topk_prob, m.moe_groups, m.moe_topk_groups, m.moe_routed_scaling) == (
        "softmax", False, 4, 2, 2.0)
    assert (m.moe_aux_loss_type, m.moe_aux_loss_coeff, m.moe_expert_bias) == ("sequence", 0.001, False)
    lite = load_consolidated(reference["v2_lite"]["converted"])[0].model
    assert (lite.q_lora_rank, lite.moe_groups) == (0, 0)


def test_the_other_group_rule_gives_other_logits(reference, tmp_path, monkeypatch):
    """Control: the same V2 weights routed with DeepSeek-V3's group rule (a group ranked by the sum of its two
    best experts' scores, not by its best one) move the logits by more than 100 times the tolerance, so the
    logit checks above tell the two rules apart."""
    from shardlm.models import moe

    def top2_sum(*args, **kwargs):
        return route(*args[:7], group_rule="top2_sum")

    monkeypatch.setattr(moe, "route", top2_sum)
    logits = variant_logits(reference["v2"], tmp_path / "top2_sum.safetensors")
    moved = (logits - reference["v2"]["logits"]).abs().max().item()
    assert moved > 100 * LOGIT_TOL, moved


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_logits_and_greedy_tokens_match_transformers(reference, kind):
    assert_converted_matches(reference[kind])


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("kind", KINDS)
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, reference, layout, kind):
    assert_layout_matches(world2, f"{layout} {kind}", reference[kind])


def test_rope_interleave_false_reads_as_transformers_computes_it(reference, tmp_path):
    """DeepseekV2ForCausalLM interleaves its rotary channels whatever rope_interleave says: the "v2" directory with
    rope_interleave = false in its config.json still gives transformers' logits (read as stored, the rotary rows
    would stay interleaved: 0.05 off)."""
    import json
    import shutil

    from shardlm.checkpoint.hf import from_hf

    ref = reference["v2"]
    folder = tmp_path / "hf"
    shutil.copytree(ref["root"] / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"rope_interleave": False}))
    logits = logits_and_greedy(from_hf(folder, tmp_path / "m.safetensors"), ParallelContext.single(),
                               reference["tokens"])[0]
    assert (logits - ref["logits"]).abs().max() < LOGIT_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(reference, kind, tmp_path):
    assert_round_trip(reference[kind], tmp_path / "back", type(hf_model(kind)))


# ------------------------------------------------------------------------- sequence-wise balance loss

@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_balance_loss_equals_megatron_core(score):
    moe_utils = import_or_skip("megatron.core.transformer.moe.moe_utils")  # fails under CI, which installs it
    B, T, E, k, coeff = 3, 10, 8, 2, 0.01
    logits = torch.randn(B, T, E, generator=torch.Generator().manual_seed(3)) * 3
    probs = logits.softmax(-1) if score == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
    ours = sequence_balance_loss(probs.reshape(-1, E), B, k, coeff)
    # Megatron-Core's seq_aux_loss (router._apply_seq_aux_loss) on its [s, b] token order
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits.transpose(0, 1).reshape(-1, E), k,
                                                                        score)
    scores, routing_map = scores.reshape(T, -1), routing_map.reshape(T, -1)
    theirs = moe_utils.switch_load_balancing_loss_func(scores, routing_map.sum(0), T, k, E, coeff) / B
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    uniform = sequence_balance_loss(torch.full((B * T, E), 1.0 / E), B, k, coeff)
    assert ours > uniform  # the random routing is unbalanced: above the loss of uniform probabilities


def sequence_config(tp: int = 1, cp: int = 1, sp: bool = False):
    config = mla_config(tp=tp, cp=cp, sp=sp, moe_aux_loss_type="sequence")
    config.model.moe_aux_loss_coeff = 0.01
    return config


@pytest.fixture(scope="module")
def sequence_one_process():
    return train_layout(ParallelContext.single(), sequence_config())[:2]


@pytest.mark.parametrize("name", ["train tp2 sp", "train cp2"])
def test_sequence_balance_loss_trains_as_one_process(world2, sequence_one_process, name):
    curve, _ = sequence_one_process
    assert len(curve) == STEPS and all(aux > 0 for *_, aux in curve)
    for run in check_result(world2, name):
        assert_same_run(run, sequence_one_process)
