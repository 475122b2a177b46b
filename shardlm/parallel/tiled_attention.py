"""Causal attention in tiles on one rank, for what PyTorch's SDPA cannot do: attention sinks and sliding windows.

gpt-oss adds a learned sink logit per head to every softmax row and lets alternate layers see only the last
`window` tokens. SDPA returns no log-sum-exp to merge a sink with, and masks a window by computing every
(T, T) score anyway. Here the rows are cut into tiles of `tile` tokens; a query tile runs only against the
key tiles its window reaches (the others are skipped, not masked), each block through the ring's block
function (`shardlm.parallel.ring_attention.attention_block`: CPU flash kernel, an additive mask only where a
block straddles the window's edge or a document boundary), and the partial results merge by log-sum-exp,
the sink last. The backward reruns the same blocks from the saved output and log-sum-exp. With packed
documents (`segments`) a query sees its own document only, inside its window. Under context parallelism the
ring does the same over the CP ranks (`context_parallel_attention(..., window=, sinks=)`).
"""

from __future__ import annotations

import torch

from shardlm.parallel.graph_break import graph_break
from shardlm.parallel.ring_attention import (
    BlockCounts,
    attention_block,
    block_backward,
    merge_partial,
    merge_sinks,
    sink_gradient,
    tiles,
    window_tile,
)


def tile_blocks(length: int, tile: int, window: int, segments: torch.Tensor | None, device,
                counts: BlockCounts | None = None, pass_name: str = "forward"):
    """Yield (query slice, key slice, causal, mask or None) for every tile of the causal triangle of `length`
    tokens with a visible pair (`ring_attention.tiles`, tiles of `tile` tokens, the last one shorter);
    `counts` counts the tiles computed and skipped."""
    yielded = 0
    for block in tiles(range(length), range(length), True, window, segments, tile, device):
        yielded += 1
        yield block
    if counts is not None:
        side = -(-length // tile)
        counts.computed[pass_name] += yielded
        counts.skipped[pass_name] += side * (side + 1) // 2 - yielded


class _TiledAttention(torch.autograd.Function):
    """`setup` = (scale, window, tile, segments, counts); `sinks` (H,) or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, setup):
        scale, window, tile, segments, counts = setup
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        for qs, ks, causal, mask in tile_blocks(q.shape[2], tile, window, segments, q.device, counts, "forward"):
            block = attention_block(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal, scale, "auto", mask)
            out[:, :, qs], lse[:, :, qs] = merge_partial(out[:, :, qs], lse[:, :, qs], *block)
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
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for qs, ks, causal, mask in tile_blocks(q.shape[2], tile, window, segments, q.device, counts, "backward"):
            dq_b, dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                              out[:, :, qs], lse[:, :, qs], causal, scale, "auto", mask)
            dq[:, :, qs] += dq_b
            dk[:, :, ks] += dk_b
            dv[:, :, ks] += dv_b
        dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


@graph_break
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
