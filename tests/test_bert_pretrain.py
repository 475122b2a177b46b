"""BERT end to end from the command line: `shardlm preprocess --tokenizer bert --split-sentences`,
`shardlm train configs/bert-tiny.toml` (model.arch = "bert"), then `shardlm finetune race` from the
checkpoint it saved. The shipped BERT configs validate at the paper's GPU counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardlm.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, data_dir):
    folder = tmp_path_factory.mktemp("bert_e2e")
    text = (data_dir / "corpus/pride_and_prejudice_pg1342.txt").read_text(encoding="utf-8")
    (folder / "novel.txt").write_text(text[20_000:120_000], encoding="utf-8")
    vocab = data_dir / "vocab/bert-base-uncased/vocab.txt"
    assert main(["preprocess", "--input", str(folder / "novel.txt"), "--output-prefix", str(folder / "novel"),
                 "--tokenizer", "bert", "--vocab-file", str(vocab), "--split-sentences", "--no-progress"]) == 0
    run = folder / "run"
    code = main(["train", str(ROOT / "configs/bert-tiny.toml"), f'data.prefixes=["{folder / "novel"}"]',
                 "model.hidden_size=32", "model.seq_length=64", "train.steps=10", "train.micro_batch_size=8",
                 "train.global_batch_size=8", "train.warmup_steps=2", "train.lr=1e-2", "log.interval=1",
                 "log.progress=false", "log.tensorboard=false", "log.plot=false", "--run-dir", str(run)])
    assert code == 0
    return run


def test_bert_pretraining_runs_from_the_cli_and_lowers_the_loss(pretrained):
    lines = [json.loads(line) for line in (pretrained / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in lines if "loss" in m]
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 1.0
    assert any("val_loss" in m for m in lines)
    config = json.loads((pretrained / "config.json").read_text())
    assert config["model"]["arch"] == "bert" and config["model"]["vocab_size"] == 30522
    assert (pretrained / "checkpoints").is_dir()


def test_finetune_race_from_the_pretrained_checkpoint(pretrained, data_dir, tmp_path):
    code = main(["finetune", "race", "--checkpoint", str(pretrained / "checkpoints"), "--data",
                 str(data_dir / "race/RACE"), "--output-dir", str(tmp_path), "--epochs", "1", "--batch-size", "4",
                 "--limit-train", "8", "--limit-eval", "8", "--seq-length", "64"])
    assert code == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["train_examples"] == 8 and metrics["epochs"][0]["steps"] == 2
    assert metrics["epochs"][0]["dev"]["examples"] == 8


@pytest.mark.parametrize("name,world,accumulation", [("bert-336m", 128, 1), ("bert-1.3b", 256, 1),
                                                     ("bert-3.9b", 512, 2), ("bert-tiny", 1, 2)])
def test_shipped_bert_configs_have_the_paper_recipe(name, world, accumulation):
    from shardlm.config import load_config
    from shardlm.validation import validate

    config = load_config(ROOT / "configs" / f"{name}.toml")
    assert validate(config, world, check_paths=False) == accumulation
    assert config.model.arch == "bert" and config.data.tokenizer == "bert"
    if name != "bert-tiny":
        t = config.train
        assert (t.global_batch_size, t.lr, t.warmup_steps, t.steps, t.decay_style) == (1024, 1e-4, 10_000,
                                                                                        2_000_000, "linear")
        assert config.model.vocab_size == 30522 and config.model.layernorm_order == "pre"


def test_ln_order_script_trains_both_orders_and_plots(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ln_order_experiment", ROOT / "scripts/ln_order_experiment.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    output = tmp_path / "curves.png"
    assert script.main(["--layers", "2", "--hidden", "32", "--steps", "4", "--batch", "4", "--seq-length", "32",
                        "--work-dir", str(tmp_path / "work"), "--output", str(output)]) == 0
    assert output.stat().st_size > 1000
    summary = json.loads(output.with_suffix(".json").read_text())
    assert len(summary["post"]["losses"]) == len(summary["pre"]["losses"]) == 4
    assert summary["post"]["first_train_loss"] != summary["pre"]["first_train_loss"]  # the orders differ


@pytest.mark.parametrize("nsp,whole_word", [(True, False), (False, True)])
def test_bert_data_options_reach_the_dataset(pretrained, nsp, whole_word):
    from shardlm.config import load_config
    from shardlm.data.tokenizers import build_tokenizer_for
    from shardlm.training.data import build_datasets

    prefix = pretrained.parent / "novel"
    config = load_config(ROOT / "configs/bert-tiny.toml", [f'data.prefixes=["{prefix}"]', "model.seq_length=64",
                                                            f"data.next_sentence_prediction={str(nsp).lower()}",
                                                            f"data.whole_word_masking={str(whole_word).lower()}"])
    train, _ = build_datasets(config.data, build_tokenizer_for(config.data), 64, 1, 16, 0, arch="bert")
    assert train.next_sentence_prediction is nsp
    assert train.masking.whole_word is whole_word and train.masking.max_ngram == (3 if whole_word else 1)
    assert set(int(train[i]["is_random"]) for i in range(16)) <= {0, 1}
