"""MNLI and QQP from the GLUE TSV layout: sentence-pair classification.

    MNLI/  train.tsv, dev_matched.tsv, dev_mismatched.tsv   columns ... sentence1 sentence2 ... gold_label
           labels contradiction / entailment / neutral
    QQP/   train.tsv, dev.tsv                               columns id qid1 qid2 question1 question2 is_duplicate
           labels 0 / 1 (1 = duplicate; F1 is reported for this class)

Files are tab-separated with a header row and no quoting (GLUE's text contains bare quotes), so they
are read with `csv.QUOTE_NONE` and columns are found by header name. MNLI rows whose gold label is
`-` (no annotator consensus) are skipped, as GLUE does; any other unknown label is an error.
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
    skip_labels: tuple[str, ...] = ()
    f1: bool = False  # report F1 of class 1


GLUE_TASKS = {
    "mnli": GlueTask("mnli", "sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral"),
                     "train.tsv", ("dev_matched.tsv", "dev_mismatched.tsv"), skip_labels=("-",)),
    "qqp": GlueTask("qqp", "question1", "question2", "is_duplicate", ("0", "1"), "train.tsv", ("dev.tsv",), f1=True),
}


@dataclass
class PairExample:
    """A sentence pair and its class id."""

    first: str
    second: str
    label: int


def glue_file(data_dir: str | Path, task: GlueTask, name: str) -> Path:
    """`data_dir/name`, or `data_dir/MNLI/name` (QQP/...) when given the GLUE root."""
    data_dir = Path(data_dir)
    for path in (data_dir / name, data_dir / task.name.upper() / name):
        if path.is_file():
            return path
    raise UserError(f"{data_dir / name} not found; --data must be the {task.name.upper()} folder of GLUE "
                    f"with {task.train_file} and {', '.join(task.eval_files)}")


def read_glue(path: str | Path, task: GlueTask, limit: int | None = None) -> list[PairExample]:
    """The labelled pairs of one GLUE TSV file, checked against the task's columns and labels."""
    path = Path(path)
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None:
            raise UserError(f"{path} is empty; expected a GLUE TSV file with a header row")
        missing = [c for c in (task.first, task.second, task.label) if c not in header]
        if missing:
            raise UserError(f"{path} has no column {', '.join(missing)} (header: {' '.join(header)[:120]}); "
                            f"{task.name.upper()} files need {task.first}, {task.second}, {task.label}")
        columns = [header.index(c) for c in (task.first, task.second, task.label)]
        examples = []
        for line, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) <= max(columns):
                raise UserError(f"{path}:{line} has {len(row)} fields but the header has {len(header)}; "
                                "fix or remove the malformed line")
            first, second, label = (row[c] for c in columns)
            if label in task.skip_labels:
                continue
            if label not in task.labels:
                raise UserError(f"{path}:{line}: {task.label} {label!r} is not one of {', '.join(task.labels)}")
            examples.append(PairExample(first, second, task.labels.index(label)))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise UserError(f"{path} has no labelled examples")
    return examples
