"""The `.bin/.idx` files follow Megatron-LM's published layout, checked by an independent codec here."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from shardlm.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype_for_vocab
from shardlm.errors import UserError

from multiproc import needs

# Megatron's dtype codes, restated independently of shardlm.
CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
DTYPES = {8: np.dtype("<u2"), 4: np.dtype("<i4")}

DOCUMENTS = [  # document -> sentences -> token ids
    [[5, 6, 7], [8]],
    [[9, 10, 11, 12, 13]],
    [[1], [2, 3], [4, 4, 4]],
]


def write_by_hand(prefix, documents, dtype) -> None:
    """An independent writer of the published layout, field by field with struct.pack."""
    dtype = np.dtype(dtype)
    sentences = [s for doc in documents for s in doc]
    lengths = [len(s) for s in sentences]
    pointers, position = [], 0
    for length in lengths:
        pointers.append(position)
        position += length * dtype.itemsize
    document_index = [0]
    for doc in documents:
        document_index.append(document_index[-1] + len(doc))
    with open(f"{prefix}.bin", "wb") as f:
        for s in sentences:
            f.write(struct.pack(f"<{len(s)}{'H' if dtype.itemsize == 2 else 'i'}", *s))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_index)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(document_index)}q", *document_index))


def parse_by_hand(prefix) -> dict:
    """An independent parser of the published layout."""
    with open(f"{prefix}.idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = struct.unpack_from("<QBQQ", raw, 9)
    offset = 34
    lengths = struct.unpack_from(f"<{sequences}i", raw, offset)
    offset += 4 * sequences
    pointers = struct.unpack_from(f"<{sequences}q", raw, offset)
    offset += 8 * sequences
    document_index = struct.unpack_from(f"<{documents}q", raw, offset)
    offset += 8 * documents
    assert offset == len(raw), "no bytes after the document index"
    data = open(f"{prefix}.bin", "rb").read()
    dtype = DTYPES[code]
    sentences = [np.frombuffer(data, dtype=dtype, count=n, offset=p).tolist() for n, p in zip(lengths, pointers)]
    docs = [sentences[document_index[k]:document_index[k + 1]] for k in range(documents - 1)]
    return {"version": version, "code": code, "documents": docs, "document_index": list(document_index)}


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reader_reads_a_file_written_to_the_published_layout(tmp_path, dtype):
    write_by_hand(tmp_path / "hand", DOCUMENTS, dtype)
    dataset = IndexedDataset(tmp_path / "hand")
    assert dataset.dtype == np.dtype(dtype)
    assert len(dataset) == 6 and dataset.num_documents == 3
    assert [dataset[i].tolist() for i in range(len(dataset))] == [s for d in DOCUMENTS for s in d]
    for k, doc in enumerate(DOCUMENTS):
        assert dataset.document(k).tolist() == [t for s in doc for t in s]
        assert [s.tolist() for s in dataset.document_sentences(k)] == doc
    assert dataset.document_lengths().tolist() == [4, 5, 6]


@pytest.mark.parametrize("vocab_size, code", [(50257, 8), (30522, 8), (100_000, 4)])
def test_writer_output_parses_with_the_independent_parser(tmp_path, vocab_size, code):
    with IndexedDatasetWriter(tmp_path / "ours", token_dtype_for_vocab(vocab_size)) as writer:
        for doc in DOCUMENTS:
            writer.add_document(doc)
    parsed = parse_by_hand(tmp_path / "ours")
    assert parsed["version"] == 1 and parsed["code"] == code
    assert parsed["documents"] == DOCUMENTS
    assert parsed["document_index"] == [0, 2, 3, 6]
    write_by_hand(tmp_path / "hand", DOCUMENTS, token_dtype_for_vocab(vocab_size))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "hand.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "hand.bin").read_bytes()


def test_writer_leaves_nothing_when_interrupted(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "out", np.uint16) as writer:
            writer.add_document([[1, 2, 3]])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def _single_line_user_error(prefix, match: str) -> None:
    with pytest.raises(UserError, match=match) as info:
        IndexedDataset(prefix)
    assert "\n" not in str(info.value)


def test_bad_files_give_one_line_user_errors(tmp_path):
    """Each invariant the reader checks, broken in turn (a missing file, the magic, the version, the dtype
    code, a truncated header or body, the sequence pointers, the document index, a short .bin): a one-line
    UserError that names it."""
    write_by_hand(tmp_path / "good", DOCUMENTS, np.uint16)
    idx = (tmp_path / "good.idx").read_bytes()
    bin_ = (tmp_path / "good.bin").read_bytes()

    _single_line_user_error(tmp_path / "absent", "not found")

    (tmp_path / "magic.idx").write_bytes(b"NOTMAGIC!" + idx[9:])
    (tmp_path / "magic.bin").write_bytes(bin_)
    _single_line_user_error(tmp_path / "magic", "magic")

    for cut, name in ((20, "cut_header"), (len(idx) - 5, "cut_body")):
        (tmp_path / f"{name}.idx").write_bytes(idx[:cut])
        (tmp_path / f"{name}.bin").write_bytes(bin_)
        _single_line_user_error(tmp_path / name, "truncated")

    (tmp_path / "short.idx").write_bytes(idx)
    (tmp_path / "short.bin").write_bytes(bin_[:-2])
    _single_line_user_error(tmp_path / "short", "shorter than its index")

    (tmp_path / "version.idx").write_bytes(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    (tmp_path / "version.bin").write_bytes(bin_)
    _single_line_user_error(tmp_path / "version", "version 2")

    # the arrays: S = 6 lengths (int32) from byte 34, 6 pointers (int64) from 58, D + 1 = 4 document ends from 106
    pointers, documents = 34 + 4 * 6, 34 + 12 * 6
    assert struct.unpack_from("<6q", idx, pointers) == (0, 6, 8, 18, 20, 24)
    assert struct.unpack_from("<4q", idx, documents) == (0, 2, 3, 6)
    for name, offset, fmt, value, match in [
        ("dtype", 17, "<B", 99, "unknown token dtype code 99"),
        ("first_pointer", pointers, "<q", 2, "inconsistent sequence pointers"),  # pointer[0] = 0
        ("gap", pointers + 8 * 3, "<q", 20, "inconsistent sequence pointers"),  # pointer[3] = pointer[2] + 5 x 2
        ("documents_start", documents, "<q", 1, "invalid document index"),
        ("documents_decrease", documents + 8, "<q", 4, "invalid document index"),  # 0, 4, 3, 6
        ("documents_end", documents + 8 * 3, "<q", 5, "invalid document index"),  # ends at 5, not S = 6
    ]:
        bad = bytearray(idx)
        struct.pack_into(fmt, bad, offset, value)
        (tmp_path / f"{name}.idx").write_bytes(bytes(bad))
        (tmp_path / f"{name}.bin").write_bytes(bin_)
        _single_line_user_error(tmp_path / name, match)


def megatron_core_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@needs(megatron_core_installed(), "megatron-core (`make install` installs it)")
def test_interoperates_with_megatron_core(tmp_path):
    """With megatron-core (a test-only install, without its dependencies), each side reads the other's files."""
    import torch
    from megatron.core.datasets import indexed_dataset as megatron
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as writer:
        for doc in DOCUMENTS:
            writer.add_document(doc)
    theirs = megatron.IndexedDataset(str(tmp_path / "ours"))
    assert [theirs[i].tolist() for i in range(len(theirs))] == [s for d in DOCUMENTS for s in d]
    assert theirs.document_indices.tolist() == [0, 2, 3, 6]
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32)
    for doc in DOCUMENTS:
        builder.add_document(torch.tensor([t for s in doc for t in s]), [len(s) for s in doc])
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(tmp_path / "theirs")
    assert [[s.tolist() for s in ours.document_sentences(k)] for k in range(3)] == DOCUMENTS
