"""Fine-tuning under TP and DP, and the fine-tuned model kept (`--save`, reloaded at any TP size) and
used (`--predict` files).

The tiny BERT and GLUE files are those of `test_finetune.py` (`finetune_helpers`). Two processes are
spawned twice per module: once by `run_workers` (function-level layouts and CLI reloads at TP=2 and
DP=2, `two_process_runs`) and once by the CLI's own `--nproc-per-node 2` (`race_tp2`).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from finetune_helpers import bert_vocab, finetune_cli, one_line_error, untrained_bert_checkpoint, write_glue_dirs

from shardlm.cli import main
from shardlm.errors import UserError
from shardlm.finetune.glue import GLUE_TASKS, read_glue
from shardlm.finetune.heads import MultipleChoiceModel
from shardlm.finetune.loop import FinetuneSettings, finetune
from shardlm.finetune.race import encode_race, read_race
from shardlm.parallel import ParallelContext

from multiproc import run_workers

SEQ = 64


@pytest.fixture(scope="module")
def vocab(data_dir):
    return bert_vocab(data_dir)


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
