"""`train.compile`: training with every transformer layer under `torch.compile` gives the eager
run's loss curve, gradient norms and final parameters (fp32, within TOL = 1e-5) at DP=2 with
whole-layer recompute and at TP=2 with sequence parallelism and selective recompute (the layers' TP
collectives, graph breaks by design, under compile; plain TP=2 compiles the same layer code); TorchDynamo
compiled graphs in the compiled runs (none in the eager ones) and every layer runs through
`torch.compile`. Without a C++ compiler on the CPU it stops with a one-line error before any work
(simulated on every machine). One world of 2 gloo processes runs every layout."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from test_training import LAYERS, TOL, synthetic_data, tiny_config, train_run
from torch._dynamo.utils import counters

from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.parallelize import can_compile
from shardlm.training.trainer import Trainer

from agreement import trained_rel
from multiproc import check_result, needs, run_checks, run_workers

needs_cpp = needs(can_compile(torch.device("cpu")), "a C++ compiler (torch.compile on the CPU)")

LAYOUTS = {  # name: (tensor-parallel size, extra config)
    "dp2_full_recompute": (1, {"recompute": "full"}),
    "tp2_sp_selective": (2, {"recompute": "selective", "sequence_parallel": True}),
}
STEPS = 4


def eager_and_compiled(tp: int, extra: dict) -> dict:
    ctx = ParallelContext.from_process_group(tp)
    sequence_parallel = extra.pop("sequence_parallel", False)
    runs, graphs = {}, {}
    for compiled in (False, True):
        config = tiny_config(tp=tp, micro=4, compile=compiled, **extra)
        config.parallel.sequence_parallel = sequence_parallel
        torch._dynamo.reset()  # compile afresh: a graph cached by an earlier layout would not be counted
        counters.clear()
        curve, params, trainer = train_run(ctx, config, steps=STEPS)
        runs[compiled] = (curve, params)
        # frames TorchDynamo turned into graphs during the run, and the layers that `Module.compile` wrapped
        graphs[compiled] = {"graphs": counters["stats"]["unique_graphs"], "frames_ok": counters["frames"]["ok"],
                            "ops": counters["stats"]["calls_captured"],
                            "compiled_layers": sum(getattr(layer, "_compiled_call_impl", None) is not None
                                                   for layer in trainer.model.layers.values())}
    (eager_curve, eager_params), (curve, params) = runs[False], runs[True]
    worst = max(trained_rel(params[name], eager_params[name], STEPS) for name in eager_params)
    return {"eager": eager_curve, "compiled": curve, "graphs": graphs, "params": worst, "rank": dist.get_rank()}


def worker():
    return run_checks({name: (lambda tp=tp, extra=extra: eager_and_compiled(tp, dict(extra)))
                       for name, (tp, extra) in LAYOUTS.items()})


@pytest.fixture(scope="module")
def results():
    return run_workers(2, worker, timeout=600)


@needs_cpp
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layers_train_like_eager(results, layout):
    for result in check_result(results, layout):
        assert len(result["compiled"]) == len(result["eager"]) == STEPS
        for (loss, norm), (loss_eager, norm_eager) in zip(result["compiled"], result["eager"]):
            assert abs(loss - loss_eager) <= TOL * abs(loss_eager), (result["compiled"], result["eager"])
            assert abs(norm - norm_eager) <= TOL * abs(norm_eager), (result["compiled"], result["eager"])
        assert result["params"] < TOL, result["params"]


@needs_cpp
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layers_really_run_compiled(results, layout):
    """The compiled run wraps each of the LAYERS layers with `torch.compile` and TorchDynamo compiles at
    least one graph of operators without failing a frame (the layers share one graph: parameters are
    graph inputs); the eager run compiles nothing."""
    for result in check_result(results, layout):
        eager, compiled = result["graphs"][False], result["graphs"][True]
        assert eager == {"graphs": 0, "frames_ok": 0, "ops": 0, "compiled_layers": 0}, eager
        assert compiled["compiled_layers"] == LAYERS, compiled
        assert compiled["graphs"] >= 1 and compiled["frames_ok"] >= 1 and compiled["ops"] > 0, compiled


def test_compile_without_a_cpp_compiler_is_a_one_line_error(monkeypatch):
    """A machine without a C++ compiler, simulated on every machine: `shutil.which` finds none."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not can_compile(torch.device("cpu"))
    with pytest.raises(UserError, match="needs a C\\+\\+ compiler"):
        Trainer(tiny_config(compile=True), ParallelContext.single(), synthetic_data())
