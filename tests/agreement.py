"""How the layout tests measure agreement with one process, on every kind of CPU.

A layout sums in another order than one process, and so does every kind of CPU kernel (AVX2's and
AVX-512's vector widths; `ATEN_CPU_CAPABILITY` picks them), so fp32 results agree to a few units in the
last place per operation, never bit for bit. The measures here stay meaningful for every tensor:

- `rel`: ||a - b|| / ||b||, for outputs and gradients of one step.
- `trained_rel`: for a parameter after `steps` AdamW steps. AdamW moves each element by about the
  learning rate per step whatever the gradient's size, so an element whose gradient nearly cancels (a sum
  of many terms near zero: its rounding is the kernels' summation order) still takes a full-sized step,
  in a direction the rounding decides. Relative to ||b|| alone, a tensor that started at zero (a bias)
  and moved a few steps has a small norm, and that noise crosses 1e-5 of it on one kind of CPU and not
  on another (a packed SFT run's `layers.2.mlp.fc.bias`: 1.1e-5 at TP=2 on an AVX2-only
  EPYC, 0.7e-5 at CP=2 on an AVX-512 one). So the
  error is measured against the larger of ||b|| and the distance AdamW can move the tensor,
  `LR * steps * sqrt(numel)`: for weights and norms ||b|| is the larger and nothing changes; for a
  tensor near zero the bound is the same fraction of its training movement as for every other tensor.
  A real error (a missing reduction, a wrong shard) moves elements by a whole step: 1e-2 to 1 of it.
"""

from __future__ import annotations

import torch

LR = 3e-3
"""The peak learning rate of every layout test's AdamW run."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a tensor: ||a - b|| / ||b|| (L2 over all its elements)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def trained_rel(a: torch.Tensor, b: torch.Tensor, steps: int, lr: float = LR) -> float:
    """Error of a parameter after `steps` AdamW steps of at most `lr`: ||a - b|| over the larger of ||b||
    and AdamW's reach, lr * steps * sqrt(numel) (see the module docstring for why)."""
    a, b = a.float(), b.float()
    scale = max(b.norm().item(), lr * steps * b.numel() ** 0.5, 1e-12)
    return (a - b).norm().item() / scale


def trained_errors(params: dict, ref_params: dict, steps: int) -> dict[str, float]:
    """`trained_rel` of every parameter of the reference, by name."""
    return {name: trained_rel(params[name], ref_params[name], steps) for name in ref_params}


def assert_trained_but_off(curve: list, params: dict, ref_params: dict, steps: int, part: str,
                           bound: float = 1e-3) -> None:
    """A control's broken run: it trained all `steps` steps to finite losses (a crash is not the mismatch looked
    for), and the parameters whose names contain `part` end more than `bound` (`trained_rel`) from the reference."""
    import math

    assert len(curve) == steps and all(math.isfinite(step[0]) for step in curve), curve
    errors = trained_errors(params, ref_params, steps)
    assert max(error for name, error in errors.items() if part in name) > bound, errors


def assert_trained_parameters(params: dict, ref_params: dict, steps: int, tol: float = 1e-5,
                              where: str = "") -> None:
    """The same parameter names, and every one within `tol` of the reference by `trained_rel`; the
    message names the worst."""
    assert params.keys() == ref_params.keys(), f"{where}: {sorted(params.keys() ^ ref_params.keys())}"
    errors = trained_errors(params, ref_params, steps)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{where} final parameter {worst} differs by {errors[worst]:.2e}"
