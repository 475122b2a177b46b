"""`shardlm plan` models the combinations training composes: MoE with context parallelism (EP folded over
DP x CP), FSDP with pipeline stages, FSDP with MoE layers, and hybrid sharding (`train.fsdp_shard_size`).

Every term is checked against a formula written here from the model's shape (layers, widths, experts,
vocabulary) and the link model of `docs/plan.md` (ring collectives; NVLink inside an 8-GPU server, the
server's network shared by the groups that cross it): Qwen3-30B-A3B at 131,072 tokens on 64 H100s picks
C > 1 and fits; Llama 3 70B at PP=2 under FSDP holds its stage's state / DP and its stage's units gathered;
Mixtral 8x7B under FSDP shards its experts over expert-DP; Llama 3 8B shards over 8 GPUs of a server
(hybrid), which wins over full sharding on a slow network and loses on the H100 servers' 400 GB/s.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from shardlm.cli import main
from shardlm.plan.activations import LayerSetting, shardlm_memory
from shardlm.plan.context import context_invalid_reason, context_options
from shardlm.plan.experts import all_to_all_bytes
from shardlm.plan.fsdp import FSDPUnits, fsdp_units
from shardlm.plan.hardware import gpu_preset
from shardlm.plan.memory import numeric_format
from shardlm.plan.models import PlannedModel, resolve_model
from shardlm.plan.parameters import parameter_count
from shardlm.plan.planner import PlanRequest, expert_options, invalid_reason, plan, shard_size_options
from shardlm.plan.sc21 import SC21_CALIBRATION
from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages
from shardlm.plan.timing import Layout, dp_comm_seconds, step_time

H100 = gpu_preset("h100")
CAL = SC21_CALIBRATION
LONG = 131072


def with_length(name: str, seq_length: int | None = None) -> PlannedModel:
    model = resolve_model(name)
    return PlannedModel(model.name, dataclasses.replace(model.config, seq_length=seq_length or model.config.seq_length))


def request(name: str, gpus: int = 64, global_batch: int = 64, seq_length: int | None = None, gpu=H100,
            **changes) -> PlanRequest:
    return PlanRequest(model=with_length(name, seq_length), gpu=gpu, gpus=gpus, global_batch=global_batch,
                       calibration=CAL, **changes)


def ring(nbytes: float, ranks: int, stride: int, allreduce: bool = False, gpu=H100) -> float:
    """A ring all-gather / reduce-scatter (all-reduce: twice the steps and bytes) of nbytes over `ranks` ranks
    `stride` GPUs apart: NVLink (half the bidirectional figure per direction) while a server holds them all;
    across servers also the server's network, carrying it for the min(stride, 8) groups the server hosts at
    once; the slower link sets the time."""
    if ranks == 1:
        return 0.0
    factor = 2 if allreduce else 1
    steps = factor * (ranks - 1)

    def over(nbytes_: float, bandwidth: float, latency: float) -> float:
        return steps / ranks * nbytes_ / (bandwidth * CAL.link_efficiency) + steps * latency

    nvlink = over(nbytes, gpu.intra_node_gbps / 2 * 1e9, CAL.intra_node_latency_s)
    per_node = max(1, gpu.gpus_per_node // stride)
    if math.ceil(ranks / per_node) == 1:
        return nvlink
    return max(nvlink, over(min(stride, gpu.gpus_per_node) * nbytes, gpu.inter_node_gbps * 1e9,
                            CAL.inter_node_latency_s))


def layer_windows(time, cfg, global_batch: int, tp: int, layers: int, m: int, recompute: bool) -> tuple[float, float]:
    """One layer's forward and backward seconds for one micro-batch: its share of the step's compute (less the
    LM head's 6 s h V_padded FLOPs per sequence), elementwise and TP work, split 1/3 : 2/3 (1/4 : 3/4 when
    recomputing)."""
    padded = -(-cfg.vocab_size // (128 * tp)) * 128 * tp
    head = 6 * global_batch * cfg.seq_length * cfg.hidden_size * padded
    per_layer = (time.compute_s * (1 - head / time.model_flops) + time.elementwise_s + time.tp_comm_s) / (m * layers)
    forward = (1 / 4 if recompute else 1 / 3) * per_layer
    return forward, per_layer - forward


def exposed(seconds: float, window: float) -> float:
    return seconds - min(CAL.dp_overlap * seconds, window)


# ------------------------------------------------------------------------------- MoE under context parallelism

def qwen_expert_elements(tp: int, ep: int) -> int:
    """Qwen3-30B-A3B's routed experts on one (TP, EP) rank: 48 layers x 128 / EP experts x gate, up, down
    (768 x 2048 each, split over TP)."""
    return 48 * (128 // ep) * 3 * 768 * 2048 // tp


def test_moe_models_are_searched_with_context_parallelism_and_ep_folds_over_dp_x_cp():
    """The refusal is gone; long MoE sequences get C > 1; E runs over the divisors of DP x CP that divide the
    128 experts (at DP = 2 x CP = 8: up to 16, which DP alone does not allow); EP = 32 is refused there."""
    qwen = request("qwen3-30b-a3b", seq_length=LONG)
    cfg = qwen.model.config
    assert context_invalid_reason(cfg, 2) is None
    assert context_options(cfg, 16, None, "shardlm") == [1, 2, 4, 8, 16]
    assert expert_options(qwen, 2, 8) == [1, 2, 4, 8, 16]
    assert invalid_reason(qwen, 4, 1, ep=16, cp=8) is None  # 64 / (4 x 8) = DP 2
    assert invalid_reason(qwen, 4, 1, ep=32, cp=8) == "DP=2 x CP=8 is not divisible by EP=32"


@pytest.fixture(scope="module")
def qwen_long_plan():
    """Qwen3-30B-A3B trained at 131,072 tokens on 64 H100s, 64 sequences per step."""
    return plan(request("qwen3-30b-a3b", seq_length=LONG))


def test_qwen3_30b_at_131072_tokens_on_64_h100s_plans_context_parallelism_and_fits(qwen_long_plan):
    """The recommendation splits the sequence (C > 1) and the experts (E > 1) and fits in 80 GB; some planned
    layouts fold EP over CP (E > DP)."""
    best = qwen_long_plan.recommended
    assert best.cp > 1 and best.ep > 1 and best.fits and best.choice.total_bytes <= 80e9
    assert (best.dp * best.cp) % best.ep == 0 and best.choice.layout.gpus == 64
    assert any(row.ep > row.dp and row.fits for row in qwen_long_plan.rows)


def test_a_context_ranks_moe_activations_and_all_to_all_are_those_of_its_tokens(qwen_long_plan):
    """A CP rank's row saves what the MoE layers save for T / C tokens, and its all-to-all sends per MoE layer
    b (T / C) k h (E - 1) / E rows of h at dispatch (fp32 residual) and combine (bf16), forward and backward
    (+ the recomputed forward): on NVLink at TP x E <= 8, E - 1 latencies each."""
    cfg, fmt = qwen_long_plan.request.model.config, qwen_long_plan.request.format
    row = next(r for r in qwen_long_plan.rows if r.cp > 1 and r.ep > 1 and r.pp == 1 and r.tp * r.ep <= 8)
    layout, tp, ep, cp = row.choice.layout, row.tp, row.ep, row.cp
    short = dataclasses.replace(cfg, seq_length=LONG // cp)
    assert row.choice.activations == shardlm_memory(short, tp, layout.micro_batch, fmt,
                                                    LayerSetting(layout.sequence_parallel, layout.recompute), ep=ep)
    rows = layout.micro_batch * (LONG // cp) * 8 * 2048 * (ep - 1) / ep
    assert all_to_all_bytes(short, layout.micro_batch, ep, fmt) == (rows * 4, rows * 2)
    intra = H100.intra_node_gbps / 2 * 1e9 * CAL.link_efficiency
    one = rows * (4 + 2) / intra + 2 * (ep - 1) * CAL.intra_node_latency_s
    passes = 3 if layout.checkpointing else 2
    assert row.choice.time.ep_comm_s == pytest.approx(row.choice.accumulation * 48 * passes * one, rel=1e-12)


@pytest.mark.parametrize("dp, cp, ep", [(2, 8, 4), (1, 16, 16), (8, 8, 8)])
def test_expert_gradients_are_reduced_over_dp_x_cp_over_ep(dp, cp, ep):
    """At TP = 1: the dense gradients all-reduced over the DP x CP ranks (1 apart), the experts' over the
    DP x CP / E ranks holding the same experts (E apart), fp32 gradients."""
    cfg = request("qwen3-30b-a3b", seq_length=LONG).model.config
    params = parameter_count(cfg, 1, ep)
    assert params.expert == qwen_expert_elements(1, ep)
    layout = Layout(tp=1, dp=dp, cp=cp, ep=ep, micro_batch=1, checkpointing=False)
    expected = ring(params.dense * 4, dp * cp, 1, True) + ring(params.expert * 4, dp * cp // ep, ep, True)
    assert dp_comm_seconds(params, layout, H100, numeric_format("bf16"), CAL) == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------------- FSDP with pipeline stages

def llama_elements(name: str, tp: int) -> tuple[int, int, int]:
    """(one layer's elements, the embedding's (= the output layer's), the final norm's) of a Llama 3 on one
    TP rank: q and o h x h, k and v 8 KV heads x 128 x h, gate, up, down f x h, all split; two norms of h;
    V_padded x h split by rows, V padded to a multiple of 128 TP."""
    cfg = resolve_model(name).config
    h, f = cfg.hidden_size, cfg.ffn_size
    padded = -(-cfg.vocab_size // (128 * tp)) * 128 * tp
    return (2 * h * h + 2 * 1024 * h + 3 * f * h) // tp + 2 * h, padded * h // tp, h


def test_fsdp_with_pipeline_stages_holds_the_stages_state_over_dp_and_its_units_gathered():
    """Llama 3 70B, PP=2 x TP=8 x FSDP DP=4: pipeline rank 0 has layers 0-39 and the embedding, rank 1 layers
    40-79, the final norm and the output layer. The busiest holds 16 bytes x its N / DP (+ 4 per tensor: 9 per
    layer, the end pieces') and, since every backward on PyTorch's schedules keeps its layers gathered and
    their fp32 gradients unsharded until the step's reduce-scatter, N (w + 4) bytes, w = 4 (fp32 parameters)."""
    req = request("llama3-70b", data_sharding="full", pipeline=2, micro_batch=1, recompute="full")
    cfg = req.model.config
    layer, embedding, norm = llama_elements("llama3-70b", 8)
    held = {0: (40 * layer + embedding, 9 * 40 + 1), 1: (40 * layer + embedding + norm, 9 * 40 + 2)}
    for rank, (n, _) in held.items():
        stages = rank_stages(pipeline_layers(80, 2, 1), 2, rank)
        assert fsdp_units(cfg, 8, stages) == FSDPUnits(layer=layer, root=n - 40 * layer, layers=40,
                                                       all_layers=40 * layer)
    row = next(r for r in plan(req).rows if r.tp == 8)
    choice = row.choice
    assert (row.pp, row.dp, choice.layout.data_sharding) == (2, 4, "full")
    n, tensors = held[choice.busiest_stage]
    share = -(-n // 4)
    assert (choice.state.parameters, choice.state.gradients, choice.state.optimizer) == \
        (4 * share, 4 * share, 8 * share + 4 * tensors)
    assert choice.gathered == n * (4 + 4)
    assert choice.total_bytes == choice.state.total + choice.activation_peak + choice.gathered + 2 * 10**9


@pytest.mark.parametrize("tp, dp, recompute", [(8, 4, True), (4, 8, False)])
def test_fsdp_with_pipeline_stages_time_terms_equal_the_formula(tp, dp, recompute):
    """PP=2, 4 micro-batches: rank 0's root (the embedding) gathered once and reduce-scattered, each of its 40
    layers gathered 1 + m times and reduce-scattered once, on the DP group (TP apart). Exposed: the first
    forward's gathers and the backwards' gathers less what hides behind a layer's forward / backward; the
    root and every reduce-scatter, which the schedule issues after the flush, in full."""
    req = request("llama3-70b", gpus=2 * tp * dp, global_batch=4 * dp)
    cfg, fmt = req.model.config, req.format
    layer, embedding, _ = llama_elements("llama3-70b", tp)
    units = FSDPUnits(layer=layer, root=embedding, layers=40)
    layout = Layout(tp=tp, dp=dp, pp=2, micro_batch=1, checkpointing=recompute, sequence_parallel=True,
                    full_sharding=True)
    stages = rank_stages(pipeline_layers(80, 2, 1), 2, 0)
    params = rank_parameter_count(cfg, tp, stages)
    assert params.total == units.total
    time = step_time(cfg, layout, req.global_batch, H100, fmt, params, CAL, units=units)
    m, w = 4, fmt.weight_bytes
    gather, reduce = ring(layer * w, dp, tp), ring(layer * 4, dp, tp)
    root = ring(embedding * w, dp, tp) + ring(embedding * 4, dp, tp)
    assert time.dp_comm_s == pytest.approx(root + 40 * ((1 + m) * gather + reduce), rel=1e-12)
    forward, backward = layer_windows(time, cfg, req.global_batch, tp, 40, m, recompute)
    expected = root + 40 * (exposed(gather, forward) + m * exposed(gather, backward) + reduce)
    assert time.dp_exposed_s == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------------------- FSDP with MoE

def mixtral_elements(tp: int, ep: int) -> tuple[int, int, int, int]:
    """(one layer's elements without its experts, its E / EP experts', the root's, tensors) of Mixtral 8x7B
    on one (TP, EP) rank: Llama attention (q, o h x h; k, v 8 x 128 x h; split), two norms, the router 8 x h
    (replicated), experts gate, up, down 14,336 x h split over TP; embedding and output V_padded x h split,
    the final norm; tensors 4 + 2 + 1 + 3 per layer, 3 outside."""
    h, f = 4096, 14336
    padded = -(-32000 // (128 * tp)) * 128 * tp
    dense = (2 * h * h + 2 * 1024 * h) // tp + 2 * h + 8 * h
    return dense, (8 // ep) * 3 * f * h // tp, 2 * padded * h // tp + h, 10 * 32 + 3


def test_fsdp_with_moe_shards_split_experts_over_expert_dp():
    """Mixtral 8x7B on 16 H100s, TP=2 x FSDP DP=8, EP=4 (expert-DP = 2), half parameters, 8 micro-batches: a
    rank holds 16 bytes per element of its dense N_d / 8 and expert N_e / 2 (+ 4 per tensor); gathered: the root
    and two whole layers (experts included) in bf16, and every unit's fp32 gradient (m > 1)."""
    req = request("mixtral-8x7b", gpus=16, data_sharding="full", expert=4, pipeline=1, micro_batch=1,
                  param_dtype="half", recompute="full", fsdp_shard_size=0)
    dense, experts, root, tensors = mixtral_elements(2, 4)
    layer, n = dense + experts, root + 32 * (dense + experts)
    cfg = req.model.config
    assert fsdp_units(cfg, 2, ep=4) == FSDPUnits(layer=layer, root=root, layers=32, all_layers=32 * layer,
                                                 expert=32 * experts)
    params = parameter_count(cfg, 2, 4)
    assert (params.total, params.expert, params.tensors) == (n, 32 * experts, tensors)
    row = next(r for r in plan(req).rows if r.tp == 2)
    choice = row.choice
    assert (row.dp, row.ep, choice.accumulation, choice.layout.data_sharding) == (8, 4, 8, "full")
    share = -(-(n - 32 * experts) // 8) + -(-(32 * experts) // 2)
    assert (choice.state.parameters, choice.state.gradients, choice.state.optimizer) == \
        (4 * share, 4 * share, 8 * share + 4 * tensors)
    assert choice.gathered == root * 2 + 2 * layer * 2 + 4 * n
    # hybrid sharding over S = 4 of the 8 DP ranks: the dense units / 4, the split experts still / 2
    hybrid = next(r for r in plan(dataclasses.replace(req, fsdp_shard_size=4)).rows if r.tp == 2).choice
    share = -(-(n - 32 * experts) // 4) + -(-(32 * experts) // 2)
    assert hybrid.layout.fsdp_shard_size == 4
    assert (hybrid.state.parameters, hybrid.state.gradients) == (4 * share, 4 * share)


def test_fsdp_with_moe_time_terms_gather_experts_over_expert_dp():
    """TP=2 x DP=32 x EP=4 (64 GPUs): per layer, the dense part all-gathered over the 32 DP ranks (2 apart) and
    the experts over their 8 expert-DP ranks (8 apart, one per server), 1 + m times; each reduce-scattered
    once; the root over DP."""
    req = request("mixtral-8x7b", global_batch=64)
    cfg, fmt = req.model.config, req.format
    dense, experts, root, _ = mixtral_elements(2, 4)
    layout = Layout(tp=2, dp=32, ep=4, micro_batch=1, checkpointing=True, sequence_parallel=True,
                    full_sharding=True)
    time = step_time(cfg, layout, 64, H100, fmt, parameter_count(cfg, 2, 4), CAL)
    m, w = 2, fmt.weight_bytes

    def per_layer(nbytes_per_element: int) -> float:
        return ring(dense * nbytes_per_element, 32, 2) + ring(experts * nbytes_per_element, 8, 8)

    gather, reduce = per_layer(w), per_layer(4)
    root_s = ring(root * w, 32, 2) + ring(root * 4, 32, 2)
    assert time.dp_comm_s == pytest.approx(root_s + 32 * ((1 + m) * gather + reduce), rel=1e-12)
    forward, backward = layer_windows(time, cfg, 64, 2, 32, m, True)
    expected = root_s + 32 * (exposed(gather, forward) + (m - 1) * exposed(gather, backward)
                              + exposed(gather + reduce, backward))
    assert time.dp_exposed_s == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------------------------- hybrid sharding

def llama8b_units(tp: int) -> tuple[int, int, int]:
    """(layer, root, N) of Llama 3 8B on one TP rank."""
    layer, embedding, norm = llama_elements("llama3-8b", tp)
    return layer, 2 * embedding + norm, 32 * layer + 2 * embedding + norm


def test_hybrid_sharding_holds_the_state_over_the_shard_group():
    """Llama 3 8B, TP=1 x DP=64, train.fsdp_shard_size = 8: a rank holds 16 bytes per element of N / 8 (+ 4 per
    tensor), not N / 64; the gathered units are full sharding's (the root and its gradient, two layers, one
    layer's fp32 gradient at m = 1)."""
    req = request("llama3-8b", data_sharding="full", pipeline=1, context=1, fsdp_shard_size=8, micro_batch=1,
                  recompute="full")
    layer, root, n = llama8b_units(1)
    row = next(r for r in plan(req).rows if r.tp == 1)
    choice = row.choice
    assert (row.dp, choice.layout.fsdp_shard_size, choice.accumulation) == (64, 8, 1)
    share = -(-n // 8)
    assert (choice.state.parameters, choice.state.gradients, choice.state.optimizer) == \
        (4 * share, 4 * share, 8 * share + 4 * (9 * 32 + 3))
    assert choice.gathered == 2 * root * 4 + 2 * layer * 4 + 4 * layer


@pytest.mark.parametrize("tp, dp, shard", [(1, 64, 8), (2, 32, 4), (1, 16, 4)])
def test_hybrid_sharding_time_terms_equal_the_formula(tp, dp, shard):
    """Gathers and reduce-scatters over the S shard ranks (TP apart: one server's when S x TP <= 8), and after
    each reduce-scatter an all-reduce of the unit's gradient shard (4 bytes x elements / S) over the DP / S
    shard groups (TP x S apart); the all-reduce hides behind the backward with the reduce-scatter."""
    req = request("llama3-8b", gpus=tp * dp, global_batch=2 * dp)
    cfg, fmt = req.model.config, req.format
    layer, root, _ = llama8b_units(tp)
    layout = Layout(tp=tp, dp=dp, micro_batch=1, checkpointing=True, sequence_parallel=tp > 1,
                    full_sharding=True, fsdp_shard_size=shard)
    time = step_time(cfg, layout, req.global_batch, H100, fmt, parameter_count(cfg, tp), CAL)
    m, w, groups = 2, fmt.weight_bytes, dp // shard

    def reduce_of(elements: int) -> float:
        return ring(elements * 4, shard, tp) + ring(elements * 4 / shard, groups, tp * shard, True)

    gather, reduce = ring(layer * w, shard, tp), reduce_of(layer)
    root_s = ring(root * w, shard, tp) + reduce_of(root)
    assert time.dp_comm_s == pytest.approx(root_s + 32 * ((1 + m) * gather + reduce), rel=1e-12)
    forward, backward = layer_windows(time, cfg, req.global_batch, tp, 32, m, True)
    expected = root_s + 32 * (exposed(gather, forward) + (m - 1) * exposed(gather, backward)
                              + exposed(gather + reduce, backward))
    assert time.dp_exposed_s == pytest.approx(expected, rel=1e-12)
    hbm = H100.hbm_gbps * 1e9 * CAL.memory_efficiency
    assert time.optimizer_s == pytest.approx(parameter_count(cfg, tp).total / shard * 40 / hbm, rel=1e-12)


def hybrid_rows(gpu, shard_size):
    """Llama 3 8B on 64 GPUs, FSDP without pipeline or CP: the TP = 1 row (DP = 64)."""
    req = request("llama3-8b", gpu=gpu, data_sharding="full", pipeline=1, context=1, fsdp_shard_size=shard_size)
    return next(r for r in plan(req).rows if r.tp == 1)


def test_hybrid_sharding_wins_on_a_slow_network_and_loses_on_h100_servers():
    """On servers with 25 GB/s of network each (2 x 100 Gb/s), the planner picks S = 8 for TP 1 x DP 64 and it
    is faster than sharding over all 64 ranks: the ring over 64 ranks pushes its (1 + m) gathers and the
    reduce-scatter through every server's network, hybrid only the all-reduce of 1/8 of the gradients from each
    GPU. On H100 servers (400 GB/s each) full sharding is faster: the network carries one ring per server as
    fast as NVLink, and hybrid adds the all-reduce after the reduce-scatter."""
    slow = dataclasses.replace(H100, inter_node_gbps=25.0)
    searched, full, hybrid = (hybrid_rows(slow, size) for size in (None, 0, 8))
    assert searched.choice.layout.fsdp_shard_size == 8 and searched.fits
    assert hybrid.choice.time.total_s < full.choice.time.total_s
    assert searched.choice.time == hybrid.choice.time
    searched, full, hybrid = (hybrid_rows(H100, size) for size in (None, 0, 8))
    assert searched.choice.layout.fsdp_shard_size == 0
    assert full.choice.time.total_s < hybrid.choice.time.total_s


def test_hybrid_sizes_searched_and_refused():
    """Searched: 0 and GPUs per node / TP when it is between 1 and DP x CP and divides it, with split experts
    too (their units stay sharded over expert-DP); a fixed S = DP x CP is plain full sharding."""
    req = request("llama3-8b")
    assert shard_size_options(req, 1, 64, 1, 1) == [0, 8]
    assert shard_size_options(req, 2, 16, 2, 1) == [0, 4]
    assert shard_size_options(req, 8, 8, 1, 1) == [0]
    assert shard_size_options(req, 1, 4, 1, 1) == [0]  # 8 does not divide DP x CP = 4
    assert shard_size_options(req, 1, 64, 1, 2) == [0, 8]
    fixed = dataclasses.replace(req, fsdp_shard_size=4)
    assert shard_size_options(fixed, 1, 64, 1, 1) == [4] and shard_size_options(fixed, 1, 4, 1, 1) == [0]
    assert shard_size_options(fixed, 1, 64, 1, 2) == [4] and shard_size_options(fixed, 1, 6, 1, 1) == []
    moe = request("mixtral-8x7b", gpus=16, data_sharding="full", fsdp_shard_size=4, expert=2, pipeline=1)
    assert invalid_reason(moe, 1, 1, ep=2) is None


def test_cli_shows_the_shard_size(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--global-batch", "64",
            "--data-sharding", "full", "--pipeline", "1", "--context", "1", "--fsdp-shard-size", "8"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    tp1 = next(layout for layout in data["layouts"] if layout["tp"] == 1)
    assert tp1["fsdp_shard_size"] == 8 and tp1["data_sharding"] == "full"
    assert main(args) == 0
    assert "full/8" in capsys.readouterr().out
