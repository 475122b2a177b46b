"""Preference pairs packed into rows: each pair's two sequences, prompt + chosen and prompt + rejected, are two
documents of one row (per-document positions and attention, as SFT packs conversations), so a pair never splits
across rows, micro-batches or data-parallel ranks.

A row (`PairDataset[i]`) is a dict of (T,) arrays: `input_ids`; `labels`, the next token where it is an answer's
(-100 on the prompt, the last token and padding); `position_ids` restarting at every sequence; `pair`, the
pair's index in the data set (-1 on padding); `side`, 0 on the chosen sequence and 1 on the rejected one. The
loss sums the trained tokens' log-probabilities per (pair, side) (`shardlm.preference.loss`).

Pairs are packed by their two sequences' length (`sft.packing`: best-fit-decreasing, greedy in order, or one pair
a row), reshuffled and repacked every epoch by (seed, epoch) as `shardlm.sft.packing.PackedRows` does; a pair
longer than a row is dropped (counted and reported).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardlm.errors import UserError
from shardlm.preference.pairs import TokenizedPair
from shardlm.sft.dataset import PackedDataset
from shardlm.sft.packing import IGNORE_INDEX, PackStats, epoch_order, plan_bins, shift_labels


@dataclass
class PairRow:
    """One row's (T,) tensors (module docstring) and the pairs it holds."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    pair: torch.Tensor
    side: torch.Tensor
    pairs: list[int]


def build_pair_row(pairs: list[TokenizedPair], indices: list[int], length: int, pad_id: int) -> PairRow:
    """Pack `pairs` (data-set indices `indices`) into a row of `length` tokens, padding at the end."""
    ids, labels, positions, owner, side = [], [], [], [], []
    for pair, index in zip(pairs, indices):
        for s, answer in enumerate((pair.chosen, pair.rejected)):
            sequence = pair.prompt + answer
            ids += sequence
            labels += shift_labels(sequence, [0] * len(pair.prompt) + [1] * len(answer))
            positions += range(len(sequence))
            owner += [index] * len(sequence)
            side += [s] * len(sequence)
    pad = length - len(ids)
    if pad < 0:
        raise ValueError(f"pairs of {len(ids)} tokens do not fit a row of {length}")
    return PairRow(torch.tensor(ids + [pad_id] * pad), torch.tensor(labels + [IGNORE_INDEX] * pad),
                   torch.tensor(positions + list(range(pad))), torch.tensor(owner + [-1] * pad),
                   torch.tensor(side + [-1] * pad), list(indices))


class PairRows:
    """Packed rows of tokenized pairs, epoch after epoch (the `PackedRows` interface `PackedDataset` reads)."""

    def __init__(self, pairs: list[TokenizedPair], seq_length: int, pad_id: int = 0, seed: int | None = 0,
                 strategy: str = "bfd"):
        self.pairs, self.seq_length, self.pad_id, self.seed = pairs, seq_length, pad_id, seed
        self.strategy = strategy
        self.kept = [i for i, p in enumerate(pairs) if len(p) <= seq_length]
        self.stats = PackStats(documents=len(pairs), dropped=len(pairs) - len(self.kept))
        if not self.kept:
            raise UserError(f"every preference pair is longer than model.seq_length={seq_length} (its two sequences "
                            "share a row); raise model.seq_length")
        self._plan_epoch: int | None = None
        self._plan: list[list[int]] = []
        self.plan(0)

    def plan(self, epoch: int) -> list[list[int]]:
        """Row contents (pair indices) of `epoch`."""
        if self._plan_epoch != epoch:
            order = [self.kept[i] for i in epoch_order(len(self.kept), self.seed, epoch)]
            lengths = [len(self.pairs[i]) for i in order]
            bins = [[order[j] for j in b] for b in plan_bins(lengths, self.seq_length, self.strategy)]
            if self.seed is not None:
                bins = [bins[j] for j in np.random.default_rng([self.seed, epoch, 1]).permutation(len(bins))]
            self._plan, self._plan_epoch = bins, epoch
            self.stats.rows, self.stats.row_tokens = len(bins), len(bins) * self.seq_length
            self.stats.tokens = sum(len(self.pairs[i]) for i in order)
            self.stats.targets = sum(len(self.pairs[i].chosen) + len(self.pairs[i].rejected) for i in order)
        return self._plan

    def row(self, epoch: int, index: int) -> PairRow:
        indices = self.plan(epoch)[index]
        return build_pair_row([self.pairs[i] for i in indices], indices, self.seq_length, self.pad_id)


class PairDataset(PackedDataset):
    """Rows of pairs by global sample index (`PackedDataset`'s epochs and padding past the end), with `pair` and
    `side`."""

    @property
    def num_pairs(self) -> int:
        return len(self.rows.pairs)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if self.epochs is not None and index >= len(self):
            row = super().__getitem__(index)
            return row | {"pair": np.full(self.rows.seq_length, -1), "side": np.full(self.rows.seq_length, -1)}
        row = self.rows.row(*self._epoch_of(index))
        return {"input_ids": row.input_ids.numpy(), "labels": row.labels.numpy(),
                "position_ids": row.position_ids.numpy(), "pair": row.pair.numpy(), "side": row.side.numpy()}
