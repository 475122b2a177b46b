"""`python -m shardlm.bench.gpu --against REV` (shardlm/bench/gpu_against.py) on the CPU's smoke shape, its pieces on
fabricated rows, and the prepared GPU check's summary (scripts/gpu_summary.py) on fabricated logs."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from shardlm.bench.gpu import build_parser
from shardlm.bench.gpu_against import bench_argv, operator_diff, summaries

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--device", "cpu", "--shapes", "smoke", "--steps", "1", "--micro-batch", "2"]


def bench(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """`python -m shardlm.bench.gpu ARGS` with its temporary folders under `tmp`."""
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shardlm.bench.gpu", *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=env)


def test_side_by_side_against_head_tags_each_run_and_summarizes_the_rounds(tmp_path):
    """Against HEAD (the same code): 2 rounds in ABBA order, each run tagged; the summary's ratio is the median of
    the per-round ratios of step times; the profiled step's operators have the same call counts in both trees;
    the extracted tree is removed."""
    proc = bench([*SMOKE, "--against", "HEAD", "--rounds", "2", "--profile", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    runs = [line for line in lines if "step_s" in line and "tree" in line]
    assert [(run["tree"], run["round"]) for run in runs] == [("rev", 0), ("work", 0), ("work", 1), ("rev", 1)]
    assert all(run["shape"] == "smoke" and run["micro_batch"] == 2 for run in runs)
    step = {(run["tree"], run["round"]): run["step_s"] for run in runs}
    ratios = [step["rev", r] / step["work", r] for r in (0, 1)]
    [summary] = [line for line in lines if line.get("summary") == "side_by_side"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    assert summary["against"] == head.strip()[:10] and summary["rounds"] == 2 and summary["complete"] is True
    assert summary["ratio"] == pytest.approx(statistics.median(ratios))
    assert (summary["ratio_min"], summary["ratio_max"]) == pytest.approx((min(ratios), max(ratios)))
    for tree in ("rev", "work"):
        assert summary[tree]["step_s"] == pytest.approx(statistics.median([step[tree, r] for r in (0, 1)]))
        assert summary[tree]["tokens_per_sec"] > 0
    [diff] = [line for line in lines if "diff_count" in line]
    assert diff["ms_rev"] > 0 and diff["ms_work"] > 0
    assert diff["diff_count"] <= 1, [line for line in lines if "diff" in line]
    assert len([line for line in lines if line.get("profile") == "total"]) == 2
    assert not list(tmp_path.glob("shardlm-against-*"))


def test_an_unknown_revision_is_one_line(tmp_path):
    proc = bench([*SMOKE, "--against", "no-such-revision"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "no-such-revision" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("shardlm-against-*"))


def test_a_revision_whose_bench_lacks_an_option_is_one_line(tmp_path):
    """46f234c added --param-dtype: its parent's bench.gpu refuses it, in one line, and its tree is removed."""
    old = "46f234c^"
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", old], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("no git history here")
    proc = bench([*SMOKE, "--against", old, "--param-dtype", "half"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and "--param-dtype" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("shardlm-against-*"))


def test_each_run_gets_the_shapes_and_the_options_that_differ_from_their_defaults():
    parser = build_parser()
    args = parser.parse_args(["--shapes", "smoke", "--against", "HEAD", "--rounds", "4", "--compile", "--profile",
                              "3", "--micro-batch", "16", "--param-dtype", "half"])
    assert bench_argv(args, parser) == ["--shapes", "smoke", "--micro-batch", "16", "--compile",
                                        "--param-dtype", "half"]


def test_operator_diff_lists_the_operators_whose_calls_differ_largest_time_difference_first():
    rev = [{"op": "copy", "calls": 10, "ms": 5.0}, {"op": "gemm", "calls": 4, "ms": 50.0},
           {"op": "add", "calls": 2, "ms": 1.0}, {"op": "gone", "calls": 1, "ms": 0.5}]
    work = [{"op": "copy", "calls": 14, "ms": 7.0}, {"op": "copy", "calls": 2, "ms": 1.0},  # a truncated-name twin
            {"op": "gemm", "calls": 4, "ms": 60.0}, {"op": "add", "calls": 3, "ms": 0.9}]
    diff = operator_diff(rev, work)
    assert [row["diff"] for row in diff] == ["copy", "gone", "add"]  # gemm: same calls, slower, not listed
    assert diff[0] == {"diff": "copy", "calls_rev": 10, "calls_work": 16, "ms_rev": 5.0, "ms_work": 8.0,
                       "ms_diff": 3.0}
    assert (diff[1]["calls_work"], diff[1]["ms_diff"]) == (0, -0.5)


def test_summaries_pair_rounds_and_keep_an_interrupted_comparison():
    """Round 1 of the working tree ran, REV's did not (interrupted): one ratio, from round 0."""
    def row(step_s):
        return {"shape": "s", "step_s": step_s, "tokens_per_sec": 1 / step_s, "mfu": 0.5, "peak_memory_gb": 9.0}

    runs = [("rev", 0, [row(1.1)]), ("work", 0, [row(1.0)]), ("work", 1, [row(0.9)])]
    [line] = summaries(runs, "abc", complete=False)
    assert line["ratios"] == pytest.approx([1.1]) and line["rounds"] == 1 and line["complete"] is False
    assert line["work"]["mfu"] == 0.5 and line["rev"]["peak_memory_gb"] == 9.0
