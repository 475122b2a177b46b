"""Multi-process test helpers: spawn a gloo world once per module and run many checks inside it.

`run_workers(4, run_checks, CHECKS)` returns, per rank, the dict the checks produced (see
`shardlm.parallel.spawn`). Each check's exception is kept as text, so one failing check fails only
the tests that read it.
"""

from __future__ import annotations

import traceback

from shardlm.parallel.spawn import free_port, run_workers

__all__ = ["free_port", "run_checks", "run_workers"]


def run_checks(checks: dict) -> dict:
    """Worker body: run every named check, keeping each one's result or its traceback."""
    out = {}
    for name, check in checks.items():
        try:
            out[name] = ("ok", check())
        except Exception:  # noqa: BLE001
            out[name] = ("error", traceback.format_exc())
    return out
