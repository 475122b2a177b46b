"""The largest attention logit of each head, QK-clip's statistic (`shardlm.training.qk_clip`).

An attention layer whose `max_logits` is a tensor (set by `shardlm.training.qk_clip.track_max_logits`) raises it,
in training forwards, to the largest q . k x scale each of its heads computed in the micro-batch: over the batch,
the queries and the keys each query sees (earlier or equal positions, its own packed document, its sliding
window). The logits are computed again here, in fp32, one head at a time, because the fused attention kernels
never show them. Under context parallelism the keys of every CP rank are all-gathered for it (the ring's blocks
all count), and a query's place in the whole row is its zigzag position. Sparse attention (DSA) counts the keys
each query chose only, the logits those of its absorbed product (`max_chosen_logits`), by chunks of queries.
"""

from __future__ import annotations

import torch

from shardlm.data.zigzag import zigzag_positions
from shardlm.parallel.graph_break import graph_break


@torch.no_grad()
@graph_break
def max_attention_logits(q: torch.Tensor, k: torch.Tensor, cp, scale: float | None = None, documents=None,
                         window: int = 0) -> torch.Tensor:
    """(H,) fp32: each head's largest visible logit. q (B, H, T, d), k (B, Hkv, T, d) with H a multiple of Hkv (or
    this rank's zigzag parts of T under context parallelism, `cp` the CP `Communicator`); `scale`: the softmax
    scale (1 / sqrt(d) by default); `documents`: packed rows' `Documents`; `window` > 0: a sliding window."""
    B, H, T, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    queries = torch.arange(T, device=q.device)
    keys, key_positions = k, queries
    if cp.size > 1:
        length = T * cp.size
        keys = torch.cat(cp.all_gather(k.contiguous()), dim=2)  # (B, Hkv, T x C, d), rank by rank
        key_positions = torch.cat([zigzag_positions(length, cp.size, r, q.device) for r in range(cp.size)])
        queries = zigzag_positions(length, cp.size, cp.rank, q.device)
    distance = queries[:, None] - key_positions[None, :]
    visible = (distance >= 0) & ((distance < window) if window else True)
    visible = visible.expand(B, *visible.shape)  # (B, T, S)
    if documents is not None:
        segments = documents.segments
        visible = visible & (segments[:, queries, None] == segments[:, None, key_positions])
    group = H // keys.shape[1]
    out = torch.empty(H, device=q.device)
    for h in range(H):
        scores = (q[:, h].float() @ keys[:, h // group].float().transpose(-1, -2)) * scale  # (B, T, S)
        out[h] = scores.masked_fill(~visible, float("-inf")).amax()
    return out


def record_max_logits(module, q: torch.Tensor, k: torch.Tensor, scale: float | None = None, documents=None,
                      window: int = 0) -> None:
    """Raise `module.max_logits` (this rank's heads) to this micro-batch's, when it tracks them and trains.

    The test runs inside `torch.compile`'s graph (a guard on the attribute), so a layer that does not track compiles
    into one graph; only the update itself is kept out of the graph (`_raise_max_logits`)."""
    if getattr(module, "max_logits", None) is not None and module.training:
        _raise_max_logits(module, q, k, scale, documents, window)


@graph_break
def _raise_max_logits(module, q: torch.Tensor, k: torch.Tensor, scale: float | None, documents, window: int) -> None:
    """`record_max_logits`'s update, outside `torch.compile`'s graphs: an in-place update of a module's tensor."""
    logits = max_attention_logits(q, k, module.ctx.cp, scale, documents, window)
    torch.maximum(module.max_logits, logits, out=module.max_logits)


@torch.no_grad()
@graph_break
def max_chosen_logits(q: torch.Tensor, weight: torch.Tensor, nope: int, keys: torch.Tensor, indices: torch.Tensor,
                      valid: torch.Tensor, scale: float) -> torch.Tensor:
    """(H,) fp32: each head's largest logit over the keys sparse attention chose. q (B, H, T, nope + rope) rotated,
    weight (H, nope + v, r) kv_b's per head, keys (B, S, r + rope) the row's latents and shared rotated keys, indices
    and valid (B, T, k) each query's chosen keys (`shardlm.models.sparse_attention`): the logit of a chosen valid
    key is [q_nope W_UK | q_rope] . [c | k_rope] x scale, as the sparse core computes it."""
    from shardlm.models.sparse_attention import absorb_query, gather_keys, query_step

    B, H, T, _ = q.shape
    out = torch.full((H,), float("-inf"), device=q.device)
    step = query_step(B, indices.shape[-1], H, keys.shape[-1])
    for start in range(0, T, step):
        part = slice(start, start + step)
        query = absorb_query(q[:, :, part].float(), weight.float(), nope)  # (B, H, Q, r + rope)
        chosen = gather_keys(keys.float(), indices[:, part].long())  # (B, Q, k, r + rope)
        scores = torch.einsum("bhqn,bqkn->bhqk", query, chosen) * scale
        scores = scores.masked_fill(~valid[:, part].unsqueeze(1), float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out


def record_chosen_max_logits(module, q: torch.Tensor, weight: torch.Tensor, keys: torch.Tensor,
                             indices: torch.Tensor, valid: torch.Tensor) -> None:
    """`record_max_logits` for a sparse-attention layer (`max_chosen_logits`; the layer's `nope` and `scale`)."""
    if getattr(module, "max_logits", None) is not None and module.training:
        logits = max_chosen_logits(q, weight, module.nope, keys, indices, valid, module.scale)
        torch.maximum(module.max_logits, logits, out=module.max_logits)
