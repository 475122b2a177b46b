"""`shardlm plan` knows context parallelism: activations of T / C tokens, the ring's traffic and overlap, the
gradient reduction over DP x CP, and a long-context case where it picks C > 1 and fits."""

from __future__ import annotations

import dataclasses

import pytest

from shardlm.errors import UserError
from shardlm.plan.activations import LayerSetting, shardlm_memory
from shardlm.plan.context import LONG_CONTEXT, ring_seconds
from shardlm.plan.hardware import gpu_preset
from shardlm.plan.memory import numeric_format
from shardlm.plan.models import PlannedModel, resolve_model
from shardlm.plan.parameters import ParameterCount
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.sc21 import SC21_CALIBRATION
from shardlm.plan.timing import Layout, dp_comm_seconds

LONG = 131072


def llama3_8b(seq_length: int) -> PlannedModel:
    model = resolve_model("llama3-8b")
    return PlannedModel(model.name, dataclasses.replace(model.config, seq_length=seq_length))


@pytest.fixture(scope="module")
def long_plan():
    """Llama 3 8B trained at 131,072 tokens on 64 H100s (8 servers), 64 sequences per step."""
    return plan(PlanRequest(model=llama3_8b(LONG), gpu=gpu_preset("h100"), gpus=64, global_batch=64,
                            calibration=SC21_CALIBRATION))


def test_long_context_plan_picks_context_parallelism_that_fits(long_plan):
    """The recommended layout has C > 1 and fits in 80 GB; it is faster than every fitting C = 1 layout
    (which all need full recomputation at this length); the ring's transfers are mostly hidden."""
    best = long_plan.recommended
    assert best.cp > 1 and best.fits and best.choice.total_bytes <= 80e9
    assert best.choice.layout.gpus == 64
    without = [row for row in long_plan.rows if row.cp == 1 and row.fits]
    assert without and all(row.choice.layout.recompute == "full" for row in without)
    assert all(best.choice.time.total_s < row.choice.time.total_s for row in without)
    time = best.choice.time
    assert 0 < time.cp_comm_s < 0.1 * time.cp_ring_s


def test_a_context_parallel_rank_saves_the_per_token_activations_of_its_share_of_the_tokens():
    """Per layer, what a rank saves at C = 1, 2, 4 is a T / C share of the per-token activations plus a part
    that does not depend on the tokens (autocast's half copies of the layer's weights): the differences
    halve with C, and the constant is the same at every C."""
    cfg, fmt = llama3_8b(LONG).config, numeric_format("bf16")
    setting = LayerSetting(sequence_parallel=True)
    saved = {c: shardlm_memory(dataclasses.replace(cfg, seq_length=LONG // c), 2, 1, fmt, setting).per_layer
             for c in (1, 2, 4)}
    assert saved[1] - saved[2] == 2 * (saved[2] - saved[4]) > 0
    per_token_share = saved[2] - saved[4]  # what T / 4 tokens save
    assert 0 <= saved[4] - per_token_share < 0.1 * saved[4]


def test_short_sequences_are_planned_without_context_parallelism():
    """Below LONG_CONTEXT tokens the planner keeps C = 1 (its rows are those it made before CP existed)."""
    result = plan(PlanRequest(model=llama3_8b(LONG_CONTEXT // 2), gpu=gpu_preset("h100"), gpus=16, global_batch=64,
                              calibration=SC21_CALIBRATION))
    assert {row.cp for row in result.rows} == {1}


def test_ring_time_is_the_formula_of_kv_bytes_and_hides_behind_compute():
    """C = 4, TP = 2, b = 1, Llama 3 8B (8 KV heads of 128 channels, 4 per TP rank), bf16, T = 131,072: per
    layer 3 hops forward of K and V (2 x 4 x 32,768 x 128 x 2 bytes), 3 backward of K/V plus fp32 dK/dV, and
    the forward's again under full recomputation. Blocks that take no time hide nothing; blocks longer than
    the transfers hide all but the latencies."""
    cfg = llama3_8b(LONG).config
    kv = 2 * 4 * (LONG // 4) * 128
    bandwidth, latency = 100e9, 1e-5
    expected_total = 3 * ((kv * 2) / bandwidth + latency) + 3 * ((kv * 2 + kv * 4) / bandwidth + latency)
    exposed, total = ring_seconds(cfg, 4, 2, 1, 2, False, bandwidth, latency, flops_per_s=1e30)
    assert total == pytest.approx(expected_total) and exposed == pytest.approx(expected_total)
    exposed_slow, total_slow = ring_seconds(cfg, 4, 2, 1, 2, False, bandwidth, latency, flops_per_s=1.0)
    assert total_slow == pytest.approx(expected_total) and exposed_slow == pytest.approx(6 * latency)
    _, recomputed = ring_seconds(cfg, 4, 2, 1, 2, True, bandwidth, latency, flops_per_s=1.0)
    assert recomputed == pytest.approx(expected_total + 3 * ((kv * 2) / bandwidth + latency))
    assert ring_seconds(cfg, 1, 2, 1, 2, False, bandwidth, latency, 1.0) == (0.0, 0.0)


def test_gradients_are_reduced_over_data_times_context_ranks():
    """DP = 2 x CP = 4 reduces gradients like DP = 8: one all-reduce over 8 ranks TP apart."""
    params = ParameterCount(sharded=10**9, replicated=10**6, tensors=100, matrix=10**9)
    gpu, fmt = gpu_preset("h100"), numeric_format("bf16")
    with_cp = dp_comm_seconds(params, Layout(tp=2, dp=2, cp=4, micro_batch=1, checkpointing=False), gpu, fmt,
                              SC21_CALIBRATION)
    plain = dp_comm_seconds(params, Layout(tp=2, dp=8, micro_batch=1, checkpointing=False), gpu, fmt,
                            SC21_CALIBRATION)
    assert with_cp == plain > 0


@pytest.mark.parametrize("model,context,implementation,message", [
    ("bert-336m", 2, "shardlm", "--context=2: context parallelism is planned for GPT and Llama only"),
    ("llama3-8b", 0, "shardlm", "--context=0 must be at least 1"),
    ("llama3-8b", 2, "megatron", "--context=2: not planned for --implementation megatron .*use --implementation "
                                 "megatron-core"),
])
def test_bad_context_requests_are_one_line_errors(model, context, implementation, message):
    with pytest.raises(UserError, match=message):
        plan(PlanRequest(model=resolve_model(model), gpu=gpu_preset("h100"), gpus=16, global_batch=64,
                         context=context, implementation=implementation))


@pytest.mark.parametrize("implementation,hinted", [("megatron", True), ("megatron-core", False)])
def test_no_layout_at_a_long_sequence_under_sc21s_megatron_names_the_implementations_with_cp(implementation,
                                                                                             hinted):
    """One sequence a step cannot fill two pipeline stages at any TP x DP: SC21's Megatron (no CP) says where
    context parallelism is planned; megatron-core, which searched CP already, does not."""
    with pytest.raises(UserError, match="no valid PP x TP x DP layout") as error:
        plan(PlanRequest(model=llama3_8b(LONG), gpu=gpu_preset("h100"), gpus=16, global_batch=1, pipeline=2,
                         implementation=implementation))
    assert ("context parallelism, which splits a long sequence over GPUs, is planned with --implementation "
            "megatron-core or shardlm" in str(error.value)) == hinted
