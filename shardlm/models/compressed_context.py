"""DeepSeek-V4's attention (`shardlm.models.compressed_attention`) under context parallelism: what a rank gathers.

A CP rank holds two zigzag chunks of L = T / 2 consecutive positions (chunks r and 2C - 1 - r of a row of S = 2 C L).
Its queries need the keys of their windows and the compressed entries of the whole row.

- `halo_sources` (plain rows whose chunks hold whole compression windows, L a multiple of the layer's ratio m, and
  whose windows reach at most one chunk back, window - 1 <= L): each rank projects its own tokens
  (`CompressedAttention.key_inputs`) and computes the entries of its own windows; it all-gathers those entries
  (S / m of them a row, D channels, and the indexer's D_i) and the last `halo` tokens' projections of each chunk
  (halo = max(window - 1, m on CSA layers, whose first window of a chunk pools the previous window's first halves)).
  Per token and layer that is D / m + D_i / m channels plus the halos, instead of the whole row's projections.
  Its keys are pieces: each run of its chunks with the window - 1 positions before it (all its queries read).
- `gathered_keys` (packed documents, whose windows start at each document's first token, or chunks that do not hold
  whole windows): every position's projections (D + 2 (1 + o) D + 4 D_i channels) all-gathered.

Each all-gather's backward reduce-scatters its gradient to the rank that computed it.
"""

from __future__ import annotations

import torch

from shardlm.data.zigzag import zigzag_merge
from shardlm.parallel import gather_from_sequence_parallel


def gathered_keys(attn, inputs: list[torch.Tensor], cp) -> list[torch.Tensor]:
    """Every position's `key_inputs` (B, S, .) of the row, in row order: this rank's tokens (`key_inputs`' views of
    x (B, T, h)) projected and all-gathered over the CP group `cp`."""
    keys = attn.key_inputs(inputs)
    widths = [part.shape[-1] for part in keys]
    joined = gather_from_sequence_parallel(torch.cat(keys, dim=-1), cp)
    return list(zigzag_merge(list(joined.chunk(cp.size, dim=1))).split(widths, dim=-1))


def chunk_runs(context: int, rank: int) -> list[list[int]]:
    """CP rank `rank`'s zigzag chunks r and 2C - 1 - r as runs of consecutive chunks (one run when they meet)."""
    mine = [rank, 2 * context - 1 - rank]
    return [mine] if mine[1] == mine[0] + 1 else [[mine[0]], [mine[1]]]


def halo_size(window: int, ratio: int, overlap: bool) -> int:
    """Positions of the chunk before that a chunk's queries and windows read: window - 1, at least `ratio` on a CSA
    layer (`overlap`), whose first window of a chunk pools the window before it."""
    return max(window - 1, ratio if overlap else 0)


def holds_whole_windows(tokens: int, window: int, ratio: int, overlap: bool) -> bool:
    """Whether a CP rank of `tokens` a row takes `halo_sources`: its two chunks hold whole windows of `ratio` (0: no
    compressor) and their halos reach at most one chunk back."""
    chunk = tokens // 2
    return tokens % 2 == 0 and (not ratio or chunk % ratio == 0) and halo_size(window, ratio, overlap) <= chunk


def halo_sources(attn, inputs: list[torch.Tensor], cp) -> tuple | None:
    """`CompressedAttention.sources` for this rank's queries, from its tokens (`key_inputs`' views of x (B, T, h)):
    kv's projection as pieces [(first position, (B, n, D))], each run of its chunks with the window - 1 positions
    before it, the row's entries and the indexer's, gathered (the module docstring); None when its chunks do not hold
    whole windows."""
    T = inputs[0].shape[1]
    C, L = cp.size, T // 2
    compressor = attn.compressor
    ratio = compressor.ratio if compressor is not None else 0
    overlap = compressor is not None and compressor.overlap
    if not holds_whole_windows(T, attn.window, ratio, overlap):
        return None
    before, halo = attn.window - 1, halo_size(attn.window, ratio, overlap)  # before: what a chunk's first query sees
    keys = attn.key_inputs(inputs)
    widths = [part.shape[-1] for part in keys]
    local = torch.cat(keys, dim=-1)  # (B, T, P)
    tails = torch.cat((local[:, L - halo:L], local[:, T - halo:]), dim=1)  # each chunk's last `halo` positions
    tails = zigzag_merge(list(gather_from_sequence_parallel(tails, cp).chunk(C, dim=1)))  # (B, 2 C halo, P)
    mine = (cp.rank, 2 * C - 1 - cp.rank)

    def held(j: int) -> torch.Tensor:  # chunk j's projections: this rank's (B, L, P), else its gathered tail
        if j in mine:
            return local[:, :L] if j == mine[0] else local[:, L:]
        return tails[:, j * halo:(j + 1) * halo]

    def leading(j: int, n: int) -> list[torch.Tensor]:  # the n positions before chunk j, if any
        return [held(j - 1)[:, held(j - 1).shape[1] - n:]] if n else []

    kv = []
    for run in chunk_runs(C, cp.rank):
        n = min(before, run[0] * L)
        parts = leading(run[0], n) + [held(j) for j in run]
        kv.append((run[0] * L - n, torch.cat([part[..., :widths[0]] for part in parts], dim=1)))  # kv's D only
    if compressor is None:
        return kv, None, None
    pieces = []  # this rank's chunks' entries (and the indexer's), each from its own windows
    for j in mine:
        extra = ratio if compressor.overlap and j > 0 else 0  # the previous window's first halves
        span = torch.cat(leading(j, extra) + [held(j)], dim=1)
        _, entries, index_entries = attn.sources(list(span.split(widths, dim=-1)), j * L // ratio - extra // ratio)
        pieces.append([e[:, extra // ratio:] for e in (entries, index_entries) if e is not None])  # (its own)
    joined = torch.cat([torch.cat(parts, dim=1) for parts in zip(*pieces)], dim=-1)  # (B, 2 L / m, D (+ D_i))
    whole = zigzag_merge(list(gather_from_sequence_parallel(joined, cp).chunk(C, dim=1)))  # (B, S / m, D + D_i)
    entries = whole[..., :compressor.dim]
    index_entries = whole[..., compressor.dim:] if attn.indexer is not None else None
    return kv, entries, index_entries
