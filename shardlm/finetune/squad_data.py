"""SQuAD 1.1 / 2.0 files: read the official JSON format into checked question examples.

The format (`train-v1.1.json`, `dev-v2.0.json`, ...):

    {"version": "v2.0", "data": [{"title": ..., "paragraphs": [{"context": ..., "qas": [
        {"id": ..., "question": ..., "answers": [{"text": ..., "answer_start": ...}, ...],
         "is_impossible": false, "plausible_answers": [...]}]}]}]}

SQuAD 1.1 has no `is_impossible` (every question has an answer). Every question becomes one
`SquadExample` with all of its reference answers (dev files have 1 to 6; training uses the first).
Version 1.1 runs skip the unanswerable questions of a 2.0 file, so the 2.0 dev file also serves
as a 1.1 dev set of its answerable questions. A file that does not follow the format (a missing
key, an `answer_start` that does not index its text in the context, an answerable question without
answers, a repeated id) is refused with one line naming the question id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardlm.errors import UserError

VERSIONS = ("1.1", "2.0")


@dataclass(frozen=True)
class SquadAnswer:
    """A reference answer: its text and the character where it starts in the context."""

    text: str
    start: int


@dataclass(frozen=True)
class SquadExample:
    """One question about one context. `answers` is empty for an unanswerable (2.0) question."""

    id: str
    question: str
    context: str
    answers: tuple[SquadAnswer, ...]
    title: str = ""

    @property
    def is_impossible(self) -> bool:
        return not self.answers


def parse_articles(spec: str | None, available: int, flag: str) -> range:
    """The article indices a `--train-articles` / `--dev-articles` slice `START:END` selects
    (either end may be left out; `None` selects all `available`)."""
    if spec is None:
        return range(available)
    try:
        start, end = (int(part) if part.strip() else None for part in spec.split(":"))
    except ValueError:
        raise UserError(f"{flag}={spec!r} is not START:END article indices (e.g. 0:4 or 4:)") from None
    selected = range(available)[slice(start, end)]
    if not selected:
        raise UserError(f"{flag}={spec!r} selects no article of the {available} in the file")
    return selected


def _require(record, key: str, kind: type, where: str):
    if not isinstance(record, dict) or key not in record:
        raise UserError(f"{where} has no {key!r}; a SQuAD file needs data/paragraphs/context/qas/id/question/answers")
    value = record[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise UserError(f"{where}: {key!r} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _answers(qa: dict, context: str, where: str) -> tuple[SquadAnswer, ...]:
    answers = []
    for answer in _require(qa, "answers", list, where):
        text = _require(answer, "text", str, where)
        start = _require(answer, "answer_start", int, where)
        if context[start:start + len(text)] != text:
            found = context[max(start, 0):max(start, 0) + len(text)]
            raise UserError(f"{where}: answer_start={start} does not point at the answer {text!r} in the context "
                            f"(found {found!r}); fix answer_start")
        answers.append(SquadAnswer(text, start))
    return tuple(answers)


def read_squad(path: str | Path, version: str, articles: str | None = None,
               flags: tuple[str, str] = ("--data", "--train-articles")) -> list[SquadExample]:
    """The checked questions of a SQuAD JSON file, in file order. `version` "1.1" skips unanswerable
    questions; `articles` ("START:END") keeps only those articles (to split one file into train and
    dev). `flags` name the file's and the articles' options in error messages."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"SQuAD file not found: {path}; pass the official train/dev JSON file with {flags[0]}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a SQuAD JSON file ({exc})") from None
    data = _require(record, "data", list, str(path))
    examples, seen = [], set()
    for index in parse_articles(articles, len(data), flags[1]):
        article = data[index]
        title = article.get("title", "") if isinstance(article, dict) else ""
        for paragraph in _require(article, "paragraphs", list, f"{path}: article {index}"):
            context = _require(paragraph, "context", str, f"{path}: a paragraph of article {index}")
            for qa in _require(paragraph, "qas", list, f"{path}: a paragraph of article {index}"):
                qid = _require(qa, "id", str, f"{path}: a question of article {index}")
                where = f"{path}: question {qid}"
                if qid in seen:
                    raise UserError(f"{where} appears twice; question ids must be unique")
                seen.add(qid)
                question = _require(qa, "question", str, where)
                answers = _answers(qa, context, where)
                impossible = qa.get("is_impossible", False)
                if impossible and answers:
                    raise UserError(f"{where} is_impossible but has {len(answers)} answers; an unanswerable "
                                    "question's answers must be []")
                if not impossible and not answers:
                    raise UserError(f"{where} has no answers; give it answers or mark it \"is_impossible\": true")
                if impossible and version == "1.1":
                    continue
                examples.append(SquadExample(qid, question, context, answers, title))
    return examples


def squad_files(data: str | Path, dev: str | None, version: str) -> tuple[Path, Path]:
    """(train file, dev file) of `--data` (the training file, or a folder holding the official
    train-vX.json and dev-vX.json) and `--dev` (the dev file; default: the folder's dev-vX.json)."""
    data = Path(data)
    if data.is_dir():
        return data / f"train-v{version}.json", Path(dev) if dev else data / f"dev-v{version}.json"
    if not dev:
        raise UserError(f"--data {data} is a file: pass the dev file with --dev (the same file with "
                        "--train-articles / --dev-articles splits one file)")
    return data, Path(dev)
