"""A fine-tuned model as one file: `OUTPUT_DIR/model.safetensors`, written by `shardlm finetune --save`.

The file holds the encoder and the task head as full (TP=1) tensors, gathered from the TP shards,
each named `model/<parameter>` after the fine-tuning model (`model/bert.wte.weight`, ...,
`model/classify.weight` or `model/score.weight`). The word embedding is cut to the real vocabulary,
as `shardlm checkpoint convert` (`consolidate`) does; loading at any TP size pads it again with zero
rows (`ShardedReader`). Its safetensors metadata (strings):

    format       "shardlm-finetuned-v1"
    config       the run config as JSON, as in a consolidated pretraining checkpoint (`consolidated_config`
                 reads it), with `--dropout` and `--vocab-file` of the fine-tuning run applied
    task         race | mnli | qqp
    num_classes  4 (RACE's choices), 3 (MNLI), 2 (QQP)
    finetune     JSON: seq_length and max_qa_length of the inputs (the defaults when it is loaded again),
                 the pretrained checkpoint it started from, the fine-tuning settings

The file is written by global rank 0 only, into a hidden temporary file that is flushed to disk and
then renamed over the destination, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from shardlm.checkpoint import files
from shardlm.checkpoint.sharded import ShardedReader
from shardlm.checkpoint.state import consolidated_config, load_weights, safetensors_metadata, split_dim
from shardlm.config import RunConfig
from shardlm.parallel import ParallelContext

FORMAT = "shardlm-finetuned-v1"
WORD_EMBEDDING = "bert.wte.weight"


@dataclass(frozen=True)
class FinetunedInfo:
    """What a fine-tuned model file says about itself besides the run config."""

    task: str
    """race, mnli or qqp."""
    num_classes: int
    """Classes (MNLI 3, QQP 2) or choices per question (RACE 4) of the head."""
    seq_length: int
    """Input length the model was fine-tuned with."""
    max_qa_length: int
    """RACE: tokens kept of question+option when fine-tuning."""


def finetuned_info(path: str | Path) -> FinetunedInfo | None:
    """The `FinetunedInfo` of a fine-tuned model file; None for a pretraining checkpoint (a directory
    or a consolidated file)."""
    path = Path(path)
    if not path.is_file():
        return None
    metadata = safetensors_metadata(path)
    if metadata.get("format") != FORMAT:
        return None
    details = json.loads(metadata["finetune"])
    return FinetunedInfo(metadata["task"], int(metadata["num_classes"]), int(details["seq_length"]),
                         int(details["max_qa_length"]))


def full_tensor(param: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The whole of a parameter on the CPU: TP shards (each (..., n / tp, ...)) concatenated along its
    split dimension; replicated parameters as they are. An all-gather over the TP group for split ones."""
    dim = split_dim(param)
    if dim is None or ctx.tp_size == 1:
        return param.detach().cpu()
    return torch.cat(ctx.tp.all_gather(param.detach()), dim=dim).cpu()


def save_finetuned(model: nn.Module, ctx: ParallelContext, path: str | Path, config: RunConfig,
                   info: FinetunedInfo, details: dict) -> Path:
    """Write `model` (a head model of `heads.py`) as one TP=1 file at `path` (see the module docstring).

    Collective over all ranks: the TP group of DP rank 0 gathers the shards, global rank 0 writes,
    and every rank returns once the file is in place. `details` (JSON-able) joins the `finetune` metadata."""
    path = Path(path)
    tensors = {}
    if ctx.dp_rank == 0:
        for name, param in model.named_parameters():
            full = full_tensor(param, ctx)  # collective: every rank of the group gathers, rank 0 keeps
            if not ctx.is_main:
                continue
            if name == WORD_EMBEDDING:
                full = full[:config.model.vocab_size]  # drop the vocabulary padding
            tensors[f"model/{name}"] = full.contiguous()
    if ctx.is_main:
        metadata = {"format": FORMAT, "config": json.dumps(asdict(config)), "task": info.task,
                    "num_classes": str(info.num_classes),
                    "finetune": json.dumps({"seq_length": info.seq_length, "max_qa_length": info.max_qa_length,
                                            **details})}
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    ctx.world.barrier()
    return path


def load_finetuned(path: str | Path, ctx: ParallelContext,
                   build: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, RunConfig]:
    """(head model, config) from a fine-tuned model file, sharded for `ctx` at any TP size.
    `build(bert)` puts the task's head on the encoder; every weight is then read from the file."""
    from shardlm.models import build_model

    path = Path(path)
    config = consolidated_config(path)
    config.parallel.tensor = ctx.tp_size
    model = build(build_model(config.model, ctx, seed=config.train.seed))
    load_weights(model, ShardedReader([path]), ctx)
    return model, config
