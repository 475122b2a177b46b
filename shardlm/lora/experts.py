"""Adapters on a MoE layer's experts: one low-rank update per expert and projection, as peft's
`target_parameters` puts them on transformers' fused expert tensors.

transformers keeps a layer's experts as two 3-D tensors, `gate_up_proj` (E, 2f, h: gate rows, then up rows)
and `down_proj` (E, h, f); peft adapts each with, per expert e, A_e (r, in) and B_e (out, r). So the gate and
up projections of an expert share one A (their fused input side) and split B's rows, gate first. shardlm's
`GroupedExperts` keeps gate and up apart, split over TP by rows: here B's gate and up rows are two stacks split
the same way.

Stacks over this rank's experts (E_l = E / ep, `expert_parallel`, `first_expert` as the weights):
- gated: `A_in` (E_l, r, h) whole on every TP rank, `B_gate`, `B_up` (E_l, f / tp, r) split with the output;
  `A_down` (E_l, r, f / tp) split with the input, `B_down` (E_l, h, r) whole;
- GPT's: `A_in`, `B_fc` (E_l, f / tp, r); `A_proj` (E_l, r, f / tp), `B_proj` (E_l, h, r).
The whole factors' gradients are partial over TP (as a dense adapter's, `shardlm.lora.adapter`) and are summed
by the trainer; the down update is added to the experts' partial output before its reduction. Expert e's A is
drawn from a seed of its global index, B is zero.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.lora.adapter import kaiming_uniform
from shardlm.parallel import ParallelContext
from shardlm.parallel.init import param_seed


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """The experts' grouped GEMM (`shardlm.models.moe.expert_matmul`), or their loop where the rank r leaves rows
    the grouped kernel cannot take."""
    from shardlm.models.moe import expert_matmul as matmul
    from shardlm.models.moe import grouped_mm_applies

    return matmul(x, weight, counts, grouped and grouped_mm_applies(x, weight))


class ExpertLoRA(nn.Module):
    """The adapters of one `GroupedExperts` (module docstring). `inputs(x, counts, grouped)`: x (M, h) grouped by
    expert -> the updates of the gate and up (or fc) outputs, each (M, f / tp); `outputs(hidden, counts,
    grouped)`: hidden (M, f / tp) -> the update of the down (or proj) output, (M, h), partial over TP."""

    def __init__(self, gated: bool, hidden: int, ffn: int, num_experts: int, rank: int, alpha: float,
                 dropout: float, rslora: bool, ctx: ParallelContext, seed: int, prefix: str, dtype=torch.float32):
        super().__init__()
        self.gated, self.dropout, self.ctx = gated, dropout, ctx
        self.scale = alpha / (math.sqrt(rank) if rslora else rank)
        local = num_experts // ctx.ep_size
        first = ctx.ep_rank * local
        width = ffn // ctx.tp_size
        lo, hi = ctx.tp_rank * width, (ctx.tp_rank + 1) * width
        names = ("gate", "up", "down") if gated else ("fc", "proj")

        def factor(values: list[torch.Tensor], split_dim: int | None) -> nn.Parameter:
            param = nn.Parameter(torch.stack(values).to(device=ctx.device, dtype=dtype).contiguous())
            param.expert_parallel, param.first_expert = True, first
            if split_dim is not None:
                param.tensor_parallel_dim = split_dim
            elif ctx.tp_size > 1:
                param.sequence_parallel = True  # partial over TP: summed by the trainer
            return param

        experts = range(first, first + local)
        self.A_in = factor([kaiming_uniform((rank, hidden), param_seed(seed, f"{prefix}.experts.{e}.lora.A_in"))
                            for e in experts], None)
        for name in names[:-1]:
            setattr(self, f"B_{name}", factor([torch.zeros(width, rank) for _ in experts], 1))
        out = names[-1]
        setattr(self, f"A_{out}", factor([kaiming_uniform((rank, ffn), param_seed(seed, f"{prefix}.experts.{e}.lora."
                                                                                 f"A_{out}"))[:, lo:hi]
                                          for e in experts], 2))
        setattr(self, f"B_{out}", factor([torch.zeros(hidden, rank) for _ in experts], None))
        self.out = out

    def _dropped(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        """Dropout on an input: a TP-split one (the down input) draws from the model-parallel generator."""
        if not (self.training and self.dropout > 0):
            return x
        if split and self.ctx.rng is not None:
            with self.ctx.rng.fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)

    def inputs(self, x: torch.Tensor, counts: list[int], grouped: bool) -> list[torch.Tensor]:
        low = expert_matmul(self._dropped(x, False), self.A_in.to(x.dtype), counts, grouped)
        names = ("gate", "up") if self.gated else ("fc",)
        return [expert_matmul(low, getattr(self, f"B_{n}").to(x.dtype), counts, grouped) * self.scale for n in names]

    def outputs(self, hidden: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
        a, b = getattr(self, f"A_{self.out}"), getattr(self, f"B_{self.out}")
        low = expert_matmul(self._dropped(hidden, True), a.to(hidden.dtype), counts, grouped)
        return expert_matmul(low, b.to(hidden.dtype), counts, grouped) * self.scale
