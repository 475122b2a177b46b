"""Context parallelism on one CPU (`make bench` section `context_parallel`): memory per rank, speed, balance.

A small Llama (`CP_BENCH`: GQA, 2 layers) at a long sequence (8,192 tokens; `CP_QUICK` for `--quick`):

- memory: the bytes autograd saves for backward in one forward of one sequence, per rank, at C = 1 (this
  process), 2 and 4 (a world of 4; `shardlm.plan.measure.saved_activation_bytes`), against 1/C of C = 1's;
  and the memory budget between C = 4's and C = 1's that only the split fits in;
- speed: one training step at CP = 2 (2 processes x 1 thread, each half of every sequence, K/V around the
  ring) against one process x 2 threads on the same batch, in alternating rounds (`common.round_orders`);
- balance: per-rank causal attention time (forward blocks of L x L, the CPU flash kernel, one thread) at
  C = 4 with the zigzag split (chunks r and 2C-1-r) and with a contiguous split (chunks 2r, 2r+1): the
  spread is the slowest rank's time over the fastest's, minus 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from shardlm.bench.common import round_orders, summary, timed_between_barriers


@dataclass(frozen=True)
class CPShape:
    """A small Llama at a long sequence."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 256
    seq_length: int = 8192
    vocab_size: int = 4096

    def config(self, context: int = 1):
        from shardlm.config import from_dict

        return from_dict({
            "model": {"arch": "llama", "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                      "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                      "ffn_hidden_size": self.ffn_hidden_size, "seq_length": self.seq_length,
                      "vocab_size": self.vocab_size, "dropout": 0.0},
            "parallel": {"context": context}, "data": {"text_file": "unused"},
            "train": {"micro_batch_size": 1, "global_batch_size": 1, "steps": 1000, "lr": 1e-3}})

    def describe(self) -> str:
        return (f"Llama {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads "
                f"({self.num_kv_heads} KV), sequence {self.seq_length}, vocabulary {self.vocab_size}, fp32, one "
                "sequence per step")


CP_BENCH = CPShape()
CP_QUICK = CPShape(hidden_size=64, ffn_hidden_size=128, seq_length=256, vocab_size=512)


class _Tokens:
    """Random sequences of seq_length + 1 tokens (the trainer's dataset interface)."""

    def __init__(self, shape: CPShape):
        self.shape = shape

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng(index)
        return rng.integers(0, self.shape.vocab_size, self.shape.seq_length + 1, dtype=np.int64)


def _saved_bytes(shape: CPShape, ctx) -> int:
    """Bytes autograd saves in one forward + backward of this rank's part of one sequence."""
    from shardlm.models import build_model
    from shardlm.plan.measure import saved_activation_bytes
    from shardlm.training.data import context_parallel_part

    config = shape.config(ctx.cp_size)
    model = build_model(config.model, ctx)
    inputs, targets = context_parallel_part(torch.from_numpy(_Tokens(shape)[0]).unsqueeze(0), ctx.cp_size,
                                            ctx.cp_rank)
    return saved_activation_bytes(model, lambda: model(inputs, targets).mean().backward(),
                                  list(model.layers.values())).total


def memory_worker(shape: CPShape) -> dict | None:
    """In a world of 4: rank 0's saved bytes at C = 4 and at C = 2 (DP = 2)."""
    from shardlm.parallel import ParallelContext

    out = {}
    for context in (4, 2):
        out[context] = _saved_bytes(shape, ParallelContext.from_process_group(1, context_parallel=context))
    return out if dist.get_rank() == 0 else None


def speed_worker(shape: CPShape, repeats: int) -> dict | None:
    """In a world of 2: seconds per training step at CP = 2 (1 thread per rank) and of one process x 2
    threads (rank 0; rank 1 waits), in alternating rounds."""
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    rank = dist.get_rank()
    cp2 = Trainer(shape.config(2), ParallelContext.from_process_group(1, context_parallel=2), _Tokens(shape))
    one = Trainer(shape.config(1), ParallelContext.single(), _Tokens(shape)) if rank == 0 else None
    programs = {"cp2": (cp2.train_step, True, 1), "one_process": (lambda: one.train_step(), rank == 0, 2)}
    for run, here, threads in programs.values():  # warm-up
        timed_between_barriers(run, here, threads)
    times = {name: [] for name in programs}
    for order in round_orders(programs, repeats):
        for name in order:
            run, here, threads = programs[name]
            times[name].append(timed_between_barriers(run, here, threads))
    return times if rank == 0 else None


def attention_balance(shape: CPShape, context: int, repeats: int) -> dict:
    """Per-rank seconds of the causal attention blocks (forward) its queries need at C = `context`, zigzag
    and contiguous splits, one thread, the least of `repeats` rounds; the spread max / min - 1 of each."""
    from shardlm.parallel.context import CAUSAL, EMPTY, _block_forward, block_kind, zigzag_chunks

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    chunks = 2 * context
    length = shape.seq_length // chunks
    head_dim = shape.hidden_size // shape.num_heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, shape.num_heads, length, head_dim, generator=g)
    kv = torch.randn(1, shape.num_kv_heads, length, head_dim, generator=g)
    splits = {"zigzag": lambda r: zigzag_chunks(context, r), "contiguous": lambda r: (2 * r, 2 * r + 1)}
    blocks = {(name, rank): [block_kind(i, j) for i in held(rank) for j in range(chunks)]
              for name, held in splits.items() for rank in range(context)}
    runs: dict = {key: [] for key in blocks}
    try:
        for _ in range(repeats):  # rounds over every (split, rank), so that a busy moment hits them all alike
            for key, kinds in blocks.items():
                start = time.perf_counter()
                for kind in kinds:
                    if kind != EMPTY:
                        _block_forward(q, kv, kv, kind == CAUSAL, head_dim ** -0.5, "auto")
                runs[key].append(time.perf_counter() - start)
        out = {}
        for name in splits:
            seconds = [min(runs[name, rank]) for rank in range(context)]
            out[name] = {"seconds_per_rank": [round(t, 6) for t in seconds], "spread": max(seconds) / min(seconds) - 1}
    finally:
        torch.set_num_threads(previous)
    return out


def context_parallel_bench(quick: bool, repeats: int) -> dict:
    """The `context_parallel` section of `make bench`."""
    from shardlm.parallel import ParallelContext
    from shardlm.parallel.spawn import run_workers

    shape = CP_QUICK if quick else CP_BENCH
    saved = {1: _saved_bytes(shape, ParallelContext.single())}
    saved.update(run_workers(4, memory_worker, shape, timeout=1800)[0])
    memory = [{"context": c, "saved_bytes": saved[c], "one_over_c_of_c1": saved[1] / c,
               "ratio_to_one_over_c": saved[c] / (saved[1] / c)} for c in (1, 2, 4)]
    budget = (saved[1] + saved[4]) // 2
    times = run_workers(2, speed_worker, shape, repeats, timeout=1800)[0]
    rates = {name: [shape.seq_length / t for t in ts] for name, ts in times.items()}
    return {
        "config": shape.describe(),
        "memory": {"rows": memory, "budget_bytes": budget, "fits_at_c1": saved[1] <= budget,
                   "fits_at_c4": saved[4] <= budget},
        "cp2_tokens_per_sec": summary(rates["cp2"]),
        "one_process_tokens_per_sec": summary(rates["one_process"]),
        "cp2_efficiency": summary([a / b for a, b in zip(rates["cp2"], rates["one_process"])]),
        "balance": attention_balance(shape, 4, max(3, repeats)),
    }


def markdown_lines(r: dict) -> list[str]:
    """The section of BENCHMARKS.md."""
    lines = ["## Context parallelism (`context_parallel`)", "", f"Config: {r['config']}.", "",
             "Bytes saved for backward per rank (one forward + backward of one sequence):", "",
             "| C | saved MB per rank | C = 1's / C | ratio |", "|---|---|---|---|"]
    for row in r["memory"]["rows"]:
        lines.append(f"| {row['context']} | {row['saved_bytes'] / 1e6:.1f} | {row['one_over_c_of_c1'] / 1e6:.1f} | "
                     f"{row['ratio_to_one_over_c']:.2f} |")
    m, e = r["memory"], r["cp2_efficiency"]
    verdict = {True: "fits", False: "does not fit"}
    lines += ["", f"A budget of {m['budget_bytes'] / 1e6:.1f} MB of saved activations per rank: C = 1 "
              f"{verdict[m['fits_at_c1']]}, C = 4 {verdict[m['fits_at_c4']]}.",
              "", f"CP = 2 (2 processes x 1 thread) / one process x 2 threads, tokens/s: median {e['median']:.2f} "
              f"(min {e['min']:.2f}, max {e['max']:.2f}).", "",
              "Per-rank causal attention time at C = 4 (forward blocks, one thread):", "",
              "| split | seconds per rank | spread (max / min - 1) |", "|---|---|---|"]
    for name, b in r["balance"].items():
        per_rank = ", ".join(f"{s:.3f}" for s in b["seconds_per_rank"])
        lines.append(f"| {name} | {per_rank} | {b['spread']:.0%} |")
    return lines + [""]
