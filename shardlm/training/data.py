"""Training data for the trainer: datasets of fixed-length samples and the batch each rank reads.

A dataset here is anything with `__len__` and `__getitem__(i) -> int64 array of seq_length + 1`
tokens. The trainer reads the global batch of step `k` as samples `[k * G, (k + 1) * G)` of an
endless, per-epoch shuffled order (G = global batch size); DP rank d takes the d-th contiguous
slice of it, cut into micro-batches; TP ranks of one group read the same samples. The position in
the data is therefore a pure function of the step, so a resumed run reads the exact next sample.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardlm.config import DataConfig
from shardlm.errors import UserError
from shardlm.paths import shared_data_dir


def build_tokenizer_for(data: DataConfig):
    """The tokenizer a data config names (GPT-2 files default to the shared vocabulary)."""
    from shardlm.data.tokenizers import build_tokenizer

    vocab, merges = data.vocab_file, data.merges_file
    if data.tokenizer == "gpt2":
        vocab = vocab or str(shared_data_dir() / "vocab" / "gpt2" / "encoder.json")
        merges = merges or str(shared_data_dir() / "vocab" / "gpt2" / "vocab.bpe")
    return build_tokenizer(data.tokenizer, vocab_file=vocab or None, merges_file=merges or None)


class TokenWindows:
    """Non-overlapping windows of `seq_length + 1` tokens over a 1-D token array.

    Window i is tokens[i * seq_length : i * seq_length + seq_length + 1]: consecutive windows share
    one token, so every token is a target exactly once.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int):
        self.tokens, self.seq_length = tokens, seq_length
        if len(tokens) < seq_length + 1:
            raise UserError(f"only {len(tokens)} tokens of data for model.seq_length={seq_length}; "
                            "use more text or a shorter sequence")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_length

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_length
        return self.tokens[start:start + self.seq_length + 1].astype(np.int64)


class EpochShuffled:
    """Endless view of a dataset: index i reads sample perm_e[i mod n] of epoch e = i div n, where
    perm_e is a permutation drawn from (seed, e). Deterministic, so any index is computable."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        self._epoch, self._perm = -1, None

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self.dataset)
        epoch = i // n
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
        return self.dataset[int(self._perm[i % n])]

    def __len__(self) -> int:
        return len(self.dataset)


def text_file_datasets(data: DataConfig, tokenizer, seq_length: int, seed: int):
    """Tokenize a text file in memory and split it into train and valid windows by data.split."""
    text = Path(data.text_file).read_text(encoding="utf-8", errors="replace")
    tokens = np.asarray(tokenizer.encode(text) + [tokenizer.eod], dtype=np.int64)
    weights = [float(w) for w in data.split.split(",")]
    train_fraction = weights[0] / max(1e-12, weights[0] + (weights[1] if len(weights) > 1 else 0.0))
    cut = int(len(tokens) * train_fraction)
    train = EpochShuffled(TokenWindows(tokens[:cut], seq_length), seed)
    valid = TokenWindows(tokens[cut:], seq_length) if len(tokens) - cut > seq_length else None
    return train, valid


def build_datasets(data: DataConfig, tokenizer, seq_length: int, seed: int, train_samples: int,
                   valid_samples: int):
    """(train, valid) datasets for a run; valid may be None when the split leaves no validation data."""
    if data.text_file:
        return text_file_datasets(data, tokenizer, seq_length, seed)
    from shardlm.data.gpt_dataset import build_gpt_datasets

    train, valid, _ = build_gpt_datasets(list(data.prefixes), data.split, seq_length, seed,
                                         (train_samples, valid_samples, 0), cache_dir=data.cache_dir or None)
    return train, valid


def micro_batches(dataset, step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                  device: torch.device) -> list[torch.Tensor]:
    """This DP rank's micro-batches of step `step`, each (micro_batch, seq_length + 1) int64."""
    per_rank = global_batch // dp_size
    first = step * global_batch + dp_rank * per_rank
    samples = np.stack([dataset[first + j] for j in range(per_rank)])
    tensor = torch.from_numpy(samples).to(device)
    return list(tensor.split(micro_batch))
