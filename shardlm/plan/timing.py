"""Predicted time of one training step for a TP x DP layout.

    step = compute + elementwise + tp_comm + optimizer + exposed dp_comm

- compute: the matmul FLOP count (`shardlm.models.config.flops_per_step`: 72 B s l h^2 (1 + s/6h +
  V/12lh), plus the layers' forward again with activation recomputation, padded vocabulary) divided
  over all GPUs, at `compute_efficiency` of
  the GPU's peak. It covers everything that splits over TP (GEMMs, attention, GeLU).
- elementwise: the work every TP rank repeats on the full b x s x h activations (LayerNorms,
  dropouts, residual adds, row-parallel bias adds: `ELEMENTWISE_PASSES` reads/writes of b s h
  elements per layer, forward and backward, again when recomputing), memory-bound at the HBM
  bandwidth. This is what makes TP scale below linear even with free communication.
- tp_comm: per layer and micro-batch 2 all-reduces forward and 2 backward (+2 forward when
  recomputing), plus the embedding's forward and the LM head's backward all-reduce, each of
  b x s x h elements, and the cross-entropy's 3 b s floats; ring cost
  2 (p-1)/p * bytes / bandwidth + 2 (p-1) * latency over the intra-node link. Not overlapped: each
  all-reduce sits on the critical path between two GEMMs.
- dp_comm: one ring all-reduce of this rank's gradients over the DP group. A DP group is strided
  by TP, so a node hosts `gpus_per_node / tp` of its ranks and `tp` such groups at once; when a
  group spans nodes, each node's network carries 2 (p-1)/p * gradient bytes for each of its tp
  groups. shardlm's DDP starts bucket all-reduces during the last micro-batch's backward: a fraction
  `dp_overlap` of the all-reduce hides behind that backward (capped by its length), the rest is
  exposed.
- optimizer: AdamW, clipping and precision copies stream the per-rank state once (memory-bound).

The three calibrated constants and what they were fitted on are in `PAPER_CALIBRATION`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardlm.models.config import ModelConfig, flops_per_step
from shardlm.plan.hardware import GPUSpec
from shardlm.plan.memory import NumericFormat, ParameterCount

# Reads + writes of b x s x h elements per layer that every TP rank repeats (derived from the layer,
# not fitted): forward LN1 2, bias add 2, dropout 2, residual add 3, the same again after the MLP
# (18); backward: LayerNorms 3 + 3, dropouts 2 + 2, bias gradients 1 + 1, residual-gradient adds
# 3 + 3 (18); a recomputed forward repeats the 18 forward passes.
ELEMENTWISE_PASSES_FORWARD = 18
ELEMENTWISE_PASSES_BACKWARD = 18


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
    """Activation checkpointing of every transformer layer."""

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part."""

    compute_s: float
    elementwise_s: float
    tp_comm_s: float
    optimizer_s: float
    dp_comm_s: float
    """The whole DP all-reduce, before overlap."""
    dp_exposed_s: float
    """The part of the DP all-reduce not hidden behind the backward pass."""
    model_flops: float
    """Matmul FLOPs of the step (`flops_per_step`, recomputed forwards included when checkpointing)."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.elementwise_s + self.tp_comm_s + self.optimizer_s + self.dp_exposed_s

    def tflops_per_gpu(self, gpus: int) -> float:
        return self.model_flops / self.total_s / gpus / 1e12


def ring_allreduce_seconds(nbytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce: each rank sends and receives 2 (p-1)/p of the buffer, in 2 (p-1) steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth_bytes_per_s + 2 * (ranks - 1) * latency_s


def _direction_bandwidth(gpu: GPUSpec, calibration: Calibration) -> tuple[float, float]:
    """Achieved per-direction bytes/s of the intra-node link (per GPU) and the inter-node network (per node)."""
    intra = gpu.intra_node_gbps / 2 * 1e9 * calibration.link_efficiency
    inter = gpu.inter_node_gbps * 1e9 * calibration.link_efficiency
    return intra, inter


def tp_comm_seconds(cfg: ModelConfig, layout: Layout, gpu: GPUSpec, fmt: NumericFormat,
                    calibration: Calibration) -> float:
    """TP all-reduce time of one micro-batch (forward + backward [+ recomputation])."""
    if layout.tp == 1:
        return 0.0
    intra, _ = _direction_bandwidth(gpu, calibration)
    tokens = layout.micro_batch * cfg.seq_length
    layers = cfg.num_layers
    forward_calls = 2 * layers * (2 if layout.checkpointing else 1)
    sizes = ([tokens * cfg.hidden_size * fmt.tp_forward_bytes] * forward_calls
             + [tokens * cfg.hidden_size * fmt.tp_backward_bytes] * (2 * layers + 1)  # layers + LM head
             + [tokens * cfg.hidden_size * fmt.residual_bytes]  # embedding
             + [tokens * 4, 2 * tokens * 4])  # cross-entropy MAX and SUM
    return sum(ring_allreduce_seconds(n, layout.tp, intra, calibration.intra_node_latency_s) for n in sizes)


def dp_comm_seconds(params: ParameterCount, layout: Layout, gpu: GPUSpec, fmt: NumericFormat,
                    calibration: Calibration) -> float:
    """Gradient all-reduce over the DP group (ring), limited by NVLink or by the node's network."""
    if layout.dp == 1:
        return 0.0
    intra, inter = _direction_bandwidth(gpu, calibration)
    grad_bytes = params.total * fmt.grad_bytes
    ranks_per_node = max(1, gpu.gpus_per_node // layout.tp)
    nodes = math.ceil(layout.dp / ranks_per_node)
    on_nvlink = ring_allreduce_seconds(grad_bytes, layout.dp, intra, calibration.intra_node_latency_s)
    if nodes == 1:
        return on_nvlink
    groups_per_node = min(layout.tp, gpu.gpus_per_node)
    network_bytes = groups_per_node * grad_bytes
    on_network = ring_allreduce_seconds(network_bytes, layout.dp, inter, calibration.inter_node_latency_s)
    return max(on_nvlink, on_network)


def optimizer_bytes_per_parameter(fmt: NumericFormat) -> int:
    """Bytes streamed per parameter per step: AdamW reads weight, gradient and both moments and
    writes weight and moments (7 x 4); clipping reads the gradient for the norm and scales it
    (3 x grad); mixed precision also writes the half weight copy."""
    half_copy = fmt.weight_bytes if fmt.weight_bytes != 4 else 0
    return 7 * 4 + 3 * fmt.grad_bytes + half_copy


def step_time(cfg: ModelConfig, layout: Layout, global_batch: int, gpu: GPUSpec, fmt: NumericFormat,
              params: ParameterCount, calibration: Calibration) -> StepTime:
    """Predicted time of one optimizer step of `global_batch` sequences on `layout`."""
    accumulation = global_batch // (layout.dp * layout.micro_batch)
    padded = replace(cfg, vocab_size=cfg.padded_vocab_size(layout.tp))
    flops = flops_per_step(padded, global_batch, recompute=layout.checkpointing)
    compute = flops / layout.gpus / (gpu.peak_tflops * 1e12 * calibration.compute_efficiency)

    passes = ELEMENTWISE_PASSES_FORWARD * (2 if layout.checkpointing else 1) + ELEMENTWISE_PASSES_BACKWARD
    tokens = layout.micro_batch * cfg.seq_length
    elementwise_bytes = passes * cfg.num_layers * tokens * cfg.hidden_size * fmt.residual_bytes
    elementwise = accumulation * elementwise_bytes / (gpu.hbm_gbps * 1e9)

    tp_comm = accumulation * tp_comm_seconds(cfg, layout, gpu, fmt, calibration)
    optimizer = params.total * optimizer_bytes_per_parameter(fmt) / (gpu.hbm_gbps * 1e9)

    dp_comm = dp_comm_seconds(params, layout, gpu, fmt, calibration)
    backward_share = 3 / 4 if layout.checkpointing else 2 / 3  # (recompute +) backward of fwd+bwd FLOPs
    last_backward = backward_share * (compute + elementwise + tp_comm) / accumulation
    hidden = min(calibration.dp_overlap * dp_comm, last_backward)
    return StepTime(compute_s=compute, elementwise_s=elementwise, tp_comm_s=tp_comm, optimizer_s=optimizer,
                    dp_comm_s=dp_comm, dp_exposed_s=dp_comm - hidden, model_flops=flops)
