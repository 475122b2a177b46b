"""What the fine-tuning test files share: the untrained tiny BERT they start from, the shared WordPiece
vocabulary, small GLUE files in the exact GLUE layouts, and the `shardlm finetune` command run in-process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardlm.cli import main


def bert_vocab(data_dir: Path) -> Path:
    """The real 30,522-token `bert-base-uncased` WordPiece vocabulary in the shared data."""
    return data_dir / "vocab/bert-base-uncased/vocab.txt"


def untrained_bert_checkpoint(directory: Path, vocab: Path, hidden_size: int, seq_length: int) -> Path:
    """An untrained 2-layer BERT (4 heads, no dropout, seed 3) saved as a shardlm checkpoint in `directory`,
    whose config names `vocab`."""
    from shardlm.checkpoint import save_checkpoint
    from shardlm.config import from_dict
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    config = from_dict({
        "model": {"arch": "bert", "num_layers": 2, "hidden_size": hidden_size, "num_heads": 4,
                  "seq_length": seq_length, "vocab_size": 30522, "dropout": 0.0},
        "data": {"prefixes": ["unused"], "tokenizer": "bert", "vocab_file": str(vocab)},
        "train": {"precision": "fp32", "seed": 3},
    })
    trainer = Trainer(config, ParallelContext.single(), None)
    return save_checkpoint(trainer, directory)


# ------------------------------------------------------------------------------------------ GLUE

MNLI_HEADER = ("index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
               "sentence2_parse sentence1 sentence2 label1 gold_label").split()
QQP_HEADER = "id qid1 qid2 question1 question2 is_duplicate".split()
MNLI_TEST_HEADER = MNLI_HEADER[:10]  # index ... sentence1 sentence2: no label columns
QQP_TEST_HEADER = "id question1 question2".split()
WORDS = "river garden letter morning window evening carriage family dinner ball".split()


def mnli_rows(count: int, seed: int, header=MNLI_HEADER) -> list[list[str]]:
    """Pairs whose label is readable from the hypothesis: "never" -> contradiction, "also" -> entailment."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        label = ("contradiction", "entailment", "neutral")[i % 3]
        premise = " ".join(rng.choice(WORDS, 6))
        marker = {"contradiction": "never", "entailment": "also", "neutral": "perhaps"}[label]
        hypothesis = f"the {rng.choice(WORDS)} {marker} \"moved\" {rng.choice(WORDS)}"
        values = {"index": str(i), "promptID": str(1000 + i), "pairID": f"{1000 + i}{label[0]}", "genre": "fiction",
                  "sentence1": premise, "sentence2": hypothesis, "label1": label, "gold_label": label}
        rows.append([values.get(column, "( x )") for column in header])
    return rows


def qqp_rows(count: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        question = " ".join(rng.choice(WORDS, 5)) + "?"
        duplicate = i % 2
        other = question if duplicate else " ".join(rng.choice(WORDS, 5)) + "?"
        rows.append([str(i), str(2 * i), str(2 * i + 1), question, other, str(duplicate)])
    return rows


def write_tsv(path, header, rows) -> None:
    path.write_text("\n".join("\t".join(r) for r in [header, *rows]) + "\n", encoding="utf-8")



def write_glue_dirs(root: Path) -> Path:
    """MNLI/ and QQP/ under `root`: train, dev (MNLI's mismatched set with one no-consensus row) and
    unlabelled test files."""
    mnli, qqp = root / "MNLI", root / "QQP"
    mnli.mkdir(), qqp.mkdir()
    write_tsv(mnli / "train.tsv", MNLI_HEADER, mnli_rows(48, 0))
    dev_header = MNLI_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
    write_tsv(mnli / "dev_matched.tsv", dev_header, mnli_rows(12, 1, dev_header))
    no_consensus = mnli_rows(1, 3, dev_header)[0][:-1] + ["-"]
    write_tsv(mnli / "dev_mismatched.tsv", dev_header, mnli_rows(9, 2, dev_header) + [no_consensus])
    write_tsv(qqp / "train.tsv", QQP_HEADER, qqp_rows(32, 0))
    write_tsv(qqp / "dev.tsv", QQP_HEADER, qqp_rows(10, 1))
    for name, count in (("test_matched.tsv", 7), ("test_mismatched.tsv", 5)):
        rows = mnli_rows(count, 10 + count, MNLI_TEST_HEADER)
        write_tsv(mnli / name, MNLI_TEST_HEADER, [[str(500 + 3 * k), *r[1:]] for k, r in enumerate(rows)])
    write_tsv(qqp / "test.tsv", QQP_TEST_HEADER, [[str(900 + k), r[3], r[4]] for k, r in enumerate(qqp_rows(6, 2))])
    return root



# ------------------------------------------------------------------------------------- the command

def finetune_cli(task, checkpoint, data, out, *extra) -> dict:
    code = main(["finetune", task, "--checkpoint", str(checkpoint), "--data", str(data), "--output-dir", str(out),
                 "--seq-length", "32", "--batch-size", "8", "--lr", "3e-3", "--warmup", "0", *extra])
    assert code == 0
    return json.loads((out / "metrics.json").read_text())


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("shardlm: error: ")
    return err

