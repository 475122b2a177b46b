"""Preference pairs packed into rows: each pair's two sequences, prompt + chosen and prompt + rejected, are two
documents of one row (per-document positions and attention, as SFT packs conversations), so a pair never splits
across rows, micro-batches or data-parallel ranks.

A row (`PairDataset[i]`) is a dict of (T,) arrays: `input_ids`; `labels`, the next token where it is an answer's
(-100 on the prompt, the last token and padding); `position_ids` restarting at every sequence; `pair`, the
pair's index in the data set (-1 on padding); `side`, 0 on the chosen sequence, 1 on the rejected one and 2 on TPO's
gold one (prompt + gold answer, a third document after them). The loss sums the trained tokens' log-probabilities
per (pair, side) (`shardlm.preference.loss`).

KTO's unpaired examples (`shardlm.preference.unpaired.TokenizedExample`) are rows of the same kind: each example's
sequence (prompt + completion, side 0) in the row's arrays, and its KL sequence (prompt + another example's
completion) at the same place in a second set of arrays of the row's length, `kl_input_ids`, `kl_labels`,
`kl_position_ids`, `kl_pair`, `kl_side`, so that the KL sequences can run forward on their own
(`shardlm.preference.kto`); an example takes the longer of its two sequences.

Pairs are packed by their sequences' length (`sft.packing`: best-fit-decreasing, greedy in order, or one pair
a row), reshuffled and repacked every epoch by (seed, epoch) as `shardlm.sft.packing.PackedRows` does. A pair longer
than a row (`sft.overflow`): "truncate" cuts each of its k sequences (2, 3 with a gold answer) to at most row / k
tokens, keeping its start (TRL's `max_length` with `truncation_mode="keep_start"`, row / k being that max_length),
and a KTO example each of its two sequences to the row; a sequence whose prompt alone fills that share (no answer
token left) drops the pair, as TRL drops fully truncated examples; "drop" drops every such pair. Both are counted and
reported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from shardlm.errors import UserError
from shardlm.preference.pairs import TokenizedPair
from shardlm.preference.unpaired import TokenizedExample
from shardlm.sft.dataset import PackedDataset
from shardlm.sft.packing import IGNORE_INDEX, PackStats, epoch_order, plan_bins, shift_labels


@dataclass
class PairRow:
    """One row's (T,) tensors (module docstring) and the pairs it holds; `kl`: KTO's KL sequences' tensors, by the
    same names."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    pair: torch.Tensor
    side: torch.Tensor
    pairs: list[int]
    kl: dict[str, torch.Tensor] | None = None


def _packed(sequences: list[tuple[list[int], list[int], int, int]], length: int, pad_id: int) -> dict:
    """(prompt, answer, owner, side) sequences one after the other, padded at the end to `length` tokens: a dict of
    the row's (T,) tensors (module docstring)."""
    ids, labels, positions, owner, side = [], [], [], [], []
    for prompt, answer, index, s in sequences:
        sequence = prompt + answer
        ids += sequence
        labels += shift_labels(sequence, [0] * len(prompt) + [1] * len(answer))
        positions += range(len(sequence))
        owner += [index] * len(sequence)
        side += [s] * len(sequence)
    pad = length - len(ids)
    if pad < 0:
        raise ValueError(f"sequences of {len(ids)} tokens do not fit a row of {length}")
    return {"input_ids": torch.tensor(ids + [pad_id] * pad), "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
            "position_ids": torch.tensor(positions + list(range(pad))), "pair": torch.tensor(owner + [-1] * pad),
            "side": torch.tensor(side + [-1] * pad)}


def build_pair_row(pairs: list[TokenizedPair], indices: list[int], length: int, pad_id: int) -> PairRow:
    """Pack `pairs` (data-set indices `indices`) into a row of `length` tokens, padding at the end."""
    sequences = [(pair.prompt, answer, index, s) for pair, index in zip(pairs, indices)
                 for s, answer in enumerate((pair.chosen, pair.rejected, pair.gold)) if answer is not None]
    return PairRow(**_packed(sequences, length, pad_id), pairs=list(indices))


def build_example_row(examples: list[TokenizedExample], indices: list[int], length: int, pad_id: int) -> PairRow:
    """Pack KTO `examples` (data-set indices `indices`) into a row of `length` tokens and their KL sequences into
    the row's `kl` arrays, each padded at the end."""
    own = [(e.prompt, e.completion, index, 0) for e, index in zip(examples, indices)]
    if examples and examples[0].kl_completion is None:  # a loss without the KL term
        return PairRow(**_packed(own, length, pad_id), pairs=list(indices))
    mismatched = [(e.prompt, e.kl_completion, index, 0) for e, index in zip(examples, indices)]
    return PairRow(**_packed(own, length, pad_id), pairs=list(indices), kl=_packed(mismatched, length, pad_id))


def fit(pair: TokenizedPair | TokenizedExample, seq_length: int) -> TokenizedPair | TokenizedExample | None:
    """`pair` cut to fit a row of `seq_length` tokens (module docstring: each sequence to its share, its start kept),
    itself when it fits, None when a sequence would keep no answer token."""
    if len(pair) <= seq_length:
        return pair
    if isinstance(pair, TokenizedExample):
        share, answers = seq_length, ("completion", "kl_completion")
    else:
        answers = ("chosen", "rejected") + (() if pair.gold is None else ("gold",))
        share = seq_length // len(answers)
    room = share - len(pair.prompt)
    if room < 1:
        return None
    return replace(pair, **{name: getattr(pair, name)[:room] for name in answers if getattr(pair, name) is not None})


class PairRows:
    """Packed rows of tokenized pairs, epoch after epoch (the `PackedRows` interface `PackedDataset` reads); pairs
    longer than a row truncated or dropped (`overflow`, module docstring)."""

    def __init__(self, pairs: list[TokenizedPair] | list[TokenizedExample], seq_length: int, pad_id: int = 0,
                 seed: int | None = 0, strategy: str = "bfd", overflow: str = "truncate"):
        if overflow not in ("truncate", "drop"):
            raise UserError(f"sft.overflow={overflow!r} is unknown; use 'truncate' or 'drop'")
        fitted = [fit(p, seq_length) if overflow == "truncate" else p if len(p) <= seq_length else None
                  for p in pairs]
        self.pairs = [f if f is not None else p for f, p in zip(fitted, pairs)]
        self.seq_length, self.pad_id, self.seed = seq_length, pad_id, seed
        self.strategy = strategy
        self.unpaired = bool(pairs) and isinstance(pairs[0], TokenizedExample)
        self.labels = [p.label for p in pairs] if self.unpaired else None
        """KTO: each example's label (True: desirable), by index; None for pairs."""
        self.with_kl = self.unpaired and pairs[0].kl_completion is not None
        """KTO: whether the rows carry the `kl_` arrays."""
        self.kept = [i for i, f in enumerate(fitted) if f is not None]
        self.stats = PackStats(documents=len(pairs), dropped=len(pairs) - len(self.kept),
                               truncated=sum(f is not None and f is not p for f, p in zip(fitted, pairs)),
                               unit="examples" if self.unpaired else "pairs")
        if not self.kept:
            what = "example is" if self.unpaired else "preference pair is"
            raise UserError(f"every {what} longer than model.seq_length={seq_length} ("
                            + ("its sequence or its KL sequence" if self.unpaired else "its sequences share a row")
                            + (", its prompt longer than its share of a row" if overflow == "truncate" else "")
                            + "); raise model.seq_length")
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
            arrays = 2 if self.with_kl else 1  # KTO: the examples' arrays and the KL sequences'
            self.stats.rows, self.stats.row_tokens = len(bins), len(bins) * self.seq_length * arrays
            self.stats.tokens = sum(sum(self.pairs[i].sequence_lengths) if self.unpaired else len(self.pairs[i])
                                    for i in order)
            self.stats.targets = sum(self.pairs[i].targets for i in order)
        return self._plan

    def row(self, epoch: int, index: int) -> PairRow:
        indices = self.plan(epoch)[index]
        build = build_example_row if self.unpaired else build_pair_row
        return build([self.pairs[i] for i in indices], indices, self.seq_length, self.pad_id)


class PairDataset(PackedDataset):
    """Rows of pairs by global sample index (`PackedDataset`'s epochs and padding past the end), with `pair` and
    `side` (and KTO's `kl_` arrays)."""

    @property
    def num_pairs(self) -> int:
        return len(self.rows.pairs)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if self.epochs is not None and index >= len(self):
            return empty_row(self.rows.seq_length, self.rows.pad_id, self.rows.with_kl)
        row = self.rows.row(*self._epoch_of(index))
        arrays = {"input_ids": row.input_ids, "labels": row.labels, "position_ids": row.position_ids,
                  "pair": row.pair, "side": row.side}
        arrays |= {f"kl_{key}": value for key, value in (row.kl or {}).items()}
        return {key: value.numpy() for key, value in arrays.items()}


def empty_row(length: int, pad_id: int, with_kl: bool) -> dict[str, np.ndarray]:
    """A row without pairs (to fill the last micro-batches of a split): padding, no trained token; with KTO's `kl_`
    arrays when `with_kl`."""
    row = {"input_ids": np.full(length, pad_id, dtype=np.int64), "labels": np.full(length, IGNORE_INDEX),
           "position_ids": np.arange(length), "pair": np.full(length, -1), "side": np.full(length, -1)}
    return row | ({f"kl_{key}": value.copy() for key, value in row.items()} if with_kl else {})
