"""fp32 master weights for half-precision parameters, and the distributed optimizer (ZeRO-1).

`MasterWeightOptimizer` takes over a model's parameters when `train.param_dtype = "half"` or
`train.distributed_optimizer = true` (Megatron's mixed-precision and distributed optimizers):

- The parameters become views into one flat buffer (bf16/fp16 with "half", else fp32), and every
  parameter gets `main_grad`, a view into one flat fp32 gradient buffer: a hook adds each backward's
  gradient to it (in fp32) and frees the half-precision one, so micro-batches accumulate in fp32.
- Both buffers are padded to a multiple of the data-parallel size d. With the distributed optimizer,
  DP rank r owns elements [r N/d, (r + 1) N/d) of the flattened parameters, whatever parameters they
  belong to: gradients are reduce-scattered over DP (each rank receives the averaged gradient of its
  range), the rank updates the fp32 master weights and AdamW moments of its range only, and the
  updated parameters are all-gathered. Without it, gradients are all-reduced and every rank updates all.
- AdamW runs on "segments": for each parameter, the part of it inside this rank's range, a 1-D view of
  the master buffer whose `.grad` is a view of the reduced gradient. Segments carry their parameter's
  attributes (tensor-parallel split, tied pipeline copy), so the global gradient norm, clipping, weight
  decay (matrices only) and fp16 loss scaling behave exactly as without sharding.

Bytes per parameter: half params 2 + gradients 4 + master 4 + moments 8 = 18, or 2 + 4 + 12 / d with
the distributed optimizer; fp32 params are their own master: 4 + 4 + 8 / d.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.parallel import Communicator, ParallelContext

SEGMENT_ATTRIBUTES = ("tensor_parallel_dim", "pipeline_tied_copy", "sequence_parallel", "expert_parallel")


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as the trainer reduces it: the fp32 `main_grad` when there is one."""
    return getattr(param, "main_grad", param.grad)


class MasterWeightOptimizer:
    """AdamW over fp32 master weights of this rank's (optionally DP-sharded) range of `named_params`.

    Exposes what the trainer and checkpoints use of `torch.optim.AdamW`: `param_groups`, `state`,
    `step()`, `zero_grad()`, plus the gradient reduction (`reduce_gradients`) and the layout-free state
    (`full_state`, `load_full_state`).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], ctx: ParallelContext, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, param_dtype: torch.dtype,
                 shard: bool, dp: Communicator | None = None, grad_divisor: int | None = None, muon=None):
        """`muon`: `MuonSettings` to update these parameters (all Muon matrices) with Muon instead of AdamW;
        `dp`: the group that reduces (and shards) these parameters' gradients, `ctx.dp_cp` by default
        (data x context; `ctx.dp` without context parallelism; expert parameters: `ctx.expert_dp`);
        `grad_divisor`: what the reduced sum is divided by
        (default its size; expert parameters: the whole data x context size, `expert_gradient_divisor`)."""
        self.ctx, self.names = ctx, [name for name, _ in named_params]
        self.dp = dp or ctx.dp_cp
        self.grad_divisor = grad_divisor or self.dp.size
        self.params = [p for _, p in named_params]
        self.index = {id(p): i for i, p in enumerate(self.params)}  # a parameter's place in `params` and `ranges`
        self.shard = shard and self.dp.size > 1
        d = self.dp.size if self.shard else 1
        numel = sum(p.numel() for p in self.params)
        self.padded = -(-numel // d) * d
        self.shard_size = self.padded // d
        self.lo = (self.dp.rank if self.shard else 0) * self.shard_size
        device = ctx.device
        initial = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.param_buffer = torch.zeros(self.padded, dtype=param_dtype, device=device)
        self.grad_buffer = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.ranges = []
        offset = 0
        for p in self.params:
            a, b = offset, offset + p.numel()
            initial[a:b] = p.detach().reshape(-1).float()
            self.param_buffer[a:b] = p.detach().reshape(-1)
            p.data = self.param_buffer[a:b].view_as(p)
            p.main_grad = self.grad_buffer[a:b].view_as(p)
            p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            self.ranges.append((a, b))
            offset = b
        hi = self.lo + self.shard_size
        # fp32 parameters are their own master weights; half ones get an fp32 copy of this rank's range
        self.separate_master = param_dtype != torch.float32
        self.master = initial[self.lo:hi].clone() if self.separate_master else self.param_buffer[self.lo:hi]
        self.grad_shard = self.grad_buffer[self.lo:hi]  # the reduce-scatter lands in the buffer's own range
        self.segments, pieces = [], {}
        decay, no_decay = [], []
        for i, (p, (a, b)) in enumerate(zip(self.params, self.ranges)):
            s, e = max(a, self.lo), min(b, hi)
            if s >= e:
                continue
            segment = self.master[s - self.lo:e - self.lo]
            segment.grad = self.grad_shard[s - self.lo:e - self.lo]
            segment.shard_offset = s - self.lo
            for attribute in SEGMENT_ATTRIBUTES:
                if hasattr(p, attribute):
                    setattr(segment, attribute, getattr(p, attribute))
            self.segments.append(segment)
            pieces[i] = segment
            (decay if p.ndim >= 2 else no_decay).append(segment)
        if muon is not None:  # each matrix gathered whole over DP for its orthogonalization (`Muon`)
            self.optimizer, self.moments = self._muon(muon, pieces), ("momentum_buffer",)
        else:
            groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
            self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
            self.moments = ("exp_avg", "exp_avg_sq")
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    def _muon(self, settings, pieces: dict[int, torch.Tensor]):
        """Muon over this optimizer's parameters (each a Muon matrix), the segments its pieces: DP rank r holds
        the part of each matrix inside its range [r N/d, (r + 1) N/d) of the flat buffer."""
        from shardlm.training.muon import Muon, MuonMatrix

        d = self.dp.size if self.shard else 1
        matrices = []
        for i, (name, p, (a, b)) in enumerate(zip(self.names, self.params, self.ranges)):
            n = b - a
            spans = [(min(max(r * self.shard_size - a, 0), n), min(max((r + 1) * self.shard_size - a, 0), n))
                     for r in range(d)]
            matrices.append(MuonMatrix(name, tuple(p.shape), getattr(p, "tensor_parallel_dim", None),
                                       pieces.get(i), spans))
        return Muon(matrices, self.ctx, settings, self.dp if self.shard else None)

    def reduce_gradients(self) -> None:
        """Average the fp32 gradients over DP: reduce-scatter (each rank gets its range) when sharded,
        else one all-reduce of the whole buffer; the sum is divided by `grad_divisor`."""
        dp = self.dp
        if dp.size == 1:
            if self.grad_divisor != 1:
                self.grad_buffer.div_(self.grad_divisor)
            return
        if self.shard:
            self.grad_shard.copy_(dp.reduce_scatter(self.grad_buffer)).div_(self.grad_divisor)
        else:
            dp.all_reduce(self.grad_buffer).div_(self.grad_divisor)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's master range, then the updated weights back into the parameters
        (cast to their dtype; all-gathered over DP when sharded)."""
        self.optimizer.step()
        self.refresh_params()

    @torch.no_grad()
    def refresh_params(self) -> None:
        """The parameters from this rank's master range: cast to their dtype, all-gathered over DP when sharded
        (after the step, and after QK-clip scaled the master weights). Collective over DP when sharded."""
        hi = self.lo + self.shard_size
        if self.separate_master:
            self.param_buffer[self.lo:hi].copy_(self.master)
        if self.shard:
            gathered = self.dp.all_gather(self.param_buffer[self.lo:hi].clone())
            self.param_buffer.copy_(torch.cat(gathered))

    @torch.no_grad()
    def scale_master_rows(self, param: torch.Tensor, factor: torch.Tensor) -> None:
        """Multiply row i of `param`'s fp32 master weights by factor[i] (factor (rows,)), in this rank's range; the
        parameter itself changes at the next `refresh_params`."""
        (a, b), hi = self.ranges[self.index[id(param)]], self.lo + self.shard_size
        s, e = max(a, self.lo), min(b, hi)
        if s < e:
            row = torch.arange(s - a, e - a, device=factor.device) // (param.numel() // param.shape[0])
            self.master[s - self.lo:e - self.lo].mul_(factor[row])

    def owner(self, param: torch.Tensor) -> MasterWeightOptimizer | None:
        """This optimizer when its master weights hold `param`, else None."""
        return self if id(param) in self.index else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 gradient buffer (its views stay attached; `set_to_none` is ignored)."""
        self.grad_buffer.zero_()

    # ------------------------------------------------------------------ layout-free state (checkpoints)

    def _flat_state(self, key: str) -> torch.Tensor:
        """This rank's range of AdamW state `key` as one flat tensor (zeros where a segment has none)."""
        flat = torch.zeros(self.shard_size, dtype=torch.float32, device=self.ctx.device)
        for segment in self.segments:
            if key in self.state.get(segment, {}):
                flat[segment.shard_offset:segment.shard_offset + segment.numel()] = self.state[segment][key]
        return flat

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{parameter name: {"model", "exp_avg", "exp_avg_sq"}} (Muon's: "model", "momentum_buffer") in fp32 for
        this rank's TP shard, every DP range gathered (collective over DP when sharded)."""
        flats = {"model": self.master.float(), **{key: self._flat_state(key) for key in self.moments}}
        if self.shard:
            flats = {key: torch.cat(self.dp.all_gather(flat)) for key, flat in flats.items()}
        has_moments = any(self.moments[0] in state for state in self.state.values())
        out = {}
        for name, p, (a, b) in zip(self.names, self.params, self.ranges):
            out[name] = {key: flat[a:b].view_as(p).clone() for key, flat in flats.items()
                         if key == "model" or has_moments}
        return out

    @torch.no_grad()
    def load_full_state(self, tensors: dict[str, dict[str, torch.Tensor]], optimizer_step: int) -> None:
        """Set parameters, master weights and (when given) moments from `full_state`-shaped tensors."""
        flats = {key: torch.zeros(self.padded, dtype=torch.float32, device=self.ctx.device)
                 for key in ("model", *self.moments)}
        for name, (a, b) in zip(self.names, self.ranges):
            for key, value in tensors[name].items():
                if key in flats:
                    flats[key][a:b] = value.reshape(-1).to(flats[key].device, torch.float32)
        hi = self.lo + self.shard_size
        self.param_buffer.copy_(flats["model"])
        self.master.copy_(flats["model"][self.lo:hi])
        if optimizer_step == 0 or not all(self.moments[0] in t for t in tensors.values()):
            return
        for segment in self.segments:
            start = self.lo + segment.shard_offset
            state = {key: flats[key][start:start + segment.numel()].clone() for key in self.moments}
            if "exp_avg" in state:  # AdamW's step count beside its moments
                state["step"] = torch.tensor(float(optimizer_step), device=segment.device)
            self.state[segment] = state


class JointMasterOptimizer:
    """Several `MasterWeightOptimizer`s used as one: under expert parallelism the dense parameters reduced (and
    sharded) over `ctx.dp_cp` (data x context), the expert parameters over `ctx.expert_dp` with their sum divided
    by the whole DP x C size (`shardlm.training.gradients.reduce_expert_gradients` says why); with Muon, each of
    those split again into Muon's matrices and AdamW's rest (`shardlm.training.parallelize._master_weights`)."""

    def __init__(self, parts: list[MasterWeightOptimizer]):
        self.parts = parts
        self.shard = parts[0].shard
        self.segments = [s for part in parts for s in part.segments]
        self.param_groups = [g for part in parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for part in self.parts for k, v in part.state.items()}

    def reduce_gradients(self) -> None:
        for part in self.parts:
            part.reduce_gradients()

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def owner(self, param: torch.Tensor) -> MasterWeightOptimizer | None:
        """The part whose master weights hold `param` (None: no part's)."""
        return next((part for part in self.parts if part.owner(param) is not None), None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad()

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: v for part in self.parts for k, v in part.full_state().items()}

    def load_full_state(self, tensors: dict[str, dict[str, torch.Tensor]], optimizer_step: int) -> None:
        for part in self.parts:
            part.load_full_state({name: tensors[name] for name in part.names}, optimizer_step)


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: add the fresh gradient to the fp32 `main_grad` and free it."""
    param.main_grad.add_(param.grad)
    param.grad = None
