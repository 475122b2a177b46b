"""DeepSeek-V4's manifold-constrained hyper-connections: the residual is n_hc streams (B, T, n, h) instead of one.

Before each attention or MLP branch a small projection of the RMS-normalized, flattened streams gives, per token,
    pre  = sigmoid(scale_0 x w_pre + b_pre) + eps                    (n,)    collapses the streams into the input
    post = 2 sigmoid(scale_1 x w_post + b_post)                      (n,)    spreads the output over the streams
    comb = Sinkhorn(softmax(scale_2 x w_comb + b_comb) + eps)        (n, n)  mixes the streams themselves
and the block computes streams' = post (x) branch(sum_j pre_j stream_j) + comb^T streams. Sinkhorn-Knopp runs as
transformers' DeepseekV4HyperConnection does: one column normalization, then `iters - 1` row-then-column rounds,
each sum with eps added. The model's end collapses the streams once more (`HyperHead`: a sigmoid weight per stream).

Everything is per token, in fp32, with parameters replicated over TP: under sequence parallelism the streams are
(B, T / tp, n, h) chunks, like the residual, and the parameters are marked `sequence_parallel` (their gradients
are partial sums over TP, which the trainer adds up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.config import ModelConfig
from shardlm.models.norms import rms_norm, rms_norm_fp32
from shardlm.parallel.init import normal_shard, param_seed


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., d) divided by its root mean square (fp32 statistic), as transformers' DeepseekV4UnweightedRMSNorm. An
    fp32 x takes `norms.rms_norm` (on the CPU its written-out backward: the same forward, bitwise)."""
    if x.dtype == torch.float32:
        return rms_norm(x, None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """(..., n, n) positive matrices -> nearly doubly stochastic ones: columns normalized once, then `iters - 1`
    rounds of rows then columns, every sum plus eps (transformers' order). Differentiable (`_Sinkhorn`)."""
    return _Sinkhorn.apply(comb, iters, eps)


def sinkhorn_steps(iters: int) -> list[int]:
    """The dimension each normalization sums over, in order: columns (-2), then rows (-1) and columns per round."""
    return [-2] + [-1, -2] * (iters - 1)


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp with its backward written out: each step y = x / d, d = x.sum(dim) + eps, has
    dx = (dy - (dy * y).sum(dim)) / d, for 2 iters - 1 steps (39 at DeepSeek-V4's 20) in every branch of every layer.
    The steps run on the matrices moved to the front, (n, n, ...): each sum then adds n contiguous vectors over the
    tokens instead of reducing n numbers per token, about 5x faster an operation at n = 4, and the backward is three
    operations a step where autograd's unrolled graph makes about three times as many (1.2 against 5.9 ms forward and
    backward at the bench's 1,024 tokens). Keeps each step's y and d."""

    @staticmethod
    def forward(ctx, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        x = comb.movedim((-2, -1), (0, 1)).contiguous()  # (n rows, n columns, ...)
        saved = []
        for dim in sinkhorn_steps(iters):
            d = x.sum(dim=dim + 2, keepdim=True).add_(eps)  # -2 (over rows) -> 0, -1 (over columns) -> 1
            x = x / d
            saved += [x, d]
        ctx.save_for_backward(*saved)
        ctx.iters = iters
        return x.movedim((0, 1), (-2, -1)).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        grad = grad.movedim((-2, -1), (0, 1)).contiguous()
        for k, dim in reversed(list(enumerate(sinkhorn_steps(ctx.iters)))):
            y, d = saved[2 * k], saved[2 * k + 1]
            grad = (grad - (grad * y).sum(dim=dim + 2, keepdim=True)).div_(d)
        return grad.movedim((0, 1), (-2, -1)).contiguous(), None, None


def _mark(module: nn.Module, sequence_parallel: bool) -> None:
    """Mark the parameters of a per-token module that sees sequence chunks (partial gradients over TP)."""
    if sequence_parallel:
        for param in module.parameters():
            param.sequence_parallel = True


class HyperConnection(nn.Module):
    """The weights of one branch: `fn` ((2 + n) n, n h), `base` ((2 + n) n,), `scale` (3,), transformers' names.
    forward(streams (B, T, n, h)) -> (post (B, T, n), comb (B, T, n, n), collapsed input (B, T, h))."""

    def __init__(self, cfg: ModelConfig, ctx, seed: int, prefix: str, sequence_parallel: bool):
        super().__init__()
        n, h = cfg.hc_mult, cfg.hidden_size
        self.n, self.iters, self.eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.layernorm_epsilon
        self.fn = nn.Parameter(normal_shard(((2 + n) * n, n * h), cfg.init_std, param_seed(seed, f"{prefix}.fn"),
                                            device=ctx.device))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, device=ctx.device))
        self.scale = nn.Parameter(torch.ones(3, device=ctx.device))
        _mark(self, sequence_parallel)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, n, _ = streams.shape
        mixes = F.linear(unweighted_rms_norm(streams.reshape(B, T, -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(B, T, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def expand(output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams after a branch: post (B, T, n) x output (B, T, h) on each stream plus comb^T (B, T, n, n) times
    the streams (B, T, n, h) -> (B, T, n, h)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    """The model's last collapse and final RMSNorm: streams (B, T, n, h) -> (B, T, h). Parameters `fn` (n, n h),
    `base` (n,), `scale` (1,) (transformers' hc_head.hc_fn, hc_base, hc_scale) and `weight` (h,) (its norm). Each
    multi-token-prediction depth has one of its own (`prefix` "mtp.k.head")."""

    def __init__(self, cfg: ModelConfig, ctx, seed: int, sequence_parallel: bool, prefix: str = "ln_f"):
        super().__init__()
        n, h = cfg.hc_mult, cfg.hidden_size
        self.eps, self.norm_eps = cfg.hc_eps, cfg.layernorm_epsilon
        self.fn = nn.Parameter(normal_shard((n, n * h), cfg.init_std, param_seed(seed, f"{prefix}.fn"),
                                            device=ctx.device))
        self.base = nn.Parameter(torch.zeros(n, device=ctx.device))
        self.scale = nn.Parameter(torch.ones(1, device=ctx.device))
        self.weight = nn.Parameter(torch.ones(h, device=ctx.device))
        _mark(self, sequence_parallel)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        B, T = streams.shape[:2]
        mixes = F.linear(unweighted_rms_norm(streams.reshape(B, T, -1).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        x = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return rms_norm_fp32(x, self.weight, self.norm_eps)
