"""`shardlm train` with a [distill] section: a tiny student distilled from a frozen teacher on the shared Dolly
records (16 of them; the real Qwen3 tokenizer and chat template), the teacher reported in the run's first lines
(fp32 and bf16 weights); bad settings stop with one line before anything is written."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from shardlm.cli import main

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def teacher(data_dir, tmp_path_factory):
    """A random 2-layer Qwen3 over the Qwen3 tokenizer's 151,669 entries, with that tokenizer, as an HF directory."""
    from test_lora_peft import save_random
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("teacher")
    config = Qwen3Config(vocab_size=151669, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128,
                         tie_word_embeddings=True)
    save_random(Qwen3ForCausalLM, config, root)
    for name in TOKENIZER_FILES:
        shutil.copy(data_dir / "chat" / "qwen3" / name, root / name)
    return root


@pytest.fixture()
def config(data_dir, teacher, tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text("".join((data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines(True)[:16]))
    path = tmp_path / "distill.toml"
    path.write_text(f"""
[model]
arch = "llama"
num_layers = 1
hidden_size = 32
num_heads = 4
num_kv_heads = 2
seq_length = 96
dropout = 0.0
[sft]
tokenizer = "{data_dir / 'chat' / 'qwen3'}"
data = ["{records}"]
valid_fraction = 0.0
[distill]
teacher = "{teacher}"
beta = 0.5
temperature = 2.0
[train]
micro_batch_size = 2
global_batch_size = 2
steps = 2
precision = "fp32"
[log]
plot = false
progress = false
""")
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_student_distills_from_the_command_line(config, teacher, tmp_path, capsys, dtype):
    """Two steps train to finite losses; the log names the teacher and what its weights take (fp32: 4 bytes a
    parameter, bf16: 2)."""
    assert main(["train", str(config), f'distill.teacher_dtype="{dtype}"', "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    line = re.search(r"distill: teacher .*", out)[0]
    assert f"{teacher}" in line and "2 layers, hidden 48, vocabulary 151669" in line, line
    parameters = 151669 * 48 + 2 * (4 * 48 * 48 + 3 * 48 * 96 + 2 * 48 + 2 * 12) + 48  # tied embedding, norms
    mib = float(re.search(r"([\d.,]+) MiB of frozen weights", line)[1].replace(",", ""))
    assert abs(mib - parameters * (4 if dtype == "fp32" else 2) / 2**20) < 0.1, (mib, parameters)
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert len(losses) == 2 and all(0 < loss < 50 for loss in losses), losses


def other_tokenizer(root, data_dir):
    """A copy of the Qwen3 tokenizer with the ids of two tokens swapped: the same tokens, another mapping."""
    root.mkdir()
    tokenizer = json.loads((data_dir / "chat" / "qwen3" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "Hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (root / "tokenizer.json").write_text(json.dumps(tokenizer))


ERRORS = [
    ("teacher missing", lambda tmp, data, teacher: [f'distill.teacher="{tmp / "nowhere"}"'],
     "distill.teacher="),
    ("beta", lambda tmp, data, teacher: ["distill.beta=1.5"], "distill.beta=1.5 must be in [0, 1]"),
    ("temperature", lambda tmp, data, teacher: ["distill.temperature=0.0"], "distill.temperature=0.0 must be > 0"),
    ("top_p", lambda tmp, data, teacher: ["distill.top_p=0.0"], "distill.top_p=0.0 must be in (0, 1]"),
    ("dtype", lambda tmp, data, teacher: ['distill.teacher_dtype="fp16"'], 'distill.teacher_dtype="fp16" must be'),
    ("iw_opd offline", lambda tmp, data, teacher: ['distill.loss="iw_opd"'],
     'distill.loss="iw_opd" weighs the student\'s own samples; set distill.lmbda=1'),
    ("iw_opd gamma", lambda tmp, data, teacher: ["distill.iw_opd_gamma=-0.5"],
     "distill.iw_opd_gamma=-0.5 must be >= 0"),
    ("a negative top-k support", lambda tmp, data, teacher: ["distill.loss_top_k=-1"],
     "distill.loss_top_k=-1 must be >= 0 (0: the whole vocabulary)"),
    ("a top-k support of the sampled tokens' loss", lambda tmp, data, teacher: [
        'distill.loss="token_kl"', "distill.lmbda=1.0", "distill.loss_top_k=5"],
     'distill.loss_top_k restricts the "jsd" divergence to a support; distill.loss="token_kl" reads the sampled '
     "tokens alone: set it to 0"),
    ("an unknown reverse top-1 mode", lambda tmp, data, teacher: ['distill.reverse_kl_top_1_mode="max"'],
     'distill.reverse_kl_top_1_mode="max" must be "sampled" or "argmax"'),
    ("vocabulary size", lambda tmp, data, teacher: ["model.vocab_size=151936"],
     "has a vocabulary of 151669 entries, the student 151936"),
]


@pytest.mark.parametrize("name,extra,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_distill_errors_are_one_line(config, data_dir, teacher, tmp_path, capsys, name, extra, message):
    code = main(["train", str(config), *extra(tmp_path, data_dir, teacher), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists(), "nothing is written before the input is checked"


def test_a_teacher_with_another_tokenizer_is_refused(config, data_dir, teacher, tmp_path, capsys):
    """The same number of entries, another vocabulary (two tokens' ids swapped): one line."""
    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    (other / "tokenizer.json").unlink()
    other_tokenizer(tmp_path / "tok", data_dir)
    shutil.copy(tmp_path / "tok" / "tokenizer.json", other / "tokenizer.json")
    code = main(["train", str(config), f'distill.teacher="{other}"', "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "has another tokenizer than the student's" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_on_policy_distillation_from_the_command_line(config, tmp_path, capsys):
    """distill.lmbda=1: every step trains on the student's own completions (at most 8 tokens, sampled with the
    KV cache, top-k 50 and a repetition penalty), the run says so in its first lines and logs each step's completion
    length."""
    assert main(["train", str(config), "distill.lmbda=1.0", "distill.max_new_tokens=8", "distill.top_k=50",
                 "distill.repetition_penalty=1.2", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert ("distill: on-policy on a share 1 of the steps (completions of at most 8 tokens sampled by the student at "
            "temperature 1, top_k 50, repetition_penalty 1.2)") in out, out
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [s["on_policy"] for s in steps] == [1.0, 1.0], steps
    assert all(0 < s["completion_length"] <= 8 for s in steps), steps
