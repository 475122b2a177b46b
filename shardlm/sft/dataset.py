"""The trainer's datasets for an `[sft]` run: chat records -> tokenized conversations -> packed rows.

`build_sft_datasets(sft, seq_length, seed)` reads the records, holds out `sft.valid_fraction` of the
conversations (a fixed choice by `seed`), renders and masks both parts with the tokenizer's chat template
and packs them (`shardlm.sft.packing.PackedRows`). The trainer reads samples by global index, as it reads
pretraining samples (`shardlm.training.data`): sample `i` is row `i` of the concatenation of the
training epochs (the documents reshuffled and repacked every epoch, by `(seed, epoch)`), so the data
position is a pure function of the step and a run resumed mid-epoch reads the exact next row.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlm.config import SFTConfig
from shardlm.errors import UserError
from shardlm.sft.packing import IGNORE_INDEX, PackedRows, PackStats
from shardlm.sft.records import ALPACA, DOLLY, load_conversations
from shardlm.sft.template import ChatTemplate, tokenize_conversations

FIELDS = {"auto": None, "dolly": DOLLY, "alpaca": ALPACA}


class PackedDataset:
    """Packed rows by global sample index: `dataset[i]` is a dict of `input_ids`, `labels`, `position_ids`,
    each (T,) int64 (what `shardlm.training.data.micro_batches` stacks). With `epochs=None` the index runs on
    through as many epochs as it asks for; with `epochs=1` (validation) the length is one epoch's rows, and
    an index past the end reads an empty row (no trained token), so that every layout can evaluate the
    whole set in equal micro-batches and get the same loss."""

    def __init__(self, rows: PackedRows, epochs: int | None = None):
        self.rows, self.epochs = rows, epochs
        self.pads_past_end = epochs is not None
        self._ends: list[int] = []  # cumulative row counts of epochs 0, 1, ...

    def _epoch_of(self, index: int) -> tuple[int, int]:
        while not self._ends or self._ends[-1] <= index:
            epoch = len(self._ends)
            if self.epochs is not None and epoch >= self.epochs:
                raise IndexError(index)
            self._ends.append((self._ends[-1] if self._ends else 0) + len(self.rows.plan(epoch)))
        epoch = bisect.bisect_right(self._ends, index)
        return epoch, index - (self._ends[epoch - 1] if epoch else 0)

    def __len__(self) -> int:
        if self.epochs is None:
            return 2**62
        if not hasattr(self, "_length"):
            self._length = sum(len(self.rows.plan(e)) for e in range(self.epochs))
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if self.epochs is not None and index >= len(self):
            length = self.rows.seq_length
            return {"input_ids": np.full(length, self.rows.pad_id, dtype=np.int64),
                    "labels": np.full(length, IGNORE_INDEX, dtype=np.int64), "position_ids": np.arange(length)}
        row = self.rows.row(*self._epoch_of(index))
        return {"input_ids": row.input_ids.numpy(), "labels": row.labels.numpy(),
                "position_ids": row.position_ids.numpy()}


@dataclass
class SFTData:
    """What an SFT run reads: the training and validation datasets (valid None when nothing is held out), the
    chat template, the packing counts of the first epoch and the largest token id (to check the vocabulary)."""

    train: PackedDataset
    valid: PackedDataset | None
    template: ChatTemplate
    stats: PackStats
    valid_stats: PackStats | None
    max_token_id: int

    def summary(self) -> str:
        line = (f"sft: {self.stats.summary()}; chat template: {self.template.name} (loss mask by "
                f"{self.template.mask_method})")
        if self.valid_stats is not None:
            valid = self.valid_stats
            line += f"; validation: {valid.documents} {valid.unit} in {valid.rows} rows"
        return line


def tokenizer_dir(sft: SFTConfig, init_from: str) -> Path:
    """The tokenizer directory of an SFT run: sft.tokenizer, else checkpoint.init_from when it is a directory."""
    if sft.tokenizer:
        return Path(sft.tokenizer)
    if init_from and Path(init_from).is_dir():
        return Path(init_from)
    raise UserError("sft.tokenizer is not set and checkpoint.init_from is not a Hugging Face directory; set "
                    "sft.tokenizer to the directory holding tokenizer.json and the chat template")


def run_template(sft: SFTConfig, init_from: str) -> ChatTemplate:
    """The chat template an `[sft]` section's run renders with (SFT, preference and RL alike): the tokenizer
    directory's (`tokenizer_dir`) or `sft.template`'s, `sft.end_of_turn`, and `sft.chat_template_kwargs` passed to
    every rendering."""
    source = Path(sft.template).read_text(encoding="utf-8") if sft.template else None
    template = ChatTemplate.from_dir(tokenizer_dir(sft, init_from), end_of_turn=sft.end_of_turn or None,
                                     template=source)
    template.variables = dict(sft.chat_template_kwargs)
    return template


def held_out(count: int, fraction: float, seed: int) -> set[int]:
    """Indices of the conversations held out for validation: round(count x fraction), at least one when the
    fraction is above 0 and at least two conversations exist, chosen by `seed`."""
    if fraction <= 0 or count < 2:
        return set()
    size = min(count - 1, max(1, round(count * fraction)))
    return set(np.random.default_rng([seed, 7]).permutation(count)[:size].tolist())


def build_sft_datasets(sft: SFTConfig, seq_length: int, seed: int, init_from: str = "") -> SFTData:
    """Read, split, tokenize and pack an `[sft]` section's records (one-line UserErrors for bad input)."""
    template = run_template(sft, init_from)
    conversations = load_conversations(list(sft.data), FIELDS[sft.fields], sft.system_prompt or None)
    valid_ids = held_out(len(conversations), sft.valid_fraction, seed)
    train_docs = tokenize_conversations(template, [c for i, c in enumerate(conversations) if i not in valid_ids])
    valid_docs = tokenize_conversations(template, [c for i, c in enumerate(conversations) if i in valid_ids])
    pad = template.special_tokens.get("pad_token") or template.end_of_turn
    pad_id = template.tokenizer.token_to_id(pad) if pad else None
    pad_id = pad_id if pad_id is not None else 0
    train = PackedRows(train_docs, seq_length, sft.packing, sft.overflow, pad_id, seed=seed if sft.shuffle else None)
    valid = None
    if valid_docs:
        valid = PackedRows(valid_docs, seq_length, sft.packing, sft.overflow, pad_id, seed=None)
    max_id = max(max(d.input_ids) for d in train_docs + valid_docs)
    return SFTData(PackedDataset(train), PackedDataset(valid, epochs=1) if valid else None, template,
                   train.stats, valid.stats if valid else None, max(max_id, pad_id))
