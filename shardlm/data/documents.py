"""Reading documents from `.jsonl`, `.txt` and their `.gz`, streaming, with line numbers for errors.

Document boundaries:

- `.jsonl`: one JSON object per line; the document is the string under `json_key` (default
  "text"). Blank lines are skipped. A line that is not a JSON object with that string key is an
  error naming its line number, or is skipped and counted with `skip_bad_lines`.
- `.txt`, `txt_mode="paragraph"` (default): documents are separated by one or more blank lines.
- `.txt`, `txt_mode="line"`: every non-blank line is a document.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlm.errors import UserError

TXT_MODES = ("paragraph", "line")


@dataclass
class Document:
    """One input document: its text, the 1-based line where it starts, and the parsed JSON record."""

    text: str
    line_number: int
    record: dict[str, Any] | None = None


@dataclass
class ReadStats:
    """Counters a reader fills in while it streams."""

    bad_lines: int = 0
    bytes_read: int = 0
    bad_line_numbers: list[int] = field(default_factory=list)  # the first 20 skipped lines


def input_format(path: str | Path) -> str:
    """"jsonl" or "txt", from the file name (a trailing `.gz` is ignored)."""
    name = Path(path).name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith((".txt", ".tokens", ".text")):
        return "txt"
    raise UserError(f"cannot tell the format of {path}; name it .jsonl, .txt or either with .gz")


def open_text(path: str | Path) -> io.TextIOBase:
    """Open a UTF-8 text file, decompressing `.gz` on the fly."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"input file not found: {path}; check --input")
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="strict", newline="")
    return open(path, encoding="utf-8", newline="")


def iter_documents(
    path: str | Path,
    json_key: str = "text",
    txt_mode: str = "paragraph",
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[Document]:
    """Yield the documents of one input file in order (see the module docstring for boundaries)."""
    if txt_mode not in TXT_MODES:
        raise UserError(f"unknown --txt-mode {txt_mode!r}; choose one of {', '.join(TXT_MODES)}")
    stats = stats if stats is not None else ReadStats()
    kind = input_format(path)
    with open_text(path) as stream:
        try:
            if kind == "jsonl":
                yield from _jsonl_documents(stream, path, json_key, skip_bad_lines, stats)
            else:
                yield from _txt_documents(stream, txt_mode, stats)
        except UnicodeDecodeError as exc:
            raise UserError(f"{path} is not valid UTF-8 ({exc.reason}); convert it to UTF-8") from exc
        except (EOFError, gzip.BadGzipFile, OSError) as exc:
            raise UserError(f"cannot read {path}: {exc}; check the file is complete") from exc


def _jsonl_documents(stream, path, json_key: str, skip_bad_lines: bool, stats: ReadStats) -> Iterator[Document]:
    for line_number, line in enumerate(stream, start=1):
        stats.bytes_read += len(line.encode("utf-8"))
        if not line.strip():
            continue
        problem = None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = f"is not valid JSON ({exc.msg})"
        else:
            if not isinstance(record, dict):
                problem = "is not a JSON object"
            elif not isinstance(record.get(json_key), str):
                problem = f"has no string key {json_key!r}"
        if problem is None:
            yield Document(record[json_key], line_number, record)
            continue
        if not skip_bad_lines:
            raise UserError(f"{path} line {line_number} {problem}; fix it or pass --skip-bad-lines")
        stats.bad_lines += 1
        if len(stats.bad_line_numbers) < 20:
            stats.bad_line_numbers.append(line_number)


def _txt_documents(stream, txt_mode: str, stats: ReadStats) -> Iterator[Document]:
    if txt_mode == "line":
        for line_number, line in enumerate(stream, start=1):
            stats.bytes_read += len(line.encode("utf-8"))
            text = line.rstrip("\r\n")
            if text.strip():
                yield Document(text, line_number)
        return
    paragraph: list[str] = []
    start_line = 1
    for line_number, line in enumerate(stream, start=1):
        stats.bytes_read += len(line.encode("utf-8"))
        if line.strip():
            if not paragraph:
                start_line = line_number
            paragraph.append(line)
        elif paragraph:
            yield Document("".join(paragraph).rstrip("\r\n"), start_line)
            paragraph = []
    if paragraph:
        yield Document("".join(paragraph).rstrip("\r\n"), start_line)
