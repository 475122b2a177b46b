"""Pipeline parallelism: split a built model into stages and run them with `torch.distributed.pipelining`.

A model with `P x V` pipeline stages (P ranks in a pipeline group, V virtual stages each) is cut into
contiguous blocks of layers: stage `s` holds block `s` and lives on pipeline rank `s % P`, so with
V > 1 each rank holds V blocks spaced P apart (the interleaved schedule of Narayanan et al. 2021).
Stage 0 also runs the embeddings, the last stage the final LayerNorm, the output layer and the loss, and
a model's multi-token-prediction depths (`shardlm.models.mtp`), which read the embedding too.

The model itself is unaware of stages (it only offers `embed`, `run_layers`, `head` and `loss`, what its layers
hand on across a boundary besides the hidden state, `stage_handoff` / `stage_carry`, and keeps its layers in a dict
keyed by layer index): `keep_stages` builds the whole model's structure,
then drops the layers and end pieces this rank does not own, so parameter names stay those of the
unsplit model and checkpoints stay layout-free. A word embedding that the last stage uses too (GPT's
tied output layer, the multi-token-prediction depths' input embedding) lives on the first and the last
stage; `sum_tied_gradients` adds the two copies' gradients over the embedding group every step, so
both copies see the single-process gradient and stay bitwise equal (checkpoints save the first copy only).

Schedules (GPipe, 1F1B, interleaved 1F1B, and the zero-bubble interleaved ZB, ZB-V and DualPipeV, which split
each backward into an input-gradient and a weight-gradient step; the last two place stages r and 2P - 1 - r on
rank r, a V) are PyTorch's. `ShardlmStage` gives both split steps every weight the stage reaches (`weights`),
records the point-to-point transfers they issue into the communication statistics, keeps the model-parallel
RNG tracker out of the schedule's one-off metadata inference (see its docstring), and hands every stage the
packed documents of the micro-batch it runs (the first stage's inputs are not the only ones that need them),
and the last stage its multi-token-prediction inputs and targets.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _ComputationType

from shardlm.errors import UserError
from shardlm.parallel.layout import ParallelContext

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two stages a rank, r and 2P - 1 - r


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """How many stages each pipeline rank runs: 2 under the V-shaped schedules, else `virtual_stages`."""
    return 2 if schedule in V_SHAPED else virtual_stages


def stage_layers(num_layers: int, num_stages: int, first: int = 0, last: int = 0) -> list[list[int]]:
    """Layer indices of each of `num_stages` stages, contiguous and in order.

    `first` / `last` > 0 fix the layer count of the first / last stage (to take load off the stages that
    also run the embedding or the output layer and loss); the other stages share the remaining layers
    evenly, the later ones taking one more when they do not divide. Raises UserError when a stage would
    get no layer.
    """
    if num_stages == 1:
        return [list(range(num_layers))]
    fixed = {0: first, num_stages - 1: last}
    free = [s for s in range(num_stages) if not fixed.get(s)]
    remaining = num_layers - sum(fixed.values())
    if remaining < len(free) or (not free and remaining != 0) or min(first, last) < 0:
        raise UserError(f"model.num_layers={num_layers} cannot fill {num_stages} pipeline stages with "
                        f"first_stage_layers={first} and last_stage_layers={last}; every stage needs at least "
                        "one layer: use fewer stages or change those keys")
    counts = {s: n for s, n in fixed.items() if n}
    for i, s in enumerate(free):
        counts[s] = remaining // len(free) + (1 if i >= len(free) - remaining % len(free) else 0)
    out, start = [], 0
    for s in range(num_stages):
        out.append(list(range(start, start + counts[s])))
        start += counts[s]
    return out


def local_stages(ctx: ParallelContext, virtual_stages: int, v_shaped: bool = False) -> list[int]:
    """Indices of the stages this rank runs: its pipeline rank, plus P, 2P, ... with virtual stages (loop
    placement); V-shaped (ZB-V, DualPipeV: 2 P stages), rank r runs stage r and its mirror 2P - 1 - r, so
    rank 0 holds the first and the last stage."""
    if v_shaped:
        return [ctx.pp_rank, 2 * ctx.pp_size - 1 - ctx.pp_rank]
    return [ctx.pp_rank + v * ctx.pp_size for v in range(virtual_stages)]


def stage_owner(stage: int, pp_size: int, num_stages: int, v_shaped: bool = False) -> int:
    """The pipeline rank that runs `stage` (of `num_stages`): s mod P, or the V's fold."""
    if v_shaped:
        return stage if stage < pp_size else num_stages - 1 - stage
    return stage % pp_size


def keep_stages(model: nn.Module, layers: list[list[int]], stages: list[int]) -> nn.Module:
    """Drop from `model` (in place) every layer and end piece that `stages` do not need; returns it.

    `model.FIRST_STAGE` / `model.LAST_STAGE` name the attributes the first / last stage need (for GPT:
    the embeddings; the final LayerNorm and the tied output layer's `wte`; for Llama with multi-token
    prediction the last stage adds `mtp` and `wte`). A parameter kept by the last
    stage that belongs to the first stage's pieces too is the tied copy: it is marked
    `pipeline_tied_copy` (counted once in the gradient norm, on the first stage). A rank that holds both
    the first and the last stage (the V-shaped schedules' rank 0) keeps one word embedding, used twice.
    `model.pipeline_ends` records (holds the first stage, holds the last stage).
    """
    num_stages = len(layers)
    owned = {str(i) for s in stages for i in layers[s]}
    for key in list(model.layers.keys()):
        if key not in owned:
            del model.layers[key]
    first, last = 0 in stages, num_stages - 1 in stages
    needed = (set(model.FIRST_STAGE) if first else set()) | (set(model.LAST_STAGE) if last else set())
    for name in set(model.FIRST_STAGE) | set(model.LAST_STAGE):
        if name not in needed:
            setattr(model, name, None)
    if last and not first:
        for name in set(model.FIRST_STAGE) & set(model.LAST_STAGE):
            for param in getattr(model, name).parameters():
                param.pipeline_tied_copy = True
    model.pipeline_ends = (first, last)
    return model


def tied_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that both the first and the last stage hold (GPT's word embedding, or Llama's under
    multi-token prediction)."""
    tied = []
    for name in set(model.FIRST_STAGE) & set(model.LAST_STAGE):
        module = getattr(model, name)
        if module is not None:
            tied.extend(module.parameters())
    return tied


def sum_tied_gradients(model: nn.Module, ctx: ParallelContext) -> None:
    """Add the gradients of the tied embedding's two copies (first and last stage) over the embedding
    group: one all-reduce per tied tensor, on those two stages only. Under FSDP each copy's gradient is
    already reduce-scattered over DP, and DP rank r of both stages holds the same rows: the sum of
    the two local shards is that rank's rows of the summed gradient. A rank holding both ends (V-shaped
    schedules) has one embedding whose gradient already sums both uses: nothing to add."""
    first, last = getattr(model, "pipeline_ends", (False, False))
    if ctx.pp_size == 1 or first == last:
        return
    for param in tied_parameters(model):
        if not param.requires_grad:  # frozen (a LoRA run's base): nothing to add
            continue
        if hasattr(param, "main_grad"):  # fp32 gradient buffer of the master-weight optimizer
            ctx.embedding.all_reduce(param.main_grad)
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        # under FSDP a DTensor: both copies are sharded alike over DP, so their local rows add up
        ctx.embedding.all_reduce(param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad)


class StageModule(nn.Module):
    """One pipeline stage of `model`: (B, T) ids on the first stage, (B, T, h) hidden states elsewhere
    -> (B, T, h); on the last stage the final norm's output, which the loss function takes through the
    fused output layer and loss (`model.output_loss`). `documents` is the packed documents of the
    micro-batch being run (`shardlm.models.documents`), or None; `ShardlmStage` sets it on every stage.
    `mtp` is the micro-batch's multi-token-prediction (inputs, targets), each (D, B, T); the last stage of a
    model with depths returns (final norm's output, the depths' per-token losses (D, B, T),
    `model.mtp_losses`, or (0,) without `mtp`), and the loss function weighs the second into the gradient.
    `after`: the layers of the later stages. What the model's layers hand on beside the hidden state
    (`model.stage_handoff`: Gemma 4's shared keys and values, its per-layer inputs) a non-last stage returns after
    it, (hidden, *handed), and the next stage takes as its further inputs (`model.stage_carry`)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], is_first: bool, is_last: bool,
                 after: list[int] | None = None):
        super().__init__()
        self.layers = nn.ModuleList(model.layers[str(i)] for i in layer_ids)
        self.is_first, self.is_last = is_first, is_last
        self.later, self.after = list(layer_ids) + list(after or ()), list(after or ())
        self.documents = None
        self.mtp = None
        object.__setattr__(self, "model", model)  # not a submodule: the stage owns only its layers

    def forward(self, x: torch.Tensor, *handed: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.is_first:
            tokens, x = x, self.model.embed(x, 0, self.documents)
            carry = self.model.stage_carry((), self.later, tokens, x)
        else:
            carry = self.model.stage_carry(handed, self.later)
        extra = () if carry is None else (carry,)
        x = self.model.run_layers(x, self.layers, self.documents, *extra)
        if not self.is_last:
            handoff = self.model.stage_handoff(carry, self.after)
            return (x, *handoff) if handoff else x
        hidden = self.model.ln_f(x)
        if getattr(self.model, "mtp", None) is None:
            return hidden
        # a model with depths always gives two outputs (the schedule fixes their number on its shape inference,
        # which runs without a micro-batch: then no depth loss, (0,))
        if self.mtp is None:
            return hidden, hidden.new_zeros(0)
        return hidden, self.model.mtp_losses(self.model.mtp_input(x, hidden), self.mtp, self.documents)


class ShardlmStage(PipelineStage):
    """A `PipelineStage` that records each point-to-point send and receive the schedule posts (kinds
    "send" / "recv" in the "pp" group of `ctx.comm`, with the tensor's bytes) and leaves the RNG
    tracker as it found it when the schedule infers shapes.

    On its first step a schedule runs each stage's forward and backward once on stand-in tensors to
    learn the shapes it will send. PyTorch forks the default generators around that, but not
    `ctx.rng`, whose model-parallel generator draws the attention-dropout masks: without the fork
    below, that state would advance once more in every run's first step, so a run resumed from a
    checkpoint (whose first step infers again) would draw other masks than the uninterrupted run."""

    def __init__(self, *args, ctx: ParallelContext, **kwargs):
        super().__init__(*args, **kwargs)
        self.ctx = ctx
        self.stats = ctx.comm
        self.documents: list | None = None  # per micro-batch, set by the runner before a step
        self.mtp: list | None = None  # per micro-batch multi-token-prediction (inputs, targets), likewise
        self.chunk_id: int | None = None  # the micro-batch last run (None before a step's first: shape inference)
        self.timeline: list | None = None  # when a list: (kind F/B/I/W, stage, micro-batch, start, end) per action

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        """Run micro-batch `fwd_chunk_id` with its packed documents (when the step has them): every stage,
        not only the first, gets the boundaries from the runner, never through the activations. The last
        stage also gets the micro-batch's multi-token-prediction inputs and targets (when the model has
        depths); the schedule's shape inference, outside this call, runs without them. `chunk_id` keeps the
        index, so the loss that follows knows its micro-batch."""
        self.chunk_id = fwd_chunk_id
        if fwd_chunk_id == 0:  # the shape inference ran this stage on stand-in inputs first: QK-clip's per-head
            for module in self.submod.modules():  # maxima (`shardlm.models.max_logits`) start from the real ones
                if getattr(module, "max_logits", None) is not None:
                    module.max_logits.fill_(float("-inf"))
        self.submod.documents = None if self.documents is None else self.documents[fwd_chunk_id]
        self.submod.mtp = None if self.mtp is None or not self.is_last else self.mtp[fwd_chunk_id]
        try:
            return self._timed("F", fwd_chunk_id, lambda: super(ShardlmStage, self)
                               .forward_one_chunk(fwd_chunk_id, *args, **kwargs))
        finally:
            self.submod.documents = self.submod.mtp = None

    @contextlib.contextmanager
    def _tracker_untouched(self):
        tracker = self.ctx.rng
        saved = tracker.get_states() if tracker is not None else None
        try:
            yield
        finally:
            if tracker is not None:
                tracker.set_states(saved)

    def _prepare_forward_infra(self, *args, **kwargs):
        with self._tracker_untouched():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        with self._tracker_untouched():
            return super()._prepare_backward_infra(*args, **kwargs)

    # ---- the backward split into its input- and weight-gradient steps (zero-bubble schedules)

    def weights(self) -> list[nn.Parameter]:
        """Every trainable parameter this stage's backward reaches: its layers' and the end pieces it runs (the
        embedding on the first stage; the final norm, output layer and depths on the last), which the model,
        not the `StageModule`, owns. Under FSDP, the gathered parameters the forward ran with (the modules hold
        the shards between forwards, and the gathered ones keep the gradients until the reduce-scatter)."""
        module = self.submod
        params = list(module.parameters())
        seen = {id(p) for p in params}
        params += [p for p in end_parameters(module.model, module.is_first, module.is_last) if id(p) not in seen]
        gathered = _gathered_parameters(module)
        return [gathered.get(id(p), p) for p in params if p.requires_grad]

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """PyTorch's split steps take only `submod.parameters()`, which would leave the last stage's final norm
        and output layer without a gradient: here both steps take `weights()`. The input step computes the
        stage input's gradient and keeps, at each node where a weight's path meets the input's, the gradient
        the weight step starts from; the weight step sets or adds `.grad` itself, so the master-weight
        optimizer's hook never sees it: `_flush_main_grad` moves it into the fp32 `main_grad` as the hook
        would. A full backward (every other schedule, and the first stage's weight step) is PyTorch's."""
        if backward_type == "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if isinstance(self.submod, FSDPModule):  # gradients stay unreduced until the schedule's REDUCE_GRAD
            self.submod.set_is_last_backward(False)
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(False)
        weights = self.weights()
        if backward_type == "input":
            return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                        bwd_kwargs["input_values"], iter(weights))
        # retain_graph: two groups of weights can share part of the graph (the word embedding that the last
        # stage's depths read and its output layer multiplies by), and PyTorch frees each group's path after it;
        # the graph goes once this step's saved state is dropped
        stage_backward_weight(iter(weights), bwd_kwargs["param_groups"], retain_graph=True)
        _flush_main_grad(weights)
        return (), None

    def _timed(self, kind: str, chunk: int, run):
        if self.timeline is None:
            return run()
        start = time.perf_counter()
        try:
            return run()
        finally:
            self.timeline.append((kind, self.stage_index, chunk, start, time.perf_counter()))

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        return self._timed("B" if full_backward else "I", bwd_chunk_id, lambda: super(ShardlmStage, self)
                           .backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        return self._timed("W", bwd_chunk_id, lambda: super(ShardlmStage, self)
                           .backward_weight_one_chunk(bwd_chunk_id, last_backward))

    def _count(self, ops: list, kind: str) -> list:
        for op in ops:
            self.stats.record(kind, "pp", op.tensor)
        return ops

    def get_fwd_send_ops(self, *args, **kwargs):
        return self._count(super().get_fwd_send_ops(*args, **kwargs), "send")

    def get_bwd_send_ops(self, *args, **kwargs):
        return self._count(super().get_bwd_send_ops(*args, **kwargs), "send")

    def get_fwd_recv_ops(self, *args, **kwargs):
        return self._count(super().get_fwd_recv_ops(*args, **kwargs), "recv")

    def get_bwd_recv_ops(self, *args, **kwargs):
        return self._count(super().get_bwd_recv_ops(*args, **kwargs), "recv")


def _gathered_parameters(module: nn.Module) -> dict[int, nn.Parameter]:
    """{id of an FSDP shard: the gathered parameter the forward used} for every FSDP unit in `module` that is
    gathered now (empty without FSDP)."""
    gathered = {}
    for unit in module.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            if hasattr(fsdp_param, "_unsharded_param"):
                gathered[id(fsdp_param.sharded_param)] = fsdp_param._unsharded_param
    return gathered


def _flush_main_grad(weights: list[nn.Parameter]) -> None:
    """Move each weight's fresh `.grad` into its fp32 `main_grad` (where the master-weight optimizer keeps one),
    exactly as that optimizer's post-accumulate-grad hook does after a whole backward."""
    for param in weights:
        if param.grad is not None and hasattr(param, "main_grad"):
            param.main_grad.add_(param.grad)
            param.grad = None


def end_parameters(model: nn.Module, is_first: bool, is_last: bool) -> list[nn.Parameter]:
    """The parameters of the end pieces (`model.FIRST_STAGE` / `LAST_STAGE`: modules or bare parameters)
    that a stage runs besides its layers."""
    names = (model.FIRST_STAGE if is_first else ()) + (model.LAST_STAGE if is_last else ())
    pieces = [getattr(model, name) for name in dict.fromkeys(names)]
    return [p for piece in pieces for p in ([piece] if isinstance(piece, nn.Parameter) else piece.parameters())]


def shard_stage(stage: StageModule, **fsdp_kwargs) -> None:
    """`fully_shard` one pipeline stage as an FSDP root (its layers already each a unit of their own; the
    keyword arguments are `fully_shard`'s). The root's own group is the end pieces the stage runs (first
    stage: the embeddings; last stage: the final norm and the output layer, the tied embedding's copy),
    gathered before the stage's first forward of a step and kept so until the reduce-scatter
    (`reshard_after_forward=False`: the loss runs the output layer outside the stage's forward;
    `ignored_params` stay outside FSDP). PyTorch's schedules see an FSDP stage and keep
    gradients unreduced until the stage's last backward of the step, then reduce-scatter each unit once.

    FSDP swaps a parameter on the modules it finds it in, and some end pieces are the model's bare
    parameters (GPT's `wpe`): the model is shown to `fully_shard` as a child of the stage for this call only,
    every parameter but this stage's end pieces ignored, so the stage still owns only its layers."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    # a V-shaped rank 0 shards its first stage before its last: the word embedding both use is then already
    # that first root's (one unit, gathered from the step's first forward until its reduce-scatter, which
    # PyTorch's order puts after the last stage's weight steps)
    ends = [p for p in end_parameters(stage.model, stage.is_first, stage.is_last) if not isinstance(p, DTensor)]
    ignored = set(fsdp_kwargs.pop("ignored_params", None) or ())
    if not ends:
        fully_shard(stage, ignored_params=ignored, **fsdp_kwargs)
        return
    ignored |= set(stage.model.parameters()) - set(ends)
    stage._modules["owner"] = stage.model
    try:
        fully_shard(stage, ignored_params=ignored, **fsdp_kwargs)
    finally:
        del stage._modules["owner"]


class ForwardOnlyV(ScheduleZBVZeroBubble):
    """Forwards only, over the V-shaped placement (evaluation, a preference run's reference pass): rank r runs
    every micro-batch through stage r, then through its mirror 2P - 1 - r. PyTorch's V schedules cannot run
    forward only (their `eval` still hands the input-gradient steps' outputs between a rank's two stages)."""

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action]:
        return [_Action(stage, _ComputationType.FORWARD, mb)
                for stage in (rank, self.num_stages - 1 - rank) for mb in range(self._n_microbatches)]

    def _prepare_schedule_with_comms(self, actions, format: str = "compute_only") -> None:
        """Only the sends and receives between the forwards (PyTorch's check would want every micro-batch's
        backward in the order; the V's stage-to-rank mapping is already set)."""
        self.pipeline_order_with_comms = _add_send_recv(
            {rank: list(ops) for rank, ops in actions.items()},
            stage_to_rank=lambda s: self.stage_index_to_group_rank[s], num_stages=self._num_stages)


def build_schedule(model: nn.Module, ctx: ParallelContext, layers: list[list[int]], schedule: str,
                   num_micro_batches: int, loss_fn, modules: list[StageModule] | None = None):
    """The stages this rank runs, wrapped for PyTorch's pipelining, and the schedule that drives them.

    `loss_fn(output, targets) -> scalar` runs on the last stage once per micro-batch (`output`: what the
    last `StageModule` returns); its gradient is what backward propagates (the schedule does not rescale
    gradients). `modules`: this rank's `StageModule`s to reuse (another schedule over the same, possibly
    FSDP-sharded, stages); built anew when None. The V-shaped schedules (`V_SHAPED`, and "forward-v", their
    forward-only order) place stages r and 2P - 1 - r on rank r; the others s on s mod P.
    """
    num_stages = len(layers)
    v_shaped = schedule in (*V_SHAPED, "forward-v")
    stages = []
    for i, s in enumerate(local_stages(ctx, num_stages // ctx.pp_size, v_shaped)):
        after = [j for later in layers[s + 1:] for j in later]
        module = StageModule(model, layers[s], s == 0, s == num_stages - 1, after) if modules is None else modules[i]
        stages.append(ShardlmStage(module, s, num_stages, ctx.device, group=ctx.pp.group, ctx=ctx))
    multi = {"interleaved-1f1b": ScheduleInterleaved1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV, "forward-v": ForwardOnlyV}
    if schedule in multi:
        return stages, multi[schedule](stages, num_micro_batches, loss_fn=loss_fn, scale_grads=False)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return stages, kind(stages[0], num_micro_batches, loss_fn=loss_fn, scale_grads=False)
