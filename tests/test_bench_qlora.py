"""`make bench`'s `qlora_memory` section on its quick shape (`--quick --only qlora_memory`): QLoRA's bytes per rank,
measured, against `shardlm plan`'s for the same config at one process and at FSDP DP=2.

- exact: the NF4 base, the other frozen weights, the adapters, their gradients and AdamW's moments and steps equal
  the plan's on every rank (the NF4 base at DP=2 up to FSDP's padding of each weight's one-element offset, derived
  below; the unpadded shards add up to the whole model's NF4 bytes, derived from the shapes by hand); nothing else
  lives between steps; FSDP halves every part (AdamW's per-tensor steps excepted);
- derived: what is alive at the end of the forward is the plan's activations (with FSDP's gathered root) plus the
  adapters' r-wide intermediates, less the input the frozen output layer does not save, within a few bytes a token;
- bounded: the step's peak lies between the end of the forward and the plan's, which counts every gradient and the
  largest layer's dequantized weights at once (`shardlm/bench/qlora_memory.py`'s docstring).
The JSON's documented keys hold values, each row's ratio is its quotient, and BENCHMARKS.md shows the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardlm.bench.qlora_memory import PARTS, QLORA_QUICK, RANK, STATE
from shardlm.bench.report import KEYS

pytestmark = pytest.mark.timeout(300)

SHAPE = QLORA_QUICK
LAYERS, TOKENS, HIDDEN = SHAPE.num_layers, SHAPE.micro_batch * SHAPE.seq_length, SHAPE.hidden_size
EXACT = ("frozen_fp32", "adapters", "adamw", "gradients")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_qlora")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench", "--quick", "--only", "qlora_memory", "--out",
                           str(out)], capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "benchmarks.json").read_text())
    assert results["errors"] == {} and results["machine"]["cpu"]
    return results, (out / "BENCHMARKS.md").read_text()


def rows(results: dict) -> dict:
    """{(layout, rank, part): row}."""
    return {(r["layout"], r["rank"], r["part"]): r for r in results["qlora_memory"]["rows"]}


@pytest.mark.parametrize("key", [k for k in KEYS if k.startswith("qlora_memory.")])
def test_documented_key_holds_a_value(run, key):
    value = run[0]
    for part in key.split("."):
        assert part in value, f"benchmarks.json lacks {key}"
        value = value[part]
    assert value not in (None, "", [], {}), f"benchmarks.json has {key} = {value!r}"


def test_every_row_is_there_and_its_ratio_is_its_quotient(run):
    results, _ = run
    r = results["qlora_memory"]
    assert r["cpu"] == results["machine"]["cpu"]
    assert set(rows(results)) == {(layout, rank, part) for layout, ranks in (("dp1", 1), ("fsdp_dp2", 2))
                                  for rank in range(ranks) for part in PARTS}
    for row in r["rows"]:
        assert row["planned"] > 0 and row["ratio"] == pytest.approx(row["measured"] / row["planned"], rel=1e-12)
        assert row["measured"] == r["measured"][row["layout"]][row["rank"]][row["part"]]
        assert row["planned"] == r["plan"][row["layout"]][row["part"]]
    for ranks in r["measured"].values():
        assert all(len(rank["losses"]) == SHAPE.steps and all(0 < x < 20 for x in rank["losses"]) for rank in ranks)


def quantized_bytes(rows_: int, cols: int) -> int:
    """NF4 with double quantization (`shardlm.lora.nf4`'s docstring), written out again: 4 bits a value, a statistics
    byte per block of 64, a 4-byte maximum per 256 blocks and a 4-byte offset."""
    n = rows_ * cols
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4


def projections() -> list[tuple[int, int]]:
    """One layer's seven (out, in) weights: q, k, v, o, gate, up, down."""
    h, f = HIDDEN, SHAPE.ffn_hidden_size
    a, kv = SHAPE.num_heads * SHAPE.head_dim, SHAPE.num_kv_heads * SHAPE.head_dim
    return [(a, h), (kv, h), (kv, h), (h, a), (f, h), (f, h), (h, f)]


def test_the_nf4_base_is_the_plans_up_to_fsdps_padding(run):
    """Whole model: 4 layers x (q, o 512 x 512: 131,072 + 4,096 + 64 + 4 = 135,236 bytes; k, v 256 x 512: 67,620;
    gate, up, down 1,536 x 512: 393,216 + 12,288 + 192 + 4 = 405,700) = 4 x 1,622,812 = 6,491,248 bytes, the plan's
    and one process's. At DP=2 FSDP shards each NF4 tensor's rows: codes and statistics (one row a block), maxima
    (16, 8 or 48 rows) split evenly, but the offset's single row is padded to one on each rank, 4 bytes where the
    plan's even split of the total counts 2: each rank stores the plan's share plus 2 bytes for each of the
    7 x 4 weights; its unpadded shard has all of the offsets on rank 0, none on rank 1, so the two add up to the
    whole."""
    results, _ = run
    r, cells = results["qlora_memory"], rows(results)
    whole = LAYERS * sum(quantized_bytes(*shape) for shape in projections())
    assert SHAPE == QLORA_QUICK and whole == 6_491_248  # the docstring's arithmetic for the quick shape
    assert r["plan"]["dp1"]["nf4_whole_model_bytes"] == r["plan"]["fsdp_dp2"]["nf4_whole_model_bytes"] == whole
    assert cells["dp1", 0, "nf4_base"]["measured"] == cells["dp1", 0, "nf4_base"]["planned"] == whole
    weights = 7 * LAYERS
    for rank in (0, 1):
        row = cells["fsdp_dp2", rank, "nf4_base"]
        assert row["planned"] == whole // 2
        assert row["measured"] == row["planned"] + 2 * weights
    shards = [rank["nf4_shard_bytes"] for rank in r["measured"]["fsdp_dp2"]]
    assert shards == [whole // 2 + 2 * weights, whole // 2 - 2 * weights] and sum(shards) == whole
    assert r["plan"]["dp1"]["nf4_parameters"] == LAYERS * sum(a * b for a, b in projections())


def test_the_other_state_parts_equal_the_plans_on_every_rank(run):
    """The frozen fp32 weights, the adapters, their gradients and AdamW's state: measured == planned exactly, and
    the adapters are the plan's count (r x (in + out) of each projection, halved over DP=2: every dim 0 is even)."""
    results, _ = run
    cells = rows(results)
    adapters = LAYERS * sum(RANK * (a + b) for a, b in projections())
    assert results["qlora_memory"]["plan"]["dp1"]["trainable_parameters"] == adapters
    for layout, ranks, dp in (("dp1", 1, 1), ("fsdp_dp2", 2, 2)):
        for rank in range(ranks):
            for part in EXACT:
                row = cells[layout, rank, part]
                assert row["measured"] == row["planned"], (layout, rank, row)
            assert cells[layout, rank, "adapters"]["measured"] == 4 * adapters // dp
            # 2 moments of 4 bytes an element of the shard, a 4-byte step per adapter tensor (2 a projection)
            assert cells[layout, rank, "adamw"]["measured"] == 8 * adapters // dp + 4 * 2 * 7 * LAYERS


def test_nothing_else_lives_between_steps_and_fsdp_halves_the_state(run):
    results, _ = run
    r = results["qlora_memory"]
    for ranks in r["measured"].values():
        for rank in ranks:
            assert rank["resident_other"] == 0 and rank["resident"] == sum(rank[part] for part in STATE)
    halving = r["fsdp_halving"]
    assert halving["frozen_fp32"] == halving["adapters"] == halving["gradients"] == 0.5
    one, two = r["measured"]["dp1"][0], r["measured"]["fsdp_dp2"][0]
    assert 2 * two["nf4_base"] == one["nf4_base"] + 4 * 7 * LAYERS  # the padded offsets
    assert 2 * two["adamw"] == one["adamw"] + 4 * 2 * 7 * LAYERS  # every rank keeps every step


def test_the_end_of_the_forward_is_the_plans_activations_as_derived(run):
    """Measured - planned = the adapters' intermediates A x (r fp32 values a token for each of 7 projections, saved
    for B's weight gradient; the plan does not count them), less the LM head's input (b s h fp32: the frozen output
    layer saves none, the plan counts it), within 16 bytes a token: the token ids (8 a token, made outside any
    operator) and layer 0's first norm statistic (4 a token; its input, the frozen embedding's, needs no gradient)
    are planned but not measured, the step's 4-byte loss accumulator is measured but not planned. At FSDP DP=2 the
    plan's figure includes the gathered root (embedding, output layer, final norm), which the measurement holds too.
    Quick shape: 4 x 7 x 16 x 256 x 4 - 256 x 512 x 4 = 458,752 - 524,288."""
    results, _ = run
    r, cells = results["qlora_memory"], rows(results)
    expected = LAYERS * 7 * RANK * TOKENS * 4 - TOKENS * HIDDEN * 4
    assert r["plan"]["fsdp_dp2"]["root_gathered"] == 4 * (2 * SHAPE.vocab_size * HIDDEN + HIDDEN)
    for layout, ranks in (("dp1", 1), ("fsdp_dp2", 2)):
        plan = r["plan"][layout]
        assert plan["forward_end"] == plan["activations"] + plan["root_gathered"]
        for rank in range(ranks):
            row = cells[layout, rank, "forward_end"]
            assert abs(row["measured"] - row["planned"] - expected) <= 16 * TOKENS, (layout, rank, row)


def test_the_step_peak_lies_between_the_forward_and_the_plan(run):
    """The plan's step peak (gradients + activations + FSDP's gathered units + the largest layer's dequantized
    weights) is an upper bound: the backward holds one projection's dequantized weight at a time, not the layer's
    seven, and only the gradients of the layers it has passed. The peak is at least what the end of the forward
    holds plus one dequantized projection (4 bytes an element: down, 512 x 1,536, the first the backward dequantizes
    again, while every layer's activations are alive) less the loss's saved tensors freed before it (at most
    b s V fp32 of logits gradient). The totals add what lives between steps, which is the plan's state but the
    gradients."""
    results, _ = run
    r, cells = results["qlora_memory"], rows(results)
    down = 4 * HIDDEN * SHAPE.ffn_hidden_size
    for layout, ranks in (("dp1", 1), ("fsdp_dp2", 2)):
        plan = r["plan"][layout]
        assert plan["step_peak"] == plan["gradients"] + plan["activations"] + plan["gathered"] + plan["dequantized"]
        assert plan["dequantized"] == 4 * sum(a * b for a, b in projections())
        assert (plan["gathered"] > plan["root_gathered"] > 0) == (layout == "fsdp_dp2")
        for rank in range(ranks):
            measured = r["measured"][layout][rank]
            peak = cells[layout, rank, "step_peak"]
            assert measured["forward_end"] + down - 4 * TOKENS * SHAPE.vocab_size <= peak["measured"] \
                <= peak["planned"], (layout, rank, measured)
            total = cells[layout, rank, "total"]
            assert total["measured"] == measured["resident"] + peak["measured"]
            assert total["planned"] == sum(plan[part] for part in STATE) + plan["step_peak"]


def test_benchmarks_md_shows_the_table(run):
    results, text = run
    r, cells = results["qlora_memory"], rows(results)
    assert "## QLoRA memory per rank, planned against measured (`qlora_memory`)" in text
    assert f"on {results['machine']['cpu']}" in text
    nf4 = cells["fsdp_dp2", 0, "nf4_base"]
    assert f"| {cells['dp1', 0, 'nf4_base']['planned']:,} | {cells['dp1', 0, 'nf4_base']['measured']:,} | 1.0000 | " \
           f"{nf4['planned']:,} | {nf4['measured']:,} |" in text
    peak = cells["fsdp_dp2", 1, "step_peak"]
    assert f"| {peak['measured']:,} | {peak['ratio']:.4f} |" in text
    assert f"{r['plan']['dp1']['bits_per_weight']:.3f} bits a weight" in text
