"""What a plan is made of, below every model of time and memory: one layout of a run on a cluster (`Layout`)
and the time model's constants that no datasheet gives (`Calibration`, the 2019 paper's fit)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    """Constants of the time model that no datasheet gives."""

    compute_efficiency: float
    """Fraction of peak FLOP/s the split work (FLOP formula) reaches."""
    link_efficiency: float
    """Achieved fraction of the nominal per-direction link bandwidth in ring all-reduces (both links)."""
    dp_overlap: float
    """Fraction of the DP gradient all-reduce hidden behind the last micro-batch's backward."""
    intra_node_latency_s: float = 5e-6
    """Per ring step on NVLink/NVSwitch (assumed, not fitted)."""
    inter_node_latency_s: float = 10e-6
    """Per ring step across InfiniBand (assumed, not fitted)."""
    memory_efficiency: float = 1.0
    """Achieved fraction of the HBM bandwidth in memory-bound kernels (elementwise passes, optimizer);
    1.0 in the 2019 fit, fitted on the SC21 table (`shardlm.plan.sc21`)."""
    attention_efficiency: float = 0.0
    """Fraction of peak FLOP/s a flash-attention kernel's forward reaches on the attention core (QK^T, PV), used
    with `kernels.CORE_KERNELS`; 0: at `compute_efficiency` like the GEMMs (`generations.HOPPER_CALIBRATION`)."""
    attention_backward_efficiency: float = 0.0
    """The same for the flash kernel's backward (0: `compute_efficiency`)."""


# Fitted in this order by `shardlm.plan.paper.fit_calibration` (a test keeps them in sync):
#   compute_efficiency on the paper's baseline: the 1.2B model on one V100 sustains 39 TFLOP/s;
#   link_efficiency on the TP-only end point: 8.3B at TP=8 runs at 77% weak-scaling efficiency;
#   dp_overlap on the TP+DP end point: 8.3B on 512 GPUs (TP=8 x DP=64) runs at 74%.
# The other six rows of Table 1 are predictions.
PAPER_CALIBRATION = Calibration(compute_efficiency=0.3155, link_efficiency=0.7325, dp_overlap=0.7856)


@dataclass(frozen=True)
class Layout:
    """One way to place a run on the cluster."""

    tp: int
    """Tensor-parallel size (consecutive ranks inside a node)."""
    dp: int
    """Data-parallel size."""
    micro_batch: int
    """Sequences per forward/backward on one DP rank."""
    checkpointing: bool
    """Activation checkpointing of every transformer layer (recompute = "full")."""
    pp: int = 1
    """Pipeline-parallel size (stages across servers)."""
    virtual: int = 1
    """Virtual stages per pipeline rank (interleaved 1F1B when > 1; 2 under the V-shaped "zbv" and "dualpipev")."""
    schedule: str = "1f1b"
    """"gpipe", "1f1b", "interleaved-1f1b", or the zero-bubble "interleaved-zb", "zbv", "dualpipev"
    (`shardlm.plan.schedule_sim`)."""
    sequence_parallel: bool = False
    """LayerNorm, dropout and residual activations split along the sequence over TP."""
    selective: bool = False
    """Selective recomputation of the attention core (ignored when `checkpointing`)."""
    distributed_optimizer: bool = False
    """Optimizer state sharded over DP (ZeRO-1): reduce-scatter gradients, all-gather parameters."""
    ep: int = 1
    """Expert-parallel size E: each MoE layer's experts split over E consecutive DP x CP ranks, CP ranks first
    (divides DP x CP)."""
    cp: int = 1
    """Context-parallel size C: every sequence split over C ranks (next to TP; DP is the data replicas)."""
    full_sharding: bool = False
    """FSDP (`train.data_sharding = "full"`): parameters, gradients and optimizer state sharded over DP,
    each layer gathered for its forward and backward (`shardlm.plan.fsdp`); excludes `distributed_optimizer`."""
    end_trim: bool = False
    """The first and the last pipeline stage hold one layer fewer than the others (their embedding and output
    layer take its place: Llama 3's stage split, `stages.trimmed_layers`; planned for megatron-core)."""
    fsdp_shard_size: int = 0
    """Hybrid sharding (`train.fsdp_shard_size` = S, with `full_sharding`): units sharded within groups of S
    consecutive DP x CP ranks and replicated across the groups; 0 shards over all DP x CP ranks."""

    @property
    def v_shaped(self) -> bool:
        """Stages r and 2P - 1 - r on rank r (ZB-V, DualPipeV), rank 0 holding both ends."""
        return self.pp > 1 and self.schedule in ("zbv", "dualpipev")

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp * self.cp

    @property
    def data_sharding(self) -> str:
        """shardlm's `train.data_sharding`: "none", "optimizer" (ZeRO-1) or "full" (FSDP)."""
        return "full" if self.full_sharding else "optimizer" if self.distributed_optimizer else "none"

    @property
    def recompute(self) -> str:
        return "full" if self.checkpointing else "selective" if self.selective else "none"
