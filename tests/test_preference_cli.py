"""Preference optimization from the command line: `shardlm train` with `[preference]` starting from a Hugging Face
chat model's directory, the reference precomputed and saved with the run, read back on a restart, the rewards in
the log and the plot, the model exported with `convert --to-hf`; `configs/dpo-tiny-qwen3.toml` with
`scripts/dolly_pairs.py`; bad records and settings as one-line errors that leave nothing behind."""

from __future__ import annotations

import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llama_reference import tiny_qwen3_chat

from shardlm.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[model]
seq_length = 512

[sft]
data = ["{records}"]
valid_fraction = 0.1

[preference]
loss = "sigmoid"
beta = 0.1

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
    root = tmp_path_factory.mktemp("preference_cli")
    tiny_qwen3_chat(root / "hf", data_dir, max_positions=512)
    source = root / "dolly.jsonl"
    source.write_text("\n".join((data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()[:31]) + "\n")
    records = root / "pairs.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "dolly_pairs.py"), str(source), str(records)],
                          capture_output=True, text=True, check=True)
    assert "30 pairs" in done.stdout
    path = root / "dpo.toml"
    path.write_text(CONFIG.format(records=records))
    return {"root": root, "hf": root / "hf", "config": path, "records": records}


def test_dpo_from_a_hf_directory_restarts_and_exports(setup, capsys):
    from transformers import AutoModelForCausalLM

    run_dir = setup["root"] / "run"
    args = ["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", "--run-dir", str(run_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("preference: sigmoid loss, beta 0.1, reference: precomputed by the starting weights for 27 train and 3 "
            "valid pairs") in out, out
    assert "reward margin" in out and (run_dir / "reference_logps.safetensors").is_file()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward_margin" in m]
    assert len(steps) == 3 and abs(steps[0]["loss"] - math.log(2)) < 1e-6 and steps[-1]["reward_margin"] > 0
    assert (run_dir / "loss_curve.png").is_file()
    # a restart with more steps resumes from the run's checkpoint and reads the saved reference (the starting
    # weights are no longer what the checkpoint holds)
    assert main(args + ["train.steps=4"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and f"reference: read from {run_dir}" in out, out
    exported = setup["root"] / "exported"
    assert main(["convert", "--to-hf", str(exported), "--checkpoint", str(run_dir / "checkpoints")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    start = AutoModelForCausalLM.from_pretrained(setup["hf"]).eval()
    ids = torch.randint(0, 151936, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - start(ids).logits).abs().max() > 1e-3


def test_the_tiny_dpo_config_trains(setup, tmp_path, capsys):
    """`configs/dpo-tiny-qwen3.toml` on the pairs `scripts/dolly_pairs.py` writes (one step, shorter rows)."""
    code = main(["train", "configs/dpo-tiny-qwen3.toml", f"sft.data=[\"{setup['records']}\"]", "model.seq_length=512",
                 "train.steps=1", "train.eval_interval=0", "train.eval_iters=1", "log.progress=false",
                 "log.plot=false", "log.tensorboard=false", "checkpoint.save=false",
                 "--run-dir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert abs(next(m["loss"] for m in metrics if "loss" in m) - math.log(2)) < 1e-6


def bad_records(root: Path, text: str) -> list[str]:
    path = root / "bad.jsonl"
    path.write_text(text)
    return [f'sft.data=["{path}"]']


PROMPT = '"prompt": [{"role": "user", "content": "Say hi."}]'
ERRORS = [
    ("no chosen answer", lambda r: bad_records(r, '{' + PROMPT + ', "rejected": [{"role": "assistant", "content": '
                                                  '"No."}]}\n'), "bad.jsonl:1: the record has no 'chosen' answer"),
    ("identical answers", lambda r: bad_records(r, '{"prompt": "Say hi.", "chosen": "Hi.", "rejected": "Hi."}\n'),
     "'chosen' and 'rejected' are identical"),
    ("text answers without a prompt", lambda r: bad_records(r, '{"chosen": "Hi.", "rejected": "No."}\n'),
     "a text record needs a string 'prompt'"),
    ("beta", lambda r: ["preference.beta=0.0"], "preference.beta=0.0 must be > 0"),
    ("unknown loss", lambda r: ['preference.loss="kto"'], 'preference.loss="kto" must be one of'),
    ("reference-free with a reference", lambda r: ['preference.loss="simpo"', 'preference.reference="precomputed"'],
     'preference.loss="simpo" uses no reference model'),
    ("adapters reference without LoRA", lambda r: ['preference.reference="adapters"'],
     'preference.reference="adapters" is the base of a LoRA run'),
]


@pytest.mark.parametrize("name,extra,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_preference_errors_are_one_line(setup, tmp_path, capsys, name, extra, message):
    workdir = tmp_path / "case"
    workdir.mkdir()
    code = main(["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", *extra(workdir),
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing is written before the input is checked"


def test_the_pairs_script_refuses_a_missing_file(tmp_path, capsys):
    module = runpy.run_path(str(ROOT / "scripts" / "dolly_pairs.py"))
    assert module["main"]([str(tmp_path / "none.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "out.jsonl").exists()
