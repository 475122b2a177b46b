"""GPU and node presets: the numbers the time and memory models need about the hardware.

Link bandwidths follow how vendors and the paper quote them: the intra-node figure is the per-GPU
NVLink/NVSwitch bandwidth *summed over both directions* (V100 in a DGX-2H: 300 GB/s), the inter-node
figure is the network bandwidth of a whole node *per direction* (DGX-2H: 8 InfiniBand EDR adapters
of 100 Gb/s = 100 GB/s). `timing` turns them into per-direction bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.errors import UserError


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model inside its usual server."""

    name: str
    """Preset name, e.g. "v100-dgx2h"."""
    memory_gb: float
    """Device memory in GB (10^9 bytes) usable for training."""
    peak_tflops: float
    """Dense half-precision (fp16/bf16) tensor-core peak, TFLOP/s."""
    hbm_gbps: float
    """Device-memory bandwidth, GB/s (prices the memory-bound elementwise work and the optimizer)."""
    gpus_per_node: int
    """GPUs in one server: the largest tensor-parallel group that stays on the intra-node links."""
    intra_node_gbps: float
    """Per-GPU NVLink/NVSwitch bandwidth, both directions summed, GB/s."""
    inter_node_gbps: float
    """Network bandwidth of one node, per direction, GB/s."""
    description: str = ""
    """Where the numbers come from."""


GPU_PRESETS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in [
        # 39 TFLOP/s is "30% of peak" in the paper, so its DGX-2H V100s (450 W) peak at 130 TFLOP/s.
        GPUSpec("v100-dgx2h", 32, 130, 900, 16, 300, 100,
                "the paper's: V100 32GB in a DGX-2H, NVSwitch 300 GB/s, 8x100 Gb/s InfiniBand per node"),
        GPUSpec("a100-80gb", 80, 312, 2039, 8, 600, 200,
                "DGX A100: NVLink 3 600 GB/s, 8x200 Gb/s HDR InfiniBand per node"),
        GPUSpec("h100-80gb", 80, 989, 3350, 8, 900, 400,
                "DGX H100 (SXM): NVLink 4 900 GB/s, 8x400 Gb/s NDR InfiniBand per node"),
        GPUSpec("h200-141gb", 141, 989, 4800, 8, 900, 400,
                "HGX H200: H100 compute with 141 GB HBM3e, NVLink 4 900 GB/s, 8x400 Gb/s per node"),
        # DeepSeek-V3's cluster (its report, 3.1 and 3.2.2): H100 compute and memory, NVLink cut to 400 GB/s,
        # one 400 Gb/s InfiniBand adapter per GPU (the report measures about 160 GB/s NVLink and 50 GB/s IB)
        GPUSpec("h800-80gb", 80, 989, 3350, 8, 400, 400,
                "H800 (SXM): H100 compute, NVLink 400 GB/s, 8x400 Gb/s InfiniBand per node"),
    ]
}
# Device-memory bandwidth assumed for a custom GPU without --hbm-bw (an A100's, roughly).
DEFAULT_HBM_GBPS = 2000.0

GPU_ALIASES = {"v100": "v100-dgx2h", "a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb",
               "h800": "h800-80gb"}


def gpu_preset(name: str) -> GPUSpec:
    """The preset called `name` (or a short alias like "h100"); UserError naming the choices."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPU_PRESETS:
        choices = ", ".join([*GPU_PRESETS, *GPU_ALIASES])
        raise UserError(f"unknown GPU preset {name!r}; choose one of {choices} or give --gpu-memory and --flops")
    return GPU_PRESETS[key]


def custom_gpu(base: GPUSpec | None, *, memory_gb: float | None = None, peak_tflops: float | None = None,
               hbm_gbps: float | None = None, gpus_per_node: int | None = None,
               intra_node_gbps: float | None = None, inter_node_gbps: float | None = None) -> GPUSpec:
    """A preset with some numbers overridden, or (base None) a GPU described entirely by the caller."""
    given = {"memory_gb": memory_gb, "peak_tflops": peak_tflops, "hbm_gbps": hbm_gbps,
             "gpus_per_node": gpus_per_node, "intra_node_gbps": intra_node_gbps, "inter_node_gbps": inter_node_gbps}
    changes = {key: value for key, value in given.items() if value is not None}
    for key, value in changes.items():
        if value <= 0:
            raise UserError(f"--{key.replace('_', '-')}={value} must be positive")
    if base is not None:
        return replace(base, name=base.name + ("*" if changes else ""), **changes)
    flags = {"memory_gb": "--gpu-memory", "peak_tflops": "--flops", "hbm_gbps": "--hbm-bw",
             "gpus_per_node": "--gpus-per-node", "intra_node_gbps": "--intra-node-bw",
             "inter_node_gbps": "--inter-node-bw"}
    changes.setdefault("hbm_gbps", DEFAULT_HBM_GBPS)
    missing = [flags[key] for key in flags if key not in changes]
    if missing:
        raise UserError(f"without --gpu PRESET also give {', '.join(missing)} (or pick a preset with --gpu)")
    return GPUSpec(name="custom", **changes)
