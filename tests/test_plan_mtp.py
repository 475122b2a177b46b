"""`shardlm plan` counts DeepSeek-V3's multi-token prediction (`model.mtp_layers`): parameters, the last pipeline
stage's memory, and time.

Published figure: DeepSeek-V3's Hugging Face release holds 685B parameters, 671B of the main model and 14B of the
MTP module (its model card), the module keeping its own copies of the embedding and the output head.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.parameters import layer_parameter_counts, parameter_count
from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages

DEEPSEEK = MODEL_PRESETS["deepseek-v3"]
WITH_MTP = dataclasses.replace(DEEPSEEK, mtp_layers=1)


def test_mtp_depth_adds_one_moe_layer_a_projection_and_three_norms():
    """Depth 1 sits at layer index 61, an MoE layer: the planner adds that layer, eh_proj (7168 x 14336) and three
    RMSNorms; with the released files' own embedding and head copies that is the model card's 14B MTP module and
    685B in all."""
    h = DEEPSEEK.hidden_size
    moe = layer_parameter_counts(DEEPSEEK, 1)[1].total
    added = parameter_count(WITH_MTP, 1).total - parameter_count(DEEPSEEK, 1).total
    assert added == moe + 2 * h * h + 3 * h
    copies = 2 * DEEPSEEK.vocab_size * h
    assert added + copies == pytest.approx(14e9, rel=0.05)
    assert parameter_count(WITH_MTP, 1).total + copies == pytest.approx(685e9, rel=0.002)


def test_mtp_depth_lives_on_the_last_pipeline_stage():
    """PP 16: the last rank holds the depth and a copy of the input embedding; the other ranks are unchanged, and
    the ranks sum to the model with its depth plus that copy."""
    layers = pipeline_layers(DEEPSEEK.num_layers, 16, 1)
    ranks = [rank_stages(layers, 16, r) for r in range(16)]
    without = [rank_parameter_count(DEEPSEEK, 1, r, ep=64).total for r in ranks]
    with_mtp = [rank_parameter_count(WITH_MTP, 1, r, ep=64).total for r in ranks]
    assert with_mtp[:-1] == without[:-1]
    embedding = DEEPSEEK.vocab_size * DEEPSEEK.hidden_size
    depth = parameter_count(WITH_MTP, 1, 64).total - parameter_count(DEEPSEEK, 1, 64).total
    assert with_mtp[-1] - without[-1] == depth + embedding
    assert sum(with_mtp) == parameter_count(WITH_MTP, 1, 64).total + embedding


def _choice(cfg, layout):
    from shardlm.plan.evaluate import Evaluator
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.planner import PlanRequest

    request = PlanRequest(PlannedModel("deepseek-v3", cfg), gpu_preset("h100"), 2048, 15360, param_dtype="half")
    return Evaluator(request).choice(layout)


def test_mtp_depth_costs_the_last_stage_memory_and_the_step_time():
    """PP 16 x DP 128, EP 64, the distributed optimizer, full recomputation: the last stage carries the depth's
    state and activations (the busiest stage's bytes grow), and its four layers plus the depth (5 against the
    other ranks' 4 at most) set the pace, so the step grows by more than the depth's share of the FLOPs."""
    from shardlm.plan.mtp import busiest_rank_layers
    from shardlm.plan.timing import Layout

    layout = Layout(tp=1, dp=128, micro_batch=1, checkpointing=True, pp=16, ep=64, distributed_optimizer=True)
    plain, mtp = _choice(DEEPSEEK, layout), _choice(WITH_MTP, layout)
    assert busiest_rank_layers(WITH_MTP, 16, 1, False) == (5, 5)
    assert busiest_rank_layers(DEEPSEEK, 16, 1, False) == (4, 4)
    assert mtp.busiest_stage == 15 and mtp.total_bytes > plain.total_bytes
    flops_share = mtp.time.model_flops / plain.time.model_flops
    assert mtp.time.compute_s / plain.time.compute_s > flops_share > 1.02
    assert mtp.time.ep_comm_s == pytest.approx(plain.time.ep_comm_s * 5 / 4)
