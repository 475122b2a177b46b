"""Packed documents: rows that hold several documents, each attending only to itself.

A packed row of T tokens holds documents one after another (SFT conversations, `shardlm.sft.packing`, or
pretraining documents cut at end-of-document tokens, `data.document_mask`). Its position ids (B, T) restart
at 0 at every document, as TRL's padding-free collator and torchtitan write them, and they are all a
model needs: `Documents.from_positions` reads the layout from them once per micro-batch, and every
attention layer of every pipeline stage receives the same `Documents` (`DecoderLM.forward(...,
documents=)`, `StageModule`), so no stage can lose the boundaries.

Under context parallelism a rank holds the zigzag part of each row (`shardlm.data.zigzag`): `positions`
are its tokens' positions within their documents, while `segments` and `offsets` describe the whole row,
so the ring (`shardlm.parallel.ring_attention`) can mask every (query chunk, key chunk) block by document.

`document_causal_attention` is the attention without context parallelism: PyTorch's SDPA with
`is_causal=True` on each document's slice of each row, so no (T, T) mask is built and the work is the sum
of the squared document lengths instead of T squared. `reference_document_attention` is the plain
definition (one dense SDPA call with the block-causal boolean mask) it is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardlm.data.zigzag import local_positions, zigzag_split


@dataclass
class Documents:
    """The documents of a micro-batch of packed rows.

    positions: (B, T_local) int64, each of this rank's tokens' position within its document (the zigzag
        part under context parallelism; the whole row otherwise).
    segments: (B, T) int64, the document number of every token of the whole row (0, 1, ...).
    offsets: per row, the document start offsets in the whole row, `[0, ..., T]` (the `cu_seqlens` layout).
    """

    positions: torch.Tensor
    segments: torch.Tensor
    offsets: list[list[int]]

    @classmethod
    def from_positions(cls, position_ids: torch.Tensor, cp_size: int = 1, cp_rank: int = 0) -> Documents:
        """From the whole rows' position ids (B, T): a document starts wherever the position is 0; the others
        must count up by one. `cp_size` / `cp_rank`: keep that context-parallel rank's zigzag positions."""
        if position_ids.dim() != 2 or position_ids.shape[1] == 0:
            raise ValueError(f"position ids must be (B, T); got {tuple(position_ids.shape)}")
        starts = position_ids == 0
        follows = position_ids[:, 1:] == position_ids[:, :-1] + 1
        if not bool(starts[:, 0].all()) or not bool((starts[:, 1:] | follows).all()):
            raise ValueError("position ids must start at 0 and count up by one within each document")
        segments = starts.long().cumsum(1) - 1
        length = position_ids.shape[1]
        offsets = [starts_row.nonzero().flatten().tolist() + [length] for starts_row in starts.cpu()]
        positions = position_ids if cp_size == 1 else zigzag_split(position_ids, cp_size, cp_rank)
        return cls(positions, segments, offsets)

    @classmethod
    def from_offsets(cls, offsets: Sequence[Sequence[int]], length: int, device=None) -> Documents:
        """From each row's document offsets `[0, ..., T]` (e.g. `PackedRow.cu_seqlens`), no context parallelism."""
        positions = torch.zeros(len(offsets), length, dtype=torch.long)
        for b, row in enumerate(offsets):
            for start, end in zip(row, row[1:]):
                positions[b, start:end] = torch.arange(end - start)
        return cls.from_positions(positions.to(device))

    @property
    def length(self) -> int:
        """T, the whole row's length."""
        return self.segments.shape[1]

    def block_mask(self, query: slice, key: slice, causal: bool) -> torch.Tensor:
        """(B, 1, Lq, Lk) bool: query tokens `query` (of the whole row) may attend to key tokens `key`: same
        document, and, when `causal`, key position <= query position (the two slices then start together)."""
        same = self.segments[:, query, None] == self.segments[:, None, key]
        if causal:
            same = same & torch.ones(same.shape[1:], dtype=torch.bool, device=same.device).tril()
        return same.unsqueeze(1)


def token_positions(length: int, cp, past: int, documents: Documents | None, device=None) -> torch.Tensor:
    """The positions RoPE or position embeddings see for this rank's `length` tokens of each row: (B, length)
    within their documents when `documents` is given, else (length,) (`local_positions`: past ..., or the
    zigzag positions under context parallelism)."""
    if documents is not None:
        if documents.positions.shape[1] != length:
            raise ValueError(f"documents hold {documents.positions.shape[1]} positions per row for {length} tokens")
        return documents.positions
    return local_positions(length, cp, past, device)


def _check_offsets(offsets: Sequence[Sequence[int]], batch: int, length: int) -> list[list[int]]:
    rows = [[int(x) for x in row] for row in offsets]
    if len(rows) != batch:
        raise ValueError(f"{len(rows)} rows of document offsets for a batch of {batch}")
    for row in rows:
        if row[0] != 0 or row[-1] != length or any(b <= a for a, b in zip(row, row[1:])):
            raise ValueError(f"document offsets {row} must rise strictly from 0 to the sequence length {length}")
    return rows


def block_causal_mask(offsets: Sequence[Sequence[int]], length: int, device=None) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query t may attend to key s: same document and s <= t."""
    rows = _check_offsets(offsets, len(offsets), length)
    return Documents.from_offsets(rows, length, device).block_mask(slice(None), slice(None), causal=True)


def reference_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: Sequence[Sequence[int]],
                                  scale: float | None = None) -> torch.Tensor:
    """Dense SDPA with the block-causal mask: q (B, H, T, d), k and v (B, Hkv, T, d) -> (B, H, T, d). Memory
    grows with T squared; the definition the per-document kernels are tested and benchmarked against."""
    mask = block_causal_mask(offsets, q.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: Sequence[Sequence[int]],
                              scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal SDPA on each document's slice of each row, concatenated back: q (B, H, T, d), k and v
    (B, Hkv, T, d) with H a multiple of Hkv, v's head size may differ -> (B, H, T, d_v). Rows that share
    their offsets are computed together. With `dropout_p`, the caller picks the generator."""
    batch, heads, length, _ = q.shape
    rows = _check_offsets(offsets, batch, length)
    gqa = k.shape[1] != heads
    if gqa and heads % k.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {k.shape[1]} key/value heads")
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, row in enumerate(rows):
        groups.setdefault(tuple(row), []).append(b)
    outputs: list[torch.Tensor | None] = [None] * batch
    for row, members in groups.items():
        if len(members) == batch:
            qs, ks, vs = q, k, v
        else:
            index = torch.tensor(members, device=q.device)
            qs, ks, vs = q.index_select(0, index), k.index_select(0, index), v.index_select(0, index)
        lengths = [e - a for a, e in zip(row, row[1:])]  # split, not slices: its backward is one concatenation
        pieces = [F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, dropout_p=dropout_p,
                                                 enable_gqa=gqa)
                  for qd, kd, vd in zip(*(x.split(lengths, dim=2) for x in (qs, ks, vs)))]
        out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
        if len(members) == batch:
            return out
        for j, b in enumerate(members):
            outputs[b] = out[j:j + 1]
    return torch.cat(outputs, dim=0)
