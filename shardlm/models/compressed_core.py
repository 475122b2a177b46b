"""DeepSeek-V4's attention core (`shardlm.models.compressed_attention`) by chunks of queries, without a (T, S) matrix.

The definition: each query at position p scores the shared key = value head at the positions of its sliding window,
p - window + 1 .. p, and the layer's compressed entries it may see (on an HCA layer every entry complete for p, on a
CSA layer the ones its indexer chose), then takes one softmax over [those scores / sqrt(D), its head's sink], the
sink's share dropped, and sums the keys and entries by it. transformers builds that over every position, the
others masked: (T, S + W) scores per head, kept for the backward, which at 128K tokens fit no GPU.

Here queries run in chunks of consecutive positions p0 .. p1 (a context-parallel rank's zigzag positions make two
runs). A chunk scores only the band of keys its window reaches, max(0, p0 - window + 1) .. p1, masking per query
those outside its own window, and the entries: on an HCA layer the ones complete for p1 (masked per query as they
complete), on a CSA layer each query's chosen ones: gathered, or while the chunk's complete entries are few
(`DENSE_SPAN` x k) all of them scored, the unchosen masked. The heads' queries are the rows of one product with the
band or the entries (one key head: nothing is repeated to the heads). A layer of more than `CHUNK_ELEMENTS` scores
recomputes each chunk in the backward, which keeps q, the keys and the entries, not the chunks' scores: the layer's
memory is linear in T (a smaller layer keeps its scores). The work is too, but for the HCA entries (T / ratio
each) and the indexer's scoring: at 4096 tokens, 8 heads of 64 and a window of 64, the score and value products
are T x 127 a head, not T x T. The same softmax, over fewer masked (exactly 0) terms: equal to the dense definition
within fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 22
"""At most about this many scores a chunk (batch x heads x queries x the keys and entries they score); a layer
with more in all recomputes its chunks in the backward."""

MIN_CHUNK = 64
"""Queries a chunk at least (if `CHUNK_ELEMENTS` allows), however small the window."""

DENSE_SPAN = 4
"""A CSA chunk whose queries may see at most this many times k entries scores all of them, the unchosen masked, instead
of gathering each query's k (as `shardlm.models.sparse_attention.DENSE_SPAN`)."""


def query_runs(positions: torch.Tensor, step: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of at most `step` queries, each at consecutive positions (positions (T,) of the
    queries, in their order, on the host)."""
    cuts = (positions[1:] != positions[:-1] + 1).nonzero().flatten().add(1).tolist()
    bounds = [0, *cuts, len(positions)]
    return [(start, min(start + step, end)) for begin, end in zip(bounds, bounds[1:])
            for start in range(begin, end, step)]


def attend(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, window: int,
           scale: float, entries: torch.Tensor | None = None, ratio: int = 0,
           chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, T, D) rotated, kv (B, S, D) the keys (= values) of positions 0 .. S - 1, positions (T,) the queries'
    (each below S), sinks (H,); `entries` (B, W, D) on a compressing layer, with its `ratio` (HCA: a query sees every
    complete entry) and on a CSA layer `chosen` (B, T, k) (the entries each query sees, -1 none) -> (y (B, H, T, D),
    on a CSA layer the heads' summed probabilities at each query's chosen entries (B, T, k), detached, 0 where
    chosen is -1, else None).

    Chunks of about the window's length (at least `MIN_CHUNK`): a chunk's band then holds at most twice the keys
    its queries see. A layer whose scores come to no more than `CHUNK_ELEMENTS` in all keeps them for the backward;
    otherwise every chunk is recomputed there."""
    B, H, T, _ = q.shape
    host = positions.cpu()
    others = 0 if entries is None else chosen.shape[-1] if chosen is not None else entries.shape[1]
    # a chunk of c queries scores c + window - 1 keys of its band: c near the window wastes at most half of them
    step = max(1, min(max(window, MIN_CHUNK), CHUNK_ELEMENTS // (B * H * (2 * window + others))))
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, kv, sinks, entries))
    recompute = grads and B * H * T * (step + window + others) > CHUNK_ELEMENTS
    outputs, masses = [], []
    for start, end in query_runs(host, step):
        first, last = int(host[start]), int(host[end - 1])
        low = max(0, first - window + 1)
        args = (q[:, :, start:end], kv[:, low:last + 1], positions[start:end], low, sinks, window, scale)
        if entries is None:
            args += (None, 0, None, False)
        elif chosen is None:  # HCA: the entries complete for the chunk's last query
            args += (entries[:, :(last + 1) // ratio], ratio, None, False)
        else:  # CSA: densely over the entries complete for its last query when they are few, else gathered
            complete = (last + 1) // ratio
            dense = complete <= DENSE_SPAN * chosen.shape[-1]
            args += (entries[:, :complete] if dense else entries, ratio, chosen[:, start:end], not dense)
        y, mass = checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
        outputs.append(y)
        masses.append(mass)
    return torch.cat(outputs, dim=2), None if chosen is None else torch.cat(masses, dim=1)


def _chunk(q, band, positions, low, sinks, window, scale, entries, ratio, chosen, gather):
    """`attend` for one chunk: q (B, H, c, D) at consecutive `positions` (c,), band (B, n, D) the keys of positions
    low .. low + n - 1; entries (B, W', D): HCA (`chosen` None) each masked until complete, CSA the `chosen`
    (B, c, k) ones, gathered (`gather`) or the others masked."""
    B, H, c, D = q.shape
    rows = q.reshape(B, H * c, D)  # the heads' queries against the one key head
    distance = positions.view(-1, 1) - torch.arange(low, low + band.shape[1], device=q.device).view(1, -1)
    scores = [torch.bmm(rows, band.transpose(1, 2)).view(B, H, c, -1) * scale]
    scores[0] = scores[0].masked_fill((distance < 0) | (distance >= window), float("-inf"))
    if gather:  # each query's chosen entries
        picked = entries[torch.arange(B, device=q.device).view(B, 1, 1), chosen.clamp_min(0)]  # (B, c, k, D)
        scores.append((torch.einsum("bhcd,bckd->bhck", q, picked) * scale).masked_fill(
            (chosen < 0).unsqueeze(1), float("-inf")))
    elif entries is not None:  # every entry, masked: until complete (HCA), or where not chosen (CSA)
        W = entries.shape[1]
        if chosen is None:
            hidden = torch.arange(W, device=q.device).view(1, -1) >= ((positions + 1) // ratio).view(-1, 1)
        else:
            hidden = ~torch.zeros(B, c, W + 1, dtype=torch.bool, device=q.device).scatter_(
                -1, torch.where(chosen >= 0, chosen, W), True)[..., :W].unsqueeze(1)
        scores.append((torch.bmm(rows, entries.transpose(1, 2)).view(B, H, c, W) * scale).masked_fill(
            hidden, float("-inf")))
    sink = sinks.view(1, -1, 1, 1).expand(B, -1, c, 1).to(scores[0].dtype)
    logits = torch.cat((*scores, sink), dim=-1)
    exact = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)
    probs, n = exact.to(band.dtype), band.shape[1]
    y = torch.bmm(probs[..., :n].reshape(B, H * c, n), band).view(B, H, c, D)
    if entries is None:
        return y, None
    on_entries = probs[..., n:-1]
    if gather:
        return y + torch.einsum("bhck,bckd->bhcd", on_entries, picked), exact[..., n:-1].detach().sum(1)
    y = y + torch.bmm(on_entries.reshape(B, H * c, -1), entries).view(B, H, c, D)
    if chosen is None:
        return y, None
    mass = F.pad(exact[..., n:-1].detach().sum(1), (0, 1))  # a last 0 for the queries' -1s
    return y, mass.gather(-1, torch.where(chosen >= 0, chosen, entries.shape[1]))
