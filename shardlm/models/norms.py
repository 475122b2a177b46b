"""The Llama family's norms: RMSNorm (`rms_norm`, `RMSNorm`), zero-centred RMSNorm (Qwen3-Next, Qwen3.5), the checks
of where norms go (`norm_placement`, `qk_norm_scope`), and QK-norm over whole projections (OLMo 3, MiniMax-M2), whose
statistic spans the heads of every TP rank."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.parallel import invariant, sum_over

# Under bf16 autocast with fp32 norm weights (a QK-norm after autocast's GEMMs), F.rms_norm takes its composite path
# and says so once per process: the result is the documented one, so the performance note stays out of users' logs.
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning,
                        module="torch.nn.functional")


class _RMSNorm(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, fp32, with the backward written out: on the CPU
    `F.rms_norm` is a composite that autograd differentiates piece by piece (about 15 passes over x in the backward,
    and it saves the normalized x too); this backward takes 9 and saves only x and the (..., 1) statistic. The
    forward computes what F.rms_norm computes, in its order: the same output, bitwise. x (..., d), weight (d,) or
    None -> (..., d)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        rstd = x.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        y = x * rstd
        return y if weight is None else y.mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x * rstd
        weight_grad = None
        if weight is not None and ctx.needs_input_grad[1]:
            weight_grad = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
        if weight is not None:
            grad = grad * weight
        x_grad = None
        if ctx.needs_input_grad[0]:  # rstd (grad - normed mean(grad normed))
            dot = torch.linalg.vecdot(grad, normed).unsqueeze(-1)
            x_grad = torch.addcmul(grad, normed, dot, value=-1.0 / x.shape[-1]).mul_(rstd)
        return x_grad, weight_grad, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """`F.rms_norm` over x's last dimension, x (..., d), weight (d,) or None; eps None: x's dtype's epsilon (as
    nn.RMSNorm). fp32 on the CPU takes `_RMSNorm` (F.rms_norm's output bitwise, its gradients within rounding, in
    less time and memory); other dtypes and devices (CUDA has a fused kernel), and batch-invariant runs
    (`shardlm.parallel.invariant`), take `F.rms_norm`."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    if (x.device.type != "cpu" or x.dtype != torch.float32 or invariant.enabled()
            or (weight is not None and weight.dtype != torch.float32)):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm` computed in fp32 (as transformers keeps Gemma 4's and DeepSeek-V4's norms), x (..., d) -> (..., d)
    in x's dtype."""
    return rms_norm(x.float(), None if weight is None else weight.float(), eps).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm over the last dimension through `rms_norm` (same parameters and state dict), (..., d) -> (..., d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class FP32RMSNorm(nn.RMSNorm):
    """nn.RMSNorm computed in fp32 (`rms_norm_fp32`: Gemma4RMSNorm, DeepSeek-V4's norms), (..., d) -> (..., d) in
    the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm that scales by 1 + weight, the weight starting at zero (Qwen3-Next and Qwen3.5: weight decay pulls
    the scale toward 1, not 0); computed in fp32 as transformers does. (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).type_as(x)


def norm_class(cfg: ModelConfig) -> type[nn.Module]:
    """The RMSNorm of a Llama-family model: zero-centred (`norm_zero_centered`) or plain (`RMSNorm`)."""
    return ZeroCenteredRMSNorm if cfg.norm_zero_centered else RMSNorm


def check_norm_options(cfg: ModelConfig) -> None:
    """One-line UserErrors for `norm_placement` / `qk_norm_scope` settings a Llama-family model does not compute."""
    if cfg.norm_placement not in ("pre", "post"):
        raise UserError(f'model.norm_placement="{cfg.norm_placement}" must be "pre" or "post"')
    from shardlm.models.gemma_config import check_gemma_keys

    check_gemma_keys(cfg)
    if cfg.qk_norm_scope not in ("head", "projection"):
        raise UserError(f'model.qk_norm_scope="{cfg.qk_norm_scope}" must be "head" or "projection"')
    if cfg.qk_norm_scope == "projection" and not cfg.qk_norm:
        raise UserError('model.qk_norm_scope="projection" says how the q and k norms cover the heads, and there are '
                        "none: set model.qk_norm = true, or remove qk_norm_scope")


def projection_mean_square(x: torch.Tensor, tp, split: bool) -> torch.Tensor:
    """Mean of squares over all channels of a projection, x (B, T, n_local) fp32 -> (B, T, 1). `split`: x is this
    rank's n_local of the projection's n_local x tp channels (its heads), so the sum of squares is all-reduced over
    TP, forward and backward (`sum_over`); otherwise x holds them all."""
    squares = x.pow(2).sum(-1, keepdim=True)
    if split and tp.size > 1:
        return sum_over(squares, tp) / (x.shape[-1] * tp.size)
    return squares / x.shape[-1]
