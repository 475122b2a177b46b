"""BERT pretraining samples: sentence pairs from documents, masked LM + sentence-order prediction.

Input is a file preprocessed with `--split-sentences` (one index sequence per sentence). A samples
mapping, built once per (data, split, seq_length, seed) and cached, cuts each document into chunks
of consecutive sentences of about `seq_length - 3` tokens (with probability `short_seq_prob` a
shorter random target, as in BERT). Item i then, deterministically for (seed, i):

1. splits its chunk at a random sentence boundary into segments A and B;
2. sentence-order prediction (default): swaps A and B with probability 0.5, `is_random` = 1 if
   swapped; with `next_sentence_prediction`, B is instead replaced by sentences of another
   document with probability 0.5 (`is_random` = 1);
3. truncates the longer segment until `[CLS] A [SEP] B [SEP]` fits in `seq_length`;
4. masks tokens (see `masking.py`) and pads to `seq_length`.

Returned arrays (all int64): `tokens` (L,), `token_types` (L,) 0 for [CLS] A [SEP], 1 for B [SEP],
`labels` (L,) original ids at predicted positions and -100 elsewhere, `padding_mask` (L,) 1 real 0
pad, `is_random` () the SOP/NSP label.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardlm.data.builders import build_split_datasets
from shardlm.data.index_cache import cached_arrays, file_signature
from shardlm.data.indexed import IndexedDataset, idx_path
from shardlm.data.masking import IGNORE_LABEL, MaskingConfig, continuation_flags, mask_tokens
from shardlm.data.splits import SPLIT_NAMES
from shardlm.errors import UserError

INDEX_VERSION = 1


def build_samples_mapping(
    sentence_lengths: np.ndarray, document_index: np.ndarray, document_range: tuple[int, int],
    max_tokens: int, short_seq_prob: float, rng: np.random.Generator,
) -> np.ndarray:
    """(M, 4) int64 rows (document, first sentence, end sentence (exclusive), target length).

    Sentence numbers are global sequence indices of the `.idx` file. Only chunks of two or more
    sentences are kept (a pair needs a sentence on each side).
    """
    rows: list[tuple[int, int, int, int]] = []
    for document in range(*document_range):
        first, end = int(document_index[document]), int(document_index[document + 1])
        if end - first < 2:
            continue
        target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
        chunk_start, chunk_tokens = first, 0
        for sentence in range(first, end):
            chunk_tokens += int(sentence_lengths[sentence])
            if chunk_tokens >= target or sentence == end - 1:
                if sentence + 1 - chunk_start >= 2:
                    rows.append((document, chunk_start, sentence + 1, target))
                chunk_start, chunk_tokens = sentence + 1, 0
                target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: np.random.Generator) -> None:
    """Trim the longer of `a`, `b` (in place), from its front or back at random, until they fit."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) >= len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


class BertDataset:
    """Masked-LM + SOP (or NSP) samples of fixed length `seq_length` (see the module docstring).

    `tokenizer` supplies `cls`, `sep`, `mask`, `pad`, `vocab_size` and `id_to_token` (for
    whole-word masking). `num_samples <= 0` means one pass over the samples mapping.
    """

    def __init__(
        self, source: IndexedDataset, document_range: tuple[int, int], seq_length: int, seed: int,
        num_samples: int, tokenizer, split_id: int = 0, cache_dir: Path | None = None,
        masking: MaskingConfig | None = None, short_seq_prob: float = 0.1,
        next_sentence_prediction: bool = False, continuation: np.ndarray | None = None,
    ) -> None:
        if None in (tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad):
            raise UserError("the BERT dataset needs a tokenizer with [CLS] [SEP] [MASK] [PAD]; use --tokenizer bert")
        if seq_length < 8:
            raise UserError(f"seq_length={seq_length} is too short for BERT sentence pairs; use at least 8")
        self.source, self.seq_length, self.seed = source, seq_length, seed
        self.document_range = document_range
        self.masking = masking or MaskingConfig()
        self.next_sentence_prediction = next_sentence_prediction
        self.special = (tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad)
        self.vocab_size = tokenizer.vocab_size
        self.continuation = continuation if continuation is not None else continuation_flags(tokenizer)
        max_tokens = seq_length - 3
        rng = np.random.default_rng(np.random.SeedSequence([seed, split_id, 1]))

        def build() -> dict[str, np.ndarray]:
            mapping = build_samples_mapping(source.sequence_lengths, source.document_index, document_range,
                                            max_tokens, short_seq_prob, rng)
            if len(mapping) == 0:
                raise UserError(f"{source.prefix} documents {document_range[0]}..{document_range[1]} have no "
                                "document with 2+ sentences; preprocess with --split-sentences")
            count = num_samples if num_samples > 0 else len(mapping)
            epochs = -(-count // len(mapping))
            order = np.concatenate([rng.permutation(len(mapping)) for _ in range(epochs)])[:count]
            return {"samples_mapping": mapping, "sample_order": order.astype(np.int64)}

        description = {
            "kind": "bert", "version": INDEX_VERSION, "data": file_signature(idx_path(source.prefix)),
            "document_range": list(document_range), "seq_length": seq_length, "seed": seed,
            "split_id": split_id, "num_samples": num_samples, "short_seq_prob": short_seq_prob,
        }
        indices = (build() if cache_dir is None else cached_arrays(
            Path(cache_dir), f"{Path(source.prefix).name}_bert_{SPLIT_NAMES[split_id]}", description,
            ("samples_mapping", "sample_order"), build))
        self.samples_mapping = indices["samples_mapping"]
        self.sample_order = indices["sample_order"]

    def __len__(self) -> int:
        return len(self.sample_order)

    def _sentences(self, first: int, end: int) -> list[list[int]]:
        return [self.source[s].tolist() for s in range(first, end)]

    def _random_segment(self, document: int, length: int, rng: np.random.Generator) -> list[int]:
        """Tokens of consecutive sentences of a random other document of the split (for NSP)."""
        start, end = self.document_range
        other = document
        for _ in range(10):
            other = int(rng.integers(start, end))
            if other != document or end - start == 1:
                break
        first, last = int(self.source.document_index[other]), int(self.source.document_index[other + 1])
        tokens: list[int] = []
        for sentence in range(int(rng.integers(first, max(first + 1, last))), last):
            tokens += self.source[sentence].tolist()
            if len(tokens) >= length:
                break
        return tokens or [self.special[3]]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        document, first, end, target = (int(v) for v in self.samples_mapping[int(self.sample_order[i])])
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, i, 2]))
        sentences = self._sentences(first, end)
        split_at = int(rng.integers(1, len(sentences)))
        a = [t for s in sentences[:split_at] for t in s]
        b = [t for s in sentences[split_at:] for t in s]
        is_random = bool(rng.random() < 0.5)
        if is_random and self.next_sentence_prediction:
            b = self._random_segment(document, max(1, target - len(a)), rng)
        elif is_random:
            a, b = b, a
        truncate_pair(a, b, self.seq_length - 3, rng)
        return self._assemble(a, b, int(is_random), rng)

    def _assemble(self, a: list[int], b: list[int], is_random: int, rng: np.random.Generator) -> dict:
        cls, sep, mask, pad = self.special
        tokens = np.asarray([cls, *a, sep, *b, sep], dtype=np.int64)
        token_types = np.asarray([0] * (len(a) + 2) + [1] * (len(b) + 1), dtype=np.int64)
        maskable = np.ones(len(tokens), dtype=bool)
        maskable[[0, len(a) + 1, len(tokens) - 1]] = False
        tokens, labels = mask_tokens(tokens, maskable, self.masking, mask, self.vocab_size, rng,
                                     self.continuation)
        padding = self.seq_length - len(tokens)
        return {
            "tokens": np.concatenate([tokens, np.full(padding, pad, dtype=np.int64)]),
            "token_types": np.concatenate([token_types, np.zeros(padding, dtype=np.int64)]),
            "labels": np.concatenate([labels, np.full(padding, IGNORE_LABEL, dtype=np.int64)]),
            "padding_mask": np.concatenate([np.ones(len(tokens), dtype=np.int64), np.zeros(padding, dtype=np.int64)]),
            "is_random": np.asarray(is_random, dtype=np.int64),
        }


def build_bert_datasets(
    data_prefixes: list | str,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer,
    cache_dir: str | Path | None = None,
    masking: MaskingConfig | None = None,
    short_seq_prob: float = 0.1,
    next_sentence_prediction: bool = False,
) -> tuple[BertDataset | None, ...]:
    """(train, valid, test) BERT datasets, split and blended exactly as `build_gpt_datasets`.

    `data_prefixes` must have been preprocessed with `--split-sentences` and a BERT tokenizer;
    `tokenizer` is that tokenizer (`build_tokenizer("bert", vocab.txt)`).
    """
    continuation = continuation_flags(tokenizer)

    def make(source, document_range, split_id, count, directory) -> BertDataset:
        return BertDataset(source, document_range, seq_length, seed, count, tokenizer, split_id, directory,
                           masking, short_seq_prob, next_sentence_prediction, continuation)

    return build_split_datasets(data_prefixes, split, num_samples, cache_dir, make)
