"""Tensor-parallel layers: column- and row-parallel linears, the vocabulary-parallel embedding, and the linear every
TP rank holds whole (`ReplicatedLinear`).

Weights are stored as `(out_features, in_features)` like `nn.Linear`. A column-parallel layer keeps
rows `[r*out/p, (r+1)*out/p)` of the full weight (its output is split), a row-parallel layer keeps
the matching columns of the input dimension (its input is split). Paired as column -> row, they
need one all-reduce forward (`g`, in the row layer) and one backward (`f`, in the column layer).
Initialization draws from the full weight's seed (see `shardlm.parallel.init`), so shards at any TP
size concatenate to the TP=1 weight.

With `sequence_parallel`, the replicated activations around a column -> row pair are split along the
sequence instead: the column layer all-gathers its input (`f_sp`), the row layer reduce-scatters its
output (`g_sp`), and parameters applied to sequence chunks (the row layer's bias) are marked
`sequence_parallel`, telling the trainer to sum their gradients over the TP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.parallel import invariant
from shardlm.parallel.comm import Communicator
from shardlm.parallel.init import normal_shard
from shardlm.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel={denominator}")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows across the TP group.

    x: (..., in_features), replicated on every TP rank -> (..., out_features / tp), or the gathered
    (..., out_features) when `gather_output`. With `skip_bias_add` the bias is returned instead of
    added, as `(y, bias)`, so the caller can fuse it into the next elementwise op.
    Communication: all-reduce of the input gradient backward (`f`); all-gather when gathering. With
    `sequence_parallel`, x is this rank's sequence chunk (B, T / tp, in_features), all-gathered forward
    and its gradient reduce-scattered backward.
    """

    def __init__(self, in_features: int, out_features: int, tp: Communicator, *, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False, std: float = 0.02,
                 seed: int = 0, device=None, dtype=torch.float32, sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        local = divide(out_features, tp.size, "out_features")
        start = tp.rank * local
        self.weight = nn.Parameter(normal_shard((out_features, in_features), std, seed, 0, start,
                                                start + local, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype, device=device)) if bias else None
        self.weight.tensor_parallel_dim = 0
        if self.bias is not None:
            self.bias.tensor_parallel_dim = 0
        self.lora = None  # a low-rank adapter (`shardlm.lora`), added to the GEMM's output when set

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output columns for an input already past the layer's `f` (replicated or sequence-gathered,
        as when one `f` serves several layers): the GEMM, the bias unless `skip_bias_add`, the adapter's update."""
        y = invariant.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return y if self.lora is None else y + self.lora(x)

    def forward(self, x: torch.Tensor):
        x = gather_from_sequence_parallel(x, self.tp) if self.sequence_parallel else copy_to_tensor_parallel(x, self.tp)
        y = self.local(x)
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.tp)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns across the TP group.

    x: (..., in_features / tp) when `input_is_parallel` (the output of a column-parallel layer),
    else the full (..., in_features), which is scattered here. Returns (..., out_features),
    replicated. The partial products are all-reduced (`g`) and the bias is added once, after the
    reduction; with `skip_bias_add` it is returned as `(y, bias)` instead. With `sequence_parallel` the
    partial products are reduce-scattered along the sequence instead: (B, T / tp, out_features).
    """

    def __init__(self, in_features: int, out_features: int, tp: Communicator, *, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False, std: float = 0.02,
                 seed: int = 0, device=None, dtype=torch.float32, sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        local = divide(in_features, tp.size, "in_features")
        start = tp.rank * local
        self.weight = nn.Parameter(normal_shard((out_features, in_features), std, seed, 1, start,
                                                start + local, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.weight.tensor_parallel_dim = 1
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True
        self.lora = None  # a low-rank adapter (`shardlm.lora`): its update joins the partial product, then reduced

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.tp)
        if self.tp.size == 1 and not self.skip_bias_add:  # nothing to reduce: the bias goes into the GEMM (addmm)
            y = invariant.linear(x, self.weight, self.bias)
            return y if self.lora is None else y + self.lora(x)
        reduce = reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_tensor_parallel
        partial = invariant.linear(x, self.weight)
        y = reduce(partial if self.lora is None else partial + self.lora(x), self.tp)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary across the TP group.

    Rank r holds rows `[r*V/p, (r+1)*V/p)` of the (padded) table. ids: (...) int64 ->
    (..., embedding_dim), replicated. Ids outside this rank's range are looked up as row 0 and
    their output rows zeroed, then the partial lookups are all-reduced (`g`): one all-reduce
    forward, none backward. Rows >= `vocab_size` (padding) are initialized to zero. With
    `sequence_parallel`, ids (B, T) give this rank's sequence chunk (B, T / tp, embedding_dim): the
    partial lookups are reduce-scattered instead.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: Communicator, *,
                 vocab_size: int | None = None, std: float = 0.02, seed: int = 0, device=None,
                 dtype=torch.float32, sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size
        local = divide(num_embeddings, tp.size, "padded vocabulary size")
        self.vocab_start, self.vocab_end = tp.rank * local, (tp.rank + 1) * local
        self.weight = nn.Parameter(normal_shard((num_embeddings, embedding_dim), std, seed, 0,
                                                self.vocab_start, self.vocab_end,
                                                valid_rows=self.vocab_size, dtype=dtype, device=device))
        self.weight.tensor_parallel_dim = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        reduce = reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_tensor_parallel
        return reduce(partial, self.tp)


class ReplicatedLinear(nn.Module):
    """x (..., in) -> (..., out) by a (out, in) weight every TP rank holds whole, without bias (marked
    `sequence_parallel` when it sees sequence chunks, so the trainer sums its partial gradients over TP)."""

    def __init__(self, shape: tuple[int, int], std: float, seed: int, device, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(normal_shard(shape, std, seed, device=device))
        if sequence_parallel:
            self.weight.sequence_parallel = True
        self.lora = None  # a low-rank adapter (`shardlm.lora`, kind "replicated"), added when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return y if self.lora is None else y + self.lora(x)
