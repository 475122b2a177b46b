"""SQuAD fine-tuning: it beats the untrained model on a held-out article, learns when there is no answer,
the command writes the official prediction files and a model that reloads, and TP=2 and DP=2 give
equal losses and predictions (one 2-process world for the whole module).

Data and model as in `test_squad.py`: the shared sample of the SQuAD 2.0 dev file (articles 0-3 train,
article 4 evaluates) and a tiny BERT (2 layers, hidden 64, the real WordPiece vocabulary).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch.distributed as dist
from finetune_helpers import bert_vocab, untrained_bert_checkpoint

from shardlm.cli import main
from shardlm.finetune.squad_data import read_squad
from shardlm.finetune.squad_decode import DecodeSettings
from shardlm.finetune.squad_metrics import (
    squad_scores,
)
from shardlm.parallel import ParallelContext

from multiproc import run_workers

SEQ = 128
TRAIN_ARTICLES, DEV_ARTICLES = "0:4", "4:"


@pytest.fixture(scope="module")
def squad_file(data_dir):
    return data_dir / "squad/dev-v2.0-first5.json"


@pytest.fixture(scope="module")
def vocab(data_dir):
    return bert_vocab(data_dir)


@pytest.fixture(scope="module")
def tokenizer(vocab):
    from shardlm.data.tokenizers import build_tokenizer

    return build_tokenizer("bert", vocab)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, vocab):
    """An untrained tiny BERT saved as a shardlm checkpoint whose config names the BERT vocabulary."""
    return untrained_bert_checkpoint(tmp_path_factory.mktemp("squad_bert"), vocab, hidden_size=64, seq_length=SEQ)


# ---------------------------------------------------------------------------------- fine-tuning

def squad_run(tokenizer, ctx, version: str, seq_length: int = SEQ):
    from shardlm.finetune.squad import SquadRun

    return SquadRun(tokenizer, ctx, seq_length, max_query_length=24, doc_stride=32,
                    decode=DecodeSettings(version), batch_size=64)


def span_model(checkpoint, ctx, seed: int = 0):
    from shardlm.checkpoint import load_model
    from shardlm.finetune.heads import SpanModel

    bert, _ = load_model(checkpoint, ctx)
    ctx.seed(seed)
    return SpanModel(bert, seed)


def finetune_squad(model, run, train, dev, epochs: int, batch_size: int = 16, micro_batch_size: int = 0):
    from shardlm.finetune.heads import span_loss
    from shardlm.finetune.loop import FinetuneSettings, finetune

    settings = FinetuneSettings(epochs=epochs, batch_size=batch_size, micro_batch_size=micro_batch_size, lr=1e-3,
                                warmup=0.0, seed=0, eval_batch_size=64)
    return finetune(model, run.ctx, run.features(train, training=True).data, {"dev": dev}, settings,
                    loss_fn=span_loss, evaluate_fn=run.evaluate)


def test_span_loss_is_the_mean_of_start_and_end_cross_entropies():
    import torch

    from shardlm.finetune.heads import span_loss

    logits = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [2.0, 3.0]]])  # (1, 3 positions, 2)
    start = np.log(np.exp([0.0, 1.0, 2.0]).sum()) - 1.0  # right start: position 1
    end = np.log(np.exp([1.0, 0.0, 3.0]).sum()) - 3.0  # right end: position 2
    assert span_loss(logits, torch.tensor([[1, 2]])).item() == pytest.approx((start + end) / 2, rel=1e-6)


@pytest.mark.slow
def test_finetuning_v11_beats_the_untrained_model_on_a_held_out_article(checkpoint, squad_file, tokenizer):
    ctx = ParallelContext.single()
    model = span_model(checkpoint, ctx)
    run = squad_run(tokenizer, ctx, "1.1")
    dev = run.evaluation_set(read_squad(squad_file, "1.1", DEV_ARTICLES))
    before = run.evaluate(model, "dev", dev)
    history = finetune_squad(model, run, read_squad(squad_file, "1.1", TRAIN_ARTICLES), dev, epochs=3)
    after = history[-1]["dev"]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 1.0
    assert (before["examples"], after["examples"]) == (124, 124)
    assert after["f1"] > before["f1"] + 2.0, (before, after)  # measured: 4.6 -> 8.9
    assert after["exact_match"] >= before["exact_match"]


@pytest.mark.slow
def test_finetuning_v20_learns_when_there_is_no_answer(checkpoint, squad_file, tokenizer):
    ctx = ParallelContext.single()
    model = span_model(checkpoint, ctx)
    run = squad_run(tokenizer, ctx, "2.0")
    dev = run.evaluation_set(read_squad(squad_file, "2.0", DEV_ARTICLES))
    before = run.evaluate(model, "dev", dev)
    history = finetune_squad(model, run, read_squad(squad_file, "2.0", "0:1"), dev, epochs=1)
    after = history[-1]["dev"]
    assert (after["HasAns_total"], after["NoAns_total"]) == (124, 123)
    # measured: EM 3.2 -> 49.8, F1 5.5 -> 49.8 (every question answered "no answer")
    assert after["exact"] > before["exact"] + 20.0 and after["f1"] > before["f1"] + 20.0, (before, after)
    assert after["NoAns_exact"] > before["NoAns_exact"]
    assert {"best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"} <= set(after)


# ------------------------------------------------------------------ the command, saving, reloading

def squad_cli(checkpoint, squad_file, out, *extra) -> int:
    """`shardlm finetune squad` on the shared sample: the Normans article trains, Victoria evaluates."""
    return main(["finetune", "squad", "--checkpoint", str(checkpoint), "--data", str(squad_file), "--dev",
                 str(squad_file), "--dev-articles", DEV_ARTICLES, "--limit-eval", "40", "--seq-length", "64",
                 "--output-dir", str(out), *extra])


@pytest.fixture(scope="module")
def squad_finetuned(checkpoint, squad_file, tmp_path_factory):
    """SQuAD 2.0 fine-tuned by the command (TP=1), saved and predicting: OUTPUT_DIR."""
    out = tmp_path_factory.mktemp("squad_finetuned")
    assert squad_cli(checkpoint, squad_file, out, "--version", "2.0", "--train-articles", "0:1", "--limit-train",
                     "96", "--max-qa-length", "16", "--doc-stride", "24", "--epochs", "2", "--batch-size", "16",
                     "--lr", "1e-3", "--save", "--predict") == 0
    return out


def test_cli_writes_official_prediction_files_and_their_scores(squad_finetuned, squad_file, capsys):
    out = squad_finetuned
    dev = read_squad(squad_file, "2.0", DEV_ARTICLES)[:40]
    predictions = json.loads((out / "predictions/predictions.json").read_text())
    odds = json.loads((out / "predictions/null_odds.json").read_text())
    assert list(predictions) == list(odds) == [e.id for e in dev]  # {id: text}, {id: odds}, question order
    assert all(isinstance(t, str) for t in predictions.values()) and all(isinstance(o, float) for o in odds.values())
    assert all((t == "") == (odds[q] > 0.0) for q, t in predictions.items())  # threshold 0
    assert all(t in e.context for e, t in zip(dev, predictions.values()))  # cut from the context itself
    metrics = json.loads((out / "metrics.json").read_text())
    official = squad_scores(dev, predictions, "2.0", odds)  # what evaluate-v2.0.py computes from the files
    listed = metrics["predictions"]["dev"]
    assert {k: listed[k] for k in official} == official
    last = metrics["epochs"][-1]["dev"]
    assert {k: last[k] for k in official} == official and last["examples"] == 40 and last["windows"] > 40
    assert metrics["epochs"][-1]["train_loss"] < metrics["epochs"][0]["train_loss"]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "model.safetensors", "predictions"]


def test_saved_model_reloads_with_its_input_settings_and_predicts_the_same(squad_finetuned, squad_file, tmp_path):
    from shardlm.checkpoint.state import safetensors_metadata
    from shardlm.finetune.saved import finetuned_info

    info = finetuned_info(squad_finetuned / "model.safetensors")
    assert (info.task, info.num_classes, info.seq_length, info.max_qa_length) == ("squad", 2, 64, 16)
    details = json.loads(safetensors_metadata(squad_finetuned / "model.safetensors")["finetune"])
    assert (details["squad_version"], details["doc_stride"]) == ("2.0", 24)
    # reloaded without --version, --max-qa-length, --doc-stride: the saved model's are the defaults
    assert squad_cli(squad_finetuned / "model.safetensors", squad_file, tmp_path, "--epochs", "0", "--predict") == 0
    reloaded = json.loads((tmp_path / "metrics.json").read_text())
    trained = json.loads((squad_finetuned / "metrics.json").read_text())
    assert reloaded["epochs"][0]["dev"] == trained["epochs"][-1]["dev"]  # 2.0 (best_f1...) without --version
    for name in ("predictions.json", "null_odds.json"):
        assert (tmp_path / "predictions" / name).read_bytes() == (squad_finetuned / "predictions" / name).read_bytes()


# ----------------------------------------------------------------------------- TP and DP layouts

def layout_run(checkpoint, squad_file, tokenizer, ctx: ParallelContext) -> dict:
    """SQuAD 2.0 on 48 questions, 1 epoch (6 optimizer steps), micro-batches of 2; every layout must
    agree. The tiny model may answer "no answer" everywhere by then, so the spans are compared too:
    `spans` are the answers decoded with an infinite no-answer threshold."""
    model = span_model(checkpoint, ctx, seed=1)
    run = squad_run(tokenizer, ctx, "2.0", seq_length=64)
    dev = run.evaluation_set(read_squad(squad_file, "2.0", DEV_ARTICLES)[:30])
    history = finetune_squad(model, run, read_squad(squad_file, "2.0", TRAIN_ARTICLES)[:48], dev, epochs=1,
                             batch_size=8, micro_batch_size=2)
    predictions, odds = run.answers(model, dev)
    run.decode = DecodeSettings("2.0", null_threshold=float("inf"))
    spans, _ = run.answers(model, dev)
    return {"losses": [h["train_loss"] for h in history], "dev": history[-1]["dev"], "predictions": predictions,
            "odds": odds, "spans": spans}


def worker_two_processes(checkpoint, squad_file, vocab, saved_model, out):
    """On 2 ranks: fine-tune at TP=2 and at TP=1 x DP=2, and reload the saved model with the command
    at both layouts. Returns rank 0's results."""
    from shardlm.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("bert", vocab)
    runs, codes = {}, {}
    for tp in (2, 1):
        runs[tp] = layout_run(checkpoint, squad_file, tokenizer, ParallelContext.from_process_group(tp))
        codes[tp] = squad_cli(saved_model, squad_file, out / f"tp{tp}", "--epochs", "0", "--predict",
                              "--tensor-parallel", str(tp), "--eval-batch-size", "7")
    return {"runs": runs, "codes": codes} if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def two_process_runs(checkpoint, squad_file, vocab, squad_finetuned, tmp_path_factory):
    out = tmp_path_factory.mktemp("squad_two_process")
    results = run_workers(2, worker_two_processes, checkpoint, squad_file, vocab,
                          squad_finetuned / "model.safetensors", out)
    return results[0], out


@pytest.mark.slow
def test_tp2_and_dp2_finetuning_give_the_single_process_losses_and_answers(checkpoint, squad_file, tokenizer,
                                                                            two_process_runs):
    reference = layout_run(checkpoint, squad_file, tokenizer, ParallelContext.single())
    assert len(set(reference["spans"].values())) > 10  # answers differ between questions
    for tp, run in two_process_runs[0]["runs"].items():
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), f"TP={tp}"
        assert run["predictions"] == reference["predictions"] and run["spans"] == reference["spans"], f"TP={tp}"
        assert run["odds"] == pytest.approx(reference["odds"], abs=1e-4), f"TP={tp}"
        assert run["dev"] == pytest.approx(reference["dev"]), f"TP={tp}"


@pytest.mark.slow
def test_saved_model_predicts_the_same_at_tp2_and_dp2(squad_finetuned, two_process_runs):
    results, out = two_process_runs
    assert results["codes"] == {2: 0, 1: 0}
    for tp, dp in ((2, 1), (1, 2)):
        metrics = json.loads((out / f"tp{tp}/metrics.json").read_text())
        assert (metrics["tensor_parallel"], metrics["data_parallel"]) == (tp, dp)
        assert (out / f"tp{tp}/predictions/predictions.json").read_bytes() == \
            (squad_finetuned / "predictions/predictions.json").read_bytes(), f"TP={tp}"
        odds = json.loads((out / f"tp{tp}/predictions/null_odds.json").read_text())
        assert odds == pytest.approx(json.loads((squad_finetuned / "predictions/null_odds.json").read_text()),
                                     abs=1e-4)
