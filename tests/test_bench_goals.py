"""BENCHMARKS.md's speed goals (`shardlm.bench.goals`): every goal row reads the figure it names, is met exactly
when that figure reaches its target, and a missed one says why from the run's own numbers. Also the operator
breakdown (`shardlm.bench.breakdown`) that those reasons quote."""

from __future__ import annotations

import pytest
import torch

from shardlm.bench.breakdown import breakdown, kind_of, why_not_faster
from shardlm.bench.common import cpu_features
from shardlm.bench.goals import markdown_lines, speed_goals


def _figure(median: float) -> dict:
    return {"median": median, "min": median, "max": median, "values": [median]}


def _family(fp32: float, bf16: float) -> dict:
    steps = {"shardlm": {"gemm": 300.0, "attention": 40.0, "triangular_solve": 0.0, "optimizer": 20.0,
                         "other": 140.0, "total": 500.0},
             "hf": {"gemm": 300.0, "attention": 50.0, "triangular_solve": 0.0, "optimizer": 20.0, "other": 180.0,
                    "total": 550.0}}
    return {"precisions": ["fp32", "bf16"], "fp32": {"ratio": _figure(fp32), "breakdown": steps},
            "bf16": {"ratio": _figure(bf16), "breakdown": steps}}


def _results(amx: bool) -> dict:
    bf16 = {"fraction_of_best": 0.5, "step_gemm_gflops": 400.0, "step_gemm_of_best": 0.6,
            "best_gemm_ceiling_gflops": 640.0, "fraction_of_step_gemms": 0.8,
            "breakdown": {"gemm": 600.0, "attention": 200.0, "optimizer": 30.0, "other": 170.0, "total": 1000.0}}
    return {"train_vs_hf": {"cpu_features": {"amx": amx, "matrix": "AMX" if amx else "AVX-512-BF16"}},
            "mfu": {"by_vocabulary": {"8192": {"fp32": {"fraction_of_best": 0.7}, "bf16": bf16}}},
            "moe": {"single_process": _family(1.25, 1.1)}, "deepseek": _family(1.19, 1.2),
            "linear_attention": {"train_vs_hf": _family(1.0, 1.3)}}


def test_each_goal_reads_its_figure_and_is_met_exactly_at_the_target():
    goals = speed_goals(_results(amx=False))
    rows = {row["key"]: row for row in goals["rows"]}
    assert set(rows) == {"moe.single_process.fp32.ratio", "moe.single_process.bf16.ratio", "deepseek.fp32.ratio",
                         "deepseek.bf16.ratio", "linear_attention.train_vs_hf.fp32.ratio",
                         "linear_attention.train_vs_hf.bf16.ratio", "mfu.by_vocabulary.8192.bf16.fraction_of_best"}
    met = {key: row["met"] for key, row in rows.items()}
    assert met == {"moe.single_process.fp32.ratio": True, "moe.single_process.bf16.ratio": False,
                   "deepseek.fp32.ratio": False, "deepseek.bf16.ratio": True,  # 1.2 itself meets 1.2
                   "linear_attention.train_vs_hf.fp32.ratio": False, "linear_attention.train_vs_hf.bf16.ratio": True,
                   "mfu.by_vocabulary.8192.bf16.fraction_of_best": False}
    assert goals["missed"] == 4
    assert all((row["why"] is None) == row["met"] for row in goals["rows"])
    assert rows["deepseek.fp32.ratio"]["value"] == 1.19


def test_amx_rows_only_on_amx_and_a_plain_note_elsewhere():
    plain, amx = speed_goals(_results(amx=False)), speed_goals(_results(amx=True))
    assert not any(row["goal"].startswith("AMX") for row in plain["rows"])
    amx_rows = [row for row in amx["rows"] if row["goal"].startswith("AMX")]
    assert [(row["target"], row["met"]) for row in amx_rows] == [(0.60, False)]
    assert "AMX was not measured" in "\n".join(markdown_lines(plain))
    assert "AMX was not measured" not in "\n".join(markdown_lines(amx))


def test_a_missed_goal_says_why_from_the_runs_numbers():
    rows = {row["key"]: row for row in speed_goals(_results(amx=False))["rows"]}
    family = rows["linear_attention.train_vs_hf.fp32.ratio"]["why"]
    # 550 / 1.2 - 300 = 158 ms left for everything but the GEMMs, where shardlm spends 500 - 300 = 200
    assert "158 ms for everything else" in family and "spends 200 ms" in family
    assert "gemm 300 / 300 ms" in family and "other 140 / 180 ms" in family
    dense = rows["mfu.by_vocabulary.8192.bf16.fraction_of_best"]["why"]
    assert "ran at 400 GFLOP/s, 60% of the best square GEMM's rate" in dense
    assert "even a step of nothing but GEMMs would miss 75%" in dense and "at 80% of its own GEMMs' rate" in dense
    assert "attention 200" in dense
    results = _results(amx=False)
    results["mfu"]["by_vocabulary"]["8192"]["bf16"]["step_gemm_of_best"] = 0.9
    rows = {row["key"]: row for row in speed_goals(results)["rows"]}
    assert "GEMMs alone would reach the goal" in rows["mfu.by_vocabulary.8192.bf16.fraction_of_best"]["why"]
    text = "\n".join(markdown_lines(speed_goals(_results(amx=False))))
    assert "| 1.19 | >= 1.2 | **no** |" in text and "**`goals.missed` = 4** of 7." in text


def test_why_not_faster_never_asks_for_negative_time():
    ours = {"gemm": 500.0, "attention": 0.0, "triangular_solve": 0.0, "optimizer": 0.0, "other": 100.0,
            "total": 600.0}
    theirs = {**ours, "total": 580.0}
    assert "leave shardlm 0 ms for everything else, where it spends 100 ms" in why_not_faster(ours, theirs, 1.2)


@pytest.mark.parametrize("name, kind", [("aten::mm", "gemm"), ("aten::_grouped_mm", "gemm"), ("aten::bmm", "gemm"),
                                        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
                                        ("aten::linalg_solve_triangular", "triangular_solve"),
                                        ("aten::_fused_adamw_", "optimizer"), ("aten::mul", "other")])
def test_operator_kinds(name, kind):
    assert kind_of(name) == kind


def test_breakdown_sums_a_real_steps_operators():
    a, b = torch.randn(256, 256), torch.randn(256, 256, requires_grad=True)

    def step():
        (torch.nn.functional.scaled_dot_product_attention(a[None, None], a[None, None], (a @ b)[None, None])
         .relu().sum().backward())

    out = breakdown(step, steps=2)
    assert set(out) == {"gemm", "attention", "triangular_solve", "optimizer", "other", "total"}
    assert out["gemm"] > 0 and out["attention"] > 0 and out["triangular_solve"] == 0 and out["optimizer"] == 0
    assert sum(v for k, v in out.items() if k != "total") <= out["total"] * 1.05  # self times within the wall time


def test_the_reason_scales_each_profile_to_its_timed_step():
    """The profiler costs a program of many small calls more: each breakdown is scaled to its program's timed
    median before the sentence is written."""
    ours = {"gemm": 250.0, "attention": 0.0, "triangular_solve": 0.0, "optimizer": 0.0, "other": 250.0,
            "total": 500.0}  # profiled 500, timed 400: 200 + 200
    theirs = {"gemm": 300.0, "attention": 0.0, "triangular_solve": 0.0, "optimizer": 0.0, "other": 300.0,
              "total": 600.0}  # profiled 600, timed 480
    text = why_not_faster(ours, theirs, 1.2, 400.0, 480.0)
    assert "steps of 400 and 480 ms" in text and "gemm 200 / 240 ms, other 200 / 240 ms" in text
    assert "leave shardlm 200 ms for everything else, where it spends 200 ms" in text  # 480 / 1.2 - 200


def test_a_ratio_just_under_its_goal_shows_a_third_decimal_and_amx_is_read_from_any_section():
    results = _results(amx=True)
    results["deepseek"]["fp32"]["ratio"] = _figure(1.1997)
    results["moe"]["single_process"]["cpu_features"] = results.pop("train_vs_hf")["cpu_features"]
    goals = speed_goals(results)
    assert goals["amx"] is True
    text = "\n".join(markdown_lines(goals))
    assert "| 1.200 | >= 1.2 | **no** |" in text and "AMX was not measured" not in text


def test_the_goals_follow_the_cpu_kind_the_run_measured(cpu_kind):
    """With the features `cpu_features` reads on each CPU kind: the AMX goal row exactly on AMX, elsewhere one line
    naming the kind's matrix unit (a line, not a failed section: the report's "**not measured**")."""
    results = _results(amx=False)
    features = results["train_vs_hf"]["cpu_features"] = cpu_features()
    goals = speed_goals(results)
    text = "\n".join(markdown_lines(goals))
    on_amx = cpu_kind == "amx"
    assert goals["amx"] is on_amx and goals["cpu_matrix"] == features["matrix"]
    assert [row["target"] for row in goals["rows"] if row["goal"].startswith("AMX")] == ([0.60] if on_amx else [])
    assert ("AMX was not measured" in text) is not on_amx and "not measured**" not in text
    if not on_amx:
        assert f"this CPU's matrix unit is {features['matrix']}," in text
