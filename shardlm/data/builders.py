"""Building (train, valid, test) datasets from preprocessed files: split by documents, blend across files.

Shared by `build_gpt_datasets` and `build_bert_datasets`, which differ only in how one dataset is
made from one file's document range.
"""

from __future__ import annotations

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
    `num_samples[k] <= 0` means one epoch (of every file, for a blend). The cache directory defaults
    to `index-cache/` beside each data file.
    """
    pairs = parse_data_prefixes(data_prefixes)
    weights = parse_split(split)
    if len(num_samples) != 3:
        raise UserError(f"num_samples={num_samples} must give (train, valid, test) sample counts")
    sources = [IndexedDataset(prefix) for _, prefix in pairs]
    blend_weights = [weight for weight, _ in pairs]
    datasets: list = []
    for split_id, split_name in enumerate(SPLIT_NAMES):
        if weights[split_id] == 0:
            datasets.append(None)
            continue
        parts_args = []
        for source in sources:
            document_range = split_document_ranges(source.num_documents, weights)[split_id]
            if document_range[1] <= document_range[0]:
                raise UserError(f"the {split_name} split of {source.prefix} gets 0 of {source.num_documents} "
                                f"documents with data.split={split!r}; use more documents or change data.split")
            directory = Path(cache_dir) if cache_dir is not None else Path(source.prefix).parent / "index-cache"
            parts_args.append((source, document_range, directory))
        requested = int(num_samples[split_id])
        if len(sources) == 1:
            source, document_range, directory = parts_args[0]
            datasets.append(make(source, document_range, split_id, requested, directory))
            continue
        if requested <= 0:  # one epoch of every file
            requested = sum(len(make(s, r, split_id, 0, d)) for s, r, d in parts_args)
        counts = samples_per_dataset(blend_weights, requested)
        parts = [make(s, r, split_id, max(count, 1), d) for (s, r, d), count in zip(parts_args, counts)]
        blend_cache = Path(cache_dir) if cache_dir is not None else parts_args[0][2]
        datasets.append(BlendedDataset(parts, blend_weights, requested, blend_cache, name=f"blend_{split_name}"))
    return tuple(datasets)
