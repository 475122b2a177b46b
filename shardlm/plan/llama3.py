"""Llama 3 405B's published pre-training runs (Meta, "The Llama 3 Herd of Models", 2024, Table 4) against the
planner's predictions.

Hardware: Meta's Grand Teton servers, 8 H100 80GB (700 W) on NVLink, RoCE at 400 Gb/s per GPU (the paper's
section 3.3.1): the `h100-80gb` preset (NVLink 4 900 GB/s, 8 x 400 Gb/s = 400 GB/s per server and
direction). Software: Meta's stack, planned as `--implementation megatron-core` (bf16, flash attention,
gradients reduce-scattered in fp32 and sharded with the optimizer state, the interleaved schedule with the
first and last stage one layer short: section 3.3.2), and the Hopper calibration
(`generations.HOPPER_CALIBRATION`: nothing in it comes from this table).

TFLOP/s per GPU are counted as the paper's MFU counts them, PaLM's definition (Chowdhery et al. 2023, appendix
B, which the paper cites): 6 x the matrix parameters + 12 l a s per token (the whole s x s square), which is
`flops_per_step` without recomputation. Batch sizes are sequences per step (the paper's 16M tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.models.config import ModelConfig
from shardlm.plan.evaluate import Choice, Evaluator
from shardlm.plan.flops import flops_per_step
from shardlm.plan.generations import HOPPER_CALIBRATION
from shardlm.plan.hardware import GPU_PRESETS
from shardlm.plan.models import PlannedModel
from shardlm.plan.planner import Plan, PlanRequest, PlanRow, plan
from shardlm.plan.timing import Layout

LLAMA3_405B = ModelConfig(arch="llama", num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
                          seq_length=8192, vocab_size=128256, ffn_hidden_size=53248, rope_theta=500000.0,
                          layernorm_epsilon=1e-5, dropout=0.0, tie_embeddings=False)
"""Llama 3 405B's shape (the paper's Table 3)."""


@dataclass(frozen=True)
class Llama3Row:
    """One row of Table 4."""

    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    sequence: int
    global_batch: int
    """Sequences per step (16M tokens / sequence)."""
    paper_tflops: float
    """Achieved BF16 TFLOP/s per GPU (Table 4)."""
    paper_mfu: float
    """BF16 MFU in percent (Table 4)."""

    @property
    def name(self) -> str:
        return f"{self.gpus} GPUs, {self.sequence} tokens"


# Table 4. The paper prints DP 4 in the last row, which contradicts its 16,384 GPUs and 16M tokens per batch;
# DP 8 is consistent with both.
TABLE4 = [
    Llama3Row(8192, 8, 1, 16, 64, 8192, 2048, 430, 43),
    Llama3Row(16384, 8, 1, 16, 128, 8192, 2048, 400, 41),
    Llama3Row(16384, 8, 16, 16, 8, 131072, 128, 380, 38),
]


def request(row: Llama3Row) -> PlanRequest:
    """What a user asks: Llama 3 405B at the row's sequence on its GPUs, the pipeline fixed at 16."""
    cfg = replace(LLAMA3_405B, seq_length=row.sequence)
    return PlanRequest(model=PlannedModel("llama3-405b", cfg), gpu=GPU_PRESETS["h100-80gb"], gpus=row.gpus,
                       global_batch=row.global_batch, precision="bf16", implementation="megatron-core",
                       pipeline=row.pp, calibration=HOPPER_CALIBRATION)


AS_RUN_VIRTUAL = 8
"""Virtual stages per pipeline rank as Meta ran them: with 126 layers, one layer fewer on the first and last
stage and "the first model chunk on the first stage has only the embedding" (section 3.3.2), every chunk holds
one layer: (126 + 2) / (16 x 8)."""


def as_run(row: Llama3Row) -> Layout:
    """The row's layout with the settings the paper states: micro-batch 1 (batch per DP rank = micro-batches),
    no activation checkpointing at 8K tokens (section 3.3.2; at 128K the planner's memory model fits it too),
    sequence parallelism, the optimizer state and gradients sharded over DP (FSDP without resharding the
    parameters), the interleaved schedule with Llama 3's stage split."""
    return Layout(tp=row.tp, dp=row.dp, cp=row.cp, micro_batch=1, checkpointing=False, pp=row.pp,
                  virtual=AS_RUN_VIRTUAL, schedule="interleaved-1f1b", sequence_parallel=True,
                  distributed_optimizer=True, end_trim=True)


@dataclass(frozen=True)
class Llama3Comparison:
    row: Llama3Row
    predicted_tflops: float
    """The planner's prediction of the published layout run as Meta ran it (`as_run`), in Meta's count."""
    as_run: Choice
    """That option's memory and time."""
    rank: int | None
    """Place of the published layout among the fitting layouts the planner ranks (0: recommended; None: it
    fits no option)."""
    layout: PlanRow
    """The planner's best fitting option of the published layout (or its smallest, when none fits)."""
    plan: Plan

    @property
    def error(self) -> float:
        """Predicted over published TFLOP/s, minus 1."""
        return self.predicted_tflops / self.row.paper_tflops - 1

    @property
    def planned_tflops(self) -> float:
        """TFLOP/s of the planner's own option for the published layout."""
        return tflops(self.plan.request.model.config, self.row, self.layout.choice.time.total_s)


def tflops(cfg: ModelConfig, row: Llama3Row, step_s: float) -> float:
    """Meta's count of TFLOP/s per GPU at `step_s` seconds per step."""
    return flops_per_step(cfg, row.global_batch) / step_s / row.gpus / 1e12


def compare(row: Llama3Row) -> Llama3Comparison:
    """The planner's verdict on the row: the published layout as run, and its place in the plan."""
    req = request(row)
    result = plan(req)
    [published] = [r for r in result.rows if (r.tp, r.cp, r.pp, r.dp) == (row.tp, row.cp, row.pp, row.dp)]
    fitting = sorted((r for r in result.rows if r.fits), key=lambda r: r.choice.time.total_s)
    rank = next((i for i, r in enumerate(fitting) if r is published), None)
    choice = Evaluator(req).choice(as_run(row))
    return Llama3Comparison(row, tflops(req.model.config, row, choice.time.total_s), choice, rank, published,
                            result)
