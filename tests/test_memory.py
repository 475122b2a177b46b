"""Memory at scale keeps the single-process answer: sequence parallelism, selective and full
recomputation, half-precision parameters with fp32 master weights, and the distributed optimizer.

The tiny GPT of `test_training` (2 layers, 10 steps, fp32, dropout 0 where layouts are compared) trains
at 1x1 in this process and at each layout in one world of 2 and one world of 4 processes; every rank's
losses and gradient norms at every step and its copy of the final parameters (its data-parallel replica,
TP shards gathered) must agree within 1e-5. Half-precision (bf16) parameters are compared with fp32 at a
bf16 tolerance and, with the distributed optimizer, against one process at measured bf16 tolerances (their
master weights against a hand-written AdamW, and the settings' one-line errors: `test_memory_settings.py`).
With dropout on, selective and full recomputation run the forward again in the backward (counted) and give the
run without recomputation, bitwise. State bytes of
every rank are checked against the formula to the byte, and an fp16 overflow on one DP rank of the
distributed optimizer skips the step on all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_pipeline import whole_model
from test_training import LAYERS, assert_same_run, full_parameters, synthetic_data, tiny_config, train_run

from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from agreement import assert_trained_parameters, rel
from layouts import count_forwards, layout, layout_context, spawn_layouts
from multiproc import check_result


def config(tp: int = 1, micro: int = 8, pp: int = 1, sp: bool = False, recompute: str = "none",
           zero: bool = False, dropout: float = 0.0, **train):
    cfg = tiny_config(tp=tp, micro=micro, dropout=dropout, recompute=recompute, distributed_optimizer=zero, **train)
    cfg.parallel.sequence_parallel, cfg.parallel.pipeline = sp, pp
    return cfg


def run_layout(tp: int, pp: int, cp: int, ep: int, **kwargs) -> tuple:
    """One case on this rank: its curve and its copy of the parameters (its data-parallel replica, TP shards
    gathered; under PP every stage's, gathered with each copy compared bitwise)."""
    ctx = layout_context(tp, pp, cp, ep)
    curve, params, trainer = train_run(ctx, config(tp=tp, pp=pp, **kwargs))
    return curve, whole_model(ctx, trainer) if pp > 1 else params


def sp_communication() -> dict:
    """TP=2 with sequence parallelism: the collectives of one forward and of one whole train step."""
    ctx = ParallelContext.from_process_group(2)
    trainer = Trainer(config(tp=2, micro=4, sp=True), ctx, synthetic_data())
    batch = torch.from_numpy(__import__("numpy").stack([trainer.train_data[i] for i in range(4)]))
    ctx.comm.reset()
    loss = trainer.model(batch[:, :-1], batch[:, 1:]).mean()
    forward = ctx.comm.snapshot()
    loss.backward()
    total = ctx.comm.snapshot()
    trainer.optimizer.zero_grad()
    ctx.comm.reset()
    trainer.train_step()
    return {"forward": forward, "total": total, "step": ctx.comm.snapshot()}


RECOMPUTE_STEPS = 4


def recompute_runs() -> dict:
    """TP=2 with sequence parallelism and dropout 0.2, the same seed, in each recompute mode: the loss
    and gradient-norm curve, the final parameters and the forward calls of layers and attention cores."""
    ctx = ParallelContext.from_process_group(2)
    out = {}
    for mode in ("none", "selective", "full"):
        ctx.rng = None
        trainer = Trainer(config(tp=2, micro=4, sp=True, recompute=mode, dropout=0.2), ctx, synthetic_data())
        counts = count_forwards(trainer.model)
        curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(RECOMPUTE_STEPS))]
        out[mode] = {"curve": curve, "params": full_parameters(trainer), "counts": dict(counts)}
    return out


def state_bytes(trainer: Trainer) -> int:
    """Bytes of every distinct storage behind parameters, gradients (the fp32 `main_grad` buffers, or plain
    AdamW's `.grad`), master weights and optimizer state of this rank (each storage counted once)."""
    tensors = [*trainer.params, *(getattr(p, "main_grad", p.grad) for p in trainer.params),
               *getattr(trainer.optimizer, "segments", []),
               *(v for state in trainer.optimizer.state.values() for v in state.values())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def expected_state_bytes(sizes: list[int], d: int, r: int, half: bool, zero: bool) -> int:
    """The formula: parameters (2 or 4 bytes) and fp32 gradients over all N elements padded to a
    multiple of d; fp32 master weights (half only) of this rank's N/d range; AdamW moments (8 bytes) of
    the real elements in the range and a 4-byte step per parameter segment in it."""
    d = d if zero else 1
    r = r if zero else 0
    n = sum(sizes)
    padded = -(-n // d) * d
    lo, hi = r * padded // d, (r + 1) * padded // d
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    segments = sum(1 for a, size in zip(starts, sizes) if max(a, lo) < min(a + size, hi))
    return (2 if half else 4) * padded + 4 * padded + (4 * padded // d if half else 0) + \
        8 * (min(hi, n) - lo) + 4 * segments


def measured_state(tp: int, half: bool, zero: bool) -> tuple[int, int]:
    """(measured, expected) state bytes of this rank, measured at the end of the optimizer's first step (plain
    AdamW frees its gradients after the step; the master-weight optimizer keeps its fp32 buffers)."""
    ctx = ParallelContext.from_process_group(tp) if dist.is_initialized() else ParallelContext.single()
    precision = "bf16" if half else "fp32"
    trainer = Trainer(config(tp=tp, micro=2, zero=zero, precision=precision, param_dtype="half" if half else "fp32"),
                      ctx, synthetic_data())
    measured, step = [], trainer.optimizer.step

    def measuring_step():
        step()
        measured.append(state_bytes(trainer))
    trainer.optimizer.step = measuring_step
    trainer.train_step()
    sizes = [p.numel() for p in trainer.params]
    return measured[0], expected_state_bytes(sizes, ctx.dp_size, ctx.dp_rank, half, zero)


def memory_table(tp: int = 1) -> dict:
    """(measured, expected) state bytes for each (half parameters, distributed optimizer) setting."""
    return {(half, zero): measured_state(tp, half, zero) for half in (False, True) for zero in (False, True)}


def fp16_overflow_on_dp_rank_1() -> dict:
    """fp16 parameters with the distributed optimizer over DP=2: one clean step, then a step where only DP
    rank 1 finds an inf in its range of the reduced gradients. Whether that step was skipped, whether this
    rank's parameters are unchanged, the loss scale after it, and whether the next step was skipped."""
    ctx = ParallelContext.from_process_group(1)
    ctx.rng = None
    trainer = Trainer(config(micro=4, zero=True, precision="fp16", param_dtype="half", initial_loss_scale=1024.0),
                      ctx, synthetic_data())
    trainer.train_step()
    if ctx.dp_rank == 1:
        reduce = trainer.reduce_gradients

        def reduce_then_overflow():
            reduce()
            trainer.update_params[0].grad.view(-1)[0] = float("inf")
        trainer.reduce_gradients = reduce_then_overflow
    before = full_parameters(trainer)
    skipped = trainer.train_step()["skipped"]
    unchanged = all(torch.equal(value, before[name]) for name, value in full_parameters(trainer).items())
    scale = trainer.scaler.scale
    if ctx.dp_rank == 1:
        trainer.reduce_gradients = reduce
    return {"skipped": skipped, "unchanged": unchanged, "scale": scale, "next skipped": trainer.train_step()["skipped"]}


def zero_resume(tmp: str, tp: int, sp: bool) -> dict:
    """5 steps, save, a fresh trainer loads and runs 5 more (exact resume on the same layout); also saves
    the 10-step result for loading at another layout."""
    from shardlm.checkpoint import load_checkpoint, save_checkpoint

    ctx = ParallelContext.from_process_group(tp)
    kwargs = {"tp": tp, "micro": 2, "sp": sp, "zero": True}
    first, _, trainer = train_run(ctx, config(**kwargs), steps=5)
    path = save_checkpoint(trainer, f"{tmp}/zero-tp{tp}")
    ctx.rng = None
    resumed = Trainer(config(**kwargs), ctx, synthetic_data())
    load_checkpoint(resumed, path)
    second = [(m["loss"], m["grad_norm"]) for m in (resumed.train_step() for _ in range(5))]
    return {"curve": first + second, "path": str(path)}


def load_and_finish(tmp: str, source: str, tp: int, sp: bool, zero: bool) -> tuple[list, dict]:
    """Load a 5-step checkpoint saved at another layout and train the remaining 5 steps: their curve and
    the final parameters (this rank's replica, TP shards gathered)."""
    from shardlm.checkpoint import load_checkpoint

    ctx = ParallelContext.from_process_group(tp) if dist.is_initialized() else ParallelContext.single()
    trainer = Trainer(config(tp=tp, micro=2, sp=sp, zero=zero), ctx, synthetic_data())
    load_checkpoint(trainer, source)
    return [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(5))], full_parameters(trainer)


WORLD2 = {
    "sp tp2": layout(tp=2, sp=True),
    "sp tp2 accum": layout(tp=2, sp=True, micro=2),
    "sp tp2 selective": layout(tp=2, sp=True, micro=4, recompute="selective"),
    "sp tp2 full": layout(tp=2, sp=True, micro=4, recompute="full"),
    "zero dp2": layout(zero=True, micro=4),
    "zero dp2 accum": layout(zero=True, micro=2),
}
"""The layouts of the world of 2, each within 1e-5 of one process (8 samples a micro-batch unless named)."""
WORLD4 = {
    "sp tp4": layout(tp=4, sp=True),
    "sp tp2 dp2": layout(tp=2, sp=True, micro=4),
    "sp tp2 dp2 accum": layout(tp=2, sp=True, micro=2),
    "sp tp2 pp2": layout(tp=2, pp=2, sp=True, micro=2),
    "zero dp4": layout(zero=True, micro=2),
    "zero tp2 dp2": layout(tp=2, zero=True, micro=4),
    "sp zero tp2 dp2 accum": layout(tp=2, sp=True, zero=True, micro=2),
    "zero pp2 dp2": layout(pp=2, zero=True, micro=2),
}
"""The layouts of the world of 4, each within 1e-5 of one process."""


def half_zero_dp2() -> tuple:
    """bf16 parameters with the distributed optimizer over DP=2: (curve, parameters)."""
    ctx = ParallelContext.from_process_group(1)
    ctx.rng = None
    return train_run(ctx, config(micro=4, zero=True, precision="bf16", param_dtype="half"))[:2]


def world2_more(tmp: str) -> dict:
    """The world of 2's further checks, not compared with one process at 1e-5: bf16 with ZeRO, traffic,
    recomputation, state bytes, a bitwise resume and an fp16 overflow."""
    return {"half zero dp2": half_zero_dp2, "comm": sp_communication, "recompute": recompute_runs,
            "memory": memory_table, "resume": lambda: zero_resume(tmp, 1, False),
            "fp16 overflow": fp16_overflow_on_dp_rank_1}


def world4_more(tmp: str) -> dict:
    """The world of 4's further checks: state bytes and the sharded optimizer state saved and loaded."""
    return {"memory": memory_table, "resume": lambda: zero_resume(tmp, 2, True),  # SP + ZeRO at TP=2 x DP=2
            "from single": lambda: load_and_finish(tmp, f"{tmp}/single", 2, True, True)}


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {micro: train_run(ctx, tiny_config(micro=micro))[:2] for micro in (8, 4, 2)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Holds "single": a 5-step checkpoint of one process, for loading at TP=2 x DP=2 with SP + ZeRO."""
    from shardlm.checkpoint import save_checkpoint

    tmp = tmp_path_factory.mktemp("memory")
    ctx = ParallelContext.single()
    _, _, trainer = train_run(ctx, config(micro=2), steps=5)
    save_checkpoint(trainer, tmp / "single")
    return tmp


@pytest.fixture(scope="module")
def world2(workdir):
    """Every rank's results of `WORLD2` and `world2_more`."""
    return spawn_layouts(2, run_layout, WORLD2, more=world2_more, more_args=(str(workdir),))


@pytest.fixture(scope="module")
def world4(workdir):
    """Every rank's results of `WORLD4` and `world4_more`."""
    return spawn_layouts(4, run_layout, WORLD4, more=world4_more, more_args=(str(workdir),))


@pytest.fixture(scope="module")
def half_single():
    """bf16 parameters with fp32 master weights in one process: its curve and trainer."""
    ctx = ParallelContext.single()
    curve, params, trainer = train_run(ctx, config(micro=4, precision="bf16", param_dtype="half"))
    return curve, params, trainer


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in WORLD2 if name.startswith("sp")])
def test_sequence_parallel_tp2_matches_single_process(world2, reference, name):
    for value in check_result(world2, name):
        assert_same_run(value, reference[8])


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in WORLD4 if name.startswith("sp tp")])
def test_sequence_parallel_world4_matches_single_process(world4, reference, name):
    for value in check_result(world4, name):
        assert_same_run(value, reference[8])


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in WORLD2 if name.startswith("zero")])
def test_distributed_optimizer_dp2_matches_single_process(world2, reference, name):
    for value in check_result(world2, name):
        assert_same_run(value, reference[8])


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in WORLD4 if not name.startswith("sp tp")])
def test_distributed_optimizer_world4_matches_single_process(world4, reference, name):
    for value in check_result(world4, name):
        assert_same_run(value, reference[8])


@pytest.mark.slow
def test_distributed_optimizer_resumes_bitwise_on_the_same_layout(world2, world4, reference):
    """5 steps, save, reload, 5 more: on every rank the same curve as 10 uninterrupted steps, to the bit
    (DP=2), and within 1e-5 of one process (its own curve, SP + ZeRO at TP=2 x DP=2, too)."""
    for resume, run in zip(check_result(world2, "resume"), check_result(world2, "zero dp2 accum")):
        assert resume["curve"] == run[0]
    for resume in check_result(world4, "resume"):
        assert len(resume["curve"]) == len(reference[2][0])
        for (loss, norm), (ref_loss, ref_norm) in zip(resume["curve"], reference[2][0]):
            assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.slow
def test_sharded_optimizer_state_moves_between_layouts(world4, workdir, reference):
    """SP + ZeRO at TP=2 x DP=2 -> one process, and one process -> SP + ZeRO at TP=2 x DP=2 (every rank):
    the remaining 5 steps continue the single-process curve within 1e-5 and end at its final parameters."""
    ref_curve, ref_params = reference[2]
    to_single = load_and_finish(str(workdir), check_result(world4, "resume")[0]["path"], 1, False, False)
    for curve, params in (to_single, *check_result(world4, "from single")):
        assert len(curve) == 5
        for (loss, norm), (ref_loss, ref_norm) in zip(curve, ref_curve[5:]):
            assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
        assert_trained_parameters(params, ref_params, len(ref_curve), 1e-5)


@pytest.mark.slow
def test_state_bytes_equal_the_formula_to_the_byte(world2, world4):
    """On every rank: fp32 parameters with AdamW 4 + 4 + 8 bytes per parameter (16), bf16 parameters
    2 + fp32 gradients 4 + master 4 + moments 8 (18), and with the distributed optimizer 2 + 4 + 12 / d
    (fp32 parameters: 4 + 4 + 8 / d), for d = 1, 2, 4."""
    single = memory_table()
    tables = {1: [single], 2: check_result(world2, "memory"), 4: check_result(world4, "memory")}
    for d, per_rank in tables.items():
        for rank, table in enumerate(per_rank):
            assert table.keys() == {(False, False), (False, True), (True, False), (True, True)}
            for (half, zero), (measured, expected) in table.items():
                assert measured == expected, (d, rank, half, zero)
    half_zero = {d: max(t[(True, True)][0] for t in per_rank) for d, per_rank in tables.items()}
    assert half_zero[1] > half_zero[2] > half_zero[4]


def test_half_parameters_track_fp32_at_bf16_tolerance(half_single, reference):
    """bf16 parameters, fp32 master weights and gradients: every step's loss within 2% of fp32 (bf16 has
    8 bits of mantissa, about 0.4% per rounding), and the parameters are bf16."""
    curve, _, trainer = half_single
    for (loss, _), (ref_loss, _) in zip(curve, reference[4][0]):
        assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert all(p.dtype == torch.bfloat16 for p in trainer.params)
    assert all(seg.dtype == torch.float32 for seg in trainer.optimizer.segments)


@pytest.mark.slow
def test_half_parameters_with_distributed_optimizer_track_one_process(world2, half_single):
    """bf16 parameters on both sides, the distributed optimizer over DP=2 against one process: losses within
    1e-4, gradient norms within 5e-3 and the final parameters within 1.5e-2 (relative L2 per tensor) over
    10 steps. Why not tighter: the fp32 gradients differ in their last bits (the reduce-scatter sums the
    two micro-batches in another order), so a master weight near a bf16 rounding boundary eventually
    rounds the other way; one such flip moves a parameter by 2^-8 = 0.4% and the runs then drift at bf16's
    scale. Measured: bitwise equal losses for 4 steps, then at most 2.4e-5 (losses), 1.3e-3 (norms) and
    5.4e-3 (parameters); the tolerances are about 3x that."""
    ref_curve, ref_params = half_single[0], half_single[1]
    for curve, params in check_result(world2, "half zero dp2"):
        assert len(curve) == len(ref_curve)
        for (loss, norm), (ref_loss, ref_norm) in zip(curve, ref_curve):
            assert loss == pytest.approx(ref_loss, rel=1e-4)
            assert norm == pytest.approx(ref_norm, rel=5e-3)
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            assert value.dtype == torch.bfloat16, name
            assert rel(value.float(), ref_params[name].float()) < 1.5e-2, name


@pytest.mark.slow
def test_fp16_overflow_on_one_dp_rank_skips_the_step_everywhere(world2):
    """fp16 parameters, the distributed optimizer over DP=2: an inf in DP rank 1's range of the gradients
    only makes both ranks skip the step (the overflow check spans DP, since each rank unscales only its
    range) with their parameters unchanged and the same loss scale; the next step trains."""
    results = check_result(world2, "fp16 overflow")
    for result in results:
        assert result["skipped"] and result["unchanged"] and not result["next skipped"]
    assert results[0]["scale"] == results[1]["scale"]


@pytest.mark.slow
def test_recomputation_restores_dropout_masks_bitwise(world2):
    """Dropout 0.2 (embedding, attention, residuals) at TP=2 with sequence parallelism: selective and full
    recomputation give the curve (losses and gradient norms) and final parameters of no recomputation, to
    the bit, which holds only when the recomputed dropout masks equal the original ones (every rank)."""
    for runs in check_result(world2, "recompute"):
        assert_recomputation_is_bitwise(runs)


def assert_recomputation_is_bitwise(runs: dict) -> None:
    """`runs[mode]` = {"curve", "params"} for mode none, selective, full: the curves and every final parameter
    of selective and full recomputation equal those of none, to the bit."""
    for mode in ("selective", "full"):
        assert runs[mode]["curve"] == runs["none"]["curve"], mode
        for name, value in runs["none"]["params"].items():
            assert torch.equal(runs[mode]["params"][name], value), (mode, name)


@pytest.mark.slow
def test_recomputation_runs_the_forward_again_in_the_backward(world2):
    """Forward calls over 4 steps of 2 micro-batches through LAYERS layers: without recomputation each
    layer and attention core runs once per micro-batch; selective recomputation runs every core twice
    (forward, then backward), full recomputation every layer (and so its core) twice."""
    once = RECOMPUTE_STEPS * 2 * LAYERS
    per_rank = check_result(world2, "recompute")
    counts = {mode: run["counts"] for mode, run in per_rank[0].items()}
    assert all({mode: run["counts"] for mode, run in runs.items()} == counts for runs in per_rank)
    assert counts == {"none": {"layer": once, "core": once}, "selective": {"layer": once, "core": 2 * once},
                      "full": {"layer": 2 * once, "core": 2 * once}}


@pytest.mark.slow
def test_sequence_parallel_communication_volume_equals_tensor_parallel(world2):
    """Per layer forward: 2 all-gathers of the (b, s/t, h) chunks into the column layers and 2
    reduce-scatters of (b, s, h) partial sums out of the row layers, where TP has 2 all-reduces of
    (b, s, h): the same bytes on the wire (an all-reduce is a reduce-scatter plus an all-gather).
    The embedding reduce-scatters once, the output layer all-gathers once (and reduce-scatters in the
    backward); the cross-entropy keeps its MAX and SUM. Backward mirrors the forward. A step adds one
    all-reduce of the sequence-parallel parameters' gradients and the gradient-norm scalar."""
    b, s, h, t = 4, 16, 32, 2
    full, chunk = b * s * h * 4, b * s * h * 4 // t
    comm, other = check_result(world2, "comm")
    assert other == comm
    forward, total = comm["forward"], comm["total"]
    assert forward["all_gather/tp"] == {"calls": 2 * LAYERS + 1, "bytes": (2 * LAYERS + 1) * chunk,
                                        "elements": (2 * LAYERS + 1) * chunk // 4}
    assert forward["reduce_scatter/tp"] == {"calls": 2 * LAYERS + 1, "bytes": (2 * LAYERS + 1) * full,
                                            "elements": (2 * LAYERS + 1) * full // 4}
    assert forward["all_reduce/tp"]["calls"] == 1 and forward["all_reduce_max/tp"]["calls"] == 1  # cross-entropy
    backward_gathers = total["all_gather/tp"]["calls"] - forward["all_gather/tp"]["calls"]
    backward_scatters = total["reduce_scatter/tp"]["calls"] - forward["reduce_scatter/tp"]["calls"]
    assert backward_gathers == 2 * LAYERS + 1 and backward_scatters == 2 * LAYERS + 1
    step = comm["step"]
    # a step of 8 sequences is 2 micro-batches of 4: 2 cross-entropy SUMs, the sequence-parallel grads, the norm
    assert step["all_reduce/tp"]["calls"] == 2 + 1 + 1
    # per layer and direction, all-gathered + reduce-scattered bytes equal TP's two all-reduces
    layer_bytes = (forward["all_gather/tp"]["bytes"] + forward["reduce_scatter/tp"]["bytes"]) / (2 * LAYERS + 1)
    assert layer_bytes == full + chunk
