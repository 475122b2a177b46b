"""Stopping the way schedulers and users do: SIGTERM and Ctrl-C to the `--nproc-per-node 2` launcher end
with one line and exit codes 143 / 130; the SIGTERM checkpoint resumes bitwise; half parameters need a named
half precision (the precision each CPU kind gets is tests/test_cpu_kinds.py's).

The runs train `test_fault_tolerance`'s small-vocabulary tiny model; the launches the signals go to are real
(`--nproc-per-node 2`: the launcher and its torchrun workers), the uninterrupted reference is the same command on
workers forked from the preloaded fork server (`train_on_workers`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_fault_tolerance import train_on_workers, write_small_vocab_config

from shardlm.checkpoint import files
from shardlm.cli import main
from shardlm.training import launcher

ROOT = Path(__file__).resolve().parents[1]
STEPS = 60  # every run has the same schedule; the signals come after 2 steps, long before the end (a step of the
# small-vocabulary model takes milliseconds)
TWO_WORKERS = ["--nproc-per-node", "2"]  # the tiny config is TP=2


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, data_dir):
    return write_small_vocab_config(tmp_path_factory.mktemp("signals"), data_dir)


def start(log: Path, *args) -> subprocess.Popen:
    """`python -m shardlm ARGS` with stdout and stderr together in `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "shardlm", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


def stop_lines(log: Path) -> list[str]:
    """The output lines that are not progress (the start-up line, step lines, periodic saves)."""
    progress = re.compile(r"^(step +\d+/|shardlm: [\d.]+M parameters|resumed from |saved checkpoint )")
    return [line for line in log.read_text().splitlines() if line.strip() and not progress.match(line)]


def checkpoint_folders(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir())


@pytest.fixture(scope="module")
def runs(config_file, tmp_path_factory):
    """Three 2-worker runs of the same STEPS-step schedule: `reference` uninterrupted (on forked workers);
    `stopped` SIGTERMed after 2 steps; then `resumed` from its checkpoint (saving every step), Ctrl-C'd 2 steps
    after resuming.
    With FSDP at DP=2, whose SIGTERM save gathers the sharded state (a TP=2 run's save is the same call on
    unsharded state; its bitwise resume is tests/test_resume_layouts.py's)."""
    folder = tmp_path_factory.mktemp("signals")
    layout = ["parallel.tensor=1", "train.data_sharding=full"]
    command = [str(config_file), f"train.steps={STEPS}", *layout, "train.timeout_s=60"]
    common = ["train", *command, *TWO_WORKERS]
    run_dir, checkpoints = folder / "run", folder / "run" / "checkpoints"
    train_on_workers(2, *command, "--run-dir", str(folder / "reference"))
    launched = []
    try:
        stopped = start(folder / "stopped.log", *common, "--run-dir", str(run_dir))
        launched.append(stopped)
        wait_for(lambda: len(losses(run_dir)) >= 2 or stopped.poll() is not None)
        stopped.send_signal(signal.SIGTERM)
        stopped.wait(timeout=120)
        after_sigterm = {"code": stopped.returncode, "latest": files.latest_in(checkpoints),
                         "folders": checkpoint_folders(checkpoints) if checkpoints.is_dir() else []}
        step = files.read_meta(after_sigterm["latest"])["step"] if after_sigterm["latest"] else 0
        resumed = start(folder / "resumed.log", *common, "checkpoint.save_interval=1", "checkpoint.keep_last=100",
                        "--run-dir", str(run_dir))
        launched.append(resumed)
        wait_for(lambda: max(losses(run_dir), default=0) >= step + 2 or resumed.poll() is not None)
        resumed.send_signal(signal.SIGINT)
        resumed.wait(timeout=120)
    finally:  # a failed wait leaves no launcher behind (Ctrl-C makes it stop its workers)
        for proc in launched:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    yield {"folder": folder, "run_dir": run_dir, "checkpoints": checkpoints, "step": step,
           "after_sigterm": after_sigterm, "resumed_code": resumed.returncode}


def test_sigterm_to_the_launcher_saves_and_exits_143_with_one_line(runs):
    log, after = runs["folder"] / "stopped.log", runs["after_sigterm"]
    assert after["code"] == 143, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    (line,) = stop_lines(log)
    match = re.fullmatch(r"SIGTERM: saving at step (\d+) and stopping; saved checkpoint (.+)", line)
    assert match, line
    assert Path(match[2]) == after["latest"] and int(match[1]) == runs["step"]
    assert 2 <= runs["step"] < STEPS - 2
    assert after["folders"] == ["latest", after["latest"].name]


def test_the_sigterm_checkpoint_resumes_bitwise_like_the_uninterrupted_run(runs):
    """The resumed run's losses after the checkpoint equal the uninterrupted run's at the same steps, exactly."""
    step = runs["step"]
    assert f"at step {step}" in (runs["folder"] / "resumed.log").read_text()
    expected, got = losses(runs["folder"] / "reference"), losses(runs["run_dir"])
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert sorted(got) == list(range(1, max(got) + 1)) and max(got) >= step + 2
    assert [got[s] for s in range(1, max(got) + 1)] == [expected[s] for s in range(1, max(got) + 1)]


def test_ctrl_c_to_the_launcher_exits_130_with_one_line_and_no_partial_checkpoint(runs):
    """Ctrl-C to the resumed run, which saves every step: one line naming the step and `latest`, exit 130,
    and every checkpoint folder left behind complete."""
    log, checkpoints = runs["folder"] / "resumed.log", runs["checkpoints"]
    assert runs["resumed_code"] == 130, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    (line,) = stop_lines(log)
    match = re.fullmatch(r"shardlm: interrupted at step (\d+); last checkpoint: step (\d+) \((.+)\)", line)
    assert match, line
    latest = files.latest_in(checkpoints)
    assert int(match[1]) == max(losses(runs["run_dir"])) and Path(match[3]) == latest
    assert int(match[1]) >= int(match[2]) == files.read_meta(latest)["step"] >= runs["step"]
    folders = [name for name in checkpoint_folders(checkpoints) if name != "latest"]
    assert folders and all(name.startswith("step_") for name in folders), folders  # no .tmp-* left
    for name in folders:
        meta = files.read_meta(checkpoints / name)
        files.verify(checkpoints / name, meta, list(meta["files"]))


def test_ctrl_c_in_the_middle_of_a_save_leaves_no_partial_folder_and_latest_unchanged(config_file, tmp_path,
                                                                                      monkeypatch, capsys):
    """A real SIGINT once the step-2 checkpoint is written but not yet published (one process, in this one)."""
    publish = files.publish

    def interrupted_publish(tmp_dir, final_dir, keep_last):
        if final_dir.name == files.step_name(2):
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises KeyboardInterrupt on the next line
        publish(tmp_dir, final_dir, keep_last)

    monkeypatch.setattr(files, "publish", interrupted_publish)
    checkpoints = tmp_path / "run" / "checkpoints"
    with pytest.raises(SystemExit) as stop:
        main(["train", str(config_file), "parallel.tensor=1", "train.steps=4", "checkpoint.save_interval=1",
              "--run-dir", str(tmp_path / "run")])
    assert stop.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"shardlm: interrupted at step 2; last checkpoint: step 1 ({checkpoints / files.step_name(1)})")
    assert checkpoint_folders(checkpoints) == ["latest", files.step_name(1)]
    assert files.latest_in(checkpoints) == checkpoints / files.step_name(1)


def test_workers_killed_after_the_grace_period_are_reported_in_one_line(tmp_path, capsys):
    """The launcher's verdict when the grace period ran out and the workers said nothing."""
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / ".tmp-step_00000009").mkdir(parents=True)
    report = tmp_path / "report.txt"
    report.write_text("")
    stop = launcher.LauncherSignals()
    stop.signum, stop.received_at = signal.SIGTERM, time.monotonic() - 2
    assert launcher.stopped(stop, 1, checkpoints, report) == 143
    assert capsys.readouterr().err.splitlines() == [
        "shardlm: SIGTERM: the workers did not save within --shutdown-timeout=1s and were killed; "
        "last checkpoint: none"]
    assert not (checkpoints / ".tmp-step_00000009").exists()
    report.write_text("SIGTERM: saving at step 9 and stopping; saved checkpoint x\n")  # the workers spoke
    assert launcher.stopped(stop, 1, checkpoints, report) == 143
    assert capsys.readouterr().err == ""


def test_shutdown_timeout_reaches_torchrun():
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(launcher.torchrun_args(["-m", "shardlm", "train", "c.toml"], 7))
    assert args.shutdown_timeout == 7 and "SIGTERM" not in args.signals_to_handle


def handles_sigterm(pid: int) -> bool:
    """Whether process `pid` has installed a SIGTERM handler (bit 15 of SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def test_sigterm_to_a_one_worker_generate_exits_143_with_one_line(runs, tmp_path):
    checkpoint = files.latest_in(runs["checkpoints"])
    log = tmp_path / "generate.log"
    prompts = tmp_path / "prompts.txt"  # a batch large enough that generating it outlasts the signal's delivery
    prompts.write_text("To be\n" * 4000)  # (one prompt's 30 tokens took less time than that on a quiet machine)
    proc = start(log, "generate", "--checkpoint", str(checkpoint), "--tensor-parallel", "1", "--prompt-file",
                 str(prompts), "--max-new-tokens", "100000", "--ignore-eod")
    try:
        wait_for(lambda: proc.poll() is not None or handles_sigterm(proc.pid), timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert log.read_text().splitlines() == ["shardlm: stopped by SIGTERM"]


def test_half_parameters_need_a_named_half_precision_not_auto():
    """Half parameter storage is in the run's half precision, which "auto" leaves open until the device is known."""
    from shardlm.config import from_dict
    from shardlm.errors import UserError
    from shardlm.validation import validate

    with pytest.raises(UserError, match=r'train.param_dtype="half" stores parameters in train.precision \(here '
                                        r'"auto"\); set train.precision to "bf16" or "fp16"'):
        validate(from_dict({"train": {"param_dtype": "half"}, "data": {"text_file": "x"}}), 1, check_paths=False)
    validate(from_dict({"train": {"param_dtype": "half", "precision": "bf16"}, "data": {"text_file": "x"}}), 1,
             check_paths=False)
