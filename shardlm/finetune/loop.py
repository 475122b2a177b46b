"""The fine-tuning loop: epochs over shuffled global batches, AdamW with warmup and linear decay,
global gradient clipping, and accuracy (and F1) on the evaluation sets after every epoch.

Parallelism is the pretraining one: every TP rank of a group reads the same examples (the model is
split across them), and DP rank d takes the d-th contiguous slice of each global batch, cut into
micro-batches; DDP averages gradients over the DP group during the last micro-batch's backward.
The order of examples depends only on the seed and the epoch, so any layout trains on the same
batches. Evaluation and prediction split each set over DP ranks (rank d takes examples d, d + DP,
...) and put the predicted classes (SQuAD: the start/end logits) back in example order with one
all-gather, so every rank holds all predictions; metrics are computed from them. The head's loss and
an evaluation set's metrics are arguments (`loss_fn`, `evaluate_fn`), so SQuAD's span head and its
decoded answers use the same loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardlm.errors import UserError
from shardlm.finetune.heads import choice_loss
from shardlm.finetune.inputs import TaskData
from shardlm.parallel import ParallelContext
from shardlm.training.optim import build_optimizer, clip_grad_norm, learning_rate


@dataclass
class FinetuneSettings:
    """Hyper-parameters of one fine-tuning run (the paper's RACE recipe for 336M: 3 epochs, batch 32, lr 2e-5)."""

    epochs: int = 3
    """Passes over the training set."""
    batch_size: int = 32
    """Examples per optimizer step over all DP ranks."""
    micro_batch_size: int = 0
    """Examples per forward/backward on one DP rank; 0: batch_size / DP (no accumulation)."""
    lr: float = 2e-5
    """Peak learning rate (linear warmup, then linear decay to 0)."""
    warmup: float = 0.1
    """Fraction of all steps spent warming up."""
    weight_decay: float = 0.01
    """AdamW weight decay (not on biases and LayerNorm)."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping; 0 disables."""
    seed: int = 1234
    """Seed of the head's initialization, the example order and dropout."""
    eval_batch_size: int = 32
    """Examples per forward pass when evaluating (per DP rank)."""

    def per_rank_micro_batch(self, data_parallel: int) -> int:
        """Micro-batch size on one DP rank; raises UserError when the batch does not divide."""
        if self.batch_size % data_parallel:
            raise UserError(f"--batch-size={self.batch_size} is not divisible by the data-parallel size "
                            f"{data_parallel}; use a multiple of it")
        per_rank = self.batch_size // data_parallel
        micro = self.micro_batch_size or per_rank
        if per_rank % micro:
            raise UserError(f"--batch-size / data-parallel = {per_rank} is not divisible by "
                            f"--micro-batch-size={micro}")
        return micro


def batch_order(num_examples: int, batch_size: int, seed: int, epoch: int) -> np.ndarray:
    """(steps, batch_size) example indices of one epoch: a seeded permutation, the last partial batch dropped."""
    steps = num_examples // batch_size
    permutation = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return permutation[:steps * batch_size].reshape(steps, batch_size)


def train_step(forward, data: TaskData, indices: np.ndarray, micro: int, ctx: ParallelContext,
               ddp: DistributedDataParallel | None, loss_fn: Callable = choice_loss) -> torch.Tensor:
    """Forward/backward of this DP rank's slice of one global batch; returns its mean loss (detached).
    `loss_fn(outputs, labels)` is the head's loss (`choice_loss`, or `span_loss` for SQuAD)."""
    per_rank = len(indices) // ctx.dp_size
    mine = indices[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
    chunks = [mine[i:i + micro] for i in range(0, per_rank, micro)]
    total = torch.zeros((), device=ctx.device)
    for i, chunk in enumerate(chunks):
        batch = data.batch(chunk, ctx.device)
        last = i == len(chunks) - 1
        with contextlib.nullcontext() if ddp is None or last else ddp.no_sync():
            loss = loss_fn(forward(batch["tokens"], batch["token_types"], batch["padding_mask"]), batch["labels"])
            (loss / len(chunks)).backward()
        total += loss.detach() / len(chunks)
    return total


@torch.no_grad()
def model_outputs(model: nn.Module, data: TaskData, ctx: ParallelContext, batch_size: int,
                  output: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...] = (),
                  dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """(N, *shape) `output(logits)` of every example of `data`, in example order, on every rank.

    DP rank d runs examples d, d + DP, ... in batches of `batch_size`; one all-gather over the DP group
    of (ceil(N / DP), *shape) outputs interleaves them back. TP ranks compute identical (replicated)
    logits. The model's train/eval mode is restored afterwards."""
    if len(data) == 0:
        return torch.zeros((0, *shape), dtype=dtype)
    was_training = model.training
    model.eval()
    mine = np.arange(ctx.dp_rank, len(data), ctx.dp_size)
    per_rank = -(-len(data) // ctx.dp_size)
    local = torch.zeros((per_rank, *shape), dtype=dtype, device=ctx.device)
    for start in range(0, len(mine), batch_size):
        batch = data.batch(mine[start:start + batch_size], ctx.device)
        result = output(model(batch["tokens"], batch["token_types"], batch["padding_mask"]))
        local[start:start + len(result)] = result
    gathered = torch.stack(ctx.dp.all_gather(local), dim=1)  # (per_rank, DP, ...): [j, d] is example j * DP + d
    model.train(was_training)
    return gathered.reshape(-1, *shape)[:len(data)].cpu()


def predict(model: nn.Module, data: TaskData, ctx: ParallelContext, batch_size: int) -> np.ndarray:
    """(N,) int64 argmax class (or option) of every example of `data`, in example order, on every rank
    (`model_outputs` of (B, K) logits)."""
    return model_outputs(model, data, ctx, batch_size, lambda logits: logits.argmax(-1)).numpy()


def task_metrics(predicted: np.ndarray, labels: np.ndarray, f1: bool = False) -> dict:
    """{"accuracy", "examples"[, "f1" of class 1]} of (N,) predictions against (N,) labels."""
    correct = int((predicted == labels).sum())
    result = {"accuracy": correct / max(len(labels), 1), "examples": len(labels)}
    if f1:
        tp = int(((predicted == 1) & (labels == 1)).sum())
        fp = int(((predicted == 1) & (labels != 1)).sum())
        fn = int(((predicted != 1) & (labels == 1)).sum())
        result["f1"] = 2 * tp / max(2 * tp + fp + fn, 1)
    return result


def evaluate(model: nn.Module, data: TaskData, ctx: ParallelContext, batch_size: int, f1: bool = False) -> dict:
    """Accuracy (and F1 of class 1) of `model` on `data`, examples shared out over the DP group."""
    return task_metrics(predict(model, data, ctx, batch_size), data.labels, f1)


def finetune(model: nn.Module, ctx: ParallelContext, train: TaskData, evals: dict,
             settings: FinetuneSettings, f1: bool = False, report: Callable[[dict], None] | None = None,
             loss_fn: Callable = choice_loss, evaluate_fn: Callable | None = None) -> list[dict]:
    """Train `model` (a head model from `heads.py`) on `train`; after every epoch evaluate each set of
    `evals`. Returns one dict per epoch: epoch, steps, train_loss (mean over the epoch), lr and, per
    evaluation set, {"accuracy", "examples"[, "f1"]}. `report` is called with each epoch's dict.
    `loss_fn(outputs, labels)` is the head's loss; `evaluate_fn(model, name, set)`, when given, gives
    an evaluation set's metrics instead of `evaluate` (SQuAD decodes answers and scores them)."""
    micro = settings.per_rank_micro_batch(ctx.dp_size)
    steps_per_epoch = len(train) // settings.batch_size
    if steps_per_epoch == 0:
        raise UserError(f"the training set has {len(train)} examples, fewer than --batch-size={settings.batch_size}")
    total_steps = steps_per_epoch * settings.epochs
    warmup_steps = int(round(settings.warmup * total_steps))
    model.train()
    ddp = None
    if ctx.dp_size > 1:
        ddp = DistributedDataParallel(model, process_group=ctx.dp.group)  # the models register no buffers
    forward = ddp or model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, settings.lr, settings.weight_decay, (0.9, 0.999), 1e-8, ctx.device)
    history, step = [], 0
    for epoch in range(1, settings.epochs + 1):
        losses = []
        for indices in batch_order(len(train), settings.batch_size, settings.seed, epoch):
            loss = train_step(forward, train, indices, micro, ctx, ddp, loss_fn)
            lr = learning_rate(step, settings.lr, 0.0, warmup_steps, max(1, total_steps - warmup_steps), "linear")
            clip_grad_norm(params, settings.clip_grad, ctx)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss)
            step += 1
        mean_loss = torch.stack(losses).mean()
        ctx.dp.all_reduce(mean_loss)
        record = {"epoch": epoch, "steps": step, "train_loss": mean_loss.item() / ctx.dp_size, "lr": lr}
        for name, data in evals.items():
            record[name] = (evaluate_fn(model, name, data) if evaluate_fn is not None
                            else evaluate(model, data, ctx, settings.eval_batch_size, f1))
        history.append(record)
        if report is not None:
            report(record)
    return history

