"""How a shardlm command stops: SIGTERM and Ctrl-C end it with one line and exit codes 143 / 130.

Schedulers (SLURM preemption, Kubernetes, `timeout`) stop a job with SIGTERM and, after a grace
period, SIGKILL; a user stops it with Ctrl-C (SIGINT). Every `shardlm` command runs under
`stop_signals()`: SIGTERM raises `Terminated`, the first SIGINT raises `KeyboardInterrupt` (later
ones are ignored, so that cleaning up is not itself interrupted), and `shardlm.cli.main` reports
either in one line on the main rank. Two places handle them more finely:

- `shardlm.training.run.StopSignals`: inside `shardlm train`, SIGTERM only sets a flag, so that all
  ranks finish the current step, save and stop together;
- `shardlm.training.launcher`: the `--nproc-per-node` launcher forwards the signal to its workers,
  waits up to its grace period and reports only what the workers could not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130: the same for Ctrl-C
STOP_REPORT_ENV = "SHARDLM_STOP_REPORT"


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException (like KeyboardInterrupt) so `except Exception` does not swallow it."""


def is_main_process() -> bool:
    """Rank 0 of a launched job, or a process that is not part of one: the one that prints."""
    return os.environ.get("RANK", "0") == "0"


def report_stop(message: str, printer=None) -> None:
    """On the main process only: print the one line a stopped command leaves (`printer`, default stderr)
    and, when $SHARDLM_STOP_REPORT names a file (set by the `--nproc-per-node` launcher for its workers),
    write it there too, so that the launcher knows the workers have spoken and stays silent."""
    if not is_main_process():
        return
    if printer is None:
        print(message, file=sys.stderr)
    else:
        printer(message)
    report = os.environ.get(STOP_REPORT_ENV)
    if report:
        with contextlib.suppress(OSError):
            Path(report).write_text(message + "\n")


def exit_interrupted() -> None:
    """End an interrupted process with exit code 130. A worker of a launched job (`LOCAL_RANK` set, as
    torchrun sets it) leaves through `os._exit` once its output is flushed: Ctrl-C may have cut a step in
    the middle of an asynchronous collective (FSDP's all-gathers and reduce-scatters), and PyTorch's
    process-group destructors would then print warnings at exit, or wait on peers already gone. Any other
    process raises SystemExit(130)."""
    if "LOCAL_RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED_EXIT_CODE)
    raise SystemExit(INTERRUPTED_EXIT_CODE)


def raise_terminated(signum, frame) -> None:
    raise Terminated()


def interrupt_once(signum, frame) -> None:
    """The first SIGINT raises KeyboardInterrupt; later ones are ignored while the process winds down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt()


@contextlib.contextmanager
def stop_signals():
    """SIGTERM raises `Terminated` and the first SIGINT `KeyboardInterrupt` inside the block (main thread
    only; elsewhere nothing changes). The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig, handler in
                ((signal.SIGTERM, raise_terminated), (signal.SIGINT, interrupt_once))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
