"""`make bench`'s `families` section on its quick shapes (`--quick --only families`): each newer family's training
step compares the same model (transformers' losses of steps 1 and 2 equal shardlm's within 1e-4), each ratio is the
quotient of the tokens/s of its round, the speed goals read them, and BENCHMARKS.md states them. Speed itself is never
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardlm.bench.families import FAMILIES
from shardlm.bench.goals import FAMILY_GOAL, speed_goals
from shardlm.bench.report import KEYS

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_families")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench", "--quick", "--only", "families", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "benchmarks.json").read_text())
    assert results["errors"] == {}
    return results, (out / "BENCHMARKS.md").read_text()


def test_every_family_compares_the_same_model(run):
    families = run[0]["families"]
    assert set(families) == set(FAMILIES)
    for name, result in families.items():
        check = result["loss_check"]
        others = {"hf", "hf_eager"} if FAMILIES[name].experts_class else {"hf"}  # no per-expert loop in a dense model
        assert check["match"] and set(check["max_abs_difference"]) == others, (name, check)
        assert all(abs(a - b) <= 1e-4 for a, b in zip(check["losses"]["hf"], check["losses"]["shardlm"]))


def test_each_ratio_is_the_quotient_of_its_round(run):
    for name, result in run[0]["families"].items():
        for precision in result["precisions"]:
            figures = result[precision]
            ours, theirs = figures["shardlm_tokens_per_sec"]["values"], figures["hf_tokens_per_sec"]["values"]
            assert figures["ratio"]["values"] == pytest.approx([a / b for a, b in zip(ours, theirs)], rel=1e-4), name
        assert result["goal"]["fp32_ratio"] == result["fp32"]["ratio"]["median"]
        assert result["goal"]["met"] == (result["fp32"]["ratio"]["median"] >= FAMILY_GOAL)


@pytest.mark.parametrize("key", [k for k in KEYS if k.startswith("families.")])
def test_documented_key_holds_a_value(run, key):
    value = run[0]
    for part in key.split("."):
        assert part in value, f"benchmarks.json lacks {key}"
        value = value[part]
    assert value not in (None, "", [], {}), f"benchmarks.json has {key} = {value!r}"


def test_goals_and_report_state_the_figures(run):
    results, markdown = run
    rows = [row for row in speed_goals(results)["rows"] if row["key"].startswith("families.")]
    assert {row["key"] for row in rows} == {f"families.{name}.{p}.ratio" for name, r in results["families"].items()
                                             for p in r["precisions"]}
    for name, result in results["families"].items():
        line = next(line for line in markdown.splitlines() if line.startswith(f"| {name} |"))
        assert f"{result['fp32']['ratio']['median']:.2f}" in line and str(result["loss_check"]["match"]) in line


def test_linear_attention_families_hold_every_kind_of_layer():
    """The quick Kimi Linear has KDA and MLA layers and dense and MoE MLPs; the quick Nemotron-H Mamba-2, attention,
    MLP and MoE blocks; both with their experts (no kind left out of the comparison)."""
    from shardlm.bench.families import QUICK, SHAPES

    for shapes in (QUICK, SHAPES):
        kimi, nemotron = shapes["kimi_linear"].hf_config(), shapes["nemotron_h"].hf_config()
        assert set(kimi.layer_types) == {"linear_attention", "full_attention"}
        assert set(kimi.mlp_layer_types) == {"dense", "sparse"} and kimi.num_local_experts > 1
        assert set(nemotron.layers_block_type) == {"linear_attention", "full_attention", "mlp", "moe"}
        assert nemotron.n_routed_experts > 1
