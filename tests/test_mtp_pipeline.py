"""Multi-token prediction under pipeline parallelism: the depths on the last stage train as one process.

Model: the tiny DeepSeek-V3 of `test_mla_parallel` (MLA with q-LoRA, a dense first layer, then MoE layers with
DeepSeek's grouped sigmoid routing and a moving expert bias) at 4 layers, with 2 multi-token-prediction depths
(weight 0.3), fp32, dropout 0. The depths live on the last stage, which keeps a copy of the input embedding for
their rolled tokens; its gradient is summed with the first stage's over the embedding group.

Checks, each against one process within 1e-5 on every step's loss, MTP loss and gradient norm and on every
final parameter, on every rank (the embedding's two copies must be bitwise equal: `merge_copies`):
- world 2: PP=2 under 1F1B and GPipe, PP=2 x 2 virtual stages under interleaved 1F1B, and packed SFT rows
  (documents crossing the micro-batches, rolled within documents) at PP=2 x 2 virtual stages, whose validation
  loss must match too;
- world 4: PP=2 x TP=2 with sequence parallelism (the embedding copy split over the vocabulary), and
  PP=2 x DP=2 with replicated parameters, with FSDP (each copy's gradient reduce-scattered before the sum)
  and with the distributed optimizer (the sum on the fp32 gradient buffers);
- the control: with the copy's gradient not summed (`sum_tied_gradients` a no-op) the gradient norm, the
  parameters and the two copies differ, so the checks above could fail;
- checkpoints: a one-process checkpoint of step 3 resumes at PP=2 and a PP=2 one resumes in one process, both
  then equal to the uninterrupted run; the PP=2 checkpoint stores the embedding once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_mla_parallel import mla_config
from test_moe_parallel import full_parameters
from test_sft_layouts import sft_config
from test_sft_layouts import train_data as sft_rows
from test_sft_layouts import valid_data as sft_valid_rows
from test_training import synthetic_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

import agreement
from agreement import assert_every_rank, rel
from multiproc import check_result, merge_copies, run_checks, run_workers

STEPS, SAVED_AT, TOL = 6, 3, 1e-5


def deepseek_config(pp: int = 1, tp: int = 1, sp: bool = False, virtual: int = 1, schedule: str = "1f1b",
                    micro: int = 4, **train):
    config = mla_config(tp=tp, sp=sp, pp=pp, num_layers=4, mtp_layers=2, mtp_loss_weight=0.3,
                        train={"micro_batch_size": micro, **train})
    config.parallel.pipeline_schedule, config.parallel.virtual_stages = schedule, virtual
    return config


def packed_config(pp: int = 1, virtual: int = 1, micro: int = 8):
    """Packed SFT rows (`test_sft_layouts`): MLA, 4 layers, 2 depths rolled within each document."""
    return sft_config("mla", micro=micro, pp=pp, virtual=virtual, mtp=True)


def train(ctx: ParallelContext, config, packed: bool = False, save: str | None = None, load: str | None = None,
          merge: bool = True) -> dict:
    """(loss, gradient norm, MTP loss) of every step up to STEPS (from a checkpoint's step with `load`), the
    validation loss (packed rows) and every final parameter of all stages (`merge`: one dict, the copies
    checked bitwise equal; else this rank's own). `save`: a checkpoint of step SAVED_AT goes there."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, sft_rows() if packed else synthetic_data(), sft_valid_rows() if packed else None)
    if load:
        load_checkpoint(trainer, load)
    metrics = []
    while trainer.step < STEPS:
        metrics.append(trainer.train_step())
        if save and trainer.step == SAVED_AT:
            save_checkpoint(trainer, save)
    params = full_parameters(trainer.model)
    if ctx.pp_size > 1 and merge:
        params = merge_copies(ctx.world.all_gather_object(params))
    return {"curve": [(m["loss"], m["grad_norm"], m["mtp_loss"]) for m in metrics],
            "valid": trainer.evaluate() if packed else None, "params": params}


# ------------------------------------------------------------------------------------------ workers

def pipeline_case(config, pp: int = 2, tp: int = 1, **run):
    def check():
        return train(ParallelContext.from_process_group(tp, pipeline_parallel=pp), config, **run)
    return check


def unsummed_copy():
    """PP=2 with the embedding copy's gradient left unsummed: this rank's curve and its own parameters."""
    from shardlm.training import pipeline

    original = pipeline.sum_tied_gradients
    pipeline.sum_tied_gradients = lambda model, ctx: None
    try:
        return train(ParallelContext.from_process_group(1, pipeline_parallel=2), deepseek_config(pp=2), merge=False)
    finally:
        pipeline.sum_tied_gradients = original


def world2_checks(directory: str) -> dict:
    return run_checks({
        "pp2 1f1b": pipeline_case(deepseek_config(pp=2), save=f"{directory}/pp2"),
        "pp2 gpipe": pipeline_case(deepseek_config(pp=2, schedule="gpipe")),
        "pp2 virtual2": pipeline_case(deepseek_config(pp=2, virtual=2, schedule="interleaved-1f1b")),
        "pp2 virtual2 packed": pipeline_case(packed_config(pp=2, virtual=2, micro=1), packed=True),
        "pp2 from pp1 checkpoint": pipeline_case(deepseek_config(pp=2), load=f"{directory}/pp1"),
        "pp2 unsummed copy": unsummed_copy,
    })


def world4_checks() -> dict:
    return run_checks({
        "pp2 tp2 sp": pipeline_case(deepseek_config(pp=2, tp=2, sp=True), tp=2),
        "pp2 dp2": pipeline_case(deepseek_config(pp=2, micro=2)),
        "pp2 dp2 fsdp": pipeline_case(deepseek_config(pp=2, micro=2, data_sharding="full")),
        "pp2 dp2 zero1": pipeline_case(deepseek_config(pp=2, micro=2, distributed_optimizer=True)),
    })


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mtp_pipeline")


@pytest.fixture(scope="module")
def reference(directory) -> dict:
    """One process: the 4-layer DeepSeek at micro-batch 4 (saving step 3 for the PP=2 resume) and 2 (the
    MoE loss is a function of each micro-batch's routing, so DP=2 x micro-batch 2 needs its own), and the
    packed rows at micro-batch 8."""
    ctx = ParallelContext.single()
    return {"deepseek": train(ctx, deepseek_config(), save=str(directory / "pp1")),
            "micro 2": train(ctx, deepseek_config(micro=2)),
            "packed": train(ctx, packed_config(), packed=True)}


@pytest.fixture(scope="module")
def world2(reference, directory):
    return run_workers(2, world2_checks, str(directory), timeout=600)


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, world4_checks, timeout=600)


CURVE = ("loss", "grad norm", "mtp loss")
"""What a run records at each step, as far as the step has it (`agreement.assert_same_curve` compares each)."""


def assert_same_run(value: dict, ref: dict, where: str, first_step: int = 1) -> None:
    """`agreement.assert_same_run` at TOL after STEPS steps: curve from `first_step` on, validation, parameters."""
    agreement.assert_same_run(value, ref, where, steps=STEPS, tol=TOL, columns=CURVE, first_step=first_step)


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("name, kind", [("pp2 1f1b", "deepseek"), ("pp2 gpipe", "deepseek"),
                                        ("pp2 virtual2", "deepseek"), ("pp2 virtual2 packed", "packed")])
def test_mtp_under_pipeline_equals_one_process(world2, reference, name, kind):
    assert_every_rank(world2, name, reference[kind], steps=STEPS, tol=TOL, columns=CURVE)


@pytest.mark.parametrize("name, kind", [("pp2 tp2 sp", "deepseek"), ("pp2 dp2", "micro 2"),
                                        ("pp2 dp2 fsdp", "micro 2"), ("pp2 dp2 zero1", "micro 2")])
def test_mtp_under_pipeline_at_four_ranks_equals_one_process(world4, reference, name, kind):
    assert_every_rank(world4, name, reference[kind], steps=STEPS, tol=TOL, columns=CURVE)


def test_the_embedding_copy_needs_its_gradient_summed(world2, reference):
    """Control: without the embedding group's sum, the first stage's embedding misses the depths' gradient
    and the last stage's copy misses the main model's: the norm, the weights and the copies all drift."""
    first, last = check_result(world2, "pp2 unsummed copy")
    ref = reference["deepseek"]
    assert abs(first["curve"][0][1] - ref["curve"][0][1]) > 1e-3 * ref["curve"][0][1]
    assert rel(first["params"]["wte.weight"], ref["params"]["wte.weight"]) > 1e-3
    assert rel(last["params"]["wte.weight"], first["params"]["wte.weight"]) > 1e-3


def test_checkpoint_of_one_process_resumes_at_pp2(world2, reference):
    for rank, value in enumerate(check_result(world2, "pp2 from pp1 checkpoint")):
        assert_same_run(value, reference["deepseek"], f"resumed rank {rank}", first_step=SAVED_AT + 1)


def test_checkpoint_of_pp2_resumes_in_one_process_and_stores_the_embedding_once(world2, reference, directory):
    check_result(world2, "pp2 1f1b")
    step = next((directory / "pp2").glob("step_*"))
    holders = [f.name for f in step.glob("model*.safetensors") if "model/wte.weight" in safe_open(str(f), "pt").keys()]
    assert len(holders) == 1, holders
    resumed = train(ParallelContext.single(), deepseek_config(), load=str(step))
    assert_same_run(resumed, reference["deepseek"], "resumed in one process", first_step=SAVED_AT + 1)
    assert torch.isfinite(torch.tensor([c[2] for c in resumed["curve"]])).all()
