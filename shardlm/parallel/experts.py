"""Expert parallelism: moving each token to the ranks that hold its experts, and back.

An MoE layer's E experts are split over the expert-parallel group (`ctx.ep`, carved out of the
data x context-parallel ranks, see `shardlm.parallel.layout`): EP rank r holds experts [r E/ep, (r + 1) E/ep).
Every rank routes its own tokens (under context parallelism its zigzag part of the sequences: routing is
per token, so which positions a rank holds does not matter); a dispatcher then hands each rank's experts
the (token, slot) pairs routed to them and brings the expert outputs back:

    dispatch(tokens (N, h), indices (N, k)) -> (expert_tokens (M, h) grouped by local expert,
                                               counts (E / ep,) rows per local expert, plan)
    combine(expert_out (M, h), plan) -> (N k, h): row t k + j is the output of token t's j-th expert

Both are differentiable: gradients travel the reverse path. `LocalDispatcher` (EP = 1) only sorts
the slots by expert. `AllToAllDispatcher` sends each rank exactly its slots with `all_to_all_single`
(uneven splits; the counts travel first, in one small all-to-all); `AllGatherDispatcher` gathers every
rank's tokens, keeps the slots of the local experts, and returns the outputs with a reduce-scatter
(more bytes: each rank receives all ep N tokens; simple and fine for small EP). Within an expert,
rows keep the order (source rank, token, slot) in both, so the two compute the same sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.parallel.comm import Communicator
from shardlm.parallel.graph_break import graph_break


@graph_break
def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], ep: Communicator) -> torch.Tensor:
    """Rows x[sum(send[:r]):sum(send[:r+1])] go to rank r; returns the recv[r] rows from each rank r, in rank order."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    ep.stats.record("all_to_all", ep.name, x)
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=ep.group)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all with uneven splits; backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, ep):
        ctx.send, ctx.recv, ctx.ep = send, recv, ep
        return _all_to_all(x, send, recv, ep)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.ep), None, None, None


class _GatherRows(torch.autograd.Function):
    """(N, ...) -> (ep N, ...) every rank's rows in rank order; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, x, ep):
        ctx.ep = ep
        return torch.cat(ep.all_gather(x.contiguous()))

    @staticmethod
    def backward(ctx, grad):
        return ctx.ep.reduce_scatter(grad.contiguous()), None


class _ReduceScatterRows(torch.autograd.Function):
    """(ep N, ...) partial sums -> (N, ...) this rank's rows of their sum; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, ep):
        ctx.ep = ep
        return ep.reduce_scatter(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return torch.cat(ctx.ep.all_gather(grad.contiguous())), None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], ep: Communicator) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows over `ep` (see `_AllToAll`)."""
    return x if ep.size == 1 else _AllToAll.apply(x, send, recv, ep)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (N,): out[order[i]] = i (a scatter, not a sort)."""
    out = torch.empty_like(order)
    out[order] = torch.arange(order.numel(), device=order.device)
    return out


class _PermuteRows(torch.autograd.Function):
    """x[order] for a permutation `order` of x's rows; the gradient is gathered back through the inverse, where
    autograd's indexing would scatter it with accumulation (a slow sorted `index_put_` on the CPU)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _RepeatRows(torch.autograd.Function):
    """tokens (N, h) -> the rows of the (token, slot) pairs `order` (N k,) lists, `tokens[order // k]`; the
    gradient of a token is the sum of its k slots' rows, gathered back into (token, slot) order and summed, with
    no scatter."""

    @staticmethod
    def forward(ctx, tokens, order, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return tokens.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        slots = grad.index_select(0, inverse)  # (N k, h) in (token, slot) order
        return slots.view(-1, ctx.k, *grad.shape[1:]).sum(1), None, None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """x[order] for a permutation of x's rows (`_PermuteRows`); `inverse`: `inverse_permutation(order)` if known."""
    return _PermuteRows.apply(x, order, inverse_permutation(order) if inverse is None else inverse)


def repeat_rows(tokens: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """`tokens[order // k]` for a permutation `order` of the N k (token, slot) pairs (`_RepeatRows`)."""
    return _RepeatRows.apply(tokens, order, inverse_permutation(order), k)


def sort_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, k) expert ids -> (order (N k,): slot ids sorted by expert, stably; counts (num_experts,))."""
    flat = indices.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


class LocalDispatcher:
    """All experts on this rank (EP = 1): sort the (token, slot) pairs by expert, and back."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor):
        order, counts = sort_by_expert(indices, self.num_experts)
        return repeat_rows(tokens, order, indices.shape[1]), counts, order

    def combine(self, expert_out: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return permute_rows(expert_out, inverse_permutation(order), order)


class AllToAllDispatcher:
    """Experts split over `ep`: each rank sends every (token, slot) pair to its expert's rank with one
    uneven `all_to_all_single`, after one all-to-all of the per-expert counts; `combine` is the inverse."""

    def __init__(self, num_experts: int, ep: Communicator):
        self.num_experts, self.ep = num_experts, ep
        self.local = num_experts // ep.size

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor):
        ep, local = self.ep, self.local
        order, counts = sort_by_expert(indices, self.num_experts)  # counts (E,) of this rank's slots
        received = _all_to_all(counts, [local] * ep.size, [local] * ep.size, ep).view(ep.size, local)
        send = counts.view(ep.size, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = all_to_all(repeat_rows(tokens, order, indices.shape[1]), send, recv, ep)  # (source, expert) blocks
        # regroup the (source rank, local expert) blocks by local expert, keeping source order within each
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep.size).repeat_interleave(received.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        return permute_rows(rows, regroup), received.sum(0), (order, regroup, send, recv)

    def combine(self, expert_out: torch.Tensor, plan) -> torch.Tensor:
        order, regroup, send, recv = plan
        back = all_to_all(permute_rows(expert_out, inverse_permutation(regroup), regroup), recv, send, self.ep)
        return permute_rows(back, inverse_permutation(order), order)


class AllGatherDispatcher:
    """Experts split over `ep`: every rank all-gathers all tokens and expert ids of the group, runs its
    experts on the slots routed to them, and a reduce-scatter returns each rank the sum (one rank's
    output per slot, zeros from the others)."""

    def __init__(self, num_experts: int, ep: Communicator):
        self.num_experts, self.ep = num_experts, ep
        self.local = num_experts // ep.size

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor):
        ep, k = self.ep, indices.shape[1]
        all_tokens = _GatherRows.apply(tokens, ep)  # (ep N, h)
        local_ids = torch.cat(ep.all_gather(indices.contiguous())).reshape(-1) - ep.rank * self.local
        mine = ((local_ids >= 0) & (local_ids < self.local)).nonzero().squeeze(1)  # slots of local experts
        order = mine[torch.argsort(local_ids[mine], stable=True)]
        counts = torch.bincount(local_ids[mine], minlength=self.local)
        return all_tokens[order // k], counts, (order, all_tokens.shape[0] * k)

    def combine(self, expert_out: torch.Tensor, plan) -> torch.Tensor:
        order, slots = plan
        full = expert_out.new_zeros((slots, expert_out.shape[1])).index_copy(0, order, expert_out)
        return _ReduceScatterRows.apply(full, self.ep)


def build_dispatcher(num_experts: int, ep: Communicator, kind: str = "all_to_all"):
    """The dispatcher for `ep`: local sorting at EP = 1, else "all_to_all" or "all_gather"."""
    if ep.size == 1:
        return LocalDispatcher(num_experts)
    return (AllGatherDispatcher if kind == "all_gather" else AllToAllDispatcher)(num_experts, ep)
