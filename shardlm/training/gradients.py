"""Gradient reductions the trainer makes by hand (outside DDP), each one coalesced collective.

- `all_reduce_gradients`: average over the data-parallel group, data x context under context
  parallelism (used where DDP is not: pipeline stages, half-precision parameters with fp32 gradient
  buffers).
- `sum_sequence_parallel_gradients`: under sequence parallelism, parameters applied to sequence chunks
  (LayerNorms, row-parallel biases, position embeddings; marked `sequence_parallel`) hold the
  gradient of their chunk only; summing over the tensor-parallel group gives every rank the full one.
- `reduce_expert_gradients`: with experts split over expert-parallel ranks, the one place that says
  which group reduces expert gradients (expert-data-parallel) and what the sum is divided by (DP x C).
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardlm.parallel import Communicator, ParallelContext


def _reduce_in_place(grads: list[torch.Tensor], comm: Communicator, divide: int = 1) -> None:
    """All-reduce `grads` over `comm` as one flat buffer (per dtype), then divide by `divide`."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        buffer = _flatten_dense_tensors(same)
        comm.all_reduce(buffer)
        if divide != 1:
            buffer.div_(divide)
        for grad, reduced in zip(same, _unflatten_dense_tensors(buffer, same)):
            grad.copy_(reduced)


def all_reduce_gradients(grads: list[torch.Tensor], ctx: ParallelContext) -> None:
    """Average gradients over the data x context group `ctx.dp_cp` (the data-parallel group when C = 1;
    one all-reduce per dtype). Each CP rank's gradient is that of its tokens' mean loss, the CP ranks
    hold equally many tokens, so the mean over CP is the gradient of the mean over all the tokens."""
    if ctx.dp_cp.size > 1 and grads:
        _reduce_in_place(grads, ctx.dp_cp, divide=ctx.dp_cp.size)


def sum_sequence_parallel_gradients(params: list[torch.Tensor], ctx: ParallelContext) -> None:
    """Sum the gradients of parameters marked `sequence_parallel` over the TP group (one all-reduce)."""
    grads = [getattr(p, "main_grad", p.grad) for p in params if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if ctx.tp_size > 1 and grads:
        _reduce_in_place(grads, ctx.tp)


def is_split_expert(param: torch.Tensor, ctx: ParallelContext) -> bool:
    """An MoE expert weight whose experts are split over expert-parallel ranks (`parallel.expert` > 1):
    it differs between the ranks of the data x context group, so the dense reduction must skip it."""
    return ctx.ep_size > 1 and getattr(param, "expert_parallel", False)


def expert_gradient_divisor(ctx: ParallelContext) -> int:
    """What the expert-DP sum of an expert gradient is divided by: the whole data x context size DP x C,
    the count the dense gradients are averaged over (`reduce_expert_gradients` says why)."""
    return ctx.dp_cp.size


def reduce_expert_gradients(params: list[torch.Tensor], ctx: ParallelContext) -> None:
    """Expert gradients under expert parallelism: summed over the expert-data-parallel group `ctx.expert_dp`,
    divided by the whole data x context size (`expert_gradient_divisor`: DP x C, DP without CP).

    An expert's gradient on its rank already sums what the tokens of every rank of its EP group sent it
    (the all-to-all's backward brings them back); summing over the DP x C / E ranks that hold the same
    expert adds the other EP groups' tokens, so every (DP, CP) rank's tokens count once; dividing by
    DP x C (not DP x C / E) gives the same mean over those ranks that dense parameters get. Over the dense
    DP group the sum would mix different experts' gradients (Megatron-LM #1628); divided by DP x C / E it
    would be E times too large."""
    grads = [getattr(p, "main_grad", p.grad) for p in params if is_split_expert(p, ctx)]
    grads = [g for g in grads if g is not None]
    if grads:
        _reduce_in_place(grads, ctx.expert_dp, divide=expert_gradient_divisor(ctx))
