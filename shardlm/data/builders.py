"""Building (train, valid, test) datasets from preprocessed files: split by documents, blend across files.

Shared by `build_gpt_datasets` and `build_bert_datasets`, which differ only in how one dataset is
made from one file's document range.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from shardlm.data.blending import BlendedDataset, samples_per_dataset
from shardlm.data.indexed import IndexedDataset
from shardlm.data.splits import SPLIT_NAMES, parse_data_prefixes, parse_split, split_document_ranges
from shardlm.errors import UserError

# make(source, document_range, split_id, num_samples, cache_dir) -> dataset
MakeDataset = Callable[[IndexedDataset, tuple[int, int], int, int, Path], object]


def build_split_datasets(
    data_prefixes: Sequence | str, split: str, num_samples: Sequence[int], cache_dir: str | Path | None,
    make: MakeDataset,
) -> tuple:
    """(train, valid, test): each file's documents cut by `split`, several files blended by weight.

    A split of weight 0 is None. With one file a split is `make(...)` of its document range; with
    several it is a `BlendedDataset` whose parts hold exactly the samples the blend draws from them.
    A file whose share of a split rounds to 0 documents is left out of that split (with a warning);
    a valid/test split left with no file is None, an empty train split is a `UserError`.
    `num_samples[k] <= 0` means one epoch (of every file, for a blend). The cache directory defaults
    to `index-cache/` beside each data file.
    """
    pairs = parse_data_prefixes(data_prefixes)
    weights = parse_split(split)
    if len(num_samples) != 3:
        raise UserError(f"num_samples={num_samples} must give (train, valid, test) sample counts")
    sources = [(weight, IndexedDataset(prefix)) for weight, prefix in pairs]
    datasets: list = []
    for split_id, split_name in enumerate(SPLIT_NAMES):
        if weights[split_id] == 0:
            datasets.append(None)
            continue
        parts = []  # (blend weight, source, document range, cache directory)
        for weight, source in sources:
            document_range = split_document_ranges(source.num_documents, weights)[split_id]
            if document_range[1] > document_range[0]:
                directory = Path(cache_dir) if cache_dir is not None else Path(source.prefix).parent / "index-cache"
                parts.append((weight, source, document_range, directory))
                continue
            message = (f"the {split_name} split of {source.prefix} gets 0 of {source.num_documents} documents "
                       f"with data.split={split!r}")
            if split_id == 0:
                raise UserError(f"{message}; use more documents or change data.split")
            warnings.warn(f"{message}; it is left out of the {split_name} data", stacklevel=2)
        datasets.append(_split_dataset(parts, split_id, int(num_samples[split_id]), cache_dir, make) if parts
                        else None)
    return tuple(datasets)


def _split_dataset(parts: list, split_id: int, requested: int, cache_dir: str | Path | None, make: MakeDataset):
    """One split: the dataset of a single file, or the blend of several."""
    if len(parts) == 1:
        _, source, document_range, directory = parts[0]
        return make(source, document_range, split_id, requested, directory)
    total = sum(weight for weight, *_ in parts)
    blend_weights = [weight / total for weight, *_ in parts]
    if requested <= 0:  # one epoch of every file
        requested = sum(len(make(s, r, split_id, 0, d)) for _, s, r, d in parts)
    counts = samples_per_dataset(blend_weights, requested)
    datasets = [make(s, r, split_id, max(count, 1), d) for (_, s, r, d), count in zip(parts, counts)]
    blend_cache = Path(cache_dir) if cache_dir is not None else parts[0][3]
    return BlendedDataset(datasets, blend_weights, requested, blend_cache, name=f"blend_{SPLIT_NAMES[split_id]}")
