"""The reference model's log-probabilities precomputed over the data set (`preference.reference =
"precomputed"`): one pass of the starting weights over every training pair before the first step, at the run's
layout, saved in the run directory so a resumed run reads them instead of recomputing them from weights it no
longer has."""

from __future__ import annotations

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
    is now: epoch 0's rows (which hold every kept pair once) in micro-batches over the DP ranks, summed over DP.
    Every rank runs as many forwards (the last ones on empty rows where the rows run out): FSDP's gathers and the
    experts' all-to-all need every rank of their groups."""
    ctx, t = trainer.ctx, trainer.config.train
    table = torch.zeros(dataset.num_pairs, 2, dtype=torch.float64, device=ctx.device)
    rows = len(dataset.rows.plan(0))
    per_step = t.micro_batch_size * ctx.dp_size
    trainer.model.eval()
    with trainer.autocast():
        for start in range(0, -(-rows // per_step) * per_step, per_step):
            batch = micro_batches(_Epoch0(dataset, rows), start, per_step, t.micro_batch_size, ctx.dp_rank,
                                  ctx.dp_size, ctx.device)[0]
            part = preference_parts([batch], ctx, count_pairs=False)[0]
            losses = trainer.model(part["inputs"], part["targets"], documents=part["documents"])
            table[part["pairs"]] = sequence_logps(losses, part, ctx.cp)[0]
    trainer.model.train()
    ctx.dp.all_reduce(table)
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


def save_reference(table: torch.Tensor, run_dir: Path) -> Path:
    path = Path(run_dir) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    save_file({"reference_logps": table.cpu().contiguous()}, str(tmp))
    tmp.replace(path)
    return path


def load_reference(run_dir: Path, pairs: int) -> torch.Tensor:
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: a preference run resumed with preference.reference=\"precomputed\" reads "
                        "the reference log-probabilities its first start saved there")
    table = load_file(str(path))["reference_logps"]
    if table.shape != (pairs, 2):
        raise UserError(f"{path} holds {table.shape[0]} pairs' reference log-probabilities; the data has {pairs}")
    return table
