"""The link model every collective of the planner is priced on: ring all-reduces and all-gathers, NVLink inside
a server, the server's network across servers (`docs/plan.md`).

A group of ranks `stride` GPUs apart has gpus_per_node / stride of them in a server; while one server holds
them all a ring runs on NVLink (the per-direction half of the bidirectional figure, per GPU). A group that
spans servers also crosses each server's network (its bandwidth per node, shared): the network carries the
ring's traffic once for each of the min(stride, gpus_per_node) groups the server hosts at once; the slower of
the two links sets the time. Achieved bandwidth is the nominal times `Calibration.link_efficiency`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from shardlm.plan.hardware import GPUSpec

if TYPE_CHECKING:
    from shardlm.plan.layout import Calibration


def ring_allreduce_seconds(nbytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce: each rank sends and receives 2 (p-1)/p of the buffer, in 2 (p-1) steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth_bytes_per_s + 2 * (ranks - 1) * latency_s


def direction_bandwidth(gpu: GPUSpec, calibration: Calibration) -> tuple[float, float]:
    """Achieved per-direction bytes/s of the intra-node link (per GPU) and the inter-node network (per node)."""
    intra = gpu.intra_node_gbps / 2 * 1e9 * calibration.link_efficiency
    inter = gpu.inter_node_gbps * 1e9 * calibration.link_efficiency
    return intra, inter


def ring_gather_seconds(nbytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of `nbytes` in all: each rank sends and receives
    (p-1)/p of it, in p - 1 steps."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth_bytes_per_s + (ranks - 1) * latency_s


def over_dp_group(ring, nbytes: float, ranks: int, stride: int, gpu: GPUSpec, calibration: Calibration) -> float:
    """`ring(nbytes, ranks, bandwidth, latency)` (an all-reduce, all-gather or reduce-scatter) over `ranks`
    ranks `stride` apart: on NVLink while they fit in a node; across nodes, each node's network carries it
    for each of its `stride` groups at once, and the slower of the two links sets the time."""
    intra, inter = direction_bandwidth(gpu, calibration)
    nodes = math.ceil(ranks / max(1, gpu.gpus_per_node // stride))
    on_nvlink = ring(nbytes, ranks, intra, calibration.intra_node_latency_s)
    if nodes == 1:
        return on_nvlink
    on_network = ring(min(stride, gpu.gpus_per_node) * nbytes, ranks, inter, calibration.inter_node_latency_s)
    return max(on_nvlink, on_network)
