"""The weight copies a run keeps (TR-DPO's synced reference, BEMA's) read back from a checkpoint saved at any layout:
the `PREFIX/NAME` tensors `state.reference_tensors` wrote beside the model's, through the model's own loader."""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.checkpoint import files
from shardlm.checkpoint.sharded import ShardedReader
from shardlm.checkpoint.state import load_weights, reader_of
from shardlm.errors import UserError


class _Renamed:
    """A `ShardedReader` whose "reference/NAME" tensors read as "model/NAME" (the model's loader reads them)."""

    def __init__(self, reader: ShardedReader, prefix: str):
        self.reader, self.prefix = reader, prefix

    def _key(self, key: str) -> str:
        return self.prefix + key.removeprefix("model")

    def keys(self) -> set[str]:
        return {"model" + k.removeprefix(self.prefix) for k in self.reader.keys() if k.startswith(self.prefix + "/")}

    def shape(self, key: str) -> list[int]:
        return self.reader.shape(self._key(key))

    def read(self, key: str, split_dim: int | None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.reader.read(self._key(key), split_dim, start, end)


def load_reference(trainer, path: str | Path) -> None:
    """Restore a run's synced reference (`trainer.synced_reference`) from a checkpoint saved at any layout."""
    option = ("bema.update_ref_model" if trainer.sync is None else
              ("rl" if trainer.config.rl.loss else "preference") + ".sync_ref_model")
    _load_copy(trainer, path, "reference", trainer.synced_reference,
               f"synced reference (its run had {option} off); resume with {option}=false")


def load_bema(trainer, path: str | Path) -> None:
    """Restore a run's BEMA copies (`trainer.bema`: its weights, theta_0 and EMA) from a checkpoint saved at any
    layout."""
    for prefix, copy in trainer.bema.copies().items():
        _load_copy(trainer, path, prefix, copy, "BEMA weights (its run had bema.enabled off); resume with "
                   "bema.enabled=false")


def _load_copy(trainer, path: str | Path, prefix: str, copy, missing: str) -> None:
    """The checkpoint's "PREFIX/NAME" tensors into `copy` (a `ReferenceWeights`), through the model's loader;
    `missing`: what a checkpoint without them lacks, and why."""
    checkpoint = files.resolve(path)
    meta = files.read_meta(checkpoint)
    reader = _Renamed(reader_of(checkpoint, meta), prefix)
    if not reader.keys():
        raise UserError(f"the checkpoint {checkpoint} holds no {missing}, or start a new run directory from its "
                        "weights with checkpoint.init_from")
    kept = {id(p) for p in copy.params}
    with copy.swapped(keep=True):
        load_weights(trainer.model, reader, trainer.ctx,
                     names={name for name, p in trainer.model.named_parameters() if id(p) in kept})
