"""Where a step's time goes, by kind of operator: the measured half of BENCHMARKS.md's "why" for a missed goal.

`breakdown(step)` runs one step under `torch.profiler` and sums the operators' self times (ms) into `KINDS`, so
two programs compared in a section can be set side by side: when both spend the same time in the same GEMM
kernels, a ratio can only come from the rest, and the table says how much rest there is. The profiler adds its
own cost to every operator call (more to a program of many small calls), so these are shares to read, not times
to compare: the timed rounds do that.
"""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

KINDS = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::addbmm"),
    "attention": ("scaled_dot_product", "flash_attention", "efficient_attention"),
    "triangular_solve": ("linalg_solve_triangular",),
    "optimizer": ("_fused_adamw", "_foreach_", "linalg_vector_norm"),
}
"""Kinds of operators, by fragments of their profiler names (first match wins); every other operator is "other"
(elementwise work, copies, normalization, the loss's softmax, indexing)."""


def kind_of(name: str) -> str:
    for kind, fragments in KINDS.items():
        if any(fragment in name for fragment in fragments):
            return kind
    return "other"


def self_times(step, steps: int = 1) -> tuple[float, dict[str, float]]:
    """(wall ms per step, {operator: self CPU ms per step}) over `steps` profiled calls of `step`."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) * 1000 / steps
    ops: dict[str, float] = {}
    for event in prof.key_averages():
        ops[event.key] = ops.get(event.key, 0.0) + event.self_cpu_time_total / 1000 / steps
    return wall, ops


def breakdown(step, steps: int = 1) -> dict[str, float]:
    """{kind: self ms per step, ..., "total": wall ms per step} of `steps` profiled calls of `step`."""
    wall, ops = self_times(step, steps)
    out = dict.fromkeys([*KINDS, "other"], 0.0)
    for name, ms in ops.items():
        out[kind_of(name)] += ms
    return {**{kind: round(ms, 1) for kind, ms in out.items()}, "total": round(wall, 1)}


def why_not_faster(ours: dict[str, float], theirs: dict[str, float], goal: float, ours_ms: float | None = None,
                   theirs_ms: float | None = None) -> str:
    """One sentence from two breakdowns (shardlm's, the other program's): how the kinds compare, and how little
    time outside the GEMMs shardlm would need for `goal`x when its GEMMs stay as they are. With the timed step
    medians (`ours_ms`, `theirs_ms`) each profile's kinds are scaled to its program's timed step, so the profiler's
    own cost (larger for a program of more, smaller calls) does not decide the sentence."""
    ours_ms, theirs_ms = ours_ms or ours["total"], theirs_ms or theirs["total"]
    ours = {kind: ms * ours_ms / ours["total"] for kind, ms in ours.items()}
    theirs = {kind: ms * theirs_ms / theirs["total"] for kind, ms in theirs.items()}
    parts = ", ".join(f"{kind} {ours[kind]:.0f} / {theirs[kind]:.0f} ms" for kind in [*KINDS, "other"]
                      if ours.get(kind, 0) + theirs.get(kind, 0) >= 0.02 * (ours["total"] + theirs["total"]))
    rest_needed = theirs["total"] / goal - ours["gemm"]
    rest = ours["total"] - ours["gemm"]
    return (f"steps of {ours['total']:.0f} and {theirs['total']:.0f} ms (shardlm / transformers), by the shares of "
            f"one profiled step each: {parts}; with its GEMMs as they are, {goal}x would leave shardlm "
            f"{max(rest_needed, 0):.0f} ms for everything else, where it spends {rest:.0f} ms")
