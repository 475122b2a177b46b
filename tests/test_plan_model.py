"""The planner's arithmetic: parameter counts, state bytes, the ring cost model, step times, the
layouts it considers, the paper validation and the command line. No process groups here."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from shardlm.cli import main
from shardlm.models.config import ModelConfig
from shardlm.plan.flops import flops_per_step
from shardlm.plan.hardware import GPU_PRESETS, custom_gpu, gpu_preset
from shardlm.plan.memory import activation_memory, numeric_format, state_memory
from shardlm.plan.models import MODEL_PRESETS, PlannedModel
from shardlm.plan.paper import TABLE1, compare_table1, fit_calibration
from shardlm.plan.parameters import parameter_count
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.timing import (
    PAPER_CALIBRATION,
    Calibration,
    Layout,
    dp_comm_seconds,
    ring_allreduce_seconds,
    step_time,
    tp_comm_seconds,
)

V100 = GPU_PRESETS["v100-dgx2h"]
NO_LATENCY = Calibration(compute_efficiency=0.5, link_efficiency=1.0, dp_overlap=0.0, intra_node_latency_s=0.0,
                         inter_node_latency_s=0.0)


# ------------------------------------------------------------------------------------------ memory

@pytest.mark.parametrize("name,billions", [("scaling-1.2b", 1.2), ("scaling-2.5b", 2.5), ("scaling-4.2b", 4.2),
                                           ("scaling-8.3b", 8.3), ("gpt2-355m", 0.355), ("bert-336m", 0.336)])
def test_parameter_counts_match_the_paper(name, billions):
    total = parameter_count(MODEL_PRESETS[name], 1).total / 1e9
    assert abs(total - billions) / billions < 0.03, f"{name}: {total:.3f}B"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shards_times_tp_plus_replicated_is_the_whole_model(tp):
    cfg = MODEL_PRESETS["scaling-8.3b"]  # vocab 51,200 needs no extra padding up to TP=8
    whole = parameter_count(cfg, 1)
    split = parameter_count(cfg, tp)
    assert split.sharded * tp + split.replicated == whole.total
    h, layers = cfg.hidden_size, cfg.num_layers
    assert split.replicated == layers * 6 * h + cfg.seq_length * h + 2 * h


def test_state_bytes_are_16_per_parameter_in_both_implementations():
    params = parameter_count(MODEL_PRESETS["gpt2-355m"], 2)
    shardlm = state_memory(params, numeric_format("bf16", "shardlm"))
    megatron = state_memory(params, numeric_format("fp16", "megatron"))
    assert (shardlm.parameters, shardlm.gradients) == (4 * params.total, 4 * params.total)
    assert shardlm.optimizer == 8 * params.total + 4 * params.tensors  # moments + one step scalar per tensor
    assert (megatron.parameters, megatron.gradients, megatron.optimizer) == (2 * params.total, 2 * params.total,
                                                                             12 * params.total)


def test_activation_split_part_halves_with_tp_and_checkpointing_keeps_layer_inputs():
    cfg = replace(MODEL_PRESETS["scaling-2.5b"], dropout=0.0)
    fmt = numeric_format("fp32")
    b, s, h, f = 4, cfg.seq_length, cfg.hidden_size, cfg.ffn_size
    one, two = activation_memory(cfg, 1, b, fmt), activation_memory(cfg, 2, b, fmt)
    split_tp1 = b * s * (4 * h + 2 * f) * 4 + b * cfg.num_heads * s * 4  # QKV, SDPA out, fc, GeLU; log-sum-exp
    assert one.per_layer - two.per_layer == split_tp1 // 2
    assert one.stored(True) == cfg.num_layers * b * s * h * 4 + one.outside_layers
    assert one.peak(True) == one.stored(True) + one.per_layer - b * s * h * 4


# ---------------------------------------------------------------------------------------- time model

def test_ring_all_reduce_cost():
    assert ring_allreduce_seconds(1e9, 1, 1e9, 1e-3) == 0.0
    assert ring_allreduce_seconds(1e9, 2, 1e9, 0.0) == pytest.approx(1.0)  # 2 (p-1)/p = 1
    assert ring_allreduce_seconds(1e9, 8, 1e9, 1e-5) == pytest.approx(1.75 + 14e-5)


def test_tp_communication_is_four_all_reduces_per_layer_plus_two_when_recomputing():
    cfg = MODEL_PRESETS["scaling-8.3b"]
    fmt = numeric_format("fp16", "megatron")
    bandwidth = V100.intra_node_gbps / 2 * 1e9
    tokens, h, layers = 8 * cfg.seq_length, cfg.hidden_size, cfg.num_layers
    for checkpointing, per_layer in ((False, 4), (True, 6)):
        layout = Layout(tp=8, dp=1, micro_batch=8, checkpointing=checkpointing)
        # per layer b s h halves, + embedding and LM head, + the loss's 3 floats per token
        volume = (per_layer * layers + 2) * tokens * h * 2 + 3 * tokens * 4
        expected = ring_allreduce_seconds(volume, 8, bandwidth, 0.0)
        assert tp_comm_seconds(cfg, layout, V100, fmt, NO_LATENCY) == pytest.approx(expected)


def test_dp_all_reduce_inside_a_node_uses_nvlink_and_across_nodes_the_network():
    cfg = MODEL_PRESETS["scaling-1.2b"]
    fmt = numeric_format("fp16", "megatron")
    params = parameter_count(cfg, 1)
    grads = params.total * 2
    inside = dp_comm_seconds(params, Layout(1, 16, 8, True), V100, fmt, NO_LATENCY)
    assert inside == pytest.approx(2 * 15 / 16 * grads / (V100.intra_node_gbps / 2 * 1e9))
    params8 = parameter_count(cfg, 8)
    across = dp_comm_seconds(params8, Layout(8, 64, 8, True), V100, fmt, NO_LATENCY)
    # a node hosts 8 DP groups (one per TP position), each sending 2 (p-1)/p of its gradients
    assert across == pytest.approx(2 * 63 / 64 * 8 * params8.total * 2 / (V100.inter_node_gbps * 1e9))


def test_step_time_parts():
    cfg = MODEL_PRESETS["scaling-1.2b"]
    fmt = numeric_format("fp16", "megatron")
    layout = Layout(tp=1, dp=4, micro_batch=2, checkpointing=True)
    params = parameter_count(cfg, 1)
    t = step_time(cfg, layout, 32, V100, fmt, params, NO_LATENCY)
    flops = flops_per_step(cfg, 32, recompute=True)
    assert t.model_flops == flops
    assert t.compute_s == pytest.approx(flops / 4 / (V100.peak_tflops * 1e12 * 0.5))
    assert t.tp_comm_s == 0.0
    assert t.dp_exposed_s == pytest.approx(t.dp_comm_s)  # dp_overlap = 0: nothing hidden
    hidden = step_time(cfg, layout, 32, V100, fmt, params, replace(NO_LATENCY, dp_overlap=1.0))
    assert hidden.dp_exposed_s == pytest.approx(0.0)  # 4 GPUs in one node: the backward is longer
    assert t.total_s == pytest.approx(t.compute_s + t.elementwise_s + t.optimizer_s + t.dp_comm_s)


# --------------------------------------------------------------------------------------------- paper

def test_calibration_constants_are_the_fitted_ones():
    fitted = fit_calibration()
    for key in ("compute_efficiency", "link_efficiency", "dp_overlap"):
        assert getattr(PAPER_CALIBRATION, key) == pytest.approx(getattr(fitted, key), abs=5e-4), key


def test_baseline_reproduces_39_tflops():
    rows = compare_table1()
    assert rows[0].predicted == pytest.approx(100.0)
    from shardlm.plan.paper import predict_run

    assert predict_run(TABLE1[0].model, 1, 1, PAPER_CALIBRATION).tflops_per_gpu(1) == pytest.approx(39.0, abs=0.1)


def test_tensor_parallel_weak_scaling_within_5_points_of_the_paper():
    for row in compare_table1()[:4]:
        assert abs(row.difference) <= 5.0, row


def test_tensor_and_data_parallel_weak_scaling_against_the_paper():
    rows = {row.tp: row for row in compare_table1()[4:]}
    # fitted end point, then the predictions; the 128-GPU (2.5B) row is the documented miss: the paper
    # loses 12 points there and 3-4 everywhere else, which no bandwidth model reproduces
    assert abs(rows[8].difference) <= 0.1
    assert abs(rows[1].difference) <= 5.0
    assert abs(rows[4].difference) <= 5.5
    assert 0 < rows[2].difference <= 12.0
    assert all(row.predicted <= tp_only.predicted + 1e-9
               for row, tp_only in zip(compare_table1()[4:], compare_table1()[:4]))


# ------------------------------------------------------------------------------------------- planner

def request(**changes) -> PlanRequest:
    base = PlanRequest(model=PlannedModel("gpt2-8.3b", MODEL_PRESETS["gpt2-8.3b"]), gpu=gpu_preset("v100"),
                       gpus=512, global_batch=512, precision="fp16", implementation="megatron")
    return replace(base, **changes)


def test_planner_considers_only_valid_layouts_and_recommends_the_fastest_fitting():
    result = plan(request(pipeline=1))
    assert [row.tp for row in result.rows] == [1, 2, 4, 8]  # 24 heads: TP=16 is invalid, >16 leaves the node
    assert "1x16x32" in result.skipped and "heads" in result.skipped["1x16x32"]
    assert not result.rows[0].fits  # 8.3B x 16 bytes on one 32 GB V100
    best = result.recommended
    assert best.fits
    assert best.choice.time.total_s == min(row.choice.time.total_s for row in result.rows if row.fits)
    for row in result.rows:
        assert row.choice.total_bytes == (row.state.total + row.choice.activations.peak(
            row.choice.layout.checkpointing) + row.choice.activations.transient + 2 * 10**9)


def test_nothing_fits_on_a_tiny_gpu():
    small = custom_gpu(gpu_preset("v100"), memory_gb=4)
    assert plan(request(gpu=small, pipeline=1)).recommended is None
    deep = plan(request(gpu=small)).recommended  # pipeline stages split the layers (and their state) further
    assert deep is not None and deep.pp > 1


def test_checkpointing_is_chosen_only_when_needed():
    small_model = PlannedModel("gpt2-355m", MODEL_PRESETS["gpt2-355m"])
    roomy = plan(request(model=small_model, gpu=gpu_preset("h200"), gpus=8, global_batch=64))
    assert not roomy.recommended.choice.layout.checkpointing
    forced = plan(request(model=small_model, gpu=gpu_preset("h200"), gpus=8, global_batch=64, checkpointing="on"))
    assert all(row.choice.layout.checkpointing for row in forced.rows)
    assert forced.recommended.choice.time.total_s > roomy.recommended.choice.time.total_s


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_json(capsys):
    assert main(["plan", "--model", "scaling-1.2b", "--gpus", "16", "--gpu", "a100", "--global-batch", "64",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layout["tp"] for layout in data["layouts"] if layout["pp"] == 1] == [1, 2, 4, 8]
    assert data["recommended"] is not None
    layout = data["layouts"][0]
    assert layout["memory_bytes"]["parameters"] == 4 * layout["parameters_per_rank"]


def test_cli_table_and_paper_validation(capsys):
    assert main(["plan", "--model", "gpt2-355m", "--gpus", "8", "--gpu", "h100", "--global-batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: TP=" in out
    assert main(["plan", "--validate-paper"]) == 0
    out = capsys.readouterr().out
    assert "scaling-8.3b" in out and "74" in out


def test_cli_custom_gpu_and_errors(capsys, tmp_path):
    args = ["plan", "--model", "gpt2-355m", "--gpus", "4", "--global-batch", "8"]
    assert main([*args, "--gpu-memory", "24", "--flops", "100", "--gpus-per-node", "4", "--intra-node-bw", "64",
                 "--inter-node-bw", "25", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["name"] == "custom"
    assert main([*args, "--gpu-memory", "24"]) == 2
    assert "--flops" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2-355m", "--gpus", "20", "--gpu", "h100"]) == 2
    assert "nodes" in capsys.readouterr().err
    assert main(["plan", "--model", "nonexistent-model", "--gpus", "8", "--gpu", "h100"]) == 2
    config = tmp_path / "m.toml"
    config.write_text("[model]\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\nseq_length = 64\n")
    assert main(["plan", "--model", str(config), "--gpus", "2", "--gpu", "h100", "--global-batch", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["vocab_size"] == 50257  # the gpt2 tokenizer's


def test_weak_scaling_ideal_without_communication_or_replicated_work():
    """Sanity of the efficiency definition: with infinite links and no repeated elementwise work,
    per-GPU FLOP/s cannot depend on TP."""
    cfg = MODEL_PRESETS["scaling-4.2b"]
    fast = custom_gpu(V100, intra_node_gbps=1e12, inter_node_gbps=1e12, hbm_gbps=1e15)
    fmt = numeric_format("fp16", "megatron")
    rates = [step_time(cfg, Layout(tp, 1, 8, True), 8, fast, fmt, parameter_count(cfg, tp), NO_LATENCY)
             .tflops_per_gpu(tp) for tp in (1, 2, 4, 8)]
    assert max(rates) / min(rates) == pytest.approx(1.0, abs=1e-3)
    assert math.isclose(rates[0], V100.peak_tflops * 0.5, rel_tol=1e-3)


def test_model_config_has_the_fields_the_planner_reads():
    assert ModelConfig().ffn_size == 4 * ModelConfig().hidden_size


def test_cli_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, shardlm.plan.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


MOE_SHAPES = {
    "gpt-shared-first-dense": ModelConfig(arch="gpt", num_layers=3, hidden_size=32, num_heads=4, seq_length=16,
                                          vocab_size=100, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=24,
                                          moe_shared_experts=1, moe_first_dense_layers=1),
    "llama-sigmoid-bias": ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                                      seq_length=16, vocab_size=100, moe_num_experts=4, moe_top_k=2,
                                      moe_ffn_hidden_size=24, moe_score="sigmoid", moe_expert_bias_rate=1e-3,
                                      moe_shared_experts=2),
    "qwen3-moe": ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=12,
                             qk_norm=True, seq_length=16, vocab_size=100, moe_num_experts=4, moe_top_k=2,
                             moe_ffn_hidden_size=24),
}


@pytest.mark.parametrize("name", MOE_SHAPES)
def test_moe_parameter_count_is_the_built_models(name):
    """Router, expert stacks, shared experts, dense first layers and expert biases, as `build_model` makes
    them: elements and tensors at TP=1, and at EP=2 each rank holds half of the experts' elements."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    cfg = MOE_SHAPES[name]
    params = list(build_model(cfg, ParallelContext.single(), seed=1).parameters())
    count = parameter_count(cfg, 1)
    assert count.total == sum(p.numel() for p in params) and count.tensors == len(params)
    experts = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    assert count.total - parameter_count(cfg, 1, ep=2).total == experts // 2


def test_the_planner_refuses_a_top_k_above_the_expert_count_in_one_line():
    from dataclasses import replace

    from shardlm.errors import UserError
    from shardlm.plan.models import check_model

    check_model(MOE_SHAPES["qwen3-moe"])  # MoE models are planned (tests/test_plan_moe.py)
    with pytest.raises(UserError, match="model.moe_top_k=5 must be between 1 and model.moe_num_experts=4"):
        check_model(replace(MOE_SHAPES["qwen3-moe"], moe_top_k=5))
