"""`shardlm train` from the command line: config errors, local launch, two-node launch, timeouts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlm.cli import main

from multiproc import free_port, run_workers

ROOT = Path(__file__).resolve().parents[1]

TINY = """
[model]
num_layers = 2
hidden_size = 32
num_heads = 4
seq_length = 32
dropout = 0.0

[parallel]
tensor = 2

[data]
text_file = "{text}"

[train]
precision = "fp32"
micro_batch_size = 2
global_batch_size = 8
steps = 4
lr = 1e-3
warmup_steps = 1
eval_iters = 2

[log]
interval = 1
progress = false
tensorboard = false
plot = {plot}
"""


def write_tiny_config(folder: Path, data_dir: Path, plot: bool) -> Path:
    """TINY (TP=2) on the first 40 kB of the shared Shakespeare corpus, written into `folder`."""
    text = folder / "corpus.txt"
    text.write_text((data_dir / "corpus" / "tinyshakespeare.txt").read_text()[:40_000])
    path = folder / "tiny.toml"
    path.write_text(TINY.format(text=text, plot=str(plot).lower()))
    return path


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, data_dir):
    return write_tiny_config(tmp_path_factory.mktemp("cli"), data_dir, plot=True)


ERRORS = [
    (["model.num_heads=6", "model.hidden_size=48", "--nproc-per-node", "4", "parallel.tensor=4"],
     "model.num_heads=6 is not divisible by parallel.tensor=4"),
    (["--nproc-per-node", "3"], "world size 3 is not divisible by parallel.tensor=2"),
    (["parallel.pipeline=2", "--nproc-per-node", "2"],
     "world size 2 is not divisible by parallel.tensor x parallel.pipeline = 2 x 2"),
    (["parallel.pipeline=2", "--nproc-per-node", "4", "model.num_layers=1"],
     "model.num_layers=1 cannot fill 2 pipeline stages"),
    (["model.hidden_size=30"], "model.hidden_size=30 is not divisible by model.num_heads=4"),
    (["train.micro_batch_size=4", "train.global_batch_size=6"],
     "train.global_batch_size=6 is not divisible by train.micro_batch_size x data-parallel size = 4 x 1"),
    (["train.lrr=1"], "unknown config key train.lrr"),
    (["optimizer.lr=1"], "unknown config section [optimizer]"),
    (["train.steps=ten"], "train.steps='ten' must be of type int"),
    (["train.activation_checkpointing=1"], "train.activation_checkpointing=1 must be true or false"),
    (["data.text_file=/no/such/file.txt"], "data.text_file=/no/such/file.txt not found"),
    (["data.tokenizer=json"], 'data.vocab_file must be set for data.tokenizer="json"'),
    (["data.vocab_file=/no/vocab.json"], "data.vocab_file: /no/vocab.json not found"),
    (["train.precision=fp8"], 'train.precision="fp8" must be'),
]


@pytest.mark.parametrize("extra,message", ERRORS, ids=[m.split()[0] for _, m in ERRORS])
def test_config_error_is_one_line_exit_2(config_file, capsys, extra, message):
    launch = [] if "--nproc-per-node" in extra else ["--nproc-per-node", "2"]
    code = main(["train", str(config_file), *launch, *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_compile_without_a_cpp_compiler_stops_before_any_output(config_file, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    run_dir = tmp_path / "run"
    code = main(["train", str(config_file), "parallel.tensor=1", "train.compile=true", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "train.compile=true on the CPU needs a C++ compiler" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not run_dir.exists()


def test_missing_and_invalid_config_files(tmp_path, capsys):
    assert main(["train", str(tmp_path / "none.toml")]) == 2
    assert "none.toml not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nnum_layers = 2")
    assert main(["train", str(bad)]) == 2
    assert "is not valid TOML" in capsys.readouterr().err


def read_losses(run_dir: Path) -> list[float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def shardlm(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shardlm", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def single_node_run(config_file, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    result = shardlm("train", str(config_file), "--nproc-per-node", "4", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_local_launch_trains_and_writes_outputs(single_node_run):
    run_dir, result = single_node_run
    losses = read_losses(run_dir)
    assert len(losses) == 4
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec"} <= records[0].keys()
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert "final validation loss" in result.stdout
    assert "TP=2 x DP=2" in result.stderr + result.stdout


def start_agent(node: int, port: int, config_file: Path, run_dir: Path) -> subprocess.Popen:
    """One torchrun agent of a 2-node launch on loopback (2 processes per node), whose rendezvous gives up after
    120 s instead of torchrun's 600."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--rdzv-conf", "timeout=120", "-m", "shardlm", "train", str(config_file),
                             "--run-dir", str(run_dir)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_master_agent(config_file: Path, run_dir: Path) -> tuple[subprocess.Popen, int]:
    """Node 0's agent, once it listens on its port. The port is free when picked but another process (another test
    file's world, or a gloo connection) may take it before the agent binds it; node 1 would then join that stranger
    and wait forever. So node 0 goes first, and a new port is tried when it dies before listening."""
    for _ in range(3):
        port = free_port()
        agent = start_agent(0, port, config_file, run_dir)
        deadline = time.monotonic() + 120
        while agent.poll() is None and time.monotonic() < deadline and not listening(port):
            time.sleep(0.2)
        if agent.poll() is None and listening(port):
            return agent, port
        agent.kill()
        agent.communicate()
    raise AssertionError("node 0's torchrun agent did not listen on a free port in 3 tries")


@pytest.mark.timeout(400)
def test_two_node_launch_on_loopback_matches_single_node(config_file, single_node_run, tmp_path):
    """Two torchrun agents (--nnodes 2, 2 processes each, TP=2 x DP=2) train like one node of 4."""
    run_dir = tmp_path / "two-node"
    master, port = start_master_agent(config_file, run_dir)
    agents = [master, start_agent(1, port, config_file, run_dir)]
    try:
        outputs = [agent.communicate(timeout=240) for agent in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            agent.kill()
        outputs = [agent.communicate() for agent in agents]
        raise AssertionError("the two-node launch hung:\n" + outputs[0][1][-2000:] + outputs[1][1][-2000:]) from None
    assert all(agent.returncode == 0 for agent in agents), outputs[0][1][-2000:] + outputs[1][1][-2000:]
    single = read_losses(single_node_run[0])
    two_node = read_losses(run_dir)
    assert two_node == pytest.approx(single, rel=1e-5)


def hung_peer(timeout_s: float):
    """Rank 1 never joins the collective; rank 0 must fail after about timeout_s, not hang."""
    import torch

    from shardlm.parallel import init_distributed

    ctx = init_distributed(tensor_parallel=2, timeout_s=timeout_s)
    if ctx.rank == 1:
        time.sleep(timeout_s + 6)
        return None
    start = time.perf_counter()
    try:
        ctx.tp.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        return time.perf_counter() - start, str(exc)
    return time.perf_counter() - start, "no error"


def test_collective_timeout_ends_a_hung_run():
    elapsed, message = run_workers(2, hung_peer, 3.0, init=False, timeout=60)[0]
    assert message != "no error"
    assert elapsed < 15
    from shardlm.training.cli import is_timeout

    assert is_timeout(RuntimeError(message)), message


@pytest.mark.parametrize("name,world,accumulation", [("gpt2-355m", 64, 1), ("gpt2-2.5b", 128, 1),
                                                     ("gpt2-8.3b", 512, 1), ("tiny", 1, 2)])
def test_shipped_configs_are_valid_for_their_layout(name, world, accumulation):
    from shardlm.config import load_config
    from shardlm.validation import validate

    config = load_config(ROOT / "configs" / f"{name}.toml")
    assert validate(config, world, check_paths=False) == accumulation
