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
band or the entries (one key head: nothing is repeated to the heads). Past `GROUP_FROM` chunks a layer, chunks run
in groups, one product for a group: each chunk's band a window of the group's keys (an unfold, no copy), so a long
row takes a few large products, not T / window small ones (at 8,192 tokens on the CPU 2.3x faster than chunk by
chunk; on a GPU, far fewer kernels). A layer of more than `CHUNK_ELEMENTS` scores recomputes each group in the
backward, which keeps q, the keys and the entries, not the chunks' scores: the layer's
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

GROUP_FROM = 8
"""Chunks run one product at a time up to this many chunks a layer; beyond, in groups of as many as
`CHUNK_ELEMENTS` allows (one product for a group: fewer, larger kernels at long sequences)."""

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


def attend(q: torch.Tensor, kv, positions: torch.Tensor, sinks: torch.Tensor, window: int,
           scale: float, entries: torch.Tensor | None = None, ratio: int = 0,
           chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, T, D) rotated, kv the keys (= values): (B, S, D) of positions 0 .. S - 1, or pieces [(first
    position, (B, n, D))] of consecutive positions, each query's window within one (a context-parallel rank's runs
    with the window before each), positions (T,) the queries' (each below S), sinks (H,); `entries` (B, W, D) on a
    compressing layer, with its `ratio` (HCA: a query sees every complete entry) and on a CSA layer `chosen`
    (B, T, k) (the entries each query sees, -1 none) -> (y (B, H, T, D), on a CSA layer the heads' summed
    probabilities at each query's chosen entries (B, T, k), detached, 0 where chosen is -1, else None).

    Chunks of about the window's length (at least `MIN_CHUNK`): a chunk's band then holds at most twice the keys
    its queries see. A layer whose scores come to no more than `CHUNK_ELEMENTS` in all keeps them for the backward;
    otherwise every chunk is recomputed there."""
    B, H, T, _ = q.shape
    host = positions.cpu()
    others = 0 if entries is None else chosen.shape[-1] if chosen is not None else entries.shape[1]
    pieces = [(0, kv)] if isinstance(kv, torch.Tensor) else kv
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (q, sinks, entries, *(piece for _, piece in pieces)))
    step, per_group, recompute = chunking(B, H, T, window, others, grads)
    outputs, masses = [], []
    for start, end, size in chunk_groups(host, step, per_group):
        first, last = int(host[start]), int(host[end - 1])
        low = first - window + 1
        args = (q[:, :, start:end], _band(pieces, max(0, low), last), positions[start:end], low, size, sinks, window,
                scale)
        if entries is None:
            args += (None, 0, None, False)
        elif chosen is None:  # HCA: the entries complete for the group's last query
            args += (entries[:, :(last + 1) // ratio], ratio, None, False)
        else:  # CSA: densely over the entries complete for its last query when they are few, else gathered
            complete = (last + 1) // ratio
            dense = complete <= DENSE_SPAN * chosen.shape[-1]
            args += (entries[:, :complete] if dense else entries, ratio, chosen[:, start:end], not dense)
        y, mass = checkpoint(_group, *args, use_reentrant=False) if recompute else _group(*args)
        outputs.append(y)
        masses.append(mass)
    return torch.cat(outputs, dim=2), None if chosen is None else torch.cat(masses, dim=1)


def chunking(batch: int, heads: int, queries: int, window: int, others: int,
             grads: bool = True) -> tuple[int, int, bool]:
    """How `attend` runs `batch` rows of `heads` heads and `queries` queries, each scoring its window and `others`
    entries (0 sliding, W HCA, k CSA): (queries a chunk, chunks a product, whether the chunks are recomputed in the
    backward; `grads`: a graph is built). No tensors: the planner reads it too."""
    # a chunk of c queries scores c + window - 1 keys of its band: c near the window wastes at most half of them
    step = max(1, min(max(window, MIN_CHUNK), CHUNK_ELEMENTS // (batch * heads * (2 * window + others))))
    recompute = grads and batch * heads * queries * (step + window + others) > CHUNK_ELEMENTS
    per_group = max(1, CHUNK_ELEMENTS // (batch * heads * step * (step + window - 1 + others)))  # chunks a product
    if queries <= GROUP_FROM * step:  # few chunks: one at a time costs less than the group's copies
        per_group = 1
    return step, per_group, recompute


def _band(pieces: list[tuple[int, torch.Tensor]], first: int, last: int) -> torch.Tensor:
    """The keys of positions first .. last (B, n, D), from the piece that holds them."""
    for start, piece in pieces:
        if start <= first and last < start + piece.shape[1]:
            return piece[:, first - start:last + 1 - start]
    raise ValueError(f"no key piece holds positions {first} .. {last}")


def chunk_groups(positions: torch.Tensor, step: int, per_group: int) -> list[tuple[int, int, int]]:
    """(start, end, chunk size) of each group of queries: the runs of consecutive positions (`query_runs`) cut into
    groups of `per_group` chunks of `step` queries, a run's remainder a group of one smaller chunk."""
    groups = []
    for begin, end in query_runs(positions, len(positions) or 1):
        whole = begin + (end - begin) // step * step
        groups += [(start, min(start + per_group * step, whole), step)
                   for start in range(begin, whole, per_group * step)]
        if whole < end:
            groups.append((whole, end, end - whole))
    return groups


def _group(q, band, positions, low, size, sinks, window, scale, entries, ratio, chosen, gather):
    """`attend` for a group of G chunks of `size` consecutive queries: q (B, H, G size, D) at `positions`
    (G size,), band (B, n', D) the keys of positions max(0, low) .. (the G chunks' bands together; zeros stand in
    for positions before 0 when G > 1, so that each chunk's band has size + window - 1 keys); entries
    (B, W', D): HCA (`chosen` None) each masked until complete, CSA the `chosen` (B, G size, k) ones, gathered
    (`gather`) or the others masked. Each chunk's band is a window of `band` (an unfold: no copy of the keys)."""
    B, H, Q, D = q.shape
    G, c = Q // size, size
    if G > 1 and low < 0:  # positions before the row's first key: zeros (masked), so that every band has n keys
        band = torch.cat((band.new_zeros(B, -low, D), band), dim=1)
    first_key = low if G > 1 else max(low, 0)
    n = c + window - 1 if G > 1 else band.shape[1]
    grouped = q.reshape(B, H, G, c, D).transpose(1, 2).reshape(B * G, H * c, D)  # chunk by chunk, heads' rows
    # (B G, n, D): chunk g's keys from position first_key + g c
    bands = (band.unfold(1, n, c).transpose(-1, -2) if G > 1 else band.unsqueeze(1)).reshape(B * G, n, D)
    scores = [torch.bmm(grouped, bands.transpose(1, 2)).view(B, G, H, c, n) * scale]
    keys = first_key + c * torch.arange(G, device=q.device).view(G, 1, 1) + torch.arange(n, device=q.device)
    distance = positions.view(G, c, 1) - keys  # (G, c, n)
    hidden = (distance < 0) | (distance >= window) | (keys < 0)
    scores[0] = scores[0].masked_fill(hidden.unsqueeze(1), float("-inf"))
    if gather:  # each query's chosen entries
        picked = entries[torch.arange(B, device=q.device).view(B, 1, 1), chosen.clamp_min(0)]  # (B, Q, k, D)
        picked = picked.view(B, G, c, -1, D)
        scores.append((torch.einsum("bghcd,bgckd->bghck", grouped.reshape(B, G, H, c, D), picked) * scale).masked_fill(
            (chosen < 0).view(B, G, 1, c, -1), float("-inf")))
    elif entries is not None:  # every entry, masked: until complete (HCA), or where not chosen (CSA)
        W = entries.shape[1]
        if chosen is None:
            unseen = torch.arange(W, device=q.device).view(1, -1) >= ((positions + 1) // ratio).view(-1, 1)
            unseen = unseen.view(1, G, 1, c, W)
        else:
            unseen = ~torch.zeros(B, Q, W + 1, dtype=torch.bool, device=q.device).scatter_(
                -1, torch.where(chosen >= 0, chosen, W), True)[..., :W].view(B, G, 1, c, W)
        scores.append((torch.bmm(grouped.reshape(B, G * H * c, D), entries.transpose(1, 2)).view(B, G, H, c, W)
                       * scale).masked_fill(unseen, float("-inf")))
    sink = sinks.view(1, 1, -1, 1, 1).expand(B, G, -1, c, 1).to(scores[0].dtype)
    logits = torch.cat((*scores, sink), dim=-1)
    # less the row's max, as transformers' sinks attention: a constant per row, so no gradient flows through it; in
    # the scores' dtype, as transformers (autocast on CUDA would otherwise take it to fp32)
    exact = torch.softmax(logits - logits.detach().max(dim=-1, keepdim=True).values, dim=-1, dtype=logits.dtype)
    probs = exact.to(band.dtype)
    y = torch.bmm(probs[..., :n].reshape(B * G, H * c, n), bands).view(B, G, H, c, D)
    mass = None
    if gather:
        y = y + torch.einsum("bghck,bgckd->bghcd", probs[..., n:-1], picked)
        mass = exact[..., n:-1].detach().sum(2).reshape(B, Q, -1)
    elif entries is not None:
        y = y + torch.bmm(probs[..., n:-1].reshape(B, G * H * c, -1), entries).view(B, G, H, c, D)
        if chosen is not None:  # a last 0 for the queries' -1s
            mass = F.pad(exact[..., n:-1].detach().sum(2).reshape(B, Q, -1), (0, 1))
            mass = mass.gather(-1, torch.where(chosen >= 0, chosen, entries.shape[1]))
    return y.transpose(1, 2).reshape(B, H, Q, D), mass
