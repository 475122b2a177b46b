"""The zero-bubble schedules in the planner: the replay of PyTorch's action order (`plan.schedule_sim`) against
the closed forms of the papers, derived here by hand, and the V-shaped placement's parameters, activations and
errors in `shardlm plan`."""

from __future__ import annotations

import json

import pytest

from shardlm.cli import main
from shardlm.errors import UserError
from shardlm.plan import cli as plan_cli
from shardlm.plan.hardware import gpu_preset
from shardlm.plan.models import MODEL_PRESETS, PlannedModel
from shardlm.plan.parameters import parameter_count
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.schedule_sim import schedule_actions, schedule_invalid_reason, simulate
from shardlm.plan.stages import SCHEDULES, forwards_in_flight, pipeline_layers, rank_parameter_count, rank_stages

pytestmark = pytest.mark.timeout(120)

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def idle(schedule: str, pp: int, virtual: int, m: int, f: float, i: float, w: float) -> float:
    """Idle time of the busiest rank: the step's makespan less that rank's work."""
    result = simulate(schedule, pp, virtual, m, f, i, w)
    return result["makespan"] - max(result["busy"])


# ----------------------------------------------------------------------------------- the order is PyTorch's

def test_every_stage_runs_each_micro_batch_forward_and_backward_once():
    for schedule, virtual in (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 1), ("interleaved-zb", 2),
                              ("zbv", 2), ("dualpipev", 2)):
        actions = [a for rank in schedule_actions(schedule, 4, virtual, 8) for a in rank]
        stages = 4 * virtual
        assert sorted((s, mb) for kind, s, mb in actions if kind == "F") == \
            [(s, mb) for s in range(stages) for mb in range(8)]
        assert sorted((s, mb) for kind, s, mb in actions if kind in "BW") == \
            [(s, mb) for s in range(stages) for mb in range(8)]  # one full B, or one W after its I


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"])
def test_multi_stage_orders_are_get_schedule_ops(schedule):
    """The order replayed is the one PyTorch's visualizer reads from the schedule class, OVERLAP_F_B's halves in
    order, spacing and REDUCE_GRAD dropped."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from shardlm.plan.schedule_sim import SCHEDULE_CLASSES

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    for pp, m in ((2, 4), (4, 8), (4, 12)):
        drawn = [[(kinds[part.computation_type.name], part.stage_index, part.microbatch_index)
                  for action in rank if action is not None for part in (action.sub_actions or (action,))
                  if part.computation_type.name in kinds]
                 for rank in get_schedule_ops(SCHEDULE_CLASSES[schedule].removeprefix("Schedule"), pp, m, 2)]
        assert [list(rank) for rank in schedule_actions(schedule, pp, 2, m)] == drawn


def test_the_v_places_stage_r_and_its_mirror_on_rank_r():
    for schedule in ("zbv", "dualpipev"):
        for rank, ops in enumerate(schedule_actions(schedule, 4, 2, 8)):
            assert {s for _, s, _ in ops} == {rank, 7 - rank}


def test_single_stage_orders_are_what_step_microbatches_runs():
    """GPipe's drawing in PyTorch is its run; 1F1B's drawing is too, except its last rank's (F1 .. Fm in torch
    2.13), which `_step_microbatches` runs as F0, B0, F1, B1, ..."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    def drawn(name):
        kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
        return [[(kinds[a.computation_type.name], a.stage_index, a.microbatch_index) for a in rank
                 if a is not None and a.computation_type.name in kinds]
                for rank in get_schedule_ops(name, 4, 8)]

    assert [list(r) for r in schedule_actions("gpipe", 4, 1, 8)] == drawn("GPipe")
    ours, theirs = schedule_actions("1f1b", 4, 1, 8), drawn("1F1B")
    assert [list(r) for r in ours[:3]] == theirs[:3]
    assert list(ours[3][:4]) == [("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1)]


# ----------------------------------------------------------------------------------- the closed forms

@pytest.mark.parametrize("pp,m", SIZES)
def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m(pp, m):
    """Narayanan et al. 2021, eq. 1: with b = 2f, (P - 1)(f + b) idle against m (f + b) of work."""
    for schedule in ("gpipe", "1f1b"):
        assert simulate(schedule, pp, 1, m, 1, 1, 1)["bubble"] == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp,m", SIZES)
@pytest.mark.parametrize("virtual", [2, 3])
def test_interleaved_1f1b_bubble_is_p_minus_1_over_v_m(pp, m, virtual):
    """Narayanan et al. 2021, eq. 2, when P divides m."""
    assert simulate("interleaved-1f1b", pp, virtual, m, 1, 1, 1)["bubble"] == pytest.approx((pp - 1) / (virtual * m))


@pytest.mark.parametrize("pp,m", SIZES)
@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1.3, 0.7), (1, 1, 0.5)])
def test_zb_h1_idles_p_minus_1_times_f_plus_i_minus_w(pp, m, f, i, w):
    """Qi et al. 2024, ZB-H1: (P - 1)(T_F + T_B - T_W) idle, T_B the input-gradient backward, against 1F1B's
    (P - 1)(T_F + T_B + T_W); at f = i = w a third of it."""
    assert idle("interleaved-zb", pp, 1, m, f, i, w) == pytest.approx((pp - 1) * (f + i - w))
    if (f, i, w) == (1, 1, 1):
        assert idle("1f1b", pp, 1, m, f, i, w) == pytest.approx(3 * idle("interleaved-zb", pp, 1, m, f, i, w))
        assert simulate("interleaved-zb", pp, 1, m, f, i, w)["bubble"] == pytest.approx((pp - 1) / (3 * m))


@pytest.mark.parametrize("pp,m", SIZES)
@pytest.mark.parametrize("virtual", [2, 3])
def test_interleaved_zero_bubble_divides_zb_h1_by_v(pp, m, virtual):
    """V stages a rank, each of 1/V of the layers: the same (P - 1)(f + i - w) idle in a stage's units, against V
    times the work: (P - 1) / (3 V m) at f = i = w."""
    assert simulate("interleaved-zb", pp, virtual, m, 1, 1, 1)["bubble"] == pytest.approx((pp - 1) / (3 * virtual * m))


def test_v_shapes_reach_the_warm_up_bound_at_equal_costs():
    """Nothing can reach rank P - 1 before P - 1 stage forwards have run, so no schedule idles less than
    (P - 1) f there; ZB-V and DualPipeV (m >= 2P) idle exactly that at f = i = w: (P - 1) / (6 m) of a rank's
    2 stages x m x 3f, under 1% at P = 4, m = 64."""
    for pp, m in ((2, 4), (4, 8), (4, 16), (8, 16)):
        for schedule in ("zbv", "dualpipev"):
            assert idle(schedule, pp, 2, m, 1, 1, 1) == pytest.approx(pp - 1)
            assert simulate(schedule, pp, 2, m, 1, 1, 1)["bubble"] == pytest.approx((pp - 1) / (6 * m))
    assert simulate("zbv", 4, 2, 64, 1, 1, 1)["bubble"] < 0.01


@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2), (1, 1, 0.5), (3, 5, 4)])
def test_dualpipev_stays_within_deepseeks_table(f, i, w):
    """DualPipe's README: DualPipeV of PP stages on PP / 2 devices idles (PP/2 - 1)(F&B + B - 3W), B the full
    backward; on P ranks PP = 2P, and with PyTorch running an overlapped F&B as F then B, F&B = F + B:
    (P - 1)(f + 2(i + w) - 3w). PyTorch's order never idles more (at f = i = w half of it: the warm-up bound)."""
    for pp in (2, 4, 8):
        for m in (2 * pp, 4 * pp):
            table = (pp - 1) * (f + 2 * (i + w) - 3 * w)
            assert idle("dualpipev", pp, 2, m, f, i, w) <= table + 1e-9
    assert idle("dualpipev", 4, 2, 8, 1, 1, 1) == pytest.approx((4 - 1) * (1 + 2 * 2 - 3) / 2)


# ----------------------------------------------------------------------------------- in flight

def test_in_flight_micro_batches_from_the_order():
    """1F1B: P - r on rank r (Narayanan et al.). ZB-H1 holds 1F1B's P on rank 0 and no rank more (Qi et al.:
    ZB-H1 keeps 1F1B's peak memory). ZB-V: 2P half-size stages' micro-batches a rank, 1F1B's peak again (the
    paper, section 6); DualPipeV: 2P + 1, the README's PP + 1 with PP = 2P stages."""
    sims = {s: simulate(s, 4, v, 16, 1, 1, 1)["in_flight"] for s, v in
            (("1f1b", 1), ("interleaved-zb", 1), ("zbv", 2), ("dualpipev", 2))}
    assert sims["1f1b"] == [[4], [3], [2], [1]]
    assert sims["interleaved-zb"][0] == [4] and max(sum(r) for r in sims["interleaved-zb"]) == 4
    assert [sum(r) for r in sims["zbv"]] == [8] * 4
    assert [sum(r) for r in sims["dualpipev"]] == [9] * 4
    counts = sims["zbv"][0]
    assert forwards_in_flight("zbv", 4, 2, 16, 0) == [0] * counts[0] + [1] * counts[1]
    # the existing schedules keep their own formulas
    assert forwards_in_flight("1f1b", 4, 1, 16, 1) == [0] * 3


# ----------------------------------------------------------------------------------- the planner

def _request(**changes) -> PlanRequest:
    base = dict(model=PlannedModel("gpt2-355m", MODEL_PRESETS["gpt2-355m"]), gpu=gpu_preset("h100"), gpus=8,
                global_batch=64, pipeline=4)
    return PlanRequest(**{**base, **changes})


def test_the_v_holds_each_parameter_once_with_both_ends_on_rank_0():
    """GPT ties its output layer to the word embedding: loop placement keeps a copy on the last rank, the V keeps
    one embedding on rank 0 for both uses, so the ranks' parameters add up to the model's exactly."""
    cfg = MODEL_PRESETS["gpt2-355m"]
    layers = pipeline_layers(cfg.num_layers, 4, 2)
    ranks = [rank_stages(layers, 4, r, v_shaped=True) for r in range(4)]
    assert ranks[0].first and ranks[0].last and not any(r.first or r.last for r in ranks[1:])
    assert ranks[1].layer_indices == (*layers[1], *layers[6])
    assert sum(rank_parameter_count(cfg, 1, r).total for r in ranks) == parameter_count(cfg, 1).total
    loop = [rank_stages(layers, 4, r) for r in range(4)]
    embedding = cfg.padded_vocab_size(1) * cfg.hidden_size
    assert sum(rank_parameter_count(cfg, 1, r).total for r in loop) == parameter_count(cfg, 1).total + embedding


def test_planned_zero_bubble_layouts_use_the_replay():
    for schedule in ("interleaved-zb", "zbv", "dualpipev"):
        result = plan(_request(schedule=schedule, micro_batch=4))
        row = next(r for r in result.rows if r.tp == 1)
        layout = row.choice.layout
        assert layout.schedule == schedule and (layout.virtual == 2 or schedule == "interleaved-zb")
        m = row.choice.accumulation
        bubble = simulate(schedule, 4, layout.virtual, m, 1, 1, 1)["bubble"]
        assert row.choice.time.bubble_s > 0 and row.choice.time.bubble_s / bubble == pytest.approx(
            row.choice.time.compute_s + row.choice.time.elementwise_s + row.choice.time.tp_comm_s, rel=1e-9)
        if schedule != "interleaved-zb":  # rank 0's row: the embedding, 2 x 3 layers, final norm, no tied copy
            stages = rank_stages(pipeline_layers(24, 4, 2), 4, 0, v_shaped=True)
            assert row.params == rank_parameter_count(MODEL_PRESETS["gpt2-355m"], 1, stages)


@pytest.mark.parametrize("changes,message", [
    (dict(schedule="zbv", virtual_stages=3), "exactly 2 stages a rank"),
    (dict(schedule="dualpipev", virtual_stages=1), "exactly 2 stages a rank"),
    (dict(schedule="zbv", pipeline=16, gpus=16), "more than the model's 24 layers"),
    (dict(schedule="dualpipev", gpus=4, global_batch=4), "dualpipev needs at least 2P = 8 micro-batches, got 4"),
])
def test_invalid_combinations_say_why_in_one_line(changes, message):
    with pytest.raises(UserError, match=message) as error:
        plan(_request(**changes))
    assert "\n" not in str(error.value)


def test_pytorchs_own_refusals_become_reasons():
    assert "multiple of the number of rounds" in schedule_invalid_reason("interleaved-zb", 4, 3, 11)
    assert schedule_invalid_reason("zbv", 4, 2, 2) is None  # ZB-V runs fewer micro-batches than stages
    with pytest.raises(UserError, match="2P = 8"):
        simulate("dualpipev", 4, 2, 6, 1, 1, 1)


def test_cli_offers_every_schedule_and_prints_the_v(capsys):
    assert plan_cli.SCHEDULES == SCHEDULES
    assert main(["plan", "--model", "gpt2-355m", "--gpus", "8", "--gpu", "h100", "--global-batch", "64",
                 "--pipeline", "4", "--schedule", "dualpipev", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {row["schedule"] for row in out["layouts"]} == {"dualpipev"}
    assert any("zero-bubble" in line for line in out["assumptions"])
