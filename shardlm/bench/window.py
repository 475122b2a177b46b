"""What a sliding window saves in attention, measured (`make bench` section `window`).

gpt-oss's alternate layers see only the last `window` tokens. On one long sequence (`WINDOW_BENCH`: 8,192
tokens, a window of 256, grouped-query heads, a sink logit per head, fp32), forward + backward of:

- the ring at CP = 2 (`context_parallel_attention`, 2 gloo processes x 1 thread, each rank its zigzag half):
  with the window (key blocks wholly outside it skipped, the blocks it cuts run tile by tile) against
  without it (causal), in alternating rounds, timed between barriers (the slower rank's time); the blocks
  each rank computed and skipped per pass (`BlockCounts`) with and without the window;
- one process x 1 thread (as each ring rank): `tiled_attention` with the window (tiles of the window rounded
  up to 64, key tiles outside a query tile's window skipped) and without it (one causal block), and PyTorch's
  causal SDPA (no sink, no window: the baseline of plain causal attention), in alternating rounds. (One
  thread: on a busy 2-core machine, 2 threads over many small tiles spend more time waiting for each other
  than computing.)

Savings are 1 - time with the window / time without, per round; the fraction of the causal triangle a window
keeps (`kept_fraction`) is the saving an ideal kernel would reach, stated next to the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.bench.common import interleaved, median_cell, round_orders, summary, timed_between_barriers, torch_threads


@dataclass(frozen=True)
class WindowShape:
    """One sequence of `seq_length` tokens, `num_heads` query heads over `num_kv_heads` KV heads of `head_dim`,
    a sliding `window`."""

    seq_length: int = 8192
    window: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64

    def inputs(self, seed: int = 0):
        """q (1, H, T, d), k and v (1, Hkv, T, d), sinks (H,), dout (1, H, T, d): fp32, fixed seed."""
        g = torch.Generator().manual_seed(seed)
        T, d = self.seq_length, self.head_dim
        q = torch.randn(1, self.num_heads, T, d, generator=g)
        k, v = (torch.randn(1, self.num_kv_heads, T, d, generator=g) for _ in range(2))
        return q, k, v, torch.randn(self.num_heads, generator=g), torch.randn(1, self.num_heads, T, d, generator=g)

    @property
    def kept_fraction(self) -> float:
        """(query, key) pairs the window keeps / pairs of the causal triangle."""
        T, W = self.seq_length, min(self.window, self.seq_length)
        return (T * W - W * (W - 1) / 2) / (T * (T + 1) / 2)

    def describe(self) -> str:
        return (f"one sequence of {self.seq_length} tokens, {self.num_heads} heads ({self.num_kv_heads} KV) of "
                f"{self.head_dim}, a sink per head, window {self.window}, fp32, forward + backward")


WINDOW_BENCH = WindowShape()
WINDOW_QUICK = WindowShape(seq_length=512, window=32, head_dim=16)
"""`--quick`: chunks of 128 at CP = 2, tiles of 64: the ring still runs the blocks the window cuts in tiles."""


def _forward_backward(attention, q, k, v, sinks, dout):
    """A program: attention(q, k, v, sinks) forward, then its backward from `dout` (fresh leaves each call)."""
    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)] + [None if sinks is None
                                                                     else sinks.detach().requires_grad_()]
        out = attention(*leaves)
        out.backward(dout)
    return run


def ring_worker(shape: WindowShape, repeats: int) -> dict:
    """In a world of 2 (CP = 2, 1 thread per rank): this rank's block counts with and without the window and,
    on rank 0, seconds per forward + backward of each, in alternating rounds between barriers."""
    from shardlm.data.zigzag import zigzag_split
    from shardlm.parallel import ParallelContext
    from shardlm.parallel.ring_attention import BlockCounts, context_parallel_attention

    cp = ParallelContext.from_process_group(1, context_parallel=2).cp
    q, k, v, sinks, dout = shape.inputs()
    q, k, v, dout = (zigzag_split(t, cp.size, cp.rank, dim=2) for t in (q, k, v, dout))
    windows = {"window": shape.window, "full": 0}
    counts = {name: BlockCounts() for name in windows}
    programs = {}
    for name, window in windows.items():
        def attention(q, k, v, sinks, window=window, counts=counts[name]):
            return context_parallel_attention(q, k, v, cp, window=window, sinks=sinks, counts=counts)
        programs[name] = _forward_backward(attention, q, k, v, sinks, dout)
    for run in programs.values():  # warm-up, and the counts of one call
        timed_between_barriers(run, True, 1)
    blocks = {name: {"computed": dict(c.computed), "skipped": dict(c.skipped)} for name, c in counts.items()}
    times: dict = {name: [] for name in programs}
    for order in round_orders(programs, repeats):
        for name in order:
            times[name].append(timed_between_barriers(programs[name], True, 1))
    return {"blocks": blocks, **({"seconds": times} if dist.get_rank() == 0 else {})}


def one_process(shape: WindowShape, repeats: int, threads: int = 1) -> dict:
    """Seconds per forward + backward of tiled attention with and without the window and of causal SDPA, one
    process x `threads` threads, alternating rounds; and the tiles computed and skipped with the window."""
    from shardlm.parallel.ring_attention import BlockCounts
    from shardlm.parallel.tiled_attention import tiled_attention

    q, k, v, sinks, dout = shape.inputs()
    counts = BlockCounts()
    groups = shape.num_heads // shape.num_kv_heads
    programs = {
        "tiled_window": _forward_backward(lambda q, k, v, s: tiled_attention(q, k, v, window=shape.window, sinks=s,
                                                                             counts=counts), q, k, v, sinks, dout),
        "tiled_full": _forward_backward(lambda q, k, v, s: tiled_attention(q, k, v, sinks=s), q, k, v, sinks, dout),
        "sdpa_causal": _forward_backward(
            lambda q, k, v, s: F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                              v.repeat_interleave(groups, 1), is_causal=True),
            q, k, v, None, dout),
    }
    with torch_threads(threads):
        programs["tiled_window"]()  # the counts of one call
        tiles = {"computed": dict(counts.computed), "skipped": dict(counts.skipped)}
        seconds = interleaved(programs, repeats, warmup=1)
    return {"seconds": seconds, "tiles": tiles, "threads": threads}


def _saving(with_window: list[float], without: list[float]) -> dict:
    """1 - time with the window / time without, per round."""
    return summary([1 - a / b for a, b in zip(with_window, without)])


def window_bench(quick: bool, repeats: int) -> dict:
    """The `window` section of `make bench`."""
    from shardlm.parallel.spawn import run_workers

    shape = WINDOW_QUICK if quick else WINDOW_BENCH
    ranks = run_workers(2, ring_worker, shape, repeats, timeout=1800)
    ring_s = ranks[0]["seconds"]
    single = one_process(shape, repeats)
    single_s = single["seconds"]
    ms = lambda ts: summary([1000 * t for t in ts])  # noqa: E731
    return {
        "config": shape.describe(), "kept_fraction": shape.kept_fraction,
        "ring": {"window_ms": ms(ring_s["window"]), "full_ms": ms(ring_s["full"]),
                 "saving": _saving(ring_s["window"], ring_s["full"]),
                 "blocks_per_rank": [r["blocks"] for r in ranks]},
        "one_process": {"tiled_window_ms": ms(single_s["tiled_window"]), "tiled_full_ms": ms(single_s["tiled_full"]),
                        "sdpa_causal_ms": ms(single_s["sdpa_causal"]),
                        "saving": _saving(single_s["tiled_window"], single_s["tiled_full"]),
                        "saving_vs_sdpa": _saving(single_s["tiled_window"], single_s["sdpa_causal"]),
                        "tiles": single["tiles"], "threads": single["threads"]},
    }


def markdown_lines(r: dict) -> list[str]:
    """The `window` section of BENCHMARKS.md."""
    ring, one = r["ring"], r["one_process"]

    def blocks(rank: dict, name: str) -> str:
        b = rank[name]
        return f"{b['computed'].get('forward', 0)} computed / {b['skipped'].get('forward', 0)} skipped"

    per_rank = "; ".join(f"rank {i}: {blocks(rank, 'window')} with the window, {blocks(rank, 'full')} without"
                         for i, rank in enumerate(ring["blocks_per_rank"]))
    tiles, threads = one["tiles"], f"{one['threads']} thread" + ("s" if one["threads"] > 1 else "")
    return [
        "## Sliding-window attention (`window`)", "", f"Config: {r['config']}. A window keeps "
        f"{r['kept_fraction']:.1%} of the causal triangle's (query, key) pairs: the saving an ideal kernel would "
        "reach.", "",
        "| program | with the window ms | without ms | saving (1 - with / without, per round) |", "|---|---|---|---|",
        f"| ring, CP = 2 (2 processes x 1 thread) | {median_cell(ring['window_ms'], digits=1)} | "
        f"{median_cell(ring['full_ms'], digits=1)} | **{median_cell(ring['saving'])}** (`window.ring.saving`) |",
        f"| tiled, one process x {threads} | {median_cell(one['tiled_window_ms'], digits=1)} | "
        f"{median_cell(one['tiled_full_ms'], digits=1)} | **{median_cell(one['saving'])}** "
        "(`window.one_process.saving`) |",
        f"| causal SDPA (no sink, no window), one process x {threads} | | "
        f"{median_cell(one['sdpa_causal_ms'], digits=1)} | {median_cell(one['saving_vs_sdpa'])} (tiled with the "
        "window against it) |", "",
        "Ring blocks per rank, forward (its 2 query chunks x the 4 key chunks, each chunk T / 4 tokens): "
        f"{per_rank}. Tiles of the single process with the window, forward: "
        f"{tiles['computed'].get('forward', 0)} computed, {tiles['skipped'].get('forward', 0)} skipped.", ""]
