"""`shardlm plan` with Mixture-of-Experts models and expert parallelism (pure computation).

Claims: the MoE presets have the parameter totals transformers counts for the published configs and
the published activated counts; an expert-parallel size E holds 1/E of the expert weights and shards
their optimizer state over DP / E; a pipeline rank holding DeepSeek-style first dense layers counts
them as dense; the MoE layer's activation bytes are what autograd saves; the all-to-all bytes are
the rows that leave a rank; the planner searches E and refuses a fixed E that cannot work in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.plan.experts import activated_parameter_count, all_to_all_bytes, moe_layer_activation_bytes
from shardlm.plan.flops import flops_per_token
from shardlm.plan.hardware import gpu_preset
from shardlm.plan.memory import numeric_format, state_memory
from shardlm.plan.models import MODEL_PRESETS, PlannedModel
from shardlm.plan.parameters import parameter_count
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages
from shardlm.plan.timing import Calibration, Layout, all_to_all_seconds, dp_comm_seconds, step_time

NO_LATENCY = Calibration(compute_efficiency=0.5, link_efficiency=1.0, dp_overlap=0.0, intra_node_latency_s=0.0,
                         inter_node_latency_s=0.0)


def _hf_model(name: str):
    """The Hugging Face model of a preset, built from its published config on the meta device."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    if name == "mixtral-8x7b":  # mistralai/Mixtral-8x7B-v0.1 config.json
        config = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                               num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False)
    else:  # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json
        big = name == "qwen3-235b-a22b"
        config = Qwen3MoeConfig(vocab_size=151936, hidden_size=4096 if big else 2048,
                                intermediate_size=12288 if big else 6144, moe_intermediate_size=1536 if big else 768,
                                num_hidden_layers=94 if big else 48, num_attention_heads=64 if big else 32,
                                num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
                                tie_word_embeddings=False)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_moe_preset_parameter_total_equals_transformers(name):
    """The planner's total (TP=1: both vocabularies are multiples of 128, so unpadded) equals the number
    of parameters transformers instantiates for the published config."""
    expected = sum(p.numel() for p in _hf_model(name).parameters())
    assert parameter_count(MODEL_PRESETS[name], 1).total == expected


# Published activated parameters per token: Mistral AI, "Mixtral of experts" (mistral.ai/news/mixtral-of-experts,
# 2023-12-11): 46.7B total, 12.9B used per token; the Qwen3 model cards (huggingface.co/Qwen/Qwen3-30B-A3B and
# huggingface.co/Qwen/Qwen3-235B-A22B): 30.5B total and 3.3B activated, 235B total and 22B activated.
PUBLISHED_ACTIVATED = {"mixtral-8x7b": 12.9e9, "qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9}


@pytest.mark.parametrize("name", list(PUBLISHED_ACTIVATED))
def test_moe_preset_activated_parameters_match_the_published_figure(name):
    """Activated parameters (all but the E - k skipped experts per MoE layer) within 3% of the published count."""
    assert activated_parameter_count(MODEL_PRESETS[name]) == pytest.approx(PUBLISHED_ACTIVATED[name], rel=0.03)


def test_one_more_routed_expert_adds_six_flops_per_activated_parameter():
    """flops_per_token and activated_parameter_count agree: raising top_k by one adds 6 training FLOPs per
    token (2 forward + 4 backward) for every parameter it activates."""
    cfg = MODEL_PRESETS["qwen3-30b-a3b"]
    more = dataclasses.replace(cfg, moe_top_k=cfg.moe_top_k + 1)
    added = activated_parameter_count(more) - activated_parameter_count(cfg)
    assert added > 0 and flops_per_token(more) - flops_per_token(cfg) == 6 * added


@pytest.mark.parametrize("experts", [2, 4, 8])
def test_expert_parallelism_divides_expert_weights_by_e_and_shards_their_state_over_dp_over_e(experts):
    """At EP=E a rank holds exactly 1/E of the expert weights (and their gradients); with the distributed
    optimizer at DP=8 each rank's share of the experts' Adam state stays 1/DP of all experts (1/E of them
    sharded over DP/E ranks), so only padding and step scalars differ from EP=1."""
    cfg, dp = MODEL_PRESETS["qwen3-30b-a3b"], 8
    one, split = parameter_count(cfg, 1), parameter_count(cfg, 1, ep=experts)
    assert split.expert * experts == one.expert and split.dense == one.dense
    fmt = numeric_format("bf16", "shardlm")
    plain_one, plain_split = state_memory(one, fmt, dp), state_memory(split, fmt, dp, ep=experts)
    saved = one.expert * (experts - 1) // experts
    assert plain_one.parameters - plain_split.parameters == saved * fmt.weight_bytes
    assert plain_one.gradients - plain_split.gradients == saved * fmt.grad_bytes
    half = numeric_format("bf16", "shardlm", "half")
    zero_one = state_memory(one, half, dp, distributed_optimizer=True)
    zero_split = state_memory(split, half, dp, distributed_optimizer=True, ep=experts)
    padding_and_steps = 12 * dp + 8  # flat buffers padded to a multiple of DP (DP/E), one more step scalar
    assert abs(zero_one.optimizer - zero_split.optimizer) <= padding_and_steps
    assert zero_one.parameters - zero_split.parameters == pytest.approx(saved * half.weight_bytes, abs=4 * dp)


def test_first_dense_layers_count_as_dense_on_their_pipeline_rank():
    """DeepSeek-style first dense layers and every-other-layer MoE under PP=4: each rank's layer parameters
    equal those of the prefix model ending at its last layer less the prefix before its first layer."""
    cfg = ModelConfig(arch="llama", num_layers=12, hidden_size=64, num_heads=4, num_kv_heads=2, seq_length=32,
                      vocab_size=1000, ffn_hidden_size=256, moe_num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32,
                      moe_shared_experts=1, moe_first_dense_layers=3, moe_layer_interval=2)
    tp, ep, pp = 2, 4, 4
    layers = pipeline_layers(cfg.num_layers, pp, 1)
    ranks = [rank_parameter_count(cfg, tp, rank_stages(layers, pp, r), ep) for r in range(pp)]
    embedding = cfg.padded_vocab_size(tp) // tp * cfg.hidden_size  # the first rank's; the last holds the
    ends = [embedding] + [0] * (pp - 2) + [embedding + cfg.hidden_size]  # output layer and the final norm
    for rank, end, stage in zip(ranks, ends, layers):
        upto, before = (parameter_count(dataclasses.replace(cfg, num_layers=n), tp, ep)
                        for n in (stage[-1] + 1, stage[0]))
        assert rank.total - end == upto.total - before.total
        assert rank.expert == upto.expert - before.expert
    assert ranks[0].expert == 0 and sum(r.total for r in ranks) == parameter_count(cfg, tp, ep).total


MEASURED_SHAPES = {
    "llama-shared": (ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                 seq_length=32, vocab_size=100, moe_num_experts=8, moe_top_k=2,
                                 moe_ffn_hidden_size=48, moe_shared_experts=1, dropout=0.0), "fp32"),
    "gpt-bf16": (ModelConfig(arch="gpt", num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=100,
                             moe_num_experts=8, moe_top_k=2, moe_ffn_hidden_size=48, dropout=0.0,
                             moe_norm_topk_prob=False), "bf16"),
}


@pytest.mark.parametrize("name", MEASURED_SHAPES)
def test_moe_layer_activation_bytes_equal_what_autograd_saves(name):
    """One process on the CPU (every expert local, so the rows per expert need no routing assumption):
    the bytes each MoE layer saves for backward equal `moe_layer_activation_bytes`."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext
    from shardlm.plan.measure import autocast_context, saved_activation_bytes

    cfg, precision = MEASURED_SHAPES[name]
    model = build_model(cfg, ParallelContext.single(), seed=0)
    for experts in model.modules():  # the formula counts the routed rows; bf16 on the CPU would save its
        if hasattr(experts, "pad_rows"):  # zero pad rows too (routing-dependent, at most E (PAD_ROWS - 1) a layer)
            experts.pad_rows = 0
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length), generator=torch.Generator().manual_seed(0))

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    saved = saved_activation_bytes(model, forward, list(model.layers.values()))
    predicted = moe_layer_activation_bytes(cfg, 1, 1, 3, numeric_format(precision), backend="cpu")
    assert set(saved.by_layer.values()) == {predicted}


@pytest.mark.parametrize("experts", [2, 4, 8])
def test_all_to_all_bytes_are_the_rows_routed_to_other_ranks(experts):
    """With perfectly balanced routing (slot j of token t to expert (t k + j) mod E, experts split evenly
    over the EP ranks), the rows rank 0 sends away times h and the element size are the dispatch bytes."""
    cfg = MODEL_PRESETS["mixtral-8x7b"]
    micro, fmt = 2, numeric_format("bf16", "shardlm")
    tokens, k = micro * cfg.seq_length, cfg.moe_top_k
    expert = torch.arange(tokens * k) % cfg.moe_num_experts
    owner = expert // (cfg.moe_num_experts // experts)
    leaving = int((owner != 0).sum())
    dispatch, combine = all_to_all_bytes(cfg, micro, experts, fmt)
    assert dispatch == leaving * cfg.hidden_size * fmt.residual_bytes
    assert combine == leaving * cfg.hidden_size * fmt.matmul_bytes


def test_all_to_all_time_uses_nvlink_inside_a_node_and_the_network_across():
    """One micro-batch, one pipeline rank, no latency: 4 exchanges (dispatch and combine, forward and
    backward) per MoE layer, 6 with full recomputation; on NVLink while TP x E fits in a node, else the
    rows leaving the node share the node's network with its other GPUs. EP=1 and dense models: no time."""
    cfg, gpu, fmt = MODEL_PRESETS["mixtral-8x7b"], gpu_preset("h100"), numeric_format("bf16", "shardlm")
    dispatch, combine = all_to_all_bytes(cfg, 1, 4, fmt)
    nvlink = gpu.intra_node_gbps / 2 * 1e9
    inside = Layout(tp=2, dp=4, micro_batch=1, checkpointing=False, ep=4)
    assert all_to_all_seconds(cfg, inside, gpu, fmt, NO_LATENCY) == pytest.approx(
        cfg.num_layers * 2 * (dispatch + combine) / nvlink)
    recomputed = dataclasses.replace(inside, checkpointing=True)
    assert all_to_all_seconds(cfg, recomputed, gpu, fmt, NO_LATENCY) == pytest.approx(
        1.5 * all_to_all_seconds(cfg, inside, gpu, fmt, NO_LATENCY))
    across = Layout(tp=8, dp=4, micro_batch=1, checkpointing=False, ep=4)  # 4 nodes: every row leaves the node
    network = gpu.inter_node_gbps * 1e9 / gpu.gpus_per_node
    assert all_to_all_seconds(cfg, across, gpu, fmt, NO_LATENCY) == pytest.approx(
        cfg.num_layers * 2 * (dispatch + combine) / network)
    assert all_to_all_seconds(cfg, dataclasses.replace(inside, ep=1), gpu, fmt, NO_LATENCY) == 0.0
    assert all_to_all_seconds(MODEL_PRESETS["llama3-8b"], inside, gpu, fmt, NO_LATENCY) == 0.0
    params = parameter_count(cfg, 2, 4)
    time = step_time(cfg, inside, 64, gpu, fmt, params, NO_LATENCY)
    assert time.ep_comm_s == pytest.approx(64 // 4 * all_to_all_seconds(cfg, inside, gpu, fmt, NO_LATENCY))
    assert time.total_s > time.ep_comm_s > 0


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_ranks():
    """Inside one node (TP=1, DP=8, no latency): at EP=2 the gradient all-reduce is a ring over the 8 DP
    ranks for the dense gradients plus a ring over the 4 expert-DP ranks for this rank's half of the
    expert gradients (2 (p-1)/p x bytes / bandwidth each); at EP=1 one ring over DP carries everything."""
    cfg, gpu, fmt = MODEL_PRESETS["qwen3-30b-a3b"], gpu_preset("h100"), numeric_format("bf16", "shardlm")
    bandwidth = gpu.intra_node_gbps / 2 * 1e9

    def ring(elements: int, ranks: int) -> float:
        return 2 * (ranks - 1) / ranks * elements * fmt.grad_bytes / bandwidth

    layout = Layout(tp=1, dp=8, micro_batch=1, checkpointing=False, ep=2)
    params = parameter_count(cfg, 1, ep=2)
    assert dp_comm_seconds(params, layout, gpu, fmt, NO_LATENCY) == pytest.approx(
        ring(params.dense, 8) + ring(params.expert, 4))
    whole = parameter_count(cfg, 1)
    assert dp_comm_seconds(whole, dataclasses.replace(layout, ep=1), gpu, fmt, NO_LATENCY) == pytest.approx(
        ring(whole.total, 8))


def _request(name: str, gpus: int, **kwargs) -> PlanRequest:
    return PlanRequest(PlannedModel(name, MODEL_PRESETS[name]), gpu_preset("h100"), gpus, kwargs.pop("batch", 512),
                       **kwargs)


def test_planner_picks_expert_parallelism_for_qwen3_235b_on_64_h100s_with_8_stages():
    """Qwen3-235B-A22B on 64 H100s (8 per node), half parameters, PP fixed at 8: the recommendation splits
    the experts (E > 1) and fits; at PP=1 no layout fits without expert parallelism, and one with it does."""
    result = plan(_request("qwen3-235b-a22b", 64, param_dtype="half", pipeline=8))
    best = result.recommended
    assert best is not None and best.fits and best.ep > 1 and best.choice.layout.ep == best.ep
    assert {row.ep for row in result.rows} == {1, 2, 4, 8}
    flat = plan(_request("qwen3-235b-a22b", 64, param_dtype="half", pipeline=1))
    assert not any(row.fits for row in flat.rows if row.ep == 1)
    assert any(row.fits for row in flat.rows if row.ep > 1)


def test_dense_model_rows_all_have_expert_parallel_size_1():
    """A dense model is planned exactly as before: every row and layout has E = 1 and no all-to-all."""
    result = plan(_request("llama3-8b", 16, batch=64))
    assert result.rows and all(row.ep == 1 and row.choice.layout.ep == 1 for row in result.rows)
    assert all(row.choice.time.ep_comm_s == 0 and row.params.expert == 0 for row in result.rows)


@pytest.mark.parametrize("model, expert, message", [
    ("qwen3-30b-a3b", 3, "--expert=3 does not divide the model's 128 experts"),
    ("llama3-8b", 2, "--expert=2 needs a Mixture-of-Experts model"),
    ("qwen3-30b-a3b", 0, "--expert=0 must be at least 1"),
    ("qwen3-30b-a3b", 64, "DP=.* is not divisible by EP=64"),
])
def test_fixed_expert_size_that_cannot_work_is_one_line(model, expert, message):
    with pytest.raises(UserError, match=message) as error:
        plan(_request(model, 16, expert=expert, batch=64))
    assert "\n" not in str(error.value)


def test_megatron_implementation_refuses_moe_models_in_one_line():
    with pytest.raises(UserError, match="--implementation megatron has no activation model for MoE layers"):
        plan(_request("mixtral-8x7b", 16, implementation="megatron", precision="fp16"))


def test_cli_expert_flag_fixes_e_and_shows_it(capsys):
    """`shardlm plan --expert 4 --json`: every layout has EP=4, and the JSON names it and the all-to-all."""
    import json

    from shardlm.cli import main

    code = main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu", "h100", "--global-batch", "64",
                 "--expert", "4", "--pipeline", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["layouts"] and {row["ep"] for row in out["layouts"]} == {4}
    assert all(row["time_s"]["ep_comm"] > 0 for row in out["layouts"])


@pytest.mark.parametrize("bias", [{"moe_expert_bias_rate": 0.01}, {"moe_expert_bias": True}, {}])
def test_expert_biases_are_counted_when_the_model_builds_them(bias):
    """An imported DeepSeek-V3 keeps its expert bias (`moe_expert_bias`) at update rate 0: the planner counts
    the E biases per MoE layer whenever the model has them, as the built model's parameters show."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, vocab_size=100, seq_length=16,
                      moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_score="sigmoid", **bias)
    model = build_model(cfg, ParallelContext.single())
    built = sum(p.numel() for p in model.parameters())
    assert parameter_count(cfg, 1).total == built  # both with the padded vocabulary
