"""Reading a tensor-parallel tensor back at any TP size (resharding).

A checkpoint saved at TP=a holds, for each split tensor, a files `model_tpXX.safetensors` with
consecutive slices of the full tensor along its split dimension. Loading at TP=c, a rank asks for
its own range of the full tensor; the reader takes the overlapping parts of the saved slices
(safetensors reads slices lazily, so no rank materializes the full tensor) and fills rows past the
saved padded vocabulary with zeros (the padding of a larger TP size).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def model_file(tp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}.safetensors"


class ShardedReader:
    """Open shard files of one checkpoint and read global slices of its tensors."""

    def __init__(self, paths: list[Path]):
        """`paths`: the shard files in TP rank order (one file for a consolidated checkpoint)."""
        self.tensor_parallel = len(paths)
        self.files = [safe_open(str(p), framework="pt") for p in paths]

    def keys(self) -> set[str]:
        return set(self.files[0].keys())

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
