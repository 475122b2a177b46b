"""Batch-invariant numerics: a token's numbers do not depend on which other tokens share its batch, on where it sits
in a packed row, or on the KV cache. An RL run's rollout then computes, while sampling, the very log-probabilities
its training forward computes for the same tokens (bitwise in fp32), so the importance ratio of the rollout's
own log-probabilities is exactly 1 (`rl.batch_invariant`).

The CPU's GEMMs pick their algorithm by the matrix shape (a one-row product takes a GEMV path, small row counts
another blocking), so one row's result moves in its last bits with the number of rows around it, and PyTorch's
fused attention kernels tile queries and keys by the sequence length. Here, while the mode is on (`enabled()`, set
by `batch_invariant()` for a block, as `torch.use_deterministic_algorithms` sets its mode for a process):

- `linear`: every matrix product runs in blocks of exactly `ROWS` rows (the last one padded with zeros): one GEMM
  shape whatever the batch, so a row's result depends on that row alone;
- `attention`: causal softmax(q k^T) v over each document in tiles of `ROWS` keys aligned at the document's start,
  every reduction of a fixed length (the scores over the head size, each tile's max and sum over its `ROWS` keys,
  the weighted values), the tiles merged in order by log-sum-exp. A decoding step sees the same tiles as the
  training forward sees for that query (the keys past it masked there, absent here): the same numbers.

Elementwise functions are position-independent already. The cost: the products in blocks (one GEMM per 16 rows)
and the attention's elementwise scores, O(T^2 d) memory per document (chunked by query tiles): meant for checking
runs and small models. Models whose decoding takes another algorithm than their
training forward (MLA's absorbed cache, the recurrent form of linear attention) are not made invariant by this.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from shardlm.data.zigzag import zigzag_chunks

ROWS = 16
"""Rows of every block product, and keys of every attention tile."""

_state = {"on": False}


def enabled() -> bool:
    """Whether batch-invariant numerics are on (`batch_invariant`)."""
    return _state["on"]


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Batch-invariant numerics for the block (the previous mode afterwards)."""
    previous, _state["on"] = _state["on"], on
    try:
        yield
    finally:
        _state["on"] = previous


def set_batch_invariant(on: bool) -> None:
    """Turn batch-invariant numerics on or off for the process (an RL run's setting)."""
    _state["on"] = on


def matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x (N, k) @ w_t (k, n) in blocks of exactly ROWS rows: (N, n), each row independent of the others."""
    n = x.shape[0]
    pad = (-n) % ROWS
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    return torch.cat([x[i:i + ROWS] @ w_t for i in range(0, x.shape[0], ROWS)])[:n] if x.shape[0] else x @ w_t


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (..., k) x (n, k) -> (..., n), batch-invariant while the mode is on."""
    if not _state["on"]:
        return F.linear(x, weight, bias)
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """One document: q (B, H, Tq, d) at positions past .. past + Tq - 1, k and v (B, H, Tk, d) at 0 .. Tk - 1 ->
    (B, H, Tq, d_v), causal, in key tiles of ROWS (module docstring)."""
    B, H, Tq, d = q.shape
    Tk, d_v = k.shape[2], v.shape[-1]
    tiles = -(-Tk // ROWS)
    pad = tiles * ROWS - Tk
    k = F.pad(k, (0, 0, 0, pad)).view(B, H, tiles, ROWS, d)
    v_t = F.pad(v, (0, 0, 0, pad)).view(B, H, tiles, ROWS, d_v).transpose(-1, -2).contiguous()  # (.., d_v, ROWS)
    key_pos = torch.arange(tiles * ROWS, device=q.device).view(tiles, ROWS)
    out = q.new_zeros(B, H, Tq, d_v, dtype=torch.float32)
    for first in range(0, Tq, ROWS):  # query tiles bound the memory of the elementwise scores
        qs = q[:, :, first:first + ROWS].float()
        query_pos = torch.arange(past + first, past + first + qs.shape[2], device=q.device)
        hidden = key_pos[None] > query_pos[:, None, None]  # (Tq', tiles, ROWS): later keys and padding
        scores = (qs[:, :, :, None, None, :] * k[:, :, None].float()).sum(-1) * scale  # (B, H, Tq', tiles, ROWS)
        scores = scores.masked_fill(hidden, float("-inf"))
        m = torch.full(scores.shape[:3], float("-inf"), device=q.device)
        total = torch.zeros_like(m)
        acc = q.new_zeros(*scores.shape[:3], d_v, dtype=torch.float32)
        for t in range(tiles):
            tile = scores[..., t, :]
            tile_max = tile.amax(-1)
            if bool(torch.isinf(tile_max).all()):  # every query of the block is before this tile: nothing to add
                break
            new_max = torch.maximum(m, tile_max)  # finite: key 0 of tile 0 is visible to every query
            weights = torch.exp(tile - new_max[..., None])  # (B, H, Tq', ROWS); hidden keys give 0
            keep = torch.exp(m - new_max)  # 1 where the tile adds nothing new, 0 before the first tile
            acc = acc * keep[..., None] + (weights[..., None, :] * v_t[:, :, None, t].float()).sum(-1)
            total = total * keep + weights.sum(-1)
            m = new_max
        out[:, :, first:first + ROWS] = acc / total[..., None]
    return out.to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              offsets=None, past: int = 0) -> torch.Tensor:
    """Batch-invariant causal attention: q (B, H, Tq, d), k and v (B, Hkv, Tk, d) with H a multiple of Hkv ->
    (B, H, Tq, d_v). `offsets` (packed rows: each row's document starts and its length, as `Documents.offsets`)
    restricts each query to its document; `past`: q holds positions past .. past + Tq - 1 of one document (a
    decoding step over a KV cache)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if offsets is None:
        return _document(q, k, v, past, scale)
    rows = []
    for b, row in enumerate(offsets):
        pieces = [_document(q[b:b + 1, :, a:e], k[b:b + 1, :, a:e], v[b:b + 1, :, a:e], 0, scale)
                  for a, e in zip(row, row[1:])]
        rows.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    return torch.cat(rows)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp, *, scale: float | None = None,
                               offsets=None) -> torch.Tensor:
    """`attention` under context parallelism: q (B, H, T / C, d), k and v (B, Hkv, T / C, d) this CP rank's zigzag
    part (chunks r and 2C-1-r of 2C) -> (B, H, T / C, d_v). Every rank's keys and values are all-gathered in the
    row's order (the backward reduce-scatters their gradients), and each of the rank's chunks of queries attends,
    document by document (`offsets`: the whole rows'), to the keys from its document's start, in the tiles
    `attention` makes of the whole row: a token's numbers are the same, bit for bit."""
    from shardlm.parallel.mappings import gather_zigzag_rows

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, _, local, _ = q.shape
    length, half = local * cp.size, local // 2
    k, v = (gather_zigzag_rows(x.transpose(1, 2), cp).transpose(1, 2) for x in (k, v))  # (B, Hkv, T, d), row order
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    rows = [[0, length]] * B if offsets is None else offsets
    out = []
    for b in range(B if offsets is not None else 1):
        batch = slice(b, b + 1) if offsets is not None else slice(None)
        pieces = []
        for slot, chunk in enumerate(zigzag_chunks(cp.size, cp.rank)):
            first, last = chunk * half, (chunk + 1) * half  # the chunk's positions in the row
            for start, end in zip(rows[b], rows[b][1:]):  # its documents' queries, keys from the document's start
                lo, hi = max(start, first), min(end, last)
                if lo < hi:
                    queries = q[batch, :, slot * half + lo - first:slot * half + hi - first]
                    pieces.append(_document(queries, k[batch, :, start:hi], v[batch, :, start:hi], lo - start,
                                            scale))
        out.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    return torch.cat(out) if len(out) > 1 else out[0]
