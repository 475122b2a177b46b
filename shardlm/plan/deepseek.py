"""DeepSeek-V3's published pre-training run (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, arXiv 2412.19437)
against the planner's prediction.

Published: 2,048 H800 GPUs (section 3.1), 16-way pipeline parallelism with DualPipe, 64-way expert parallelism
over 8 nodes, ZeRO-1 data parallelism and no tensor parallelism (section 3.2); 14.8T tokens of pre-training in
2.664M H800 GPU hours (Table 1), which is 14.8e12 / (2.664e6 x 3600) = 1,543 tokens/s per GPU; sequences of 4096
tokens, 15,360 a step after the batch ramp (section 4.2); one multi-token-prediction depth (section 4.2). The
throughput is an average over the whole run: the batch ramp from 3,072 sequences over the first 469B tokens
and any time lost are in it.

The planner runs the published layout with DeepSeek's stack (`kernels.DEEPSEEK_KERNELS`: FP8 GEMMs at DeepGEMM's
rates and the casts around them, DualPipe with two stages a rank (`dualpipe`), 20 SMs for communication,
node-limited routing, FP8-cached activations and BF16 moments) on the `h800-80gb` preset with the Hopper
calibration; nothing in it is fitted to the 1,543.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.plan.evaluate import Choice, Evaluator
from shardlm.plan.generations import HOPPER_CALIBRATION
from shardlm.plan.hardware import GPU_PRESETS
from shardlm.plan.kernels import DEEPSEEK_KERNELS
from shardlm.plan.models import MODEL_PRESETS, PlannedModel
from shardlm.plan.planner import Plan, PlanRequest, PlanRow, plan
from shardlm.plan.timing import Layout

DEEPSEEK_V3_TRAINED = replace(MODEL_PRESETS["deepseek-v3"], mtp_layers=1)
"""DeepSeek-V3 as it trained: the preset with its one multi-token-prediction depth."""

GPUS, PIPELINE, EXPERT, DATA = 2048, 16, 64, 128
GLOBAL_BATCH = 15360
"""Sequences of 4096 tokens per step after the batch ramp (section 4.2)."""
GPU_HOURS, TOKENS = 2.664e6, 14.8e12
PUBLISHED_TOKENS_PER_GPU_S = TOKENS / (GPU_HOURS * 3600)
"""1,543 tokens/s per GPU: 14.8T tokens in 2.664M H800 GPU hours (Table 1)."""


def request(kernels=DEEPSEEK_KERNELS) -> PlanRequest:
    """DeepSeek-V3 with its MTP depth on 2,048 H800s, 15,360 sequences a step, bf16 with half parameters, the
    published PP 16 and EP 64 fixed, no virtual stages (DualPipe's two chunks a rank are its own)."""
    return PlanRequest(model=PlannedModel("deepseek-v3", DEEPSEEK_V3_TRAINED), gpu=GPU_PRESETS["h800-80gb"],
                       gpus=GPUS, global_batch=GLOBAL_BATCH, param_dtype="half", pipeline=PIPELINE, expert=EXPERT,
                       virtual_stages=1, calibration=HOPPER_CALIBRATION, kernels=kernels)


def as_run() -> Layout:
    """The published layout as the report runs it: no TP, PP 16, DP 128 with EP 64, ZeRO-1 (the distributed
    optimizer), micro-batches of one sequence (the report does not give the size), and no full recomputation
    (it recomputes only the RMSNorms and MLA's up-projections: `fp8.fp8_layer_bytes`, `Kernels.recompute_mla_up`)."""
    return Layout(tp=1, dp=DATA, micro_batch=1, checkpointing=False, pp=PIPELINE, ep=EXPERT,
                  distributed_optimizer=True)


@dataclass(frozen=True)
class DeepSeekComparison:
    predicted: float
    """Tokens/s per GPU of the published layout as run (`as_run`)."""
    as_run: Choice
    rank: int | None
    """Place of the published layout (its best fitting option) among the fitting layouts (0: recommended)."""
    layout: PlanRow
    plan: Plan

    @property
    def error(self) -> float:
        return self.predicted / PUBLISHED_TOKENS_PER_GPU_S - 1


def tokens_per_gpu_s(step_s: float) -> float:
    return GLOBAL_BATCH * DEEPSEEK_V3_TRAINED.seq_length / step_s / GPUS


def compare(kernels=DEEPSEEK_KERNELS) -> DeepSeekComparison:
    """The planner's verdict on DeepSeek-V3's run: the published layout as run, and its place in the plan."""
    req = request(kernels)
    result = plan(req)
    [published] = [r for r in result.rows if (r.tp, r.pp, r.dp, r.ep) == (1, PIPELINE, DATA, EXPERT)]
    fitting = sorted((r for r in result.rows if r.fits), key=lambda r: r.choice.time.total_s)
    rank = next((i for i, r in enumerate(fitting) if r is published), None)
    choice = Evaluator(req).choice(as_run())
    return DeepSeekComparison(tokens_per_gpu_s(choice.time.total_s), choice, rank, published, result)
