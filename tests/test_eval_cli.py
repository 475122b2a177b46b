"""`shardlm eval` and `shardlm generate` on a checkpoint that `shardlm train` just saved: JSON output,
the same numbers at TP=1 and TP=2 (local workers), and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from shardlm.cli import main

TINY = """
[model]
num_layers = 2
hidden_size = 32
num_heads = 4
seq_length = 32
dropout = 0.0

[data]
text_file = "{text}"

[train]
precision = "fp32"
micro_batch_size = 2
global_batch_size = 2
steps = 2
lr = 1e-3

[log]
interval = 1
progress = false
tensorboard = false
plot = false
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """A 2-step tiny GPT checkpoint and a WikiText slice of 10 lines."""
    folder = tmp_path_factory.mktemp("evalcli")
    corpus = folder / "corpus.txt"
    corpus.write_text((data_dir / "corpus" / "tinyshakespeare.txt").read_text()[:20_000])
    config = folder / "tiny.toml"
    config.write_text(TINY.format(text=corpus))
    assert main(["train", str(config), "--run-dir", str(folder / "run")]) == 0
    wiki = folder / "wiki.tokens"
    lines = (data_dir / "wikitext" / "wikitext-103" / "wiki.test.tokens").read_text().splitlines(keepends=True)
    wiki.write_text("".join(lines[:10]))
    return {"checkpoint": str(folder / "run" / "checkpoints"), "wiki": str(wiki),
            "lambada": str(data_dir / "lambada" / "lambada_test.jsonl")}


def run_json(capfd, argv: list[str]) -> dict:
    capfd.readouterr()
    assert main(argv) == 0
    out = capfd.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_wikitext_at_tp1_and_tp2_agree(trained, capfd):
    argv = ["eval", "wikitext", "--checkpoint", trained["checkpoint"], "--data", trained["wiki"],
            "--stride", "8", "--json"]
    single = run_json(capfd, argv)
    assert single["scored_tokens"] == single["bpe_tokens"] - 1 and single["context"] == 32
    assert single["perplexity"] < 50257  # trained two steps: a little better than uniform
    double = run_json(capfd, [*argv, "--tensor-parallel", "2"])
    assert double["tensor_parallel"] == 2
    for key in ("bpe_tokens", "original_tokens", "scored_tokens", "windows"):
        assert double[key] == single[key]
    for key in ("total_loss", "loss", "perplexity", "adjusted_perplexity"):
        assert double[key] == pytest.approx(single[key], rel=1e-5), key


def test_lambada_json(trained, capfd):
    result = run_json(capfd, ["eval", "lambada", "--checkpoint", trained["checkpoint"], "--data",
                              trained["lambada"], "--limit", "12", "--strict", "--json"])
    assert result["examples"] == 12 and result["strict"] is True and 0 <= result["correct"] <= 12


def test_generate_at_tp1_and_tp2_agree(trained, capfd):
    argv = ["generate", "--checkpoint", trained["checkpoint"], "--prompt", "To be, or not", "--prompt",
            "First Citizen:", "--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "40", "--seed", "1",
            "--ignore-eod", "--json"]
    single = run_json(capfd, argv)
    double = run_json(capfd, [*argv, "--tensor-parallel", "2"])
    tokens = [g["tokens"] for g in single["generations"]]
    assert [len(t) for t in tokens] == [6, 6]
    assert [g["tokens"] for g in double["generations"]] == tokens
    assert [g["text"] for g in double["generations"]] == [g["text"] for g in single["generations"]]


ERRORS = [
    (["eval", "wikitext", "--checkpoint", "/no/such/checkpoint"], "checkpoint not found: /no/such/checkpoint"),
    (["eval", "lambada", "--checkpoint", "{ckpt}", "--data", "/no/lambada.jsonl"],
     "evaluation data not found: /no/lambada.jsonl"),
    (["eval", "wikitext", "--checkpoint", "{ckpt}", "--data", "{wiki}", "--stride", "0"], "stride=0 must be"),
    (["eval", "wikitext", "--checkpoint", "{ckpt}", "--tensor-parallel", "2", "--nproc-per-node", "3"],
     "--nproc-per-node=3 is not divisible by --tensor-parallel=2"),
    (["generate", "--checkpoint", "{ckpt}"], "no prompt given"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
]


@pytest.mark.parametrize("argv,message", ERRORS, ids=[m.split()[0] for _, m in ERRORS])
def test_errors_are_one_line_exit_2(trained, capfd, argv, message):
    argv = [a.format(ckpt=trained["checkpoint"], wiki=trained["wiki"]) for a in argv]
    capfd.readouterr()
    assert main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardlm: error: ") and message in err[0], err
