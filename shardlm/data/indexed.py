"""Megatron-LM's indexed dataset format: `PREFIX.bin` (tokens) + `PREFIX.idx` (index), on `np.memmap`.

The layout is documented byte by byte in `docs/indexed_format.md`. In short, the `.idx` file is

    9 bytes  magic b"MMIDIDX\\x00\\x00"
    8 bytes  version, little-endian uint64 = 1
    1 byte   dtype code of the tokens in .bin (4 = int32, 8 = uint16, ...)
    8 bytes  sequence count S (uint64)
    8 bytes  document count D + 1 (uint64; the document index starts with a 0)
    S x int32  sequence lengths in tokens
    S x int64  byte offset of each sequence in .bin
    (D + 1) x int64  document index: sequences [doc[k], doc[k+1]) form document k

A "sequence" is one sentence when preprocessed with `--split-sentences`, else a whole document.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from shardlm.errors import UserError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
# Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType).
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's rule: vocabulary < 65,500), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class IndexedDatasetWriter:
    """Streams documents into `PREFIX.bin` / `PREFIX.idx`, atomically.

    Tokens go to `PREFIX.bin.tmp-<pid>` as they come; `finalize()` writes the index to a temporary
    name, removes any old `PREFIX.idx`, then renames `.bin` and finally `.idx` into place, so an
    interrupted run never leaves an `.idx` (which readers require) beside a partial or newer `.bin`.
    Use as a context manager: an exception removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = Path(f"{bin_path(prefix)}{suffix}")
        self._idx_tmp = Path(f"{idx_path(prefix)}{suffix}")
        self._bin_file = open(self._bin_tmp, "wb")  # closed in finalize() or abort()
        self.sequence_lengths: list[int] = []
        self.document_index: list[int] = [0]
        self.num_tokens = 0

    def add_document(self, sequences: list[list[int]] | list[np.ndarray]) -> None:
        """Append one document made of `sequences` (sentences, or one sequence for the whole text)."""
        for sequence in sequences:
            array = np.asarray(sequence, dtype=self.dtype)
            self._bin_file.write(array.tobytes(order="C"))
            self.sequence_lengths.append(int(array.size))
            self.num_tokens += int(array.size)
        self.document_index.append(len(self.sequence_lengths))

    @property
    def num_documents(self) -> int:
        return len(self.document_index) - 1

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        self._bin_file.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        with open(self._idx_tmp, "wb") as index_file:
            index_file.write(INDEX_MAGIC)
            index_file.write(struct.pack("<Q", INDEX_VERSION))
            index_file.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            index_file.write(struct.pack("<Q", len(lengths)))
            index_file.write(struct.pack("<Q", len(self.document_index)))
            index_file.write(lengths.astype("<i4").tobytes())
            index_file.write(pointers.astype("<i8").tobytes())
            index_file.write(np.asarray(self.document_index, dtype="<i8").tobytes())
        # An old .idx goes first: at no moment does a new .bin sit beside an old, complete-looking .idx.
        idx_path(self.prefix).unlink(missing_ok=True)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Close and remove the temporary files (nothing with the final names is created)."""
        self._bin_file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of `PREFIX.bin` / `PREFIX.idx` through `np.memmap`; checks the files up front.

    `sequence_lengths` (S,) int32, `sequence_pointers` (S,) int64 byte offsets, `document_index`
    (D + 1,) int64. `dataset[i]` is sequence i as a 1-D array of the file's token dtype;
    `document(k)` is all tokens of document k (its sequences are contiguous in `.bin`).
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        index_file, data_file = idx_path(prefix), bin_path(prefix)
        for path in (index_file, data_file):
            if not path.is_file():
                raise UserError(f"indexed dataset file not found: {path}; run `shardlm preprocess` "
                                "to create PREFIX.bin and PREFIX.idx")
        self.dtype, sequence_count, document_count = _read_header(index_file)
        expected = HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8
        actual = index_file.stat().st_size
        if actual < expected:
            raise UserError(f"{index_file} is truncated ({actual} bytes, the header promises {expected}); "
                            "run `shardlm preprocess` again")
        index = np.memmap(index_file, dtype=np.uint8, mode="r")
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(index, dtype="<i4", count=sequence_count, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, dtype="<i8", count=sequence_count, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_index = np.frombuffer(index, dtype="<i8", count=document_count, offset=offset)
        self._check_consistency(index_file, data_file)
        size = data_file.stat().st_size
        self.tokens = (np.memmap(data_file, dtype=self.dtype, mode="r") if size
                       else np.zeros(0, dtype=self.dtype))

    def _check_consistency(self, index_file: Path, data_file: Path) -> None:
        itemsize = self.dtype.itemsize
        if len(self.document_index) == 0 or self.document_index[0] != 0 \
                or self.document_index[-1] != len(self.sequence_lengths) \
                or np.any(np.diff(self.document_index) < 0):
            raise UserError(f"{index_file} has an invalid document index; run `shardlm preprocess` again")
        if len(self.sequence_lengths) and (np.any(self.sequence_lengths < 0) or np.any(
                self.sequence_pointers != _pointers_of(self.sequence_lengths, itemsize))):
            raise UserError(f"{index_file} has inconsistent sequence pointers; run `shardlm preprocess` again")
        needed = int(self.sequence_lengths.sum(dtype=np.int64)) * itemsize
        actual = data_file.stat().st_size
        if actual < needed:
            raise UserError(f"{data_file} is shorter than its index says ({actual} bytes, expected {needed}); "
                            "run `shardlm preprocess` again")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_index) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    def document_lengths(self) -> np.ndarray:
        """Tokens per document, (D,) int64."""
        per_sequence = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return per_sequence[self.document_index[1:]] - per_sequence[self.document_index[:-1]]

    def document_starts(self) -> np.ndarray:
        """Token offset of each document's first token in `.bin`, (D,) int64."""
        per_sequence = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return per_sequence[self.document_index[:-1]]

    def document(self, k: int) -> np.ndarray:
        """All tokens of document k, (length,) in the file's token dtype."""
        first, last = int(self.document_index[k]), int(self.document_index[k + 1])
        if first == last:
            return self.tokens[0:0]
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        stop = int(self.sequence_pointers[last - 1]) // self.dtype.itemsize + int(self.sequence_lengths[last - 1])
        return self.tokens[start:stop]

    def document_sentences(self, k: int) -> list[np.ndarray]:
        """The sequences (sentences) of document k."""
        return [self[i] for i in range(int(self.document_index[k]), int(self.document_index[k + 1]))]


def _pointers_of(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    pointers = np.zeros(len(lengths), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * itemsize
    return pointers


def _read_header(index_file: Path) -> tuple[np.dtype, int, int]:
    with open(index_file, "rb") as stream:
        header = stream.read(HEADER_SIZE)
    if len(header) < len(INDEX_MAGIC) or header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise UserError(f"{index_file} is not a Megatron indexed dataset index (wrong magic bytes); "
                        "pass the PREFIX written by `shardlm preprocess`")
    if len(header) < HEADER_SIZE:
        raise UserError(f"{index_file} is truncated inside its header; run `shardlm preprocess` again")
    version, code, sequence_count, document_count = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
    if version != INDEX_VERSION:
        raise UserError(f"{index_file} has index version {version}, only version 1 is supported; "
                        "run `shardlm preprocess` again")
    if code not in DTYPE_CODES:
        raise UserError(f"{index_file} has unknown token dtype code {code}; run `shardlm preprocess` again")
    return np.dtype(DTYPE_CODES[code]), sequence_count, document_count
