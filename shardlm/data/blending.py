"""Blending several datasets in exact proportion to weights (Megatron-LM's greedy blending index).

Sample i of the blend comes from the dataset whose count lags its target the most:
`argmax_d(weight_d * (i + 1) - count_d)`, ties to the lowest index. After any prefix of n samples
every dataset has supplied within one sample of `weight_d * n`.

The index is built by a plain Python loop (about 1 microsecond per sample with a few datasets:
the paper's 300k iterations x 512 samples take a few minutes) and cached by `BlendedDataset`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shardlm.data.index_cache import cached_arrays


def build_blending_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index (N,) int16, dataset_sample_index (N,) int64) for normalised `weights`.

    dataset_sample_index[i] counts how many samples dataset_index[i] had supplied before i, so each
    dataset is read in its own order 0, 1, 2, ...
    """
    weights = [float(w) for w in weights]
    dataset_index = np.empty(num_samples, dtype=np.int16)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    counts = [0] * len(weights)
    choices = range(len(weights))
    for i in range(num_samples):
        target = i + 1
        chosen = max(choices, key=lambda d: (weights[d] * target - counts[d], -d))
        dataset_index[i] = chosen
        dataset_sample_index[i] = counts[chosen]
        counts[chosen] += 1
    return dataset_index, dataset_sample_index


def samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """How many samples each dataset supplies to a blend of `num_samples` (from the greedy index)."""
    dataset_index, _ = build_blending_index(weights, num_samples)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


class BlendedDataset:
    """Item i = item `dataset_sample_index[i]` of dataset `dataset_index[i]` (see the module docstring)."""

    def __init__(
        self, datasets: Sequence, weights: Sequence[float], num_samples: int, cache_dir: Path | None = None,
        name: str = "blend",
    ) -> None:
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.num_samples = int(num_samples)
        build = lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                                 build_blending_index(self.weights, self.num_samples)))
        if cache_dir is None:
            indices = build()
        else:
            description = {"kind": "blend", "weights": self.weights, "num_samples": self.num_samples}
            indices = cached_arrays(Path(cache_dir), name, description,
                                    ("dataset_index", "dataset_sample_index"), build)
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]
        for d, dataset in enumerate(self.datasets):
            needed = int(np.count_nonzero(self.dataset_index == d))
            if len(dataset) < needed:
                raise ValueError(f"dataset {d} has {len(dataset)} samples, the blend needs {needed}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
