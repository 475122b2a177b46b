"""`train.compile`: training with every transformer layer under `torch.compile` gives the eager
run's loss curve, gradient norms and final parameters (fp32, within TOL) at TP=2, at DP=2 with
whole-layer recompute, and at TP=2 with sequence parallelism and selective recompute. Without a C++
compiler on the CPU it stops with a one-line error before any work. One world of 2 gloo processes
runs every layout."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from test_training import TOL, rel, synthetic_data, tiny_config, train_run

from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer, can_compile

from multiproc import check_result, run_checks, run_workers

pytestmark = pytest.mark.skipif(not can_compile(torch.device("cpu")),
                                reason="torch.compile on the CPU needs a C++ compiler")

LAYOUTS = {  # name: (tensor-parallel size, extra config)
    "tp2": (2, {}),
    "dp2_full_recompute": (1, {"recompute": "full"}),
    "tp2_sp_selective": (2, {"recompute": "selective", "sequence_parallel": True}),
}
STEPS = 4


def eager_and_compiled(tp: int, extra: dict) -> dict:
    ctx = ParallelContext.from_process_group(tp)
    sequence_parallel = extra.pop("sequence_parallel", False)
    runs = {}
    for compiled in (False, True):
        config = tiny_config(tp=tp, micro=4, compile=compiled, **extra)
        config.parallel.sequence_parallel = sequence_parallel
        curve, params, _ = train_run(ctx, config, steps=STEPS)
        runs[compiled] = (curve, params)
    (eager_curve, eager_params), (curve, params) = runs[False], runs[True]
    return {"eager": eager_curve, "compiled": curve,
            "params": max(rel(params[name], eager_params[name]) for name in eager_params), "rank": dist.get_rank()}


def worker():
    return run_checks({name: (lambda tp=tp, extra=extra: eager_and_compiled(tp, dict(extra)))
                       for name, (tp, extra) in LAYOUTS.items()})


@pytest.fixture(scope="module")
def results():
    return run_workers(2, worker, timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layers_train_like_eager(results, layout):
    for result in check_result(results, layout):
        for (loss, norm), (loss_eager, norm_eager) in zip(result["compiled"], result["eager"]):
            assert abs(loss - loss_eager) <= TOL * abs(loss_eager), (result["compiled"], result["eager"])
            assert abs(norm - norm_eager) <= 1e-4 * abs(norm_eager), (result["compiled"], result["eager"])
        assert result["params"] < TOL, result["params"]


def test_compile_without_a_cpp_compiler_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="needs a C\\+\\+ compiler"):
        Trainer(tiny_config(compile=True), ParallelContext.single(), synthetic_data())
