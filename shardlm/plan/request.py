"""What the user asks `shardlm plan`: a model on a cluster with a batch, a precision and the choices fixed."""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.plan.hardware import GPUSpec
from shardlm.plan.kernels import Kernels
from shardlm.plan.layout import PAPER_CALIBRATION, Calibration
from shardlm.plan.memory import NumericFormat, numeric_format
from shardlm.plan.models import PlannedModel

DATA_SHARDING = ("none", "optimizer", "full")


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked: a model on a cluster with a batch and a precision."""

    model: PlannedModel
    gpu: GPUSpec
    gpus: int
    """Total GPUs (PP x TP x DP)."""
    global_batch: int
    """Sequences per optimizer step."""
    precision: str = "bf16"
    """"fp32", "bf16" or "fp16"."""
    implementation: str = "shardlm"
    """Whose memory layout and kernels: "shardlm" (this repository) or "megatron" (Korthikanti et al.'s
    activation formulas, unfused softmax, scatter/gather pipeline transfers)."""
    micro_batch: int | None = None
    """Fixed micro-batch size; None lets the planner choose (up to `max_micro_batch`)."""
    max_micro_batch: int = 8
    """Largest micro-batch the planner tries when choosing."""
    checkpointing: str = "auto"
    """Older switch for full recomputation: "on" = recompute "full", "off" = "none", "auto" defers to `recompute`."""
    recompute: str = "auto"
    """"auto" (fastest that fits), "none", "selective" or "full"."""
    sequence_parallel: str = "auto"
    """"auto", "on" (every TP > 1 layout) or "off"."""
    distributed_optimizer: str = "auto"
    """Older switch for the data sharding: "on" = data_sharding "optimizer", "off" = "none", "auto" defers to it."""
    data_sharding: str = "auto"
    """"auto" (fastest that fits), "none", "optimizer" (ZeRO-1, every DP > 1 layout) or "full" (FSDP: only the
    layouts shardlm runs it on, `fsdp.fsdp_invalid_reason`)."""
    param_dtype: str = "fp32"
    """"fp32" or "half" (shardlm's half parameters with fp32 gradients and master weights)."""
    optimizer: str = "adamw"
    """`train.optimizer`: "adamw", or "muon" (its matrices' state and step: `shardlm.plan.muon`; shardlm only)."""
    muon_ns_steps: int = 5
    """`train.muon_ns_steps`: Newton-Schulz iterations of Muon's step."""
    pipeline: int | None = None
    """Fixed pipeline size; None searches every size."""
    expert: int | None = None
    """Fixed expert-parallel size (MoE models); None searches every size dividing DP and the experts."""
    context: int | None = None
    """Fixed context-parallel size; None searches C > 1 for long sequences (`context.LONG_CONTEXT`), else 1."""
    fsdp_shard_size: int | None = None
    """Hybrid sharding of FSDP layouts (`train.fsdp_shard_size`): fixed S (0: shard over all DP x CP ranks);
    None tries 0 and S = GPUs per node / TP (`shard_size_options`)."""
    virtual_stages: int | None = None
    """Fixed virtual stages per pipeline rank; None searches."""
    schedule: str | None = None
    """Fixed pipeline schedule; None: 1F1B, interleaved 1F1B with virtual stages."""
    reserve_gb: float = 2.0
    """Memory not available to the model: CUDA context, library workspaces, fragmentation."""
    calibration: Calibration = PAPER_CALIBRATION
    """Time-model constants."""
    kernels: Kernels | None = None
    """The stack's time-relevant kernels and runtime (`kernels.Kernels`); None: the implementation's (SC21's for
    shardlm and megatron, `CORE_KERNELS` for megatron-core). `kernels.DEEPSEEK_KERNELS` plans DeepSeek-V3's."""

    @property
    def format(self) -> NumericFormat:
        return numeric_format(self.precision, self.implementation, self.param_dtype)

    def recompute_options(self) -> tuple[str, ...]:
        if self.checkpointing != "auto":
            return ("full",) if self.checkpointing == "on" else ("none",)
        return ("none", "selective", "full") if self.recompute == "auto" else (self.recompute,)

    def sharding_options(self) -> tuple[str, ...]:
        if self.distributed_optimizer != "auto":
            return ("optimizer",) if self.distributed_optimizer == "on" else ("none",)
        return DATA_SHARDING if self.data_sharding == "auto" else (self.data_sharding,)
