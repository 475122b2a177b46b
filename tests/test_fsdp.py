"""Fully sharded data parallelism (`train.data_sharding = "full"`, FSDP2) gives the single-process run.

Tiny GPT and Llama models (2 layers, fp32, dropout 0) train 4 steps in this process and, sharded by FSDP,
in one world of 2 processes (DP=2) and one of 4 (DP=4, DP=2 x TP=2 with sequence parallelism); losses and
gradient norms at every step and the final parameters (gathered over DP and TP) agree within 1e-5, with
and without gradient accumulation and recomputation. bf16 parameters under FSDP's mixed precision are
compared with the master-weight optimizer's bf16 parameters. Checkpoints written under FSDP load at one
process and the other way round, and resume bitwise on the same layout; each rank's parameter, gradient
and AdamW bytes equal the stage's parameters x bytes / DP. With `train.compile`, every layer is compiled, then
sharded (torchtitan's order), and DP=2 still gives one eager process's run.
"""

from __future__ import annotations

import pytest
import torch
from test_llama import tiny_config as llama_config
from test_training import VOCAB, assert_same_run, synthetic_data, tiny_config

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.fsdp import counting_collectives
from shardlm.training.parallelize import can_compile
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import rel
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result, disturb_generators, needs

STEPS, SAVED = 4, 2
"""Each run's steps (warm-up and decay both reached), and the step after which the resumed runs' checkpoints are
saved."""
# Tolerances, relative, about 3x the worst error measured over 8 steps on a 2-core Xeon with AMX and a 2-core
# AMD EPYC with AVX-512-BF16; "biases" bounds only the final bias tensors (QKV, MLP and LayerNorm biases: small
# tensors whose few elements each carry a rounding), "parameters" every other tensor.
# bf16 parameters, FSDP (fp32 shards, bf16 gathered copies) against the master-weight optimizer (fp32 master
# weights, bf16 parameters), DP=2 and PP=2 x DP=2: loss 3.5e-5 / 4.9e-5, gradient norm 1.6e-3 / 1.5e-3, biases
# 2.0e-2 / 1.9e-2 (layers.1.attn.qkv.bias, layers.1.ln_2.bias), other parameters 4.3e-3 (attn.proj.weight).
HALF_TOL = {"loss": 1.5e-4, "grad_norm": 5e-3, "parameters": 1.5e-2, "biases": 6e-2}
# fp16 autocast, FSDP DP=2 against one process: loss 2.9e-6, gradient norm 9.1e-5, biases 3.0e-3
# (layers.0.mlp.fc.bias), other parameters 7.8e-4 (layers.1.attn.proj.weight)
FP16_TOL = {"loss": 1e-5, "grad_norm": 3e-4, "parameters": 2.5e-3, "biases": 1e-2}


def assert_parameters_near(params: dict, ref_params: dict, tol: dict) -> None:
    """Every final parameter within `tol["biases"]` (bias tensors) or `tol["parameters"]` (the rest), relative."""
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        bound = tol["biases"] if name.endswith(".bias") else tol["parameters"]
        error = rel(value.float(), ref_params[name].float())
        assert error <= bound, f"{name}: {error:.2e} > {bound:.0e}"


def config(arch: str = "gpt", tp: int = 1, micro: int = 8, sp: bool = False, full: bool = True, **train):
    make = llama_config if arch == "llama" else tiny_config
    cfg = make(tp=tp, micro=micro, **train)
    cfg.parallel.sequence_parallel = sp
    cfg.train.data_sharding = "full" if full else "none"
    return cfg


def gathered_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter in the one-process layout: FSDP shards gathered over DP, then TP; padding removed."""
    out = {}
    for name, param in trainer.model.named_parameters():
        value = param.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if hasattr(param, "tensor_parallel_dim"):
            value = torch.cat(trainer.ctx.tp.all_gather(value.contiguous()), dim=param.tensor_parallel_dim)
        out[name] = value[:VOCAB].clone() if name in ("wte.weight", "lm_head.weight") else value.clone()
    return out


def run(ctx: ParallelContext, cfg, steps: int = STEPS, trainer: Trainer | None = None):
    """(curve, parameters, trainer): losses and gradient norms of `steps` steps and the final parameters."""
    trainer = trainer or Trainer(cfg, ctx, synthetic_data())
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]
    return curve, gathered_parameters(trainer), trainer


def state_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of this rank's parameter shards, gradient shards (after a backward) and AdamW state, each
    distinct storage counted once."""
    def total(tensors):
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())

    batch = torch.stack([torch.as_tensor(trainer.train_data[i]) for i in range(2)])
    trainer.loss(trainer.model, batch).backward()
    return {"parameters": total(trainer.params), "gradients": total(p.grad for p in trainer.params),
            "optimizer": total(v for s in trainer.optimizer.state.values() for v in s.values())}


def expected_bytes(trainer: Trainer) -> dict[str, int]:
    """The formula: this stage's (TP shard's) parameters x 4 bytes / DP (the ranks one shard spans) for
    parameters and gradients, x 8 / DP for the two moments, plus AdamW's 4-byte step per parameter; exact when DP
    divides every first dimension (asserted)."""
    d = trainer.fsdp.shard_group.size  # DP, or hybrid sharding's shard size
    shapes = [p.shape for p in trainer.params]
    assert all(s[0] % d == 0 for s in shapes), "the formula is exact only when DP divides every first dimension"
    n = sum(s.numel() for s in shapes)
    return {"parameters": 4 * n // d, "gradients": 4 * n // d, "optimizer": 8 * n // d + 4 * len(shapes)}


# -------------------------------------------------------------------------------------- in workers

def run_layout(tp: int, pp: int, cp: int, ep: int, **kwargs) -> tuple:
    """One case on this rank: (curve, gathered parameters) of `config(tp=tp, **kwargs)` at FSDP DP x TP=`tp`."""
    curve, params, _ = run(layout_context(tp, pp, cp, ep), config(tp=tp, **kwargs))
    return curve, params


def measured_bytes(tp: int) -> dict:
    ctx = ParallelContext.from_process_group(tp)
    trainer = Trainer(config(tp=tp, micro=2), ctx, synthetic_data())
    trainer.train_step()
    return {"measured": state_bytes(trainer), "expected": expected_bytes(trainer),
            "marks_kept": all(hasattr(p, "tensor_parallel_dim") for n, p in trainer.model.named_parameters()
                              if n.endswith("attn.qkv.weight"))}


def validation_loss(ctx: ParallelContext, cfg) -> float:
    """The validation loss after 2 training steps (4 iterations of micro x DP samples of another stream); under
    FSDP every parameter must be a shard again afterwards (a forward without backward leaves the root gathered)."""
    trainer = Trainer(cfg, ctx, synthetic_data(), valid_data=synthetic_data(seed=1))
    trainer.train_step(), trainer.train_step()
    loss = trainer.evaluate()
    if trainer.fsdp is not None:
        gathered = [n for n, p in trainer.model.named_parameters() if not hasattr(p, "to_local")]
        assert not gathered, f"gathered after the evaluation: {gathered}"
    return loss


def fp16_runs() -> dict:
    """FSDP DP=2 in fp16 (dynamic loss scaling from 2^16): the curve and skipped steps of STEPS steps, and one
    step where only DP rank 1 finds an inf in its gradient shard (after the reduce-scatter)."""
    ctx = ParallelContext.from_process_group(1)
    cfg = config(micro=2, precision="fp16", initial_loss_scale=2.0**16)
    trainer = Trainer(cfg, ctx, synthetic_data())
    metrics = [trainer.train_step() for _ in range(STEPS)]
    if ctx.dp_rank == 1:
        reduce = trainer.reduce_gradients

        def reduce_then_overflow():
            reduce()
            trainer.fsdp.shards[0].grad.view(-1)[0] = float("inf")
        trainer.reduce_gradients = reduce_then_overflow
    before = gathered_parameters(trainer)
    step = trainer.train_step()
    return {"curve": [(m["loss"], m["grad_norm"], m["skipped"]) for m in metrics], "parameters": before,
            "overflow step": (step["skipped"], trainer.scaler.scale), "after": gathered_parameters(trainer)}


def collectives_of_a_step(micro: int, reshard_after_forward: bool) -> dict:
    """FSDP DP=2: the all-gathers and reduce-scatters of one step (after a first one), as (calls, elements
    gathered or reduced), counted by `counting_collectives`."""
    ctx = ParallelContext.from_process_group(1)
    trainer = Trainer(config(micro=micro, fsdp_reshard_after_forward=reshard_after_forward), ctx, synthetic_data())
    trainer.train_step()
    with counting_collectives() as counts:
        trainer.train_step()
    layer_elements = sum(p.numel() for p in trainer.model.layers.parameters())
    return {"counts": counts, "elements": trainer.model.num_parameters(), "layer_elements": layer_elements,
            "layers": len(trainer.model.layers), "micro_batches": trainer.accumulation}


def save_at(folder: str, tp: int, steps: int) -> None:
    """FSDP at this world's DP x `tp`: train `steps` steps and save."""
    ctx = ParallelContext.from_process_group(tp)
    _, _, trainer = run(ctx, config(tp=tp, micro=2, sp=tp > 1), steps=steps)
    save_checkpoint(trainer, folder)


def resume_from(folder: str) -> tuple:
    """FSDP DP=2: load a checkpoint saved elsewhere (one process), train the remaining steps."""
    ctx = ParallelContext.from_process_group(1)
    trainer = Trainer(config(micro=2), ctx, synthetic_data())
    load_checkpoint(trainer, folder)
    return run(ctx, None, steps=STEPS - trainer.step, trainer=trainer)[:2]


def bitwise_resume(folder: str) -> dict:
    """FSDP DP=2 with dropout 0.1: SAVED steps, save, the rest; a fresh trainer, both its generators disturbed,
    loads the save and runs the same steps (the checkpoint must restore the dropout streams too)."""
    ctx = ParallelContext.from_process_group(1)
    _, _, trainer = run(ctx, config(micro=2, dropout=0.1), steps=SAVED)
    save_checkpoint(trainer, folder)
    straight = run(ctx, None, steps=STEPS - SAVED, trainer=trainer)[:2]
    ctx.rng = None  # seeded again by the trainer, as in a new process
    fresh = Trainer(config(micro=2, dropout=0.1), ctx, synthetic_data())
    disturb_generators(ctx)
    load_checkpoint(fresh, folder)
    resumed = run(ctx, None, steps=STEPS - SAVED, trainer=fresh)[:2]
    return {"straight": straight, "resumed": resumed}


WORLD2 = {
    "gpt dp2": layout(micro=4),
    "gpt dp2 accumulation": layout(micro=2),
    "gpt dp2 keep gathered": layout(micro=2, fsdp_reshard_after_forward=False),
    "llama dp2 accumulation": layout(arch="llama", micro=2),
    "gpt dp2 bf16 params": layout(micro=2, precision="bf16", param_dtype="half"),
}
"""FSDP DP=2, each case against one process's run of its model (the name's first word): within 1e-5, the bf16
parameters within HALF_TOL of the master-weight run."""
WORLD4 = {
    "gpt dp4": layout(micro=2),
    "gpt dp2 x tp2 sp": layout(tp=2, micro=4, sp=True),
    "gpt dp2 x tp2 sp accumulation full recompute": layout(tp=2, micro=2, sp=True, recompute="full"),
    "llama dp2 x tp2 sp selective recompute": layout(tp=2, arch="llama", micro=4, sp=True, recompute="selective"),
}
"""FSDP DP=4 and DP=2 x TP=2 with SP, each within 1e-5 of one process's run of its model."""


COMPILED_STEPS = 2


def compiled_layout():
    """FSDP DP=2 with compiled layers: the curve, the parameters, how many layers `Module.compile` wrapped and how
    many graphs TorchDynamo built."""
    from torch._dynamo.utils import counters

    curve, params, trainer = run(ParallelContext.from_process_group(1), config(micro=2, compile=True),
                                 steps=COMPILED_STEPS)
    compiled = sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in trainer.model.layers.values())
    return curve, params, (compiled, counters["stats"]["unique_graphs"])


def world2_more(one_process_checkpoint: str, folder: str) -> dict:
    """The world of 2's further checks (not layout cases): state bytes, fp16, validation, collectives, resumes."""
    return {
        "bytes": lambda: measured_bytes(1),
        "fp16": fp16_runs,
        "validation": lambda: validation_loss(ParallelContext.from_process_group(1), config(micro=2, eval_iters=4)),
        "collectives": lambda: {(m, r): collectives_of_a_step(m, r) for m, r in ((4, True), (2, True), (2, False))},
        "resume from one process": lambda: resume_from(one_process_checkpoint),
        "bitwise": lambda: bitwise_resume(folder),
        "compile": compiled_layout,  # without a compiler: a one-line error, which fails the test
    }


def world4_more(folder: str) -> dict:
    """The world of 4's further checks: state bytes at DP=4 and DP=2 x TP=2, and a checkpoint saved at the latter."""
    return {
        "bytes dp4": lambda: measured_bytes(1),
        "bytes dp2 x tp2": lambda: measured_bytes(2),
        "save": lambda: save_at(folder, tp=2, steps=SAVED),
    }


# ------------------------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no FSDP: STEPS-step runs of GPT, Llama and bf16-parameter GPT, and a checkpoint at step SAVED."""
    ctx = ParallelContext.single()
    out = {name: run(ctx, config(full=False, **kwargs))[:2] for name, kwargs in (
        ("gpt", {}), ("llama", {"arch": "llama"}),
        ("gpt bf16 params", {"micro": 4, "precision": "bf16", "param_dtype": "half"}))}
    fp16 = Trainer(config(full=False, micro=4, precision="fp16", initial_loss_scale=2.0**16), ctx, synthetic_data())
    out["fp16"] = [(m["loss"], m["grad_norm"], m["skipped"]) for m in (fp16.train_step() for _ in range(STEPS))]
    out["fp16 parameters"] = gathered_parameters(fp16)
    out["validation"] = validation_loss(ctx, config(full=False, micro=4, eval_iters=4))  # the same 16 samples
    folder = tmp_path_factory.mktemp("one_process")
    _, _, trainer = run(ctx, config(full=False, micro=2), steps=SAVED)
    save_checkpoint(trainer, folder)
    out["checkpoint"] = str(folder)
    return out


@pytest.fixture(scope="module")
def world2(reference, tmp_path_factory):
    return spawn_layouts(2, run_layout, WORLD2, more=world2_more,
                         more_args=(reference["checkpoint"], str(tmp_path_factory.mktemp("bitwise"))))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp_2x2")
    return spawn_layouts(4, run_layout, WORLD4, more=world4_more, more_args=(str(folder),)), str(folder)


@needs(can_compile(torch.device("cpu")), "a C++ compiler (torch.compile on the CPU)")
def test_fsdp_with_compiled_layers_equals_one_process(world2):
    """FSDP DP=2 with every layer compiled: both layers run compiled, and the run is within 1e-5 of one eager
    process."""
    reference = run(ParallelContext.single(), config(micro=2, full=False), steps=COMPILED_STEPS)[:2]
    for curve, params, (compiled, graphs) in check_result(world2, "compile"):  # every rank's gathered copy
        assert compiled == 2 and graphs > 0
        assert_same_run((curve, params), reference, steps=COMPILED_STEPS)


@pytest.mark.parametrize("name", [name for name in WORLD2 if "bf16" not in name])
def test_fsdp_dp2_equals_one_process(world2, reference, name):
    """FSDP DP=2 (with 2 micro-batches per rank, with parameters kept gathered after the forward):
    loss and gradient norm of every step and the final parameters within 1e-5 of one process."""
    for rank in check_result(world2, name):  # every rank's gathered copy
        assert_same_run(rank, reference[name.split()[0]], steps=STEPS)


@pytest.mark.parametrize("name", list(WORLD4))
def test_fsdp_dp4_and_dp2_tp2_equal_one_process(world4, reference, name):
    """FSDP DP=4, and FSDP DP=2 x TP=2 with sequence parallelism (with accumulation and recomputation):
    within 1e-5 of one process at every step and in the final parameters."""
    for rank in check_result(world4[0], name):  # every rank's gathered copy
        assert_same_run(rank, reference[name.split()[0]], steps=STEPS)


def test_fsdp_validation_loss_equals_one_process(world2, reference):
    """Validation under FSDP DP=2 (sharded parameters gathered for the no-grad forward) after 2 steps:
    within 1e-5 of one process."""
    for value in check_result(world2, "validation"):
        assert abs(value - reference["validation"]) <= 1e-5 * reference["validation"]


def test_fsdp_bf16_parameters_match_master_weight_bf16(world2, reference):
    """bf16 parameters: FSDP DP=2 (fp32 shards, bf16 gathered copies, fp32 reduction) against one process
    with the master-weight optimizer's bf16 parameters, both accumulating 2 micro-batches' gradients in
    fp32: loss, gradient norm and final parameters within HALF_TOL (relative, measured x 3)."""
    ref_curve, ref_params = reference["gpt bf16 params"]
    for curve, params in check_result(world2, "gpt dp2 bf16 params"):
        for (loss, norm), (ref_loss, ref_norm) in zip(curve, ref_curve):
            assert abs(loss - ref_loss) <= HALF_TOL["loss"] * ref_loss
            assert abs(norm - ref_norm) <= HALF_TOL["grad_norm"] * ref_norm
        assert_parameters_near(params, ref_params, HALF_TOL)


def test_fsdp_fp16_matches_one_process_and_skips_an_overflow_on_any_rank(world2, reference):
    """fp16 (autocast, dynamic loss scaling) under FSDP DP=2: the same skipped steps as one process and
    losses, gradient norms and final parameters within FP16_TOL; an inf in DP rank 1's gradient shard only
    makes both ranks skip the step (the overflow check spans DP) and leaves the parameters unchanged."""
    runs = check_result(world2, "fp16")
    curve, ref_curve = runs[0]["curve"], reference["fp16"]
    assert [s for _, _, s in curve] == [s for _, _, s in ref_curve]
    for (loss, norm, skipped), (ref_loss, ref_norm, _) in zip(curve, ref_curve):
        assert abs(loss - ref_loss) <= FP16_TOL["loss"] * ref_loss
        assert skipped or abs(norm - ref_norm) <= FP16_TOL["grad_norm"] * ref_norm
    assert_parameters_near(runs[0]["parameters"], reference["fp16 parameters"], FP16_TOL)
    for run_ in runs:
        skipped, scale = run_["overflow step"]
        assert skipped and scale == runs[0]["overflow step"][1]
        assert all(torch.equal(run_["after"][n], run_["parameters"][n]) for n in run_["parameters"])


def test_fsdp_state_bytes_equal_parameters_times_bytes_over_dp(world2, world4):
    """Every rank's parameter, gradient and AdamW bytes equal the stage's parameters x (4, 4, 8) / DP
    (+ AdamW's step scalars), at DP=2, DP=4 and DP=2 x TP=2; shardlm's marks survive on the parameters."""
    for results, name in ((world2, "bytes"), (world4[0], "bytes dp4"), (world4[0], "bytes dp2 x tp2")):
        for rank, value in enumerate(check_result(results, name)):
            assert value["measured"] == value["expected"], (name, rank, value)
            assert value["marks_kept"]


def test_fsdp_step_gathers_twice_and_reduce_scatters_once_without_regathering_per_micro_batch(world2):
    """One FSDP DP=2 step: the root (embedding, final norm, output layer) and every layer all-gathered for
    the first forward, each layer again for each micro-batch's backward (resharded after its forward),
    never for a later micro-batch's forward (kept gathered after a non-last backward); one reduce-scatter
    of every unit, after the last micro-batch. Kept gathered after the forward: one all-gather per unit.
    Elements: the model's parameters (DP divides every first dimension here, so no padding)."""
    for (micro, reshard), value in check_result(world2, "collectives")[0].items():
        layers, n, per_layers, m = value["layers"], value["elements"], value["layer_elements"], value["micro_batches"]
        assert m == 8 // (2 * micro)
        backward_gathers = m if reshard else 0
        gathers = [1 + layers + backward_gathers * layers, n + backward_gathers * per_layers]
        assert value["counts"]["all_gather"] == gathers, (micro, reshard)
        assert value["counts"]["reduce_scatter"] == [1 + layers, n]


def test_fsdp_checkpoint_loads_at_one_process_and_back(world2, world4, reference):
    """FSDP DP=2 x TP=2 (with SP) saved at step SAVED and resumed by one process, and one process's step-SAVED
    checkpoint resumed by FSDP DP=2: the remaining steps and the final parameters within 1e-5 of one process."""
    check_result(world4[0], "save")
    ctx = ParallelContext.single()
    trainer = Trainer(config(full=False, micro=2), ctx, synthetic_data())
    load_checkpoint(trainer, world4[1])
    curve, params = run(ctx, None, steps=STEPS - SAVED, trainer=trainer)[:2]
    ref_curve, ref_params = reference["gpt"]
    assert_same_run((curve, params), (ref_curve[SAVED:], ref_params), steps=STEPS - SAVED)
    for rank in check_result(world2, "resume from one process"):
        assert_same_run(rank, (ref_curve[SAVED:], ref_params), steps=STEPS - SAVED)


def test_fsdp_resume_on_the_same_layout_is_bitwise(world2):
    """FSDP DP=2 with dropout 0.1: the steps after loading a step-SAVED checkpoint into a trainer whose generators
    moved equal the uninterrupted ones (losses, gradient norms, every parameter on every rank), bitwise."""
    for value in check_result(world2, "bitwise"):
        (curve, params), (ref_curve, ref_params) = value["resumed"], value["straight"]
        assert curve == ref_curve
        assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)


@pytest.mark.parametrize("change, world, key", [
    ({"train.distributed_optimizer": True}, 4, "set train.distributed_optimizer=false"),
    ({"model.arch": "bert"}, 4, 'supports model.arch="gpt" and "llama"; use "optimizer" for "bert"'),
    ({}, 1, "needs a data-parallel size above 1"),
], ids=["distributed-optimizer", "bert", "dp-x-cp-1"])
def test_fsdp_unsupported_combinations_are_one_line_errors(change, world, key):
    """data_sharding="full" with the distributed optimizer, with BERT, or on one data-parallel rank (DP x CP =
    1): a one-line UserError naming it, from `validate` (before any process starts). Pipeline stages are
    supported (tests/test_fsdp_pipeline.py)."""
    cfg = config(micro=1)
    for dotted, value in change.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(UserError) as err:
        validate(cfg, world_size=world, check_paths=False)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_data_sharding_optimizer_is_the_distributed_optimizer():
    """train.data_sharding="optimizer" sets train.distributed_optimizer, and the old key sets the new one."""
    from shardlm.config import from_dict

    assert from_dict({"train": {"data_sharding": "optimizer"}}).train.distributed_optimizer
    assert from_dict({"train": {"distributed_optimizer": True}}).train.data_sharding == "optimizer"
    with pytest.raises(UserError, match="data_sharding"):
        validate(from_dict({"train": {"data_sharding": "zero3"}, "data": {"text_file": "x"}}), 1, check_paths=False)

