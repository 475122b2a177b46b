"""The training side of DeepSeek Sparse Attention's indexers (`shardlm.models.sparse_attention`) and of
DeepSeek-V4's CSA indexers (`shardlm.models.compressed_attention`, the same loss over compressed entries): the
stage's frozen parameters, the gradient their attached loss receives, and the step's metric.

- `freeze_for_warmup`: in the dense warm-up stage (`model.index_stage = "warmup"`) only the indexers train;
  everything else is frozen as a LoRA run freezes its base, so every data-parallel wrapper handles it.
- `set_indexer_loss_scale`, before the micro-batches: each indexer's loss gets the micro-batch loss's factor
  (loss scale / micro-batches), times C under context parallelism. Each CP rank's loss sums its own queries'
  divergences over the whole micro-batch's tokens, and the trainer averages gradients over CP, so C times the
  factor makes that average the gradient of the whole micro-batch's loss (as the MoE balancing loss does).
- `indexer_metrics`, after the step: {"indexer_kl": the per-token KL divergence of the step's micro-batches,
  averaged over the indexers of every stage}.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.models.compressed_attention import Indexer as CompressedIndexer
from shardlm.models.sparse_attention import Indexer
from shardlm.parallel import ParallelContext

INDEXERS = (Indexer, CompressedIndexer)
"""The indexer kinds: each has `cfg`, `loss_scale` and `recorded`, and attaches its loss by `attach_indexer_loss`."""


def indexers(model: nn.Module) -> list[Indexer | CompressedIndexer]:
    """The indexers of a model (of this rank's pipeline stages), in order: DSA's and DeepSeek-V4's."""
    return [m for m in model.modules() if isinstance(m, INDEXERS)]


def freeze_for_warmup(model: nn.Module) -> None:
    """Freeze every parameter but the indexers' (DeepSeek-V3.2's dense warm-up)."""
    trained = {id(p) for indexer in indexers(model) for p in indexer.parameters()}
    for param in model.parameters():
        if id(param) not in trained:
            param.requires_grad_(False)
            param.frozen_base = True  # FSDP still shards it (`shardlm.training.fsdp`)


def set_indexer_loss_scale(model: nn.Module, ctx: ParallelContext, loss_scale: float, micro_batches: int) -> None:
    """Before a step's micro-batches: every indexer's attached loss gets `loss_scale / micro_batches` x CP size."""
    for indexer in indexers(model):
        indexer.loss_scale = loss_scale / micro_batches * ctx.cp_size


@torch.no_grad()
def indexer_metrics(model: nn.Module, ctx: ParallelContext, micro_batches: int) -> dict:
    """After a step: {"indexer_kl"}, the mean over micro-batches and indexers of the per-token KL divergence
    (without its coefficient). CP ranks hold parts of each micro-batch's sum (added), DP ranks other
    micro-batches (averaged), pipeline stages other indexers (counted). Collective over DP x CP and PP."""
    total = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for indexer in indexers(model):
        recorded, indexer.recorded = indexer.recorded[-micro_batches:], []
        if recorded:
            total[0] += sum(float(loss) for loss in recorded) / micro_batches
            total[1] += 1
    ctx.dp_cp.all_reduce(total[:1])
    total[0] /= ctx.dp_size
    ctx.pp.all_reduce(total)
    return {"indexer_kl": (total[0] / total[1]).item()} if total[1] > 0 else {}
