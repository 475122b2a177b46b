"""Per-document causal attention for packed rows: a token attends only to earlier tokens of its own document.

`q` is (B, H, T, D); `k` and `v` are (B, H_kv, T, D) with `H % H_kv == 0` (grouped-query attention when
`H_kv < H`). `cu_seqlens` gives each row's segment offsets: a list of B int32 tensors `[0, ..., T]` (as
`PackedRow.cu_seqlens`), or one tensor shared by every row. The result is (B, H, T, D).

`document_causal_attention` runs PyTorch's `scaled_dot_product_attention(is_causal=True)` on each
document's slice, so no (T, T) mask is built and the work is the sum of the squared document lengths
instead of T squared. `reference_document_attention` is the plain definition (one dense block-causal
boolean mask) that it is tested against. Neither knows about process groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _row_offsets(cu_seqlens: torch.Tensor | Sequence[torch.Tensor], batch: int, length: int) -> list[list[int]]:
    rows = [cu_seqlens] * batch if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(rows) != batch:
        raise ValueError(f"cu_seqlens has {len(rows)} rows for a batch of {batch}")
    offsets = []
    for row in rows:
        row = [int(x) for x in row]
        if row[0] != 0 or row[-1] != length or any(b <= a for a, b in zip(row, row[1:])):
            raise ValueError(f"cu_seqlens {row} must rise strictly from 0 to the sequence length {length}")
        offsets.append(row)
    return offsets


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    if x.shape[1] == heads:
        return x
    if heads % x.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {x.shape[1]} key/value heads")
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def block_causal_mask(cu_seqlens: torch.Tensor | Sequence[torch.Tensor], batch: int, length: int,
                      device: torch.device | None = None) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query t may attend to key s: same document and s <= t."""
    masks = []
    for row in _row_offsets(cu_seqlens, batch, length):
        doc = torch.repeat_interleave(torch.arange(len(row) - 1), torch.tensor(row[1:]) - torch.tensor(row[:-1]))
        masks.append(doc[:, None] == doc[None, :])
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (torch.stack(masks) & causal).unsqueeze(1).to(device)


def reference_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cu_seqlens: torch.Tensor | Sequence[torch.Tensor],
                                 scale: float | None = None) -> torch.Tensor:
    """Dense SDPA with the block-causal mask: (B, H, T, D). Memory grows with T squared; for tests."""
    batch, heads, length, _ = q.shape
    mask = block_causal_mask(cu_seqlens, batch, length, q.device)
    return F.scaled_dot_product_attention(q, _expand_kv(k, heads), _expand_kv(v, heads), attn_mask=mask, scale=scale)


def document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens: torch.Tensor | Sequence[torch.Tensor],
                              scale: float | None = None) -> torch.Tensor:
    """Causal SDPA on each document's slice of each row, concatenated back: (B, H, T, D).

    Rows that share their offsets (e.g. one tensor for the whole batch) are computed together.
    """
    batch, heads, length, _ = q.shape
    offsets = _row_offsets(cu_seqlens, batch, length)
    gqa = k.shape[1] != heads
    if gqa and heads % k.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {k.shape[1]} key/value heads")
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, row in enumerate(offsets):
        groups.setdefault(tuple(row), []).append(b)
    outputs: list[torch.Tensor | None] = [None] * batch
    for row, members in groups.items():
        if len(members) == batch:
            qs, ks, vs = q, k, v
        else:
            index = torch.tensor(members, device=q.device)
            qs, ks, vs = q.index_select(0, index), k.index_select(0, index), v.index_select(0, index)
        pieces = [F.scaled_dot_product_attention(qs[:, :, a:e], ks[:, :, a:e], vs[:, :, a:e], is_causal=True,
                                                 scale=scale, enable_gqa=gqa)
                  for a, e in zip(row, row[1:])]
        out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
        if len(members) == batch:
            return out
        for j, b in enumerate(members):
            outputs[b] = out[j:j + 1]
    return torch.cat(outputs, dim=0)
