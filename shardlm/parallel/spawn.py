"""Run a function on N local processes that form one gloo world, and collect what each returns.

For tests and benchmarks on one machine: `run_workers(2, fn, *args)` starts 2 processes with the
torchrun environment set, initializes the default process group (unless `init=False`), calls
`fn(*args)` on each and returns the per-rank results (pickled bytes, so tensors survive the exit of
their process). A worker's exception travels back as text and is raised here.

Workers are forked from a fork server that has imported torch and shardlm's training stack once
(`PRELOAD`), instead of each spawned process importing them again (seconds of CPU per worker, which
multi-process test suites pay hundreds of times). Each worker takes the caller's environment as it is
at the call, as a spawned process would. `SHARDLM_START_METHOD=spawn` restores plain spawning.

The caller hosts the world's rendezvous store (`host_store`), as torchrun's agent does: the OS picks its
port while binding it. A port picked free and bound later by rank 0 can be taken in between (by another
world's store, or as the local end of any TCP connection, gloo's included), and rank 0 then fails with
EADDRINUSE or, worse, the other ranks join a stranger's world.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from queue import Empty


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(world_size: int):
    """A TCPStore server for a local world of `world_size`, on a port the OS picks as it binds (`.port`).
    Keep it alive until the workers end; they connect to it as clients (`set_local_rank_env`)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def set_local_rank_env(rank: int, world_size: int, port: int, threads: int | str) -> None:
    """The environment torchrun gives rank `rank` of a one-machine world whose store (`host_store`) listens on
    `port`: every rank, rank 0 too, joins it as a client, as under torchrun's agent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS=str(threads), TORCHELASTIC_USE_AGENT_STORE="True")


PRELOAD = ["torch", "torch.distributed", "shardlm.training.trainer"]
"""Modules the fork server imports once for every worker it forks."""


def _worker(rank, world_size, port, fn, args, queue, init, threads, environment):
    # What the worker inherited (the fork server's modules) is left out of its garbage collections, which would
    # otherwise walk every object of torch and shardlm again (and copy the pages they touch) in each worker.
    gc.freeze()
    os.environ.clear()
    os.environ.update(environment)  # the caller's environment at the call, as a spawned worker gets it
    set_local_rank_env(rank, world_size, port, threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if init:
            # A short collective timeout turns a hang (one rank failed mid-check) into an error.
            from shardlm.parallel.staged import backend_for

            # gloo, or the staged gloo group under SHARDLM_BACKEND=gloo_staged (several ranks on one GPU)
            backend = backend_for(torch.device("cpu"))
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_alive(procs: list, results: dict, deadline: float, timeout: float) -> None:
    """Between polls of the result queue: a worker that exited without reporting (it died before `_worker` ran,
    e.g. its function could not be unpickled, or was killed) fails the call now instead of at the deadline."""
    silent = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0) and rank not in results]
    if silent:
        rank = silent[0]
        raise RuntimeError(f"rank {rank} exited with code {procs[rank].exitcode} without a result (its output "
                           "above says why)")
    if time.monotonic() >= deadline:
        raise TimeoutError(f"{len(procs) - len(results)} of {len(procs)} ranks gave no result within {timeout:g} s")


def run_workers(world_size: int, fn, *args, timeout: float = 300.0, init: bool = True, threads: int = 1) -> list:
    """Run `fn(*args)` on ranks 0..world_size-1 (gloo, `threads` threads each); return per-rank results.
    With init=False the workers get the torchrun environment but no process group yet."""
    import torch.multiprocessing as mp

    method = os.environ.get("SHARDLM_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    store = host_store(world_size)
    port = store.port
    environment = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, init, threads, environment),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except Empty:
                _check_alive(procs, results, deadline, timeout)
                continue
            if status == "error":  # the first line names the worker's exception (its traceback's last line)
                last = next((line.strip() for line in reversed(value.splitlines()) if line.strip()), "")
                raise RuntimeError(f"rank {rank} failed: {last}\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:  # after a failure the other ranks may wait in a collective: end them at once
            p.join(timeout=10 if len(results) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
        del store  # the workers are gone: close the rendezvous port
    return [results[r] for r in range(world_size)]
