"""Recomputation reruns the forward, and changes nothing, in the layouts added with expert, context and
fully sharded parallelism; context parallelism trains with residual dropout.

Each layout trains 2 steps (2 micro-batches each) without recomputation, with selective recomputation (the
attention core) and with full recomputation (every layer), from the same seed. Counted by hooks: the calls of
every layer, attention core and MoE layer, and the MoE all-to-alls and ring K/V sends each rank makes, in
the model's forward and in the whole step. What must hold:
- the curve (losses, gradient norms, aux loss) and every final parameter equal no recomputation's, to the bit;
- selective recomputation runs every attention core twice, full recomputation every layer (and so its core and
  MoE layer) twice, and neither changes the forward's own calls;
- the communication a rerun forward makes is made again: under full recomputation a step's all-to-alls and
  ring sends are no recomputation's plus one more forward's; under selective recomputation the ring's too
  (it is inside the core) but not the all-to-alls.
Layouts (world of 2): one process's MoE (in this process), EP=2, CP=2 GPT and Llama with residual dropout
0.1, CP=2 with EP=2 (experts over the two CP ranks), FSDP DP=2 with dropout 0.1. CP with dropout: the same
seed gives the same run to the bit, and dropout changes the run (it is on).
"""

from __future__ import annotations

import pytest
import torch
from test_context_parallel_training import synthetic_data as cp_data
from test_resume_layouts import context, dense, moe
from test_training import synthetic_data

from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from layouts import count_forwards, counting
from multiproc import check_result, run_checks, run_workers

STEPS, MICRO_BATCHES = 2, 2
MODES = ("none", "selective", "full")
COUNTED = ("all_to_all", "ring_kv")  # collectives a layer's forward makes (MoE dispatch, the CP ring)


def counted_calls(ctx: ParallelContext) -> dict[str, int]:
    calls = ctx.comm.calls
    return {kind: sum(n for (k, _), n in calls.items() if k == kind) for kind in COUNTED}


def attach_counters(model, ctx: ParallelContext) -> dict:
    """Live counts: `count_forwards`' layer and core calls, MoE layer calls ("moe") and the counted
    collectives made inside the model's forward ("forward <kind>"), so that what a recomputation adds in the
    backward is the rest."""
    counts = count_forwards(model)
    counts |= {"moe": 0, **{f"forward {kind}": 0 for kind in COUNTED}}
    before = {}

    def enter(*_):
        before.update(counted_calls(ctx))

    def leave(*_):
        for kind, n in counted_calls(ctx).items():
            counts[f"forward {kind}"] += n - before[kind]

    for layer in model.layers.values():
        if hasattr(layer.mlp, "router"):
            layer.mlp.register_forward_pre_hook(counting(lambda *_: None, counts, "moe"))
    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    return counts


def modes_run(ctx: ParallelContext, make_config, data, modes=MODES) -> dict:
    """{mode: {"curve", "params", "counts", "calls"}} of STEPS steps of `make_config(recompute=mode)`."""
    from test_moe_parallel import full_parameters

    out = {}
    for mode in modes:
        config = make_config(recompute=mode)
        validate(config, ctx.world_size, check_paths=False)
        ctx.rng = None
        trainer = Trainer(config, ctx, data())
        assert trainer.accumulation == MICRO_BATCHES
        counts = attach_counters(trainer.model, ctx)
        ctx.comm.reset()
        curve = [(m["loss"], m["grad_norm"], m.get("moe_aux_loss")) for m in
                 (trainer.train_step() for _ in range(STEPS))]
        out[mode] = {"curve": curve, "params": full_parameters(trainer.model), "counts": dict(counts),
                     "calls": counted_calls(ctx), "layers": len(trainer.model.layers)}
    return out


# (tp, ep, cp, config factory taking train keys, dataset); micro-batches sized for 2 per step on 2 ranks
WORLD2 = {
    "ep2 gpt mixtral": (1, 2, 1, lambda **t: moe(ep=2, dropout=0.0, **t), synthetic_data),
    "cp2 gpt dropout": (1, 1, 2, lambda **t: context("gpt", **t), cp_data),
    "cp2 llama dropout": (1, 1, 2, lambda **t: context("llama", **t), cp_data),
    "cp2 ep2 llama mixtral": (1, 2, 2, lambda **t: moe_cp(**t), synthetic_data),
    "fsdp dp2 gpt dropout": (1, 1, 1, lambda **t: dense(data_sharding="full", **t), synthetic_data),
}


def moe_cp(**train):
    """A Mixtral-style Llama (16-token sequences) at CP=2, experts over the two CP ranks (EP=2)."""
    from test_context_parallel_moe import cp_moe_config

    cfg = cp_moe_config("llama", "mixtral", cp=2, ep=2, **train)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 8
    return cfg


def reproduction(make_config, data) -> dict:
    """CP=2 with residual dropout: the same seed twice, and dropout 0 (curves only)."""
    ctx = ParallelContext.from_process_group(1, context_parallel=2)
    runs = {}
    for name, config in (("first", make_config()), ("second", make_config()), ("no dropout", make_config())):
        if name == "no dropout":
            config.model.dropout = 0.0
        ctx.rng = None
        trainer = Trainer(config, ctx, data())
        runs[name] = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    return runs


def world2_checks() -> dict:
    checks = {name: (lambda case=case: modes_run(
        ParallelContext.from_process_group(case[0], expert_parallel=case[1], context_parallel=case[2]), *case[3:]))
        for name, case in WORLD2.items()}
    checks["cp2 reproduction"] = lambda: reproduction(lambda: context("gpt"), cp_data)
    return run_checks(checks)


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, world2_checks, timeout=600)


@pytest.fixture(scope="module")
def one_process_moe():
    """One process, DeepSeek-style routing (aux loss, expert bias, shared expert, first layer dense)."""
    from test_moe_parallel import moe_config

    def make(**train):
        return moe_config("llama", "deepseek", 4, **train)
    return modes_run(ParallelContext.single(), make, synthetic_data)


def assert_recomputation(runs: dict) -> None:
    """Bitwise equal runs; every layer (and MoE layer) twice under full recomputation, every core twice under
    both; the forward's collectives unchanged and, in the step, made again by each rerun forward."""
    none = runs["none"]
    once = STEPS * MICRO_BATCHES * none["layers"]
    moe_once = none["counts"]["moe"]
    assert none["counts"]["layer"] == none["counts"]["core"] == once
    for mode in ("selective", "full"):
        run = runs[mode]
        assert run["curve"] == none["curve"], mode
        for name, value in none["params"].items():
            assert torch.equal(run["params"][name], value), (mode, name)
        full = mode == "full"
        assert run["counts"]["layer"] == (2 if full else 1) * once, mode
        assert run["counts"]["core"] == 2 * once, mode
        assert run["counts"]["moe"] == (2 if full else 1) * moe_once, mode
        for kind in COUNTED:
            forward = none["counts"][f"forward {kind}"]
            assert run["counts"][f"forward {kind}"] == forward, (mode, kind)
            rerun = full or kind == "ring_kv"  # the ring runs inside the core
            assert run["calls"][kind] == none["calls"][kind] + (forward if rerun else 0), (mode, kind)


def test_one_process_moe_recomputation_reruns_the_moe_layers(one_process_moe):
    assert one_process_moe["none"]["counts"]["moe"] == STEPS * MICRO_BATCHES * 1  # the first layer is dense
    assert_recomputation(one_process_moe)


@pytest.mark.parametrize("name", list(WORLD2))
def test_recomputation_reruns_the_forward_and_its_communication(world2, name):
    for rank, runs in enumerate(check_result(world2, name)):
        none = runs["none"]
        expects = {"all_to_all": "ep2" in name, "ring_kv": "cp2" in name}
        for kind, made in expects.items():  # each layout makes the collectives its name says, in its forward
            assert (none["counts"][f"forward {kind}"] > 0) == made, (rank, kind)
            assert none["calls"][kind] > none["counts"][f"forward {kind}"] or not made, (rank, kind)  # + backward
        assert_recomputation(runs)


def test_context_parallel_residual_dropout_reproduces_and_is_on(world2):
    """CP=2 with residual dropout 0.1: the same seed gives the same curve to the bit on every rank, and
    dropout 0 another curve."""
    for runs in check_result(world2, "cp2 reproduction"):
        assert runs["first"] == runs["second"]
        assert runs["first"] != runs["no dropout"]
