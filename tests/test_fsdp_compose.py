"""FSDP2 (`train.data_sharding = "full"`) composed with context parallelism and with MoE under expert parallelism
gives the single-process run (FSDP x compile is tests/test_fsdp.py's, at DP=2).

One world of 4 processes trains each layout 2 steps (fp32, dropout 0); losses, gradient norms (and for MoE the
aux loss) at every step and the final parameters (gathered over DP, TP and EP) must be within 1e-5 (relative) of
one process running the same micro-batches:
- FSDP x CP: CP=2 x DP=2 (sharded over the 4 data x context ranks, 2 micro-batches each), and CP=2 x TP=2
  with sequence parallelism (DP=1: sharded over the 2 CP ranks alone);
- FSDP x MoE: experts replicated (EP=1, sharded with their layer over DP=4); EP=2 x DP=4 (each layer's
  expert stacks their own FSDP unit over expert-DP = 2, gradients divided by DP); EP=4 (expert-DP = 1) with
  DeepSeek routing's expert biases left outside FSDP; EP=2 x TP=2 with SP; and an EP=2 x DP=4 checkpoint (after
  step 1) that one process resumes for 3 steps (per-expert tensors and Adam moments, layout-free); with context
  parallelism, experts folded over DP x CP (CP=2 x DP=2 with EP=2, CP=4 with EP=4).
"""

from __future__ import annotations

import functools

import pytest
from test_context_parallel_moe import assert_same_run as assert_same_cp_moe_run
from test_context_parallel_moe import cp_moe_config
from test_context_parallel_moe import reference as cp_moe_reference
from test_context_parallel_moe import run as cp_moe_run
from test_context_parallel_training import cp_config
from test_context_parallel_training import synthetic_data as cp_synthetic_data
from test_context_parallel_training import train_layout as cp_train
from test_fsdp import config as fsdp_config
from test_moe_parallel import MOE_CURVE, TOL, curve_of, full_parameters, moe_config
from test_moe_parallel import train_layout as moe_train
from test_training import assert_same_run, synthetic_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

import agreement
from agreement import assert_trained_parameters
from multiproc import check_result, run_checks, run_workers

STEPS, SAVED, RESUMED = 2, 1, 3
"""The steps of every layout's run (of its config's 8-step schedule), of the saved runs, and of one process's
resumption of them."""
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
HYBRID_LAYOUTS = {  # name: (arch, micro-batch size, CP); hybrid sharding over pairs of the 4 data x context ranks
    "dp4 shard2 gpt accumulation": ("gpt", 1, 1),
    "cp2 x dp2 shard2 llama": ("llama", 2, 2),  # shard over each DP rank's CP pair, replicate across DP
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
    curve, params, _ = cp_train(ctx, cp_config(kwargs["arch"], micro, cp=2, tp=tp, sp=kwargs.get("sp", False), **FSDP),
                                steps=STEPS)
    return curve, params


def moe_layout(arch, routing, micro, tp, ep, sp, save: str | None = None):
    ctx = ParallelContext.from_process_group(tp, expert_parallel=ep)
    curve, params, trainer = moe_train(ctx, _moe_config(arch, routing, micro, tp, ep, sp),
                                       steps=SAVED if save else STEPS)
    if save:
        save_checkpoint(trainer, save)
    return curve, params


def hybrid_layout(arch: str, micro: int, cp: int, save: str | None = None):
    """Hybrid sharding (train.fsdp_shard_size = 2) on 4 ranks: the curve, parameters, the shard and replicate
    sizes of the parameters' mesh, and the state bytes after the run."""
    from test_fsdp import expected_bytes, state_bytes

    ctx = ParallelContext.from_process_group(1, context_parallel=cp)
    config = cp_config(arch, micro, cp=cp, fsdp_shard_size=2, **FSDP)
    curve, params, trainer = cp_train(ctx, config, steps=SAVED if save else STEPS)
    if save:
        save_checkpoint(trainer, save)
        return curve
    mesh = trainer.params[0].device_mesh
    # (`state_bytes` runs whole sequences: at C = 1 only)
    state = {"measured": state_bytes(trainer), "expected": expected_bytes(trainer)} if cp == 1 else None
    return curve, params, tuple(mesh.shape), state


def world4_checks(folder: str, hybrid_folder: str) -> dict:
    checks = {f"cp {name}": (lambda case=case: cp_layout(*case)) for name, case in CP_LAYOUTS.items()}
    checks |= {f"moe {name}": (lambda case=case: moe_layout(*case)) for name, case in MOE_LAYOUTS.items()}
    checks |= {f"cp moe {name}": cp_moe_run(cp_moe_config(arch, routing, cp=cp, ep=ep, **FSDP))
               for name, (arch, routing, cp, ep) in CP_MOE_LAYOUTS.items()}
    checks |= {f"hybrid {name}": (lambda case=case: hybrid_layout(*case)) for name, case in HYBRID_LAYOUTS.items()}
    checks["hybrid save"] = lambda: hybrid_layout("gpt", 1, 1, save=hybrid_folder)
    checks["hybrid moe ep2"] = lambda: moe_train(ParallelContext.from_process_group(1, expert_parallel=2),
                                                 moe_config("gpt", "mixtral", 1, ep=2, fsdp_shard_size=2, **FSDP),
                                                 steps=STEPS)[:2]
    checks["moe save"] = lambda: moe_layout(*MOE_LAYOUTS["ep2 x dp4 gpt accumulation"], save=folder)
    return run_checks(checks)


# ------------------------------------------------------------------------------------------- tests

@functools.cache
def moe_reference(arch: str, routing: str, micro: int, steps: int = STEPS) -> tuple:
    """One process's (curve, parameters) of `steps` steps of the MoE config, once per module."""
    return moe_train(ParallelContext.single(), _moe_config(arch, routing, micro, 1, 1, False, full=False),
                     steps=steps)[:2]


@functools.cache
def cp_reference(arch: str, micro: int, steps: int = STEPS) -> tuple:
    """One process's (curve, parameters) of `steps` steps of the CP test's config, once per module."""
    return cp_train(ParallelContext.single(), cp_config(arch, micro), steps=steps)[:2]


def assert_same_moe_run(run_result, ref, where: str = "") -> None:
    """A (curve, parameters) MoE run equals the reference within TOL, its auxiliary loss included."""
    agreement.assert_same_run(run_result, ref, where, steps=STEPS, tol=TOL, columns=MOE_CURVE)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folders = [str(tmp_path_factory.mktemp(name)) for name in ("fsdp_ep2", "hybrid")]
    return run_workers(4, world4_checks, *folders), *folders


@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_fsdp_with_context_parallelism_equals_one_process(world4, name):
    """FSDP over the data x context ranks (CP=2 x DP=2), and over the CP ranks alone (CP=2 x TP=2 with SP):
    within 1e-5 of one process at every step and in the final parameters."""
    micro, _, kwargs = CP_LAYOUTS[name]
    reference = cp_reference(kwargs["arch"], micro)
    for rank in check_result(world4[0], f"cp {name}"):  # every rank's gathered copy
        assert_same_run(rank, reference, steps=STEPS)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_fsdp_with_experts_equals_one_process(world4, name):
    """FSDP with MoE layers: replicated experts sharded with their layer; split experts (EP=2 with expert-DP 2,
    EP=4 with expert-DP 1, EP=2 x TP=2 with SP) sharded over expert-DP with gradients divided by DP; DeepSeek's
    expert biases moved alike on every rank: loss, gradient norm and aux loss at every step and the final
    parameters within 1e-5 of one process."""
    arch, routing, micro, *_ = MOE_LAYOUTS[name]
    reference = moe_reference(arch, routing, micro)
    for rank in check_result(world4[0], f"moe {name}"):  # every rank's gathered copy
        assert_same_moe_run(rank, reference)


@pytest.mark.parametrize("name", list(CP_MOE_LAYOUTS))
def test_fsdp_with_experts_and_context_parallelism_equals_one_process(world4, name):
    """FSDP with MoE under context parallelism, experts split over the data x context ranks (CP=2 x DP=2 with
    EP=2: expert-DP 2; CP=4 with EP=4 and DeepSeek's expert biases: expert-DP 1): loss, gradient norm, aux
    loss and expert loads at every step and the final parameters within 1e-5 of one process."""
    arch, routing, _, _ = CP_MOE_LAYOUTS[name]
    for curve, params, _ in check_result(world4[0], f"cp moe {name}"):  # every rank's gathered copy
        assert_same_cp_moe_run(curve, params, cp_moe_reference(arch, routing))


def test_fsdp_expert_checkpoint_resumes_in_one_process(world4):
    """EP=2 x FSDP DP=4 saved after step 1 (each expert under its global index, moments gathered over
    expert-DP): one process loads it and steps 2-4 and the final parameters equal one process's run
    within 1e-5."""
    check_result(world4[0], "moe save")
    config = _moe_config("gpt", "mixtral", 1, 1, 1, False, full=False)
    ref_curve, ref_params = moe_reference("gpt", "mixtral", 1, SAVED + RESUMED)
    trainer = Trainer(config, ParallelContext.single(), synthetic_data())
    load_checkpoint(trainer, world4[1])
    assert trainer.step == SAVED
    curve = curve_of([trainer.train_step() for _ in range(RESUMED)])
    assert len(curve) == len(ref_curve[SAVED:]) == RESUMED
    for step, (got, want) in enumerate(zip(curve, ref_curve[SAVED:]), SAVED + 1):
        for what, a, b in zip(("loss", "grad norm", "aux loss"), got, want):
            assert abs(a - b) <= TOL * abs(b), f"step {step}: {what} {a} vs {b}"
    assert_trained_parameters(full_parameters(trainer.model), ref_params, SAVED + RESUMED, TOL)


@pytest.mark.parametrize("name", list(HYBRID_LAYOUTS))
def test_hybrid_sharding_equals_one_process_and_holds_state_over_the_shard_group(world4, name):
    """Hybrid sharding (train.fsdp_shard_size = 2 of 4 data x context ranks: sharded within pairs, replicated
    across them): a (2, 2) replicate x shard mesh, within 1e-5 of one process at every step and in the final
    parameters, and (DP=4) each rank's parameter, gradient and AdamW bytes = the parameters x bytes / 2."""
    arch, micro, _ = HYBRID_LAYOUTS[name]
    reference = cp_reference(arch, micro)
    for curve, params, mesh_shape, state in check_result(world4[0], f"hybrid {name}"):  # every rank's
        assert mesh_shape == (2, 2)
        assert state is None or state["measured"] == state["expected"]
        assert_same_run((curve, params), reference, steps=STEPS)


def test_hybrid_sharded_checkpoint_resumes_in_one_process(world4):
    """Hybrid sharding saved after step 1 (gathered over the shard group, written once): one process loads it
    and steps 2-4 equal one process's uninterrupted run within 1e-5."""
    check_result(world4[0], "hybrid save")
    config = cp_config("gpt", 1)
    ref_curve, ref_params = cp_reference("gpt", 1, SAVED + RESUMED)
    trainer = Trainer(config, ParallelContext.single(), cp_synthetic_data(),
                      valid_data=cp_synthetic_data(seed=1, samples=8))
    load_checkpoint(trainer, world4[2])
    assert trainer.step == SAVED
    assert_same_run(cp_train(ParallelContext.single(), config, steps=RESUMED, trainer=trainer)[:2],
                    (ref_curve[SAVED:], ref_params), steps=RESUMED)


@pytest.mark.parametrize("changes, message", [
    ({"fsdp_shard_size": 3}, "does not divide the data x context size 4"),
    ({"fsdp_shard_size": 2, "data_sharding": "optimizer"}, 'needs train.data_sharding="full"'),
])
def test_hybrid_shard_sizes_that_do_not_fit_are_one_line_errors(changes, message):
    """A shard size that does not divide DP x CP, or one without full sharding: one line from `validate`."""
    config = fsdp_config(micro=1)
    for key, value in changes.items():
        setattr(config.train, key, value)
    with pytest.raises(UserError, match=message) as error:
        validate(config, world_size=4, check_paths=False)
    assert "\n" not in str(error.value)


def test_hybrid_sharding_with_split_experts_equals_one_process(world4):
    """Hybrid sharding (S = 2 of DP = 4) with EP=2: the dense parts sharded within pairs and replicated across
    them, the experts sharded over expert-DP (2 ranks); the gradient norm sums the dense shares over the
    shard pair and the expert shares over all of DP: within 1e-5 of one process."""
    reference = moe_reference("gpt", "mixtral", 1)
    for run_ in check_result(world4[0], "hybrid moe ep2"):
        assert_same_moe_run(run_, reference)
