"""Context parallelism on one CPU (`make bench` section `context_parallel`): memory per rank, speed, balance.

A small Llama (`CP_BENCH`: GQA, 2 layers) at a long sequence (8,192 tokens; `CP_QUICK` for `--quick`):

- memory: the bytes autograd saves for backward in one forward of one sequence, per rank, at C = 1 (this
  process), 2 and 4 (a world of 4; `shardlm.plan.measure.saved_activation_bytes`), against 1/C of C = 1's;
- a memory cap (`CAP_BENCH`: the Llama at 16,384 tokens, `RLIMIT_DATA` 0.75 GiB per process,
  `shardlm.bench.memory_cap`): one process runs out of memory in its first step, 4 processes under the same cap
  each train 2 steps, with the losses and gradient norms of an uncapped one-process run;
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

from shardlm.bench.common import round_orders, summary, timed_between_barriers, torch_threads


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
            "train": {"micro_batch_size": 1, "global_batch_size": 1, "steps": 1000, "lr": 1e-3, "precision": "fp32"}})

    def describe(self) -> str:
        return (f"Llama {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads "
                f"({self.num_kv_heads} KV), sequence {self.seq_length}, vocabulary {self.vocab_size}, fp32, one "
                "sequence per step")


CP_BENCH = CPShape()
CP_QUICK = CPShape(hidden_size=64, ffn_hidden_size=128, seq_length=256, vocab_size=512)

CAP_BENCH = (CPShape(seq_length=16384), 3 * 2**28)
"""Shape and per-process cap (bytes) of the memory-cap demonstration. The smallest caps that train 2 steps (found
by bisection, 8 MiB apart): one process 1.00 GiB, each rank of C = 4 0.58 GiB; a process holds 0.27 GiB at start."""
CAP_QUICK = (CPShape(hidden_size=64, ffn_hidden_size=128, seq_length=8192), 2**29)
"""The same at a small size (`--quick`): one process needs 0.57 GiB, each rank of C = 4 0.45 GiB."""
CAP_CONTEXT, CAP_STEPS, CAP_TOLERANCE = 4, 2, 1e-5


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
    from shardlm.data.zigzag import zigzag_chunks
    from shardlm.parallel.ring_attention import CAUSAL, EMPTY, attention_block, block_kind

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
    with torch_threads(1):
        for _ in range(repeats):  # rounds over every (split, rank), so that a busy moment hits them all alike
            for key, kinds in blocks.items():
                start = time.perf_counter()
                for kind in kinds:
                    if kind != EMPTY:
                        attention_block(q, kv, kv, kind == CAUSAL, head_dim ** -0.5, "auto")
                runs[key].append(time.perf_counter() - start)
        out = {}
        for name in splits:
            seconds = [min(runs[name, rank]) for rank in range(context)]
            out[name] = {"seconds_per_rank": [round(t, 6) for t in seconds], "spread": max(seconds) / min(seconds) - 1}
    return out


def memory_cap_demo(shape: CPShape, cap_bytes: int, context: int = CAP_CONTEXT, steps: int = CAP_STEPS) -> dict:
    """Train `shape` for `steps` steps in one process and over `context` processes, each process capped at
    `cap_bytes` of private writable memory, and in one uncapped process (the reference). Returns each run's
    result (`shardlm.bench.memory_cap.capped_training`), the largest relative difference of the split run's
    losses and gradient norms from the reference's, and `demonstrated`: one capped process ran out of memory in
    step 1 while the split run trained every step, equal to the reference within `CAP_TOLERANCE`."""
    from shardlm.bench.memory_cap import capped_training
    from shardlm.parallel.spawn import run_workers

    def train(c: int, cap: int | None) -> dict:
        try:
            return run_workers(c, capped_training, shape.config(c), _Tokens(shape), cap, steps, timeout=1800)[0]
        except RuntimeError as error:  # e.g. one rank out of memory while its peers wait in a collective
            return {"error": str(error).strip().splitlines()[-1][:300]}

    one, split, reference = train(1, cap_bytes), train(context, cap_bytes), train(1, None)
    difference = None
    if "losses" in split and "losses" in reference:
        pairs = list(zip(split["losses"] + split["grad_norms"], reference["losses"] + reference["grad_norms"]))
        difference = max(abs(a - b) / abs(b) for a, b in pairs)
    return {
        "config": shape.describe(), "cap_bytes": int(cap_bytes), "limit": "RLIMIT_DATA", "context": context,
        "steps": steps, "one_process": one, "split": split, "reference_uncapped": reference,
        "max_relative_difference": difference,
        "demonstrated": (one.get("out_of_memory") == "step 1" and len(split.get("losses", [])) == steps
                         and difference is not None and difference <= CAP_TOLERANCE),
    }


def context_parallel_bench(quick: bool, repeats: int) -> dict:
    """The `context_parallel` section of `make bench`."""
    from shardlm.parallel import ParallelContext
    from shardlm.parallel.spawn import run_workers

    shape = CP_QUICK if quick else CP_BENCH
    saved = {1: _saved_bytes(shape, ParallelContext.single())}
    saved.update(run_workers(4, memory_worker, shape, timeout=1800)[0])
    memory = [{"context": c, "saved_bytes": saved[c], "one_over_c_of_c1": saved[1] / c,
               "ratio_to_one_over_c": saved[c] / (saved[1] / c)} for c in (1, 2, 4)]
    times = run_workers(2, speed_worker, shape, repeats, timeout=1800)[0]
    rates = {name: [shape.seq_length / t for t in ts] for name, ts in times.items()}
    return {
        "config": shape.describe(),
        "memory": {"rows": memory},
        "memory_cap": memory_cap_demo(*(CAP_QUICK if quick else CAP_BENCH)),
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
    e = r["cp2_efficiency"]
    lines += ["", *memory_cap_lines(r["memory_cap"]),
              "", f"CP = 2 (2 processes x 1 thread) / one process x 2 threads, tokens/s: median {e['median']:.2f} "
              f"(min {e['min']:.2f}, max {e['max']:.2f}).", "",
              "Per-rank causal attention time at C = 4 (forward blocks, one thread):", "",
              "| split | seconds per rank | spread (max / min - 1) |", "|---|---|---|"]
    for name, b in r["balance"].items():
        per_rank = ", ".join(f"{s:.3f}" for s in b["seconds_per_rank"])
        lines.append(f"| {name} | {per_rank} | {b['spread']:.0%} |")
    return lines + [""]


def memory_cap_lines(m: dict) -> list[str]:
    """The memory-cap demonstration's paragraph of BENCHMARKS.md."""
    gib, c = m["cap_bytes"] / 2**30, m["context"]
    one, split, reference = m["one_process"], m["split"], m["reference_uncapped"]

    def outcome(run: dict, label: str) -> str:
        if "out_of_memory" in run:
            return f"{label} out of memory at {run['out_of_memory']} ({run['error']})"
        if "error" in run:
            return f"{label} failed ({run['error']})"
        peaks = ", ".join(f"{p / 2**30:.2f}" for p in run["peak_resident_bytes"])
        return f"{label} trains {len(run['losses'])} steps (peak resident GiB per process: {peaks})"

    lines = [f"Memory cap {gib:.2f} GiB per process (`{m['limit']}`, set in each worker before the model is built), "
             f"{m['config']}: {outcome(one, 'C = 1')}; {outcome(split, f'C = {c}')}."]
    if m["max_relative_difference"] is not None:
        losses = ", ".join(f"{x:.6f}" for x in split["losses"])
        lines.append(f"Losses at C = {c}: {losses}; the uncapped C = 1 run's losses and gradient norms differ by at "
                     f"most {m['max_relative_difference']:.1e} (relative); {outcome(reference, 'uncapped C = 1')}.")
    verdict = "demonstrated" if m["demonstrated"] else "NOT demonstrated"
    return lines + [f"A sequence too long for one process's memory trains split over C = {c}: {verdict}."]
