"""The planner on Llama 3 405B's published H100 runs and on what `--implementation megatron-core` changes.

Published figures: Meta, "The Llama 3 Herd of Models" (2024), Table 4 (TFLOP/s per GPU, BF16 MFU, the TP /
CP / PP / DP layouts; its last row's DP 4 corrected to 8, which its 16,384 GPUs and 16M-token batch imply).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardlm.plan.evaluate import Evaluator
from shardlm.plan.flops import flops_per_step
from shardlm.plan.generations import (
    A100_MATMUL_EFFICIENCY,
    H100_MATMUL_EFFICIENCY,
    HOPPER_CALIBRATION,
    default_calibration,
)
from shardlm.plan.hardware import GPU_PRESETS
from shardlm.plan.kernels import CORE_KERNELS, SC21_KERNELS
from shardlm.plan.llama3 import LLAMA3_405B, TABLE4, as_run, compare, request, tflops
from shardlm.plan.sc21 import SC21_CALIBRATION
from shardlm.plan.stages import trimmed_layers, trimmed_split
from shardlm.plan.timing import PAPER_CALIBRATION, Layout

ROWS = {(row.gpus, row.sequence): row for row in TABLE4}


@pytest.fixture(scope="module")
def comparisons():
    return {key: compare(row) for key, row in ROWS.items()}


def test_table4_is_consistent():
    """The rows' layouts multiply to their GPUs, their batches are 16M tokens, and MFU is TFLOP/s over 989."""
    for row in TABLE4:
        assert row.tp * row.cp * row.pp * row.dp == row.gpus
        assert row.global_batch * row.sequence == 16 * 2 ** 20
        assert abs(100 * row.paper_tflops / 989 - row.paper_mfu) < 1
    assert (ROWS[(16384, 131072)].dp, ROWS[(16384, 131072)].cp) == (8, 16)  # the paper's DP 4 contradicts 16,384


def test_405b_counts_match_published_size():
    """405B parameters; the FLOP count per token is torchtitan's 6 N (without the input embedding) + 12 l a s."""
    from shardlm.plan.parameters import parameter_count

    total = parameter_count(LLAMA3_405B, 1).total
    assert 405e9 < total < 406e9
    embedding = LLAMA3_405B.vocab_size * LLAMA3_405B.hidden_size
    norms = (2 * LLAMA3_405B.num_layers + 1) * LLAMA3_405B.hidden_size
    attention = 12 * LLAMA3_405B.num_layers * LLAMA3_405B.hidden_size * LLAMA3_405B.seq_length
    per_token = flops_per_step(LLAMA3_405B, 1) / LLAMA3_405B.seq_length
    assert per_token == pytest.approx(6 * (total - embedding - norms) + attention, rel=1e-12)


def test_llama3_8192_gpus_at_8k_tokens(comparisons):
    """Table 4: 8,192 H100s, TP 8 x PP 16 x DP 64, 8,192 tokens: 430 TFLOP/s per GPU (43% MFU). As run (V = 8, no
    recomputation), within 10%, and it fits 80 GB once each stage frees its received input (the Llama 3 paper,
    section 3.3.2): it is the planner's own option for the layout, among its five best."""
    found = comparisons[(8192, 8192)]
    assert found.row.paper_tflops == 430
    assert abs(found.error) < 0.10
    assert found.as_run.fits and 79e9 < found.as_run.total_bytes < 80e9
    assert found.layout.choice.layout == found.as_run.layout
    assert found.rank is not None and found.rank < 5


def test_stage_input_freed_after_the_forward():
    """Meta frees each stage's received input after its forward: on the second pipeline rank of the 8,192-GPU row
    (141 in-flight chunks of one layer), 141 layer inputs (8,192 x 16,384 x 2 bytes / TP 8) fewer than the layers
    save; the first stage's own first chunk (the embedding) receives nothing, and full recomputation keeps them."""
    from shardlm.plan.activations import rank_activation_peak
    from shardlm.plan.evaluate import Evaluator
    from shardlm.plan.llama3 import as_run

    row = ROWS[(8192, 8192)]
    evaluator = Evaluator(request(row))
    layout = as_run(row)
    acts = evaluator.choice(layout).activations
    stages = evaluator.rank_params(16, 8, 8, 1, 1, True)[0]
    kept = rank_activation_peak(acts, stages, "interleaved-1f1b", 16, 32, "none")
    freed = rank_activation_peak(acts, stages, "interleaved-1f1b", 16, 32, "none", frees_stage_input=True)
    assert acts.layer_input == 8192 * 16384 * 2 // 8
    assert kept - freed == 141 * acts.layer_input
    assert rank_activation_peak(acts, stages, "interleaved-1f1b", 16, 32, "full", frees_stage_input=True) == \
        rank_activation_peak(acts, stages, "interleaved-1f1b", 16, 32, "full")


def test_llama3_16384_gpus_at_8k_tokens(comparisons):
    """Table 4: 16,384 H100s, TP 8 x PP 16 x DP 128, 8,192 tokens: 400 TFLOP/s per GPU (41% MFU); as run it fits
    and is the planner's own option for that layout."""
    found = comparisons[(16384, 8192)]
    assert found.row.paper_tflops == 400
    assert abs(found.error) < 0.10
    assert found.as_run.fits and found.layout.choice.layout == found.as_run.layout
    assert found.rank is not None and found.rank < 10


def test_llama3_16384_gpus_at_131k_tokens(comparisons):
    """Table 4: 16,384 H100s, TP 8 x CP 16 x PP 16 x DP 8, 131,072 tokens: 380 TFLOP/s per GPU (38% MFU); planned
    with context parallelism under --implementation megatron-core, it is the recommendation; 12.3% high with the K/V
all-gather again in the backward and GQA's expanded dK/dV (16.0% before them)."""
    found = comparisons[(16384, 131072)]
    assert found.row.paper_tflops == 380
    assert found.as_run.fits and found.rank == 0
    assert 0.10 < found.error < 0.13  # +12.3%: not yet within 10%, docs/plan.md says what the model may miss


@pytest.mark.parametrize("slower,low,high", [(1.04, 0.10, 0.102), (1.045, 0.098, 0.0999), (1.25, -0.005, 0.0)])
def test_llama3_131k_row_against_the_attention_rate(slower, low, high):
    """docs/plan.md's distance to 10% at 131,072 tokens: the attention core's rates divided by `slower` (nothing
    else changed) move the row from +12.3% to just over 10% at 4%, within it at 4.5%, and onto Meta's 380 at
    25%."""
    row = TABLE4[2]
    calibration = replace(HOPPER_CALIBRATION, attention_efficiency=HOPPER_CALIBRATION.attention_efficiency / slower,
                          attention_backward_efficiency=HOPPER_CALIBRATION.attention_backward_efficiency / slower)
    req = replace(request(row), calibration=calibration)
    predicted = tflops(req.model.config, row, Evaluator(req).choice(as_run(row)).time.total_s)
    assert low < predicted / row.paper_tflops - 1 < high


def test_older_tables_keep_their_calibrations():
    """The Hopper constants change neither the V100 nor the A100 calibration, and a custom GPU keeps SC21's."""
    assert default_calibration(GPU_PRESETS["v100-dgx2h"]) is PAPER_CALIBRATION
    assert default_calibration(GPU_PRESETS["a100-80gb"]) is SC21_CALIBRATION
    assert default_calibration(GPU_PRESETS["h200-141gb"]) is HOPPER_CALIBRATION
    scaled = SC21_CALIBRATION.compute_efficiency * H100_MATMUL_EFFICIENCY / A100_MATMUL_EFFICIENCY
    assert HOPPER_CALIBRATION.compute_efficiency == pytest.approx(scaled)
    assert 0.65 < scaled < 0.67


def test_causal_flash_attention_time():
    """megatron-core's flash kernel executes half of the attention core's forward FLOPs and 2.5x that backward,
    at its own rates; SC21's kernels run the full square (3 x 4 s^2 a per layer and sequence) at the GEMMs'."""
    cfg = replace(LLAMA3_405B, seq_length=131072)
    counted = 3 * 4 * cfg.seq_length ** 2 * cfg.hidden_size * cfg.num_layers
    assert SC21_KERNELS.counted_attention_flops(cfg, 1, False) == counted
    assert CORE_KERNELS.counted_attention_flops(cfg, 1, True) == 4 / 3 * counted
    forward = counted / 3 / 2
    assert CORE_KERNELS.attention_seconds(cfg, 1, False, 1.0, 0.5, 0.25) == pytest.approx(
        forward / 0.5 + 2.5 * forward / 0.25)
    assert CORE_KERNELS.attention_seconds(cfg, 1, True, 1.0, 0.5, 0.25) == pytest.approx(
        2 * forward / 0.5 + 2.5 * forward / 0.25)


def test_llama3_stage_split():
    """126 layers on 16 x V stages: the first and last stage one layer short (Llama 3's split); at V = 8 the
    first stage holds only the embedding and the last only the output layer, as the paper describes."""
    assert all(trimmed_split(126, 16, v) for v in (1, 2, 4, 8)) and not trimmed_split(126, 16, 3)
    for virtual in (1, 2, 4, 8):
        sizes = [len(s) for s in trimmed_layers(126, 16, virtual)]
        assert sum(sizes) == 126 and sizes[0] == sizes[-1] == 8 // virtual - 1
        assert set(sizes[1:-1]) == {8 // virtual}
    stages = trimmed_layers(126, 16, 8)
    assert [i for s in stages for i in s] == list(range(126))


def test_context_is_planned_for_megatron_core_not_sc21_megatron():
    """--context: refused with SC21's Megatron (one line), searched with megatron-core."""
    from shardlm.errors import UserError
    from shardlm.plan.planner import plan

    row = ROWS[(16384, 131072)]
    with pytest.raises(UserError, match="megatron-core"):
        plan(replace(request(row), implementation="megatron", context=16))
    assert any(r.cp == 16 for r in compare(row).plan.rows)


def test_megatron_core_shards_gradients_with_the_optimizer():
    """ZeRO-2 under megatron-core's distributed optimizer: fp32 gradients are 1/DP x CP per rank."""
    from shardlm.plan.evaluate import Evaluator

    row = ROWS[(16384, 8192)]
    evaluator = Evaluator(request(row))
    base = Layout(tp=8, dp=128, micro_batch=1, checkpointing=False, pp=16, sequence_parallel=True, end_trim=True)
    plain = evaluator.choice(base).state.gradients
    sharded = evaluator.choice(replace(base, distributed_optimizer=True)).state.gradients
    assert sharded == -(-plain // 128)


def test_megatron_core_refuses_moe_models():
    """No activation model for MoE layers under megatron-core: one clear line, as for SC21's Megatron."""
    from shardlm.errors import UserError
    from shardlm.plan.models import MODEL_PRESETS, PlannedModel
    from shardlm.plan.planner import PlanRequest, plan

    model = PlannedModel("mixtral-8x7b", MODEL_PRESETS["mixtral-8x7b"])
    with pytest.raises(UserError, match="megatron-core has no activation model for MoE"):
        plan(PlanRequest(model, GPU_PRESETS["h100-80gb"], 64, 512, implementation="megatron-core"))


def test_cli_validates_against_table4(capsys):
    """`shardlm plan --validate-paper llama3 --json`: the three rows with Meta's figures and the predictions."""
    import json

    from shardlm.cli import main

    assert main(["plan", "--validate-paper", "llama3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["paper_tflops"] for r in rows] == [430, 400, 380]
    assert all(abs(r["error"]) < 0.05 for r in rows[:2]) and abs(rows[2]["error"]) < 0.13 and rows[2]["rank"] == 0


def test_flash_layer_bytes_of_llama3_405b():
    """One layer, one 8,192-token micro-batch at TP 8 with SP, bf16: the four norm and GEMM inputs (2 h each, /t),
    q, k, v and the attention output (2 (2 a + 2 kv), /t), SwiGLU's three f-wide tensors (6 f, /t) per token,
    and the fp32 log-sum-exp of the rank's 16 heads: 533,200,896 bytes."""
    from shardlm.plan.activations import LayerSetting, flash_layer_bytes

    s, h, a, kv, f, t = 8192, 16384, 16384, 1024, 53248, 8
    expected = s * (8 * h + 2 * (2 * a + 2 * kv + 3 * f)) // t + 4 * s * 128 // t
    assert expected == 533_200_896
    assert flash_layer_bytes(LLAMA3_405B, t, 1, LayerSetting(sequence_parallel=True)) == expected
    unsplit = flash_layer_bytes(LLAMA3_405B, t, 1, LayerSetting(sequence_parallel=False))
    assert unsplit - expected == s * 8 * h - s * 8 * h // t  # without SP the norm and GEMM inputs stay whole


def test_context_allgather_seconds():
    """Llama 3's CP at 131,072 tokens, TP 8 x CP 16 (one KV head a TP rank): per layer and micro-batch a ring
    all-gather of K and V (2 x 131,072 x 128 x 2 bytes) forward, and backward the same all-gather again (Transformer
    Engine's all-gather CP saves only the local K and V) and a reduce-scatter of their gradients, (C - 1) / C of it
    through the link plus C - 1 latencies each; the forward's once more with full recomputation."""
    from shardlm.plan.context import allgather_seconds

    cfg = replace(LLAMA3_405B, seq_length=131072)
    nbytes = 2 * 131072 * 128 * 2
    one = 15 / 16 * nbytes / 1e10 + 15 * 1e-5
    assert allgather_seconds(cfg, 16, 8, 1, 2, False, 1e10, 1e-5) == pytest.approx(3 * one)
    assert allgather_seconds(cfg, 16, 8, 1, 2, True, 1e10, 1e-5) == pytest.approx(4 * one)
    assert allgather_seconds(cfg, 1, 8, 1, 2, False, 1e10, 1e-5) == 0


def test_without_context_parallelism_at_8k_tokens():
    """Asked as Meta used CP (only for long sequences: --context 1 at 8K tokens), the planner recommends Table 4's
    layout at both 8,192 and 16,384 GPUs."""
    from shardlm.plan.planner import plan

    for gpus in (8192, 16384):
        row = ROWS[(gpus, 8192)]
        result = plan(replace(request(row), context=1))
        best = result.recommended
        assert (best.tp, best.pp, best.dp) == (row.tp, row.pp, row.dp)


def test_flash_attention_rates_are_the_published_h100_figures():
    """FlashAttention-2 on an H100 SXM5 at head size 128 and 16k tokens: 335 TFLOP/s causal forward and 322 backward
    (FlashAttention-3's paper); its own forward + backward figure, 328 with the causal mask, agrees with them
    within 1% (3.5 / (1 / 335 + 2.5 / 322) = 325)."""
    from shardlm.plan.generations import H100_FLASH_ATTENTION_BACKWARD_EFFICIENCY, H100_FLASH_ATTENTION_EFFICIENCY

    forward, backward = H100_FLASH_ATTENTION_EFFICIENCY * 989, H100_FLASH_ATTENTION_BACKWARD_EFFICIENCY * 989
    assert (forward, backward) == (pytest.approx(335), pytest.approx(322))
    assert 3.5 / (1 / forward + 2.5 / backward) == pytest.approx(328, rel=0.01)
    assert HOPPER_CALIBRATION.attention_backward_efficiency == H100_FLASH_ATTENTION_BACKWARD_EFFICIENCY


def test_gqa_backward_expands_dk_dv_per_query_head():
    """FlashAttention-2's GQA backward writes dK and dV for each of the rank's 16 query heads and reads them back to
    sum: 4 b keys (H/t) d bf16 elements a layer; with CP 16 the rank's two chunks see 33 of the 32 chunks' keys;
    nothing under SC21's kernels or without GQA."""
    cfg = replace(LLAMA3_405B, seq_length=131072)
    assert CORE_KERNELS.gqa_expanded_bytes(cfg, 8, 1, 16, 2) == 4 * 131072 * 33 // 32 * 16 * 128 * 2
    assert CORE_KERNELS.gqa_expanded_bytes(LLAMA3_405B, 8, 1, 1, 2) == 4 * 8192 * 16 * 128 * 2
    assert SC21_KERNELS.gqa_expanded_bytes(cfg, 8, 1, 16, 2) == 0
    assert CORE_KERNELS.gqa_expanded_bytes(replace(LLAMA3_405B, num_kv_heads=128), 8, 1, 1, 2) == 0
