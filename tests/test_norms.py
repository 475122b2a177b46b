"""shardlm's RMSNorm (`shardlm.models.norms.rms_norm`): its hand-written backward against autograd's numerical
gradient, and the whole function against PyTorch's `F.rms_norm`, forward and gradients, where it takes its own path
(fp32 on the CPU) and where it hands over (other dtypes, batch-invariant runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlm.models.norms import RMSNorm, ZeroCenteredRMSNorm, _RMSNorm, rms_norm
from shardlm.parallel import invariant

pytestmark = pytest.mark.timeout(120)


def test_backward_matches_the_numerical_gradient():
    """gradcheck in float64 (x of two leading dimensions, with and without a weight)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: _RMSNorm.apply(a, w, 1e-5), (x, weight))
    assert torch.autograd.gradcheck(lambda a: _RMSNorm.apply(a, None, 1e-5), (x,))


@pytest.mark.parametrize("with_weight", [True, False])
def test_equals_pytorch_in_fp32(with_weight):
    """The output bitwise and both gradients within fp32 rounding of `F.rms_norm`, on rows of unequal scale."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 32, 64, generator=generator) * torch.rand(4, 32, 1, generator=generator) * 10)
    weight = torch.randn(64, generator=generator) if with_weight else None
    grad = torch.randn(4, 32, 64, generator=generator)
    results = []
    for norm in (rms_norm, lambda a, w, eps: F.rms_norm(a, (64,), w, eps)):
        a = x.clone().requires_grad_()
        w = None if weight is None else weight.clone().requires_grad_()
        y = norm(a, w, 1e-6)
        y.backward(grad)
        results.append((y, a.grad, None if w is None else w.grad))
    (ours, ours_x, ours_w), (ref, ref_x, ref_w) = results
    assert torch.equal(ours, ref)  # the forward is F.rms_norm's, bitwise
    torch.testing.assert_close(ours_x, ref_x, rtol=1e-5, atol=1e-5)
    if with_weight:
        torch.testing.assert_close(ours_w, ref_w, rtol=1e-5, atol=1e-4)


def test_modules_and_frozen_weights():
    """`RMSNorm` keeps nn.RMSNorm's parameter and state dict and computes F.rms_norm; its default eps is the dtype's
    (as nn.RMSNorm's); a frozen weight gets no gradient and x's gradient is unchanged; the zero-centred norm scales
    by 1 + weight."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(6, 24, generator=generator, requires_grad=True)
    norm = RMSNorm(24)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=generator)
    assert list(norm.state_dict()) == ["weight"]
    torch.testing.assert_close(norm(x), F.rms_norm(x, (24,), norm.weight), rtol=1e-5, atol=1e-6)
    trained_grad = torch.autograd.grad(norm(x).square().sum(), x)[0]
    norm.weight.requires_grad_(False)
    y = norm(x)
    y.square().sum().backward()
    assert norm.weight.grad is None
    torch.testing.assert_close(x.grad, trained_grad, rtol=0, atol=0)
    centred = ZeroCenteredRMSNorm(24)
    with torch.no_grad():
        centred.weight.copy_(norm.weight - 1.0)
    torch.testing.assert_close(centred(x), norm(x), rtol=1e-6, atol=1e-6)


def test_other_dtypes_and_invariant_runs_take_pytorchs_norm():
    """bf16 (and a bf16 weight) and batch-invariant runs compute exactly `F.rms_norm`."""
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(8, 32, generator=generator), torch.randn(32, generator=generator)
    reference = F.rms_norm(x.bfloat16(), (32,), weight.bfloat16(), 1e-6)
    assert torch.equal(rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6), reference)
    with invariant.batch_invariant():
        assert torch.equal(rms_norm(x, weight, 1e-6), F.rms_norm(x, (32,), weight, 1e-6))



def test_a_bf16_input_with_an_fp32_weight_says_nothing():
    """A QK-norm after autocast's GEMMs: bf16 x, fp32 weight. F.rms_norm takes its composite path and torch notes so
    once per process in a UserWarning, which `shardlm.models.norms` keeps out of users' logs (its result is the
    documented one). In a fresh process each: through shardlm, nothing on stderr; torch alone (the control) says it."""
    import subprocess
    import sys

    norm = "x = torch.randn(2, 8).bfloat16(); w = torch.rand(8) + 0.5; "
    runs = {"shardlm": f"import torch; from shardlm.models.norms import rms_norm; {norm}rms_norm(x, w, 1e-6)",
            "torch": f"import torch; import torch.nn.functional as F; {norm}F.rms_norm(x, (8,), w, 1e-6)"}
    said = {name: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
            for name, code in runs.items()}
    assert "Mismatch dtype" in said["torch"], said["torch"]
    assert "Mismatch dtype" not in said["shardlm"], said["shardlm"]
