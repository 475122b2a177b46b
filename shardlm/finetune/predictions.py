"""Prediction files (`shardlm finetune --predict`): `OUTPUT_DIR/predictions/<set>.tsv` for every dev
set and every test file present in the task's data folder.

    MNLI  test_matched.tsv, test_mismatched.tsv -> predictions/test_matched.tsv, test_mismatched.tsv
    QQP   test.tsv                              -> predictions/test.tsv
    RACE  test/{high,middle}/*.txt              -> predictions/test.tsv
    dev sets                                    -> predictions/dev*.tsv, in the same format

GLUE's submission format: a header `index<TAB>prediction`, then one row per example in file order:
the row's `index` (MNLI) or `id` (QQP) column and the label as GLUE spells it (MNLI
`contradiction`/`entailment`/`neutral`, QQP `0`/`1`). (The GLUE server wants the files renamed
MNLI-m.tsv, MNLI-mm.tsv, QQP.tsv.) RACE: a header `id<TAB>answer`, the question's id
`level/file#number` (e.g. `high/132.txt#1`) and a letter A-D. Dev files list the rows that were
scored (MNLI's `-` rows are skipped). Files are written by global rank 0, atomically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardlm.checkpoint.files import write_atomically


def read_test_sets(task: str, data_dir: str | Path) -> tuple[dict[str, list], list[str]]:
    """({set name: unlabelled examples} of the test files present, [test files looked for but absent]).
    SQuAD's test set is hidden: none (its dev predictions are `squad.py`'s)."""
    if task == "squad":
        return {}, []
    if task == "race":
        from shardlm.finetune.race import LEVELS, race_root, read_race

        folder = race_root(data_dir) / "test"
        if not any((folder / level).glob("*.txt") for level in LEVELS):
            return {}, [f"{folder}/{{high,middle}}/*.txt"]
        return {"test": read_race(data_dir, "test", require_answers=False)}, []
    from shardlm.finetune.glue import GLUE_TASKS, find_glue_file, read_glue

    spec = GLUE_TASKS[task]
    sets, missing = {}, []
    for name in spec.test_files:
        path = find_glue_file(data_dir, spec, name)
        if path is None:
            missing.append(name)
        else:
            sets[Path(name).stem] = read_glue(path, spec, labelled=False)
    return sets, missing


def example_ids(task: str, examples: list) -> list[str]:
    """What names each example in a prediction file: RACE `level/file#number`, GLUE the index column."""
    return [e.source if task == "race" else e.index for e in examples]


def label_names(task: str) -> tuple[str, ...]:
    """Class id -> the label written in prediction files."""
    if task == "race":
        from shardlm.finetune.race import LETTERS

        return tuple(LETTERS)
    from shardlm.finetune.glue import GLUE_TASKS

    return GLUE_TASKS[task].labels


def prediction_lines(task: str, ids: list[str], predicted: np.ndarray) -> list[str]:
    """The lines of a prediction file (header first) for (N,) predicted class ids."""
    names = label_names(task)
    header = "id\tanswer" if task == "race" else "index\tprediction"
    return [header] + [f"{i}\t{names[p]}" for i, p in zip(ids, predicted.tolist(), strict=True)]


def write_predictions(path: Path, task: str, ids: list[str], predicted: np.ndarray) -> Path:
    """Write one prediction file atomically (call on one rank only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(prediction_lines(task, ids, predicted)) + "\n"
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def race_level_accuracy(ids: list[str], predicted: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """RACE accuracy per level: {"high": ..., "middle": ...} for the levels present."""
    levels = np.array([i.split("/", 1)[0] for i in ids])
    return {str(level): float((predicted[levels == level] == labels[levels == level]).mean())
            for level in sorted(set(levels.tolist()))}
