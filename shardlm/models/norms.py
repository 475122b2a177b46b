"""The Llama family's norms: zero-centred RMSNorm (Qwen3-Next, Qwen3.5), the checks of where norms go
(`norm_placement`, `qk_norm_scope`), and QK-norm over whole projections (OLMo 3, MiniMax-M2), whose statistic spans
the heads of every TP rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm that scales by 1 + weight, the weight starting at zero (Qwen3-Next and Qwen3.5: weight decay pulls
    the scale toward 1, not 0); computed in fp32 as transformers does. (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (1.0 + self.weight.float())).type_as(x)


def norm_class(cfg: ModelConfig) -> type[nn.Module]:
    """The RMSNorm of a Llama-family model: zero-centred (`norm_zero_centered`) or PyTorch's."""
    return ZeroCenteredRMSNorm if cfg.norm_zero_centered else nn.RMSNorm


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


def sum_over_tensor_parallel(x: torch.Tensor, tp) -> torch.Tensor:
    """All-reduce (sum) over the TP group in the forward and in the backward (`g`, then `f`), x any shape: for a
    statistic each rank sums over its own channels and then uses on its own channels, so that each rank's gradient
    of the sum is a partial one too."""
    return copy_to_tensor_parallel(reduce_from_tensor_parallel(x, tp), tp)


def projection_mean_square(x: torch.Tensor, tp, split: bool) -> torch.Tensor:
    """Mean of squares over all channels of a projection, x (B, T, n_local) fp32 -> (B, T, 1). `split`: x is this
    rank's n_local of the projection's n_local x tp channels (its heads), so the sum of squares is all-reduced over
    TP, forward and backward (`sum_over_tensor_parallel`); otherwise x holds them all."""
    squares = x.pow(2).sum(-1, keepdim=True)
    if split and tp.size > 1:
        return sum_over_tensor_parallel(squares, tp) / (x.shape[-1] * tp.size)
    return squares / x.shape[-1]
