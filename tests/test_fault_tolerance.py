"""Stopping and failing mid-run: SIGTERM saves and stops; a killed worker restarts from the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_cli_train import write_tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, data_dir):
    return write_tiny_config(tmp_path_factory.mktemp("fault"), data_dir, plot=False)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start(*args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "shardlm", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, timeout: float = 120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise TimeoutError("condition not reached")


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(config_file, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(str(config_file), "parallel.tensor=1", "train.steps=100000", "--run-dir", str(run_dir))
    wait_for(lambda: len(records(run_dir)) >= 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    step = json.loads((run_dir / "checkpoints" / latest / "meta.json").read_text())["step"]
    assert step >= 2 and "SIGTERM: saving" in out + err
    resumed = start(str(config_file), "parallel.tensor=1", f"train.steps={step + 2}", "--run-dir", str(run_dir))
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err[-2000:]
    assert f"at step {step}" in out + err
    assert records(run_dir)[-2]["step"] == step + 2  # last train record, then the validation record


def loss_curve(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad_norm) of a run's training records; a step logged again after a restart keeps
    its last record."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir) if "loss" in r}


def final_tensors(run_dir: Path, out: Path) -> dict:
    from safetensors.torch import load_file

    from shardlm.checkpoint import consolidate

    return load_file(str(consolidate(run_dir / "checkpoints", out)))


def test_killed_worker_restarts_from_checkpoint_and_finishes_like_an_uninterrupted_run(config_file, tmp_path):
    """torchrun --max-restarts 1 with 2 pipeline stages and dropout 0.1: SIGKILL one worker mid-run; the
    job resumes from its last checkpoint and every step's loss and gradient norm, and every final
    parameter, are bitwise those of an uninterrupted run."""
    common = [str(config_file), "parallel.tensor=1", "parallel.pipeline=2", "model.dropout=0.1", "train.steps=24",
              "checkpoint.save_interval=5", "train.timeout_s=60", "--nproc-per-node", "2"]
    reference = start(*common, "--run-dir", str(tmp_path / "reference"))
    faulty_dir = tmp_path / "faulty"
    faulty = start(*common, "--max-restarts", "1", "--run-dir", str(faulty_dir))
    wait_for(lambda: (faulty_dir / "checkpoints" / "latest").is_file() and len(records(faulty_dir)) >= 12)
    workers = children(faulty.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    out, err = faulty.communicate(timeout=300)
    (tmp_path / "faulty.log").write_text(out + err)
    assert faulty.returncode == 0, err[-3000:]
    assert "resumed from" in out + err
    ref_out, ref_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_err[-3000:]
    curve, expected = loss_curve(faulty_dir), loss_curve(tmp_path / "reference")
    assert sorted(expected) == list(range(1, 25))
    assert curve == expected
    final, ref_final = final_tensors(faulty_dir, tmp_path / "faulty.safetensors"), final_tensors(
        tmp_path / "reference", tmp_path / "reference.safetensors")
    assert final.keys() == ref_final.keys()
    for name, value in ref_final.items():
        assert torch.equal(final[name], value), name


def test_a_failed_save_ends_the_run_with_one_line_and_publishes_nothing(config_file, tmp_path):
    """TP=2 saves step 2, then resumes with a 2 MB file-size limit (`RLIMIT_FSIZE`, as `ulimit -f 2000` sets;
    the model shards are ~10 MB) and trains to step 4, whose save fails on both ranks: the command exits 2 with
    one line on stderr naming the file, the OS error and the last good checkpoint; step 2 and `latest` are
    intact and nothing of step 4 (not even its unfinished folder) is left."""
    import resource

    common = [str(config_file), "checkpoint.save_interval=2", "--nproc-per-node", "2", "--run-dir",
              str(tmp_path / "run")]
    first = start(*common, "train.steps=2")
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    second = subprocess.run([sys.executable, "-m", "shardlm", "train", *common, "train.steps=4"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert second.returncode == 2, second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith("shardlm: error: could not save the checkpoint of step 4: ")
    assert f"{checkpoints}/.tmp-step_00000004/model_tp0" in lines[0] and "[Errno 27] File too large" in lines[0]
    assert f"the last good checkpoint is step 2 ({checkpoints / 'step_00000002'})" in lines[0]
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]
