"""Reward modeling from the command line: `shardlm train` with `[reward]` from a Hugging Face chat model's directory
(the head starts new), the run's line, its accuracy and margin in the log, the held-out accuracy at each validation
and the plot; `shardlm convert --to-hf` writes a `Qwen3ForSequenceClassification` whose scores (transformers'
pooling: the last token that is not the pad token) are the run's own rewards (`shardlm.checkpoint.load_model`) within
1e-5, and a second run started from that export reads its head back (its first loss equals the first run's last
step's pairs scored again); a run stopped by SIGTERM after step 2 resumes to the straight run's losses bitwise;
`configs/reward-tiny-qwen3.toml`; a GPT reward model's export as
`GPT2ForSequenceClassification`; bad settings and records as one-line errors that leave nothing behind."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from chat_cache import template_parsed_once  # noqa: F401 (parses the chat template once per module)
from test_preference_cli import chat_model_and_pairs

from shardlm.checkpoint import load_model
from shardlm.cli import main
from shardlm.parallel import ParallelContext
from shardlm.reward.head import SCORE

CONFIG = """
[model]
seq_length = 512

[sft]
data = ["{records}"]
valid_fraction = 0.1
overflow = "drop"  # the pairs longer than a row left out: 13 training pairs

[reward]
loss = "bradley_terry"
center_rewards_coefficient = 0.01

[train]
precision = "fp32"
micro_batch_size = 2
global_batch_size = 4
steps = 3
lr = 2e-2
warmup_steps = 1
eval_interval = 0
eval_iters = 4

[log]
interval = 1
progress = false
tensorboard = false
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    return chat_model_and_pairs(tmp_path_factory.mktemp("reward_cli"), data_dir, CONFIG)


@pytest.fixture(scope="module")
def run(setup):
    run_dir = setup["root"] / "run"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}",
                     "--run-dir", str(run_dir)]) == 0
    return {"dir": run_dir, "printed": out.getvalue()}


def records_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_reward_run_logs_its_accuracy_and_held_out_figures(run):
    printed = run["printed"]
    assert "reward model: bradley_terry loss over 13 training pairs, rewards centered (coefficient 0.01), no " \
           "margins" in printed, printed
    steps = [r for r in records_of(run["dir"]) if "accuracy" in r]
    assert len(steps) == 3 and all(0 <= s["accuracy"] <= 1 and s["min_reward"] <= s["max_reward"] for s in steps)
    assert "| margin " in printed and "| accuracy " in printed
    final = [r for r in records_of(run["dir"]) if "val_loss" in r][-1]
    assert 0 <= final["val_accuracy"] <= 1 and "val_margin" in final
    assert "accuracy" in printed.split("validation at step 3:")[1].splitlines()[0]
    assert (run["dir"] / "loss_curve.png").stat().st_size > 0


def test_the_export_is_a_sequence_classifier_scoring_as_the_run(setup, run, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(out), "--checkpoint", str(run["dir"] / "checkpoints")]) == 0
    assert "Qwen3ForSequenceClassification" in capsys.readouterr().out
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    pairs = [json.loads(line) for line in setup["records"].read_text().splitlines()[:3]]
    texts = [tokenizer.apply_chat_template(p["prompt"] + p[side], tokenize=False)
             for p in pairs for side in ("chosen", "rejected")]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    model, _ = load_model(run["dir"] / "checkpoints", ParallelContext.single())
    ours = []
    with torch.no_grad():
        theirs = hf(**batch).logits.squeeze(-1)
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            hidden = model(ids[mask.bool()].unsqueeze(0), hidden_only=True)
            ours.append(getattr(model, SCORE)(hidden[0, -1]).item())
    assert torch.allclose(theirs, torch.tensor(ours), rtol=1e-5, atol=1e-5), (theirs, ours)
    assert theirs.std() > 1e-3  # the sequences score differently

    # a reward run from the export reads its head: its first step's loss is the trained model's, not a new head's
    again = tmp_path / "again"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(setup["config"]), f"checkpoint.init_from={out}", "train.steps=1",
                     "checkpoint.save=false", "--run-dir", str(again)]) == 0
    first = records_of(again)[0]["loss"]
    fresh = records_of(run["dir"])[0]["loss"]
    assert abs(first - fresh) > 1e-3, (first, fresh)


def test_the_tiny_reward_config_trains(setup, tmp_path, capsys):
    code = main(["train", "configs/reward-tiny-qwen3.toml", f"sft.data=[\"{setup['records']}\"]",
                 "model.seq_length=512", "sft.valid_fraction=0.1", "train.steps=1", "train.eval_interval=0",
                 "train.eval_iters=1", "model.dropout=0.2", "log.progress=false", "log.plot=false",
                 "log.tensorboard=false", "checkpoint.save=false", "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "dropout off for reward (model.dropout=0.2 set to 0" in out.out + out.err


def bad_margin(workdir: Path, records: Path) -> list[str]:
    lines = records.read_text().splitlines()
    first = json.loads(lines[0]) | {"margin": "high"}
    path = workdir / "bad.jsonl"
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    return [f"sft.data=[\"{path}\"]"]


def two_labels(workdir: Path, hf: Path) -> list[str]:
    from transformers import AutoConfig, Qwen3ForSequenceClassification

    config = AutoConfig.from_pretrained(hf, num_labels=2)
    Qwen3ForSequenceClassification(config).save_pretrained(workdir / "classifier")
    return [f"checkpoint.init_from={workdir / 'classifier'}"]


ERRORS = [
    ("unknown loss", lambda w, s: ['reward.loss="pairwise"'], 'reward.loss="pairwise" must be "bradley_terry"'),
    ("negative centering", lambda w, s: ["reward.center_rewards_coefficient=-1"],
     "reward.center_rewards_coefficient=-1.0 must be >= 0 (0: off)"),
    ("with a preference loss", lambda w, s: ['preference.loss="sigmoid"'],
     "reward, preference, rl and distill are different losses"),
    ("a margin that is no number", lambda w, s: bad_margin(w, s["records"]), "'margin' must be a number, got 'high'"),
    ("a classifier of two labels", lambda w, s: two_labels(w, s["hf"]),
     "is a Qwen3ForSequenceClassification with 2 labels; a reward model has one (num_labels=1)"),
]


@pytest.mark.parametrize("name,extra,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_reward_errors_are_one_line(setup, tmp_path, capsys, name, extra, message):
    workdir = tmp_path / "case"
    workdir.mkdir()
    args = extra(workdir, setup)
    capsys.readouterr()  # (what building a case's files printed)
    code = main(["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", *args,
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing is written before the input is checked"


def test_a_reward_model_with_multi_token_prediction_is_refused():
    from shardlm.config import load_config
    from shardlm.reward import check_reward

    config = load_config(None, ['reward.loss="bradley_terry"', 'sft.data=["x.jsonl"]', "model.mtp_layers=1",
                                'model.arch="llama"'])
    assert check_reward(config) == "a reward model scores sequences, it predicts no tokens; set model.mtp_layers=0"


def test_a_gpt_reward_model_exports_as_gpt2_for_sequence_classification(tmp_path, capsys):
    """A GPT reward model (the head on a GPT-2 trunk, consolidated with `reward.loss` set) exports as transformers'
    `GPT2ForSequenceClassification`, whose scores of padded rows equal the model's own within 1e-5."""
    import dataclasses

    from transformers import GPT2ForSequenceClassification

    from shardlm.checkpoint.files import write_consolidated
    from shardlm.config import load_config
    from shardlm.models import build_model
    from shardlm.reward.head import add_score_head

    config = load_config(None, ['model.arch="gpt"', "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                                "model.seq_length=32", "model.vocab_size=96", 'reward.loss="bradley_terry"'])
    ctx = ParallelContext.single()
    model = add_score_head(build_model(config.model, ctx, seed=0), seed=0).eval()
    with torch.no_grad():
        model.score.weight.normal_()
    tensors = {f"model/{name}": p.detach().clone().contiguous() for name, p in model.named_parameters()}
    path = write_consolidated(tmp_path / "reward.safetensors", tensors, dataclasses.asdict(config))
    assert main(["convert", "--to-hf", str(tmp_path / "hf"), "--checkpoint", str(path)]) == 0
    assert "GPT2ForSequenceClassification" in capsys.readouterr().out
    hf = GPT2ForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    hf.config.pad_token_id = 0  # (no tokenizer files here: rows of one length need no padding id's search)
    ids = torch.randint(1, 96, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits.squeeze(-1)
        ours = model.score(model(ids, hidden_only=True)[:, -1]).squeeze(-1)
    assert torch.allclose(theirs, ours, rtol=1e-5, atol=1e-5), (theirs, ours)


def test_a_stopped_reward_run_resumes_as_the_straight_run(setup, tmp_path):
    """With dropout on (reward.disable_dropout=false, model.dropout 0.2: the generators' states must come back too),
    the same command stopped by SIGTERM after step 2 (it saves), then run again, resumes from step 2 (the head and the
    optimizer's moments from the checkpoint) and ends as the straight run: the same losses, bitwise."""
    from shardlm.signals import TERMINATED_EXIT_CODE
    from shardlm.training.run import StopSignals

    dropout = ["reward.disable_dropout=false", "model.dropout=0.2", "train.eval_interval=0", "sft.valid_fraction=0"]
    straight = ["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", *dropout]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(straight + ["--run-dir", str(tmp_path / "straight")]) == 0
    base = straight + ["--run-dir", str(tmp_path / "r")]
    checks = iter([False, False, True])  # the check before each step: SIGTERM arrives during step 2
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        patch.setattr(StopSignals, "agree_to_stop", lambda self, ctx: next(checks))
        with pytest.raises(SystemExit) as stop:
            main(base)
    assert stop.value.code == TERMINATED_EXIT_CODE
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(base) == 0
    assert "resumed from" in out.getvalue()
    losses = [r["loss"] for r in records_of(tmp_path / "r") if "accuracy" in r]
    assert losses == [r["loss"] for r in records_of(tmp_path / "straight") if "accuracy" in r], losses
    assert len(losses) == 3
    assert json.loads((tmp_path / "r" / "config.json").read_text())["model"]["dropout"] == 0.2  # it trained with it
