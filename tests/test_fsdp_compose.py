"""FSDP2 (`train.data_sharding = "full"`) composed with context parallelism, MoE with expert parallelism and
`train.compile` gives the single-process run.

One world of 4 processes trains each layout 8 steps (fp32, dropout 0); losses, gradient norms (and for MoE
the aux loss) at every step and the final parameters (gathered over DP, TP and EP) must be within 1e-5
(relative) of one process running the same micro-batches:
- FSDP x CP: CP=2 x DP=2 (sharded over the 4 data x context ranks, 2 micro-batches each), and CP=2 x TP=2
  with sequence parallelism (DP=1: sharded over the 2 CP ranks alone);
- FSDP x MoE: experts replicated (EP=1, sharded with their layer over DP=4); EP=2 x DP=4 (each layer's
  expert stacks their own FSDP unit over expert-DP = 2, gradients divided by DP); EP=4 (expert-DP = 1) with
  DeepSeek routing's expert biases left outside FSDP; EP=2 x TP=2 with SP; and an EP=2 x DP=4 checkpoint that
  one process resumes (per-expert tensors and Adam moments, layout-free); with context parallelism, experts
  folded over DP x CP (CP=2 x DP=2 with EP=2, CP=4 with EP=4);
- FSDP x compile: every layer compiled, then sharded, at DP=4.
"""

from __future__ import annotations

import pytest
import torch
from test_context_parallel_moe import assert_same_run as assert_same_cp_moe_run
from test_context_parallel_moe import cp_moe_config
from test_context_parallel_moe import reference as cp_moe_reference
from test_context_parallel_moe import run as cp_moe_run
from test_context_parallel_training import cp_config
from test_context_parallel_training import train_layout as cp_train
from test_fsdp import config as fsdp_config
from test_fsdp import run as fsdp_run
from test_moe_parallel import STEPS, TOL, curve_of, full_parameters, moe_config
from test_moe_parallel import assert_same_run as assert_same_moe_run
from test_moe_parallel import train_layout as moe_train
from test_training import assert_same_run, rel, synthetic_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer, can_compile

from multiproc import check_result, run_checks, run_workers

FSDP = {"data_sharding": "full"}
CP_LAYOUTS = {  # name: (micro-batch size, TP, config kwargs); CP=2, DP = 4 / (2 TP)
    "cp2 x dp2 gpt accumulation": (2, 1, {"arch": "gpt"}),
    "cp2 x tp2 sp llama": (4, 2, {"arch": "llama", "sp": True}),
}
MOE_LAYOUTS = {  # name: (arch, routing, micro-batch size, TP, EP, SP)
    "dp4 replicated experts gpt": ("gpt", "mixtral", 2, 1, 1, False),
    "ep2 x dp4 gpt accumulation": ("gpt", "mixtral", 1, 1, 2, False),
    "ep4 llama deepseek": ("llama", "deepseek", 2, 1, 4, False),
    "ep2 x tp2 sp gpt": ("gpt", "mixtral", 4, 2, 2, True),
}
CP_MOE_LAYOUTS = {  # name: (arch, routing, CP, EP); DP = 4 / CP, experts folded over DP x CP
    "cp2 x dp2 ep2 gpt": ("gpt", "mixtral", 2, 2),
    "cp4 ep4 llama deepseek": ("llama", "deepseek", 4, 4),
}


def _moe_config(arch, routing, micro, tp, ep, sp, full=True):
    return moe_config(arch, routing, micro, tp=tp, ep=ep, sp=sp, **(FSDP if full else {}))


# -------------------------------------------------------------------------------------- in workers

def cp_layout(micro: int, tp: int, kwargs: dict):
    ctx = ParallelContext.from_process_group(tp, context_parallel=2)
    curve, params, _ = cp_train(ctx, cp_config(kwargs["arch"], micro, cp=2, tp=tp, sp=kwargs.get("sp", False), **FSDP))
    return curve, params


def moe_layout(arch, routing, micro, tp, ep, sp, save: str | None = None):
    ctx = ParallelContext.from_process_group(tp, expert_parallel=ep)
    curve, params, trainer = moe_train(ctx, _moe_config(arch, routing, micro, tp, ep, sp),
                                       steps=4 if save else STEPS)
    if save:
        save_checkpoint(trainer, save)
    return curve, params


def compiled_layout():
    """FSDP DP=4 with compiled layers: the curve, the parameters, how many layers `Module.compile` wrapped
    and how many graphs TorchDynamo built."""
    from torch._dynamo.utils import counters

    ctx = ParallelContext.from_process_group(1)
    curve, params, trainer = fsdp_run(ctx, fsdp_config(micro=2, compile=True))
    compiled = sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in trainer.model.layers.values())
    return curve, params, (compiled, counters["stats"]["unique_graphs"])


def world4_checks(folder: str) -> dict:
    checks = {f"cp {name}": (lambda case=case: cp_layout(*case)) for name, case in CP_LAYOUTS.items()}
    checks |= {f"moe {name}": (lambda case=case: moe_layout(*case)) for name, case in MOE_LAYOUTS.items()}
    checks |= {f"cp moe {name}": cp_moe_run(cp_moe_config(arch, routing, cp=cp, ep=ep, **FSDP))
               for name, (arch, routing, cp, ep) in CP_MOE_LAYOUTS.items()}
    checks["moe save"] = lambda: moe_layout(*MOE_LAYOUTS["ep2 x dp4 gpt accumulation"], save=folder)
    if can_compile(torch.device("cpu")):
        checks["compile"] = compiled_layout
    return run_checks(checks)


# ------------------------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp_ep2")
    return run_workers(4, world4_checks, str(folder)), str(folder)


@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_fsdp_with_context_parallelism_equals_one_process(world4, name):
    """FSDP over the data x context ranks (CP=2 x DP=2), and over the CP ranks alone (CP=2 x TP=2 with SP):
    within 1e-5 of one process at every step and in the final parameters."""
    micro, _, kwargs = CP_LAYOUTS[name]
    reference = cp_train(ParallelContext.single(), cp_config(kwargs["arch"], micro))[:2]
    assert_same_run(check_result(world4[0], f"cp {name}")[0], reference, steps=STEPS)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_fsdp_with_experts_equals_one_process(world4, name):
    """FSDP with MoE layers: replicated experts sharded with their layer; split experts (EP=2 with expert-DP 2,
    EP=4 with expert-DP 1, EP=2 x TP=2 with SP) sharded over expert-DP with gradients divided by DP; DeepSeek's
    expert biases moved alike on every rank: loss, gradient norm and aux loss at every step and the final
    parameters within 1e-5 of one process."""
    arch, routing, micro, *_ = MOE_LAYOUTS[name]
    reference = moe_train(ParallelContext.single(), _moe_config(arch, routing, micro, 1, 1, False, full=False))[:2]
    assert_same_moe_run(check_result(world4[0], f"moe {name}")[0], reference)


@pytest.mark.parametrize("name", list(CP_MOE_LAYOUTS))
def test_fsdp_with_experts_and_context_parallelism_equals_one_process(world4, name):
    """FSDP with MoE under context parallelism, experts split over the data x context ranks (CP=2 x DP=2 with
    EP=2: expert-DP 2; CP=4 with EP=4 and DeepSeek's expert biases: expert-DP 1): loss, gradient norm, aux
    loss and expert loads at every step and the final parameters within 1e-5 of one process."""
    arch, routing, _, _ = CP_MOE_LAYOUTS[name]
    curve, params, _ = check_result(world4[0], f"cp moe {name}")[0]
    assert_same_cp_moe_run(curve, params, cp_moe_reference(arch, routing))


def test_fsdp_expert_checkpoint_resumes_in_one_process(world4):
    """EP=2 x FSDP DP=4 saved after 4 steps (each expert under its global index, moments gathered over
    expert-DP): one process loads it and steps 5-8 and the final parameters equal one process's run
    within 1e-5."""
    check_result(world4[0], "moe save")
    config = _moe_config("gpt", "mixtral", 1, 1, 1, False, full=False)
    ref_curve, ref_params = moe_train(ParallelContext.single(), config)[:2]
    trainer = Trainer(config, ParallelContext.single(), synthetic_data())
    load_checkpoint(trainer, world4[1])
    assert trainer.step == 4
    curve = curve_of([trainer.train_step() for _ in range(STEPS - 4)])
    for step, (got, want) in enumerate(zip(curve, ref_curve[4:]), 5):
        for what, a, b in zip(("loss", "grad norm", "aux loss"), got, want):
            assert abs(a - b) <= TOL * abs(b), f"step {step}: {what} {a} vs {b}"
    params = full_parameters(trainer.model)
    assert max(rel(params[n], ref_params[n]) for n in params) <= TOL


@pytest.mark.skipif(not can_compile(torch.device("cpu")), reason="torch.compile on the CPU needs a C++ compiler")
def test_fsdp_with_compiled_layers_equals_one_process(world4):
    """FSDP DP=4 with every layer compiled (compile, then shard, as torchtitan orders them): both layers run
    compiled, and the run is within 1e-5 of one eager process."""
    curve, params, (compiled, graphs) = check_result(world4[0], "compile")[0]
    assert compiled == 2 and graphs > 0
    reference = fsdp_run(ParallelContext.single(), fsdp_config(micro=2, full=False))[:2]
    assert_same_run((curve, params), reference, steps=STEPS)
