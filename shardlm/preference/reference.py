"""The reference model's log-probabilities precomputed over the data set (`preference.reference =
"precomputed"`): one pass of the starting weights over every training pair before the first step, at the run's
layout, saved in the run directory so a resumed run reads them instead of recomputing them from weights it no
longer has."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from shardlm.errors import UserError
from shardlm.preference.loss import preference_parts, sequence_logps
from shardlm.training.data import micro_batches

FILE = "reference_logps.safetensors"


@torch.no_grad()
def precompute_reference(trainer, dataset) -> torch.Tensor:
    """(pairs, 2) fp64 log-probabilities of every pair of `dataset` (a `PairDataset`) under `trainer.model` as it
    is now: epoch 0's rows (which hold every kept pair once) in micro-batches over the DP ranks, summed over DP
    (and over the pipeline group, whose last stage alone computes them: the micro-batches go through the stages
    a step's worth at a time). Every rank runs as many forwards (the last ones on empty rows where the rows run
    out): FSDP's gathers and the experts' all-to-all need every rank of their groups."""
    ctx, t = trainer.ctx, trainer.config.train
    table = torch.zeros(dataset.num_pairs, 2, dtype=torch.float64, device=ctx.device)
    rows = len(dataset.rows.plan(0))
    per_step = t.micro_batch_size * ctx.dp_size
    epoch0 = _Epoch0(dataset, rows)
    parts = [preference_parts([micro_batches(epoch0, start, per_step, t.micro_batch_size, ctx.dp_rank, ctx.dp_size,
                                             ctx.device)[0]], ctx, count_pairs=False)[0]
             for start in range(0, -(-rows // per_step) * per_step, per_step)]

    def record(token_losses: torch.Tensor, part: dict) -> None:
        table[part["pairs"]] = sequence_logps(token_losses, part, ctx.cp)[0]

    trainer.model.eval()
    with trainer.autocast():
        if trainer.pipeline is None:
            for part in parts:
                record(trainer.model(part["inputs"], part["targets"], documents=part["documents"]), part)
        else:
            group = trainer.accumulation
            for i in range(0, len(parts), group):
                trainer.pipeline.reference_pass(parts[i:i + group], record, contextlib.nullcontext())
    trainer.model.train()
    ctx.dp.all_reduce(table)
    if ctx.pp_size > 1:
        ctx.pp.all_reduce(table)
    return table


class _Epoch0:
    """Epoch 0's rows of a `PairDataset`, then empty rows (no pair) to fill the last micro-batches."""

    def __init__(self, dataset, rows: int):
        self.dataset, self.rows = dataset, rows

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> dict:
        if index < self.rows:
            return self.dataset[index]
        length = self.dataset.rows.seq_length
        return {"input_ids": np.zeros(length, dtype=np.int64), "labels": np.full(length, -100),
                "position_ids": np.arange(length), "pair": np.full(length, -1), "side": np.full(length, -1)}


def save_reference(tables: dict[str, torch.Tensor], run_dir: Path) -> Path:
    """Write the tables ({"train": (pairs, 2), "valid": ...}) to the run directory's FILE (atomically)."""
    path = Path(run_dir) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    save_file({f"{split}_reference_logps": table.cpu().contiguous() for split, table in tables.items()}, str(tmp))
    tmp.replace(path)
    return path


def load_reference(run_dir: Path, pairs: dict[str, int]) -> dict[str, torch.Tensor]:
    """The tables `save_reference` wrote, each checked against its split's pair count (`pairs`)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: a preference run resumed with preference.reference=\"precomputed\" reads "
                        "the reference log-probabilities its first start saved there")
    tensors = load_file(str(path))
    tables = {}
    for split, count in pairs.items():
        table = tensors.get(f"{split}_reference_logps")
        if table is None or table.shape != (count, 2):
            held = "none" if table is None else table.shape[0]
            raise UserError(f"{path} holds {held} {split} pairs' reference log-probabilities; the data has {count}: "
                            "the run's data or sft.valid_fraction changed since its first start")
        tables[split] = table
    return tables
