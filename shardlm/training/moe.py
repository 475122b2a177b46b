"""The training side of Mixture-of-Experts: what happens across micro-batches, ranks and steps.

An `MoELayer` (`shardlm.models.moe`) computes routing, experts and its balance losses for one
micro-batch, over the groups that hold that micro-batch's tokens (TP under sequence parallelism, CP),
and records what it saw (routed-slot counts per expert, its detached loss). What the step does with
that lives here, as torchtitan's trainer owns its load-balancing updates:

- `set_aux_loss_scale`, before the micro-batches: the gradient each layer's attached loss receives in
  the backward. It is the micro-batch loss's factor (loss scale / micro-batches), times C under context
  parallelism: every CP rank holds the whole token set's loss but its gradient reaches only this rank's
  tokens, and the trainer averages gradients over CP, so C times the factor makes that average the
  whole loss's gradient.
- `finish_step`, after the optimizer step: the step's MoE metrics and the expert-bias update, with the
  routing statistics summed over the data x context, tensor and pipeline groups.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.models.moe import moe_layers
from shardlm.parallel import ParallelContext


def set_aux_loss_scale(model: nn.Module, ctx: ParallelContext, loss_scale: float, micro_batches: int) -> None:
    """Before a step's micro-batches: every MoE layer's attached loss gets gradient
    `loss_scale / micro_batches` (the micro-batch loss's factor) times the CP size (see the module docstring)."""
    factor = loss_scale / micro_batches * ctx.cp_size
    for layer in moe_layers(model):
        layer.loss_scale = factor


@torch.no_grad()
def finish_step(model: nn.Module, ctx: ParallelContext, micro_batches: int, sequence_parallel: bool,
                update_bias: bool = True) -> dict:
    """After an optimizer step: the step's MoE metrics, and the expert-bias update.

    Each layer's last `micro_batches` recorded forwards are the step's (a pipeline schedule's first step
    also runs each stage once on stand-in tensors to learn shapes: that one comes first and is left
    out). Token counts are summed over the data x context group (and TP under sequence parallelism: the
    CP and SP ranks hold different tokens), so every rank sees the global counts and moves its biases
    alike: bias += rate x sign(mean count - count). Returns {"moe_aux_loss": mean per micro-batch summed
    over layers (averaged over DP, summed over pipeline stages; every CP rank already holds its whole
    micro-batch's), "expert_load_min"/"max": the least and most loaded expert's share of its layer's slots
    relative to uniform}. Collective over DP x CP, TP and PP; every rank of a model with MoE layers
    anywhere must call it."""
    layers = moe_layers(model)
    aux = torch.tensor([0.0, -float("inf"), -float("inf")], dtype=torch.float64, device=ctx.device)  # aux,-min,max
    recorded = [layer.recorded[-micro_batches:] for layer in layers]
    for layer in layers:
        layer.recorded = []
    if layers:
        aux[0] = sum(loss.double() for step in recorded for _, loss in step)
        counts = torch.stack([sum(c for c, _ in step).double() for step in recorded])  # (layers, E)
        ctx.dp_cp.all_reduce(counts)  # `dp` without context parallelism
        if sequence_parallel:
            ctx.tp.all_reduce(counts)
        share = counts / counts.mean(1, keepdim=True).clamp_min(1)
        aux[1], aux[2] = -share.min(), share.max()
        for layer, count in zip(layers, counts):
            bias = layer.router.expert_bias
            if bias is not None and update_bias:
                bias += layer.cfg.moe_expert_bias_rate * torch.sign(count.mean() - count).to(bias.dtype)
    ctx.dp.all_reduce(aux[:1])
    ctx.pp.all_reduce(aux[:1])
    ctx.pp.all_reduce(aux[1:], op=torch.distributed.ReduceOp.MAX)
    return {"moe_aux_loss": aux[0].item() / (micro_batches * ctx.dp_size),
            "expert_load_min": -aux[1].item(), "expert_load_max": aux[2].item()}
