"""Pipeline parallelism on this CPU: step time of PP=2 against the ideal and the predicted bubble, and
peak memory per stage, for GPipe, 1F1B and interleaved 1F1B at m = 2, 4, 8 micro-batches.

One process with one thread runs the whole model (the baseline, `t1`); PP=2 runs two processes with
one thread each, so a perfect pipeline takes `t1 / 2`. The bubble adds (P - 1) / m of that for
GPipe and 1F1B and (P - 1) / (V m) for interleaved 1F1B with V virtual stages (Narayanan et al.
2021); the table puts the measured time beside both. Peak memory per stage is the most bytes alive
at once during one training step beyond parameters and optimizer state (`PeakMemory`): GPipe keeps
the activations of all m micro-batches, 1F1B at most P on the first stage.
"""

from __future__ import annotations

import statistics
import time

import torch

from shardlm.bench.common import BenchShape

PIPELINE_SHAPE = BenchShape(num_layers=8, hidden_size=128, num_heads=4, seq_length=128, micro_batch=2,
                            vocab_size=4096)
CASES = [(schedule, virtual, m) for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
         for m in (2, 4, 8)]


def _time_steps(trainer, repeats: int) -> float:
    trainer.train_step()  # warm-up (and the pipeline's shape inference)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak(trainer) -> int:
    from shardlm.plan.measure import PeakMemory

    with PeakMemory() as memory:
        trainer.train_step()
    return memory.peak


def run_cases(shape: BenchShape, cases: list, pipeline: int, repeats: int) -> dict:
    """On every rank: median step seconds and peak bytes of each (schedule, virtual, m) case."""
    from shardlm.parallel import ParallelContext

    torch.set_num_threads(1)
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=pipeline) if pipeline > 1 \
        else ParallelContext.single()
    out = {}
    for schedule, virtual, m in cases:
        ctx.rng = None
        parallel = {"pipeline": pipeline, "pipeline_schedule": schedule if pipeline > 1 else "1f1b",
                    "virtual_stages": virtual if pipeline > 1 else 1}
        trainer = shape.trainer(ctx, global_batch=shape.micro_batch * m, parallel=parallel)
        out[(schedule, virtual, m)] = {"step_s": _time_steps(trainer, repeats), "peak_bytes": _peak(trainer)}
    return out


def pipeline_bubble(quick: bool = False, repeats: int = 5) -> dict:
    from shardlm.parallel.spawn import run_workers

    shape = BenchShape(num_layers=4, hidden_size=64, num_heads=4, seq_length=64, micro_batch=2, vocab_size=512) \
        if quick else PIPELINE_SHAPE
    repeats = 1 if quick else repeats
    cases = [case for case in CASES if case[2] == 4] if quick else CASES
    pp = 2
    baseline = run_cases(shape, [("1f1b", 1, m) for m in sorted({case[2] for case in cases})], 1, repeats)
    stages = run_workers(pp, run_cases, shape, cases, pp, repeats, timeout=1800)
    rows = []
    for schedule, virtual, m in cases:
        single = baseline[("1f1b", 1, m)]["step_s"]
        measured = max(rank[(schedule, virtual, m)]["step_s"] for rank in stages)
        ideal = single / pp
        bubble = (pp - 1) / (virtual * m)
        rows.append({"schedule": schedule, "virtual_stages": virtual, "micro_batches": m,
                     "one_process_s": single, "measured_s": measured, "ideal_s": ideal,
                     "predicted_bubble": bubble, "predicted_s": ideal * (1 + bubble),
                     "measured_overhead": measured / ideal - 1,
                     "peak_bytes_per_stage": [rank[(schedule, virtual, m)]["peak_bytes"] for rank in stages]})
    return {"config": shape.describe() + f"; PP={pp} as 2 processes x 1 thread against 1 process x 1 thread "
            "running every layer; medians of the step time.", "rows": rows}
