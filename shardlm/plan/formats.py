"""Bytes per element of each kind of tensor (`NumericFormat`), for a precision in an implementation: shardlm's
own, the 2019 paper's Megatron, or today's Megatron-Core."""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.errors import UserError


@dataclass(frozen=True)
class NumericFormat:
    """Bytes per element of each kind of tensor, for one precision in one implementation."""

    name: str
    """"shardlm-fp32", "shardlm-bf16", "megatron-fp16", ..."""
    weight_bytes: int
    """Model weights the forward pass reads (shardlm: fp32 masters; Megatron: half copies)."""
    grad_bytes: int
    """Gradient of each weight (also the element size of the DP all-reduce)."""
    optimizer_bytes: int
    """Optimizer state per parameter: Adam's two fp32 moments, plus the fp32 master in Megatron."""
    matmul_bytes: int
    """Inputs and outputs of the GEMMs and SDPA: 4 in fp32, 2 under half precision."""
    residual_bytes: int
    """The residual stream and LayerNorm inputs (shardlm: fp32, the fp32 biases promote it)."""
    weight_cast_bytes: int
    """Half copy of each GEMM weight that autocast saves for the backward pass (0 without autocast)."""
    tp_forward_bytes: int
    """Element size of the forward TP all-reduces (outputs of the row-parallel GEMMs)."""
    tp_backward_bytes: int
    """Element size of the backward TP all-reduces (gradients of the LayerNorm outputs)."""
    adam_step_scalar: bool
    """True when the optimizer keeps a 4-byte `step` tensor per parameter tensor (torch AdamW)."""

    @property
    def half_gemms(self) -> bool:
        """shardlm computing its GEMMs in half: bf16 or fp16 autocast, with fp32 or half parameters."""
        return self.name.startswith("shardlm-") and self.matmul_bytes == 2


PRECISIONS = ("fp32", "bf16", "fp16")
IMPLEMENTATIONS = ("shardlm", "megatron", "megatron-core")


PARAM_DTYPES = ("fp32", "half")


def numeric_format(precision: str, implementation: str = "shardlm", param_dtype: str = "fp32") -> NumericFormat:
    """The byte sizes of `implementation` ("shardlm", "megatron" or "megatron-core") running in `precision`.

    "megatron-core" (today's Megatron-Core, and Meta's Llama 3 stack): half weights, gradients accumulated and
    reduced in fp32 (Megatron-Core's fp32 `main_grad`; the Llama 3 paper reduce-scatters gradients in fp32),
    fp32 master weights and moments: 2 + 4 + 12 bytes per parameter.

    `param_dtype="half"` (shardlm's `train.param_dtype`): bf16/fp16 parameters and activations, fp32
    gradient buffers (`main_grad`), fp32 master weights and moments: 2 + 4 + 12 bytes per parameter.
    """
    if param_dtype not in PARAM_DTYPES:
        raise UserError(f"--param-dtype {param_dtype!r} must be one of {', '.join(PARAM_DTYPES)}")
    if param_dtype == "half" and (precision == "fp32" or implementation != "shardlm"):
        raise UserError("--param-dtype half needs --precision bf16 or fp16 and --implementation shardlm")
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r} must be one of {', '.join(PRECISIONS)}")
    if implementation not in IMPLEMENTATIONS:
        raise UserError(f"--implementation {implementation!r} must be one of {', '.join(IMPLEMENTATIONS)}")
    name = f"{implementation}-{precision}"
    if param_dtype == "half":
        return NumericFormat(name + "-half", 2, 4, 12, 2, 2, 0, 2, 2, True)
    if precision == "fp32":
        return NumericFormat(name, 4, 4, 8, 4, 4, 0, 4, 4, implementation == "shardlm")
    if implementation == "shardlm":  # fp32 masters and grads, autocast GEMMs, fp32 residual stream
        return NumericFormat(name, 4, 4, 8, 2, 4, 2, 2, 4, True)
    if implementation == "megatron-core":  # half weights, fp32 main_grad buffers, fp32 master + moments
        return NumericFormat(name, 2, 4, 12, 2, 2, 0, 2, 2, False)
    return NumericFormat(name, 2, 2, 12, 2, 2, 0, 2, 2, False)
