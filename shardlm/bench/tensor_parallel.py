"""Tensor-parallel efficiency on one CPU, and communication per step against the analytic formula.

Efficiency = tokens/s at TP=2 (2 processes x 1 thread) / tokens/s at TP=1 (1 process x 2 threads),
for shardlm and for PyTorch's own tensor parallelism (`torch_tp.py`). Both layouts live in one world
of 2 processes and take turns, in a new order every round (`common.round_orders`): for a TP=1 turn
rank 0 computes with 2 threads while rank 1 waits at a barrier. Two 1-thread processes get about
the GEMM throughput of one 2-thread process here, so what separates the two codes is communication and replicated work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.bench.common import BenchShape, round_orders, summary, timed_between_barriers


def worker(shape: BenchShape, repeats: int, warmup: int = 1) -> dict:
    """Runs on both ranks of a world of 2; rank 0 returns timings and communication counts. `warmup`: untimed
    rounds first (a quick run's 0)."""
    from shardlm.bench.torch_tp import PlainGPT, parallelize, training_step
    from shardlm.parallel import ParallelContext

    rank = dist.get_rank()
    tp2 = shape.trainer(ParallelContext.from_process_group(2), tp=2)
    dp2 = shape.trainer(ParallelContext.from_process_group(1), tp=1)
    tp1 = shape.trainer(ParallelContext.single()) if rank == 0 else None
    batch = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length + 1),
                          generator=torch.Generator().manual_seed(0))
    dims = (shape.num_layers, shape.hidden_size, shape.num_heads, shape.seq_length, shape.vocab_size)
    torch.manual_seed(0)
    plain_tp2 = training_step(parallelize(PlainGPT(*dims), 2), batch)
    plain_tp1 = training_step(PlainGPT(*dims), batch) if rank == 0 else None

    programs = {
        "shardlm_tp1": (lambda: tp1.train_step(), rank == 0, 2),
        "shardlm_tp2": (tp2.train_step, True, 1),
        "torch_tp1": (plain_tp1, rank == 0, 2),
        "torch_tp2": (plain_tp2, True, 1),
    }
    for _ in range(warmup):
        for run, here, threads in programs.values():
            timed_between_barriers(run, here, threads)
    times = {name: [] for name in programs}
    for order in round_orders(programs, repeats):  # the same orders on both ranks
        for name in order:
            run, here, threads = programs[name]
            times[name].append(timed_between_barriers(run, here, threads))

    torch.set_num_threads(1)
    comm = {}
    for label, trainer in (("tp2", tp2), ("dp2", dp2)):
        trainer.ctx.comm.reset()
        trainer.train_step()
        comm[label] = trainer.ctx.comm.snapshot()
    local_params = {"tp2": sum(p.numel() for p in tp2.params), "dp2": sum(p.numel() for p in dp2.params)}
    return {"times": times, "comm": comm, "local_params": local_params} if rank == 0 else None


def expected_comm(shape: BenchShape, tp: int, dp: int, local_params: int) -> dict:
    """The documented collectives of one training step with one micro-batch per rank (fp32, no
    checkpointing): {"kind/group": {"calls", "elements"}}."""
    layers, b, s, h = shape.num_layers, shape.micro_batch, shape.seq_length, shape.hidden_size
    out = {}
    if tp > 1:
        # per layer 2 forward (g) + 2 backward (f); embedding forward; LM head backward; CE sums; grad norm
        calls = 4 * layers + 1 + 1 + 1 + 1
        elements = (4 * layers + 2) * b * s * h + 2 * b * s + 1
        out["all_reduce/tp"] = {"calls": calls, "elements": elements}
        out["all_reduce_max/tp"] = {"calls": 1, "elements": b * s}
    if dp > 1:
        out["all_reduce/dp"] = {"elements": local_params + 1}  # every gradient once (buckets) + the loss
    return out


def comm_matches(measured: dict, expected: dict) -> dict:
    rows = {}
    for key, want in expected.items():
        got = measured.get(key, {})
        rows[key] = {"measured": {k: got.get(k) for k in want}, "expected": want,
                     "match": all(got.get(k) == v for k, v in want.items())}
    extra = set(measured) - set(expected)
    return {"rows": rows, "unexpected": sorted(extra), "matches": all(r["match"] for r in rows.values()) and not extra}


def tensor_parallel_efficiency(shape: BenchShape, repeats: int, warmup: int = 1) -> dict:
    from shardlm.parallel.spawn import run_workers

    result = run_workers(2, worker, shape, repeats, warmup, threads=1, timeout=1800)[0]
    times = result["times"]
    tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
    eff = {kind: [a / b for a, b in zip(tokens[f"{kind}_tp2"], tokens[f"{kind}_tp1"])] for kind in ("shardlm", "torch")}
    comm = {label: comm_matches(result["comm"][label],
                                expected_comm(shape, 2 if label == "tp2" else 1, 2 if label == "dp2" else 1,
                                              result["local_params"][label]))
            for label in ("tp2", "dp2")}
    return {
        "config": shape.describe() + "; TP=1: 1 process x 2 threads, TP=2: 2 processes x 1 thread",
        "tokens_per_sec": {name: summary(v) for name, v in tokens.items()},
        "shardlm": summary(eff["shardlm"]), "torch_tp": summary(eff["torch"]),
        "comm": {"matches_formula": all(c["matches"] for c in comm.values()), **comm,
                 "measured": result["comm"]},
    }
