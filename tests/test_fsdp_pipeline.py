"""FSDP (`train.data_sharding = "full"`) composed with pipeline stages gives the single-process run.

One world of 4 processes, PP=2 x FSDP DP=2, trains the tiny GPT (tied word embedding on the first and the
last stage) with 1F1B and GPT and Llama (4 layers, 2 virtual stages) with interleaved 1F1B, each DP rank
accumulating 2 or 4 micro-batches; losses and gradient norms at each of 8 steps and the final parameters
(gathered over DP and from every stage) agree within 1e-5 with one process run in this test process, and
the tied embedding's two copies stay bitwise equal. The same world counts FSDP's collectives of a step,
evaluates, skips an fp16 step that overflows on one rank only, runs a checkpoint chain FSDP DP=2 x TP=2
-> one process -> PP=2 x FSDP DP=2 against one process's curve, and resumes bitwise on PP=2 x FSDP DP=2;
bf16 parameters and MoE with EP=2 train there too, near / equal to one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_fsdp import HALF_TOL, assert_parameters_near, config, gathered_parameters, run, save_at, validation_loss
from test_moe_parallel import assert_same_run as assert_same_moe_run
from test_moe_parallel import moe_config
from test_moe_parallel import reference as moe_reference
from test_moe_parallel import run as moe_run
from test_training import assert_same_run, synthetic_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.parallel import ParallelContext
from shardlm.training.fsdp import counting_collectives
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from layouts import layout, spawn_layouts
from multiproc import check_result, merge_copies

STEPS = 8
INTERLEAVED = {"layers": 4, "micro": 1, "schedule": "interleaved-1f1b", "virtual": 2}  # 4 micro-batches per DP rank
BF16_PARAMS = {"precision": "bf16", "param_dtype": "half"}


def pp_config(arch: str = "gpt", layers: int = 2, micro: int = 2, schedule: str = "1f1b", virtual: int = 1,
              pp: int = 2, full: bool = True, **train):
    """The tiny model of `test_fsdp.config` with `layers` layers over `pp` stages (pp=1: one process)."""
    cfg = config(arch=arch, micro=micro, full=full, **train)
    cfg.model.num_layers = layers
    if pp > 1:
        cfg.parallel.pipeline, cfg.parallel.pipeline_schedule, cfg.parallel.virtual_stages = pp, schedule, virtual
    return cfg


def whole_model(ctx: ParallelContext, trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every stage's parameters (`gathered_parameters`: over DP and TP) on every rank. A name several ranks
    hold (its DP replicas after the gather, the tied embedding's first- and last-stage copies) must be
    bitwise equal on all of them, else this raises naming it."""
    return merge_copies(ctx.world.all_gather_object(gathered_parameters(trainer)))


def pipeline_run(cfg, steps: int = STEPS) -> tuple:
    """(curve, whole model) of `cfg` trained at PP=2 x FSDP DP=2."""
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    curve, _, trainer = run(ctx, cfg, steps)
    return curve, whole_model(ctx, trainer)


# -------------------------------------------------------------------------------------- in workers

def collectives_of_a_step(reshard_after_forward: bool) -> dict:
    """PP=2 x FSDP DP=2, GPT with 1F1B over 2 micro-batches: the all-gathers and reduce-scatters of one
    step (after a first one) as (calls, elements), counted by `counting_collectives`."""
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    trainer = Trainer(pp_config(fsdp_reshard_after_forward=reshard_after_forward), ctx, synthetic_data())
    trainer.train_step()
    with counting_collectives() as counts:
        trainer.train_step()
    layers = trainer.model.layers
    return {"counts": counts, "layers": len(layers), "layer_elements": sum(p.numel() for p in layers.parameters()),
            "elements": sum(p.numel() for p in trainer.params), "micro_batches": trainer.accumulation}


def fp16_overflow_on_one_rank() -> dict:
    """PP=2 x FSDP DP=2 in fp16: one clean step, then a step where only the last stage's DP rank 1 finds an
    inf in its gradient shard (after the reduce-scatter): whether it skipped, and the parameters unchanged."""
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    trainer = Trainer(pp_config(precision="fp16", initial_loss_scale=2.0**10), ctx, synthetic_data())
    clean = trainer.train_step()["skipped"]
    if ctx.is_last_stage and ctx.dp_rank == 1:
        reduce = trainer.reduce_gradients

        def reduce_then_overflow():
            reduce()
            trainer.fsdp.shards[-1].grad.view(-1)[0] = float("inf")
        trainer.reduce_gradients = reduce_then_overflow
    before = {n: p.detach().to_local().clone() for n, p in trainer.model.named_parameters()}
    skipped = trainer.train_step()["skipped"]
    unchanged = all(torch.equal(before[n], p.detach().to_local()) for n, p in trainer.model.named_parameters())
    return {"clean": clean, "skipped": skipped, "unchanged": unchanged}


def checkpoint_chain(folder: str) -> dict:
    """FSDP DP=2 x TP=2 (with SP) trains steps 1-3 and saves; rank 0 alone, as one process without FSDP, loads
    that and trains steps 4-5 and saves; PP=2 x FSDP DP=2 loads that and trains steps 6-8."""
    save_at(f"{folder}/fsdp_tp", tp=2, steps=3)
    one_process = None
    if dist.get_rank() == 0:
        ctx = ParallelContext.single()
        trainer = Trainer(config(full=False, micro=2), ctx, synthetic_data())
        load_checkpoint(trainer, f"{folder}/fsdp_tp")
        one_process, _, trainer = run(ctx, None, steps=2, trainer=trainer)
        save_checkpoint(trainer, f"{folder}/one_process")
    dist.barrier()
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    trainer = Trainer(pp_config(), ctx, synthetic_data())
    load_checkpoint(trainer, f"{folder}/one_process")
    curve, _, trainer = run(ctx, None, steps=STEPS - 5, trainer=trainer)
    return {"one process": one_process, "pipeline": (curve, whole_model(ctx, trainer))}


def bitwise_resume(folder: str) -> dict:
    """PP=2 x FSDP DP=2 with dropout: 2 steps, save, 2 more; a fresh trainer loads the save and runs the same
    2 steps."""
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    cfg = pp_config(dropout=0.1)
    _, _, trainer = run(ctx, cfg, steps=2)
    save_checkpoint(trainer, folder)
    straight = run(ctx, None, steps=2, trainer=trainer)[0], whole_model(ctx, trainer)
    fresh = Trainer(cfg, ctx, synthetic_data())
    load_checkpoint(fresh, folder)
    resumed = run(ctx, None, steps=2, trainer=fresh)[0], whole_model(ctx, fresh)
    return {"straight": straight, "resumed": resumed}


WORLD4 = {
    "gpt 1f1b": layout(pp=2),
    "gpt interleaved": layout(pp=2, **INTERLEAVED),
    "llama interleaved": layout(pp=2, arch="llama", **INTERLEAVED),
    "gpt 1f1b bf16 params": layout(pp=2, **BF16_PARAMS),
    "moe ep2 1f1b": layout(pp=2, ep=2, moe=True),
}
"""The layouts of the world of 4, PP=2 x FSDP DP=2 (the MoE at EP=2), each against one process: the first three
within 1e-5 (`EQUAL`), bf16 parameters within `test_fsdp.HALF_TOL`, the MoE with its aux loss."""
EQUAL = ["gpt 1f1b", "gpt interleaved", "llama interleaved"]


def run_layout(tp: int, pp: int, cp: int, ep: int, moe: bool = False, **config) -> tuple:
    """One case on this rank: (curve, whole model) of `pp_config(**config)` at PP=`pp` x FSDP DP, or with `moe`
    `test_moe_parallel`'s Mixtral-routed GPT at EP=`ep` under FSDP."""
    if moe:
        return moe_run(moe_config("gpt", "mixtral", 2, ep=ep, pp=pp, data_sharding="full"), tp=tp, ep=ep, pp=pp)()
    return pipeline_run(pp_config(pp=pp, **config))


def world4_more(folder: str) -> dict:
    """The world's further checks, not layout-against-one-process cases: collectives, validation, an fp16
    overflow, a checkpoint chain and a bitwise resume."""
    return {
        "collectives": lambda: {r: collectives_of_a_step(r) for r in (True, False)},
        "validation": lambda: validation_loss(ParallelContext.from_process_group(1, pipeline_parallel=2),
                                              pp_config(eval_iters=4)),
        "fp16": fp16_overflow_on_one_rank,
        "chain": lambda: checkpoint_chain(folder),
        "bitwise": lambda: bitwise_resume(f"{folder}/bitwise"),
    }


# ------------------------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def reference():
    """One process, no FSDP: 8-step runs of the 2-layer GPT and the 4-layer GPT and Llama, and the
    validation loss after 2 steps."""
    ctx = ParallelContext.single()
    out = {name: run(ctx, pp_config(arch, layers, micro=8, pp=1, full=False), STEPS)[:2]
           for name, arch, layers in (("gpt 1f1b", "gpt", 2), ("gpt interleaved", "gpt", 4),
                                      ("llama interleaved", "llama", 4))}
    out["gpt 1f1b bf16 params"] = run(ctx, pp_config(micro=8, pp=1, full=False, **BF16_PARAMS), STEPS)[:2]
    out["validation"] = validation_loss(ctx, config(full=False, micro=4, eval_iters=4))  # the same 16 samples
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fsdp_pipeline"))
    return spawn_layouts(4, run_layout, WORLD4, timeout=240, more=world4_more, more_args=(folder,))


@pytest.mark.parametrize("name", EQUAL)
def test_fsdp_with_pipeline_stages_equals_one_process(world4, reference, name):
    """PP=2 x FSDP DP=2 (1F1B over 2 micro-batches per DP rank; interleaved 1F1B with 2 virtual stages over
    4): loss and gradient norm at every step and the final parameters within 1e-5 of one process. The
    gradient norm counts the tied embedding once; its first- and last-stage copies are bitwise equal on
    every rank (`whole_model` raises otherwise)."""
    for run_ in check_result(world4, name):
        assert_same_run(run_, reference[name], steps=STEPS)


def test_fsdp_with_pipeline_stages_and_bf16_parameters_match_the_master_weight_run(world4, reference):
    """bf16 parameters (FSDP's mixed precision: fp32 shards, bf16 gathered copies, fp32 reduction) at PP=2 x
    FSDP DP=2 against one process with the master-weight optimizer's bf16 parameters: losses, gradient norms
    and final parameters within `test_fsdp.HALF_TOL` (relative)."""
    ref_curve, ref_params = reference["gpt 1f1b bf16 params"]
    for curve, params in check_result(world4, "gpt 1f1b bf16 params"):
        for (loss, norm), (ref_loss, ref_norm) in zip(curve, ref_curve):
            assert abs(loss - ref_loss) <= HALF_TOL["loss"] * ref_loss
            assert abs(norm - ref_norm) <= HALF_TOL["grad_norm"] * ref_norm
        assert_parameters_near(params, ref_params, HALF_TOL)


def test_fsdp_with_pipeline_stages_and_split_experts_equals_one_process(world4):
    """MoE at PP=2 x FSDP DP=2 with EP=2 (each stage's expert stacks their own FSDP unit over expert-DP of one
    rank, the rest of the stage over DP): loss, gradient norm and aux loss at every step and the final
    parameters within 1e-5 of one process."""
    for run_ in check_result(world4, "moe ep2 1f1b"):
        assert_same_moe_run(run_, moe_reference("gpt", "mixtral", 2))


def test_fsdp_with_pipeline_stages_gathers_without_regathering_per_micro_batch(world4):
    """One PP=2 x FSDP DP=2 step of 1F1B over m = 2 micro-batches, on each rank (one layer and one stage
    root each). Parameters kept gathered after the forward (`fsdp_reshard_after_forward = false`): each unit
    all-gathered once for the step and reduce-scattered once, after its last backward, since the schedule
    keeps gradients unreduced and parameters gathered between micro-batches. Resharded after the forward:
    each layer gathered for its first forward and again for each of the m backwards (a forward that follows
    a backward finds it still gathered), the root once. Elements: the stage's parameters."""
    for rank, per_reshard in enumerate(check_result(world4, "collectives")):
        for reshard, value in per_reshard.items():
            m, layers, n = value["micro_batches"], value["layers"], value["elements"]
            assert m == 2 and layers == 1
            layer_gathers = 1 + m if reshard else 1
            assert value["counts"]["all_gather"] == [1 + layer_gathers * layers,
                                                     n + (layer_gathers - 1) * value["layer_elements"]], (rank, reshard)
            assert value["counts"]["reduce_scatter"] == [1 + layers, n], (rank, reshard)


def test_fsdp_with_pipeline_stages_validation_loss_equals_one_process(world4, reference):
    """Validation through the sharded stages (their forward-only schedule) after 2 steps: within 1e-5 of
    one process, on every rank."""
    for value in check_result(world4, "validation"):
        assert abs(value - reference["validation"]) <= 1e-5 * reference["validation"]


def test_fsdp_with_pipeline_stages_fp16_overflow_on_one_rank_skips_everywhere(world4):
    """fp16: an inf in the gradient shard of one rank (last stage, DP rank 1) makes all four ranks skip the
    step, their parameters unchanged (the overflow check spans TP, PP and DP); the step before is clean."""
    for value in check_result(world4, "fp16"):
        assert value == {"clean": False, "skipped": True, "unchanged": True}


def test_checkpoint_chain_fsdp_tp_to_one_process_to_fsdp_pipeline(world4, reference):
    """FSDP DP=2 x TP=2 saves at step 3; one process loads it and trains steps 4-5 and saves; PP=2 x FSDP
    DP=2 loads that and trains steps 6-8: every step and the final parameters within 1e-5 of the
    uninterrupted one-process run (AdamW moments travel with the layout-free checkpoints)."""
    values = check_result(world4, "chain")
    ref_curve, ref_params = reference["gpt 1f1b"]
    assert len(values[0]["one process"]) == 2  # steps 4-5 (the model at step 5 is not compared: not a final state)
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(values[0]["one process"], ref_curve[3:5]), 4):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(norm - ref_norm) <= 1e-5 * ref_norm, step
    for value in values:
        assert_same_run(value["pipeline"], (ref_curve[5:], ref_params), steps=STEPS - 5)


def test_fsdp_with_pipeline_stages_resumes_bitwise(world4):
    """PP=2 x FSDP DP=2 with dropout 0.1: steps 3-4 after loading a step-2 checkpoint equal the
    uninterrupted steps 3-4 and their final parameters, bitwise, on every rank."""
    for value in check_result(world4, "bitwise"):
        (curve, params), (ref_curve, ref_params) = value["resumed"], value["straight"]
        assert curve == ref_curve
        assert params.keys() == ref_params.keys()
        assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)


def test_validate_accepts_fsdp_with_pipeline_stages():
    """`validate` takes data_sharding="full" with parallel.pipeline=2 (and interleaved virtual stages)."""
    validate(pp_config(micro=1), world_size=4, check_paths=False)
    validate(pp_config(**INTERLEAVED), world_size=4, check_paths=False)
