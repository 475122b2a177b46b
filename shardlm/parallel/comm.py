"""Communication accounting: every collective the parallel code issues, counted by kind, group and bytes.

The counter is a plain dict update per call, cheap enough to stay on in production. Tests and
benchmarks read it to check the paper's communication pattern (two all-reduces forward and two
backward per transformer layer, O(batch x sequence) scalars for the parallel cross-entropy).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardlm.parallel.graph_break import graph_break


@dataclass
class CommStats:
    """Totals of collective calls, keyed by (kind, group name).

    `calls[(kind, group)]` is the number of calls, `bytes[(kind, group)]` the payload bytes of the
    local tensor (what one rank hands to the collective), `elements[(kind, group)]` its element count.
    """

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    elements: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, group: str, tensor: torch.Tensor) -> None:
        key = (kind, group)
        self.calls[key] += 1
        self.bytes[key] += tensor.numel() * tensor.element_size()
        self.elements[key] += tensor.numel()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.elements.clear()

    def count(self, kind: str | None = None, group: str | None = None) -> int:
        """Number of calls matching kind and group (None matches any)."""
        return sum(n for (k, g), n in self.calls.items() if kind in (None, k) and group in (None, g))

    def total_bytes(self, kind: str | None = None, group: str | None = None) -> int:
        return sum(n for (k, g), n in self.bytes.items() if kind in (None, k) and group in (None, g))

    def snapshot(self) -> dict:
        """A JSON-friendly copy: {"kind/group": {"calls": n, "bytes": b, "elements": e}}."""
        return {
            f"{k}/{g}": {"calls": self.calls[(k, g)], "bytes": self.bytes[(k, g)],
                         "elements": self.elements[(k, g)]}
            for (k, g) in sorted(self.calls)
        }


class Communicator:
    """Collectives on one process group, recorded in a shared `CommStats`.

    A communicator of size 1 (or without a process group) makes every collective a no-op that is not
    counted: TP=1 and DP=1 communicate nothing. With `shared_memory=True` (CPU tensors) all-reduce,
    all-gather and reduce-scatter go through a shared-memory segment when every rank of the group is
    on this machine (`shardlm.parallel.shm`, several times faster than gloo's loopback TCP);
    otherwise, and for everything else, through the process group. Building such a communicator is
    collective over its group (the ranks agree on the segment). Under `torch.compile` (`train.compile`)
    each collective is a graph break: the compiler runs it as it is rather than tracing into it.
    """

    def __init__(self, name: str, group, size: int, rank: int, stats: CommStats,
                 shared_memory: bool = False, timeout_s: float | None = None):
        self.name = name
        self.group = group
        self.size = size
        self.rank = rank
        self.stats = stats
        self.timeout_s = timeout_s
        self.shm = None
        """The group's `SharedMemoryGroup`, or None when its collectives go through the process group."""
        if shared_memory and size > 1:
            from shardlm.parallel.shm import SharedMemoryGroup

            self.shm = SharedMemoryGroup.connect(group, size, rank, timeout_s)

    @graph_break
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of `tensor` over this group; returns it."""
        if self.size == 1:
            return tensor
        kind = "all_reduce_max" if op == dist.ReduceOp.MAX else "all_reduce"
        self.stats.record(kind, self.name, tensor)
        if self.shm is not None and op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            return self.shm.all_reduce(tensor, op)
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    @graph_break
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather equal-shaped tensors from every rank of the group, in rank order."""
        if self.size == 1:
            return [tensor]
        self.stats.record("all_gather", self.name, tensor)
        if self.shm is not None and (out := self.shm.all_gather(tensor)) is not None:
            return out
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    @graph_break
    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum `tensor` over the group and return this rank's chunk of the sum along `dim` (equal chunks,
        in rank order). Recorded with the bytes of the whole input, as an all-reduce of it would be."""
        if self.size == 1:
            return tensor
        self.stats.record("reduce_scatter", self.name, tensor)
        chunks = [c.contiguous() for c in tensor.chunk(self.size, dim=dim)]
        if self.shm is not None and (out := self.shm.reduce_scatter(chunks)) is not None:
            return out
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks, group=self.group)
        return out

    @graph_break
    def broadcast(self, tensor: torch.Tensor, src_rank_in_group: int = 0) -> torch.Tensor:
        if self.size == 1:
            return tensor
        self.stats.record("broadcast", self.name, tensor)
        src = src_rank_in_group if self.group is None else dist.get_global_rank(self.group, src_rank_in_group)
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    def all_gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(every rank's rows of `tensor` (n_r, ...) concatenated in rank order, this rank's first row's index among
        them): the row counts may differ between ranks (each rank's padded to the largest for the all-gather)."""
        if self.size == 1:
            return tensor, 0
        counts = [int(n) for n in self.all_gather(torch.tensor([len(tensor)], device=tensor.device))]
        padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
        padded[:len(tensor)] = tensor
        gathered = self.all_gather(padded)
        return torch.cat([part[:n] for part, n in zip(gathered, counts)]), sum(counts[:self.rank])

    def all_gather_object(self, obj) -> list:
        """Gather a picklable object from every rank (small metadata only; not counted)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out
