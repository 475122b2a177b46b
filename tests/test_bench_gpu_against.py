"""`python -m shardlm.bench.gpu --against REV` (shardlm/bench/gpu_against.py) on the CPU's smoke shape, its pieces on
fabricated rows, and the prepared GPU check's summary (scripts/gpu_summary.py) on fabricated logs."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
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


@pytest.mark.bench  # two benches of a git tree side by side: `make test-bench`
def test_side_by_side_against_head_tags_each_run_and_summarizes_the_rounds(tmp_path):
    """Against HEAD (the same code): 2 rounds in ABBA order, each run tagged; the summary's ratio is the median of
    the per-round ratios of step times; the profiled step's operators have the same call counts in both trees;
    the extracted tree is removed."""
    proc = bench([*SMOKE, "--against", "HEAD", "--rounds", "2", "--profile", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    runs = [line for line in lines if "step_s" in line and "tree" in line]
    assert [(run["tree"], run["round"]) for run in runs] == [("rev", 0), ("work", 0), ("work", 1), ("rev", 1)]
    assert all(run["shape"] == "smoke" and run["micro_batch"] == 2 and run["wall_s"] > 0 for run in runs)
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


def test_a_terminated_comparison_summarizes_its_complete_rounds_and_removes_the_tree(tmp_path, monkeypatch, capsys):
    """SIGTERM (what `timeout` sends) during round 1: the summary of round 0, marked incomplete, exit code 130, the
    extracted tree removed. The runs are faked in this process (each real one is a process of its own, as the test
    above runs them), the signal is real: what it checks is `compare`'s handling."""
    import tempfile

    from shardlm.bench import gpu_against

    calls = []

    def fake_run(root, argv, label):
        calls.append(label)
        if len(calls) == 3:  # rev and work of round 0 done; work of round 1 is interrupted
            os.kill(os.getpid(), signal.SIGTERM)
        return [{"shape": "smoke", "step_s": float(len(calls)), "tokens_per_sec": 1.0}]

    monkeypatch.setattr(gpu_against, "run_tree", fake_run)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parser = build_parser()
    args = parser.parse_args([*SMOKE, "--against", "HEAD", "--rounds", "8"])
    previous = signal.getsignal(signal.SIGTERM)
    assert gpu_against.compare(args, parser) == 130
    assert signal.getsignal(signal.SIGTERM) == previous  # restored
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["tree"], line["round"]) for line in lines if "tree" in line] == [("rev", 0), ("work", 0)]
    summary = lines[-1]
    assert summary["summary"] == "side_by_side" and summary["complete"] is False and summary["rounds"] == 1
    assert summary["ratio"] == pytest.approx(1.0 / 2.0)
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


CHECK = ROOT / "scripts" / "gpu_check.sh"


def step_commands(script: str) -> dict[str, str]:
    """`gpu_check.sh`'s `step NAME LIMIT COMMAND...` lines, continuation lines joined: {NAME: "LIMIT COMMAND..."}."""
    joined = re.sub(r"\\\n\s*", "", script)
    return {m[1]: m[2] for m in re.finditer(r"^\s*step (\S+) (\d+ .*)$", joined, re.MULTILINE)}


def test_gpu_check_parses_fits_eight_minutes_and_names_its_baseline_once():
    assert subprocess.run(["bash", "-n", str(CHECK)], capture_output=True).returncode == 0
    script = CHECK.read_text()
    steps = step_commands(script)
    assert list(steps)[:5] == ["env", "staged_backend", "against_xl", "test_cuda", "train_nccl"]
    budget = int(re.search(r"^BUDGET=(\d+)", script, re.MULTILINE)[1])
    fixed = sum(int(command.split()[0]) for name, command in steps.items() if name != "bench_other")
    fixed += 2 * int(steps['"train_$cfg"'].split()[0])  # the family loop runs three configs
    assert fixed <= budget and budget + 3 + 10 < 8 * 60
    compile(re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.DOTALL)[1], "env step", "exec")  # the env step's Python
    [baseline] = re.findall(r"^AGAINST=(\w+)", script, re.MULTILINE)
    assert script.count(baseline) == 1
    # the side-by-side step's options are bench.gpu's
    best = re.search(r'^best="([^"]*)"', script, re.MULTILINE)[1]
    command = steps["against_xl"].replace("$best", best).replace('"$against"', baseline)
    args = build_parser().parse_args(shlex.split(command.split("shardlm.bench.gpu", 1)[1]))
    assert args.against == baseline and args.profile > 0 and args.rounds % 2 == 0
    assert (args.compile, args.micro_batch, args.global_batch, args.param_dtype) == (True, 16, 64, "half")


def test_gpu_summary_gathers_fabricated_logs(tmp_path):
    """A check's logs as gpu_check.sh leaves them, one step killed mid-line and one skipped, into summary.json."""
    figure = {"shape": "gpt2-1.5b", "micro_batch": 16, "global_batch": 64, "param_dtype": "half", "compile": True,
              "step_s": 1.4, "tokens_per_sec": 46811.4, "tflops": 480.0, "mfu": 0.485, "peak_memory_gb": 71.6}
    side = {"shape": "gpt2-1.5b", "summary": "side_by_side", "against": "46f234c535", "rounds": 2, "ratio": 0.957,
            "ratio_min": 0.95, "ratio_max": 0.964, "rev": {"step_s": 1.375}, "work": {"step_s": 1.436}}
    diff = {"shape": "gpt2-1.5b", "diff": "copy_kernel", "calls_rev": 10, "calls_work": 400, "ms_rev": 1.0,
            "ms_work": 60.0, "ms_diff": 59.0}
    runs = [{**figure, "tree": tree, "round": r, "wall_s": 30.0} for r, tree in enumerate(("rev", "work"))]
    logs = {
        "env": [{"env": True, "gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9",
                 "gemm_bf16_tflops": 787.0}],
        "staged_backend": "..F.s.\nFAILED tests/test_staged_backend.py::test_two[cp2 oss] - in 3s\n"
                          "6 passed, 1 failed, 1 skipped, 2 warnings in 48.21s\n",
        "against_xl": [*runs, {"shape": "gpt2-1.5b", "diff_count": 1, "shown": 1}, diff, side],
        "test_cuda": "....\n4 passed in 12.31s\n",
        "train_nccl": "step     10/40 | loss 9.1000 | lr 1e-4 | 170000 tokens/s | 20 TFLOP/s/device\n"
                      "step     40/40 | loss 6.2500 | lr 6e-5 | grad norm 1.0 | 175000 tokens/s | 21 TFLOP/s/device\n"
                      "saved checkpoint /tmp/x/step_00000040\nfinal validation loss 6.1000 | perplexity 445.86\n",
        "train_tiny-moe-deepseek": "step      1/20 | loss 10.8715 | aux loss 0.004 | 1869 tokens/s | 0.1 TFLOP/s\n",
        "bench_other": [figure, {"shape": "gpt2-774m", "error": "out of memory at this micro-batch"}],
    }
    for name, content in logs.items():
        text = content if isinstance(content, str) else "".join(json.dumps(row) + "\n" for row in content)
        (tmp_path / f"{name}.log").write_text(text + ('{"shape": "gpt2-' if name == "bench_other" else ""))
    (tmp_path / "steps.tsv").write_text("env\t0\t9\t30\nstaged_backend\t1\t50\t80\nagainst_xl\t0\t150\t180\n"
                                        "test_cuda\t0\t20\t40\ntrain_nccl\t0\t25\t45\n"
                                        "train_tiny-moe-deepseek\t124\t25\t25\ntrain_tiny-gpt-oss\tskipped\t0\t0\n"
                                        "bench_other\t124\t90\t90\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["env"] == {k: v for k, v in logs["env"][0].items() if k != "env"}
    steps = {step["step"]: step for step in summary["steps"]}
    assert list(steps) == ["env", "staged_backend", "against_xl", "test_cuda", "train_nccl", "train_tiny-moe-deepseek",
                           "train_tiny-gpt-oss", "bench_other"]
    assert steps["staged_backend"]["tests"] == {"passed": 6, "failed": 1, "skipped": 1, "errors": 0}
    assert (steps["staged_backend"]["exit"], steps["staged_backend"]["seconds"]) == (1, 50)
    assert steps["test_cuda"]["tests"]["passed"] == 4 and "tests" not in steps["against_xl"]
    assert steps["train_nccl"]["train"] == {"last_step": 40, "steps": 40, "last_loss": 6.25, "tokens_per_sec": 175000,
                                            "final_val_loss": 6.1, "checkpoint_saved": True}
    assert steps["train_tiny-moe-deepseek"]["train"] == {"last_step": 1, "steps": 20, "last_loss": 10.8715,
                                                         "tokens_per_sec": 1869, "final_val_loss": None,
                                                         "checkpoint_saved": False}
    assert steps["train_tiny-gpt-oss"]["exit"] == "skipped" and steps["bench_other"]["exit"] == 124
    assert summary["side_by_side"] == [{"step": "against_xl", **side}]
    assert [(run["tree"], run["round"], run["wall_s"]) for run in summary["side_by_side_runs"]] == [
        ("rev", 0, 30.0), ("work", 1, 30.0)]
    assert summary["operator_diff"][1] == diff and summary["operator_diff"][0]["diff_count"] == 1
    assert summary["bench"] == [{"step": "bench_other", **figure},
                                {"step": "bench_other", "shape": "gpt2-774m", "error": logs["bench_other"][1]["error"]}]
    assert summary["seconds"] == 9 + 50 + 150 + 20 + 25 + 25 + 90
