"""The trainer's forward and backward under pipeline parallelism (`parallel.pipeline` > 1).

`PipelineRunner` turns a built model into this rank's stages (`shardlm.parallel.pipeline`) and runs
one optimizer step's micro-batches through PyTorch's schedule (any of `shardlm.parallel.pipeline.SCHEDULES`; under
the V-shaped ones rank 0 holds both the first and the last stage, so "first" and "last" below are the ranks that
hold those stages). Every rank of a pipeline group reads
the same micro-batches of its data-parallel rank; the first stage feeds the tokens, the last stage
the targets (and, with multi-token prediction, runs the depths on each micro-batch's rolled tokens, which
`ShardlmStage` hands it, and weighs their loss into the gradient as one process does). After the schedule:
  1. the word embedding's two copies (tied output layer, or the depths' input embedding) add their
     gradients (embedding group, first + last stage);
  2. the last stage's mean loss (and multi-token-prediction loss) is broadcast over the pipeline group, so
     every rank reports it.
The trainer then averages gradients over the data-parallel group (one coalesced all-reduce, or the
distributed optimizer's reduce-scatter): DDP is not used under pipelining. Under FSDP
(`train.data_sharding = "full"`) each stage module is an FSDP root (`stage_modules`, sharded by
`shardlm.training.fsdp.shard_model`): the schedule runs every micro-batch's backward without gradient
sync or resharding, then reduce-scatters each unit once after the stage's last backward, so step 1 sums
the tied embedding's already-reduced gradient shards, and the trainer has nothing left to average.
The loss of each micro-batch is divided by the micro-batch count (and multiplied by the fp16 loss
scale) before its backward, as the trainer does without pipelining, so gradients are the same sums.

A loss of whole sequences (preference pairs, `shardlm.preference.loss`) is `sequence_loss(token_losses,
micro-batch)`: the last stage hands it the output layer's per-token losses with the dict of the micro-batch it
belongs to (the stage records which one it ran), and `reference_pass` runs the micro-batches forward once more
under a context (the base with adapters off) to record their reference log-probabilities.
"""

from __future__ import annotations

import torch

from shardlm.config import RunConfig
from shardlm.models import dynamic_fine_tuning
from shardlm.models.mtp import add_mtp_gradient
from shardlm.parallel import ParallelContext
from shardlm.parallel.pipeline import (
    V_SHAPED,
    build_schedule,
    keep_stages,
    local_stages,
    stage_layers,
    stage_owner,
    stages_per_rank,
    sum_tied_gradients,
)


def pipeline_layout(config: RunConfig, ctx: ParallelContext) -> tuple[list[list[int]], list[int]]:
    """(layer indices of every stage, the stages this rank runs) for the run's pipeline keys."""
    p = config.parallel
    per_rank = stages_per_rank(p.pipeline_schedule, p.virtual_stages)
    layers = stage_layers(config.model.num_layers, ctx.pp_size * per_rank, p.first_stage_layers, p.last_stage_layers)
    return layers, local_stages(ctx, per_rank, p.pipeline_schedule in V_SHAPED)


class PipelineRunner:
    """This rank's pipeline stages of `model` (pruned in place) and the schedule of one step.

    `layers`: layer indices of every stage; `stage_ids`: the stages this rank runs (`pipeline_layout`)."""

    def __init__(self, model: torch.nn.Module, ctx: ParallelContext, layers: list[list[int]], stage_ids: list[int],
                 schedule: str, num_micro_batches: int):
        self.model, self.ctx = model, ctx
        self.num_micro_batches = num_micro_batches
        self.layers, self.stage_ids = layers, stage_ids
        keep_stages(model, self.layers, self.stage_ids)
        self.has_first, self.has_last = 0 in stage_ids, len(layers) - 1 in stage_ids
        self.v_shaped = schedule in V_SHAPED
        self.last_rank = stage_owner(len(layers) - 1, ctx.pp_size, len(layers), self.v_shaped)
        self.schedule_name = schedule
        self.loss_factor = 1.0
        self.divisor: float | None = None  # packed rows: the step's sum-over-tokens divisor
        self.dft = False  # packed rows of an sft.loss_type="dft" run: Dynamic Fine-Tuning's token weights
        self.mtp_divisors: list[float] = []  # multi-token prediction: each depth's divisor, and the loss weight
        self.mtp_weight = 0.0
        self.mtp_loss_sum = torch.zeros(())  # the last step's sum of micro-batch MTP losses, on every rank
        self._losses: list[torch.Tensor] = []
        self._mtp_losses: list[torch.Tensor] = []
        self.stages, self.schedule = build_schedule(model, ctx, self.layers, self.schedule_name, num_micro_batches,
                                                    self._loss)
        self._evals: dict[int, tuple] = {}  # micro-batch count -> (stages, forward-only schedule)
        self._running: list = self.stages  # the stages of the schedule being run
        self._batches: list = []  # the dicts of the micro-batches being run
        self.sequence_loss = None  # (token losses (b, T), micro-batch dict) -> loss, for a loss of sequences
        self.hidden_loss = None  # (final-norm output, micro-batch dict) -> loss, for a loss of hidden states

    def record_timeline(self, timeline: list | None) -> None:
        """Append every compute action of the following steps to `timeline` as (kind, stage, micro-batch, start,
        end) (kind "F" forward, "B" whole backward, "I" / "W" its input- and weight-gradient halves; times of
        `time.perf_counter`); None stops recording. What the benchmark draws and measures idle time from."""
        for stage in self.stages:
            stage.timeline = timeline

    @property
    def stage_modules(self) -> list[torch.nn.Module]:
        """This rank's `StageModule`s, in stage order (what FSDP shards as roots, `shard_stage`)."""
        return [stage.submod for stage in self.stages]

    def _loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: `output` is the final norm's output (B, T, h), or that and
        the multi-token-prediction depths' per-token losses (D, B, T) (`StageModule`; empty on the schedule's
        shape inference); targets (B, T)."""
        hidden, depth_losses = output if isinstance(output, tuple) else (output, None)
        if self.hidden_loss is not None:  # distillation: the divergence from the teacher's recorded hidden states
            chunk = self._running[-1].chunk_id
            loss = hidden.sum() * 0.0 if chunk is None else self.hidden_loss(hidden, self._batches[chunk])
            if chunk is not None:
                self._losses.append(loss.detach())
            return loss * self.loss_factor
        losses = self.model.output_loss(hidden, targets)
        if self.sequence_loss is not None:
            chunk = self._running[-1].chunk_id
            if chunk is None:  # the schedule's shape inference: no micro-batch of its own, nothing recorded
                return losses.sum() * 0.0
            loss = self.sequence_loss(losses, self._batches[chunk])
        else:
            if self.dft:
                losses = dynamic_fine_tuning(losses)
            loss = losses.mean() if self.divisor is None else losses.sum() / self.divisor
        self._losses.append(loss.detach())
        if depth_losses is not None and depth_losses.numel():
            loss, mtp_loss = add_mtp_gradient(loss, depth_losses, self.mtp_divisors, self.mtp_weight)
            self._mtp_losses.append(mtp_loss)
        return loss * self.loss_factor

    def _run(self, schedule, batches: list, train: bool) -> torch.Tensor:
        """Run `schedule` over `batches` (each (b, T + 1), a context-parallel rank's (inputs, targets), or
        packed rows' dict, `shardlm.training.data.packed_parts`, whose documents every stage gets, with
        multi-token prediction's `mtp` for the last stage, `add_multi_token_targets`); the sums of the
        micro-batch losses and MTP losses on the last stage (zeros elsewhere), shape (2,)."""
        self.divisor, self.dft = None, False
        documents = mtp = None
        if isinstance(batches[0], dict):
            inputs, targets = torch.cat([b["inputs"] for b in batches]), torch.cat([b["targets"] for b in batches])
            documents, self.divisor = [b["documents"] for b in batches], batches[0]["divisor"]
            self.dft = bool(batches[0].get("dft"))
            if "mtp" in batches[0]:
                mtp = [b["mtp"] for b in batches]
                self.mtp_divisors, self.mtp_weight = batches[0]["mtp_divisors"], batches[0]["mtp_weight"]
        elif isinstance(batches[0], tuple):
            inputs, targets = (torch.cat(parts) for parts in zip(*batches))
        else:
            batch = torch.cat(batches)
            inputs, targets = batch[:, :-1], batch[:, 1:]
        self._running = self.stages if schedule is self.schedule else self._evals[len(batches)][0]
        self._batches = batches
        for stage in self._running:
            stage.documents, stage.mtp, stage.chunk_id = documents, mtp, None
        self._losses.clear()
        self._mtp_losses.clear()
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        (schedule.step if train else schedule.eval)(*args, target=target, return_outputs=False)
        if not self.has_last:
            return torch.zeros(2, device=self.ctx.device)
        # the schedule may call the loss once more first, on its shape inference's stand-ins (without MTP)
        mtp_sum = torch.stack(self._mtp_losses).sum() if mtp else torch.zeros((), device=self.ctx.device)
        return torch.stack((torch.stack(self._losses[-len(batches):]).sum(), mtp_sum.to(self._losses[-1].dtype)))

    def forward_backward(self, batches: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one step's micro-batches; the tied embedding's gradients summed over its
        two stages (the trainer then averages gradients over DP). Returns the sum of the micro-batch
        losses, the same on every rank of the step's pipeline group (before the DP average); with
        multi-token prediction the sum of their MTP losses is `mtp_loss_sum` likewise."""
        if len(batches) != self.num_micro_batches:
            raise ValueError(f"{len(batches)} micro-batches, but the schedule was built for {self.num_micro_batches}")
        self.loss_factor = scale / len(batches)
        sums = self._run(self.schedule, batches, train=True)
        sum_tied_gradients(self.model, self.ctx)
        loss_sum, self.mtp_loss_sum = self.broadcast_from_last_stage(sums)
        return loss_sum

    def _forward_only(self, count: int):
        """The forward-only schedule of `count` micro-batches over the same stages: GPipe, interleaved with
        virtual stages, each rank's two stages in turn with the V-shaped placement (`ForwardOnlyV`)."""
        if count not in self._evals:
            kind = "forward-v" if self.v_shaped else "gpipe" if len(self.stage_ids) == 1 else "interleaved-1f1b"
            self._evals[count] = build_schedule(self.model, self.ctx, self.layers, kind, count, self._loss,
                                                self.stage_modules)
        return self._evals[count][1]

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the mean losses of `batches` (forward only, GPipe over all of them at once), on every rank."""
        self.loss_factor = 1.0
        return self.broadcast_from_last_stage(self._run(self._forward_only(len(batches)), batches, train=False))[0]

    @torch.no_grad()
    def reference_pass(self, batches: list[dict], record, context) -> None:
        """Run `batches` (dicts) forward under `context` (entered on every rank), calling `record(token_losses,
        micro-batch dict)` on the last stage for each: how a preference run's reference log-probabilities are
        taken from the same stages (the base with adapters off, or the starting weights)."""
        loss, self.sequence_loss = self.sequence_loss, lambda losses, batch: record(losses, batch) or losses.sum() * 0.0
        try:
            with context:
                self._run(self._forward_only(len(batches)), batches, train=False)
        finally:
            self.sequence_loss = loss

    def broadcast_from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (any shape) as the last pipeline stage holds it, on every rank of the pipeline group."""
        return self.ctx.pp.broadcast(value.clone(), self.last_rank)
