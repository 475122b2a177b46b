"""`make bench`'s `rl` section on tiny settings (`--quick --only rl`): the figures of benchmarks.json are those of the
steps it timed (each ratio the quotient of the times or rates it names, per pair; the shares of a step add up to
one), the pairs completed the same number of tokens, the decoders ran on the same weights and produced B x N tokens,
a reference shows up only with beta > 0, and BENCHMARKS.md states the ratios. Speed itself is never asserted."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from multiproc import import_or_skip

import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")

from shardlm.bench.report import KEYS  # noqa: E402
from shardlm.bench.rl import RL_QUICK  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("bench_rl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDLM_DATA": str(data_dir)}
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench", "--quick", "--only", "rl", "--out", str(out)],
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "benchmarks.json").read_text())
    assert results["errors"] == {} and results["machine"]["cpu"]
    return results["rl"], (out / "BENCHMARKS.md").read_text()


def _values(fig: dict) -> list[float]:
    """A median figure's repeats (stored rounded to 6 decimals), checked against its median, min and max."""
    values = fig["values"]
    assert values and all(math.isfinite(v) for v in values), fig
    assert fig["median"] == pytest.approx(statistics.median(values), rel=1e-5, abs=1e-6)
    assert (fig["min"], fig["max"]) == pytest.approx((min(values), max(values)), rel=1e-5, abs=1e-6)
    return values


def _as_reported(fig: dict) -> str:
    return f"{fig['median']:.2f} (min {fig['min']:.2f}, max {fig['max']:.2f})"


def _check_pairs(figures: dict, pairs: int, with_reference: bool) -> None:
    """Each pair's ratio is TRL's step seconds over shardlm's; each trainer's shares are fractions of its own step
    that add up to one; both completed the same prompts' sequences with as many tokens; scoring only with a
    reference."""
    assert figures["pairs"] == pairs and figures["same_prompts"] == [True] * pairs
    ours, theirs = figures["shardlm"], figures["trl"]
    mine, trl = _values(ours["step_s"]), _values(theirs["step_s"])
    assert len(mine) == len(trl) == pairs
    assert _values(figures["ratio"]) == pytest.approx([b / a for a, b in zip(mine, trl)], rel=1e-4)
    for run in (ours, theirs):
        parts = [_values(run[f"{part}_share"]) for part in ("generation", "scoring", "update", "other")]
        assert all(0 < g < 1 and 0 < u < 1 for g, u in zip(parts[0], parts[2])), run
        assert [sum(p) for p in zip(*parts)] == pytest.approx([1.0] * pairs, abs=1e-5)
        # the rest (rewards, advantages, packing) is timed by nobody: some time, a small part of the step
        assert all(0 < x < 0.5 for x in parts[3]), run
        # without a reference no pass runs: the clock around nothing reads microseconds
        assert all((s > 1e-3) if with_reference else (s < 1e-4) for s in parts[1]), run
        # a random-init model over 151,936 tokens all but never samples the end-of-turn id: full-length completions
        assert run["completion_tokens"] == [RL_QUICK.sequences * RL_QUICK.max_completion_length] * pairs
    assert all(math.isfinite(x) for x in figures["shardlm_losses"])


@pytest.mark.parametrize("key", [k for k in KEYS if k.startswith("rl.")])
def test_documented_rl_key_holds_a_value(rl_run, key):
    value = rl_run[0]
    for part in key.split(".")[1:]:
        assert part in value, f"benchmarks.json lacks {key}"
        value = value[part]
    assert value not in (None, "", [], {}), f"benchmarks.json has {key} = {value!r}"


def test_grpo_step_figures_are_the_timed_pairs(rl_run):
    r, text = rl_run
    _check_pairs(r, RL_QUICK.model.steps - RL_QUICK.model.warmup_steps, with_reference=False)
    assert f"{_as_reported(r['ratio'])}** (goal 1.5)" in text and "Online RL: GRPO steps (`rl`)" in text


def test_the_run_with_a_reference_scores_it(rl_run):
    r, text = rl_run
    w = r["with_reference"]
    assert w["beta"] == RL_QUICK.beta > 0
    _check_pairs(w, RL_QUICK.beta_steps - RL_QUICK.model.warmup_steps, with_reference=True)
    assert f"(`rl.with_reference.ratio`): {_as_reported(w['ratio'])}" in text


def test_decoders_run_the_same_weights_for_as_many_tokens(rl_run):
    """Both decoders load the same folder (their next-token logits agree to fp32 round-off), generate B x N new
    tokens each round, and the ratio is per round the quotient of their rates."""
    r, text = rl_run
    d = r["decode"]
    assert d["max_abs_logit_difference"] < 1e-4
    assert d["sequences"] == RL_QUICK.sequences and d["new_tokens"] == RL_QUICK.max_completion_length
    ours, theirs = _values(d["shardlm_tokens_per_sec"]), _values(d["transformers_tokens_per_sec"])
    assert len(ours) == len(theirs) == RL_QUICK.decode_repeats and min(ours + theirs) > 0
    every_round = [d["sequences"] * d["new_tokens"]] * RL_QUICK.decode_repeats
    assert d["tokens_per_round"] == {"shardlm": every_round, "transformers": every_round}
    assert _values(d["ratio"]) == pytest.approx([a / b for a, b in zip(ours, theirs)], rel=1e-4)
    assert f"(`rl.decode.ratio`, per round): {_as_reported(d['ratio'])}" in text
