"""Model inputs for sentence-pair tasks: `[CLS] A [SEP] B [SEP]`, token types 0 / 1, padded.

A task's examples become a `TaskData`: numpy arrays `tokens`, `token_types`, `padding_mask`, each
(N, L) for classification or (N, C, L) for C-way multiple choice (one row per choice), and `labels`
(N,). Tokens are stored as int32 and types / padding as int8 (RACE at length 512 has ~350k rows);
`TaskData.batch` converts the rows it is asked for to int64 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TaskData:
    """Encoded examples of one split. Arrays: (N, L) or (N, C, L); labels (N,)."""

    tokens: np.ndarray
    token_types: np.ndarray
    padding_mask: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        """Rows `indices` as int64 tensors on `device`: tokens, token_types, padding_mask, labels."""
        return {name: torch.from_numpy(np.ascontiguousarray(getattr(self, name)[indices])).long().to(device)
                for name in ("tokens", "token_types", "padding_mask", "labels")}


def truncate_pair(a: list[int], b: list[int], budget: int) -> None:
    """Drop tokens from the end of the longer of `a`, `b` (in place) until len(a) + len(b) <= budget."""
    while len(a) + len(b) > budget:
        (a if len(a) > len(b) else b).pop()


def pair_row(a: list[int], b: list[int], seq_length: int, cls: int, sep: int, pad: int):
    """`[CLS] a [SEP] b [SEP]` padded to `seq_length` -> (tokens, token_types, padding_mask), each (L,).
    The caller has already made len(a) + len(b) <= seq_length - 3."""
    tokens = [cls, *a, sep, *b, sep]
    length = len(tokens)
    if length > seq_length:
        raise ValueError(f"pair of {length} tokens does not fit in {seq_length}")
    padding = seq_length - length
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1) + [0] * padding
    return tokens + [pad] * padding, types, [1] * length + [0] * padding


def stack_rows(rows: list[tuple], labels: list[int], shape: tuple[int, ...]) -> TaskData:
    """Rows from `pair_row` (in example-major order) -> TaskData with arrays of `shape` + (L,)."""
    tokens, types, padding = (np.asarray([r[k] for r in rows]) for k in range(3))
    length = tokens.shape[-1] if rows else 0
    return TaskData(tokens.astype(np.int32).reshape(*shape, length), types.astype(np.int8).reshape(*shape, length),
                    padding.astype(np.int8).reshape(*shape, length), np.asarray(labels, dtype=np.int64))


def encode_pairs(pairs: list[tuple[str, str]], labels: list[int], tokenizer, seq_length: int) -> TaskData:
    """Sentence pairs -> (N, L) arrays; the longer text loses tokens from its end until the pair fits."""
    firsts = tokenizer.encode_batch([a for a, _ in pairs])
    seconds = tokenizer.encode_batch([b for _, b in pairs])
    rows = []
    for a, b in zip(firsts, seconds):
        truncate_pair(a, b, seq_length - 3)
        rows.append(pair_row(a, b, seq_length, tokenizer.cls, tokenizer.sep, tokenizer.pad))
    return stack_rows(rows, labels, (len(pairs),))
