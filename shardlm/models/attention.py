"""Causal attention, the one function GPT's and Llama's attention layers (and the next kind) call.

`causal_attention(q, k, v, cp, ...)` is softmax(q k^T / sqrt(d)) v under a causal mask, with
grouped-query attention when k and v have fewer heads than q. Without context parallelism it is
PyTorch's `scaled_dot_product_attention`; under context parallelism (`cp.size` > 1) the sequence is
this rank's zigzag part and the keys and values of the other CP ranks come around the ring
(`shardlm.parallel.ring_attention`). With `documents` (packed rows, `shardlm.models.documents`) a token
attends only to earlier tokens of its own document, with or without CP. gpt-oss's attention sinks and
sliding windows run in tiles (`shardlm.parallel.tiled_attention`) without CP and in the ring with it.
`cached_attention` is the KV-cached decoding step. A model picks its projections, positions and head layout;
the attention math and its CP, document, window and sink branches live here once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.models.documents import Documents, document_causal_attention
from shardlm.parallel import invariant
from shardlm.parallel.ring_attention import context_parallel_attention
from shardlm.parallel.tiled_attention import tiled_attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp, *, exchange: str = "ring",
                     dropout_p: float = 0.0, rng=None, scale: float | None = None,
                     documents: Documents | None = None, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v: q (B, H, T, d), k and v (B, Hkv, T, d) with H a multiple of Hkv
    -> (B, H, T, d).

    `cp`: the context-parallel group (`Communicator`); with more than one rank, T is this rank's zigzag
    part and `exchange` ("ring" or "allgather", the run's `parallel.cp_comm`) says how K/V move.
    `dropout_p`: attention dropout (0 in evaluation; refused under CP), drawn under `rng.fork()` (the
    model-parallel RNG tracker: heads differ per TP rank, so must their dropout masks).
    `scale`: the softmax scale in place of 1 / sqrt(d) (MLA: v may have a smaller head size than q and k,
    (B, H, T, d_v) then; the values are zero-padded to the keys' size, which the flash kernels and the ring
    need, and the output cut back).
    `documents`: the micro-batch's packed documents; each token then attends within its own document only.
    `window` > 0: each query sees the keys less than `window` positions behind it (a sliding-window layer).
    `sinks` (H,): each head's sink logit, one more softmax entry without a value (gpt-oss); neither takes
    attention dropout."""
    if invariant.enabled() and not window and sinks is None and not dropout_p:
        offsets = None if documents is None else documents.offsets
        if cp.size > 1:  # the whole row's keys gathered: the tiles of one process, bit for bit
            return invariant.context_parallel_attention(q, k, v, cp, scale=scale, offsets=offsets)
        return invariant.attention(q, k, v, scale=scale, offsets=offsets)
    segments = None if documents is None else documents.segments
    d_v = v.shape[-1]
    if d_v != k.shape[-1]:  # MLA: values padded with zeros to the key size; P [v | 0] = [P v | 0], so the output's
        v = F.pad(v, (0, k.shape[-1] - d_v))  # first d_v channels are exact, and the flash kernels need equal sizes
    out = _attention(q, k, v, cp, exchange, dropout_p, rng, scale, documents, segments, window, sinks)
    return out if out.shape[-1] == d_v else out[..., :d_v]


def _attention(q, k, v, cp, exchange, dropout_p, rng, scale, documents, segments, window, sinks) -> torch.Tensor:
    """`causal_attention` once q, k and v have one head size."""
    if cp.size > 1:
        return context_parallel_attention(q, k, v, cp, scale=scale, exchange=exchange, dropout_p=dropout_p,
                                          segments=segments, window=window, sinks=sinks)
    if window or sinks is not None:
        if dropout_p > 0:
            raise ValueError("attention dropout is not supported with sliding windows or attention sinks")
        return tiled_attention(q, k, v, scale=scale, window=window, sinks=sinks, segments=segments)
    if documents is not None:
        if dropout_p > 0:
            with rng.fork():
                return document_causal_attention(q, k, v, documents.offsets, scale=scale, dropout_p=dropout_p)
        return document_causal_attention(q, k, v, documents.offsets, scale=scale)
    gqa = k.shape[1] != q.shape[1]
    if dropout_p > 0:
        with rng.fork():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa,
                                                  scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)

def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, *, window: int = 0,
                     sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """One decoding step over a KV cache: q (B, H, T, d) the positions past .. past + T - 1, k and v
    (B, Hkv, past + T, d) -> (B, H, T, d); causal, within `window` when set, with `sinks` (H,) when given."""
    T, total = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if not window and sinks is None:
        if invariant.enabled():
            return invariant.attention(q, k, v, scale=scale, past=past)
        mask = None if T == 1 else torch.ones(T, total, dtype=torch.bool, device=q.device).tril(past)  # one query
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)  # sees all
    query_pos = torch.arange(past, past + T, device=q.device)[:, None]
    distance = query_pos - torch.arange(total, device=q.device)[None, :]
    visible = (distance >= 0) & ((distance < window) if window else True)
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1) * scale).masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)

