"""Fine-tuning: the RACE and GLUE readers, inputs as the paper builds them, the multiple-choice loss,
training that lowers the loss, and one-line errors for bad data (`test_finetune_saved.py`: equal
results under TP and DP, and the fine-tuned model kept and used).

A tiny BERT (2 layers, hidden 32, the real 30,522-token WordPiece vocabulary) is saved once as a
checkpoint; the GLUE files are small TSVs written in the exact GLUE layouts (`finetune_helpers`).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from finetune_helpers import (
    MNLI_HEADER,
    QQP_HEADER,
    bert_vocab,
    finetune_cli,
    mnli_rows,
    one_line_error,
    qqp_rows,
    untrained_bert_checkpoint,
    write_glue_dirs,
    write_tsv,
)

from shardlm.finetune.glue import GLUE_TASKS, read_glue
from shardlm.finetune.heads import MultipleChoiceModel, choice_loss
from shardlm.finetune.loop import FinetuneSettings, finetune
from shardlm.finetune.race import encode_race, question_with_option, read_race
from shardlm.parallel import ParallelContext

SEQ = 64


@pytest.fixture(scope="module")
def vocab(data_dir):
    return bert_vocab(data_dir)


@pytest.fixture(scope="module")
def tokenizer(vocab):
    from shardlm.data.tokenizers import build_tokenizer

    return build_tokenizer("bert", vocab)


@pytest.fixture(scope="module")
def race_dir(data_dir):
    return data_dir / "race/RACE"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, vocab):
    """An (untrained) tiny BERT saved as a shardlm checkpoint whose config names the BERT vocabulary."""
    return untrained_bert_checkpoint(tmp_path_factory.mktemp("bert_ckpt"), vocab, hidden_size=32, seq_length=SEQ)


@pytest.fixture(scope="module")
def glue_dirs(tmp_path_factory):
    return write_glue_dirs(tmp_path_factory.mktemp("glue"))


# ------------------------------------------------------------------------------------------ RACE

def test_race_reader_reads_every_question_of_the_shared_sample(race_dir):
    for split in ("train", "dev", "test"):
        files = sorted((race_dir / split / "high").glob("*.txt")) + sorted((race_dir / split / "middle").glob("*.txt"))
        records = [json.loads(p.read_text()) for p in files]
        examples = read_race(race_dir, split)
        assert len(examples) == sum(len(r["questions"]) for r in records)
        assert {e.article for e in examples} == {r["article"] for r in records}
        assert all(len(e.options) == 4 and 0 <= e.label < 4 for e in examples)
    # the dataset card's example: test/high/132.txt, answer A
    skirts = [e for e in read_race(race_dir, "test") if e.source.startswith("high/132.txt#")]
    record = json.loads((race_dir / "test/high/132.txt").read_text())
    assert [e.label for e in skirts] == ["ABCD".index(a) for a in record["answers"]]
    assert [e.source for e in skirts] == [f"high/132.txt#{n}" for n in range(1, len(skirts) + 1)]
    assert read_race(race_dir.parent, "dev", limit=5) == read_race(race_dir, "dev")[:5]  # RACE/ parent works too


def test_option_fills_the_blank_or_follows_the_question():
    assert question_with_option("The man went to the _ .", "shop") == "The man went to the shop ."
    assert question_with_option("Where did he go?", "home") == "Where did he go? home"


def test_race_inputs_are_cls_question_option_sep_passage_sep(race_dir, tokenizer):
    examples = read_race(race_dir, "dev", limit=6)
    max_qa = 12
    data = encode_race(examples, tokenizer, SEQ, max_qa_length=max_qa)
    assert data.tokens.shape == (6, 4, SEQ) and data.labels.tolist() == [e.label for e in examples]
    for i, example in enumerate(examples):
        passage = tokenizer.encode(example.article)
        for j, option in enumerate(example.options):
            qa = tokenizer.encode(question_with_option(example.question, option))[:max_qa]
            expected = [tokenizer.cls, *qa, tokenizer.sep, *passage[:SEQ - 3 - len(qa)], tokenizer.sep]
            length = len(expected)
            assert data.tokens[i, j, :length].tolist() == expected
            assert (data.tokens[i, j, length:] == tokenizer.pad).all()
            assert data.padding_mask[i, j].tolist() == [1] * length + [0] * (SEQ - length)
            assert data.token_types[i, j, :length].tolist() == [0] * (len(qa) + 2) + [1] * (length - len(qa) - 2)


def test_multiple_choice_loss_is_softmax_cross_entropy_over_the_options(checkpoint, race_dir, tokenizer):
    from shardlm.checkpoint import load_model

    bert, _ = load_model(checkpoint, ParallelContext.single())
    model = MultipleChoiceModel(bert, seed=5).eval()
    batch = encode_race(read_race(race_dir, "dev", limit=3), tokenizer, SEQ).batch(np.arange(3), torch.device("cpu"))
    with torch.no_grad():
        scores = model(batch["tokens"], batch["token_types"], batch["padding_mask"])
        loss = choice_loss(scores, batch["labels"]).item()
    assert scores.shape == (3, 4)
    by_hand = []
    for row, label in zip(scores.tolist(), batch["labels"].tolist()):
        log_sum_exp = math.log(sum(math.exp(s) for s in row))
        by_hand.append(log_sum_exp - row[label])
    assert loss == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-6)
    assert len(set(scores[0].tolist())) == 4  # every option is scored separately


def test_finetuning_race_lowers_the_training_loss(checkpoint, race_dir, tokenizer):
    from shardlm.checkpoint import load_model

    ctx = ParallelContext.single()
    bert, _ = load_model(checkpoint, ctx)
    ctx.seed(0)
    model = MultipleChoiceModel(bert, seed=0)
    train = encode_race(read_race(race_dir, "train", limit=16), tokenizer, SEQ)
    settings = FinetuneSettings(epochs=20, batch_size=8, lr=1e-3, warmup=0.0, seed=0)
    history = finetune(model, ctx, train, {"train": train}, settings)
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.2
    assert history[-1]["train"]["accuracy"] > 0.5  # memorizes a few questions (chance is 0.25)


# ------------------------------------------------------------------------------------------ GLUE

def test_glue_readers_find_columns_by_header(glue_dirs):
    mnli = GLUE_TASKS["mnli"]
    train = read_glue(glue_dirs / "MNLI/train.tsv", mnli)
    rows = mnli_rows(48, 0)
    assert [(e.first, e.second) for e in train] == [(r[8], r[9]) for r in rows]  # quotes kept as text
    assert [mnli.labels[e.label] for e in train] == [r[-1] for r in rows]
    assert len(read_glue(glue_dirs / "MNLI/dev_mismatched.tsv", mnli)) == 9  # the "-" row is skipped
    qqp = read_glue(glue_dirs / "QQP/dev.tsv", GLUE_TASKS["qqp"])
    assert [e.label for e in qqp] == [int(r[5]) for r in qqp_rows(10, 1)]


def test_finetune_mnli_cli_lowers_loss_and_reports_both_dev_sets(checkpoint, glue_dirs, tmp_path, capsys):
    metrics = finetune_cli("mnli", checkpoint, glue_dirs / "MNLI", tmp_path, "--epochs", "15")
    epochs = metrics["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, 16)) and epochs[-1]["steps"] == 15 * (48 // 8)
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] - 0.3
    assert epochs[-1]["dev_matched"]["accuracy"] > 0.6  # the keyword rule generalizes (chance is 1/3)
    assert metrics["eval_examples"] == {"dev_matched": 12, "dev_mismatched": 9}
    assert all(0 <= e[name]["accuracy"] <= 1 for e in epochs for name in ("dev_matched", "dev_mismatched"))
    table = capsys.readouterr().out
    assert "dev_matched acc" in table and len([line for line in table.splitlines() if "%" in line]) == 15


def test_finetune_qqp_reports_f1(checkpoint, glue_dirs, tmp_path):
    metrics = finetune_cli("qqp", checkpoint, glue_dirs, tmp_path, "--epochs", "1")
    dev = metrics["epochs"][0]["dev"]
    assert dev["examples"] == 10 and 0 <= dev["f1"] <= 1 and 0 <= dev["accuracy"] <= 1


# ------------------------------------------------------------------------------------ bad input


def test_missing_glue_column_is_a_one_line_error(checkpoint, tmp_path, capsys):
    header = [c for c in MNLI_HEADER if c != "gold_label"]
    write_tsv(tmp_path / "train.tsv", header, [r[:-1] for r in mnli_rows(8, 0)])
    for name in ("dev_matched.tsv", "dev_mismatched.tsv"):
        write_tsv(tmp_path / name, MNLI_HEADER, mnli_rows(4, 0))
    err = one_line_error(capsys, ["finetune", "mnli", "--checkpoint", str(checkpoint), "--data", str(tmp_path)])
    assert "train.tsv has no column gold_label" in err


def test_unknown_glue_label_is_a_one_line_error(checkpoint, tmp_path, capsys):
    rows = qqp_rows(6, 0)
    rows[3][5] = "yes"
    write_tsv(tmp_path / "train.tsv", QQP_HEADER, rows)
    write_tsv(tmp_path / "dev.tsv", QQP_HEADER, qqp_rows(4, 1))
    err = one_line_error(capsys, ["finetune", "qqp", "--checkpoint", str(checkpoint), "--data", str(tmp_path)])
    assert "train.tsv:5: is_duplicate 'yes' is not one of 0, 1" in err


def test_wrong_race_answer_letter_is_a_one_line_error(checkpoint, race_dir, tmp_path, capsys):
    for split in ("train", "dev"):
        for level in ("high", "middle"):
            (tmp_path / split / level).mkdir(parents=True)
            source = sorted((race_dir / split / level).glob("*.txt"))[0]
            (tmp_path / split / level / source.name).write_text(source.read_text())
    bad = tmp_path / "train/middle" / sorted((race_dir / "train/middle").glob("*.txt"))[0].name
    record = json.loads(bad.read_text())
    record["answers"][1] = "E"
    bad.write_text(json.dumps(record))
    err = one_line_error(capsys, ["finetune", "race", "--checkpoint", str(checkpoint), "--data", str(tmp_path)])
    assert f"{bad}: answer 'E' of question 2 is not one of A, B, C, D" in err


def test_missing_race_split_and_bad_numbers_are_one_line_errors(checkpoint, race_dir, tmp_path, capsys):
    err = one_line_error(capsys, ["finetune", "race", "--checkpoint", str(checkpoint), "--data", str(tmp_path)])
    assert "has no RACE train/ or dev/ folder" in err
    err = one_line_error(capsys, ["finetune", "race", "--checkpoint", str(checkpoint), "--data", str(race_dir),
                                  "--warmup", "5"])
    assert "--warmup=5.0 is a fraction" in err
