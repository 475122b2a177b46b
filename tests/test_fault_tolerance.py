"""Stopping and failing mid-run: SIGTERM saves and stops; a killed worker restarts from the checkpoint.

Only the runs a test is about start real processes (`shardlm train --nproc-per-node 2`, its launcher and torchrun
workers: seconds of imports each); the runs they are compared with or start from are `shardlm train` on workers
forked from the preloaded fork server (`train_on_workers`, the same command as torchrun's workers run), and the
one-process SIGTERM run is `shardlm train` in this process, signalled as a scheduler signals it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_cli_train import write_tiny_config

from shardlm.cli import main

from multiproc import run_workers

ROOT = Path(__file__).resolve().parents[1]


def write_small_vocab_config(folder: Path, data_dir: Path) -> Path:
    """`test_cli_train`'s tiny TP=2 config with a 128-token BPE trained on its corpus (`tokenizer.json`) instead of
    GPT-2's 50257 tokens, whose output layer and loss are most of a tiny model's step, and its encoder seconds of
    each process's start."""
    from tokenizers import Tokenizer, models, trainers

    path = write_tiny_config(folder, data_dir, plot=False)
    text = (folder / "corpus.txt").read_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.train_from_iterator([text[i:i + 1000] for i in range(0, len(text), 1000)], trainers.BpeTrainer(
        vocab_size=128, special_tokens=["<|endoftext|>"], show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    data = f'[data]\ntokenizer = "json"\nvocab_file = "{folder / "tokenizer.json"}"\n'
    path.write_text(path.read_text().replace("[data]\n", data))
    return path


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, data_dir):
    """The tiny config with GPT-2's tokenizer: its model shards (~10 MB) outgrow the failed save's file-size limit."""
    return write_tiny_config(tmp_path_factory.mktemp("fault"), data_dir, plot=False)


@pytest.fixture(scope="module")
def small_config(tmp_path_factory, data_dir):
    return write_small_vocab_config(tmp_path_factory.mktemp("fault-small"), data_dir)


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


def train_worker(args: list[str]) -> int:
    """`shardlm train ARGS` on a worker of `run_workers` (torchrun's environment, no process group yet): the exit
    code it would end the worker with."""
    try:
        return main(["train", *args])
    except SystemExit as stop:
        return stop.code


def train_on_workers(world: int, *args) -> None:
    """`shardlm train ARGS` on `world` workers forked from the fork server, as torchrun's workers run it; each must
    exit 0."""
    codes = run_workers(world, train_worker, list(args), init=False, timeout=300)
    assert codes == [0] * world, codes


@contextmanager
def sigterm_once(condition, timeout: float = 120.0):
    """Send this process one SIGTERM, from a thread, once `condition()` holds (or after `timeout`) while the block
    runs. A SIGTERM that finds the block already left is caught here, so it cannot end the test session."""
    done, received = threading.Event(), []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))

    def send():
        deadline = time.time() + timeout
        while not done.is_set() and not condition() and time.time() < deadline:
            time.sleep(0.05)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        done.set()
        sender.join()
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(small_config, tmp_path, capsys):
    """One process (`shardlm train` here) gets SIGTERM after 2 steps: it saves, says so and exits 143; the same
    command resumes from that checkpoint and finishes its steps."""
    run_dir = tmp_path / "run"
    common = ["train", str(small_config), "parallel.tensor=1", "--run-dir", str(run_dir)]
    with sigterm_once(lambda: len(records(run_dir)) >= 2), pytest.raises(SystemExit) as stop:
        main([*common, "train.steps=100000"])
    out, err = capsys.readouterr()
    assert stop.value.code == 143, err[-2000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    step = json.loads((run_dir / "checkpoints" / latest / "meta.json").read_text())["step"]
    assert step >= 2 and "SIGTERM: saving" in out + err
    assert main([*common, f"train.steps={step + 2}"]) == 0
    out, err = capsys.readouterr()
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


KILLED_RUN_STEPS = 60
"""The killed-worker job's steps: SIGKILL comes after step 10, so that even on a busy machine the workers are
still training when it lands (a step of the small-vocabulary model takes milliseconds)."""


def test_killed_worker_restarts_from_checkpoint_and_finishes_like_an_uninterrupted_run(small_config, tmp_path):
    """torchrun --max-restarts 1 with 2 pipeline stages and dropout 0.1: SIGKILL one worker mid-run; the
    job resumes from its last checkpoint and every step's loss and gradient norm, and every final
    parameter, are bitwise those of an uninterrupted run (the same command on 2 forked workers)."""
    common = [str(small_config), "parallel.tensor=1", "parallel.pipeline=2", "model.dropout=0.1",
              f"train.steps={KILLED_RUN_STEPS}", "checkpoint.save_interval=5", "train.timeout_s=60"]
    faulty_dir = tmp_path / "faulty"
    faulty = start(*common, "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", str(faulty_dir))
    wait_for(lambda: (faulty_dir / "checkpoints" / "latest").is_file() and len(records(faulty_dir)) >= 10)
    workers = children(faulty.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    train_on_workers(2, *common, "--run-dir", str(tmp_path / "reference"))  # while the job restarts
    out, err = faulty.communicate(timeout=300)
    (tmp_path / "faulty.log").write_text(out + err)
    assert faulty.returncode == 0, err[-3000:]
    assert "resumed from" in out + err
    curve, expected = loss_curve(faulty_dir), loss_curve(tmp_path / "reference")
    assert sorted(expected) == list(range(1, KILLED_RUN_STEPS + 1))
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

    common = [str(config_file), "checkpoint.save_interval=2", "--run-dir", str(tmp_path / "run")]
    train_on_workers(2, *common, "train.steps=2")

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "shardlm", "train", *common, "train.steps=4", "--nproc-per-node", "2"]
    second = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert second.returncode == 2, second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith("shardlm: error: could not save the checkpoint of step 4: ")
    assert f"{checkpoints}/.tmp-step_00000004/model_tp0" in lines[0] and "[Errno 27] File too large" in lines[0]
    assert f"the last good checkpoint is step 2 ({checkpoints / 'step_00000002'})" in lines[0]
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]
