"""`shardlm plan` with FSDP (`train.data_sharding = "full"`): memory, time, when it wins, what shardlm allocates.

- memory per rank: the fp32 parameter and gradient shards and AdamW's moments / DP, derived here from
  Llama 3 70B's shape, and the transient gathered root and layers;
- time: per layer 1 + m all-gathers and one reduce-scatter priced as ring collectives over the DP group's
  link (NVLink in a server, the node's network across servers), the dp_overlap fraction hidden behind
  the layer's forward or backward; the root's collectives exposed;
- with context parallelism, shards over DP x CP; not planned with pipeline stages or MoE layers;
- Llama 3 70B on 64 H100s at 8,192 tokens: full wins (TP 1 x DP 64, nothing else fits without TP or a
  pipeline); GPT-2 355M on one 8-GPU server: it does not (the unsharded state fits and FSDP moves 1.5x the
  all-reduce's bytes);
- on the CPU, a tiny GPT under shardlm's FSDP at DP=2: state bytes and the collectives of one step equal
  the planner's formulas.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardlm.cli import main
from shardlm.errors import UserError
from shardlm.plan.fsdp import fsdp_collectives, fsdp_gathered_bytes, fsdp_state_memory, fsdp_units
from shardlm.plan.hardware import gpu_preset
from shardlm.plan.models import resolve_model
from shardlm.plan.parameters import parameter_count
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.sc21 import SC21_CALIBRATION
from shardlm.plan.timing import Layout, step_time

from multiproc import check_result, run_checks, run_workers

H100 = gpu_preset("h100")


def llama70b_request(**changes) -> PlanRequest:
    """Llama 3 70B at its 8,192 tokens on 64 H100s (8 servers), one sequence per GPU per step."""
    model = resolve_model("llama3-70b")
    assert model.config.seq_length == 8192
    return dataclasses.replace(PlanRequest(model=model, gpu=H100, gpus=64, global_batch=64,
                                           calibration=SC21_CALIBRATION), **changes)


def llama70b_elements(tp: int) -> tuple[int, int, int]:
    """(one layer's, the root's, tensors) of Llama 3 70B on one TP rank, from its shape: q and o h x h split,
    k and v 8 KV heads x 128 x h split (8 divides by TP), gate, up, down f x h split, two norms of h; the
    embedding and the untied output layer V_padded x h split by rows (V padded to a multiple of 128 TP),
    the final norm h."""
    cfg = resolve_model("llama3-70b").config
    h, f, kv, layers = cfg.hidden_size, cfg.ffn_size, 8 * 128, cfg.num_layers
    padded = -(-cfg.vocab_size // (128 * tp)) * 128 * tp
    layer = (2 * h * h + 2 * kv * h + 3 * f * h) // tp + 2 * h
    return layer, 2 * padded * h // tp + h, 9 * layers + 3


@pytest.fixture(scope="module")
def llama70b():
    return {sharding: plan(llama70b_request(data_sharding=sharding)) for sharding in ("auto", "none", "optimizer")}


# ------------------------------------------------------------------------------------------- memory

@pytest.mark.parametrize("tp", [1, 8])
def test_full_sharding_memory_per_rank_is_the_state_over_dp_plus_the_gathered_units(tp):
    """A rank holds 4 N / DP bytes of fp32 parameters and of gradients, 8 N / DP of AdamW moments and a
    4-byte step per tensor; transient: the root gathered and its gradient, two layers gathered (w bytes each,
    w = 4 with fp32 parameters, 2 with half ones) and one layer's fp32 gradient; with m > 1 micro-batches
    every unit's fp32 gradient (4 N) instead."""
    layer, root, tensors = llama70b_elements(tp)
    layers, dp = 80, 64 // tp
    n = root + layers * layer
    assert parameter_count(resolve_model("llama3-70b").config, 1).total == 70_553_706_496  # docs/plan.md
    units = fsdp_units(resolve_model("llama3-70b").config, tp)
    assert (units.layer, units.root, units.total) == (layer, root, n)
    state = fsdp_state_memory(parameter_count(resolve_model("llama3-70b").config, tp), dp)
    share = -(-n // dp)
    assert (state.parameters, state.gradients, state.optimizer) == (4 * share, 4 * share, 8 * share + 4 * tensors)
    for w in (4, 2):
        assert fsdp_gathered_bytes(units, w, 1) == 2 * root * w + 2 * layer * w + 4 * layer
        assert fsdp_gathered_bytes(units, w, 2) == root * w + 2 * layer * w + 4 * n

    request = llama70b_request(global_batch=dp, data_sharding="full", pipeline=1, recompute="full", micro_batch=1)
    row = next(r for r in plan(request).rows if r.tp == tp)
    choice = row.choice
    assert choice.layout.data_sharding == "full" and choice.accumulation == 1
    assert choice.state == state and choice.gathered == fsdp_gathered_bytes(units, 4, 1)  # fp32 parameters
    assert choice.total_bytes == state.total + choice.activation_peak + choice.gathered + 2 * 10**9


# --------------------------------------------------------------------------------------------- time

def _ring_over_dp(nbytes: float, dp: int, tp: int, calibration) -> float:
    """Ring all-gather / reduce-scatter of nbytes over DP ranks TP apart on H100 servers of 8: NVLink (450 GB/s
    per direction) in a server; across servers also the server's 400 GB/s network, carrying it for its TP
    groups at once; both at the link efficiency, the slower link sets the time."""
    steps = dp - 1
    nvlink = steps / dp * nbytes / (450e9 * calibration.link_efficiency) + steps * calibration.intra_node_latency_s
    if dp <= 8 // tp:
        return nvlink
    network = (steps / dp * tp * nbytes / (400e9 * calibration.link_efficiency)
               + steps * calibration.inter_node_latency_s)
    return max(nvlink, network)


@pytest.mark.parametrize("tp, dp, micro, checkpointing", [(1, 64, 1, True), (8, 8, 1, True), (1, 8, 2, False),
                                                          (2, 32, 1, False)])
def test_full_sharding_time_terms_equal_the_formula(tp, dp, micro, checkpointing):
    """The FSDP terms of one step at global batch 64 x 2 (m = 2 / micro micro-batches): the whole traffic
    root gather + root reduce-scatter + L ((1 + m) gathers + 1 reduce-scatter), and its exposed part, per
    layer gather - min(dp_overlap x gather, forward) for the first forward, (gather [+ reduce-scatter on the
    last micro-batch]) - min(dp_overlap x it, backward) per backward, the root's collectives exposed. A
    layer's forward and backward are 1/3 and 2/3 (1/4 and 3/4 when recomputing) of its share of the step's
    compute (all but the LM head's 6 s h V FLOPs per sequence), elementwise and TP work, per micro-batch.
    The optimizer streams 40 bytes per parameter of the rank's 1/DP share."""
    request = llama70b_request(gpus=tp * dp, global_batch=2 * dp)
    cfg, fmt, calibration = request.model.config, request.format, request.calibration
    layout = Layout(tp=tp, dp=dp, micro_batch=micro, checkpointing=checkpointing, sequence_parallel=tp > 1,
                    full_sharding=True)
    params = parameter_count(cfg, tp)
    time = step_time(cfg, layout, request.global_batch, H100, fmt, params, calibration)
    layer, root, _ = llama70b_elements(tp)
    layers, m, w = 80, 2 // micro, fmt.weight_bytes
    gather, reduce = _ring_over_dp(layer * w, dp, tp, calibration), _ring_over_dp(layer * 4, dp, tp, calibration)
    root_s = _ring_over_dp(root * w, dp, tp, calibration) + _ring_over_dp(root * 4, dp, tp, calibration)
    assert time.dp_comm_s == pytest.approx(root_s + layers * ((1 + m) * gather + reduce), rel=1e-12)

    padded = -(-cfg.vocab_size // (128 * tp)) * 128 * tp
    head = 6 * request.global_batch * cfg.seq_length * cfg.hidden_size * padded
    per_layer = (time.compute_s * (1 - head / time.model_flops) + time.elementwise_s + time.tp_comm_s) / (m * layers)
    forward_share = 1 / 4 if checkpointing else 1 / 3
    forward, backward = forward_share * per_layer, (1 - forward_share) * per_layer

    def exposed(seconds, window):
        return seconds - min(calibration.dp_overlap * seconds, window)

    expected = root_s + layers * (exposed(gather, forward) + (m - 1) * exposed(gather, backward)
                                  + exposed(gather + reduce, backward))
    assert time.dp_exposed_s == pytest.approx(expected, rel=1e-12)
    assert 0 < time.dp_exposed_s < time.dp_comm_s
    hbm = H100.hbm_gbps * 1e9 * calibration.memory_efficiency
    assert time.optimizer_s == pytest.approx(params.total * 40 / dp / hbm, rel=1e-12)


# ------------------------------------------------------------------------------------ when it wins

def test_llama3_70b_on_64_h100s_picks_full_sharding_over_a_pipeline(llama70b):
    """At 8,192 tokens, one sequence per GPU: the recommendation is FSDP at TP 1 x DP 64 (full recomputation),
    and it beats the best layout without it, which needs a pipeline and TP (or CP) to hold 70B x 16 bytes:
    FSDP's exposed collectives cost less than that layout's bubble and TP all-reduces. No TP = 1 layout
    without a pipeline fits without FSDP."""
    best = llama70b["auto"].recommended
    assert best.choice.layout.data_sharding == "full" and best.fits
    assert (best.pp, best.tp, best.cp, best.dp) == (1, 1, 1, 64) and best.choice.layout.recompute == "full"
    time = best.choice.time
    for sharding in ("none", "optimizer"):
        other = llama70b[sharding].recommended
        assert other.choice.layout.data_sharding == sharding and other.fits
        assert time.total_s < other.choice.time.total_s
        assert other.pp > 1 and other.tp > 1
        assert time.dp_exposed_s < other.choice.time.bubble_s + other.choice.time.tp_comm_s
        assert not any(r.fits for r in llama70b[sharding].rows if r.pp == r.tp == r.cp == 1)
    assert best.choice.total_bytes <= 80e9 and best.state.total < 0.25 * best.choice.total_bytes


def test_gpt2_355m_on_one_server_does_not_pick_full_sharding():
    """GPT-2 355M on one server of 8 H100s, one sequence per GPU: its 355M x 16 bytes (5.7 GB) fit every GPU
    unsharded, so FSDP saves memory no layout needs, while its layers cross NVLink 3 times a step (2 gathers
    and 1 reduce-scatter: 1.5x the all-reduce's bytes, in 74 collectives instead of one), with one 1,024-token
    sequence of compute per layer to hide them. At TP 1 x DP 8 it is slower than the distributed optimizer,
    which shards the optimizer's work over the same ranks for the all-reduce's traffic; not recommended."""
    request = PlanRequest(model=resolve_model("gpt2-355m"), gpu=H100, gpus=8, global_batch=8,
                          calibration=SC21_CALIBRATION)
    assert plan(request).recommended.choice.layout.data_sharding != "full"
    rows = {s: next(r for r in plan(dataclasses.replace(request, data_sharding=s, pipeline=1)).rows if r.tp == 1)
            for s in ("none", "optimizer", "full")}
    assert all(row.fits and row.choice.accumulation == 1 for row in rows.values())
    assert rows["none"].state.total < 0.1 * H100.memory_gb * 1e9
    full, zero = rows["full"].choice.time, rows["optimizer"].choice.time
    assert full.dp_comm_s > 1.5 * zero.dp_comm_s and full.dp_exposed_s > zero.dp_exposed_s
    assert full.total_s > 1.1 * zero.total_s


# ---------------------------------------------------------------------------------------- requests

def test_full_sharding_where_planned_and_over_dp_x_cp():
    """Fixed --data-sharding full plans every layout shardlm runs it on, pipeline stages included (their terms:
    tests/test_plan_compose.py), and skips DP x CP = 1 with the reason; with context parallelism it shards
    over DP x CP; --distributed-optimizer on/off still mean optimizer/none, and a contradiction is a one-line
    error; MoE models get FSDP rows."""
    result = plan(llama70b_request(data_sharding="full"))
    assert result.rows and all(r.choice.layout.data_sharding == "full" for r in result.rows)
    assert any(r.pp > 1 for r in result.rows) and "2x8x4" not in result.skipped
    assert result.skipped["8x8x1"] == "FSDP needs DP x CP > 1"
    context = next(r for r in result.rows if r.tp == 8 and r.cp == 2)
    assert context.state == fsdp_state_memory(parameter_count(resolve_model("llama3-70b").config, 8), 4 * 2)
    for switch, sharding in (("on", "optimizer"), ("off", "none")):
        rows = plan(llama70b_request(distributed_optimizer=switch, pipeline=1)).rows
        assert {r.choice.layout.data_sharding for r in rows} == {sharding}
    with pytest.raises(UserError, match="--distributed-optimizer on contradicts --data-sharding full"):
        plan(llama70b_request(distributed_optimizer="on", data_sharding="full"))
    moe = plan(PlanRequest(model=resolve_model("mixtral-8x7b"), gpu=H100, gpus=16, global_batch=64,
                           param_dtype="half", data_sharding="full"))
    assert moe.rows and all(r.choice.layout.full_sharding for r in moe.rows)


def test_cli_data_sharding_column_and_json(capsys):
    args = ["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100", "--global-batch", "64"]
    assert main([*args, "--data-sharding", "full", "--pipeline", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {layout["data_sharding"] for layout in data["layouts"]} == {"full"}
    best = data["recommended"]
    assert best["memory_bytes"]["total"] == (sum(best["memory_bytes"][k] for k in ("parameters", "gradients",
                                             "optimizer", "activations_peak", "fsdp_gathered")) + 2 * 10**9)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "shard" in text and "data sharding full" in text.splitlines()[-1]


# ----------------------------------------------------------------------- against shardlm's FSDP on the CPU

def fsdp_worker() -> dict:
    """In a world of 2 (DP=2): a tiny GPT under FSDP: measured state bytes, and the collectives of one step
    with 1 and 2 micro-batches per rank (`tests/test_fsdp.py`'s helpers)."""
    from test_fsdp import collectives_of_a_step, config, state_bytes
    from test_training import synthetic_data

    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    def measure_state():
        trainer = Trainer(config(micro=2), ParallelContext.from_process_group(1), synthetic_data())
        trainer.train_step()
        return state_bytes(trainer)

    return run_checks({"state": measure_state,
                       "collectives": lambda: {micro: collectives_of_a_step(micro, True) for micro in (4, 2)}})


@pytest.mark.timeout(300)
def test_the_planners_fsdp_formulas_equal_what_shardlm_allocates_and_sends():
    """A tiny GPT (2 layers, h 32) at DP=2: each rank's parameter, gradient and AdamW bytes equal
    `fsdp_state_memory` of the planner's parameter count, and one step's all-gathers and reduce-scatters
    (calls, elements) equal `fsdp_collectives` of the planner's units, at m = 1 and m = 2."""
    from test_fsdp import config

    cfg = config().model
    params = parameter_count(cfg, 1)
    expected = fsdp_state_memory(params, 2)
    results = run_workers(2, fsdp_worker)
    for measured in check_result(results, "state"):
        assert measured == {"parameters": expected.parameters, "gradients": expected.gradients,
                            "optimizer": expected.optimizer}
    units = fsdp_units(cfg, 1)
    for micro, value in check_result(results, "collectives")[0].items():
        m = value["micro_batches"]
        assert m == 4 // micro and value["elements"] == units.total == params.total
        formula = fsdp_collectives(units, m)
        assert value["counts"]["all_gather"] == [formula.all_gather_calls, formula.all_gather_elements]
        assert value["counts"]["reduce_scatter"] == [formula.reduce_scatter_calls, formula.reduce_scatter_elements]
