"""Narayanan et al. 2021 (SC21, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM"), Table 1: weak scaling of GPT from 1.7B to 1T parameters on up to 3,072 A100s,
against the planner's predictions.

Hardware: Selene's DGX A100 80GB servers (8 GPUs on NVLink 3 / NVSwitch, 600 GB/s per GPU; eight 200
Gb/s HDR InfiniBand adapters per server), the `a100-80gb` preset. Software: Megatron-LM at the
paper's commit, fp16 with fp32 master weights (2 + 2 + 12 bytes per parameter), full (uniform)
activation recomputation, the unfused softmax that stores the s x s scores, pipeline transfers with
the scatter/gather optimization, torch DDP (overlapped) without a pipeline and Megatron's local DDP
(after the flush) with one. Each row's TFLOP/s is the paper's own count,
96 B s l h^2 (1 + s / 6h + V / 16 l h), over the step time and the GPUs; peak is 312 TFLOP/s.

Where each number comes from (docs/plan.md repeats this): shapes, TP, PP, GPUs (nodes x 8), the
global batch, micro-batch, layers per virtual stage, sequence 2048, fp16 and recomputation from
Megatron-LM's `examples/sc21/run_table_1.sh` and `CONFIG.sh` (now under
`examples/academic_paper_scripts/sc21/`); TFLOP/s per GPU and % of peak from the paper's Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.models.config import ModelConfig
from shardlm.plan.hardware import GPU_PRESETS, GPUSpec
from shardlm.plan.memory import numeric_format
from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages, schedule_name
from shardlm.plan.timing import PAPER_CALIBRATION, Calibration, Layout, StepTime, step_time

SC21_GPU: GPUSpec = GPU_PRESETS["a100-80gb"]
SC21_FORMAT = numeric_format("fp16", "megatron")
SEQUENCE, VOCAB = 2048, 51200  # as the `sc21-*` presets have them


@dataclass(frozen=True)
class SC21Row:
    """One row of Table 1 with the run script's settings."""

    billions: float
    """Parameters in billions; the shape is the `sc21-<billions>b` model preset."""
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    """MBS of run_table_1.sh."""
    layers_per_virtual_stage: int
    """--num-layers-per-virtual-pipeline-stage of run_table_1.sh (0: not interleaved)."""
    paper_tflops: float
    """Achieved TFLOP/s per GPU (Table 1)."""
    paper_percent: float
    """Percentage of the 312 TFLOP/s peak (Table 1)."""

    @property
    def name(self) -> str:
        return f"{self.billions:g}B"

    @property
    def preset(self) -> str:
        return f"sc21-{self.billions:g}b"

    @property
    def layers(self) -> int:
        return self.model().num_layers

    @property
    def hidden(self) -> int:
        return self.model().hidden_size

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def virtual(self) -> int:
        per_stage = self.layers // self.pp
        return per_stage // self.layers_per_virtual_stage if self.layers_per_virtual_stage else 1

    def model(self) -> ModelConfig:
        return MODEL_PRESETS[self.preset]


# billions, TP, PP, GPUs, global batch, micro-batch, layers per virtual stage (run_table_1.sh);
# TFLOP/s per GPU, % of peak (Table 1)
TABLE1 = [
    SC21Row(1.7, 1, 1, 32, 512, 16, 0, 137, 44),
    SC21Row(3.6, 2, 1, 64, 512, 16, 0, 138, 44),
    SC21Row(7.5, 4, 1, 128, 512, 16, 0, 142, 46),
    SC21Row(18.4, 8, 1, 256, 1024, 8, 0, 135, 43),
    SC21Row(39.1, 8, 2, 512, 1536, 4, 0, 138, 44),
    SC21Row(76.1, 8, 4, 1024, 1792, 2, 5, 140, 45),
    SC21Row(145.6, 8, 8, 1536, 2304, 2, 5, 148, 47),
    SC21Row(310.1, 8, 16, 1920, 2160, 1, 3, 155, 50),
    SC21Row(529.6, 8, 35, 2520, 2520, 1, 1, 163, 52),
    SC21Row(1008.0, 8, 64, 3072, 3072, 1, 0, 163, 52),
]
CALIBRATION_ROWS = ("1.7B", "1008B")
"""The rows the two constants of `SC21_CALIBRATION` are fitted on; the other eight are predictions."""


def paper_flops(row: SC21Row) -> float:
    """The paper's FLOPs per iteration (with recomputation): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    b, s, layers, h = row.global_batch, SEQUENCE, row.layers, row.hidden
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + VOCAB / (16 * layers * h))


def layout(row: SC21Row) -> Layout:
    return Layout(tp=row.tp, dp=row.dp, micro_batch=row.micro_batch, checkpointing=True, pp=row.pp,
                  virtual=row.virtual, schedule=schedule_name(row.pp, row.virtual))


def predict(row: SC21Row, calibration: Calibration) -> StepTime:
    """The planner's step time of the row's run (the first pipeline rank's parameters)."""
    cfg = row.model()
    stages = rank_stages(pipeline_layers(cfg.num_layers, row.pp, row.virtual), row.pp, 0)
    params = rank_parameter_count(cfg, row.tp, stages)
    return step_time(cfg, layout(row), row.global_batch, SC21_GPU, SC21_FORMAT, params, calibration,
                     attention_scores=True, scatter_gather=True)


def predicted_tflops(row: SC21Row, calibration: Calibration) -> float:
    return paper_flops(row) / predict(row, calibration).total_s / row.gpus / 1e12


@dataclass(frozen=True)
class SC21Comparison:
    row: SC21Row
    predicted_tflops: float
    predicted_percent: float
    fitted: bool
    time: StepTime

    @property
    def difference(self) -> float:
        """Predicted minus the paper's percentage of peak, in points."""
        return self.predicted_percent - self.row.paper_percent


def compare(calibration: Calibration | None = None) -> list[SC21Comparison]:
    """Every Table 1 row beside the prediction."""
    calibration = calibration or SC21_CALIBRATION
    out = []
    for row in TABLE1:
        tflops = predicted_tflops(row, calibration)
        out.append(SC21Comparison(row, tflops, 100 * tflops / SC21_GPU.peak_tflops, row.name in CALIBRATION_ROWS,
                                  predict(row, calibration)))
    return out


def _bisect(function, target: float, low: float, high: float) -> float:
    """The x in [low, high] where the increasing `function(x)` equals `target`."""
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (low, middle) if function(middle) > target else (middle, high)
    return (low + high) / 2


def fit_calibration() -> Calibration:
    """Fit `compute_efficiency` on the 1T row (large GEMMs, little else) and `memory_efficiency` on the 1.7B
    row (where the elementwise and softmax passes weigh most), alternating until both rows are met; the
    link efficiency, DP overlap and latencies stay the 2019 fit's."""
    rows = {row.name: row for row in TABLE1}
    big, small = rows[CALIBRATION_ROWS[1]], rows[CALIBRATION_ROWS[0]]
    fitted = PAPER_CALIBRATION
    for _ in range(20):
        fitted = replace(fitted, compute_efficiency=_bisect(
            lambda x, base=fitted: predicted_tflops(big, replace(base, compute_efficiency=x)), big.paper_tflops,
            0.05, 1.0))
        fitted = replace(fitted, memory_efficiency=_bisect(
            lambda x, base=fitted: predicted_tflops(small, replace(base, memory_efficiency=x)), small.paper_tflops,
            0.05, 1.0))
    return fitted


SC21_CALIBRATION = replace(PAPER_CALIBRATION, compute_efficiency=0.7068, memory_efficiency=0.5658)
