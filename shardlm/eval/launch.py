"""Run an evaluation command on one rank, under torchrun, or on N local worker processes.

`run_command(fn, args)` calls `fn(args)` directly when this process is already one rank of a job
(started by torchrun, or a plain single process). With `--nproc-per-node N` (default: the
tensor-parallel size) it spawns N local workers with the torchrun environment variables set, each
of which calls `fn(args)`; rank 0 prints. A `UserError` in a worker is printed once and the command
exits 2, like the single-process CLI. SIGTERM or Ctrl-C to the command stops the workers (they hold no
state to save) and `shardlm.cli.main` says so in one line, exiting 143 / 130.
"""

from __future__ import annotations

import os
import sys
import time

from shardlm.errors import UserError
from shardlm.signals import Terminated


def under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def world_size_for(args) -> int:
    """Processes the command will run on: --nproc-per-node, else --tensor-parallel."""
    nproc = args.nproc_per_node if args.nproc_per_node is not None else args.tensor_parallel
    if nproc < 1 or args.tensor_parallel < 1:
        raise UserError(f"--nproc-per-node={nproc} and --tensor-parallel={args.tensor_parallel} must be >= 1")
    if nproc % args.tensor_parallel != 0:
        raise UserError(f"--nproc-per-node={nproc} is not divisible by --tensor-parallel={args.tensor_parallel}; "
                        "use a multiple of it")
    return nproc


def run_command(fn, args) -> int:
    """`fn(args) -> int` on this rank, or on `world_size_for(args)` spawned local ranks."""
    nproc = world_size_for(args)
    if nproc == 1 or under_launcher():
        return fn(args)
    import torch.multiprocessing as mp

    from shardlm.parallel.spawn import host_store

    store = host_store(nproc)  # held until the workers end; they join it as clients
    port = store.port
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    context = mp.start_processes(_worker, args=(nproc, port, threads, fn, args), nprocs=nproc,
                                 start_method="spawn", join=False)
    try:
        while not context.join():
            pass
    except (Terminated, KeyboardInterrupt):
        stop_workers(context.processes)
        raise  # shardlm.cli.main prints the one line and exits 143 / 130
    except mp.ProcessExitedException as exc:
        return exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1
    except mp.ProcessRaisedException as exc:
        print(f"shardlm: a worker failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


def stop_workers(processes, grace_s: float = 10.0) -> None:
    """SIGTERM to every live worker (they hold no state worth saving), SIGKILL to those still alive after
    `grace_s`."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _worker(local_rank: int, nproc: int, port: int, threads: str, fn, args) -> None:
    import signal

    from shardlm.parallel.spawn import set_local_rank_env

    # Ctrl-C reaches the whole process group; the parent alone handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    set_local_rank_env(local_rank, nproc, port, os.environ.get("OMP_NUM_THREADS", threads))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        code = fn(args)
    except UserError as exc:
        if local_rank == 0:
            print(f"shardlm: error: {exc}", file=sys.stderr)
        code = UserError.exit_code
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)
