"""Ring attention: causal attention over a sequence split over the CP ranks (context parallelism).

Each rank holds two chunks of every sequence (the zigzag split, `shardlm.data.zigzag`) and attends
with its queries to the keys and values of every rank. The K/V of the C ranks travel around the CP ring
(rank r sends to r+1 and receives from r-1, point to point), so at step s rank r holds those of rank
r-s; the next block's transfer is posted before the current one is computed, so they overlap where the
backend allows. A (query chunk i, key chunk j) block is *causal* when i = j, *full* when j < i and
*empty* when j > i; empty blocks are skipped. Under the zigzag split each rank computes 2C+1 blocks of
L x L (3 at its own K/V, 2 at every other's) and skips 2C-1. Partial outputs merge with the log-sum-exp
rule. The backward pass sends K/V around the ring again and recomputes each block from the saved output
and log-sum-exp; dK/dV accumulators travel with the blocks and reach their owner after C-1 hops. Per
call and rank: forward C-1 sends of (K, V), backward C-1 of (K, V) and C-1 of (dK, dV) in fp32.
Grouped-query attention sends only the KV heads and expands them locally. `exchange="allgather"`
all-gathers K/V instead (and reduce-scatters dK/dV): the same blocks, no overlap. Attention dropout is
not supported under CP.

With packed documents (`segments`, the document number of every token of the whole rows, as
`shardlm.models.documents.Documents` holds them) each block is also masked by document, and with a sliding
`window` (a query sees the keys less than `window` positions behind it) by distance: a block that no mask
cuts runs as above, a block with no visible pair is skipped (counted, so the window's saving is measured),
a block the window cuts runs in tiles of about the window's size (`tiles`), only those the window reaches,
and the others run with the block's mask (a query row with no key in the block contributes nothing to the
merge). Attention sinks (gpt-oss: a learned logit per head that joins every softmax row as one more key
without a value) are merged once per row after the last block, as one more partial attention with output 0
and log-sum-exp equal to the sink; the backward gives the sink -sum exp(sink - lse) (dout . out).

Blocks (`attention_block`) use PyTorch's CPU flash-attention kernel, which returns the log-sum-exp and
takes it back in its backward op (with an additive mask where a block needs one), on CPU tensors, and
exact fp32 math (`kernel="math"`) elsewhere.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardlm.data.zigzag import zigzag_chunks
from shardlm.errors import UserError
from shardlm.parallel.comm import Communicator
from shardlm.parallel.graph_break import graph_break

EMPTY, CAUSAL, FULL = "empty", "causal", "full"


def block_kind(query_chunk: int, key_chunk: int) -> str:
    """What the causal mask leaves of a (query chunk, key chunk) block of equal-length chunks."""
    return FULL if key_chunk < query_chunk else CAUSAL if key_chunk == query_chunk else EMPTY


@dataclass
class BlockCounts:
    """Attention blocks (L x L) computed and skipped, per pass ("forward", "backward"); `pairs[pass]`
    lists the computed (query chunk, key chunk) pairs in global chunk numbers."""

    computed: dict = field(default_factory=lambda: defaultdict(int))
    skipped: dict = field(default_factory=lambda: defaultdict(int))
    pairs: dict = field(default_factory=lambda: defaultdict(list))


# --------------------------------------------------------------------------------------------------
# one block: a query chunk against a key chunk, with its log-sum-exp

def _expand_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, kv_heads, L, d) -> (B, heads, L, d): query head i uses KV head i // (heads / kv_heads)."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _reduce_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, heads, L, d) gradient of expanded K or V -> (B, kv_heads, L, d), summed over each group."""
    B, heads, L, d = grad.shape
    return grad if heads == kv_heads else grad.view(B, kv_heads, heads // kv_heads, L, d).sum(2)


def _use_flash(q: torch.Tensor, kernel: str) -> bool:
    return kernel == "flash" or (kernel == "auto" and q.device.type == "cpu")


def attention_block(q, k, v, causal: bool, scale: float, kernel: str = "auto", mask: torch.Tensor | None = None):
    """One block of the ring: a query chunk against a key chunk, fully or causally masked.

    q: (B, H, L, d), k, v: (B, Hkv, L, d) (H a multiple of Hkv) -> (out (B, H, L, d) fp32, lse (B, H, L)
    fp32), the block's softmax(q k^T * scale) v and the log-sum-exp of each query row, which the ring
    merges over blocks. `kernel` as in `context_parallel_attention`. `mask` (B, 1, Lq, Lk) bool, where given,
    replaces the causal mask (a query row with no key gets out 0 and lse -inf). Talks to no group."""
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    if _use_flash(q, kernel):
        if mask is None:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out.float(), lse.float()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale)
        seen = mask.any(-1)  # (B, 1, Lq): the kernel gives a row without keys lse 0, the merge needs -inf
        return out.float(), torch.where(seen, lse.float(), float("-inf"))
    scores = _scores(q, k, causal, scale, mask)
    lse = scores.logsumexp(-1)
    return (scores - _finite(lse).unsqueeze(-1)).exp() @ v.float(), lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str, mask=None):
    """This block's share of (dq, dk, dv), given the *merged* output and log-sum-exp of q's rows."""
    kv_heads = k.shape[1]
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    if _use_flash(q, kernel):
        if q.dtype != torch.float32:  # in fp32: the CPU kernel's bf16 backward ran 2-3x its fp32 one (128-token blocks)
            dout, q, k, v, out = (t.float() for t in (dout, q, k, v, out))
        extra = {} if mask is None else {"attn_mask": _additive(mask, q.dtype)}
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal and mask is None, scale=scale, **extra)
    else:
        dout, out = dout.float(), out.float()
        probs = (_scores(q, k, causal, scale, mask) - lse.unsqueeze(-1)).exp()  # (B, H, L, L)
        dv = probs.transpose(-2, -1) @ dout
        dscores = probs * (dout @ v.float().transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
        dq, dk = dscores @ k.float() * scale, dscores.transpose(-2, -1) @ q.float() * scale
    return dq.float(), _reduce_heads(dk.float(), kv_heads), _reduce_heads(dv.float(), kv_heads)


def _scores(q, k, causal: bool, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if mask is not None:
        return scores.masked_fill(~mask, float("-inf"))
    if causal:
        L = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> 0 where True, -inf where False (what the CPU flash kernel takes)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a query row that saw no key yet) read as 0, so that exp(-inf - it) is 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def merge_partial(out, lse, block_out, block_lse):
    """Log-sum-exp merge of two partial attentions over disjoint keys; (None, None) is the empty one."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    base = _finite(new_lse)
    return (out * (lse - base).exp().unsqueeze(-1) + block_out * (block_lse - base).exp().unsqueeze(-1),
            new_lse)


def block_mask(queries: range, keys: range, causal: bool, window: int = 0, segments: torch.Tensor | None = None,
               device=None):
    """The mask of the block of query tokens `queries` against key tokens `keys` (positions in the whole rows):
    None when the causal or full mask alone is right, EMPTY when no query may see any key, else (B or 1, 1, Lq,
    Lk) bool. `causal`: the ranges are equal and the block is on the diagonal. `window` > 0: a query sees keys
    less than `window` positions behind it. `segments` (B, T): the document number of every token; a query sees
    its own document only."""
    if window and queries[0] - keys[-1] >= window:
        return EMPTY  # every key is at least a window behind every query
    cut = bool(window) and queries[-1] - keys[0] >= window
    same = None
    if segments is not None:
        q_seg, k_seg = segments[:, queries[0]:queries[-1] + 1], segments[:, keys[0]:keys[-1] + 1]
        # segments never decrease along a row: first and last token in one document means all of them
        if not (bool((q_seg[:, :1] == k_seg[:, -1:]).all()) and bool((q_seg[:, -1:] == k_seg[:, :1]).all())):
            same = (q_seg[:, :, None] == k_seg[:, None, :]).unsqueeze(1)
    if same is None and not cut:
        return None
    device = device if segments is None else segments.device
    distance = (torch.tensor(queries, device=device)[:, None] - torch.tensor(keys, device=device)[None, :])
    visible = distance >= 0 if causal else torch.ones(distance.shape, dtype=torch.bool, device=device)
    if cut:
        visible = visible & (distance < window)
    visible = visible.view(1, 1, *distance.shape)
    if same is not None:
        visible = visible & same
    return visible if bool(visible.any()) else EMPTY


def window_tile(window: int, length: int) -> int:
    """The tile a sliding window cuts blocks of `length` tokens into: the window rounded up to 64 tokens (at
    most `length`); `length` without a window."""
    return min(length, -(-window // 64) * 64) if window else length


def tiles(queries: range, keys: range, diagonal: bool, window: int, segments: torch.Tensor | None, tile: int,
          device=None):
    """The tiles with a visible pair of the block of query tokens `queries` against key tokens `keys`: (query
    slice, key slice, both relative to the block, causal, mask or None). `diagonal`: queries and keys are the
    same tokens (tiles above the diagonal are skipped). Tiles wholly outside the window are skipped."""
    for qs in range(0, len(queries), tile):
        for ks in range(0, len(keys), tile):
            if diagonal and ks > qs:
                break
            q_tile, k_tile = queries[qs:qs + tile], keys[ks:ks + tile]
            causal = diagonal and ks == qs
            mask = block_mask(q_tile, k_tile, causal, window, segments, device)
            if mask is not EMPTY:
                yield slice(qs, qs + len(q_tile)), slice(ks, ks + len(k_tile)), causal, mask


def _blocks(cp: Communicator, source: int, counts: BlockCounts | None, pass_name: str,
            segments: torch.Tensor | None = None, window: int = 0, length: int = 0, device=None):
    """The non-empty blocks of this rank's queries against `source`'s keys, each as its visible tiles
    (`tiles`; one tile, the whole block, without a window): (query half, key half, query slice, key slice,
    causal, mask or None); `length` is a chunk's L. `counts` counts whole blocks."""
    mine, theirs = zigzag_chunks(cp.size, cp.rank), zigzag_chunks(cp.size, source)
    tile = window_tile(window, length)
    for (qi, qc), (ki, kc) in itertools.product(enumerate(mine), enumerate(theirs)):
        kind = block_kind(qc, kc)
        found = False
        if kind != EMPTY:
            chunk = lambda c: range(c * length, (c + 1) * length)  # noqa: E731
            for qs, ks, causal, mask in tiles(chunk(qc), chunk(kc), kind == CAUSAL, window, segments, tile, device):
                found = True
                yield qi, ki, qs, ks, causal, mask
        if counts is not None:
            if found:
                counts.computed[pass_name] += 1
                counts.pairs[pass_name].append((qc, kc))
            else:
                counts.skipped[pass_name] += 1


# --------------------------------------------------------------------------------------------------
# moving K/V between CP ranks

def _shift(tensor: torch.Tensor, cp: Communicator, kind: str, tag: int):
    """Post the send of `tensor` to the next CP rank and the receive of the previous rank's tensor of the
    same shape (point to point on `cp.group`); return a function that waits for both and returns the
    received tensor. Recorded in `cp.stats` as `kind` on the CP group."""
    received = torch.empty_like(tensor)
    cp.stats.record(kind, cp.name, tensor)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, group=cp.group, tag=tag, group_peer=(cp.rank + 1) % cp.size),
        dist.P2POp(dist.irecv, received, group=cp.group, tag=tag, group_peer=(cp.rank - 1) % cp.size),
    ])

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return received

    return wait


def _kv_sources(kv: torch.Tensor, cp: Communicator, exchange: str):
    """Yield (source CP rank, its stacked K/V (2, B, Hkv, 2L, d)) for every rank, starting with this one's
    and going backwards around the ring. "ring": each step's transfer is posted before the current
    block is yielded, so the caller's compute overlaps it. "allgather": one all-gather up front."""
    sources = [(cp.rank - step) % cp.size for step in range(cp.size)]
    if exchange == "allgather":
        parts = cp.all_gather(kv)
        yield from ((source, parts[source]) for source in sources)
        return
    for step, source in enumerate(sources):
        pending = _shift(kv, cp, "ring_kv", tag=0) if step + 1 < cp.size else None
        yield source, kv
        if pending is not None:
            kv = pending()


class _ContextParallelAttention(torch.autograd.Function):
    """Causal attention of this CP rank's queries against every rank's keys and values (see the module
    docstring). `sinks` (H,) or None. `setup` = (cp, exchange, scale, kernel, counts, segments, window)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, setup):
        cp, exchange, scale, kernel, counts, segments, window = setup
        queries = q.chunk(2, dim=2)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        outs, lses = out.chunk(2, dim=2), lse.chunk(2, dim=2)  # views: the merges write into out and lse
        where = dict(segments=segments, window=window, length=q.shape[2] // 2, device=q.device)
        for source, kv in _kv_sources(torch.stack((k, v)), cp, exchange):
            keys, values = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for qi, ki, qs, ks, causal, mask in _blocks(cp, source, counts, "forward", **where):
                block = attention_block(queries[qi][:, :, qs], keys[ki][:, :, ks], values[ki][:, :, ks], causal,
                                        scale, kernel, mask)
                outs[qi][:, :, qs], lses[qi][:, :, qs] = merge_partial(outs[qi][:, :, qs], lses[qi][:, :, qs],
                                                                       *block)
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        # laid out as (B, 2L, H, d) in memory, as SDPA's flash kernel returns it: the caller's
        # transpose(1, 2).reshape(B, 2L, H d) for the output projection is then a view of the tensor saved
        # here, not a second copy kept for backward
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp, exchange, scale, kernel, counts, segments, window = ctx.setup
        where = dict(segments=segments, window=window, length=q.shape[2] // 2, device=q.device)
        halves = lambda t: t.chunk(2, dim=2)
        queries, douts, outs, lses = halves(q), halves(dout.contiguous()), halves(out), halves(lse)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = halves(dq)

        def share_of(source: int, kv: torch.Tensor) -> torch.Tensor:
            """This rank's part of dK/dV of `source`'s K/V, (2, B, Hkv, 2L, d) fp32; adds to dq."""
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            keys, values, dks, dvs = halves(kv[0]), halves(kv[1]), halves(dkv[0]), halves(dkv[1])
            for qi, ki, qs, ks, causal, mask in _blocks(cp, source, counts, "backward", **where):
                dq_b, dk_b, dv_b = block_backward(douts[qi][:, :, qs], queries[qi][:, :, qs], keys[ki][:, :, ks],
                                                  values[ki][:, :, ks], outs[qi][:, :, qs], lses[qi][:, :, qs],
                                                  causal, scale, kernel, mask)
                dqs[qi][:, :, qs] += dq_b
                dks[ki][:, :, ks] += dk_b
                dvs[ki][:, :, ks] += dv_b
            return dkv

        sources = _kv_sources(torch.stack((k, v)), cp, exchange)
        if exchange == "allgather":
            # every rank's share of every source's dK/dV, summed over the ranks and scattered to the owners
            shares = {source: share_of(source, kv) for source, kv in sources}
            dkv = cp.reduce_scatter(torch.stack([shares[s] for s in range(cp.size)]), dim=0)[0]
        else:
            # The dK/dV of source s's block start at rank s+1 and travel with its K/V, each rank adding its
            # share, until they reach s after C-1 hops; a rank's share of its own block stays home.
            dkv, pending = None, None
            for step, (source, kv) in enumerate(sources):
                share = share_of(source, kv)
                if step == 0:
                    dkv = share
                    continue
                if pending is not None:
                    share += pending()
                pending = _shift(share, cp, "ring_dkv", tag=1)
            if pending is not None:
                dkv += pending()
        dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Merge each head's sink logit into the rows' attention: out (B, H, T, d) fp32, lse (B, H, T), sinks (H,)
    -> (out x exp(lse - lse'), lse' = logaddexp(lse, sink)): the softmax over [scores, sink] with the sink's
    share dropped."""
    sink = sinks.detach().float().view(1, -1, 1).expand_as(lse)
    return merge_partial(out, lse, torch.zeros_like(out), sink)


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (H,) from the merged rows: the sink's probability exp(sink - lse) times its score's
    gradient 0 - dout . out, summed over the batch and the rows."""
    weight = (sinks.detach().float().view(1, -1, 1) - lse).exp()
    return -(weight * (dout.float() * out.float()).sum(-1)).sum((0, 2)).to(sinks.dtype)


@graph_break
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Communicator, *,
                               scale: float | None = None, exchange: str = "ring", kernel: str = "auto",
                               dropout_p: float = 0.0, counts: BlockCounts | None = None,
                               segments: torch.Tensor | None = None, window: int = 0,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v over a zigzag-split sequence, talking to the CP group `cp`.

    q: (B, H, 2L, d), k and v: (B, Hkv, 2L, d) with H a multiple of Hkv (grouped-query attention): this
    rank's two chunks (`zigzag_split` of the (B, heads, T, d) tensors along dim 2) -> (B, H, 2L, d), this
    rank's rows of the full causal attention. `exchange`: "ring" (point to point, overlapped) or
    "allgather". `kernel`: "auto" (the CPU flash kernel on CPU, else math), "flash" or "math". `scale`
    defaults to 1/sqrt(d). `counts`, if given, receives the blocks computed and skipped. With C = 1
    (`cp.size` 1) this is plain causal attention. `segments` (B, T) int64, the document number of every
    token of the whole rows (T = 2L x C): a query then sees only keys of its own document. `window` > 0: a
    query sees only the keys less than `window` positions behind it (blocks wholly outside are skipped).
    `sinks` (H,): each head's sink logit (gpt-oss), merged once per row.
    """
    if dropout_p > 0:
        raise UserError(f"attention dropout ({dropout_p}) is not supported with context parallelism; "
                        "set model.attention_dropout = 0")
    if exchange not in ("ring", "allgather") or kernel not in ("auto", "flash", "math"):
        raise ValueError(f"exchange={exchange!r} must be ring or allgather, kernel={kernel!r} auto, flash or math")
    if q.shape[2] % 2 or k.shape != v.shape or q.shape[1] % k.shape[1] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need (B, H, 2L, d) queries "
                         "and (B, Hkv, 2L, d) keys and values with H a multiple of Hkv")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if segments is not None and segments.shape != (q.shape[0], q.shape[2] * cp.size):
        raise ValueError(f"segments {tuple(segments.shape)} must be (B, T) of the whole rows, "
                         f"({q.shape[0]}, {q.shape[2] * cp.size})")
    return _ContextParallelAttention.apply(q, k, v, sinks, (cp, exchange, scale, kernel, counts, segments, window))
