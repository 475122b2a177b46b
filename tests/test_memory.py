"""Memory at scale keeps the single-process answer: sequence parallelism, selective and full
recomputation, half-precision parameters with fp32 master weights, and the distributed optimizer.

The tiny GPT of `test_training` (2 layers, 10 steps, fp32, dropout 0 where layouts are compared) trains
at 1x1 in this process and at each layout in one world of 2 and one world of 4 processes; losses and
gradient norms at every step and the final parameters must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_pipeline import whole_model
from test_training import LAYERS, assert_same_run, synthetic_data, tiny_config, train_run

from shardlm.config import validate
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from multiproc import run_workers


def config(tp: int = 1, micro: int = 8, pp: int = 1, sp: bool = False, recompute: str = "none",
           zero: bool = False, dropout: float = 0.0, **train):
    cfg = tiny_config(tp=tp, micro=micro, dropout=dropout, recompute=recompute, distributed_optimizer=zero, **train)
    cfg.parallel.sequence_parallel, cfg.parallel.pipeline = sp, pp
    return cfg


def layouts(cases: dict) -> dict:
    """Train each named (tp, pp, config kwargs) case on the whole world; rank 0 returns curves and parameters."""
    out = {}
    for name, (tp, pp, kwargs) in cases.items():
        ctx = ParallelContext.from_process_group(tp, pipeline_parallel=pp)
        curve, params, trainer = train_run(ctx, config(tp=tp, pp=pp, **kwargs))
        out[name] = (curve, whole_model(ctx, trainer) if pp > 1 else params)
    return out


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


def recompute_runs() -> dict:
    """TP=2 with sequence parallelism and dropout: each recompute mode gives the same losses, bitwise."""
    ctx = ParallelContext.from_process_group(2)
    out = {}
    for mode in ("none", "selective", "full"):
        ctx.rng = None
        curve, _, _ = train_run(ctx, config(tp=2, micro=4, sp=True, recompute=mode, dropout=0.2), steps=4)
        out[mode] = curve
    return out


def world2_checks() -> dict:
    out = layouts({
        "sp tp2": (2, 1, {"sp": True}),
        "sp tp2 accum": (2, 1, {"sp": True, "micro": 2}),
        "sp tp2 selective": (2, 1, {"sp": True, "micro": 4, "recompute": "selective"}),
        "sp tp2 full": (2, 1, {"sp": True, "micro": 4, "recompute": "full"}),
    })
    out["comm"] = sp_communication()
    out["recompute"] = recompute_runs()
    return out if dist.get_rank() == 0 else None


def world4_checks() -> dict:
    out = layouts({
        "sp tp4": (4, 1, {"sp": True}),
        "sp tp2 dp2": (2, 1, {"sp": True, "micro": 4}),
        "sp tp2 dp2 accum": (2, 1, {"sp": True, "micro": 2}),
        "sp tp2 pp2": (2, 2, {"sp": True, "micro": 2}),
    })
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {micro: train_run(ctx, tiny_config(micro=micro))[:2] for micro in (8, 4, 2)}


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, world2_checks)[0]


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, world4_checks)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp tp2", "sp tp2 accum", "sp tp2 selective", "sp tp2 full"])
def test_sequence_parallel_tp2_matches_single_process(world2, reference, name):
    assert_same_run(world2[name], reference[8])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp tp4", "sp tp2 dp2", "sp tp2 dp2 accum", "sp tp2 pp2"])
def test_sequence_parallel_world4_matches_single_process(world4, reference, name):
    assert_same_run(world4[name], reference[8])


@pytest.mark.slow
def test_recomputation_restores_dropout_masks_bitwise(world2):
    runs = world2["recompute"]
    assert runs["selective"] == runs["none"] and runs["full"] == runs["none"]


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
    comm = world2["comm"]
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


@pytest.mark.parametrize("overrides,message", [
    ({"sp": True}, "needs parallel.tensor > 1"),
    ({"tp": 4, "sp": True, "seq": 18}, "model.seq_length=18 is not divisible by parallel.tensor=4"),
    ({"recompute": "some"}, 'train.recompute="some" must be'),
])
def test_bad_memory_settings_get_one_line_errors(overrides, message):
    seq = overrides.pop("seq", None)
    cfg = config(**overrides)
    cfg.model.seq_length = seq or cfg.model.seq_length
    with pytest.raises(UserError, match=message):
        validate(cfg, 8 if cfg.parallel.tensor == 4 else cfg.parallel.tensor, check_paths=False)


def test_activation_checkpointing_key_means_full_recompute():
    assert tiny_config(checkpointing=True).train.recompute == "full"
