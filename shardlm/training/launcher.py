"""`shardlm train --nproc-per-node N`: PyTorch's elastic launcher (torchrun), stopped the way schedulers stop jobs.

torchrun turns SIGTERM or SIGINT into an exception, forwards the signal to its workers, waits up to
`--shutdown-timeout` seconds for them to exit, kills what is left, and then prints a traceback and
exits 1. Here the launcher catches the signal itself (so torch's handler is not installed), silences
torch's shutdown warnings, lets torch forward the signal and wait, and then exits 128 + the signal
(143 for SIGTERM, 130 for Ctrl-C) without a traceback. The workers print the one line that says where
they stopped (`shardlm.training.run`); the launcher adds a line only when they did not exit within the
grace period and had to be killed, after removing any save they left unfinished.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from shardlm.checkpoint.files import latest_in, read_meta, remove_unfinished
from shardlm.errors import UserError
from shardlm.signals import INTERRUPTED_EXIT_CODE, STOP_REPORT_ENV, TERMINATED_EXIT_CODE

DEFAULT_SHUTDOWN_TIMEOUT_S = 300
"""Seconds the workers get after SIGTERM to finish their step and save: a step of a large model on a CPU
takes tens of seconds (GPT-2 355M, TP=2 on 2 cores: 11-16 s in fp32) and a save as long again."""


class LauncherSignals:
    """SIGTERM and SIGINT in the launching process: the first one is recorded (which, when) and raised as
    torch elastic's `SignalException`, which makes the agent forward it to the workers and wait for them;
    later ones are ignored so that the wait is not cut short."""

    def __init__(self):
        self.signum: int | None = None
        self.received_at = 0.0
        self.previous: dict = {}

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.signum is not None:
            return
        self.signum, self.received_at = signum, time.monotonic()
        quiet_elastic_logs()
        raise SignalException(f"shardlm launcher got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def quiet_elastic_logs() -> None:
    """torch elastic logs a warning per worker it signals; the launcher says what matters in one line."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def torchrun_args(argv: list[str], shutdown_timeout: int) -> list[str]:
    """`argv` for torchrun with its own SIGTERM/SIGINT handling off and the grace period set, for the
    options this PyTorch knows (older ones lack --signals-to-handle and --shutdown-timeout)."""
    from torch.distributed.run import get_args_parser

    known = {option for action in get_args_parser()._actions for option in action.option_strings}
    extra = []
    if "--signals-to-handle" in known:
        extra += ["--signals-to-handle", "SIGHUP,SIGQUIT"]
    if "--shutdown-timeout" in known:
        extra += ["--shutdown-timeout", str(shutdown_timeout)]
    return extra + argv


def describe_latest(checkpoints: Path) -> str:
    try:
        latest = latest_in(checkpoints)
        return "none" if latest is None else f"step {read_meta(latest)['step']} ({latest})"
    except Exception:  # noqa: BLE001 - a damaged folder is reported as such, the exit stays clean
        return f"unreadable ({checkpoints})"


def launch(argv: list[str], shutdown_timeout: int, checkpoints: Path) -> int:
    """Run torchrun with `argv` (its options, then `-m shardlm train ...`); the command's exit code.

    `checkpoints`: the workers' checkpoint folder, cleaned and reported on when they had to be killed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    # a failed worker printed why (a user error's one line, or its traceback); the lines torch elastic logs per
    # worker it stops ("closing signal", "failed (exitcode: 2)") add nothing. Restarts are still logged.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    handle, name = tempfile.mkstemp(prefix="shardlm-stop-", suffix=".txt")
    os.close(handle)
    report = Path(name)
    os.environ[STOP_REPORT_ENV] = str(report)  # the workers' main rank writes its stop line there
    with LauncherSignals() as stop:
        try:
            torchrun(get_args_parser().parse_args(torchrun_args(argv, shutdown_timeout)))
        except SignalException as exc:
            if stop.signum is None:  # SIGHUP or SIGQUIT: torch's own handler raised it
                stop.signum, stop.received_at = int(exc.sigval), time.monotonic()
            return stopped(stop, shutdown_timeout, checkpoints, report)
        except ChildFailedError as exc:
            failures = exc.failures
            first = min(failures) if failures else None
            code = failures[first].exitcode if first is not None else 1
            if code in (TERMINATED_EXIT_CODE, INTERRUPTED_EXIT_CODE) and report.read_text().strip():
                return code  # a worker, not this process, got the signal; the workers said where they stopped
            if any(f.exitcode == UserError.exit_code for f in failures.values()):
                # a user error: the workers printed its line (a worker the agent stopped first may report a
                # signal instead: whichever rank exits first, the run ends the same way)
                return UserError.exit_code
            print(f"shardlm: training failed on {len(failures)} worker(s); see the messages above", file=sys.stderr)
            return code if code and code > 0 else 1
        finally:
            os.environ.pop(STOP_REPORT_ENV, None)
            report.unlink(missing_ok=True)
    return 0


def stopped(stop: LauncherSignals, shutdown_timeout: int, checkpoints: Path, report: Path) -> int:
    """After the agent forwarded the signal and the workers are gone: a line only where they said nothing."""
    remove_unfinished(checkpoints)  # what a killed worker, or a Ctrl-C in the middle of a save, left
    name = signal.Signals(stop.signum).name
    if report.read_text().strip():  # the workers printed where they stopped
        pass
    elif time.monotonic() - stop.received_at >= shutdown_timeout:
        what = "save" if stop.signum == signal.SIGTERM else "stop"
        print(f"shardlm: {name}: the workers did not {what} within --shutdown-timeout={shutdown_timeout}s and "
              f"were killed; last checkpoint: {describe_latest(checkpoints)}", file=sys.stderr)
    else:  # they exited without a word (the signal came while they were starting, or after their last step)
        print(f"shardlm: stopped by {name}; last checkpoint: {describe_latest(checkpoints)}", file=sys.stderr)
    return 128 + stop.signum
