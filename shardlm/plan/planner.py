"""Every valid TP x DP layout of a model on a cluster: memory per GPU, fit, step time, recommendation.

A layout is valid when TP divides the GPUs, stays inside a node (divides `gpus_per_node`), divides
the attention heads and the MLP width, and the resulting DP size divides the global batch. For each
valid layout the planner tries every micro-batch size that divides the per-replica batch (up to
`max_micro_batch`), with and without activation checkpointing, and keeps the fastest choice that
fits in GPU memory (or, when none fits, the smallest one, marked as not fitting).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.errors import UserError
from shardlm.plan.hardware import GPUSpec
from shardlm.plan.memory import (
    GB,
    ActivationMemory,
    NumericFormat,
    ParameterCount,
    StateMemory,
    activation_memory,
    numeric_format,
    parameter_count,
    state_memory,
)
from shardlm.plan.models import PlannedModel, check_model
from shardlm.plan.timing import PAPER_CALIBRATION, Calibration, Layout, StepTime, step_time


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked: a model on a cluster with a batch and a precision."""

    model: PlannedModel
    gpu: GPUSpec
    gpus: int
    """Total GPUs (TP x DP)."""
    global_batch: int
    """Sequences per optimizer step."""
    precision: str = "bf16"
    """"fp32", "bf16" or "fp16"."""
    implementation: str = "shardlm"
    """Whose memory layout and communication dtypes: "shardlm" (fp32 masters, autocast) or "megatron"."""
    micro_batch: int | None = None
    """Fixed micro-batch size; None lets the planner choose (up to `max_micro_batch`)."""
    max_micro_batch: int = 8
    """Largest micro-batch the planner tries when choosing."""
    checkpointing: str = "auto"
    """"auto" (fastest that fits), "on" or "off"."""
    reserve_gb: float = 2.0
    """Memory not available to the model: CUDA context, library workspaces, fragmentation."""
    calibration: Calibration = PAPER_CALIBRATION
    """Time-model constants."""

    @property
    def format(self) -> NumericFormat:
        return numeric_format(self.precision, self.implementation)


@dataclass(frozen=True)
class Choice:
    """One (micro-batch, checkpointing) option of a layout, with its memory and time."""

    layout: Layout
    accumulation: int
    """Micro-batches per DP rank per step."""
    activations: ActivationMemory
    total_bytes: int
    """State + peak activations + transient + reserve, per GPU."""
    fits: bool
    time: StepTime


@dataclass(frozen=True)
class PlanRow:
    """The planner's verdict on one TP x DP layout."""

    tp: int
    dp: int
    params: ParameterCount
    state: StateMemory
    choice: Choice
    """The chosen micro-batch and checkpointing."""

    @property
    def fits(self) -> bool:
        return self.choice.fits


@dataclass
class Plan:
    """All layouts, the skipped ones with their reason, and the recommendation."""

    request: PlanRequest
    rows: list[PlanRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """"TPxDP" -> why it is not a valid layout."""

    @property
    def recommended(self) -> PlanRow | None:
        """The fitting layout with the lowest predicted step time (ties: smaller TP)."""
        fitting = [row for row in self.rows if row.fits]
        return min(fitting, key=lambda row: (row.choice.time.total_s, row.tp)) if fitting else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_request(request: PlanRequest) -> None:
    check_model(request.model.config)
    gpus, per_node = request.gpus, request.gpu.gpus_per_node
    if gpus < 1 or request.global_batch < 1:
        raise UserError(f"--gpus={gpus} and --global-batch={request.global_batch} must be at least 1")
    if gpus > per_node and gpus % per_node:
        raise UserError(f"--gpus={gpus} is not a whole number of {per_node}-GPU nodes; "
                        f"use a multiple of --gpus-per-node={per_node}")
    if request.checkpointing not in ("auto", "on", "off"):
        raise UserError(f"--checkpointing {request.checkpointing!r} must be auto, on or off")
    if request.micro_batch is not None and request.micro_batch < 1:
        raise UserError(f"--micro-batch={request.micro_batch} must be at least 1")


def invalid_reason(request: PlanRequest, tp: int) -> str | None:
    """Why TP size `tp` is not a valid layout for this request, or None."""
    cfg, gpu = request.model.config, request.gpu
    dp = request.gpus // tp
    if tp > gpu.gpus_per_node or gpu.gpus_per_node % tp:
        return f"TP={tp} does not divide a {gpu.gpus_per_node}-GPU node"
    if cfg.num_heads % tp:
        return f"{cfg.num_heads} heads are not divisible by TP={tp}"
    if cfg.ffn_size % tp:
        return f"MLP width {cfg.ffn_size} is not divisible by TP={tp}"
    if request.global_batch % dp:
        return f"global batch {request.global_batch} is not divisible by DP={dp}"
    if request.micro_batch is not None and (request.global_batch // dp) % request.micro_batch:
        return f"per-replica batch {request.global_batch // dp} is not divisible by micro-batch {request.micro_batch}"
    return None


def _choices(request: PlanRequest, tp: int, params: ParameterCount, state: StateMemory) -> list[Choice]:
    cfg, fmt = request.model.config, request.format
    dp = request.gpus // tp
    per_replica = request.global_batch // dp
    micro_batches = ([request.micro_batch] if request.micro_batch is not None else
                     [m for m in _divisors(per_replica) if m <= request.max_micro_batch])
    checkpointing = {"auto": (False, True), "on": (True,), "off": (False,)}[request.checkpointing]
    capacity = request.gpu.memory_gb * GB
    out = []
    for micro in micro_batches:
        activations = activation_memory(cfg, tp, micro, fmt)
        for ckpt in checkpointing:
            layout = Layout(tp=tp, dp=dp, micro_batch=micro, checkpointing=ckpt)
            total = state.total + activations.peak(ckpt) + activations.transient + int(request.reserve_gb * GB)
            time = step_time(cfg, layout, request.global_batch, request.gpu, fmt, params, request.calibration)
            out.append(Choice(layout, per_replica // micro, activations, total, total <= capacity, time))
    return out


def plan(request: PlanRequest) -> Plan:
    """Evaluate every TP size that divides the GPUs."""
    _check_request(request)
    result = Plan(request)
    for tp in _divisors(request.gpus):
        reason = invalid_reason(request, tp)
        if reason:
            result.skipped[f"{tp}x{request.gpus // tp}"] = reason
            continue
        params = parameter_count(request.model.config, tp)
        state = state_memory(params, request.format)
        choices = _choices(request, tp, params, state)
        fitting = [c for c in choices if c.fits]
        best = (min(fitting, key=lambda c: c.time.total_s) if fitting
                else min(choices, key=lambda c: c.total_bytes))
        result.rows.append(PlanRow(tp, request.gpus // tp, params, state, best))
    if not result.rows:
        raise UserError("no valid TP x DP layout: " + "; ".join(result.skipped.values()))
    return result
