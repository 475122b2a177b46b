"""Which calibration the planner uses on which GPU generation (`docs/plan.md`, "Calibration").

- V100 (`v100-dgx2h`): `timing.PAPER_CALIBRATION`, fitted on Shoeybi et al. 2019's runs;
- A100 and any GPU without a generation of its own: `sc21.SC21_CALIBRATION`, fitted on Narayanan et al.
  2021's A100 runs;
- H100 and H200 (Hopper, `h100-80gb`, `h200-141gb`): SC21's constants with the GEMM efficiency scaled by how
  much of its peak a Hopper GPU's best BF16 GEMM reaches against an A100's. The measured ratio is from
  the "Maximum Achievable Matmul FLOPS" table of Stas Bekman's ml-engineering book (compute/accelerator,
  `mamf-finder.py`, CUDA 12.1): H100 SXM 792.1 of 989 TFLOP/s (80.1%), A100 SXM 267.9 of 312 (85.9%). No
  Llama 3 or DeepSeek figure enters it. H200 and H800 run H100's GEMMs (same SMs and clocks), so they share it.
  The attention core (with `--implementation megatron-core`'s flash kernel) runs at FlashAttention-2's
  measured fractions of an H100's peak, forward and backward (`H100_FLASH_ATTENTION_EFFICIENCY`,
  `H100_FLASH_ATTENTION_BACKWARD_EFFICIENCY`).
"""

from __future__ import annotations

from dataclasses import replace

from shardlm.plan.hardware import GPUSpec
from shardlm.plan.sc21 import SC21_CALIBRATION
from shardlm.plan.timing import PAPER_CALIBRATION, Calibration

A100_MATMUL_EFFICIENCY = 267.9 / 312
"""Best measured BF16 matmul over peak, A100 SXM (ml-engineering's MAMF table)."""
H100_MATMUL_EFFICIENCY = 792.1 / 989
"""Best measured BF16 matmul over peak, H100 SXM (ml-engineering's MAMF table)."""

H100_FLASH_ATTENTION_EFFICIENCY = 335 / 989
"""FlashAttention-2's causal forward at head size 128 and 16k tokens on an H100 SXM5, 335 TFLOP/s (counting the
executed half): Shah et al. 2024 (FlashAttention-3), "Attention forward speed, head dim 128 (H100 80GB SXM5)"."""

H100_FLASH_ATTENTION_BACKWARD_EFFICIENCY = 322 / 989
"""FlashAttention-2's backward at head size 128 and 16k tokens on an H100 SXM5, 322 TFLOP/s: the same paper,
"Attention backward speed, head dim 128 (H100 80GB SXM5)". Taken for the causal backward too: FlashAttention-2's
own H100 figure ("Attention forward + backward speed (H100 80GB SXM5)", the repository's
`assets/flash2_h100_fwd_bwd_benchmark.png`) has forward + backward at head size 128 and 16k tokens at 338 TFLOP/s
without the mask and 328 with it, which with the causal forward's 335 puts the causal backward at 325."""

HOPPER_CALIBRATION = replace(SC21_CALIBRATION, compute_efficiency=SC21_CALIBRATION.compute_efficiency
                             * H100_MATMUL_EFFICIENCY / A100_MATMUL_EFFICIENCY,
                             attention_efficiency=H100_FLASH_ATTENTION_EFFICIENCY,
                             attention_backward_efficiency=H100_FLASH_ATTENTION_BACKWARD_EFFICIENCY)
"""SC21's constants with the GEMM efficiency of a Hopper GPU, 0.7068 x 0.801 / 0.859 = 0.659, and
FlashAttention-2's measured 0.339 (forward) and 0.326 (backward) for the attention core."""


def default_calibration(gpu: GPUSpec) -> Calibration:
    """The calibration of `gpu`'s generation (by preset name; custom GPUs get SC21's)."""
    if gpu.name.startswith("v100"):
        return PAPER_CALIBRATION
    if gpu.name.startswith(("h100", "h200", "h800")):
        return HOPPER_CALIBRATION
    return SC21_CALIBRATION
