"""The paper's weak-scaling results (Table 1, paper-facts §4) against the time model.

Setting: V100 32GB in DGX-2H servers (16 GPUs, NVSwitch, 8x100 Gb/s InfiniBand), Megatron's fp16
mixed precision, activation checkpointing, sequence 1024, vocabulary 51,200. TP-only runs use batch
8; TP+DP runs a global batch of 512 over 64 data-parallel replicas (batch 8 each). Efficiency is a
run's FLOP/s per GPU over the baseline's (the 1.2B model on one GPU, 39 TFLOP/s), both counted with
the same FLOP formula.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.plan.hardware import GPU_PRESETS, GPUSpec
from shardlm.plan.memory import numeric_format
from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.parameters import parameter_count
from shardlm.plan.timing import PAPER_CALIBRATION, Calibration, Layout, StepTime, step_time

PAPER_GPU: GPUSpec = GPU_PRESETS["v100-dgx2h"]
PAPER_FORMAT = numeric_format("fp16", "megatron")
BASELINE_TFLOPS = 39.0
"""The 1.2B model on one V100 (paper §4)."""
MICRO_BATCH = 8
DATA_PARALLEL = 64


@dataclass(frozen=True)
class ScalingRow:
    """One row of Table 1."""

    model: str
    """Preset name of the row's model."""
    tp: int
    tp_only_efficiency: float
    """Paper, percent (batch 8, `tp` GPUs)."""
    tp_dp_efficiency: float
    """Paper, percent (global batch 512, 64 x `tp` GPUs)."""


TABLE1 = [
    ScalingRow("scaling-1.2b", 1, 100.0, 96.0),
    ScalingRow("scaling-2.5b", 2, 95.0, 83.0),
    ScalingRow("scaling-4.2b", 4, 82.0, 79.0),
    ScalingRow("scaling-8.3b", 8, 77.0, 74.0),
]


def predict_run(model: str, tp: int, dp: int, calibration: Calibration) -> StepTime:
    """Predicted step of one Table 1 run (batch 8 per replica, checkpointing, fp16)."""
    cfg = MODEL_PRESETS[model]
    layout = Layout(tp=tp, dp=dp, micro_batch=MICRO_BATCH, checkpointing=True)
    return step_time(cfg, layout, MICRO_BATCH * dp, PAPER_GPU, PAPER_FORMAT, parameter_count(cfg, tp),
                     calibration)


def efficiency(model: str, tp: int, dp: int, calibration: Calibration) -> float:
    """Weak-scaling efficiency in percent: FLOP/s per GPU over the predicted baseline's."""
    run = predict_run(model, tp, dp, calibration)
    base = predict_run(TABLE1[0].model, 1, 1, calibration)
    return 100.0 * run.tflops_per_gpu(tp * dp) / base.tflops_per_gpu(1)


@dataclass(frozen=True)
class Comparison:
    """Predicted against the paper for one run."""

    model: str
    tp: int
    gpus: int
    paper: float
    predicted: float
    fitted: bool
    """True for the run a calibration constant was fitted on."""

    @property
    def difference(self) -> float:
        return self.predicted - self.paper


def compare_table1(calibration: Calibration = PAPER_CALIBRATION) -> list[Comparison]:
    """Every Table 1 run, TP-only rows first, then TP+DP."""
    out = []
    for row in TABLE1:
        out.append(Comparison(row.model, row.tp, row.tp, row.tp_only_efficiency,
                              efficiency(row.model, row.tp, 1, calibration), fitted=row.tp in (1, 8)))
    for row in TABLE1:
        out.append(Comparison(row.model, row.tp, row.tp * DATA_PARALLEL, row.tp_dp_efficiency,
                              efficiency(row.model, row.tp, DATA_PARALLEL, calibration), fitted=row.tp == 8))
    return out


def _bisect(function, target: float, low: float, high: float, increasing: bool) -> float:
    """The x in [low, high] where the monotone `function(x)` equals `target`."""
    for _ in range(100):
        middle = (low + high) / 2
        above = function(middle) > target
        if above == increasing:
            high = middle
        else:
            low = middle
    return (low + high) / 2


def fit_calibration() -> Calibration:
    """Fit the three constants, one data point each, in order (see `timing.PAPER_CALIBRATION`)."""
    start = Calibration(compute_efficiency=0.3, link_efficiency=1.0, dp_overlap=1.0)
    base = TABLE1[0].model

    def baseline_tflops(eta: float) -> float:
        return predict_run(base, 1, 1, replace(start, compute_efficiency=eta)).tflops_per_gpu(1)

    eta = _bisect(baseline_tflops, BASELINE_TFLOPS, 0.01, 1.0, increasing=True)
    fitted = replace(start, compute_efficiency=eta)
    last = TABLE1[-1]
    link = _bisect(lambda x: efficiency(last.model, last.tp, 1, replace(fitted, link_efficiency=x)),
                   last.tp_only_efficiency, 0.01, 1.0, increasing=True)
    fitted = replace(fitted, link_efficiency=link)
    overlap = _bisect(lambda x: efficiency(last.model, last.tp, DATA_PARALLEL, replace(fitted, dp_overlap=x)),
                      last.tp_dp_efficiency, 0.0, 1.0, increasing=True)
    return replace(fitted, dp_overlap=overlap)
