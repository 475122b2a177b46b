"""The paper's conjugate communication operators, as autograd functions.

    f  = copy_to_tensor_parallel      forward: identity       backward: all-reduce
    g  = reduce_from_tensor_parallel  forward: all-reduce     backward: identity
         scatter_to_tensor_parallel   forward: keep my slice  backward: all-gather
         gather_from_tensor_parallel  forward: all-gather     backward: keep my slice

Sequence parallelism (Korthikanti et al. 2022) splits the regions that TP replicates (LayerNorms,
dropouts, residual adds) along the sequence instead, and replaces `f` and `g` by their sequence
twins, with the same communication volume (an all-reduce is a reduce-scatter plus an all-gather):

    f_sp = gather_from_sequence_parallel        forward: all-gather seq  backward: reduce-scatter seq
    g_sp = reduce_scatter_to_sequence_parallel  forward: reduce-scatter  backward: all-gather seq
           scatter_to_sequence_parallel         forward: keep my chunk   backward: all-gather seq

`f` enters a parallel region (its input is replicated, its users are split), `g` leaves one.
Scatter and gather split or join the last dimension in tensor-parallel rank order (the sequence
operators: dimension 1 of a (B, T, h) activation, in chunks of T / tp). All talk only to the
tensor-parallel group they are given and are identities at TP=1.
"""

from __future__ import annotations

import torch

from shardlm.data.zigzag import zigzag_positions
from shardlm.parallel.comm import Communicator


def _split_last_dim(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    size = x.shape[-1]
    if size % tp.size != 0:
        raise ValueError(f"last dimension {size} is not divisible by tensor parallel size {tp.size}")
    chunk = size // tp.size
    return x[..., tp.rank * chunk:(tp.rank + 1) * chunk].contiguous()


def _gather_last_dim(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    return torch.cat(tp.all_gather(x.contiguous()), dim=-1)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split_last_dim(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.tp), None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_last_dim(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.tp), None


def copy_to_tensor_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """`f`: identity forward, all-reduce of the gradient over the TP group backward. x: any shape."""
    return x if tp.size == 1 else _CopyToTensorParallel.apply(x, tp)


def reduce_from_tensor_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """`g`: all-reduce (sum) over the TP group forward, identity backward. x: any shape."""
    return x if tp.size == 1 else _ReduceFromTensorParallel.apply(x, tp)


def scatter_to_tensor_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """(..., n) -> (..., n / tp): this rank's slice of the last dimension; backward all-gathers."""
    return x if tp.size == 1 else _ScatterToTensorParallel.apply(x, tp)


def gather_from_tensor_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """(..., n / tp) -> (..., n): all-gather along the last dimension; backward keeps the slice."""
    return x if tp.size == 1 else _GatherFromTensorParallel.apply(x, tp)


SEQUENCE_DIM = 1  # activations are (B, T, h)


def _split_sequence(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    size = x.shape[SEQUENCE_DIM]
    if size % tp.size != 0:
        raise ValueError(f"sequence length {size} is not divisible by tensor parallel size {tp.size}")
    return x.chunk(tp.size, dim=SEQUENCE_DIM)[tp.rank].contiguous()


def _gather_sequence(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    return torch.cat(tp.all_gather(x.contiguous()), dim=SEQUENCE_DIM)


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.tp), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(grad.contiguous(), dim=SEQUENCE_DIM), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return tp.reduce_scatter(x.contiguous(), dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.tp), None


def gather_zigzag_rows(x: torch.Tensor, cp: Communicator) -> torch.Tensor:
    """(B, T / C, ...) this CP rank's zigzag part -> (B, T, ...) every rank's parts in the row's order; the backward
    sums the ranks' gradients and keeps this rank's part (a reduce-scatter)."""
    if cp.size == 1:
        return x
    gathered = gather_from_sequence_parallel(x, cp)  # rank order: each rank's two zigzag chunks
    length = gathered.shape[1]
    order = torch.cat([zigzag_positions(length, cp.size, r, x.device) for r in range(cp.size)])
    return gathered.index_select(1, torch.argsort(order))


def sum_over(x: torch.Tensor, group: Communicator) -> torch.Tensor:
    """The sum of every rank's partial sums x (any shape) over `group`, all-reduced in the forward and in the
    backward (`g`, then `f`): for a statistic each rank sums over its own part (channels, tokens) and then uses on
    its own part, so that each rank's gradient gets every rank's use of the sum."""
    return copy_to_tensor_parallel(reduce_from_tensor_parallel(x, group), group)


def scatter_to_sequence_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """(B, T, h) -> (B, T / tp, h): this rank's chunk of the sequence; backward all-gathers."""
    return x if tp.size == 1 else _ScatterToSequenceParallel.apply(x, tp)


def gather_from_sequence_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """`f` of sequence parallelism: (B, T / tp, h) -> (B, T, h) all-gathered; backward reduce-scatters the
    gradient (the sum of the column-parallel layer's partial input gradients) back to the chunks."""
    return x if tp.size == 1 else _GatherFromSequenceParallel.apply(x, tp)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """`g` of sequence parallelism: (B, T, h) partial sums -> (B, T / tp, h) this rank's chunk of their
    sum over the TP group; backward all-gathers."""
    return x if tp.size == 1 else _ReduceScatterToSequenceParallel.apply(x, tp)
