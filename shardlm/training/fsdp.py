"""Fully sharded data parallelism (`train.data_sharding = "full"`) on PyTorch's FSDP2 (`fully_shard`).

Each transformer layer, then the model root (embedding, final norm, output layer), becomes one FSDP unit
over the data-parallel group (`ctx.dp_cp`: data x context). Every parameter is stored as a DTensor
sharded on dim 0 over that group (rank r keeps rows `torch.chunk(p, DP)[r]`), and so are its gradient
and its AdamW moments. A tensor-parallel weight is already this TP rank's plain local shard; FSDP shards
that shard over DP, so the parameter is split TP-wise by shardlm's layers and DP-wise by FSDP, the 2-D
layout torchtitan builds with FSDP + TP (there from DTensor TP shards; here from local ones). Each TP
rank has its own DP group, hence its own one-dimensional device mesh. With pipeline stages each of this
rank's stages is a root in the model's place, over its layers and the end pieces it runs
(`shardlm.parallel.pipeline.shard_stage`); PyTorch's schedules then decide when its gradients are reduced.
Split experts (`parallel.expert` > 1) are their own units over expert-DP (`shard_model`). Hybrid sharding
(`train.fsdp_shard_size`) shards within rows of the DP group and replicates across them (`hybrid_mesh`).

One step per FSDP unit: an all-gather of its parameters before the forward, another before the
backward (unless `train.fsdp_reshard_after_forward = false` kept them), a reduce-scatter of its
gradients (averaged over DP) after the backward. With `param_dtype = "half"` a `MixedPrecisionPolicy`
gathers bf16/fp16 copies of the fp32 shards and reduces gradients in fp32.

What the trainer sees of this rank's shards is `LocalShard`s: the local part of each parameter's
gradient, carrying the parameter's shardlm attributes, so the global gradient norm, clipping and the
sequence-parallel gradient sum work on them as on the distributed optimizer's segments (sum of squares
over the local shards, then over DP (hybrid: the shard row), TP and PP). Checkpoints stay layout-free:
`full_state` gathers every parameter and moment over DP into this TP rank's unsplit-over-DP tensor,
`load_full_state` keeps this DP rank's rows.
"""

from __future__ import annotations

import contextlib
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardlm.parallel import Communicator, ParallelContext
from shardlm.parallel.layout import context_grid, data_context_parallel_groups
from shardlm.training.gradients import expert_gradient_divisor
from shardlm.training.optim import build_optimizer

PARAM_ATTRIBUTES = ("tensor_parallel_dim", "pipeline_tied_copy", "sequence_parallel", "expert_parallel", "first_expert")
"""shardlm's marks on parameters, which FSDP's new DTensor parameters do not inherit."""


def data_parallel_mesh(ctx: ParallelContext, shard_size: int = 0) -> tuple[DeviceMesh, Communicator]:
    """(the device mesh FSDP shards over, the communicator of the ranks one shard spans): a one-dimensional
    mesh over this rank's data x context group `ctx.dp_cp`, or for `0 < shard_size < DP x CP` hybrid
    sharding's two-dimensional (replicate, shard) mesh (`hybrid_mesh`)."""
    if shard_size in (0, ctx.dp_cp.size):
        return DeviceMesh.from_group(ctx.dp_cp.group, device_type=ctx.device.type), ctx.dp_cp
    return hybrid_mesh(ctx, shard_size)


def hybrid_mesh(ctx: ParallelContext, shard_size: int) -> tuple[DeviceMesh, Communicator]:
    """Hybrid sharding: each data x context group of DP x CP ranks (one per stage and TP rank) as a
    (DP x CP / shard_size, shard_size) table. A row is a shard group of consecutive DP x CP ranks, global
    ranks TP apart, so `shard_size` x TP consecutive ranks: one node's when it divides the GPUs of a node;
    a column is a replicate group across rows. Builds both kinds of process group (collective over the
    world) and returns (the (replicate, shard) mesh, the shard group's communicator)."""
    timeout = timedelta(seconds=ctx.dp_cp.timeout_s) if ctx.dp_cp.timeout_s else None
    grid = context_grid(ctx.world_size, ctx.tp_size, ctx.pp_size, ctx.cp_size)
    mine = {}
    for ranks in data_context_parallel_groups(grid):
        table = torch.tensor(ranks).view(-1, shard_size)
        if ctx.rank in ranks:
            mine["table"] = table
        for kind, rows in (("shard", table.tolist()), ("replicate", table.t().tolist())):
            for row in rows:  # every rank creates every group, in the same order
                group = dist.new_group(row, timeout=timeout)
                if ctx.rank in row:
                    mine[kind] = (group, row)
    (replicate, _), (shard, row) = mine["replicate"], mine["shard"]
    mesh = DeviceMesh.from_group([replicate, shard], ctx.device.type, mesh=mine["table"],
                                 mesh_dim_names=("replicate", "shard"))
    return mesh, Communicator("fsdp_shard", shard, len(row), row.index(ctx.rank), ctx.comm,
                              timeout_s=ctx.dp_cp.timeout_s)


def expert_data_parallel_mesh(ctx: ParallelContext) -> DeviceMesh:
    """A one-dimensional device mesh over this rank's expert-data-parallel group (`ctx.expert_dp`): the DP
    ranks holding the same experts."""
    return DeviceMesh.from_group(ctx.expert_dp.group, device_type=ctx.device.type)


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers)


def shard_model(model: nn.Module, ctx: ParallelContext, reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None, stages: list[nn.Module] | None = None,
                shard_size: int = 0) -> Communicator:
    """`fully_shard` each transformer layer, then the root, over the DP group; in place. The parameters
    become DTensors (their shardlm attributes copied over) of the same global shape as before, which is
    this TP rank's shard shape. `param_dtype`: the dtype the gathered parameters compute in (gradients are
    reduced in fp32); None keeps the fp32 parameters as they are. `stages`: this rank's pipeline stage
    modules, each then a root in the model's place (`shardlm.parallel.pipeline.shard_stage`). `shard_size`:
    hybrid sharding over groups of that many DP x CP ranks (`data_parallel_mesh`), gradients reduce-scattered
    within a group and all-reduced across groups. Returns the communicator of the ranks one shard spans.

    MoE layers: experts split over expert-parallel ranks (`parallel.expert` > 1) differ between the ranks
    of the DP group, so each layer's expert stacks are their own FSDP unit over the expert-data-parallel
    group (`ctx.expert_dp`), their gradients summed over it and divided by DP x CP, the reduction
    `reduce_expert_gradients` makes without FSDP. Parameters without gradient (the routers' expert biases,
    which `shardlm.training.moe.finish_step` moves alike on every rank) stay whole, outside FSDP."""
    marks = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)}
             for name, p in model.named_parameters()}
    mesh, shard_group = data_parallel_mesh(ctx, shard_size)
    policy = MixedPrecisionPolicy() if param_dtype is None else \
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # The model returns its per-token losses as a view; FSDP warns that an in-place op on it would skip the
    # backward's all-gather. The losses (`shardlm.models.training_loss`) reduce it out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    # parameters without gradient that move alike on every rank stay whole; a LoRA run's frozen base is sharded
    frozen = {p for p in model.parameters() if not p.requires_grad and not getattr(p, "frozen_base", False)}
    expert_mesh = expert_data_parallel_mesh(ctx) if ctx.ep_size > 1 else None
    for layer in _layers(model):
        block = layer.mlp if hasattr(layer, "mlp") else getattr(layer, "mixer", None)  # Nemotron-H: a block's mixer
        experts = getattr(block, "experts", None)
        if experts is not None and expert_mesh is not None:
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
            experts.set_gradient_divide_factor(float(expert_gradient_divisor(ctx)))
            # a sum, then the division: gloo has no PREMUL_SUM. Not on one rank, where torch 2.13 would
            # divide twice (its copy for a group of one already divides).
            experts.set_force_sum_reduction_for_comms(ctx.expert_dp.size > 1)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    ignored_params=frozen & set(layer.parameters()))
    # the root's own parameters (embedding, final norm, output layer) are gathered for the whole step
    if stages is None:
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=frozen)
    for stage in stages or ():
        from shardlm.parallel.pipeline import shard_stage

        shard_stage(stage, mesh=mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=frozen)
    if mesh.ndim == 2:  # hybrid: the all-reduce across shard groups sums, then divides (gloo has no AVG)
        for unit in [*_layers(model), *(stages or [model])]:
            unit.set_force_sum_reduction_for_comms(True)
    for name, param in model.named_parameters():
        for attribute, value in marks[name].items():
            setattr(param, attribute, value)
    return shard_group


class LocalShard:
    """This rank's rows of one sharded parameter as the norm, clipping and gradient-sum code reads it:
    `.grad` is the local tensor of the parameter's DTensor gradient (a view: scaling it scales the
    gradient), and the parameter's shardlm attributes are copied."""

    def __init__(self, param: nn.Parameter):
        self.param = param
        for attribute in PARAM_ATTRIBUTES:
            if hasattr(param, attribute):
                setattr(self, attribute, getattr(param, attribute))

    @property
    def grad(self) -> torch.Tensor | None:
        grad = self.param.grad
        return None if grad is None else grad.to_local()


def _rows(tensor: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Rows of `tensor` that DP rank `index` of `parts` holds: FSDP2's dim-0 `torch.chunk` split
    (an empty tensor for ranks past the last chunk)."""
    chunks = torch.chunk(tensor, parts, dim=0)
    return chunks[index] if index < len(chunks) else tensor[:0]


def held_rows(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `full`, a tensor with the rows of an FSDP-sharded parameter's whole TP shard (the
    parameter itself, or one value per row): the split over its mesh's last dimension, the one that shards."""
    mesh = param.device_mesh
    dim = mesh.ndim - 1
    return _rows(full, mesh.size(dim), mesh.get_local_rank(dim))


def copy_to_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of `full` (the parameter's whole TP shard) into an FSDP-sharded parameter."""
    param.to_local().copy_(held_rows(param, full))


class FullyShardedAdamW:
    """AdamW over the DTensor shards of a `shard_model`-ed model, with the same hyperparameters and
    decay groups as `build_optimizer`; exposes what the trainer and checkpoints use of an optimizer
    (`param_groups`, `state`, `step`, `zero_grad`, `full_state`, `load_full_state`) and `shards`, the
    `LocalShard`s the trainer clips and sums."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, shard_group: Communicator | None = None, inner=None):
        """`inner`: the optimizer over the DTensor parameters (`shardlm.training.muon.build_muon`'s Muon and
        AdamW); by default AdamW as `build_optimizer` makes it."""
        self.model, self.ctx = model, ctx
        self.shard_group = shard_group or ctx.dp_cp
        """The ranks one shard spans (`shard_model`'s return): the gradient norm sums the local shares over it."""
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.inner = inner or build_optimizer(model, lr, weight_decay, betas, eps, ctx.device)
        self.param_groups, self.state, self.defaults = self.inner.param_groups, self.inner.state, self.inner.defaults
        self.shards = [LocalShard(p) for _, p in self.named]

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def set_micro_batch(self, last: bool) -> None:
        """Before a micro-batch's forward: only the last one reduce-scatters the gradients (the others
        accumulate the unsharded gradient locally) and reshards the parameters after the backward (the
        others keep them gathered for the next forward)."""
        self.model.set_requires_gradient_sync(last)
        self.model.set_reshard_after_backward(last)

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {"model", "exp_avg", "exp_avg_sq"}} (Muon's matrices: "momentum_buffer" for the moments): each
        parameter and moment gathered over DP (this
        TP rank's shard, unsplit over DP; split experts over expert-DP: this EP rank's stack), for
        checkpoints. Collective over the DP group."""
        out = {}
        for name, param in self.named:
            state = self.inner.state.get(param, {})
            out[name] = {"model": param.detach().full_tensor(),
                         **{k: state[k].full_tensor() for k in ("exp_avg", "exp_avg_sq", "momentum_buffer")
                            if k in state}}
        return out

    @torch.no_grad()
    def load_full_state(self, full: dict[str, dict[str, torch.Tensor]], optimizer_step: int) -> None:
        """Inverse of `full_state`: this DP rank's rows of each parameter (and, when `optimizer_step` > 0
        and they are given, of its moments), over the group the parameter is sharded on."""
        for name, param in self.named:
            mesh, dim = param.device_mesh, param.device_mesh.ndim - 1  # DP x CP, expert-DP, or hybrid's shard dim
            local = {k: _rows(v, mesh.size(dim), mesh.get_local_rank(dim)) for k, v in full[name].items()}
            param.to_local().copy_(local["model"])
            keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if k in local]
            if optimizer_step > 0 and keys:
                state = {"step": torch.tensor(float(optimizer_step), device=param.device)} if "exp_avg" in local else {}
                for key in keys:
                    state[key] = torch.zeros_like(param.detach())
                    state[key].to_local().copy_(local[key])
                self.inner.state[param] = state


@contextlib.contextmanager
def counting_collectives():
    """`with counting_collectives() as counts:` counts the all-gathers and reduce-scatters FSDP2 makes in the
    block (it calls `torch.distributed.all_gather_single` / `reduce_scatter_single`, around shardlm's
    `ctx.comm` statistics), on this rank: {"all_gather": [calls, elements], "reduce_scatter": [...]}, the
    elements of the unsharded side (gathered output, reduced input). For tests and benchmarks."""
    counts = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}
    originals = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def counted(kind):
        def call(output, input, *args, **kwargs):
            counts[kind][0] += 1
            counts[kind][1] += (output if kind == "all_gather" else input).numel()
            return originals[kind](output, input, *args, **kwargs)
        return call

    dist.all_gather_single, dist.reduce_scatter_single = counted("all_gather"), counted("reduce_scatter")
    try:
        yield counts
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = originals["all_gather"], originals["reduce_scatter"]


def gather_root(module: nn.Module, gather: bool = True) -> None:
    """An FSDP root whose pieces are called one by one instead of through its forward (decoding through pipeline
    stages, a teacher's pipelined pass): set up as the root first (FSDP2's lazy initialization, which a root's forward
    runs before anything; otherwise the first of its units called would take the root's place) and, with `gather`,
    its own parameters all-gathered (collective over its mesh); its layers gather and free themselves in their own
    forwards. `reshard` (or the module's `reshard()`) frees them. Nothing for a module FSDP does not shard."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module._get_fsdp_state()._lazy_init()  # (private: the set-up a root's forward runs first)
        if gather:
            module.unshard()


def reshard(modules: list[nn.Module]) -> None:
    """Free the gathered parameters of every FSDP unit in `modules`. A root keeps its own gathered after the forward
    (`reshard_after_forward=False`, for its backward), and a forward without backward (generation, a scoring pass)
    would leave them gathered: the next forward would then use them as they were, not as the optimizer or a weight
    swap has since made the shards."""
    from torch.distributed.fsdp import FSDPModule

    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
