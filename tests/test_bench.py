"""`make bench`'s harness end to end on tiny shapes (`--quick`): every section runs, the documented
keys of benchmarks.json are there, and BENCHMARKS.md is written from them. Speed itself is never
asserted here: figures are measured by `make bench`, not by tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardlm.bench.report import KEYS

# The quick run starts a world of 2 or 4 processes for several sections: minutes on a busy 2-core machine.
pytestmark = pytest.mark.timeout(700)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    return proc, out


def test_every_section_runs(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "benchmarks.json").read_text())
    assert results["errors"] == {}
    assert results["quick"] is True


@pytest.mark.parametrize("key", list(KEYS))
def test_documented_key_present(quick_run, key):
    results = json.loads((quick_run[1] / "benchmarks.json").read_text())
    value = results
    for part in key.split("."):
        assert part in value, f"benchmarks.json lacks {key}"
        value = value[part]


def test_markdown_names_the_headline_figures(quick_run):
    text = (quick_run[1] / "BENCHMARKS.md").read_text()
    for figure in ("`train_vs_hf.ratio`", "`train_vs_hf.ratio_same_kernels`", "`tp2_efficiency.shardlm`",
                   "`comm.matches_formula`", "(`memory`)", "(`mfu`)", "## Keys of `benchmarks.json`"):
        assert figure in text
    assert "not measured" not in text
    assert not list(quick_run[1].glob(".*.tmp")), "a temporary report file was left behind"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_benchmark_harness_runs_on_cpu(compiled):
    """`make bench-gpu`'s code path (real trainer step, bf16 autocast, per-layer torch.compile) on the
    smoke shape, so the GPU benchmark cannot rot on machines without a GPU."""
    import torch

    from shardlm.training.trainer import can_compile

    if compiled and not can_compile(torch.device("cpu")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    args = ["--device", "cpu", "--shapes", "smoke", "--steps", "1", "--micro-batch", "2"]
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench.gpu", *args, *(["--compile"] if compiled else [])],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == "smoke" and result["compile"] is compiled
    # wte 512x64 + wpe 128x64 + 2 layers x (12h^2 + 13h) + final LayerNorm 2h, h = 64
    assert result["parameters"] == 512 * 64 + 128 * 64 + 2 * (12 * 64**2 + 13 * 64) + 128
    assert result["tokens_per_sec"] > 0


def test_gpu_benchmark_accumulation_half_parameters_and_profile_on_cpu():
    """`--global-batch`, `--param-dtype half` and `--profile` of the GPU benchmark, on the smoke shape."""
    args = ["--device", "cpu", "--shapes", "smoke", "--steps", "1", "--micro-batch", "2", "--global-batch", "4",
            "--param-dtype", "half", "--profile", "3"]
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench.gpu", *args], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    result, total, *ops = lines
    assert result["global_batch"] == 4 and result["param_dtype"] == "half"
    assert result["tokens_per_sec"] == pytest.approx(4 * 128 / result["step_s"])
    assert total["profile"] == "total" and 0.0 <= total["outside_gemm_attention"] <= 1.0
    assert len(ops) == 3 and all(op["ms"] > 0 and op["calls"] >= 1 for op in ops)
    assert sorted((op["ms"] for op in ops), reverse=True) == [op["ms"] for op in ops]


def test_interleaved_changes_which_program_runs_before_which():
    """Every program runs once per round, and not always right after the same other one."""
    from shardlm.bench.common import interleaved

    calls: list[str] = []
    programs = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    times = interleaved(programs, repeats=7, warmup=1)
    assert {name: len(ts) for name, ts in times.items()} == {name: 7 for name in "abcde"}
    rounds = [calls[i:i + 5] for i in range(0, len(calls), 5)]
    assert all(sorted(r) == list("abcde") for r in rounds)
    timed = calls[4:]  # the last warm-up call precedes the first timed one
    for name in "abcde":
        before = [timed[i - 1] for i in range(1, len(timed)) if timed[i] == name]
        most = max(before.count(other) for other in set(before))
        assert most <= len(before) // 2, f"{name} ran right after the same program in {most} of {len(before)} rounds"
