"""Reading a tensor-parallel tensor back at any TP size (resharding).

A checkpoint saved at TP=a holds, for each split tensor, a files `model_tpXX.safetensors` with
consecutive slices of the full tensor along its split dimension; saved with pipeline stages, each
stage writes its own parameters (under the unsplit model's names) to `model_ppYY_tpXX.safetensors`,
and a tensor is read from whichever stage's file holds it. Loading at TP=c, a rank asks for
its own range of the full tensor; the reader takes the overlapping parts of the saved slices
(safetensors reads slices lazily, so no rank materializes the full tensor) and fills rows past the
saved padded vocabulary with zeros (the padding of a larger TP size).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def model_file(tp_rank: int, pp_rank: int | None = None, ep_rank: int = 0) -> str:
    """The shard file of a TP rank (of pipeline stage `pp_rank` when the checkpoint has stages); EP
    ranks above 0 write their experts to files of their own (`_epZZ`)."""
    stage = "" if pp_rank is None else f"pp{pp_rank:02d}_"
    experts = f"_ep{ep_rank:02d}" if ep_rank else ""
    return f"model_{stage}tp{tp_rank:02d}{experts}.safetensors"


def model_files(meta: dict) -> list[list[str]]:
    """File names of a checkpoint's model shards from its metadata: for each TP rank, one per stage
    (and per expert-parallel rank)."""
    stages, experts = meta.get("pipeline_parallel", 1), meta.get("expert_parallel", 1)
    return [[model_file(tp, None if stages == 1 else pp, ep) for ep in range(experts) for pp in range(stages)]
            for tp in range(meta["tensor_parallel"])]


def expert_key(name: str, expert: int) -> str:
    """Checkpoint key of expert `expert` (global index) of a stacked expert parameter `name`: experts are
    stored one tensor each, so a checkpoint loads at any expert-parallel size."""
    return f"{name}.{expert}"


class _StageFiles:
    """The files of one TP rank's shards over all pipeline stages, read as one: a key's tensor comes from
    the first file that has it (checkpoints of older versions hold the tied embedding in two)."""

    def __init__(self, paths: list[Path]):
        self.handles = [safe_open(str(p), framework="pt") for p in paths]
        self.where = {}
        for handle in self.handles:
            for key in handle.keys():
                self.where.setdefault(key, handle)

    def keys(self):
        return self.where.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)

    def get_slice(self, key: str):
        return self.where[key].get_slice(key)


class ShardedReader:
    """Open shard files of one checkpoint and read global slices of its tensors."""

    def __init__(self, paths: list):
        """`paths`: the shard files in TP rank order (one file for a consolidated checkpoint); each entry
        may be a list of files, the stages of a pipeline-parallel checkpoint."""
        self.tensor_parallel = len(paths)
        self.files = [_StageFiles(p if isinstance(p, list | tuple) else [p]) for p in paths]

    def keys(self) -> set[str]:
        return set(self.files[0].keys())

    def shape(self, key: str) -> list[int]:
        """The shape of `key` in the first shard file (the whole tensor's for replicated ones)."""
        return list(self.files[0].get_slice(key).get_shape())

    def read(self, key: str, split_dim: int | None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows (or columns) [start, end) along `split_dim` of the full tensor `key`; the whole tensor
        for replicated ones (split_dim None)."""
        if split_dim is None:
            return self.files[0].get_tensor(key)
        shard_shape = self.files[0].get_slice(key).get_shape()
        shard = shard_shape[split_dim]
        saved_total = shard * self.tensor_parallel
        end = saved_total if end is None else end
        pieces = []
        for r, f in enumerate(self.files):
            lo, hi = max(start, r * shard), min(end, (r + 1) * shard)
            if lo >= hi:
                continue
            index = [slice(None)] * len(shard_shape)
            index[split_dim] = slice(lo - r * shard, hi - r * shard)
            pieces.append(f.get_slice(key)[tuple(index)])
        if end > saved_total:  # padding that the saved (smaller) padded vocabulary did not have
            pad_shape = list(shard_shape)
            pad_shape[split_dim] = end - max(start, saved_total)
            pieces.append(torch.zeros(pad_shape, dtype=pieces[0].dtype if pieces else torch.float32))
        return torch.cat(pieces, dim=split_dim)


class TensorReader:
    """`ShardedReader`'s reading interface over whole tensors in memory ({key: tensor}, e.g. a peft adapter's
    converted to shardlm's names): rows past a tensor's end (the padded vocabulary) read as zeros."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self) -> set[str]:
        return set(self.tensors)

    def shape(self, key: str) -> list[int]:
        return list(self.tensors[key].shape)

    def read(self, key: str, split_dim: int | None, start: int = 0, end: int | None = None) -> torch.Tensor:
        value = self.tensors[key]
        if split_dim is None:
            return value
        size = value.shape[split_dim]
        end = size if end is None else end
        part = value.narrow(split_dim, min(start, size), max(0, min(end, size) - min(start, size)))
        if end > size:
            pad = list(value.shape)
            pad[split_dim] = end - max(start, size)
            part = torch.cat([part, torch.zeros(pad, dtype=value.dtype)], dim=split_dim)
        return part
