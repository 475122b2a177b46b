"""One low-rank adapter: the update `scale * B A x` beside a frozen projection, split as the projection is.

peft's LoRA (Hu et al. 2021): y = W x + scale * B(A(dropout(x))), A (r, in) drawn Kaiming-uniform, B (out, r)
zero, scale alpha / r (rsLoRA: alpha / sqrt(r)). Under tensor parallelism the adapter follows its projection:

- **column** (the projection's output rows split, q/k/v/gate/up/fc): B's rows split with the output
  (`tensor_parallel_dim` 0), A whole on every rank. A sees the projection's input after its `f` (the replicated
  or sequence-gathered x), so the input gradient flows into the projection's own reduction; but each rank's
  gradient of A comes from its rows of B only, a partial sum, which the trainer adds up over TP
  (`sequence_parallel`, the mark `sum_sequence_parallel_gradients` reads).
- **row** (the projection's input columns split, o/down/proj): A's columns split with the input
  (`tensor_parallel_dim` 1), B whole. Each rank's B A x_r is its share of the update, added to the partial
  product before the projection's all-reduce (or reduce-scatter), so the adapter adds no communication; B's
  gradient (from this rank's A x_r) is again partial over TP and summed by the trainer.
- **replicated rows** (Llama's k/v when the KV heads are fewer than TP, or not a multiple: the weight whole on
  every rank, each rank using its heads' rows): A and B whole, applied through `copy_to_tensor_parallel`, whose
  backward sums the ranks' gradient shares, as the projection's weight does.
- **replicated** (MLA's q_a and kv_a, whole on every rank in front of the heads' `f`): A and B whole; under
  sequence parallelism they see this rank's sequence chunk, so their gradients are partial and summed over TP
  (`partial`), exactly as the projection's weight is.

Parameters are drawn from the full (TP=1) tensor's seed, so every layout starts from the same adapter.
Dropout on replicated inputs draws from the default generator (the same mask on every TP rank); on a row
adapter's split input, from the model-parallel generator (`ctx.rng`), as attention dropout does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.parallel import ParallelContext, copy_to_tensor_parallel, invariant

KINDS = ("column", "row", "replicated rows", "replicated")


def kaiming_uniform(shape: tuple[int, int], seed: int, device=None) -> torch.Tensor:
    """peft's A: `nn.init.kaiming_uniform_(a=sqrt(5))` of a (r, in) tensor, U(-1/sqrt(in), 1/sqrt(in)), from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator) * 2 - 1).mul_(bound).to(device)


class LoRA(nn.Module):
    """The adapter of one projection (in, out: its full sizes). forward(x): x (..., in_local) as the
    projection's GEMM sees it -> (..., out_local), the update to add to that GEMM's output (before any
    reduction). `rows`: the replicated-rows kind's slice of output rows this rank computes."""

    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 rslora: bool, ctx: ParallelContext, seed: int, dtype=torch.float32, partial: bool = False):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"adapter kind {kind!r} must be one of {KINDS}")
        self.kind, self.ctx, self.rank_r, self.partial = kind, ctx, rank, partial
        self.scale = alpha / (math.sqrt(rank) if rslora else rank)
        self.dropout = dropout
        tp, device = ctx.tp_size, ctx.device
        a = kaiming_uniform((rank, in_features), seed, device).to(dtype)
        b_rows = out_features // tp if kind == "column" else out_features
        if kind == "row":
            local = in_features // tp
            a = a[:, ctx.tp_rank * local:(ctx.tp_rank + 1) * local]
        self.A = nn.Parameter(a.contiguous())
        self.B = nn.Parameter(torch.zeros(b_rows, rank, dtype=dtype, device=device))
        split, whole = (self.B, self.A) if kind == "column" else (self.A, self.B)
        if kind == "replicated" and partial:
            self.A.sequence_parallel = self.B.sequence_parallel = True  # sequence chunks: summed over TP
        if kind in ("column", "row"):
            split.tensor_parallel_dim = 0 if kind == "column" else 1
            if tp > 1:
                whole.sequence_parallel = True  # partial over TP: summed by the trainer

    def extra_repr(self) -> str:
        return f"{self.kind}, r={self.rank_r}, scale={self.scale:g}, dropout={self.dropout:g}"

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return x
        if (self.kind == "row" or self.partial) and self.ctx.rng is not None:  # inputs that differ per TP rank
            with self.ctx.rng.fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)

    def delta_weight(self) -> torch.Tensor:
        """scale B A, this rank's (out_local, in_local) update of the projection's weight (for merging, and for
        MLA's cached step, which multiplies by kv_b's weight directly)."""
        return (self.B @ self.A) * self.scale

    def forward(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        a, b = self.A, self.B
        if self.kind == "replicated rows":
            a, b = copy_to_tensor_parallel(a, self.ctx.tp), copy_to_tensor_parallel(b, self.ctx.tp)
            b = b if rows is None else b[rows]
        return invariant.linear(invariant.linear(self._dropped(x), a), b) * self.scale
