"""DeepSeek-V4's attention (`shardlm.models.compressed_attention`) under context parallelism: what a rank gathers.

A CP rank holds two zigzag chunks of L = T / 2 consecutive positions (chunks r and 2C - 1 - r of a row of S = 2 C L).
Its queries need the keys of their windows and the compressed entries of the whole row.

- `halo_sources` (plain rows whose chunks hold whole compression windows, L a multiple of the layer's ratio m, and
  whose windows reach at most one chunk back, window - 1 <= L): each rank projects its own tokens
  (`CompressedAttention.key_inputs`) and computes the entries of its own windows; it all-gathers those entries
  (S / m of them a row, D channels, and the indexer's D_i) and the last `halo` tokens' projections of each chunk
  (halo = max(window - 1, m on CSA layers, whose first window of a chunk pools the previous window's first halves)).
  Per token and layer that is D / m + D_i / m channels plus the halos, instead of the whole row's projections.
  Its keys are pieces: each run of its chunks with the window - 1 positions before it (all its queries read).
- `document_sources` (packed documents, whose windows start at each document's first token, anywhere in a chunk):
  each rank projects its own tokens and pools the windows that end in its chunks; it all-gathers each chunk's last
  `document_halo` positions' projections (window - 1, and a window's earlier positions: ratio - 1, 2 ratio - 1 on
  CSA layers) and the entries (padded to the same count on every rank: each rank knows every document, so every
  rank's count); each document's entries are then read from the gathered ones, its keys from the rank's chunks and
  the halos before them.
- `gathered_keys` (chunks whose halos reach further than one chunk back, or plain rows whose chunks do not hold
  whole windows): every position's projections (D + 2 (1 + o) D + 4 D_i channels) all-gathered.

Each all-gather's backward reduce-scatters its gradient to the rank that computed it.
"""

from __future__ import annotations

import torch

from shardlm.data.zigzag import zigzag_merge
from shardlm.parallel import gather_from_sequence_parallel


def gathered_keys(attn, inputs: list[torch.Tensor], cp) -> list[torch.Tensor]:
    """Every position's `key_inputs` (B, S, .) of the row, in row order: this rank's tokens (`key_inputs`' views of
    x (B, T, h)) projected and all-gathered over the CP group `cp`."""
    keys = attn.key_inputs(inputs)
    widths = [part.shape[-1] for part in keys]
    joined = gather_from_sequence_parallel(torch.cat(keys, dim=-1), cp)
    return list(zigzag_merge(list(joined.chunk(cp.size, dim=1))).split(widths, dim=-1))


def chunk_runs(context: int, rank: int) -> list[list[int]]:
    """CP rank `rank`'s zigzag chunks r and 2C - 1 - r as runs of consecutive chunks (one run when they meet)."""
    mine = [rank, 2 * context - 1 - rank]
    return [mine] if mine[1] == mine[0] + 1 else [[mine[0]], [mine[1]]]


def halo_size(window: int, ratio: int, overlap: bool) -> int:
    """Positions of the chunk before that a chunk's queries and windows read: window - 1, at least `ratio` on a CSA
    layer (`overlap`), whose first window of a chunk pools the window before it."""
    return max(window - 1, ratio if overlap else 0)


def holds_whole_windows(tokens: int, window: int, ratio: int, overlap: bool) -> bool:
    """Whether a CP rank of `tokens` a row takes `halo_sources`: its two chunks hold whole windows of `ratio` (0: no
    compressor) and their halos reach at most one chunk back."""
    chunk = tokens // 2
    return tokens % 2 == 0 and (not ratio or chunk % ratio == 0) and halo_size(window, ratio, overlap) <= chunk


def chunk_reader(local: torch.Tensor, cp, halo: int):
    """A function (first, end, rows, channels) -> (b, end - first, c): the projections of positions first .. end - 1
    of the whole row, from this rank's two zigzag chunks (local (B, 2 L, P)) and, before them, the other chunks' last
    `halo` positions, which this all-gathers (each chunk's tail; collective over `cp`). `rows` and `channels` slice
    the batch and the projections' channels."""
    T = local.shape[1]
    C, L = cp.size, T // 2
    tails = torch.cat((local[:, L - halo:L], local[:, T - halo:]), dim=1)  # each chunk's last `halo` positions
    tails = zigzag_merge(list(gather_from_sequence_parallel(tails, cp).chunk(C, dim=1)))  # (B, 2 C halo, P)
    mine = (cp.rank, 2 * C - 1 - cp.rank)

    def read(first: int, end: int, rows: slice = slice(None), channels: slice = slice(None)) -> torch.Tensor:
        parts = []
        for chunk in range(first // L, (end - 1) // L + 1):
            lo, hi = max(first, chunk * L), min(end, (chunk + 1) * L)
            if chunk in mine:
                offset = (0 if chunk == mine[0] else L) - chunk * L
                parts.append(local[rows, lo + offset:hi + offset, channels])
            else:  # the chunk's gathered tail holds its last `halo` positions
                offset = chunk * halo - ((chunk + 1) * L - halo)
                parts.append(tails[rows, lo + offset:hi + offset, channels])
        return torch.cat(parts, dim=1)

    return read


def halo_sources(attn, inputs: list[torch.Tensor], cp) -> tuple | None:
    """`CompressedAttention.sources` for this rank's queries, from its tokens (`key_inputs`' views of x (B, T, h)):
    kv's projection as pieces [(first position, (B, n, D))], each run of its chunks with the window - 1 positions
    before it, the row's entries and the indexer's, gathered (the module docstring); None when its chunks do not hold
    whole windows."""
    T = inputs[0].shape[1]
    C, L = cp.size, T // 2
    compressor = attn.compressor
    ratio = compressor.ratio if compressor is not None else 0
    overlap = compressor is not None and compressor.overlap
    if not holds_whole_windows(T, attn.window, ratio, overlap):
        return None
    before, halo = attn.window - 1, halo_size(attn.window, ratio, overlap)  # before: what a chunk's first query sees
    keys = attn.key_inputs(inputs)
    widths = [part.shape[-1] for part in keys]
    read = chunk_reader(torch.cat(keys, dim=-1), cp, halo)
    kv = []
    for run in chunk_runs(C, cp.rank):
        n = min(before, run[0] * L)
        kv.append((run[0] * L - n, read(run[0] * L - n, (run[-1] + 1) * L, channels=slice(widths[0]))))  # kv's D
    if compressor is None:
        return kv, None, None
    pieces = []  # this rank's chunks' entries (and the indexer's), each from its own windows
    for j in (cp.rank, 2 * C - 1 - cp.rank):
        extra = ratio if compressor.overlap and j > 0 else 0  # the previous window's first halves
        span = read(j * L - extra, (j + 1) * L)
        _, entries, index_entries = attn.sources(list(span.split(widths, dim=-1)), j * L // ratio - extra // ratio)
        pieces.append([e[:, extra // ratio:] for e in (entries, index_entries) if e is not None])  # (its own)
    joined = torch.cat([torch.cat(parts, dim=1) for parts in zip(*pieces)], dim=-1)  # (B, 2 L / m, D (+ D_i))
    whole = zigzag_merge(list(gather_from_sequence_parallel(joined, cp).chunk(C, dim=1)))  # (B, S / m, D + D_i)
    entries = whole[..., :compressor.dim]
    index_entries = whole[..., compressor.dim:] if attn.indexer is not None else None
    return kv, entries, index_entries


def document_halo(window: int, ratio: int, overlap: bool) -> int:
    """Positions of the chunk before that a chunk's queries and the windows ending in it read on packed rows, where
    windows start at each document's first token: window - 1, and a window's other positions (ratio - 1, or
    2 ratio - 1 on a CSA layer (`overlap`), whose entry pools the window before it too); at least 1."""
    return max(window - 1, (2 * ratio - 1 if overlap else ratio - 1) if ratio else 0, 1)


def _chunk_owner(chunk: int, context: int) -> int:
    """The CP rank holding zigzag chunk `chunk` of 2 C."""
    return chunk if chunk < context else 2 * context - 1 - chunk


def document_sources(attn, inputs: list[torch.Tensor], cp, offsets: list[list[int]]) -> list[list[tuple | None]] | None:
    """Per row and document of `offsets` (the whole rows' document starts, `Documents.offsets`), the `sources` this
    rank's queries of the document read, in the document's positions: kv's projection as pieces [(first position,
    (1, n, D))] (each run of its chunks inside the document with the window - 1 positions before it), the document's
    entries (1, W, D) and the indexer's (1, W, D_i), gathered (the module docstring); None for a document without a
    query here. None when a halo reaches more than one chunk back."""
    T = inputs[0].shape[1]
    C, L = cp.size, T // 2
    compressor = attn.compressor
    ratio = compressor.ratio if compressor is not None else 0
    overlap = compressor is not None and compressor.overlap
    halo = document_halo(attn.window, ratio, overlap)
    if T % 2 or halo > L:
        return None
    keys = attn.key_inputs(inputs)
    widths = [part.shape[-1] for part in keys]
    read = chunk_reader(torch.cat(keys, dim=-1), cp, halo)

    def span(b: int, first: int, end: int) -> torch.Tensor:  # (1, end - first, P): row b's positions first .. end - 1
        return read(first, end, slice(b, b + 1))

    blank = [part[:1, :0] for part in keys]  # no position: what a rank without entries pools (their dtypes)
    entries = _document_entries(attn, offsets, span, widths, blank, cp, L) if ratio else None
    runs = [(run[0] * L, (run[-1] + 1) * L) for run in chunk_runs(C, cp.rank)]
    out = []
    for b, row in enumerate(offsets):
        documents = []
        for d, (start, end) in enumerate(zip(row[:-1], row[1:])):
            kv = []
            for first, last in runs:
                lo, hi = max(first, start), min(last, end)
                if lo < hi:
                    n = min(attn.window - 1, lo - start)
                    kv.append((lo - n - start, read(lo - n, hi, slice(b, b + 1), slice(widths[0]))))
            if not kv:
                documents.append(None)
                continue
            mine_entries = (None, None) if entries is None else entries(b, d)
            documents.append((kv, *mine_entries))
        out.append(documents)
    return out


def _document_entries(attn, offsets: list[list[int]], span, widths: list[int], blank: list[torch.Tensor], cp,
                      L: int):
    """A function (row, document) -> (the document's entries (1, W, D), the indexer's (1, W, D_i) or None): this rank
    pools the windows that end in its chunks (from `span`'s positions), every rank's are all-gathered (each rank's
    padded to the largest count) and each document's picked from them."""
    compressor, C = attn.compressor, cp.size
    ratio, back = compressor.ratio, 1 if compressor.overlap else 0
    slots: list[list[list[tuple[int, int]]]] = [[] for _ in offsets]  # per row, document: (owner rank, its slot)
    counts = [[0] * len(offsets) for _ in range(C)]  # per rank, row: its entries
    pooled = [[] for _ in offsets]  # this rank's entries per row
    for b, row in enumerate(offsets):
        for start, end in zip(row[:-1], row[1:]):
            here, runs = [], []  # this document's (rank, slot) per window; this rank's runs of windows per chunk
            for w in range((end - start) // ratio):
                chunk = (start + (w + 1) * ratio - 1) // L  # the chunk holding the window's last position
                owner = _chunk_owner(chunk, C)
                here.append((owner, counts[owner][b]))
                counts[owner][b] += 1
                if owner == cp.rank:
                    if runs and runs[-1][0] == chunk and runs[-1][2] == w:
                        runs[-1][2] = w + 1
                    else:
                        runs.append([chunk, w, w + 1])
            slots[b].append(here)
            for _, first, last in runs:  # windows first .. last - 1, with the window before for CSA's halves
                extra = back if first > 0 else 0
                positions = span(b, start + (first - extra) * ratio, start + last * ratio)
                _, kv_entries, index_entries = attn.sources(list(positions.split(widths, dim=-1)), first - extra)
                pooled[b].append(torch.cat([e[:, extra:] for e in (kv_entries, index_entries) if e is not None],
                                           dim=-1))
    none = torch.cat([e for e in attn.sources(blank)[1:] if e is not None], dim=-1)  # (1, 0, D (+ D_i))
    most = max(1, max(max(row) for row in counts))  # (one slot of padding when no document holds a whole window)
    rows = []
    for b in range(len(offsets)):
        mine = torch.cat(pooled[b], dim=1) if pooled[b] else none
        rows.append(torch.cat((mine, mine.new_zeros(1, most - mine.shape[1], mine.shape[-1])), dim=1))
    gathered = gather_from_sequence_parallel(torch.cat(rows), cp)  # (B, C most, width): rank r's at r most

    def of(b: int, d: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        index = torch.tensor([owner * most + slot for owner, slot in slots[b][d]], dtype=torch.long,
                             device=gathered.device)
        picked = gathered[b:b + 1].index_select(1, index)
        return picked[..., :compressor.dim], picked[..., compressor.dim:] if attn.indexer is not None else None

    return of
