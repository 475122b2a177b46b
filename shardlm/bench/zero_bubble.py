"""The zero-bubble schedules on this CPU: each schedule's step, idle time per rank, and a timeline picture.

PP=2 runs two processes of one thread each on a shape heavy enough that a micro-batch's compute, not gloo's
latency, fills the step: 1F1B, interleaved 1F1B (V = 2), interleaved zero bubble (V = 1, the paper's ZB-H1),
ZB-V and DualPipeV (2 stages a rank, in a V), all at m micro-batches. Every rank records one step's actions
(`PipelineRunner.record_timeline`: forward F, whole backward B, input-gradient I, weight-gradient W, with their
start and end on the machine's monotonic clock, which both processes share). From that step:
- busy: the sum of a rank's action times; idle: the step's span (first start to last end over both ranks) less
  busy; the measured bubble: the span over the busiest rank's busy time, less one;
- the costs of a forward, an input-gradient and a weight-gradient step (medians over the step's actions; a
  schedule without the split gives its whole backward, halved for the replay, whose order does not separate
  them) go into `shardlm.plan.schedule_sim.simulate`, which replays PyTorch's own order of the schedule:
  its makespan and bubble are what the schedule promises for those costs, with free transfers.
The timed figure is the median step time over `repeats` steps. `docs/figures/pipeline_timelines.png` draws the
recorded step of each schedule, one row per rank.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from shardlm.bench.common import FIGURES, BenchShape

SHAPE = BenchShape(num_layers=8, hidden_size=256, num_heads=4, seq_length=256, micro_batch=2, vocab_size=4096)
QUICK_SHAPE = BenchShape(num_layers=4, hidden_size=64, num_heads=4, seq_length=64, micro_batch=2, vocab_size=512)
SCHEDULES = [("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 1), ("zbv", 2), ("dualpipev", 2)]
COLOURS = {"F": "tab:blue", "B": "tab:red", "I": "tab:orange", "W": "tab:green"}


def run_schedules(shape: BenchShape, micro_batches: int, repeats: int) -> dict:
    """On every rank of a PP=2 world: for each schedule, the median step seconds and one recorded step's
    actions [(kind, stage, micro-batch, start, end)]."""
    from shardlm.parallel import ParallelContext

    torch.set_num_threads(1)
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    out = {}
    for schedule, virtual in SCHEDULES:
        ctx.rng = None
        parallel = {"pipeline": 2, "pipeline_schedule": schedule,
                    "virtual_stages": virtual if schedule.startswith("interleaved") else 1}
        trainer = shape.trainer(ctx, global_batch=shape.micro_batch * micro_batches, parallel=parallel)
        trainer.train_step()  # warm-up: the schedule's shape inference
        times = []
        for _ in range(repeats):
            ctx.pp.barrier()
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
        timeline: list = []
        ctx.pp.barrier()
        trainer.pipeline.record_timeline(timeline)
        trainer.train_step()
        trainer.pipeline.record_timeline(None)
        out[schedule] = {"step_s": statistics.median(times), "timeline": timeline}
    return out


def action_costs(timelines: list[list]) -> dict[str, float]:
    """Median seconds of each kind of action over every rank's recorded step: f, i, w (a whole backward B,
    where the schedule does not split it, counts half to each)."""
    spans: dict[str, list[float]] = {}
    for timeline in timelines:
        for kind, _, _, start, end in timeline:
            spans.setdefault(kind, []).append(end - start)
    f = statistics.median(spans["F"])
    if "B" in spans and "I" not in spans:
        half = statistics.median(spans["B"]) / 2
        return {"f": f, "i": half, "w": half}
    # the split schedules still run some whole backwards (the first stage's, as its weight step): I and W rule
    return {"f": f, "i": statistics.median(spans["I"]), "w": statistics.median(spans["W"])}


def measure(timelines: list[list]) -> dict:
    """Span of the recorded step (first start to last end over the ranks), each rank's busy and idle seconds,
    and the measured bubble: span / busiest rank's busy - 1."""
    start = min(a[3] for timeline in timelines for a in timeline)
    span = max(a[4] for timeline in timelines for a in timeline) - start
    busy = [sum(a[4] - a[3] for a in timeline) for timeline in timelines]
    return {"span_s": span, "busy_s": busy, "idle_s": [span - b for b in busy], "bubble": span / max(busy) - 1,
            "origin": start}


def zero_bubble_schedules(quick: bool = False, repeats: int = 5, out_dir: str | Path = ".") -> dict:
    from shardlm.parallel.spawn import run_workers
    from shardlm.plan.schedule_sim import simulate

    shape, m = (QUICK_SHAPE, 4) if quick else (SHAPE, 8)
    ranks = run_workers(2, run_schedules, shape, m, 1 if quick else repeats, timeout=1800)
    rows, drawn = [], {}
    for schedule, virtual in SCHEDULES:
        timelines = [rank[schedule]["timeline"] for rank in ranks]
        measured, costs = measure(timelines), action_costs(timelines)
        promised = simulate(schedule, 2, virtual, m, **costs)
        rows.append({"schedule": schedule, "virtual_stages": virtual, "micro_batches": m,
                     "step_s": max(rank[schedule]["step_s"] for rank in ranks), **measured, **costs,
                     "predicted_s": promised["makespan"], "predicted_bubble": promised["bubble"],
                     "predicted_idle_s": promised["idle"]})
        drawn[schedule] = (timelines, measured["origin"])
    for row in rows:
        del row["origin"]
    return {"config": shape.describe() + f"; PP=2 as 2 processes x 1 thread, m = {m} micro-batches; step time the "
            "median of the timed steps, the rest from one recorded step.", "rows": rows,
            "plot": plot(drawn, Path(out_dir), f"{FIGURES}/pipeline_timelines.png")}


def plot(drawn: dict, out_dir: Path, relative: str) -> str:
    """One panel per schedule, one row per rank, a bar per action coloured by its kind and labelled with its
    micro-batch (second stage of a rank hatched), written to `out_dir / relative`; returns `relative` (the link from
    BENCHMARKS.md in `out_dir`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(drawn), 1, figsize=(12, 1.3 * len(drawn) + 1), sharex=True)
    for ax, (schedule, (timelines, origin)) in zip(axes, drawn.items()):
        for rank, timeline in enumerate(timelines):
            first_stage = min(a[1] for a in timeline)
            for kind, stage, mb, start, end in timeline:
                ax.barh(rank, (end - start) * 1e3, left=(start - origin) * 1e3, color=COLOURS[kind],
                        hatch="//" if stage != first_stage else None, edgecolor="black", linewidth=0.3)
                if end - start > 0.02 * max(a[4] - origin for a in timeline):
                    ax.text((start + end) / 2 * 1e3 - origin * 1e3, rank, str(mb), ha="center", va="center",
                            fontsize=6)
        ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
        ax.invert_yaxis()
        ax.set_title(schedule, fontsize=9, loc="left")
    axes[-1].set_xlabel("ms from the step's first action")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    figure.legend(handles, ["forward", "whole backward", "input gradient", "weight gradient"], loc="upper right",
                  ncol=4, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    path = out_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return relative


def markdown_lines(result: dict) -> list[str]:
    lines = ["### Zero-bubble schedules: idle time against the schedule's promise", "", result["config"], "",
             "Promised: PyTorch's order of the schedule replayed with this step's median forward, input-gradient and "
             "weight-gradient times and free transfers (`shardlm.plan.schedule_sim`).", "",
             "| schedule | V | m | step s (median) | recorded step s | idle s per rank | measured bubble | "
             "promised s | promised bubble | f / i / w ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        idle = " / ".join(f"{s:.3f}" for s in row["idle_s"])
        lines.append(f"| {row['schedule']} | {row['virtual_stages']} | {row['micro_batches']} | {row['step_s']:.3f} | "
                     f"{row['span_s']:.3f} | {idle} | {row['bubble']:.0%} | {row['predicted_s']:.3f} | "
                     f"{row['predicted_bubble']:.0%} | {row['f'] * 1e3:.1f} / {row['i'] * 1e3:.1f} / "
                     f"{row['w'] * 1e3:.1f} |")
    lines += ["", f"![one step of each schedule]({result['plot']})", ""]
    return lines
