"""The bench's harness outside `make bench`'s quick run: `make bench-gpu`'s code path on the CPU (so the GPU benchmark
cannot rot on machines without a GPU) and the interleaved timing rounds that every side-by-side figure uses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_gpu_benchmark_harness_runs_on_cpu():
    """`make bench-gpu`'s code path (real trainer step, bf16 autocast) on the smoke shape, so the GPU benchmark
    cannot rot on machines without a GPU. Its `--compile` is the per-layer `Module.compile` that `train.compile`
    applies (tests/test_compile.py; a minute of CPU compilation here) and `scripts/gpu_check.sh` runs on a GPU."""
    args = ["--device", "cpu", "--shapes", "smoke", "--steps", "1", "--micro-batch", "2"]
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench.gpu", *args], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == "smoke" and result["compile"] is False
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
