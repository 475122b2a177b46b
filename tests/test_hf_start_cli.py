"""`shardlm train checkpoint.init_from=HF_DIR` from the command line: start, restart, export, and one-line errors.

A random one-layer Qwen3 with the real Qwen3 vocabulary (151936 rows, tied) is saved with save_pretrained
beside the shared Qwen3 tokenizer files. A config with no [model] section and no tokenizer trains 2 steps
on the first 4 kB of the shared Shakespeare text: the model's shape and the tokenizer come from the HF
directory. Run again in the same run directory with more steps, it resumes from its own step-2
checkpoint, not from the HF weights (a restart after a crash), even with the weights and config.json
gone from there. `shardlm convert --to-hf` then writes a directory transformers loads, tokenizer and chat
template included, which `shardlm generate --chat` answers from. Each user error is one line, exit code 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from llama_reference import tiny_qwen3_chat

from shardlm.cli import main

CONFIG = """
[data]
text_file = "{text}"

[train]
precision = "fp32"
micro_batch_size = 2
global_batch_size = 2
steps = 2
lr = 1e-3
warmup_steps = 1
eval_iters = 1

[log]
interval = 1
progress = false
tensorboard = false
plot = false
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("hf_start_cli")
    tiny_qwen3_chat(root / "hf", data_dir, max_positions=32)
    text = root / "corpus.txt"
    text.write_text((data_dir / "corpus" / "tinyshakespeare.txt").read_text()[:4000])
    path = root / "run.toml"
    path.write_text(CONFIG.format(text=text) + "\n[model]\nseq_length = 16\n")
    return {"root": root, "hf": root / "hf", "config": path}


def test_train_from_hf_then_restart_resumes_its_own_checkpoint_then_export(setup, capsys):
    from transformers import AutoModelForCausalLM

    run_dir = setup["root"] / "run"
    args = ["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", "--run-dir", str(run_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"initialized from huggingface weights {setup['hf']}" in out, out
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["model"]["arch"], saved["model"]["vocab_size"], saved["model"]["qk_norm"]) == ("llama", 151936, True)
    assert saved["model"]["seq_length"] == 16  # a Llama's seq_length is the run's to choose
    assert saved["data"]["vocab_file"] == str(setup["hf"] / "tokenizer.json")

    moved = [setup["hf"] / name for name in ("config.json", "model.safetensors")]
    for path in moved:  # a restart needs neither the weights nor their shape from there (the tokenizer, yes)
        path.rename(path.with_suffix(".away"))
    try:
        assert main([*args, "train.steps=3"]) == 0
    finally:
        for path in moved:
            path.with_suffix(".away").rename(path)
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out and "initialized from" not in out, out

    exported = setup["root"] / "exported"
    assert main(["convert", "--to-hf", str(exported), "--checkpoint", str(run_dir / "checkpoints")]) == 0
    assert (exported / "tokenizer.json").is_file() and (exported / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 151936
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(exported), "--chat", "--prompt", "Hi", "--greedy",
                 "--max-new-tokens", "3", "--device", "cpu", "--json"]) == 0  # the chat template came along
    prompt = json.loads(capsys.readouterr().out)["generations"][0]["prompt_tokens"]
    assert prompt[-3:] == [151644, 77091, 198]  # the generation prompt, "<|im_start|>assistant\n"


def write_dir(root: Path, name: str, config: dict | None) -> Path:
    path = root / name
    path.mkdir(exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def wrong_shapes(root: Path, hf: Path) -> Path:
    """The HF directory with a config.json that says the MLP is twice as wide as its tensors are."""
    config = json.loads((hf / "config.json").read_text())
    path = write_dir(root, "wrong_shapes", {**config, "intermediate_size": 2 * config["intermediate_size"]})
    shutil.copy(hf / "model.safetensors", path / "model.safetensors")
    return path


ERRORS = [
    ("missing", lambda r, hf: ["checkpoint.init_from=" + str(r / "no-such-model")], "does not exist"),
    ("bert", lambda r, hf: ["checkpoint.init_from=" + str(write_dir(r, "bert", {"model_type": "bert"}))],
     "holds a 'bert' model; only gpt2 and llama, qwen3, mixtral, qwen3_moe, glm4_moe, gpt_oss, olmo2, olmo3, "
     "minimax_m2, qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, deepseek_v3, kimi_k2, deepseek_v2, "
     "deepseek_v32, glm_moe_dsa, mistral4, mistral3, nemotron_h, kimi_linear, gemma4, gemma4_text, deepseek_v4 "
     "convert"),
    ("deepseek", lambda r, hf: ["checkpoint.init_from=" + str(write_dir(r, "dsv3", {"model_type": "deepseek_v3"}))],
     "dsv3 must hold model.safetensors or model.safetensors.index.json"),  # read in place, like the others
    ("no_weights", lambda r, hf: ["checkpoint.init_from=" + str(write_dir(r, "empty", json.loads(
        (hf / "config.json").read_text())))], "must hold model.safetensors"),
    ("no_config", lambda r, hf: ["checkpoint.init_from=" + str(write_dir(r, "bare", None))],
     "neither a shardlm checkpoint nor a Hugging Face model directory"),
    ("shape", lambda r, hf: [f"checkpoint.init_from={hf}", "model.num_layers=3"],
     "model.num_layers=3 but checkpoint.init_from="),
    ("tensor_shape", lambda r, hf: ["checkpoint.init_from=" + str(wrong_shapes(r, hf))],
     "tensor layers.0.mlp.gate.weight has shape [32, 16] but its config.json describes a model whose tensor "
     "has [64, 16]"),
    ("run_dir", lambda r, hf: ["checkpoint.init_from=" + str(write_dir(r, "run", {"model": {}, "train": {},
                                                                                "checkpoint": {}}))],
     "is a shardlm run directory, not a Hugging Face model; name its checkpoints folder"),
    ("load_hf", lambda r, hf: [f"checkpoint.load={hf}"], "start from a consolidated file or a Hugging Face "
                                                          "directory with checkpoint.init_from"),
]


@pytest.mark.parametrize("name,extra,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_init_from_errors_are_one_line(setup, tmp_path, capsys, name, extra, message):
    code = main(["train", str(setup["config"]), *extra(tmp_path, setup["hf"]), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_convert_help_names_every_model_type_that_converts(capsys):
    """`shardlm convert --help` lists the model types `open_hf` converts, read from the converters themselves, and a
    directory of any other type is refused with the same list."""
    from shardlm.checkpoint import hf, hf_deepseek_v4, hf_gemma4, hf_nemotron_h, hf_qwen3_next

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for kinds in (hf_gemma4.MODEL_TYPES, hf_deepseek_v4.KINDS, hf_qwen3_next.KINDS, hf_nemotron_h.KINDS):
        assert all(kind in hf.MODEL_TYPES for kind in kinds)
    assert all(kind in help_text for kind in hf.MODEL_TYPES)
