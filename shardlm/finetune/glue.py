"""MNLI and QQP from the GLUE TSV layout: sentence-pair classification.

    MNLI/  train.tsv, dev_matched.tsv, dev_mismatched.tsv   columns index ... sentence1 sentence2 ... gold_label
           test_matched.tsv, test_mismatched.tsv            columns index ... sentence1 sentence2 (no label)
           labels contradiction / entailment / neutral
    QQP/   train.tsv, dev.tsv                               columns id qid1 qid2 question1 question2 is_duplicate
           test.tsv                                         columns id question1 question2 (no label)
           labels 0 / 1 (1 = duplicate; F1 is reported for this class)

Files are tab-separated with a header row and no quoting (GLUE's text contains bare quotes), so they
are read with `csv.QUOTE_NONE` and columns are found by header name. MNLI rows whose gold label is
`-` (no annotator consensus) are skipped, as GLUE does; any other unknown label is an error. Test
files have no label column: every row is kept, with label -1, and its `index` (MNLI) or `id` (QQP)
is what a GLUE submission names the row by.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path

from shardlm.errors import UserError


@dataclass(frozen=True)
class GlueTask:
    """Where a GLUE task's files and columns are and what its labels mean."""

    name: str
    first: str  # column of the first text
    second: str  # column of the second text
    label: str  # column of the label
    labels: tuple[str, ...]  # label strings; the class id is the position
    train_file: str
    eval_files: tuple[str, ...]
    test_files: tuple[str, ...]  # unlabelled; predicted with --predict
    index: str  # column naming a row in GLUE submission files
    skip_labels: tuple[str, ...] = ()
    f1: bool = False  # report F1 of class 1


GLUE_TASKS = {
    "mnli": GlueTask("mnli", "sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral"),
                     "train.tsv", ("dev_matched.tsv", "dev_mismatched.tsv"),
                     ("test_matched.tsv", "test_mismatched.tsv"), "index", skip_labels=("-",)),
    "qqp": GlueTask("qqp", "question1", "question2", "is_duplicate", ("0", "1"), "train.tsv", ("dev.tsv",),
                    ("test.tsv",), "id", f1=True),
}


@dataclass
class PairExample:
    """A sentence pair, its class id (-1 in test files) and the row's index column (its 0-based data-row
    number when the file has none)."""

    first: str
    second: str
    label: int
    index: str = ""


def find_glue_file(data_dir: str | Path, task: GlueTask, name: str) -> Path | None:
    """`data_dir/name`, or `data_dir/MNLI/name` (QQP/...) when given the GLUE root; None when neither exists."""
    data_dir = Path(data_dir)
    for path in (data_dir / name, data_dir / task.name.upper() / name):
        if path.is_file():
            return path
    return None


def glue_file(data_dir: str | Path, task: GlueTask, name: str) -> Path:
    """`find_glue_file`, or a UserError naming the files the task needs."""
    path = find_glue_file(data_dir, task, name)
    if path is not None:
        return path
    data_dir = Path(data_dir)
    raise UserError(f"{data_dir / name} not found; --data must be the {task.name.upper()} folder of GLUE "
                    f"with {task.train_file} and {', '.join(task.eval_files)}")


def read_glue(path: str | Path, task: GlueTask, limit: int | None = None, labelled: bool = True) -> list[PairExample]:
    """The pairs of one GLUE TSV file, checked against the task's columns and labels. `labelled=False`
    reads a test file: no label column is needed and every row is kept, with label -1."""
    path = Path(path)
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None:
            raise UserError(f"{path} is empty; expected a GLUE TSV file with a header row")
        columns = _columns(path, header, task, labelled)
        index = header.index(task.index) if task.index in header else None
        examples = []
        for line, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) <= max(columns + [index or 0]):
                raise UserError(f"{path}:{line} has {len(row)} fields but the header has {len(header)}; "
                                "fix or remove the malformed line")
            name = row[index] if index is not None else str(line - 2)
            label = _label(path, line, row[columns[2]], task) if labelled else -1
            if label is None:
                continue
            examples.append(PairExample(row[columns[0]], row[columns[1]], label, name))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise UserError(f"{path} has no {'labelled ' if labelled else ''}examples")
    return examples


def _columns(path: Path, header: list[str], task: GlueTask, labelled: bool) -> list[int]:
    """Positions of the first text, second text (and label) columns; UserError naming the missing ones."""
    wanted = (task.first, task.second, task.label) if labelled else (task.first, task.second)
    missing = [c for c in wanted if c not in header]
    if missing:
        raise UserError(f"{path} has no column {', '.join(missing)} (header: {' '.join(header)[:120]}); "
                        f"{task.name.upper()} {'files' if labelled else 'test files'} need {', '.join(wanted)}")
    return [header.index(c) for c in wanted]


def _label(path: Path, line: int, label: str, task: GlueTask) -> int | None:
    """The class id of a label string; None for rows to skip (MNLI's "-")."""
    if label in task.skip_labels:
        return None
    if label not in task.labels:
        raise UserError(f"{path}:{line}: {task.label} {label!r} is not one of {', '.join(task.labels)}")
    return task.labels.index(label)
