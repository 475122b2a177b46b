"""Zero-bubble pipeline schedules (interleaved zero bubble, ZB-V, DualPipeV) train exactly as one process.

These schedules split each backward into an input-gradient step (I) and a weight-gradient step (W) that the
schedule runs later, in the bubble; ZB-V and DualPipeV also place two stages a rank in a V (rank r holds stage r
and stage 2P - 1 - r, so rank 0 holds both the embedding and the output layer, one word embedding used twice).
Every case trains a tiny model for STEPS steps, fp32, dropout 0, and must equal one process within 1e-5 on each
step's loss and gradient norm (and MTP / MoE auxiliary loss where there is one) and on every final parameter,
gathered from every rank (data-parallel replicas and the tied embedding's copies bitwise equal: `merge_copies`):
- world 2, PP=2: GPT with tied embeddings under each schedule and several micro-batch counts, with full and
  selective recomputation; DeepSeek-V3-style MLA + MoE with 2 multi-token-prediction depths on the last stage
  (ZB-V, DualPipeV, interleaved zero bubble), and packed SFT rows with those depths (validation loss too); a
  1F1B checkpoint resumed under ZB-V;
- world 4: PP=4 under each schedule; PP=2 x TP=2 with sequence parallelism (GPT and the MTP model); PP=2 x DP=2
  with ZeRO-1 (the fp32 gradient buffer filled by the weight step) and with FSDP (GPT and Llama); an MoE with
  EP=2 over the data-parallel ranks;
- recomputation: every rank's layers (full) or attention cores (selective) ran exactly as often as
  docs/pipeline.md counts (`expected_calls`); with dropout 0.1 and full recomputation, ZB-V, DualPipeV and
  interleaved zero bubble (V = 2) train bitwise as the same run without recomputation, and a run resumed from a
  checkpoint is bitwise the uninterrupted one (the split backward recomputes each block more than once, so the RNG
  context is re-entered);
- evaluation and DPO's reference pass under the V (`ForwardOnlyV`): the packed SFT model's validation loss under
  DualPipeV too, and a Llama's DPO reference log-probabilities of every training and held-out pair under ZB-V and
  DualPipeV, with the validation loss before and after and 4 steps of training, equal one process (within 1e-5);
- controls: PyTorch's split steps over the stage module's own parameters only (as `PipelineStage` does) leave the
  last stage's final norm and output layer untrained, and the weight step without the flush into `main_grad`
  loses ZeRO-1's gradients: the checks above fail both;
- PyTorch's double count of a weight used at two sites on one path (pytorch #180952) is
  tests/test_pipeline_split_backward.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fsdp_pipeline import pp_config as fsdp_config
from test_moe_parallel import full_parameters, moe_config, stage_parameters
from test_mtp_pipeline import deepseek_config, packed_config
from test_pipeline import assert_resume_is_bitwise, resume_run, whole_model, with_dropout
from test_pipeline import pp_config as gpt_config
from test_pipeline import train as train_gpt
from test_preference_layouts import STEPS as PREFERENCE_STEPS
from test_preference_layouts import assert_matches as assert_preference_matches
from test_preference_layouts import preference_config
from test_preference_layouts import train_data as pairs
from test_preference_layouts import valid_data as valid_pairs
from test_sft_layouts import train_data as sft_rows
from test_sft_layouts import valid_data as sft_valid_rows
from test_training import synthetic_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.parallel import ParallelContext
from shardlm.preference.loss import METRICS
from shardlm.preference.reference import precompute_reference
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

import agreement
from agreement import assert_every_rank
from layouts import count_forwards, fresh_after_failure, layout_context
from multiproc import check_result, merge_copies, run_checks, run_workers

STEPS, SAVED_AT, TOL = 4, 2, 1e-5


# ------------------------------------------------------------------------------------------ the cases

def gpt(pp: int = 2, tp: int = 1, micro: int = 2, schedule: str = "1f1b", virtual: int = 1, recompute: str = "none",
        **parallel):
    """The 8-layer tied-embedding GPT of `test_pipeline` (global batch 8)."""
    config = gpt_config(tp, pp, micro, schedule, virtual, **parallel)
    config.train.recompute, config.train.steps = recompute, STEPS
    return config


def mtp(pp: int = 2, tp: int = 1, sp: bool = False, micro: int = 4, schedule: str = "1f1b"):
    """MLA, a dense layer then DeepSeek-routed MoE layers, 2 MTP depths on the last stage (`test_mtp_pipeline`)."""
    return deepseek_config(pp=pp, tp=tp, sp=sp, micro=micro, schedule=schedule)


def packed(pp: int = 2, micro: int = 2, schedule: str = "1f1b"):
    config = packed_config(pp=pp, micro=micro)
    config.parallel.pipeline_schedule = schedule
    return config


def moe(pp: int = 2, ep: int = 1, schedule: str = "1f1b"):
    """Mixtral-routed GPT MoE, 4 layers."""
    config = moe_config("gpt", "mixtral", 2, ep=ep, pp=pp)
    config.model.num_layers, config.parallel.pipeline_schedule = 4, schedule
    return config


def fsdp(arch: str = "gpt", pp: int = 2, schedule: str = "1f1b"):
    """The FSDP model of `test_fsdp_pipeline` at 4 layers, micro-batch 1 (4 micro-batches per DP rank); one
    process (pp=1) without sharding."""
    return fsdp_config(arch, layers=4, micro=1, schedule=schedule, pp=pp, full=pp > 1)


def train(ctx: ParallelContext, config, rows: bool = False, load: str | None = None, save: str | None = None,
          steps: int = STEPS) -> dict:
    """(loss, gradient norm, MTP loss, MoE aux loss) of each step up to `steps` (from a checkpoint's step with
    `load`), the validation loss with packed `rows`, and every parameter of every stage, merged over the world;
    with recomputation, this rank's calls of its layers and attention cores (`count_forwards`) and the step's
    micro-batch count."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, sft_rows() if rows else synthetic_data(), sft_valid_rows() if rows else None)
    counts = count_forwards(trainer.model) if config.train.recompute != "none" else None
    if load:
        load_checkpoint(trainer, load)
    metrics = []
    while trainer.step < steps:
        metrics.append(trainer.train_step())
        if save and trainer.step == SAVED_AT:
            save_checkpoint(trainer, save)
    params = full_parameters(trainer.model)
    if ctx.pp_size > 1:
        params = merge_copies(ctx.world.all_gather_object(params))
    return {"curve": [(m["loss"], m["grad_norm"], m.get("mtp_loss", 0.0), m.get("moe_aux_loss", 0.0))
                      for m in metrics],
            "valid": trainer.evaluate() if rows else None, "params": params, "counts": counts,
            "micro_batches": trainer.accumulation}


# what each case is compared with: the same model in one process, at the same micro-batch size
CASES = {
    # world 2: PP=2
    "gpt zbv m4": (gpt(schedule="zbv"), "gpt m2", 2),
    "gpt zbv m8": (gpt(micro=1, schedule="zbv"), "gpt m1", 2),
    "gpt zbv m2": (gpt(micro=4, schedule="zbv"), "gpt m4", 2),
    "gpt dualpipev m4": (gpt(schedule="dualpipev"), "gpt m2", 2),
    "gpt interleaved-zb v1 m4": (gpt(schedule="interleaved-zb"), "gpt m2", 2),
    "gpt interleaved-zb v2 m8": (gpt(micro=1, schedule="interleaved-zb", virtual=2), "gpt m1", 2),
    "gpt zbv full recompute": (gpt(schedule="zbv", recompute="full"), "gpt m2", 2),
    "gpt dualpipev selective recompute": (gpt(schedule="dualpipev", recompute="selective"), "gpt m2", 2),
    "gpt interleaved-zb v2 full recompute": (gpt(micro=1, schedule="interleaved-zb", virtual=2, recompute="full"),
                                             "gpt m1", 2),
    "mtp zbv": (mtp(micro=2, schedule="zbv"), "mtp m2", 2),
    "mtp dualpipev": (mtp(micro=2, schedule="dualpipev"), "mtp m2", 2),
    "mtp interleaved-zb": (mtp(schedule="interleaved-zb"), "mtp m4", 2),
    "packed mtp zbv": (packed(schedule="zbv"), "packed m2", 2),
    "packed mtp dualpipev": (packed(schedule="dualpipev"), "packed m2", 2),
    # world 4
    "pp4 gpt zbv": (gpt(pp=4, micro=2, schedule="zbv"), "gpt m2", 4),
    "pp4 gpt dualpipev": (gpt(pp=4, micro=1, schedule="dualpipev"), "gpt m1", 4),
    "pp4 gpt interleaved-zb v2": (gpt(pp=4, micro=2, schedule="interleaved-zb", virtual=2), "gpt m2", 4),
    "pp2 tp2 sp gpt zbv": (gpt(tp=2, schedule="zbv", sequence_parallel=True), "gpt m2", 4),
    "pp2 tp2 sp gpt dualpipev": (gpt(tp=2, schedule="dualpipev", sequence_parallel=True), "gpt m2", 4),
    "pp2 tp2 sp mtp zbv": (mtp(tp=2, sp=True, micro=2, schedule="zbv"), "mtp m2", 4),
    "pp2 dp2 zero1 gpt zbv": (gpt(micro=1, schedule="zbv"), "gpt m1", 4),
    "pp2 dp2 zero1 mtp interleaved-zb": (mtp(micro=2, schedule="interleaved-zb"), "mtp m2", 4),
    "pp2 dp2 fsdp gpt zbv": (fsdp(schedule="zbv"), "fsdp gpt", 4),
    "pp2 dp2 fsdp gpt dualpipev": (fsdp(schedule="dualpipev"), "fsdp gpt", 4),
    "pp2 dp2 fsdp llama interleaved-zb": (fsdp("llama", schedule="interleaved-zb"), "fsdp llama", 4),
    "pp2 ep2 moe zbv": (moe(ep=2, schedule="zbv"), "moe", 4),
    "pp2 ep2 moe interleaved-zb": (moe(ep=2, schedule="interleaved-zb"), "moe", 4),
}
for _name in ("pp2 dp2 zero1 gpt zbv", "pp2 dp2 zero1 mtp interleaved-zb"):
    CASES[_name][0].train.distributed_optimizer = True
TENSOR = {name: 2 if "tp2" in name else 1 for name in CASES}
EXPERT = {name: 2 if "ep2" in name else 1 for name in CASES}

REFERENCES = {
    "gpt m1": lambda: gpt(pp=1, micro=1), "gpt m2": lambda: gpt(pp=1, micro=2), "gpt m4": lambda: gpt(pp=1, micro=4),
    "mtp m2": lambda: mtp(pp=1, micro=2), "mtp m4": lambda: mtp(pp=1, micro=4),
    "packed m2": lambda: packed(pp=1), "moe": lambda: moe(pp=1),
    "fsdp gpt": lambda: fsdp(pp=1), "fsdp llama": lambda: fsdp("llama", pp=1),
}


def case(name: str):
    config, _, _ = CASES[name]
    pp = config.parallel.pipeline

    def check():  # the cases of one layout share its process groups (`layouts.layout_context`)
        return fresh_after_failure(lambda: train(layout_context(TENSOR[name], pp, 1, EXPERT[name]), config,
                                                 rows="packed" in name), {})
    return check


# ------------------------------------------------------------------------------------------ controls

def stage_parameters_only():
    """Control: the split steps over `submod.parameters()`, PyTorch's own choice (the stage's layers only)."""
    from shardlm.parallel.pipeline import ShardlmStage

    original = ShardlmStage.weights
    ShardlmStage.weights = lambda self: [p for p in self.submod.parameters() if p.requires_grad]
    try:
        return case("gpt zbv m4")()
    finally:
        ShardlmStage.weights = original


def weight_step_without_flush():
    """Control: the weight step leaves its gradients in `.grad`, where ZeRO-1's fp32 buffer never sees them."""
    from shardlm.parallel import pipeline

    original = pipeline._flush_main_grad
    pipeline._flush_main_grad = lambda weights: None
    try:
        return case("pp2 dp2 zero1 gpt zbv")()
    finally:
        pipeline._flush_main_grad = original


def resume_under_another_schedule(directory: str) -> dict:
    """A PP=2 1F1B run saves step SAVED_AT; a fresh PP=2 ZB-V trainer loads it and trains on to STEPS."""
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    train(ctx, gpt(), save=f"{directory}/1f1b", steps=SAVED_AT)
    step = sorted(Path(f"{directory}/1f1b").glob("step_*"))[-1]
    return train(ctx, gpt(schedule="zbv"), load=str(step))


DROPOUT_SCHEDULES = {"zbv": (1, 1), "dualpipev": (1, 1), "interleaved-zb": (2, 2)}  # schedule: (virtual, micro)
DROPOUT_STEPS, DROPOUT_STOP = STEPS, SAVED_AT
"""The dropout runs train the configs' STEPS steps, saved after SAVED_AT (each step recomputes every block several
times over 8 micro-batches, so these runs cost the most in this module)."""


def resume_with_dropout(directory: str, schedule: str) -> dict:
    """Dropout 0.1 and full recomputation (8 micro-batches, 4 with V = 2): DROPOUT_STOP steps, save, a new trainer
    loads and runs on, against the uninterrupted run (`test_pipeline.resume_run`); and the same run without
    recomputation ("without": its curve and final parameters)."""
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    virtual, micro = DROPOUT_SCHEDULES[schedule]
    config = with_dropout(gpt(micro=micro, schedule=schedule, virtual=virtual), recompute="full")
    run = resume_run(ctx, config, f"{directory}/{schedule}", stop=DROPOUT_STOP, steps=DROPOUT_STEPS)
    ctx.rng = None
    curve, trainer = train_gpt(ctx, with_dropout(gpt(micro=micro, schedule=schedule, virtual=virtual)),
                               steps=DROPOUT_STEPS)
    return run | {"without": (curve, whole_model(ctx, trainer))}


PREFERENCE_LAYERS = 4  # 2 stages a rank on PP=2


def preference(pp: int = 1, schedule: str = "1f1b"):
    """Sigmoid DPO of `test_preference_layouts` on a 4-layer Llama (micro-batch 2: 4 micro-batches a step)."""
    config = preference_config(pp=pp)
    config.model.num_layers, config.parallel.pipeline_schedule = PREFERENCE_LAYERS, schedule
    return config


def preference_run(ctx: ParallelContext, config) -> dict:
    """DPO with the reference precomputed by the starting weights: the reference log-probabilities of every
    training and held-out pair (`precompute_reference`, through the stages), the validation loss before and after
    PREFERENCE_STEPS steps, the curve and every parameter."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, pairs(), valid_pairs())
    tables = {"train": precompute_reference(trainer, trainer.train_data),
              "valid": precompute_reference(trainer, trainer.valid_data)}
    trainer.loss.tables = tables
    valid = [trainer.evaluate()]
    curve = []
    for _ in range(PREFERENCE_STEPS):
        m = trainer.train_step()
        curve.append((m["loss"], m["grad_norm"], *(m[k] for k in METRICS)))
    valid.append(trainer.evaluate())
    return {"tables": tables, "curve": curve, "valid": valid, "params": stage_parameters(trainer.model)}


def world2_checks(directory: str) -> dict:
    checks = {name: case(name) for name, (_, _, world) in CASES.items() if world == 2}
    return run_checks(checks | {"stage parameters only": stage_parameters_only,
                                "1f1b to zbv": lambda: resume_under_another_schedule(directory),
                                **{f"resume {s} with dropout": lambda s=s: resume_with_dropout(directory, s)
                                   for s in DROPOUT_SCHEDULES},
                                **{f"preference {s}": lambda s=s: preference_run(
                                    ParallelContext.from_process_group(1, pipeline_parallel=2), preference(2, s))
                                   for s in ("zbv", "dualpipev")}})


def world4_checks() -> dict:
    checks = {name: case(name) for name, (_, _, world) in CASES.items() if world == 4}
    return run_checks(checks | {"zero1 without flush": weight_step_without_flush})


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def reference() -> dict:
    ctx = ParallelContext.single()
    return {key: train(ctx, make(), rows=key.startswith("packed")) for key, make in REFERENCES.items()}


@pytest.fixture(scope="module")
def preference_reference() -> dict:
    return preference_run(ParallelContext.single(), preference())


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list:
    return run_workers(2, world2_checks, str(tmp_path_factory.mktemp("zero_bubble")), timeout=600)


@pytest.fixture(scope="module")
def world4() -> list:
    return run_workers(4, world4_checks, timeout=600)


CURVE = ("loss", "grad norm", "mtp loss", "moe aux loss")
"""What a run records at each step, as far as the step has it (`agreement.assert_same_curve` compares each)."""


def assert_same_run(value: dict, ref: dict, where: str, first_step: int = 1) -> None:
    """`agreement.assert_same_run` at TOL after STEPS steps: curve from `first_step` on, validation, parameters."""
    agreement.assert_same_run(value, ref, where, steps=STEPS, tol=TOL, columns=CURVE, first_step=first_step)


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("name", [name for name, (_, _, world) in CASES.items() if world == 2])
def test_pp2_zero_bubble_schedules_equal_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[CASES[name][1]], steps=STEPS, tol=TOL, columns=CURVE)


@pytest.mark.parametrize("name", [name for name, (_, _, world) in CASES.items() if world == 4])
def test_four_rank_zero_bubble_layouts_equal_one_process(world4, reference, name):
    assert_every_rank(world4, name, reference[CASES[name][1]], steps=STEPS, tol=TOL, columns=CURVE)


WEIGHT_GROUPS = 6
"""Where a GPT layer's weights meet its input's path: ln_1, attn.qkv, attn.proj, ln_2, mlp.fc, mlp.proj (each
module's weight and bias at one node). PyTorch's weight step runs one autograd call per such group."""


def expected_calls(rank: int, micro_batches: int, recompute: str) -> tuple[int, int]:
    """(layer calls, attention-core calls) on `rank` of the 8-layer GPT at PP=2 with 2 stages a rank (4 stages of 2
    layers; rank 0 holds stage 0, under the V and interleaved alike), over STEPS steps, as docs/pipeline.md counts
    them. A block runs once forward; its backward reruns it once per autograd call that needs what it saved. Full
    recomputation: the input step (1 call) and the weight step (WEIGHT_GROUPS calls) on every stage but the
    first, whose input needs no gradient, so its whole backward is one call in its weight step. Selective: the
    attention core holds no weight, so only the input step (the first stage: its one backward) reruns it. The
    schedule's first step also runs each stage forward once on stand-in tensors, and backward (one call) on every
    stage but the first."""
    layers, first = 2, 1 if rank == 0 else 0  # stage 0's layers on this rank: `first` x 2
    backward_calls = {"full": 1 + WEIGHT_GROUPS, "selective": 1}[recompute]  # on a stage other than the first
    per_micro_batch = layers * (first * 2 + (2 - first) * (1 + backward_calls))  # core or whole layer, rerun
    shapes = layers * (2 + (2 - first))  # the stand-in forward of both stages, backward of the non-first
    recomputed = STEPS * micro_batches * per_micro_batch + shapes
    forwards = STEPS * micro_batches * 2 * layers + 2 * layers
    return (recomputed, recomputed) if recompute == "full" else (forwards, recomputed)


@pytest.mark.parametrize("name,recompute", [("gpt zbv full recompute", "full"),
                                            ("gpt dualpipev selective recompute", "selective"),
                                            ("gpt interleaved-zb v2 full recompute", "full")])
def test_recomputation_reruns_each_block_as_documented(world2, name, recompute):
    """Every rank's layer calls and attention-core calls equal `expected_calls` exactly: a fully recomputed GPT
    layer off the first stage runs 1 + 1 + 6 = 8 times per micro-batch, on the first stage 2 times; a selectively
    recomputed core 2 times everywhere."""
    for rank, value in enumerate(check_result(world2, name)):
        counts = (value["counts"]["layer"], value["counts"]["core"])
        assert counts == expected_calls(rank, value["micro_batches"], recompute), (rank, value["counts"])


@pytest.mark.parametrize("schedule", list(DROPOUT_SCHEDULES))
def test_resume_with_dropout_and_recomputation_is_bitwise(world2, schedule):
    """The split backward recomputes each block more than once; the resumed run still draws the uninterrupted one's
    masks."""
    for value in check_result(world2, f"resume {schedule} with dropout"):
        assert_resume_is_bitwise(value)


@pytest.mark.parametrize("schedule", list(DROPOUT_SCHEDULES))
def test_recomputation_with_dropout_is_bitwise_the_run_without(world2, schedule):
    """Dropout 0.1 (residual: the default generator; attention probabilities: the model-parallel tracker's):
    every recomputation in the input and weight steps draws the forward's masks, so full recomputation changes
    no bit of the losses, gradient norms and final parameters."""
    for rank, value in enumerate(check_result(world2, f"resume {schedule} with dropout")):
        curve, params = value["without"]
        assert value["uninterrupted"] == curve, f"rank {rank}"
        assert params.keys() == value["final"].keys()
        for name, param in params.items():
            assert torch.equal(value["final"][name], param), f"rank {rank}: {name}"
        assert curve[-1][0] < curve[0][0] and len(curve) > 1  # it trained


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_dpo_reference_pass_under_the_v_equals_one_process(world2, preference_reference, schedule):
    """`ForwardOnlyV` runs each rank's two stages in turn; the last stage (rank 0's second) records each
    micro-batch's sequence log-probabilities for the pairs of that micro-batch. The tables of the training and
    held-out pairs equal one process's within 1e-6 relative (sums of about 10 fp32 token log-probabilities of a
    few nats each); then DPO trains as one process does (`test_preference_layouts.assert_matches`)."""
    ref = preference_reference
    for rank, value in enumerate(check_result(world2, f"preference {schedule}")):
        for split, table in value["tables"].items():
            want = ref["tables"][split]
            assert table.shape == want.shape and (want != 0).all(), split
            error = ((table - want).abs() / want.abs()).max().item()
            assert error <= 1e-6, f"rank {rank} {split}: {error:.1e}"
        assert_preference_matches(value, ref, f"preference {schedule} rank {rank}")


def test_a_1f1b_checkpoint_resumes_under_zbv(world2, reference):
    for rank, value in enumerate(check_result(world2, "1f1b to zbv")):
        assert_same_run(value, reference["gpt m2"], f"resumed rank {rank}", first_step=SAVED_AT + 1)


def test_split_steps_over_the_stage_module_alone_miss_the_last_stage_ends(world2, reference):
    """Control: PyTorch's weight list leaves the final norm without a gradient; it never moves from 1."""
    ref = reference["gpt m2"]
    for value in check_result(world2, "stage parameters only"):
        assert torch.equal(value["params"]["ln_f.weight"], torch.ones_like(ref["params"]["ln_f.weight"]))
        assert not torch.equal(ref["params"]["ln_f.weight"], torch.ones_like(ref["params"]["ln_f.weight"]))
        assert abs(value["curve"][0][1] - ref["curve"][0][1]) > 1e-3 * ref["curve"][0][1]
        assert value["curve"][-1][0] < value["curve"][0][0]  # the broken run did train


def test_zero1_needs_the_weight_step_flushed_into_main_grad(world4, reference):
    """Control: without the flush, the split steps' gradients never reach the fp32 buffer ZeRO-1 reduces."""
    ref = reference["gpt m1"]
    for value in check_result(world4, "zero1 without flush"):
        assert abs(value["curve"][0][1] - ref["curve"][0][1]) > 1e-3 * ref["curve"][0][1]
        assert value["curve"][-1][0] < value["curve"][0][0]  # the broken run did train
