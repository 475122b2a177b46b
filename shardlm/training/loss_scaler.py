"""Dynamic loss scaling for fp16 training.

The loss is multiplied by `scale` before backward so small gradients survive fp16. After backward
the gradients are unscaled and checked for inf/NaN on every rank of the model (an all-reduce MAX
over the TP group, then over the pipeline stages; DP ranks already share reduced gradients). An
overflow skips the optimizer step; after `hysteresis` consecutive-ish overflows the scale halves
(never below `min_scale`); after `window` clean steps it doubles.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.parallel import ParallelContext


class DynamicLossScaler:
    """Scale state: `scale`, and the counters that decide when it moves."""

    def __init__(self, initial_scale: float = 2.0**32, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0):
        self.scale = float(initial_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self.clean_steps = 0
        self.hysteresis_left = hysteresis

    def unscale_and_check(self, params: list[torch.Tensor], ctx: ParallelContext,
                          sharded_over_dp: bool = False) -> bool:
        """Divide every gradient by the scale; True when any gradient anywhere is inf or NaN (checked over
        DP too when each DP rank holds only its range of the gradients)."""
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / self.scale)
        found = torch.zeros((), device=ctx.device)
        for g in grads:
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        ctx.tp.all_reduce(found, op=dist.ReduceOp.MAX)
        ctx.pp.all_reduce(found, op=dist.ReduceOp.MAX)
        if sharded_over_dp or ctx.ep_size > 1:  # experts split over EP ranks differ inside the DP group
            ctx.dp_cp.all_reduce(found, op=dist.ReduceOp.MAX)  # `dp` itself without context parallelism
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps == self.window:
                self.clean_steps = 0
                self.hysteresis_left = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
