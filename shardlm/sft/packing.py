"""Packing tokenized conversations into fixed-length rows for SFT.

Each conversation (a *document* here) keeps its own causal context: in a packed row of length T,

- `input_ids` (T,) int64: the documents one after another, then `pad_id` up to T;
- `labels` (T,) int64: `labels[t] = input_ids[t + 1]` when t + 1 is in the same document and is a trained
  (assistant) token, else -100. Labels are already shifted: the loss is `cross_entropy(logits[t], labels[t])`
  with no further shift, and no label ever crosses from one document into the next;
- `position_ids` (T,) int64: 0, 1, ... restarting at 0 at every document (and for the padding tail);
- `cu_seqlens` (S + 1,) int32: segment offsets `[0, len_0, len_0 + len_1, ..., T]`, one segment per
  document plus one for the padding tail when there is one (the flash-attention `cu_seqlens` layout).

Strategies (`strategy=`): `"bfd"` best-fit-decreasing (longest documents first, each into the fullest row it
fits; the same bins and row order as TRL's `pack_dataset(strategy="bfd")` when `seed=None`), `"greedy"`
(documents in order, a new row when the next one does not fit) and `"pad"` (one document per row).
Documents longer than T are truncated to T tokens (`overflow="truncate"`), split into pieces of T tokens and a last
shorter one, each packed as a document of its own, so no token is lost (`"split"`, TRL's `"bfd_split"`: a piece's
positions start at 0 and its first token is no target), or dropped (`"drop"`); a document (or piece) left with no
trained token is dropped; `PackStats` counts the truncated documents that were kept, the split ones and all dropped
ones.

`PackedRows` iterates rows epoch after epoch in an order fixed by `(seed, epoch)`, and its
`state_dict()` / `load_state_dict()` (`{"epoch", "index"}`) restore the order mid-epoch.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shardlm.errors import UserError
from shardlm.sft.template import TokenizedConversation

IGNORE_INDEX = -100
STRATEGIES = ("bfd", "greedy", "pad")
OVERFLOW = ("truncate", "split", "drop")


def shift_labels(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """Labels (n,) of one document: `input_ids[t + 1]` where `loss_mask[t + 1]`, else -100; the last is -100."""
    n = len(input_ids)
    return [input_ids[t + 1] if loss_mask[t + 1] else IGNORE_INDEX for t in range(n - 1)] + [IGNORE_INDEX] * min(n, 1)


@dataclass
class PackStats:
    """What packing kept and lost. `efficiency` = real tokens / row tokens (padding is the rest)."""

    documents: int = 0
    rows: int = 0
    truncated: int = 0
    dropped: int = 0
    split: int = 0
    tokens: int = 0
    row_tokens: int = 0
    targets: int = 0
    unit: str = "conversations"
    """What a document is, in the summary: "conversations", preference "pairs", KTO "examples"."""

    @property
    def efficiency(self) -> float:
        return self.tokens / self.row_tokens if self.row_tokens else 0.0

    def summary(self) -> str:
        return (f"packed {self.documents} {self.unit} into {self.rows} rows: {self.efficiency:.1%} of row tokens "
                f"are real, {self.targets} trained tokens; {self.truncated} truncated, "
                + (f"{self.split} split, " if self.split else "") + f"{self.dropped} dropped")


@dataclass
class PackedRow:
    """One packed row (see the module docstring for the shapes); `documents` are the packed documents' indices."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    documents: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the row."""
        return int(self.cu_seqlens[len(self.documents)])


def plan_bins(lengths: Sequence[int], seq_length: int, strategy: str = "bfd") -> list[list[int]]:
    """Group document indices into rows: a list of rows, each a list of indices whose lengths sum to <= seq_length.

    `bfd`: documents by decreasing length (ties in input order); each goes into the open row with the least
    room that still fits it (ties: the row that reached that room first), else a new row. Rows are returned in
    the order they were opened. `greedy`: input order, a new row when the next document does not fit.
    `pad`: one document per row.
    """
    if strategy not in STRATEGIES:
        raise UserError(f"packing strategy {strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
    if any(n > seq_length or n <= 0 for n in lengths):
        raise ValueError("every length must be in 1..seq_length; truncate or drop long documents first")
    if strategy == "pad":
        return [[i] for i in range(len(lengths))]
    if strategy == "greedy":
        bins: list[list[int]] = []
        room = 0
        for i, n in enumerate(lengths):
            if n > room:
                bins.append([])
                room = seq_length
            bins[-1].append(i)
            room -= n
        return bins
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins = []
    rooms: list[int] = []  # sorted distinct room sizes of open rows that still have room
    by_room: dict[int, deque[int]] = {}
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            b = by_room[room].popleft()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        else:
            room, b = seq_length, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            if left not in by_room:
                by_room[left] = deque()
                bisect.insort(rooms, left)
            by_room[left].append(b)
    return bins


def _fit(docs: Sequence[TokenizedConversation], seq_length: int, overflow: str, stats: PackStats):
    """Per document (under "split", per piece): (input_ids, labels) within seq_length, or None when it is dropped."""
    if overflow not in OVERFLOW:
        raise UserError(f"overflow={overflow!r} is unknown; use 'truncate', 'split' or 'drop'")
    if overflow == "split":
        docs = [piece for doc in docs for piece in _pieces(doc, seq_length, stats)]
    fitted = []
    for doc in docs:
        ids, mask = list(doc.input_ids), list(doc.loss_mask)
        if len(ids) > seq_length:
            if overflow == "drop":
                stats.dropped += 1
                fitted.append(None)
                continue
            ids, mask = ids[:seq_length], mask[:seq_length]
        labels = shift_labels(ids, mask)
        if not ids or all(x == IGNORE_INDEX for x in labels):
            stats.dropped += 1
            fitted.append(None)
            continue
        stats.truncated += len(doc.input_ids) > seq_length
        fitted.append((ids, labels))
    return fitted


def _pieces(doc: TokenizedConversation, seq_length: int, stats: PackStats) -> list[TokenizedConversation]:
    """`doc` cut into pieces of `seq_length` tokens and a last shorter one (itself when it fits); counted."""
    n = len(doc.input_ids)
    if n <= seq_length:
        return [doc]
    stats.split += 1
    return [TokenizedConversation(list(doc.input_ids[i:i + seq_length]), list(doc.loss_mask[i:i + seq_length]),
                                  doc.where) for i in range(0, n, seq_length)]


def build_row(pieces: Sequence[tuple[list[int], list[int]]], seq_length: int, pad_id: int,
              documents: Sequence[int] = ()) -> PackedRow:
    """One row from `(input_ids, labels)` pieces whose lengths sum to at most `seq_length`."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    offsets = [0]
    for piece_ids, piece_labels in pieces:
        ids += piece_ids
        labels += piece_labels
        positions += range(len(piece_ids))
        offsets.append(len(ids))
    pad = seq_length - len(ids)
    if pad < 0:
        raise ValueError(f"pieces hold {len(ids)} tokens, more than seq_length={seq_length}")
    if pad:
        ids += [pad_id] * pad
        labels += [IGNORE_INDEX] * pad
        positions += range(pad)
        offsets.append(seq_length)
    return PackedRow(torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                     torch.tensor(positions, dtype=torch.long), torch.tensor(offsets, dtype=torch.int32),
                     list(documents))


def epoch_order(num: int, seed: int | None, epoch: int) -> list[int]:
    """Document order for one epoch: input order when `seed` is None, else a permutation fixed by (seed, epoch)."""
    if seed is None:
        return list(range(num))
    return np.random.default_rng([seed, epoch]).permutation(num).tolist()


class PackedRows:
    """Packed rows of tokenized conversations, epoch after epoch, resumable mid-epoch.

    Per epoch: the documents are put in `epoch_order(seed, epoch)`, packed with `strategy`, and (when `seed`
    is set) the rows are shuffled with the same generator, so long rows do not all come first. `stats` holds
    the counts of the latest planned epoch. Iterating yields `PackedRow`s without end; `rows(epoch)` gives
    one epoch's rows as a list.
    """

    def __init__(self, docs: Sequence[TokenizedConversation], seq_length: int, strategy: str = "bfd",
                 overflow: str = "truncate", pad_id: int = 0, seed: int | None = 0) -> None:
        if seq_length < 2:
            raise UserError(f"seq_length={seq_length} is too short to pack conversations; use at least 2")
        self.seq_length, self.strategy, self.pad_id, self.seed = seq_length, strategy, pad_id, seed
        self.stats = PackStats(documents=len(docs))
        self._fitted = _fit(docs, seq_length, overflow, self.stats)
        if all(f is None for f in self._fitted):
            raise UserError(f"no conversation is left to train on after fitting them into seq_length={seq_length}")
        self.epoch, self.index = 0, 0
        self._plan_epoch: int | None = None
        self._plan: list[list[int]] = []
        self.plan(0)

    def plan(self, epoch: int) -> list[list[int]]:
        """Row contents (document indices) of `epoch`."""
        if self._plan_epoch != epoch:
            order = [i for i in epoch_order(len(self._fitted), self.seed, epoch) if self._fitted[i] is not None]
            bins = plan_bins([len(self._fitted[i][0]) for i in order], self.seq_length, self.strategy)
            bins = [[order[j] for j in b] for b in bins]
            if self.seed is not None:
                rng = np.random.default_rng([self.seed, epoch, 1])
                bins = [bins[j] for j in rng.permutation(len(bins))]
            self._plan, self._plan_epoch = bins, epoch
            kept = [self._fitted[i] for i in order]
            self.stats.rows = len(bins)
            self.stats.tokens = sum(len(ids) for ids, _ in kept)
            self.stats.row_tokens = len(bins) * self.seq_length
            self.stats.targets = sum(sum(x != IGNORE_INDEX for x in labels) for _, labels in kept)
        return self._plan

    def row(self, epoch: int, index: int) -> PackedRow:
        docs = self.plan(epoch)[index]
        return build_row([self._fitted[i] for i in docs], self.seq_length, self.pad_id, docs)

    def rows(self, epoch: int = 0) -> list[PackedRow]:
        return [self.row(epoch, i) for i in range(len(self.plan(epoch)))]

    def __iter__(self) -> Iterator[PackedRow]:
        while True:
            if self.index >= len(self.plan(self.epoch)):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            row = self.row(self.epoch, self.index)
            self.index += 1
            yield row

    def state_dict(self) -> dict[str, int]:
        """`{"epoch", "index"}`: the next row to yield is row `index` of epoch `epoch`."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def collate(rows: Sequence[PackedRow]) -> dict:
    """A batch: `input_ids`, `labels`, `position_ids` (B, T) int64 and `cu_seqlens`, a list of B int32 tensors."""
    return {"input_ids": torch.stack([r.input_ids for r in rows]), "labels": torch.stack([r.labels for r in rows]),
            "position_ids": torch.stack([r.position_ids for r in rows]), "cu_seqlens": [r.cu_seqlens for r in rows]}


def check_targets(labels: torch.Tensor, where: str = "batch") -> int:
    """Number of trained tokens in `labels` (any shape); a one-line `UserError` when there are none, since the
    mean loss over zero tokens is NaN. Call it on each micro-batch before the loss."""
    count = int((labels != IGNORE_INDEX).sum())
    if count == 0:
        raise UserError(f"{where} has no assistant token to train on (every label is {IGNORE_INDEX}); check the "
                        "records' assistant turns and the chat template's loss mask")
    return count
