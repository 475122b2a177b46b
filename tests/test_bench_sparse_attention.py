"""`make bench`'s `sparse_attention` section on its quick shapes (`--quick --only sparse_attention`).

The layer comparison compares like with like: the bench's DSA layer choosing every key (index_topk = T) gives the
dense layer's output and input gradient (same weights), and choosing fewer keys does not. Its figures are those it
timed and measured: each speedup the quotient of the dense and DSA ms of its round, each saved-bytes ratio DSA's over
dense's, the bytes alive for the backward when the forward ends (not what the indexer's divergence saves and frees
chunk by chunk); neither layer keeps a (T, T) tensor for the backward (saved bytes per token do not grow with T),
while a DSA layer choosing every key (k = T) keeps T x k. The DeepSeek-V3.2 step compares the same model
(transformers' losses of steps 1 and 2 equal shardlm's), each ratio is the quotient of the tokens/s of its round, the
goal reads `sparse_attention.train_vs_hf.fp32.ratio`, and BENCHMARKS.md states the figures. Speed itself is never
asserted.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

from shardlm.bench.goals import FAMILY_GOAL
from shardlm.bench.report import KEYS
from shardlm.bench.sparse_attention import (
    BYTES_QUICK_LENGTH,
    LAYER_QUICK,
    LAYER_V32_PROPORTIONS,
    QUICK_LENGTHS,
    build_layer,
    layer_inputs,
    layer_memory,
)

pytestmark = pytest.mark.timeout(300)
KEY = "sparse_attention"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_sparse_attention")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench", "--quick", "--only", KEY, "--out", str(out)],
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "benchmarks.json").read_text())
    assert results["errors"] == {} and results["machine"]["cpu"]
    return results, (out / "BENCHMARKS.md").read_text()


def _values(fig: dict, low: float = 0.0, high: float = math.inf) -> list[float]:
    """A median figure's repeats (stored rounded to 6 decimals) inside (low, high), consistent with its median, min
    and max."""
    values = fig["values"]
    assert values and all(math.isfinite(v) and low < v < high for v in values), fig
    assert fig["median"] == pytest.approx(statistics.median(values), rel=1e-5, abs=1e-6)
    assert (fig["min"], fig["max"]) == pytest.approx((min(values), max(values)), rel=1e-5, abs=1e-6)
    return values


def _quotient(ratio: dict, top: dict, bottom: dict) -> None:
    """Each round's ratio is that round's `top` / `bottom`."""
    values, a, b = _values(ratio, 1e-3, 1e3), _values(top), _values(bottom)
    assert len(values) == len(a) == len(b)
    assert values == pytest.approx([x / y for x, y in zip(a, b)], rel=1e-4, abs=1e-6)


def _as_reported(fig: dict, digits: int = 2) -> str:
    return f"{fig['median']:.{digits}f} (min {fig['min']:.{digits}f}, max {fig['max']:.{digits}f})"


def _forward_backward(index_topk: int, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bench's quick layer with `index_topk` (0: dense) on the bench's inputs: (output, input gradient)."""
    torch.manual_seed(0)
    x, grad = layer_inputs(LAYER_QUICK, seq_length)
    x = x.requires_grad_()
    out = build_layer(LAYER_QUICK, seq_length, index_topk)(x)
    out.backward(grad)
    return out.detach(), x.grad


def test_the_layers_compare_like_with_like():
    """DSA choosing all T keys is dense MLA (the same weights; absorbed against expanded: fp32 rounding); choosing
    fewer keys (the bench's top-k) changes the output, so the agreement is not vacuous."""
    T = 64
    dense, every, fewer = (_forward_backward(k, T) for k in (0, T, LAYER_QUICK.index_topk))
    for a, b in zip(every, dense):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert (fewer[0] - dense[0]).abs().max() > 1e-3


def test_saved_bytes_grow_as_t_and_k():
    """The measurement sees the (T, k) choice: DSA choosing every key (k = T) keeps per token 5 bytes more per key
    (an int32 index and a bool), the bench's fixed k keeps per token bytes that do not grow with T (nor does dense,
    flash SDPA keeping no (T, T) tensor)."""
    def per_token(k: int, T: int) -> float:
        x, grad = layer_inputs(LAYER_QUICK, T)
        return layer_memory(build_layer(LAYER_QUICK, T, k), x, grad)["saved_bytes"] / T

    short, long = QUICK_LENGTHS
    assert per_token(long, long) - per_token(short, short) == (long - short) * (4 + 1)
    for k in (0, LAYER_QUICK.index_topk):
        assert per_token(k, long) < 1.15 * per_token(k, short)


def test_saved_bytes_are_those_alive_for_the_backward(monkeypatch):
    """What the indexer's divergence saves and frees chunk by chunk inside the forward is not counted: the figure is
    the same in one chunk and in many, and below the count of every tensor ever saved (`saved_activation_bytes`)."""
    from shardlm.models import sparse_attention as dsa
    from shardlm.plan.measure import saved_activation_bytes

    T = QUICK_LENGTHS[-1]
    x, grad = layer_inputs(LAYER_QUICK, T)
    whole = layer_memory(build_layer(LAYER_QUICK, T, LAYER_QUICK.index_topk), x, grad)["saved_bytes"]
    monkeypatch.setattr(dsa, "CHUNK_ELEMENTS", 1 << 12)  # a few queries a chunk
    layer = build_layer(LAYER_QUICK, T, LAYER_QUICK.index_topk)
    assert layer_memory(layer, x, grad)["saved_bytes"] == whole
    ever = saved_activation_bytes(layer, lambda: layer(x.detach().requires_grad_()), [layer]).total
    assert whole < ever


def test_layer_figures_are_the_measured_ones(run):
    """Every quick length ran (no budget in --quick) with the dense and top-k programs; each speedup is per round
    dense ms / DSA ms, the choice a part of DSA's time; saved bytes per token stay flat in T for both programs, and
    their ratio is DSA's / dense's; BENCHMARKS.md states them."""
    results, text = run
    layer = results[KEY]["layer"]
    assert layer["topks"] == [LAYER_QUICK.index_topk]
    assert [row["tokens"] for row in layer["rows"]] == list(QUICK_LENGTHS)
    name = f"dsa_{LAYER_QUICK.index_topk}"
    for row in layer["rows"]:
        dsa = row[name]
        _quotient(dsa["speedup"], row["dense_ms"], dsa["ms"])
        assert row["rounds"] == len(dsa["ms"]["values"]) == layer["rounds"] == 2
        choice = _values(dsa["choice_ms"])
        assert all(c <= t for c, t in zip(choice, dsa["ms"]["values"]))
        assert dsa["saved_ratio"] == pytest.approx(dsa["saved_bytes"] / row["dense_saved_bytes"])
        assert dsa["peak_bytes"] >= dsa["saved_bytes"] > 0 and row["dense_peak_bytes"] >= row["dense_saved_bytes"] > 0
        assert dsa["us_per_token"] == pytest.approx(1000 * dsa["ms"]["median"] / row["tokens"])
        assert f"**{_as_reported(dsa['speedup'])}**" in text
        assert f"| {row['tokens']:,} | DSA, top-{LAYER_QUICK.index_topk} | {dsa['ms']['median']:.0f} (min" in text
        assert f"| {dsa['saved_ratio']:.2f} |" in text
    short, long = layer["rows"]
    for saved in (lambda row: row["dense_saved_bytes"], lambda row: row[name]["saved_bytes"]):
        assert saved(long) / long["tokens"] < 1.15 * saved(short) / short["tokens"]


def test_layer_bytes_are_the_measured_ones(run):
    """The quick run's `layer_bytes`: per token bytes of dense and DSA, their ratio, stated in BENCHMARKS.md."""
    results, text = run
    b = results[KEY]["layer_bytes"]
    assert b["tokens"] == BYTES_QUICK_LENGTH and b["dense_saved_bytes_per_token"] > 0
    assert b["saved_ratio"] == pytest.approx(b["dsa_saved_bytes_per_token"] / b["dense_saved_bytes_per_token"])
    assert f"**DSA / dense {b['saved_ratio']:.2f}**" in text


def test_dsa_keeps_fewer_bytes_than_dense_at_v32_proportions():
    """At DeepSeek-V3.2's proportions (`LAYER_V32_PROPORTIONS`, 640 tokens, k = 512 below them) DSA keeps for the
    backward well under dense MLA's bytes (0.57 of them at the bench's 2,048 tokens): its chunks absorb the query and
    apply W_UV inside, so nothing kv_lora_rank wide per head outlives a chunk, and the choice is int32. Kept as
    before (the absorbed query and p c per head, int64 indices), DSA kept 1.6 times dense's bytes."""
    shape, T = LAYER_V32_PROPORTIONS, 640
    x, grad = layer_inputs(shape, T)
    dense, dsa = (layer_memory(build_layer(shape, T, k), x, grad)["saved_bytes"] for k in (0, shape.index_topk))
    assert dsa < 0.75 * dense, (dsa / T, dense / T)


def test_the_v32_step_compares_the_same_model_and_the_goal_reads_it(run):
    """transformers' DeepSeek-V3.2 losses of steps 1 and 2 equal shardlm's; each ratio is per round the quotient of
    the tokens/s it names; the goal row reads the fp32 median; the documented keys hold values; BENCHMARKS.md
    states the figures."""
    results, text = run
    train = results[KEY]["train_vs_hf"]
    check = train["loss_check"]
    assert check["match"] is True and check["tolerance"] == 1e-4
    assert set(check["losses"]) == {"shardlm", "hf", "hf_eager"}
    assert f"**`{KEY}.train_vs_hf.loss_check.match` = True**" in text
    assert train["precisions"] == ["fp32"]
    f = train["fp32"]
    for ratio, ours, theirs in (("ratio", "shardlm", "hf"), ("ratio_eager", "shardlm", "hf_eager"),
                                ("ratio_kl", "shardlm_kl", "hf")):
        _quotient(f[ratio], f[f"{ours}_tokens_per_sec"], f[f"{theirs}_tokens_per_sec"])
    assert f"**{_as_reported(f['ratio'])}**" in text and _as_reported(f["ratio_kl"]) in text
    assert f["hf_attn_implementation"] == "sdpa" and f["breakdown"]["shardlm"]["total"] > 0
    assert train["goal"]["met"] == (f["ratio"]["median"] >= FAMILY_GOAL)
    rows = {row["key"]: row for row in results["goals"]["rows"]}
    row = rows[f"{KEY}.train_vs_hf.fp32.ratio"]
    assert row["value"] == f["ratio"]["median"] and row["met"] == (row["value"] >= FAMILY_GOAL)
    assert f"`{KEY}.train_vs_hf.fp32.ratio`" in text.split("## Speed goals")[1].split("\n## ")[0]
    for key in (k for k in KEYS if k.startswith(KEY + ".")):
        value = results
        for part in key.split("."):
            value = value[part]
        assert value not in (None, "", [], {}), key


def test_the_v4_step_compares_the_same_model_and_the_goal_reads_it(run):
    """transformers' DeepSeek-V4 losses of steps 1 and 2 equal shardlm's (fp32, the converted weights); each ratio is
    per round the quotient of the tokens/s it names; the goal table has its row, reading the fp32 median; BENCHMARKS.md
    states the figures."""
    results, text = run
    train = results[KEY]["v4_train_vs_hf"]
    check = train["loss_check"]
    assert check["match"] is True and set(check["losses"]) == {"shardlm", "hf", "hf_eager"}
    assert f"**`{KEY}.v4_train_vs_hf.loss_check.match` = True**" in text
    assert train["precisions"] == ["fp32"] and "DeepSeek-V4" in train["config"]
    f = train["fp32"]
    for ratio, theirs in (("ratio", "hf"), ("ratio_eager", "hf_eager")):
        _quotient(f[ratio], f["shardlm_tokens_per_sec"], f[f"{theirs}_tokens_per_sec"])
    assert f"**{_as_reported(f['ratio'])}**" in text and f["breakdown"]["shardlm"]["total"] > 0
    assert train["goal"]["met"] == (f["ratio"]["median"] >= FAMILY_GOAL)
    row = {row["key"]: row for row in results["goals"]["rows"]}[f"{KEY}.v4_train_vs_hf.fp32.ratio"]
    assert row["value"] == f["ratio"]["median"] and row["met"] == (row["value"] >= FAMILY_GOAL)
    assert f"`{KEY}.v4_train_vs_hf.fp32.ratio`" in text.split("## Speed goals")[1].split("\n## ")[0]
