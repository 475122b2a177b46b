"""Checkpoints of the layouts added with expert, context and fully sharded parallelism resume bitwise on
the same layout with dropout on, and move between layouts.

Bitwise (dropout 0.1 on the embedding and the residuals; attention dropout too where the layout allows it):
a run trains 2 steps, saves, trains 2 more; a fresh trainer, its generators disturbed, loads the checkpoint
and trains the same 2 steps. Losses, gradient norms (and the MoE aux loss) of steps 3-4 and every final
parameter (gathered over DP, TP and EP) must be equal to the bit. Layouts: FSDP DP=2 (GPT, Llama), EP=2
(Mixtral-style MoE), CP=2 (GPT and Llama; residual dropout only, attention dropout is refused under CP),
FSDP x EP=2 at DP=2 and DP=4, FSDP x EP=2 x TP=2 with SP, FSDP x EP=4, and the distributed optimizer at
TP=2 x DP=2 with sequence parallelism. That dropout draws in them: FSDP DP=2, EP=2 and CP=2 each train at
dropout 0.1 and at 0, and the losses must differ by more than 1e-3.

Between layouts (dropout 0, within 1e-5 of one process's uninterrupted 4 steps): FSDP x EP=2 saved at step 2
and resumed by FSDP x EP=2, by EP=2 without FSDP, by FSDP x EP=4 and by one process; EP=2 without FSDP and one
process saved and resumed by FSDP x EP=2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_context_parallel_training import cp_config
from test_context_parallel_training import synthetic_data as cp_data
from test_moe_parallel import full_parameters, moe_config
from test_training import synthetic_data, tiny_config

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_trained_parameters
from multiproc import check_result, disturb_generators, run_checks, run_workers

HALF, DROPOUT, TOL = 2, 0.1, 1e-5
"""Each run trains HALF steps, saves, and HALF more (the first steps of the configs' schedules)."""


def dense(arch: str = "gpt", micro: int = 2, tp: int = 1, sp: bool = False, dropout: float = DROPOUT, **train):
    """The tiny GPT (or Llama, with grouped-query attention) of test_training."""
    cfg = tiny_config(tp=tp, micro=micro, dropout=dropout, **train)
    cfg.model.arch = arch
    if arch == "llama":
        cfg.model.num_kv_heads = 2
    cfg.parallel.sequence_parallel = sp
    return cfg


def moe(micro: int = 2, tp: int = 1, ep: int = 1, sp: bool = False, dropout: float = DROPOUT, **train):
    """The tiny Mixtral-style GPT of test_moe_parallel (4 experts, top-2, aux and z losses)."""
    cfg = moe_config("gpt", "mixtral", micro, tp=tp, ep=ep, sp=sp, **train)
    cfg.model.dropout = dropout
    return cfg


def context(arch: str, dropout: float = DROPOUT, **train):
    """The tiny CP model of test_context_parallel_training (32 tokens) with residual dropout only."""
    cfg = cp_config(arch, 4, cp=2, **train)
    cfg.model.dropout, cfg.model.attention_dropout = dropout, 0.0
    return cfg


# (tp, ep, cp, config factory, dataset factory) of each bitwise case; every case uses the whole world
WORLD2_BITWISE = {
    "fsdp dp2 gpt": (1, 1, 1, lambda: dense(data_sharding="full"), synthetic_data),
    "fsdp dp2 llama accumulation": (1, 1, 1, lambda: dense("llama", micro=1, data_sharding="full"), synthetic_data),
    "ep2 gpt mixtral": (1, 2, 1, lambda: moe(ep=2), synthetic_data),
    "fsdp ep2 gpt mixtral": (1, 2, 1, lambda: moe(ep=2, data_sharding="full"), synthetic_data),
    "cp2 gpt": (1, 1, 2, lambda: context("gpt"), cp_data),
    "cp2 llama": (1, 1, 2, lambda: context("llama"), cp_data),
}
WORLD4_BITWISE = {
    "zero tp2 dp2 sp": (2, 1, 1, lambda: dense(tp=2, sp=True, distributed_optimizer=True), synthetic_data),
    "fsdp ep2 dp4 gpt mixtral": (1, 2, 1, lambda: moe(ep=2, data_sharding="full"), synthetic_data),
    "fsdp ep2 tp2 sp gpt mixtral": (2, 2, 1, lambda: moe(tp=2, ep=2, sp=True, data_sharding="full"),
                                    synthetic_data),
    "fsdp ep4 gpt mixtral": (1, 4, 1, lambda: moe(ep=4, data_sharding="full"), synthetic_data),
}


def curve(trainer: Trainer, steps: int) -> list[tuple]:
    """(loss, gradient norm, MoE aux loss or None) of each of `steps` steps."""
    return [(m["loss"], m["grad_norm"], m.get("moe_aux_loss")) for m in (trainer.train_step() for _ in range(steps))]


def fresh_trainer(ctx: ParallelContext, config, data) -> Trainer:
    validate(config, ctx.world_size, check_paths=False)
    ctx.rng = None  # seeded again by the trainer, as in a new process
    return Trainer(config, ctx, data())


def straight_and_resumed(tp: int, ep: int, cp: int, make_config, data, folder: str) -> dict:
    """HALF steps, save, HALF more (straight); a fresh trainer with disturbed generators loads the save and
    runs the same HALF steps (resumed). Each: the curve of the last HALF steps and the final parameters."""
    ctx = ParallelContext.from_process_group(tp, expert_parallel=ep, context_parallel=cp)
    trainer = fresh_trainer(ctx, make_config(), data)
    curve(trainer, HALF)
    save_checkpoint(trainer, folder)
    straight = curve(trainer, HALF), full_parameters(trainer.model)
    resumed_trainer = fresh_trainer(ctx, make_config(), data)
    disturb_generators(ctx)
    load_checkpoint(resumed_trainer, folder)
    resumed = curve(resumed_trainer, HALF), full_parameters(resumed_trainer.model)
    return {"straight": straight, "resumed": resumed}


def save_after_half(tp: int, ep: int, make_config, folder: str) -> list[tuple]:
    """Train HALF steps and save; returns the curve."""
    ctx = ParallelContext.from_process_group(tp, expert_parallel=ep)
    trainer = fresh_trainer(ctx, make_config(), synthetic_data)
    first = curve(trainer, HALF)
    save_checkpoint(trainer, folder)
    return first


def finish_from(tp: int, ep: int, make_config, folder: str) -> tuple:
    """Load a step-HALF checkpoint saved at another layout, train HALF more steps: (curve, final parameters)."""
    ctx = ParallelContext.from_process_group(tp, expert_parallel=ep) if tp * ep > 1 or \
        torch.distributed.is_initialized() else ParallelContext.single()
    trainer = fresh_trainer(ctx, make_config(), synthetic_data)
    load_checkpoint(trainer, folder)
    assert trainer.step == HALF
    return curve(trainer, HALF), full_parameters(trainer.model)


def dropout_moves_the_run(tp: int, ep: int, cp: int, make_config, data) -> dict:
    """The losses of the 2 x HALF steps a bitwise case trains, of the same layout at its dropout (0.1) and at 0:
    the bitwise cases would prove little if dropout drew nothing. (Their first HALF steps alone may move less than
    1e-3.)"""
    ctx = ParallelContext.from_process_group(tp, expert_parallel=ep, context_parallel=cp)
    without = make_config()
    without.model.dropout = 0.0
    return {"dropout": [loss for loss, _, _ in curve(fresh_trainer(ctx, make_config(), data), 2 * HALF)],
            "none": [loss for loss, _, _ in curve(fresh_trainer(ctx, without, data), 2 * HALF)]}


DROPOUT_CONTROLS = ["fsdp dp2 gpt", "ep2 gpt mixtral", "cp2 llama"]


def bitwise_checks(cases: dict, folder: str) -> dict:
    return {f"bitwise {name}": (lambda case=case, name=name: straight_and_resumed(*case, f"{folder}/{name}"))
            for name, case in cases.items()}


def failed_save_on_one_rank(folder: str) -> dict:
    """FSDP DP=2: a save at step 1, then one at step 2 where only rank 1 cannot write (a 4 kB file-size limit:
    its generator file is larger); every rank must raise the same error instead of waiting for rank 1."""
    import resource

    from shardlm.errors import CheckpointWriteError

    ctx = ParallelContext.from_process_group(1)
    trainer = fresh_trainer(ctx, dense(data_sharding="full"), synthetic_data)
    curve(trainer, 1)
    save_checkpoint(trainer, folder)
    curve(trainer, 1)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if ctx.rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        save_checkpoint(trainer, folder)
    except CheckpointWriteError as error:
        return {"error": str(error), "files": sorted(p.name for p in Path(folder).iterdir())}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return {"error": None}


def world2_checks(folder: str) -> dict:
    checks = bitwise_checks(WORLD2_BITWISE, folder)
    checks |= {f"dropout {name}": (lambda case=WORLD2_BITWISE[name]: dropout_moves_the_run(*case))
               for name in DROPOUT_CONTROLS}
    checks["failed save on one rank"] = lambda: failed_save_on_one_rank(f"{folder}/failed_save")
    return run_checks(checks)


def world4_checks(folder: str, one_process: str) -> dict:
    no_dropout = {"dropout": 0.0}
    checks = bitwise_checks(WORLD4_BITWISE, folder)
    checks |= {
        "save fsdp ep2": lambda: save_after_half(1, 2, lambda: moe(ep=2, data_sharding="full", **no_dropout),
                                                 f"{folder}/fsdp_ep2"),
        "save ep2": lambda: save_after_half(1, 2, lambda: moe(ep=2, **no_dropout), f"{folder}/ep2"),
        "fsdp ep2 -> fsdp ep2": lambda: finish_from(1, 2, lambda: moe(ep=2, data_sharding="full", **no_dropout),
                                                    f"{folder}/fsdp_ep2"),
        "fsdp ep2 -> ep2": lambda: finish_from(1, 2, lambda: moe(ep=2, **no_dropout), f"{folder}/fsdp_ep2"),
        "fsdp ep2 -> fsdp ep4": lambda: finish_from(1, 4, lambda: moe(ep=4, data_sharding="full", **no_dropout),
                                                    f"{folder}/fsdp_ep2"),
        "ep2 -> fsdp ep2": lambda: finish_from(1, 2, lambda: moe(ep=2, data_sharding="full", **no_dropout),
                                               f"{folder}/ep2"),
        "one process -> fsdp ep2": lambda: finish_from(1, 2, lambda: moe(ep=2, data_sharding="full", **no_dropout),
                                                       one_process),
    }
    return run_checks(checks)


# ------------------------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """One process, no dropout, the layouts' micro-batches: HALF steps, a checkpoint (`folder`), HALF more steps
    uninterrupted (`curve` of those, `params` at the end): what the moved checkpoints must continue."""
    folder = str(tmp_path_factory.mktemp("one_process"))
    trainer = fresh_trainer(ParallelContext.single(), moe(dropout=0.0), synthetic_data)
    curve(trainer, HALF)
    save_checkpoint(trainer, folder)
    return {"folder": folder, "curve": curve(trainer, HALF), "params": full_parameters(trainer.model)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_workers(2, world2_checks, str(tmp_path_factory.mktemp("resume2")), timeout=600)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, one_process):
    folder = str(tmp_path_factory.mktemp("resume4"))
    return run_workers(4, world4_checks, folder, one_process["folder"], timeout=600), folder


def assert_bitwise(values: list[dict]) -> None:
    """Every rank: the resumed steps and final parameters equal the straight run's, to the bit; and every
    data (context, expert) replica holds the same final parameters."""
    for rank, value in enumerate(values):
        (curve_, params), (ref_curve, ref_params) = value["resumed"], value["straight"]
        assert curve_ == ref_curve, f"rank {rank}: {curve_} vs {ref_curve}"
        assert params.keys() == ref_params.keys()
        for name, tensor in ref_params.items():
            assert torch.equal(params[name], tensor), f"rank {rank}: {name}"
            assert torch.equal(tensor, values[0]["straight"][1][name]), f"rank {rank} and rank 0 differ: {name}"


@pytest.mark.parametrize("name", list(WORLD2_BITWISE))
def test_resume_is_bitwise_with_dropout_world2(world2, name):
    assert_bitwise(check_result(world2, f"bitwise {name}"))


@pytest.mark.parametrize("name", list(WORLD4_BITWISE))
def test_resume_is_bitwise_with_dropout_world4(world4, name):
    assert_bitwise(check_result(world4[0], f"bitwise {name}"))


@pytest.mark.parametrize("name", DROPOUT_CONTROLS)
def test_dropout_is_on_in_the_bitwise_cases(world2, name):
    """The bitwise cases would prove little if dropout drew nothing: on the same layout (FSDP, EP, CP), the
    losses at dropout 0.1 differ from those at dropout 0 by more than 1e-3 (relative), on every rank."""
    for runs in check_result(world2, f"dropout {name}"):
        moved = max(abs(a - b) / abs(b) for a, b in zip(runs["dropout"], runs["none"]))
        assert moved > 1e-3, (name, runs)


def assert_continues_one_process(value: tuple, one_process: dict) -> None:
    (curve_, params), (ref_curve, ref_params) = value, (one_process["curve"], one_process["params"])
    assert len(curve_) == len(ref_curve)
    for step, (got, want) in enumerate(zip(curve_, ref_curve), HALF + 1):
        for what, a, b in zip(("loss", "grad norm", "aux loss"), got, want):
            assert abs(a - b) <= TOL * abs(b), f"step {step}: {what} {a} vs {b}"
    assert_trained_parameters(params, ref_params, 2 * HALF, TOL)


@pytest.mark.parametrize("name", ["fsdp ep2 -> fsdp ep2", "fsdp ep2 -> ep2", "fsdp ep2 -> fsdp ep4",
                                  "ep2 -> fsdp ep2", "one process -> fsdp ep2"])
def test_fsdp_expert_checkpoints_move_between_layouts(world4, one_process, name):
    """A step-2 checkpoint of FSDP x EP=2 (DP=4) loads into FSDP x EP=2, EP=2 without FSDP and FSDP x EP=4, and
    FSDP x EP=2 loads EP=2's and one process's: steps 3-4 and the final parameters continue one process's
    uninterrupted run within 1e-5, on every rank."""
    check_result(world4[0], "save fsdp ep2"), check_result(world4[0], "save ep2")
    for value in check_result(world4[0], name):
        assert_continues_one_process(value, one_process)


def test_fsdp_expert_checkpoint_resumes_in_one_process(world4, one_process):
    """FSDP x EP=2 (DP=4) saved at step 2, resumed by one process: steps 3-4 within 1e-5 of one process."""
    check_result(world4[0], "save fsdp ep2")
    assert_continues_one_process(finish_from(1, 1, lambda: moe(dropout=0.0), f"{world4[1]}/fsdp_ep2"), one_process)


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_publishes_nothing(world2):
    """Only rank 1's write fails (file too large): both ranks raise the one-line error naming rank 1's file and
    the last good checkpoint (step 1), the unfinished folder is gone and `latest` still names step 1."""
    for value in check_result(world2, "failed save on one rank"):
        error = value["error"]
        assert error is not None and "\n" not in error
        assert error.startswith("could not save the checkpoint of step 2: ")
        assert "/.tmp-step_00000002/rng_rank00001.safetensors: [Errno 27] File too large" in error
        assert "the last good checkpoint is step 1 (" in error
        assert value["files"] == ["latest", "step_00000001"]
