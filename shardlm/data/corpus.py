"""Corpus cleaning as in the paper: drop short documents, remove near-duplicates (MinHash LSH).

Both read `.jsonl` / `.txt` (and `.gz`) through `documents.iter_documents` and write `.jsonl`
(the input record unchanged for `.jsonl`, `{"text": ...}` for `.txt`) atomically: a temporary file
renamed when complete. The n-gram overlap report is in `overlap.py`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.data.documents import Document, iter_documents

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lower-cased word tokens (runs of letters/digits/underscore), the unit of shingles and n-grams."""
    return WORD.findall(text.lower())


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


class AtomicJsonlWriter:
    """Writes records as JSON lines to `path.tmp-<pid>`, renamed to `path` on a clean exit."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.temporary = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        opener = gzip.open if self.path.name.endswith(".gz") else open
        self.stream = opener(self.temporary, "wt", encoding="utf-8")
        self.count = 0

    def write(self, document: Document) -> None:
        record = document.record if document.record is not None else {"text": document.text}
        self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1

    def __enter__(self) -> AtomicJsonlWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.stream.close()
        if exc_type is None:
            os.replace(self.temporary, self.path)
        else:
            self.temporary.unlink(missing_ok=True)


@dataclass
class CleaningResult:
    """Documents read, kept and removed; for dedup, the (removed, kept) document numbers (0-based)."""

    read: int = 0
    kept: int = 0
    removed: int = 0
    duplicate_of: list[tuple[int, int]] = field(default_factory=list)


def progress_iter(iterable: Iterator, description: str, enabled: bool) -> Iterator:
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=description, unit=" docs", dynamic_ncols=True)


def filter_short_documents(
    input_path: str | Path, output_path: str | Path, min_tokens: int = 128,
    count_tokens: Callable[[str], int] | None = None, json_key: str = "text", txt_mode: str = "paragraph",
    progress: bool = True,
) -> CleaningResult:
    """Keep documents with at least `min_tokens` tokens; `count_tokens` defaults to whitespace words."""
    count_tokens = count_tokens or (lambda text: len(text.split()))
    result = CleaningResult()
    documents = iter_documents(input_path, json_key=json_key, txt_mode=txt_mode)
    with AtomicJsonlWriter(output_path) as writer:
        for document in progress_iter(documents, "filter", progress):
            result.read += 1
            if count_tokens(document.text) >= min_tokens:
                writer.write(document)
                result.kept += 1
            else:
                result.removed += 1
    return result


def shingles(text: str, size: int) -> set[bytes]:
    """Word `size`-grams of the lower-cased text (the whole text when shorter), as bytes."""
    tokens = words(text)
    if len(tokens) <= size:
        return {" ".join(tokens).encode("utf-8")}
    return {" ".join(tokens[i:i + size]).encode("utf-8") for i in range(len(tokens) - size + 1)}


def deduplicate(
    input_path: str | Path, output_path: str | Path, threshold: float = 0.7, num_perm: int = 128,
    shingle_size: int = 5, seed: int = 1, json_key: str = "text", txt_mode: str = "paragraph",
    progress: bool = True,
) -> CleaningResult:
    """Drop each document whose word-shingle Jaccard similarity with an earlier kept one exceeds `threshold`.

    MinHash signatures (`num_perm` permutations) go into an LSH index tuned for `threshold`; an LSH
    candidate counts as a duplicate only if the MinHash estimate of the Jaccard similarity is above
    `threshold`. The first document of each group of near-duplicates is kept.
    """
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    signatures: dict[int, MinHash] = {}
    result = CleaningResult()
    documents = iter_documents(input_path, json_key=json_key, txt_mode=txt_mode)
    with AtomicJsonlWriter(output_path) as writer:
        for number, document in enumerate(progress_iter(documents, "dedup", progress)):
            result.read += 1
            signature = MinHash(num_perm=num_perm, seed=seed)
            signature.update_batch(list(shingles(document.text, shingle_size)))
            matches = [k for k in lsh.query(signature) if signature.jaccard(signatures[k]) > threshold]
            if matches:
                result.removed += 1
                result.duplicate_of.append((number, min(matches)))
                continue
            lsh.insert(number, signature)
            signatures[number] = signature
            writer.write(document)
            result.kept += 1
    return result
