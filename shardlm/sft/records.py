"""Chat records for supervised fine-tuning: read JSONL or Parquet, turn each record into checked messages.

Three record shapes are understood (the ones TRL and most SFT data sets use):

- `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}`: a conversation,
  single- or multi-turn. Every assistant turn is trained.
- `{"prompt": ..., "completion": ...}`: either two strings (read as one user turn and one assistant
  turn) or two message lists (TRL's conversational prompt/completion). Only the completion is trained.
- instruction records mapped by `InstructionFields`, e.g. Dolly's `instruction` / `context` / `response`
  or Alpaca's `instruction` / `input` / `output`: the non-empty prompt fields, joined by a blank line,
  become the user turn and the answer field the assistant turn.

Every problem is a `UserError` whose one line starts with `file:line` (the record's place in its file).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlm.errors import UserError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class InstructionFields:
    """Which keys of an instruction record make the user turn, the answer and (optionally) a system turn.

    The user turn is `joiner.join(record[k] for k in prompt if record[k])`; the assistant turn is
    `record[answer]`; `system`, when set and non-empty in the record, becomes a system turn.
    """

    prompt: tuple[str, ...] = ("instruction", "context")
    answer: str = "response"
    system: str | None = None
    joiner: str = "\n\n"


DOLLY = InstructionFields(("instruction", "context"), "response")
ALPACA = InstructionFields(("instruction", "input"), "output")
INSTRUCTION_PRESETS = (DOLLY, ALPACA)


@dataclass(frozen=True)
class Conversation:
    """One record as chat messages.

    `messages`: list of `{"role", "content", ...}` dicts (extra keys such as `reasoning_content` or
    `tool_calls` are kept for the chat template). `train_from`: index of the first message whose assistant
    turns are trained (0 for `messages` records; the prompt length for prompt/completion records).
    `where`: `file:line` (or `file:row` for Parquet), for error messages.
    """

    messages: list[dict[str, Any]]
    where: str
    train_from: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def read_records(path: str | Path) -> Iterator[tuple[dict[str, Any], str]]:
    """Yield `(record, where)` for each record of a `.jsonl` / `.json` (one object per line) or `.parquet` file, or
of a directory a `datasets.Dataset` was saved to (`save_to_disk`: its Arrow files, read with pyarrow).

    Blank lines are skipped. A line that is not a JSON object raises one `UserError` naming file and line.
    """
    path = Path(path)
    if path.is_dir():
        yield from _read_saved_dataset(path)
        return
    if not path.is_file():
        raise UserError(f"{path}: no such file; give a .jsonl or .parquet file of chat records")
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise UserError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
            yield record, where


def _read_saved_dataset(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """The records of a `Dataset.save_to_disk` directory: `state.json` names its Arrow stream files, in order."""
    if (path / "dataset_dict.json").exists():
        raise UserError(f"{path}: a saved DatasetDict; give one split's folder (for example {path / 'train'})")
    try:
        files = [entry["filename"] for entry in json.loads((path / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path}: a directory but not one `datasets` saved (no readable state.json); give a "
                        ".jsonl or .parquet file, or a Dataset.save_to_disk folder") from None
    try:
        import pyarrow as pa
    except ImportError:
        raise UserError(f"{path}: reading a saved Dataset needs pyarrow (pip install pyarrow); or use JSONL") from None
    row = 0
    for name in files:
        try:
            with pa.memory_map(str(path / name)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise UserError(f"{path / name}: not a readable Arrow file ({str(exc).splitlines()[0]})") from None
        for record in table.to_pylist():
            row += 1
            yield record, f"{path}:row {row}"


def _read_parquet(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow); or use JSONL") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise UserError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    for row, record in enumerate(table.to_pylist(), start=1):
        yield record, f"{path}:row {row}"


def check_messages(messages: Any, where: str) -> None:
    """Raise a one-line `UserError` unless `messages` is a trainable conversation.

    Rules: a non-empty list of dicts with a known `role` and a string `content` (assistant turns may carry
    `tool_calls` instead); a system turn only first; then a user turn; after a user turn an assistant turn;
    after an assistant turn a user or tool turn; after a tool turn a tool or assistant turn; at least one
    assistant turn.
    """
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    previous = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise UserError(f"{where}: message {i} is not a {{role, content}} object")
        role = message["role"]
        if role not in ROLES:
            raise UserError(f"{where}: message {i} has role {role!r}; use one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not (role == "assistant" and content is None and message.get("tool_calls")):
            raise UserError(f"{where}: message {i} ({role}) has no string 'content'")
        allowed = {None: ("system", "user"), "system": ("user",), "user": ("assistant",),
                   "assistant": ("user", "tool"), "tool": ("tool", "assistant")}[previous]
        if role not in allowed:
            after = f"after a {previous} turn" if previous else "first"
            raise UserError(f"{where}: roles out of order: message {i} is {role!r} {after}; "
                            f"expected {' or '.join(repr(r) for r in allowed)}")
        previous = role
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no assistant turn, so there is nothing to train on")


def _as_messages(value: Any, default_role: str, key: str, where: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, list):
        return value
    raise UserError(f"{where}: {key!r} must be a string or a list of messages, got {type(value).__name__}")


def _instruction_fields(record: dict[str, Any], fields: InstructionFields | None) -> InstructionFields | None:
    if fields is not None:
        return fields
    for preset in INSTRUCTION_PRESETS:
        if preset.prompt[0] in record and preset.answer in record:
            return preset
    return None


def to_conversation(record: dict[str, Any], where: str, fields: InstructionFields | None = None,
                    system_prompt: str | None = None) -> Conversation:
    """Turn one record into a checked `Conversation` (see the module docstring for the shapes).

    `fields`: how to read instruction records (default: Dolly's, then Alpaca's keys, whichever the record
    has). `system_prompt`: a system turn put first when the record has none.
    """
    train_from = 0
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt = _as_messages(record["prompt"], "user", "prompt", where)
        completion = _as_messages(record["completion"], "assistant", "completion", where)
        messages = prompt + completion
        train_from = len(prompt)
    else:
        spec = _instruction_fields(record, fields)
        if spec is None or spec.answer not in record or spec.prompt[0] not in record:
            keys = ", ".join(sorted(record)) or "none"
            raise UserError(f"{where}: record has neither 'messages', 'prompt'/'completion' nor instruction fields "
                            f"(keys: {keys}); map its keys with InstructionFields")
        parts = []
        for key in spec.prompt:
            value = record.get(key)
            if value is not None and not isinstance(value, str):
                raise UserError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
            if value:
                parts.append(value)
        answer = record[spec.answer]
        if not isinstance(answer, str):
            raise UserError(f"{where}: field {spec.answer!r} must be a string, got {type(answer).__name__}")
        messages = [{"role": "user", "content": spec.joiner.join(parts)}, {"role": "assistant", "content": answer}]
        if spec.system and record.get(spec.system):
            messages.insert(0, {"role": "system", "content": record[spec.system]})
    if not isinstance(messages, list):
        raise UserError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    messages = [dict(m) if isinstance(m, dict) else m for m in messages]
    if system_prompt is not None and messages and isinstance(messages[0], dict) and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
        train_from += 1
    check_messages(messages, where)
    if not any(m["role"] == "assistant" for m in messages[train_from:]):
        raise UserError(f"{where}: the completion has no assistant turn, so there is nothing to train on")
    return Conversation(messages=messages, where=where, train_from=train_from)


def load_conversations(paths: str | Path | Sequence[str | Path], fields: InstructionFields | None = None,
                       system_prompt: str | None = None, limit: int | None = None) -> list[Conversation]:
    """Read and check every record of one or more files; `limit` keeps the first `limit` records in all."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    conversations: list[Conversation] = []
    for path in paths:
        for record, where in read_records(path):
            if limit is not None and len(conversations) >= limit:
                return conversations
            conversations.append(to_conversation(record, where, fields, system_prompt))
    if not conversations:
        raise UserError(f"{', '.join(str(p) for p in paths)}: no records; the file is empty")
    return conversations
