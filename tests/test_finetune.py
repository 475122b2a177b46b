"""Fine-tuning: the RACE and GLUE readers, inputs as the paper builds them, the multiple-choice loss,
training that lowers the loss, one-line errors for bad data, equal results under TP and DP, and the
fine-tuned model kept (`--save`, reloaded at any TP size) and used (`--predict` files).

A tiny BERT (2 layers, hidden 32, the real 30,522-token WordPiece vocabulary) is saved once as a
checkpoint; the GLUE files are small TSVs written here in the exact GLUE layouts. Two processes are
spawned twice per module: once by `run_workers` (function-level layouts and CLI reloads at TP=2 and
DP=2, `two_process_runs`) and once by the CLI's own `--nproc-per-node 2` (`race_tp2`).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardlm.cli import main
from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.finetune.glue import GLUE_TASKS, read_glue
from shardlm.finetune.heads import MultipleChoiceModel, choice_loss
from shardlm.finetune.loop import FinetuneSettings, finetune
from shardlm.finetune.race import encode_race, question_with_option, read_race
from shardlm.parallel import ParallelContext

from multiproc import run_workers

SEQ = 64


@pytest.fixture(scope="module")
def vocab(data_dir):
    return data_dir / "vocab/bert-base-uncased/vocab.txt"


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
    from shardlm.checkpoint import save_checkpoint
    from shardlm.training.trainer import Trainer

    config = from_dict({
        "model": {"arch": "bert", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": SEQ,
                  "vocab_size": 30522, "dropout": 0.0},
        "data": {"prefixes": ["unused"], "tokenizer": "bert", "vocab_file": str(vocab)},
        "train": {"seed": 3},
    })
    trainer = Trainer(config, ParallelContext.single(), None)
    return save_checkpoint(trainer, tmp_path_factory.mktemp("bert_ckpt"))


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


@pytest.fixture(scope="module")
def glue_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
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


def test_glue_readers_find_columns_by_header(glue_dirs):
    mnli = GLUE_TASKS["mnli"]
    train = read_glue(glue_dirs / "MNLI/train.tsv", mnli)
    rows = mnli_rows(48, 0)
    assert [(e.first, e.second) for e in train] == [(r[8], r[9]) for r in rows]  # quotes kept as text
    assert [mnli.labels[e.label] for e in train] == [r[-1] for r in rows]
    assert len(read_glue(glue_dirs / "MNLI/dev_mismatched.tsv", mnli)) == 9  # the "-" row is skipped
    qqp = read_glue(glue_dirs / "QQP/dev.tsv", GLUE_TASKS["qqp"])
    assert [e.label for e in qqp] == [int(r[5]) for r in qqp_rows(10, 1)]


def finetune_cli(task, checkpoint, data, out, *extra) -> dict:
    code = main(["finetune", task, "--checkpoint", str(checkpoint), "--data", str(data), "--output-dir", str(out),
                 "--seq-length", "32", "--batch-size", "8", "--lr", "3e-3", "--warmup", "0", *extra])
    assert code == 0
    return json.loads((out / "metrics.json").read_text())


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

def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("shardlm: error: ")
    return err


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


# ----------------------------------------------------------------------------- TP and DP layouts

def finetune_race_run(checkpoint, race_dir, vocab, ctx: ParallelContext) -> list[dict]:
    """Fine-tune on 16 RACE questions for 2 epochs (no dropout) on `ctx`; every layout must agree."""
    from shardlm.checkpoint import load_model
    from shardlm.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("bert", vocab)
    bert, _ = load_model(checkpoint, ctx)
    ctx.seed(1)
    model = MultipleChoiceModel(bert, seed=1)
    train = encode_race(read_race(race_dir, "train", limit=16), tokenizer, SEQ)
    dev = encode_race(read_race(race_dir, "dev", limit=10), tokenizer, SEQ)
    settings = FinetuneSettings(epochs=2, batch_size=8, micro_batch_size=2, lr=1e-3, warmup=0.25, seed=1,
                                eval_batch_size=3)
    return finetune(model, ctx, train, {"dev": dev}, settings)


def reload_cli(model_file, data, out, *extra) -> int:
    """`shardlm finetune mnli` on a saved model: no training, dev metrics and every prediction file."""
    return main(["finetune", "mnli", "--checkpoint", str(model_file), "--data", str(data), "--output-dir", str(out),
                 "--epochs", "0", "--predict", *extra])


def worker_two_processes(checkpoint, race_dir, vocab, mnli_model, mnli_data, out):
    """On 2 ranks: fine-tune RACE at TP=2 and TP=1 x DP=2; reload the TP=1-saved MNLI model at both
    layouts, predict and save it again. Returns rank 0's results and, from every rank, the files it
    renamed into place."""
    layouts, codes, renamed, real_replace = {}, {}, [], os.replace

    def spy(src, dst):
        renamed.append(os.path.relpath(dst, out))
        real_replace(src, dst)

    os.replace = spy
    for tp in (2, 1):
        layouts[tp] = finetune_race_run(checkpoint, race_dir, vocab, ParallelContext.from_process_group(tp))
        codes[tp] = reload_cli(mnli_model, mnli_data, out / f"tp{tp}", "--tensor-parallel", str(tp), "--save")
    os.replace = real_replace
    if dist.get_rank() == 0:
        return {"layouts": layouts, "codes": codes, "renamed": renamed}
    return {"renamed": renamed}


@pytest.fixture(scope="module")
def two_process_runs(checkpoint, race_dir, vocab, mnli_finetuned, glue_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_process")
    results = run_workers(2, worker_two_processes, checkpoint, race_dir, vocab, mnli_finetuned / "model.safetensors",
                          glue_dirs / "MNLI", out)
    return results, out


def test_tensor_and_data_parallel_finetuning_match_single_process(checkpoint, race_dir, vocab, two_process_runs):
    reference = finetune_race_run(checkpoint, race_dir, vocab, ParallelContext.single())
    for tp, history in two_process_runs[0][0]["layouts"].items():
        for epoch, ref in zip(history, reference):
            assert epoch["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5), f"TP={tp}"
            assert epoch["dev"] == ref["dev"], f"TP={tp}"


@pytest.fixture(scope="module")
def race_tp2(checkpoint, race_dir, tmp_path_factory):
    """RACE fine-tuned by 2 TP workers of the CLI, saved (gathered from the TP shards) and predicting."""
    out = tmp_path_factory.mktemp("race_tp2")
    metrics = finetune_cli("race", checkpoint, race_dir, out, "--epochs", "1", "--limit-train", "8", "--limit-eval",
                           "4", "--tensor-parallel", "2", "--nproc-per-node", "2", "--save", "--predict")
    assert len({row[1] for row in read_predictions(out / "predictions/test.tsv")[1]}) > 1  # not one letter for all
    return metrics, out


def test_finetune_cli_runs_tensor_parallel_workers(race_tp2):
    metrics, _ = race_tp2
    assert metrics["tensor_parallel"] == 2 and metrics["data_parallel"] == 1
    assert metrics["epochs"][0]["dev"]["examples"] == 4


# --------------------------------------------------------------------- keeping and using the model

@pytest.fixture(scope="module")
def mnli_finetuned(checkpoint, glue_dirs, tmp_path_factory):
    """MNLI fine-tuned in this process (TP=1), saved and predicting: OUTPUT_DIR. Trained until it
    predicts every class (an untrained head predicts one), so that equal predictions mean something."""
    out = tmp_path_factory.mktemp("mnli_finetuned")
    finetune_cli("mnli", checkpoint, glue_dirs / "MNLI", out, "--epochs", "15", "--save", "--predict")
    for name in ("dev_matched", "test_matched"):
        assert len({row[1] for row in read_predictions(out / f"predictions/{name}.tsv")[1]}) == 3, name
    return out


def read_predictions(path) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a prediction TSV."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[0].split("\t"), [line.split("\t") for line in lines[1:]]


def test_glue_test_files_are_read_without_labels_by_their_index(glue_dirs):
    examples = read_glue(glue_dirs / "MNLI/test_matched.tsv", GLUE_TASKS["mnli"], labelled=False)
    assert [e.index for e in examples] == [str(500 + 3 * k) for k in range(7)]
    assert all(e.label == -1 for e in examples)
    with pytest.raises(UserError, match="has no column gold_label"):
        read_glue(glue_dirs / "MNLI/test_matched.tsv", GLUE_TASKS["mnli"])  # labelled by default


def test_saved_model_is_one_tp1_file_with_the_run_config_and_task(mnli_finetuned):
    from safetensors import safe_open

    from shardlm.checkpoint.state import consolidated_config

    path = mnli_finetuned / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata, keys = f.metadata(), set(f.keys())
        embedding = f.get_slice("model/bert.wte.weight").get_shape()
    assert metadata["format"] == "shardlm-finetuned-v1"
    assert (metadata["task"], metadata["num_classes"]) == ("mnli", "3")
    assert json.loads(metadata["finetune"])["seq_length"] == 32
    config = consolidated_config(path)
    assert config.model.arch == "bert" and config.model.vocab_size == 30522 and config.train.seed == 3
    assert embedding == [30522, 32]  # the vocabulary padding (to 30,592) is dropped
    assert {"model/classify.weight", "model/classify.bias", "model/bert.pooler.weight"} <= keys
    assert not any("lm_" in k or "sentence_head" in k for k in keys)  # pretraining heads are not kept
    assert sorted(p.name for p in mnli_finetuned.iterdir()) == ["metrics.json", "model.safetensors", "predictions"]
    assert json.loads((mnli_finetuned / "metrics.json").read_text())["model"] == str(path)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # shareable like any new file (safetensors makes 0600)


def test_reloaded_model_gives_the_same_dev_accuracy_and_predictions(mnli_finetuned, glue_dirs, tmp_path):
    assert reload_cli(mnli_finetuned / "model.safetensors", glue_dirs / "MNLI", tmp_path) == 0
    trained = json.loads((mnli_finetuned / "metrics.json").read_text())
    reloaded = json.loads((tmp_path / "metrics.json").read_text())
    assert reloaded["seq_length"] == 32  # the saved model's input length is the default
    [record] = reloaded["epochs"]
    assert (record["epoch"], record["steps"]) == (0, 0)
    for name in ("dev_matched", "dev_mismatched"):
        assert record[name] == trained["epochs"][-1][name]
    names = ["dev_matched", "dev_mismatched", "test_matched", "test_mismatched"]
    assert sorted(reloaded["predictions"]) == sorted(trained["predictions"]) == sorted(names)
    for name in names:
        assert (tmp_path / f"predictions/{name}.tsv").read_bytes() == \
            (mnli_finetuned / f"predictions/{name}.tsv").read_bytes(), name
    assert reloaded["predictions"]["dev_matched"]["accuracy"] == record["dev_matched"]["accuracy"]


def test_reloading_at_tp2_and_dp2_gives_the_same_predictions(mnli_finetuned, two_process_runs):
    results, out = two_process_runs
    assert results[0]["codes"] == {2: 0, 1: 0}
    for tp, dp in ((2, 1), (1, 2)):
        metrics = json.loads((out / f"tp{tp}/metrics.json").read_text())
        assert (metrics["tensor_parallel"], metrics["data_parallel"]) == (tp, dp)
        for name in ("dev_matched", "dev_mismatched", "test_matched", "test_mismatched"):
            assert (out / f"tp{tp}/predictions/{name}.tsv").read_bytes() == \
                (mnli_finetuned / f"predictions/{name}.tsv").read_bytes(), f"TP={tp} DP={dp} {name}"


def test_saving_at_tp2_and_dp2_gives_back_the_same_tensors_from_rank_0_only(mnli_finetuned, two_process_runs):
    from safetensors.torch import load_file

    results, out = two_process_runs
    original = load_file(str(mnli_finetuned / "model.safetensors"))
    for tp in (2, 1):
        resaved = load_file(str(out / f"tp{tp}/model.safetensors"))
        assert resaved.keys() == original.keys()
        assert all(torch.equal(resaved[k], original[k]) for k in original), f"TP={tp}"
    names = ["model.safetensors"] + [f"predictions/{n}.tsv" for n in
                                     ("dev_matched", "dev_mismatched", "test_matched", "test_mismatched")]
    files = [f for f in results[0]["renamed"] if not f.endswith("metrics.json")]  # rewritten after each stage
    assert sorted(files) == sorted(f"tp{tp}/{n}" for tp in (2, 1) for n in names)
    assert {f"tp{tp}/metrics.json" for tp in (2, 1)} <= set(results[0]["renamed"])
    assert results[1]["renamed"] == []  # rank 1 writes nothing


def test_model_saved_from_tp2_shards_reloads_at_tp1_with_the_same_predictions(race_tp2, race_dir, tmp_path):
    metrics, out = race_tp2
    code = main(["finetune", "race", "--checkpoint", str(out / "model.safetensors"), "--data", str(race_dir),
                 "--output-dir", str(tmp_path), "--epochs", "0", "--predict", "--limit-eval", "4"])
    assert code == 0
    reloaded = json.loads((tmp_path / "metrics.json").read_text())
    assert reloaded["tensor_parallel"] == 1 and reloaded["epochs"][0]["dev"] == metrics["epochs"][0]["dev"]
    for name in ("dev", "test"):
        assert (tmp_path / f"predictions/{name}.tsv").read_bytes() == (out / f"predictions/{name}.tsv").read_bytes()


def test_mnli_predictions_are_glue_submission_files(mnli_finetuned, glue_dirs):
    labels = {"contradiction", "entailment", "neutral"}
    for name, count in (("test_matched", 7), ("test_mismatched", 5)):
        header, rows = read_predictions(mnli_finetuned / f"predictions/{name}.tsv")
        assert header == ["index", "prediction"]
        assert [r[0] for r in rows] == [str(500 + 3 * k) for k in range(count)]  # the test file's own index
        assert all(len(r) == 2 and r[1] in labels for r in rows)
    header, rows = read_predictions(mnli_finetuned / "predictions/dev_mismatched.tsv")
    assert header == ["index", "prediction"] and [r[0] for r in rows] == [str(i) for i in range(9)]  # "-" row left out
    metrics = json.loads((mnli_finetuned / "metrics.json").read_text())
    assert metrics["predictions"]["test_matched"] == {"file": str(mnli_finetuned / "predictions/test_matched.tsv"),
                                                      "examples": 7}


def test_qqp_predictions_are_0_or_1_by_id(checkpoint, glue_dirs, tmp_path):
    finetune_cli("qqp", checkpoint, glue_dirs / "QQP", tmp_path, "--epochs", "1", "--predict")
    header, rows = read_predictions(tmp_path / "predictions/test.tsv")
    assert header == ["index", "prediction"] and [r[0] for r in rows] == [str(900 + k) for k in range(6)]
    assert all(r[1] in ("0", "1") for r in rows)
    assert len(read_predictions(tmp_path / "predictions/dev.tsv")[1]) == 10


def test_race_predictions_name_each_question_and_answer_a_letter(race_tp2, race_dir):
    metrics, out = race_tp2
    header, rows = read_predictions(out / "predictions/test.tsv")
    questions = read_race(race_dir, "test")
    assert header == ["id", "answer"] and [r[0] for r in rows] == [e.source for e in questions]
    assert len({r[0] for r in rows}) == len(rows) and all(r[1] in ("A", "B", "C", "D") for r in rows)
    test = metrics["predictions"]["test"]  # RACE's test answers are public: scored too
    right = sum("ABCD".index(r[1]) == e.label for r, e in zip(rows, questions))
    assert test["examples"] == len(questions) and test["accuracy"] == right / len(questions)
    assert set(test["levels"]) == {"high", "middle"}


def test_model_and_prediction_files_are_replaced_atomically(mnli_finetuned, glue_dirs, tmp_path, monkeypatch):
    """Each file is written whole under a temporary name, then renamed over the old one in one step."""
    (tmp_path / "predictions").mkdir()
    finals = [tmp_path / "model.safetensors"] + [tmp_path / f"predictions/{n}.tsv"
                                                 for n in ("dev_matched", "test_matched", "test_mismatched")]
    for path in finals:
        path.write_text("old")
    renames, real_replace = {}, os.replace

    def spy(src, dst):
        before = open(dst).read() if os.path.exists(dst) else None  # the destination just before the rename
        renames[os.fspath(dst)] = (os.fspath(src), before)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    assert reload_cli(mnli_finetuned / "model.safetensors", glue_dirs / "MNLI", tmp_path, "--save") == 0
    for path in finals:
        src, before = renames[str(path)]
        assert before == "old" and src == str(path.with_name(f".{path.name}.tmp")), path
        assert path.read_bytes() != b"old"
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary file left


# ------------------------------------------------------------------------------- reload errors

def test_model_of_another_task_is_refused_in_one_line(mnli_finetuned, glue_dirs, capsys):
    err = one_line_error(capsys, ["finetune", "qqp", "--checkpoint", str(mnli_finetuned / "model.safetensors"),
                                  "--data", str(glue_dirs / "QQP"), "--epochs", "0"])
    assert "is a model fine-tuned on mnli, not qqp" in err


def test_epochs_0_needs_a_finetuned_model(checkpoint, glue_dirs, capsys):
    err = one_line_error(capsys, ["finetune", "mnli", "--checkpoint", str(checkpoint), "--data",
                                  str(glue_dirs / "MNLI"), "--epochs", "0"])
    assert "--epochs 0 evaluates a fine-tuned model" in err


def test_missing_test_files_are_a_note_and_dev_predictions_are_still_written(mnli_finetuned, glue_dirs, tmp_path,
                                                                             capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("dev_matched.tsv", "dev_mismatched.tsv", "test_matched.tsv"):  # no train.tsv needed either
        (data / name).write_bytes((glue_dirs / "MNLI" / name).read_bytes())
    assert reload_cli(mnli_finetuned / "model.safetensors", data, tmp_path / "one") == 0
    assert f"note: no test file test_mismatched.tsv in {data}; no predictions for it" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "one/predictions").iterdir()) == [
        "dev_matched.tsv", "dev_mismatched.tsv", "test_matched.tsv"]
    (data / "test_matched.tsv").unlink()
    assert reload_cli(mnli_finetuned / "model.safetensors", data, tmp_path / "none") == 0
    assert ("note: no test file test_matched.tsv, test_mismatched.tsv in "
            f"{data}; writing dev predictions only") in capsys.readouterr().out
    written = sorted(p.name for p in (tmp_path / "none/predictions").iterdir())
    assert written == ["dev_matched.tsv", "dev_mismatched.tsv"]
