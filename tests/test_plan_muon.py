"""The planner's Muon (`shardlm plan --optimizer muon`, `shardlm.plan.muon`) against shardlm's models, trainer and
the step's formulas. One process, no process groups.

- The Muon matrices the planner counts on a (TP, EP) rank are the `is_muon_matrix` parameters of the model shardlm
  builds for that rank (elements, tensors, TP-split elements, routed experts' elements), for GQA Llama (replicated
  K/V at TP=4), GPT, MoE (GPT with shared experts, Mixtral, gpt-oss), MLA (with and without the query's low rank,
  with an MTP depth) and a Gated DeltaNet hybrid; a TP > 1 rank is built with size-N communicators that no
  collective uses (building a model communicates nothing); its Newton-Schulz FLOPs are the formula's over the
  real matrices (GPT's qkv as its q, k and v parts).
- Optimizer-state bytes: what a real `Trainer` with `train.optimizer = "muon"` holds after a step (`measure`'s
  `state_bytes`, through `MuonWithAdamW.state` and the master-weight parts) equal the planner's, replicated,
  ZeRO-1 at DP=1 and with half parameters.
- The step's bytes: ZeRO-1 and FSDP exchange 2 x 4 N (d - 1) / d bytes a rank (split experts over expert-DP),
  nothing at DP=1 TP=1; the TP all-gather 4 (t - 1) S / d; the seconds are the link model's and the GEMM rate's.
- The command line takes `--optimizer muon` and shows Muon's column and step.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from shardlm.cli import main
from shardlm.config import from_dict
from shardlm.models import build_model
from shardlm.models.config import ModelConfig
from shardlm.parallel import ParallelContext
from shardlm.parallel.comm import CommStats, Communicator
from shardlm.plan.generations import default_calibration
from shardlm.plan.hardware import gpu_preset
from shardlm.plan.layout import Layout
from shardlm.plan.measure import measure_trainer_memory
from shardlm.plan.memory import numeric_format, state_memory
from shardlm.plan.models import PlannedModel
from shardlm.plan.muon import muon_cost, muon_count
from shardlm.plan.parameters import parameter_count
from shardlm.plan.planner import PlanRequest, plan
from shardlm.training.muon import Muon, is_muon_matrix, row_groups
from shardlm.training.trainer import Trainer

from layouts import MLA as LAYOUT_MLA

VOCAB, SEQ, MICRO = 100, 16, 2
BASE = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": SEQ, "vocab_size": VOCAB, "dropout": 0.0}
MOE = {"moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 24}
MLA = LAYOUT_MLA | {"v_head_dim": 8}
SHAPES = {  # name: ([model] section, TP sizes the shape divides)
    "llama-gqa": ({"arch": "llama", "num_kv_heads": 2}, (1, 2, 4)),  # TP=4: K/V replicated
    "gpt": ({"arch": "gpt"}, (1, 2, 4)),
    "gpt-moe-shared": ({"arch": "gpt", **MOE, "moe_shared_experts": 1, "moe_first_dense_layers": 1}, (1, 2, 4)),
    "mixtral": ({"arch": "llama", "num_kv_heads": 2, **MOE}, (1, 2, 4)),
    "gpt-oss": ({"arch": "llama", "num_kv_heads": 2, "head_dim": 8, "attention_bias": True,
                 "attention_output_bias": True, "attention_sinks": True, **MOE, "moe_router_bias": True,
                 "moe_linear_bias": True}, (1, 2, 4)),
    "mla-moe-mtp": ({"arch": "llama", **MLA, **MOE, "moe_first_dense_layers": 1, "mtp_layers": 1}, (1, 2, 4)),
    "mla-no-q-lora": ({"arch": "llama", **MLA, "q_lora_rank": 0}, (1, 2, 4)),
    "hybrid": ({"arch": "llama", "num_kv_heads": 2, "head_dim": 8, "qk_norm": True, "attention_output_gate": True,
                "norm_zero_centered": True, "layer_types": ["linear_attention", "full_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8, **MOE, "moe_shared_experts": 1, "moe_shared_ffn_hidden_size": 24,
                "moe_shared_expert_gate": True}, (1, 2)),
}
CASES = [(name, tp, ep) for name, (_, sizes) in SHAPES.items() for tp in sizes
         for ep in ((1, 2) if "moe_num_experts" in SHAPES[name][0] else (1,))]


def model_config(name: str) -> ModelConfig:
    return ModelConfig(**(BASE | SHAPES[name][0]))


def rank_context(tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0) -> ParallelContext:
    """One (TP, EP) rank's context in this process: communicators of the layout's sizes, never called."""
    stats = CommStats()
    return ParallelContext(rank=0, world_size=1, tp=Communicator("tp", None, tp, tp_rank, stats),
                           dp=Communicator("dp", None, 1, 0, stats), device=torch.device("cpu"), comm=stats,
                           ep=Communicator("ep", None, ep, ep_rank, stats))


def newton_schulz_flops(matrix: torch.Tensor, steps: int = 5) -> int:
    """The iteration's FLOPs on one (rows, cols) matrix: m <= n, steps x (2 m^2 n + 2 m^3 + 2 m^2 n)."""
    m, n = sorted(matrix.shape)
    return steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def real_muon(cfg: ModelConfig, ctx: ParallelContext) -> dict:
    """The Muon matrices of the model shardlm builds on `ctx`'s rank, counted from its parameters; FLOPs over the
    whole (TP=1) matrices, each expert alone and GPT's qkv by its parts (`row_groups`)."""
    named = [(n, p) for n, p in build_model(cfg, ctx, seed=1).named_parameters() if is_muon_matrix(n, p)]
    flops = 0
    if ctx.tp_size == 1:
        for name, p in named:
            for matrix in (p if p.ndim == 3 else [p]):
                flops += sum(newton_schulz_flops(matrix[rows]) for rows in
                             row_groups(name, matrix.shape[0], cfg.num_heads, "parts"))
    return {"elements": sum(p.numel() for _, p in named), "tensors": len(named),
            "split": sum(p.numel() for _, p in named if hasattr(p, "tensor_parallel_dim")),
            "expert": sum(p.numel() for _, p in named if getattr(p, "expert_parallel", False)), "flops": flops}


@pytest.mark.parametrize("name,tp,ep", CASES)
def test_muon_count_is_the_built_models_muon_matrices(name, tp, ep):
    cfg = model_config(name)
    count = muon_count(cfg, tp, range(cfg.num_layers), ep)
    real = real_muon(cfg, rank_context(tp, tp - 1, ep, ep - 1))
    total = count.total
    assert (total.elements, total.tensors, total.split, count.expert.elements) == \
        (real["elements"], real["tensors"], real["split"], real["expert"])
    if tp == 1:
        assert total.flops == real["flops"]


def test_muon_count_of_pipeline_ranks_adds_up_to_the_model():
    from shardlm.plan.stages import pipeline_layers, rank_stages

    cfg = replace(model_config("mla-moe-mtp"), num_layers=4)
    whole = muon_count(cfg, 2, range(cfg.num_layers)).total
    layers = pipeline_layers(cfg.num_layers, 2, 1)
    ranks = [muon_count(cfg, 2, rank_stages(layers, 2, r).layer_indices).total for r in range(2)]
    assert ranks[0] + ranks[1] == whole


# ---------------------------------------------------------------------------------------------- state bytes

def run_config(name: str, **train):
    return from_dict({"model": BASE | SHAPES[name][0], "data": {"text_file": "unused"},
                      "train": {"precision": "fp32", "micro_batch_size": MICRO, "global_batch_size": MICRO,
                                "steps": 2, "seed": 5, "optimizer": "muon", **train}})


def batches() -> list[np.ndarray]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (SEQ + 1,), generator=generator).numpy() for _ in range(8)]


def momentum_bytes(optimizer) -> int:
    """Bytes of Muon's momentum buffers, read through the optimizer's `state` as `measure.state_bytes` reads it."""
    return sum(v.numel() * v.element_size() for per_param in optimizer.state.values()
               for k, v in per_param.items() if k == "momentum_buffer")


@pytest.mark.parametrize("name", ["llama-gqa", "gpt", "mixtral", "mla-moe-mtp"])
@pytest.mark.parametrize("train", [{}, {"data_sharding": "optimizer"}, {"precision": "bf16", "param_dtype": "half"}],
                         ids=["replicated", "zero1", "half"])
def test_optimizer_state_bytes_equal_a_muon_trainers(name, train):
    config = run_config(name, **train)
    trainer = Trainer(config, ParallelContext.single(), batches())
    batch = torch.from_numpy(np.stack(batches()[:MICRO]))
    measured = measure_trainer_memory(trainer, batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
    cfg, t = config.model, config.train
    count = muon_count(cfg, 1, range(cfg.num_layers))
    if not train:  # MuonWithAdamW's state is a view over Muon's and AdamW's: the momenta are seen through it
        assert any(isinstance(m, Muon) for m in trainer.optimizer.muons)
    assert momentum_bytes(trainer.optimizer) == 4 * count.total.elements
    predicted = state_memory(parameter_count(cfg, 1), numeric_format(t.precision, "shardlm", t.param_dtype), 1,
                             t.distributed_optimizer, muon=count)
    assert (measured["parameters"], measured["optimizer"]) == (predicted.parameters, predicted.optimizer)
    if not cfg.mtp_layers:  # `measure_trainer_memory`'s forward has no MTP loss: the depths get no gradients there
        assert measured["gradients"] == predicted.gradients


def test_muon_state_is_4_bytes_an_element_and_no_step_under_zero1_and_fsdp():
    """Against AdamW's state of the same rank: 4 bytes fewer per Muon element (8 -> 4) and no step per Muon tensor
    (d divides the element counts here, so no rounding)."""
    from shardlm.plan.fsdp import fsdp_state_memory

    cfg, d = model_config("gpt"), 4
    params, count = parameter_count(cfg, 1), muon_count(cfg, 1, range(cfg.num_layers))
    muon = count.total
    for shards in (1, d):
        adamw, with_muon = fsdp_state_memory(params, shards), fsdp_state_memory(params, shards, muon=count)
        assert adamw.optimizer - with_muon.optimizer == 4 * muon.elements // shards + 4 * muon.tensors
        assert (adamw.parameters, adamw.gradients) == (with_muon.parameters, with_muon.gradients)
    fmt = numeric_format("bf16", "shardlm")
    adamw, with_muon = state_memory(params, fmt, d, True), state_memory(params, fmt, d, True, muon=count)
    assert adamw.optimizer - with_muon.optimizer >= 4 * muon.elements // d  # ZeRO-1: + steps, padding of 2 buffers


# --------------------------------------------------------------------------------------------- step's bytes

GPU = gpu_preset("h100")
CALIBRATION = default_calibration(GPU)


def planned(name: str, gpus: int, tp: int, sharding: str, **request):
    """The plan's row of TP size `tp` on `gpus` GPUs without a pipeline, data sharding fixed."""
    cfg = model_config(name)
    result = plan(PlanRequest(model=PlannedModel(name, cfg), gpu=GPU, gpus=gpus, global_batch=16, pipeline=1,
                              data_sharding=sharding, optimizer="muon", calibration=CALIBRATION, **request))
    rows = [row for row in result.rows if row.tp == tp]
    assert len(rows) == 1
    return rows[0]


@pytest.mark.parametrize("sharding", ["optimizer", "full"])
def test_zero1_and_fsdp_exchange_follows_the_formula(sharding):
    d = 4
    row = planned("llama-gqa", d, 1, sharding)
    real = real_muon(model_config("llama-gqa"), ParallelContext.single())
    muon = row.choice.muon
    assert muon.dp_bytes == pytest.approx(2 * 4 * real["elements"] * (d - 1) / d)
    assert (muon.tp_bytes, muon.tp_s) == (0, 0)
    assert muon.flops == pytest.approx(real["flops"] / d)
    assert muon.ns_s == pytest.approx(muon.flops / (GPU.peak_tflops * 1e12 * CALIBRATION.compute_efficiency))
    assert row.choice.time.muon_s == muon.seconds > 0


def test_split_experts_exchange_over_expert_dp():
    d, ep = 4, 2
    cfg = model_config("mixtral")
    real = real_muon(cfg, rank_context(1, 0, ep, 0))
    layout = Layout(tp=1, dp=d, micro_batch=1, checkpointing=False, distributed_optimizer=True, ep=ep)
    muon = muon_cost(muon_count(cfg, 1, range(cfg.num_layers), ep), layout, GPU, CALIBRATION)
    dense, expert_dp = real["elements"] - real["expert"], d // ep
    assert muon.dp_bytes == pytest.approx(2 * 4 * (dense * (d - 1) / d + real["expert"] * (expert_dp - 1) / expert_dp))


def test_hybrid_fsdp_exchanges_within_its_shard_group():
    d, shard = 8, 2
    cfg = model_config("gpt")
    elements = real_muon(cfg, ParallelContext.single())["elements"]
    layout = Layout(tp=1, dp=d, micro_batch=1, checkpointing=False, full_sharding=True, fsdp_shard_size=shard)
    muon = muon_cost(muon_count(cfg, 1, range(cfg.num_layers)), layout, GPU, CALIBRATION)
    assert muon.dp_bytes == pytest.approx(2 * 4 * elements * (shard - 1) / shard)


def test_nothing_is_exchanged_at_dp_1_tp_1():
    row = planned("llama-gqa", 1, 1, "none")
    real = real_muon(model_config("llama-gqa"), ParallelContext.single())
    muon = row.choice.muon
    assert (muon.tp_bytes, muon.dp_bytes, muon.tp_s, muon.dp_s) == (0, 0, 0, 0)
    assert muon.flops == real["flops"]  # every iteration on the one rank


@pytest.mark.parametrize("name", ["gpt", "llama-gqa"])
def test_tp_all_gather_bytes_at_tp_2(name):
    """Each rank sends its shard of every split matrix once (ring all-gather over 2 ranks): 4 S bytes, S its split
    elements (half the TP=1 model's); under ZeRO-1 only the matrices it orthogonalizes, 1 / d of them."""
    cfg, t = model_config(name), 2
    split = real_muon(cfg, ParallelContext.single())["split"] // t
    muon = planned(name, t, t, "none").choice.muon
    assert muon.tp_bytes == 4 * (t - 1) * split
    intra = GPU.intra_node_gbps / 2 * 1e9 * CALIBRATION.link_efficiency
    gathers = muon_count(cfg, t, range(cfg.num_layers)).total.gathers
    assert muon.tp_s == pytest.approx(muon.tp_bytes / intra + gathers * (t - 1) * CALIBRATION.intra_node_latency_s)
    d = 2
    sharded = planned(name, t * d, t, "optimizer").choice.muon
    assert sharded.tp_bytes == pytest.approx(4 * (t - 1) * split / d)
    elements = muon_count(cfg, t, range(cfg.num_layers)).total.elements  # this TP rank's, checked above
    assert sharded.dp_bytes == pytest.approx(2 * 4 * elements * (d - 1) / d)


# ---------------------------------------------------------------------------------------------- the command

def test_cli_takes_the_optimizer_and_shows_muons_step(capsys):
    args = ["plan", "--model", "gpt2-355m", "--gpus", "8", "--gpu", "h100", "--global-batch", "32", "--pipeline", "1"]
    assert main([*args, "--optimizer", "muon"]) == 0
    out = capsys.readouterr().out
    assert "Muon" in out and "Muon's step" in out and "Muon's matrices 4+4+4" in out
    assert main([*args, "--optimizer", "muon", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["optimizer"] == "muon"
    assert all(row["muon"]["seconds"]["total"] == row["time_s"]["muon"] > 0 for row in data["layouts"])
    assert main([*args, "--json"]) == 0
    adamw = json.loads(capsys.readouterr().out)
    assert adamw["optimizer"] == "adamw" and all(row["muon"] is None for row in adamw["layouts"])
    first = (adamw["layouts"][0]["memory_bytes"]["optimizer"], data["layouts"][0]["memory_bytes"]["optimizer"])
    assert first[1] < first[0]  # one fp32 momentum instead of two moments
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--optimizer {adamw,muon}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--optimizer", "sgd"])
    assert "invalid choice" in capsys.readouterr().err
    assert main([*args, "--optimizer", "muon", "--implementation", "megatron"]) == 2
    assert "--optimizer muon" in capsys.readouterr().err
