"""Weight initialization that does not depend on the tensor-parallel size.

A weight is defined by its *full* (TP=1) shape, a seed and a std. Its values are drawn in fixed
blocks of rows, each block from its own generator seeded by (seed, block index), so any slice can be
produced without the rest: a rank materializes only the row blocks it needs (column-parallel,
vocabulary-parallel) or one block at a time (row-parallel, which keeps a column slice of every
block). Concatenating the shards of a TP=p layer therefore gives exactly the TP=1 weight, and no
rank ever holds more than its shard plus one block, even for multi-billion-parameter models.
"""

from __future__ import annotations

import zlib

import torch

BLOCK_ELEMENTS = 1 << 20  # values drawn per generator; depends on nothing but the full shape


def param_seed(base_seed: int, name: str) -> int:
    """A stable per-parameter seed from the run seed and the parameter's name."""
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def _rows_per_block(num_cols: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, num_cols))


def normal_shard(
    full_shape: tuple[int, int],
    std: float,
    seed: int,
    shard_dim: int = 0,
    start: int = 0,
    end: int | None = None,
    valid_rows: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Rows or columns `[start, end)` of a normal(0, std) matrix of `full_shape` (rows, cols).

    shard_dim=0 slices rows (column-parallel and embedding weights stored as (out, in)),
    shard_dim=1 slices columns (row-parallel weights). Rows at index >= `valid_rows` are zero
    (vocabulary padding). Returns a tensor of the shard's shape on `device`.
    """
    rows, cols = full_shape
    end = full_shape[shard_dim] if end is None else end
    valid_rows = rows if valid_rows is None else valid_rows
    row_lo, row_hi = (start, end) if shard_dim == 0 else (0, rows)
    col_lo, col_hi = (0, cols) if shard_dim == 0 else (start, end)
    out = torch.zeros(row_hi - row_lo, col_hi - col_lo, dtype=torch.float32)
    block = _rows_per_block(cols)
    generator = torch.Generator()
    for first in range(row_lo - row_lo % block, min(row_hi, valid_rows), block):
        last = min(first + block, rows)
        generator.manual_seed((seed + 0x9E3779B97F4A7C15 * (first // block + 1)) % (2**63))
        values = torch.empty(last - first, cols).normal_(0.0, std, generator=generator)
        lo, hi = max(first, row_lo), min(last, row_hi, valid_rows)
        if lo < hi:
            out[lo - row_lo:hi - row_lo] = values[lo - first:hi - first, col_lo:col_hi]
    return out.to(dtype=dtype, device=device)
