"""Causal attention in tiles on one rank, for what PyTorch's SDPA cannot do: attention sinks and sliding windows.

gpt-oss adds a learned sink logit per head to every softmax row and lets alternate layers see only the last
`window` tokens. SDPA returns no log-sum-exp to merge a sink with, and masks a window by computing every
(T, T) score anyway. Here the rows are cut into tiles of `tile` tokens; a query tile runs only against the
key tiles its window reaches (the others are skipped, not masked), each tile through the ring's block
function (`shardlm.parallel.ring_attention.tiled_block` over `attention_block`: CPU flash kernel, an additive
mask only where a tile straddles the window's edge or a document boundary), and the partial results merge by
log-sum-exp, the sink last. The backward reruns the same blocks from the saved output and log-sum-exp. With packed
documents (`segments`) a query sees its own document only, inside its window. Under context parallelism the
ring does the same over the CP ranks (`context_parallel_attention(..., window=, sinks=)`), running each of its
blocks that the window cuts through the same tiles.
"""

from __future__ import annotations

import torch

from shardlm.parallel.ring_attention import (
    BlockCounts,
    merge_sinks,
    sink_gradient,
    tiled_block,
    tiled_block_backward,
    window_tile,
)


class _TiledAttention(torch.autograd.Function):
    """`setup` = (scale, window, tile, segments, counts); `sinks` (H,) or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, setup):
        scale, window, tile, segments, counts = setup
        rows = range(q.shape[2])
        out, lse = tiled_block(q, k, v, (rows, rows, True, tile, window, segments), scale, "auto", counts)
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        scale, window, tile, segments, counts = ctx.setup
        rows = range(q.shape[2])
        dq, dk, dv = tiled_block_backward(dout.contiguous(), q, k, v, out, lse,
                                          (rows, rows, True, tile, window, segments), scale, "auto", counts)
        dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


@torch.compiler.disable
def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    window: int = 0, sinks: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                    tile: int = 0, counts: BlockCounts | None = None) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v with a sliding `window` (0: none) and per-head `sinks` (H,) or None:
    q (B, H, T, d), k and v (B, Hkv, T, d) with H a multiple of Hkv -> (B, H, T, d). `segments` (B, T): the
    document number of every token of packed rows. `tile`: block size (0: the window rounded up to a multiple
    of 64, or T without a window). `counts` receives the blocks computed and skipped."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need (B, H, T, d) queries "
                         "and (B, Hkv, T, d) keys and values with H a multiple of Hkv")
    length = q.shape[2]
    tile = tile or window_tile(window, length)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _TiledAttention.apply(q, k, v, sinks, (scale, window, tile, segments, counts))
