"""Optimizer, learning-rate schedule and global gradient clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardlm.parallel import Communicator, ParallelContext


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a shard of a split weight; False for a parameter replicated on every TP rank."""
    return hasattr(param, "tensor_parallel_dim")


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (never on biases and LayerNorm parameters), with
    PyTorch's fused kernel (one pass over each tensor; on CPU several times faster than foreach)."""
    groups = adamw_groups([p for p in model.parameters() if p.requires_grad], weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def adamw_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """AdamW's two parameter groups: matrices with weight decay, vectors (biases, norms) without."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def learning_rate(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                  style: str) -> float:
    """LR for optimizer step `step` (0-based): linear warmup to `lr`, then cosine or linear decay to
    `min_lr` over `decay_steps`, constant at `min_lr` afterwards."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if style == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
    if style == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def global_grad_norm(params: list[torch.Tensor], ctx: ParallelContext, sharded_over_dp: bool = False,
                     shard_group: Communicator | None = None) -> torch.Tensor:
    """L2 norm of all gradients of the whole model, equal to the single-process norm.

    Squared norms of tensor-parallel shards are summed over the TP group (one all-reduce of one
    scalar); replicated parameters are identical on every TP rank and are counted once. Each pipeline
    stage adds its parameters' share over the PP group (one more scalar all-reduce); the tied embedding's
    copy on the last stage (`pipeline_tied_copy`) is left out, so it counts once. Gradients are already
    averaged over DP, so DP needs no communication, unless each DP rank holds only its range of them
    (`sharded_over_dp`, the distributed optimizer): then the ranges' shares are summed over DP (over
    DP x CP, `ctx.dp_cp`, under context parallelism, where the optimizer shards over it; over
    `shard_group` when the ranges are sharded over part of it and replicated across the parts, as
    hybrid-sharded FSDP does).
    Experts split over expert-parallel ranks (`expert_parallel`) differ between the ranks of the EP group:
    their share is summed over EP (over DP, which contains EP, when sharded; still over all of DP x CP under
    hybrid sharding, whose experts are sharded over expert-DP, not hybrid), and over TP for the TP-split ones
    only (a split expert parameter whole on every TP rank counts once).
    """
    device = ctx.device
    params = [p for p in params if p.grad is not None and not getattr(p, "pipeline_tied_copy", False)]
    split_experts = ctx.ep_size > 1
    split = [p for p in params if split_experts and getattr(p, "expert_parallel", False)]
    experts = [p.grad for p in split if is_tensor_parallel(p)]
    # split experts' parameters whole on every TP rank (gpt-oss's down bias, expert adapters' whole factors): once
    whole_experts = [p.grad for p in split if not is_tensor_parallel(p)]
    params = [p for p in params if not (split_experts and getattr(p, "expert_parallel", False))]
    sharded = [p.grad for p in params if is_tensor_parallel(p)]
    replicated = [p.grad for p in params if not is_tensor_parallel(p)]

    def squared(grads):
        if not grads:
            return torch.zeros((), device=device)
        return torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()

    sharded_sq = squared(sharded)
    hybrid = sharded_over_dp and shard_group is not None and shard_group is not ctx.dp_cp
    experts_sq, whole_sq = squared(experts), squared(whole_experts)
    if split_experts and not hybrid:
        if not sharded_over_dp:
            ctx.ep.all_reduce(experts_sq)
            ctx.ep.all_reduce(whole_sq)
        sharded_sq = sharded_sq + experts_sq
    ctx.tp.all_reduce(sharded_sq)
    total = sharded_sq + squared(replicated) + (0 if hybrid else whole_sq)
    if sharded_over_dp:
        (shard_group or ctx.dp_cp).all_reduce(total)
    if split_experts and hybrid:  # each expert shard lives on one rank of DP x CP
        total = total + ctx.dp_cp.all_reduce(ctx.tp.all_reduce(experts_sq)) + ctx.dp_cp.all_reduce(whole_sq)
    return ctx.pp.all_reduce(total).sqrt()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, ctx: ParallelContext,
                   sharded_over_dp: bool = False, shard_group: Communicator | None = None) -> torch.Tensor:
    """Scale gradients so the global norm is at most `max_norm` (same rule as
    `torch.nn.utils.clip_grad_norm_`); returns the norm before clipping."""
    norm = global_grad_norm(params, ctx, sharded_over_dp, shard_group)
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
    return norm
