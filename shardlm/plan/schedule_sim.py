"""A pipeline schedule as PyTorch runs it, replayed on a clock: each rank's busy and idle time, the step's
makespan, the bubble, and the micro-batches each rank keeps in flight at its peak.

The action order is PyTorch's own (`torch.distributed.pipelining`, the schedules shardlm's runtime drives), so
the planner agrees with the runtime by construction:

- multi-stage schedules ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"): the `pipeline_order` the
  schedule class builds, as `_schedule_visualizer.get_schedule_ops` reads it (mock stages, no process group;
  `_torch_ops`);
- single-stage schedules ("gpipe", "1f1b"): PyTorch runs them from `_step_microbatches`, not from their
  `pipeline_order` (a drawing only, whose 1F1B last rank is one micro-batch off in torch 2.13: F1 .. Fm), so the
  order here is the one `_step_microbatches` runs: GPipe every forward then every backward; 1F1B min(m, P - r)
  forwards on rank r, then backward and forward alternating, then the remaining backwards.

Actions: F (forward), B (full backward), I (backward for the input), W (backward for the weights), and
OVERLAP_F_B (DualPipeV's forward of one micro-batch paired with a backward of another), which PyTorch runs as its
sub-actions one after the other, so it is replayed as those. REDUCE_GRAD and spacing (None) take no time.

The replay (`simulate`): each rank runs its actions in order, each as soon as the rank is free and its input is
there: F(s, mb) after F(s - 1, mb); I or B(s, mb) after I or B(s + 1, mb), the last stage's after its own
F(last, mb); W(s, mb) after I(s, mb). Costs are f, i, w per action (B = i + w), the same on every stage, and
transfers take no time. (PyTorch's stage 0 computes nothing in its I, there being no input gradient, and its whole
backward in W; nothing on another rank waits for stage 0's backward, and replaying it that way gives the same
makespans for every schedule, P in 2, 4, 8 and m in 2P, 4P tried, so the replay keeps i and w.) Stage
placement: stage s on rank s % P (loop), or, V-shaped ("zbv", "dualpipev"), stage s < P on rank s and stage
s >= P on rank 2P - 1 - s.
"""

from __future__ import annotations

from functools import lru_cache

from shardlm.errors import UserError

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                    "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}
"""shardlm's `parallel.pipeline_schedule` names -> PyTorch's schedule classes."""
V_SHAPED = ("zbv", "dualpipev")
"""Two stages a rank, stage r and stage 2P - 1 - r: rank 0 holds the first and the last stage."""
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")
"""Schedules that split a backward into I (input gradient) and W (weight gradient)."""


def stages_per_rank(schedule: str, virtual: int) -> int:
    """Stages each pipeline rank runs: 2 under the V-shaped schedules, else `virtual` (V)."""
    return 2 if schedule in V_SHAPED else virtual


def schedule_invalid_reason(schedule: str, pp: int, virtual: int | None, micro_batches: int | None = None
                            ) -> str | None:
    """Why PyTorch cannot run `schedule` on `pp` ranks with `virtual` stages each (None: unspecified) and
    `micro_batches` micro-batches (None: not yet known), or None when it can. With the micro-batches known, the
    schedule class itself is asked too (interleaved zero bubble wants m a multiple of its rounds)."""
    reason = _layout_reason(schedule, pp, virtual, micro_batches)
    if reason or micro_batches is None or pp == 1 or virtual is None:
        return reason
    try:
        schedule_actions(schedule, pp, virtual, micro_batches)
    except UserError as error:
        return str(error)
    return None


def _layout_reason(schedule: str, pp: int, virtual: int | None, micro_batches: int | None) -> str | None:
    """`schedule_invalid_reason` without asking PyTorch."""
    if schedule not in SCHEDULE_CLASSES:
        return f"schedule {schedule!r} is not one of {', '.join(SCHEDULE_CLASSES)}"
    if schedule in V_SHAPED and virtual not in (None, 2):
        return f"{schedule} runs exactly 2 stages a rank (r and 2P - 1 - r); drop --virtual-stages={virtual} or use 2"
    if schedule in ("gpipe", "1f1b") and virtual not in (None, 1):
        return f"{schedule} runs one stage a rank; use interleaved-1f1b or interleaved-zb for virtual stages"
    if micro_batches is not None and schedule == "dualpipev" and micro_batches < 2 * pp:
        return f"dualpipev needs at least 2P = {2 * pp} micro-batches, got {micro_batches}"
    return None


def _torch_ops(schedule: str, pp: int, stages: int, micro_batches: int) -> list[list]:
    """PyTorch's `pipeline_order` of a multi-stage schedule: per rank its list of `_Action`s (None for spacing).

    Built as `_schedule_visualizer.get_schedule_ops` builds it, on mock stages, but without the schedule's
    lowering into the runtime's send/receive actions (`_prepare_schedule_with_comms`, which leaves
    `pipeline_order` as it is and takes seconds at m = 256), and also at one stage a rank (ZB-H1), which that
    helper refuses. `tests/test_plan_schedules.py` checks the orders equal `get_schedule_ops`'s."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage, schedules

    cls = getattr(schedules, SCHEDULE_CLASSES[schedule])
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, pp, None, pp * stages
    with mock.patch.object(cls, "_prepare_schedule_with_comms", lambda self, order: None):
        order = cls([stage] * stages, micro_batches).pipeline_order
    return [order[rank] for rank in range(pp)]


def _single_stage_ops(schedule: str, pp: int, micro_batches: int) -> list[list[tuple[str, int, int]]]:
    """The order `_step_microbatches` of ScheduleGPipe / Schedule1F1B runs, as (kind, stage, micro-batch)."""
    out = []
    for rank in range(pp):
        warmup = micro_batches if schedule == "gpipe" else min(micro_batches, pp - rank)
        ops = [("F", rank, mb) for mb in range(warmup)]
        for mb in range(micro_batches):
            ops.append(("B", rank, mb))
            if warmup + mb < micro_batches:
                ops.append(("F", rank, warmup + mb))
        out.append(ops)
    return out


@lru_cache(maxsize=256)
def schedule_actions(schedule: str, pp: int, virtual: int, micro_batches: int) -> tuple[tuple[tuple[str, int, int],
                                                                                              ...], ...]:
    """Each rank's compute actions in the order PyTorch runs them, as (kind, stage, micro-batch) with kind one of
    "F", "B", "I", "W" (OVERLAP_F_B flattened into its sub-actions, spacing and REDUCE_GRAD dropped). Raises
    UserError for a combination PyTorch refuses (`schedule_invalid_reason`)."""
    reason = _layout_reason(schedule, pp, virtual, micro_batches)
    if reason:
        raise UserError(reason)
    if schedule in ("gpipe", "1f1b"):
        return tuple(tuple(rank) for rank in _single_stage_ops(schedule, pp, micro_batches))
    try:
        order = _torch_ops(schedule, pp, stages_per_rank(schedule, virtual), micro_batches)
    except ValueError as error:  # the schedule class's own checks
        raise UserError(f"{schedule} with PP={pp}, {virtual} stages a rank, {micro_batches} micro-batches: "
                        f"{' '.join(str(error).split())}") from None
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out = []
    for rank_ops in order:
        flat = []
        for action in rank_ops:
            for part in (action.sub_actions or (action,)) if action is not None else ():
                kind = kinds.get(part.computation_type.name)
                if kind is not None:
                    flat.append((kind, part.stage_index, part.microbatch_index))
        out.append(tuple(flat))
    return tuple(out)


def _dependency(kind: str, stage: int, mb: int, last: int) -> tuple[str, int, int] | None:
    """The action whose end (kind, stage, mb) waits for (None: none): F on the previous stage's F, I/B on the
    next stage's I/B (the last stage's on its own F), W on its own I."""
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    if kind == "W":
        return ("I", stage, mb)
    return ("F", stage, mb) if stage == last else ("I", stage + 1, mb)  # a full B ends where an I would


def _replay(actions, last: int, cost: dict[str, float]) -> tuple[list[float], list[float]]:
    """(busy, end) time of each rank: every rank runs its next action as soon as it is free and the action's
    dependency has ended; sweeps the ranks until all are done. Raises RuntimeError if the order deadlocks."""
    ends: dict[tuple[str, int, int], float] = {}
    clock, busy, position = [0.0] * len(actions), [0.0] * len(actions), [0] * len(actions)
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for rank, ops in enumerate(actions):
            while position[rank] < len(ops):
                kind, stage, mb = ops[position[rank]]
                needed = _dependency(kind, stage, mb, last)
                ready = 0.0 if needed is None else ends.get(needed, ends.get(("B",) + needed[1:]))
                if ready is None:
                    break
                start = max(clock[rank], ready)
                clock[rank] = start + cost[kind]
                busy[rank] += cost[kind]
                ends[(kind, stage, mb)] = clock[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's action order deadlocks: " +
                               ", ".join(f"rank {r} waits at {ops[position[r]]}" for r, ops in enumerate(actions)
                                         if position[r] < len(ops)))
    return busy, clock


def peak_in_flight(rank_actions, local: dict[int, int]) -> list[int]:
    """Micro-batches per local stage (index into `local`, stage -> local index) that one rank holds at its peak:
    a micro-batch is in flight on a stage from its F until its W (or full B), when the last of what its backward
    needs is freed (after I the stage still keeps the inputs W needs). The peak is the first moment the rank's
    total is largest."""
    held, best = [0] * len(local), [0] * len(local)
    total = peak = 0
    for kind, stage, _ in rank_actions:
        if kind == "F":
            held[local[stage]] += 1
            total += 1
            if total > peak:
                best, peak = list(held), total
        elif kind in ("B", "W"):
            held[local[stage]] -= 1
            total -= 1
    return best


def in_flight(schedule: str, pp: int, virtual: int, micro_batches: int) -> list[list[int]]:
    """Per rank, its micro-batches in flight per local stage at its peak (`peak_in_flight`): an order's property,
    no clock needed."""
    return [list(counts) for counts in _in_flight(schedule, pp, virtual, micro_batches)]


@lru_cache(maxsize=1024)
def _in_flight(schedule: str, pp: int, virtual: int, micro_batches: int) -> tuple[tuple[int, ...], ...]:
    actions = schedule_actions(schedule, pp, virtual, micro_batches)
    return tuple(tuple(peak_in_flight(ops, {s: n for n, s in enumerate(local_stage_indices(schedule, pp, virtual,
                                                                                          rank))}))
                 for rank, ops in enumerate(actions))


def local_stage_indices(schedule: str, pp: int, virtual: int, rank: int) -> list[int]:
    """The stages rank `rank` runs, in local order: r, r + P, ... (loop), or r and 2P - 1 - r (V-shaped)."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(stages_per_rank(schedule, virtual))]


@lru_cache(maxsize=1024)
def _timeline(schedule: str, pp: int, virtual: int, micro_batches: int, f: float, i: float, w: float
              ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(busy, end) per rank of `simulate`'s replay, kept for the planner's many layouts."""
    actions = schedule_actions(schedule, pp, virtual, micro_batches)
    busy, end = _replay(actions, pp * stages_per_rank(schedule, virtual) - 1, {"F": f, "I": i, "W": w, "B": i + w})
    return tuple(busy), tuple(end)


def simulate(schedule: str, pp: int, virtual: int, micro_batches: int, f: float, i: float, w: float) -> dict:
    """Replay one step of `schedule` (shardlm's name) on `pp` ranks, `virtual` stages a rank (2 for "zbv" and
    "dualpipev"), `micro_batches` micro-batches, with every stage's forward taking `f`, its input-gradient backward
    `i` and its weight-gradient backward `w` (a full backward i + w). Returns a dict:

    - "busy": per rank, the sum of its actions' costs; "idle": per rank, makespan - busy;
    - "makespan": the step's time, when the last rank finishes;
    - "bubble": (makespan - busy) / busy of the busiest rank, i.e. the step's time over the ideal time of a rank
      that never waits, less one (Narayanan et al.'s (P - 1) / (V m) for 1F1B and interleaved 1F1B);
    - "in_flight": per rank, its micro-batches in flight per local stage at its peak (`peak_in_flight`; local
      stage order `local_stage_indices`).
    """
    busy, end = _timeline(schedule, pp, virtual, micro_batches, f, i, w)
    makespan, busiest = max(end), max(busy)
    return {"busy": list(busy), "idle": [makespan - b for b in busy], "makespan": makespan,
            "bubble": (makespan - busiest) / busiest, "in_flight": in_flight(schedule, pp, virtual, micro_batches)}
