"""`shardlm train` with an [sft] section from the command line: fine-tune, export, chat, and one-line errors.

A random one-layer Qwen3 with the real Qwen3 vocabulary is saved as a Hugging Face directory beside the
shared Qwen3 tokenizer and chat template. 4 steps of SFT on the first 40 Dolly records (4 held out for
validation) from that directory (the loss falls), then `shardlm convert --to-hf` (transformers' logits of
the export equal shardlm's of the run's checkpoint, not the starting model's) and `shardlm generate --chat`
on the export.
Bad SFT input stops with one line and exit code 2 before any process group or training step.
Pretraining with `data.document_mask=true` starts and trains too.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from llama_reference import tiny_qwen3_chat

from shardlm.checkpoint import load_model
from shardlm.cli import main
from shardlm.parallel import ParallelContext
from shardlm.training.data import DocumentSamples

from agreement import rel

CONFIG = """
[model]
seq_length = 256

[sft]
data = ["{records}"]
valid_fraction = 0.1

[train]
precision = "fp32"
micro_batch_size = 2
global_batch_size = 2
steps = 4
lr = 2e-2
warmup_steps = 1
eval_interval = 0
eval_iters = 8

[log]
interval = 1
progress = false
tensorboard = false
plot = false
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("sft_cli")
    tiny_qwen3_chat(root / "hf", data_dir, max_positions=256)
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()[:40]
    records = root / "records.jsonl"
    records.write_text("\n".join(lines) + "\n")
    path = root / "sft.toml"
    path.write_text(CONFIG.format(records=records))
    return {"root": root, "hf": root / "hf", "config": path, "records": records}


def test_fine_tune_export_and_chat(setup, capsys):
    from transformers import AutoModelForCausalLM

    run_dir = setup["root"] / "run"
    assert main(["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "sft: packed 36 conversations into" in out and "loss mask by prefix" in out, out
    assert "validation: 4 conversations" in out and "final validation loss" in out, out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m and "val_loss" not in m]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses

    exported = setup["root"] / "exported"
    assert main(["convert", "--to-hf", str(exported), "--checkpoint", str(run_dir / "checkpoints")]) == 0
    assert "chat_template" in json.loads((exported / "tokenizer_config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    # the export holds the fine-tuned weights: transformers' logits equal shardlm's from the run's checkpoint,
    # and differ from the starting model's
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 151936, size=(2, 24)))
    trained, _ = load_model(run_dir / "checkpoints", ParallelContext.single())
    with torch.no_grad():
        ours, theirs = trained(ids), hf(ids).logits
        start = AutoModelForCausalLM.from_pretrained(setup["hf"]).eval()(ids).logits
    assert rel(theirs, ours) <= 1e-5 and rel(start, ours) > 1e-3, (rel(theirs, ours), rel(start, ours))
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(exported), "--chat", "--prompt", "Name a colour.", "--greedy",
                 "--max-new-tokens", "4", "--device", "cpu", "--json"]) == 0
    prompt = json.loads(capsys.readouterr().out)["generations"][0]["prompt_tokens"]
    assert prompt[-3:] == [151644, 77091, 198]  # "<|im_start|>assistant\n": the template's generation prompt


def test_lora_fine_tune_export_and_chat(setup, capsys):
    """configs/sft-lora-qwen3.toml on the Dolly records from the chat model's directory, the tied embedding
    trained in full beside the adapters (a random one-layer model's loss barely moves through adapters alone):
    the run counts what it trains and its loss falls; the peft export loads onto the transformers base to the
    logits of shardlm's LoRA checkpoint; `generate --chat` from the LoRA checkpoint (adapters applied) and from
    the merged export give the same greedy tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = setup["root"] / "lora_run"
    assert main(["train", "configs/sft-lora-qwen3.toml", f"checkpoint.init_from={setup['hf']}",
                 f'sft.data=["{setup["records"]}"]', "model.seq_length=256", "lora.dropout=0.0",
                 'lora.modules_to_save=["embedding"]', "train.steps=4",
                 'train.precision="fp32"', "train.micro_batch_size=2", "train.global_batch_size=2", "train.lr=2e-2",
                 "train.warmup_steps=1",
                 "train.eval_interval=0", "checkpoint.save_interval=0", "log.interval=1", "log.progress=false",
                 "log.tensorboard=false", "log.plot=false", "--run-dir", str(run_dir)]) == 0
    assert "lora: training " in capsys.readouterr().out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m and "val_loss" not in m]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses

    adapter, merged = setup["root"] / "lora_adapter", setup["root"] / "lora_merged"
    checkpoint = str(run_dir / "checkpoints")
    assert main(["convert", "--to-peft", str(adapter), "--checkpoint", checkpoint]) == 0
    assert main(["convert", "--to-peft", str(merged), "--checkpoint", checkpoint, "--merge"]) == 0
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 151936, size=(2, 24)))
    ours, _ = load_model(checkpoint, ParallelContext.single())
    with torch.no_grad():
        expected = ours(ids)
        theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(setup["hf"]), adapter).eval()(ids)
    assert rel(theirs.logits, expected) <= 1e-5
    replies = []
    for source in (checkpoint, str(merged)):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", source, "--chat", "--prompt", "Name a colour.", "--greedy",
                     "--max-new-tokens", "6", "--device", "cpu", "--json"]) == 0
        replies.append(json.loads(capsys.readouterr().out)["generations"][0])
    assert replies[0] == replies[1]


def bad_records(root, hf, text: str) -> list[str]:
    path = root / "bad.jsonl"
    path.write_text(text)
    return [f'sft.data=["{path}"]']


def no_template(root, hf) -> list[str]:
    folder = root / "plain_tokenizer"
    folder.mkdir(exist_ok=True)
    shutil.copy(hf / "tokenizer.json", folder / "tokenizer.json")
    return [f"sft.tokenizer={folder}"]


DOLLY = '{"instruction": "Say hi.", "context": "", "response": "Hi."}\n'
ERRORS = [
    ("malformed line", lambda r, hf: bad_records(r, hf, DOLLY + DOLLY + "{not json\n"), "bad.jsonl:3"),
    ("no assistant turn", lambda r, hf: bad_records(r, hf, '{"messages": [{"role": "user", "content": "hi"}]}\n'),
     "assistant"),
    ("roles out of order", lambda r, hf: bad_records(
        r, hf, '{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}\n'),
     "bad.jsonl:1"),
    ("missing file", lambda r, hf: [f'sft.data=["{r / "none.jsonl"}"]'], "none.jsonl not found"),
    ("no chat template", no_template, "has no chat template"),
    ("with text_file", lambda r, hf: ["data.text_file=corpus.txt"], "sft.data replaces data.text_file"),
    ("packing", lambda r, hf: ['sft.packing="best"'], 'sft.packing="best" must be one of'),
    ("loss type", lambda r, hf: ['sft.loss_type="focal"'], 'sft.loss_type="focal" must be "nll" or "dft"'),
    ("all too long, dropped", lambda r, hf: ["model.seq_length=8", 'sft.overflow="drop"'], "no conversation is left"),
    ("lora rank", lambda r, hf: ["lora.rank=-1"], "lora.rank=-1 must be at least 1"),
    ("lora unknown target", lambda r, hf: ["lora.rank=4", 'lora.targets=["attn"]'], "'attn', which is no projection"),
    ("lora target the model lacks", lambda r, hf: ["lora.rank=4", 'lora.targets=["qkv"]'],
     "lora.targets names qkv, which this llama model does not have"),
    ("lora tied output", lambda r, hf: ["lora.rank=4", 'lora.modules_to_save=["output"]'],
     "ties its output layer to the embedding"),
    ("lora adapter folder", lambda r, hf: [f"checkpoint.init_adapter={r}"], "has no adapter_config.json"),
]


@pytest.mark.parametrize("name,extra,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_sft_errors_are_one_line(setup, tmp_path, capsys, name, extra, message):
    workdir = tmp_path / "case"
    workdir.mkdir()
    code = main(["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", *extra(workdir, setup["hf"]),
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing is written before the input is checked"


def test_vocabulary_must_hold_the_chat_data(setup, tmp_path, capsys):
    """A model from scratch with a vocabulary smaller than the tokenizer's ids: one line, nothing written."""
    code = main(["train", str(setup["config"]), f"sft.tokenizer={setup['hf']}", 'model.arch="llama"',
                 "model.vocab_size=1000", "model.num_layers=1", "model.hidden_size=16", "model.num_heads=2",
                 "model.num_kv_heads=1", "model.ffn_hidden_size=32", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "vocabulary has 1000 entries" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_document_samples_restart_positions_after_each_end_of_document():
    eod = 9
    samples = DocumentSamples([np.array([1, 2, eod, 3, 4, 5, eod, eod, 6])], eod)
    row = samples[0]
    assert row["input_ids"].tolist() == [1, 2, eod, 3, 4, 5, eod, eod]
    assert row["labels"].tolist() == [2, eod, 3, 4, 5, eod, eod, 6]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_pretraining_with_document_mask_trains(data_dir, tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text((data_dir / "corpus" / "tinyshakespeare.txt").read_text()[:6000])
    code = main(["train", "configs/llama-tiny.toml", f"data.text_file={text}", "data.document_mask=true",
                 "model.seq_length=32", "train.steps=2", "train.eval_interval=0", "train.eval_iters=1",
                 "log.progress=false", "log.plot=false", "log.tensorboard=false", "checkpoint.save=false",
                 "--run-dir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in m and np.isfinite(m["loss"]) for m in metrics)
