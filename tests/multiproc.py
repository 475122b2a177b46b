"""Run a function on N local gloo processes and collect what each rank returns.

Spawning costs seconds (each process imports torch), so a test module starts each world size once
and runs all its checks inside: `run_workers(4, run_checks, CHECKS)` returns, per rank, the dict the
checks produced. A worker's exception travels back as text and fails the test that reads it.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, init):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # A short collective timeout turns a hang (one rank failed mid-check) into an error.
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=90))
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that vanish
        # when this process exits before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world_size: int, fn, *args, timeout: float = 240.0, init: bool = True) -> list:
    """Run `fn(*args)` on ranks 0..world_size-1 (gloo, CPU); return the per-rank results.
    With init=False the workers get the torchrun environment but no process group yet."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, init), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def run_checks(checks: dict) -> dict:
    """Worker body: run every named check, keeping each one's result or its traceback."""
    out = {}
    for name, check in checks.items():
        try:
            out[name] = ("ok", check())
        except Exception:  # noqa: BLE001
            out[name] = ("error", traceback.format_exc())
    return out
