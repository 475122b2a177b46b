"""RACE: reading comprehension as 4-way multiple choice.

Layout (as distributed): `RACE/{train,dev,test}/{high,middle}/*.txt`, each file one JSON object
with `article` (the passage), `questions`, `options` (4 per question), `answers` (letters A-D) and
`id`. Every question becomes one example, named `level/file#number` (e.g. `high/132.txt#1`, the
first question of `high/132.txt`), which is also its id in prediction files. Test files may leave
out `answers` (a hidden test set): their questions get label -1.

Input per option, as in the paper: `[CLS] question+option [SEP] passage [SEP]`: the option replaces
`_` in the question when it has one (cloze questions), else follows it after a space; the
question+option part is cut to `max_qa_length` tokens and the passage is cut at its end to fill the
sequence. A linear head scores each of the 4 rows; softmax cross-entropy over the 4 scores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardlm.errors import UserError
from shardlm.finetune.inputs import TaskData, pair_row, stack_rows

LEVELS = ("high", "middle")
LETTERS = "ABCD"
NUM_CHOICES = 4


@dataclass
class MultipleChoiceExample:
    """One question: its passage, the 4 options, the index (0-3) of the right one (-1: unknown) and its
    name `level/file#number`."""

    article: str
    question: str
    options: list[str]
    label: int
    source: str


def race_root(data_dir: str | Path) -> Path:
    """The folder holding train/ dev/ test/: `data_dir` itself, or `data_dir/RACE`."""
    data_dir = Path(data_dir)
    for root in (data_dir, data_dir / "RACE"):
        if (root / "train").is_dir() or (root / "dev").is_dir():
            return root
    raise UserError(f"{data_dir} has no RACE train/ or dev/ folder; pass the RACE directory "
                    "(with {train,dev,test}/{high,middle}/*.txt) as --data")


def read_race_file(path: Path, require_answers: bool = True) -> list[MultipleChoiceExample]:
    """The questions of one RACE file, checked: every key present, 4 options each, answers A-D.
    With `require_answers=False` a file without `answers` is read with every label -1."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a RACE JSON file ({exc}); each file must hold one JSON object") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} is not a RACE JSON object; expected keys article, questions, options, answers")
    needed = ("article", "questions", "options", "answers") if require_answers else ("article", "questions", "options")
    missing = [k for k in needed if k not in record]
    if missing:
        raise UserError(f"{path} has no {', '.join(missing)}; a RACE file needs article, questions, options, answers")
    questions, options = record["questions"], record["options"]
    answers = record["answers"] if "answers" in record else [""] * len(questions)  # "": no answer given
    if not len(questions) == len(options) == len(answers):
        raise UserError(f"{path} has {len(questions)} questions, {len(options)} option lists and {len(answers)} "
                        "answers; they must be equally many")
    examples = []
    for number, (question, choices, answer) in enumerate(zip(questions, options, answers), 1):
        if not isinstance(choices, list) or len(choices) != NUM_CHOICES:
            raise UserError(f"{path}: question {number} has {len(choices)} options; RACE questions have exactly 4")
        examples.append(MultipleChoiceExample(record["article"], question, list(choices),
                                              _answer_index(path, number, answer, "answers" in record),
                                              f"{path.parent.name}/{path.name}#{number}"))
    return examples


def _answer_index(path: Path, number: int, answer, answered: bool) -> int:
    """0-3 for an answer letter A-D; -1 in a file without `answers` (`answered` False)."""
    if not answered:
        return -1
    if not isinstance(answer, str) or answer.strip() not in LETTERS or len(answer.strip()) != 1:
        raise UserError(f"{path}: answer {answer!r} of question {number} is not one of A, B, C, D")
    return LETTERS.index(answer.strip())


def read_race(data_dir: str | Path, split: str, limit: int | None = None,
              require_answers: bool = True) -> list[MultipleChoiceExample]:
    """Questions of `split` (train, dev or test), high-school files first, files in numeric order.
    `require_answers=False` accepts files without answers (label -1)."""
    folder = race_root(data_dir) / split
    if not folder.is_dir():
        raise UserError(f"RACE split folder {folder} not found; --data must hold {split}/high and {split}/middle")
    files = [p for level in LEVELS for p in sorted((folder / level).glob("*.txt"), key=_numeric_name)]
    if not files:
        raise UserError(f"no RACE files in {folder}/high or {folder}/middle")
    examples: list[MultipleChoiceExample] = []
    for path in files:
        examples += read_race_file(path, require_answers)
        if limit is not None and len(examples) >= limit:
            return examples[:limit]
    return examples


def _numeric_name(path: Path):
    return (int(path.stem), "") if path.stem.isdigit() else (float("inf"), path.stem)


def question_with_option(question: str, option: str) -> str:
    """The option in the question's blank (`_`), or after the question."""
    return question.replace("_", option) if "_" in question else f"{question} {option}"


def encode_race(examples: list[MultipleChoiceExample], tokenizer, seq_length: int,
                max_qa_length: int = 128) -> TaskData:
    """Examples -> (N, 4, L) arrays, one `[CLS] question+option [SEP] passage [SEP]` row per option."""
    articles: dict[str, list[int]] = {}
    rows = []
    for example in examples:
        if example.article not in articles:
            articles[example.article] = tokenizer.encode(example.article)
        qa_ids = tokenizer.encode_batch([question_with_option(example.question, o) for o in example.options])
        for qa in qa_ids:
            qa = qa[:min(max_qa_length, seq_length - 4)]
            passage = articles[example.article][:seq_length - 3 - len(qa)]
            rows.append(pair_row(qa, passage, seq_length, tokenizer.cls, tokenizer.sep, tokenizer.pad))
    return stack_rows(rows, [e.label for e in examples], (len(examples), NUM_CHOICES))
