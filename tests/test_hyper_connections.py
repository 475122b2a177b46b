"""DeepSeek-V4's Sinkhorn-Knopp (`shardlm.models.hyper_connections.sinkhorn`), whose backward is written out, against
the unrolled computation differentiated by autograd (transformers' order of normalizations, eps in every sum)."""

from __future__ import annotations

import pytest
import torch

from shardlm.models.hyper_connections import sinkhorn


def unrolled(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("n,iters", [(4, 20), (2, 1), (3, 5)])
def test_sinkhorn_and_its_gradient_are_the_unrolled_ones(n, iters):
    generator = torch.Generator().manual_seed(n + iters)
    comb = (torch.randn(2, 7, n, n, generator=generator) * 2).softmax(-1) + 1e-6
    grad = torch.randn(2, 7, n, n, generator=generator)
    got, want = (comb.clone().requires_grad_() for _ in range(2))
    out, reference = sinkhorn(got, iters, 1e-6), unrolled(want, iters, 1e-6)
    assert torch.equal(out, reference)  # the same operations forward
    out.backward(grad)
    reference.backward(grad)
    assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got.grad, torch.zeros_like(got.grad), atol=1e-3)


def test_sinkhorn_gradient_in_double():
    comb = (torch.randn(1, 3, 4, 4, dtype=torch.float64).softmax(-1) + 1e-6).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 4, 1e-6), (comb,))
