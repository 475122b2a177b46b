"""GPT pretraining samples: fixed-length windows over a shuffled stream of documents.

Three numpy indices, as in Megatron-LM, describe a dataset of `num_samples` samples of
`seq_length + 1` tokens (inputs are `sample[:-1]`, targets `sample[1:]`):

- document order `(epochs * D,)`: the split's documents, a fresh permutation per epoch, concatenated.
  This is the token stream; samples cross document boundaries.
- sample index `(num_samples + 1, 2)`: row s = (position in the document order, token offset) where
  sample s starts, at stream position `s * seq_length`. Sample s runs from row s to row s + 1
  inclusive, so consecutive samples share one token and the inputs of samples tile the stream:
  every token of every complete epoch is an input exactly once.
- shuffle index `(num_samples,)`: a permutation; item i is sample `shuffle[i]`.

Item i is computed directly from the three indices, so a trainer resumes at any sample. Indices
are cached (see `index_cache`) under a hash of the data file, document range, sequence length,
seed and sample count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from shardlm.data.blending import BlendedDataset
from shardlm.data.builders import build_split_datasets
from shardlm.data.index_cache import cached_arrays, file_signature
from shardlm.data.indexed import IndexedDataset, idx_path
from shardlm.data.splits import SPLIT_NAMES
from shardlm.errors import UserError

INDEX_VERSION = 1  # bump when the index construction changes, to invalidate caches


class DocumentSource(Protocol):
    """Anything with documents of tokens: an `IndexedDataset`, or `ArrayDocuments` in memory."""

    def document_lengths(self) -> np.ndarray: ...

    def document(self, k: int) -> np.ndarray: ...


class ArrayDocuments:
    """An in-memory 1-D token array as documents (one document unless `boundaries` are given).

    `boundaries` are the token offsets where documents 1..D-1 start (sorted, exclusive of 0 and len).
    """

    def __init__(self, tokens: np.ndarray, boundaries: np.ndarray | list[int] | None = None) -> None:
        self.tokens = np.asarray(tokens)
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        inner = np.asarray(boundaries if boundaries is not None else [], dtype=np.int64)
        self.starts = np.concatenate([[0], inner]).astype(np.int64)
        self.ends = np.concatenate([inner, [len(self.tokens)]]).astype(np.int64)

    def document_lengths(self) -> np.ndarray:
        return self.ends - self.starts

    def document(self, k: int) -> np.ndarray:
        return self.tokens[self.starts[k]:self.ends[k]]


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose stream holds `num_samples` windows: `num_samples * seq_length + 1` tokens."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def samples_in_one_epoch(tokens_per_epoch: int, seq_length: int) -> int:
    return max(0, (tokens_per_epoch - 1) // seq_length)


def build_gpt_indices(
    document_lengths: np.ndarray, document_ids: np.ndarray, seq_length: int, num_samples: int,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """The document order, sample index and shuffle index (see the module docstring).

    `document_lengths` (D_all,) tokens of every document in the file; `document_ids` (D,) the
    documents of this split.
    """
    tokens_per_epoch = int(document_lengths[document_ids].sum())
    num_epochs = epochs_needed(tokens_per_epoch, seq_length, num_samples)
    document_order = np.concatenate([rng.permutation(document_ids) for _ in range(num_epochs)]).astype(np.int64)
    stream_ends = np.cumsum(document_lengths[document_order], dtype=np.int64)
    stream_starts = stream_ends - document_lengths[document_order]
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: the document holding position p has start <= p < end.
    order_position = np.searchsorted(stream_ends, positions, side="right")
    sample_index = np.stack([order_position, positions - stream_starts[order_position]], axis=1)
    shuffle_index = rng.permutation(num_samples).astype(np.int64)
    return {"document_order": document_order, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset:
    """`num_samples` windows of `seq_length + 1` tokens (int64) over documents of a source.

    `document_range` = [start, end) of the documents in this split. `num_samples <= 0` means one
    epoch's worth. Deterministic for (`seed`, `split_id`). With `cache_dir` (and a file-backed
    source) the indices are cached there.
    """

    def __init__(
        self, source: DocumentSource, document_range: tuple[int, int], seq_length: int, seed: int,
        num_samples: int, split_id: int = 0, cache_dir: Path | None = None, name: str = "gpt",
    ) -> None:
        if seq_length < 1:
            raise UserError(f"seq_length={seq_length} must be at least 1")
        self.source = source
        self.seq_length = seq_length
        lengths = np.asarray(source.document_lengths(), dtype=np.int64)
        document_ids = np.arange(*document_range, dtype=np.int64)
        self.num_documents = len(document_ids)
        tokens_per_epoch = int(lengths[document_ids].sum())
        if tokens_per_epoch < 2:
            raise UserError(f"{name}: documents {document_range[0]}..{document_range[1]} hold {tokens_per_epoch} "
                            "tokens, too few for one sample; use more data or change data.split")
        if num_samples <= 0:
            num_samples = max(1, samples_in_one_epoch(tokens_per_epoch, seq_length))
        self.num_samples = int(num_samples)
        self.tokens_per_epoch = tokens_per_epoch
        rng = np.random.default_rng(np.random.SeedSequence([seed, split_id]))
        build = lambda: build_gpt_indices(lengths, document_ids, seq_length, self.num_samples, rng)
        if cache_dir is None or not isinstance(source, IndexedDataset):
            indices = build()
        else:
            description = {
                "kind": "gpt", "version": INDEX_VERSION, "data": file_signature(idx_path(source.prefix)),
                "document_range": list(document_range), "seq_length": seq_length, "seed": seed,
                "split_id": split_id, "num_samples": self.num_samples,
            }
            indices = cached_arrays(Path(cache_dir), f"{Path(source.prefix).name}_{name}", description,
                                    ("document_order", "sample_index", "shuffle_index"), build)
        self.document_order = indices["document_order"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    @property
    def num_epochs(self) -> int:
        """Passes over the split's documents that the sample stream spans (the last may be partial)."""
        return len(self.document_order) // self.num_documents

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample `shuffle[i]`: (seq_length + 1,) int64 tokens."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        return self.sample(int(self.shuffle_index[i]))

    def sample(self, s: int) -> np.ndarray:
        """Un-shuffled sample s: the stream from row s to row s + 1 of the sample index, inclusive."""
        first, first_offset = (int(v) for v in self.sample_index[s])
        last, last_offset = (int(v) for v in self.sample_index[s + 1])
        if first == last:
            pieces = [self.source.document(int(self.document_order[first]))[first_offset:last_offset + 1]]
        else:
            pieces = [self.source.document(int(self.document_order[first]))[first_offset:]]
            pieces += [self.source.document(int(self.document_order[k])) for k in range(first + 1, last)]
            pieces.append(self.source.document(int(self.document_order[last]))[:last_offset + 1])
        return np.concatenate(pieces).astype(np.int64)


class TokenArrayDataset(GPTDataset):
    """A `GPTDataset` over an in-memory 1-D token array (e.g. a small text file tokenized at start).

    `boundaries` optionally marks document starts; `num_samples <= 0` means one pass over the array.
    """

    def __init__(
        self, tokens: np.ndarray, seq_length: int, seed: int = 0, num_samples: int = 0,
        boundaries: np.ndarray | list[int] | None = None,
    ) -> None:
        source = ArrayDocuments(tokens, boundaries)
        super().__init__(source, (0, len(source.starts)), seq_length, seed, num_samples, name="tokens")


def build_gpt_datasets(
    data_prefixes: list | str,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | Path | None = None,
) -> tuple[GPTDataset | BlendedDataset | None, ...]:
    """(train, valid, test) GPT datasets from preprocessed `PREFIX.bin/.idx` files.

    `data_prefixes`: `[prefix]` or `[w1, prefix1, w2, prefix2, ...]` (a blend drawn in exact
    proportion to the weights). `split`: document weights like "949,50,1"; each file's documents
    are cut into three contiguous ranges. `num_samples`: samples per split (<= 0: one epoch). A
    split of weight 0 is None. Indices are cached in `cache_dir`, default `index-cache/` beside
    each data file. Items are (seq_length + 1,) int64 arrays.
    """
    def make(source: IndexedDataset, document_range: tuple[int, int], split_id: int, count: int,
             directory: Path) -> GPTDataset:
        return GPTDataset(source, document_range, seq_length, seed, count, split_id, directory,
                          name=f"gpt_{SPLIT_NAMES[split_id]}")

    return build_split_datasets(data_prefixes, split, num_samples, cache_dir, make)
