"""The fused output layer + cross-entropy (`linear_cross_entropy`, TP=1) equals the unfused computation.

Reference: `F.linear` over the padded weight, the padding sliced off, `F.cross_entropy` in fp32, as
the vocabulary-parallel path computes at TP=1. Checked: per-token losses and the gradients of the
hidden states and of the weight (padding rows included), with ignored targets, a loss gradient that
differs per token, chunk boundaries inside the batch, fp32 and bf16 autocast; and a GPT at TP=1
trains through it to the same losses and gradients as through the unfused head.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import shardlm.parallel.cross_entropy as cross_entropy
from shardlm.parallel.cross_entropy import linear_cross_entropy

V, V_PADDED, H = 300, 384, 32


def _inputs(rows: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, H, generator=g)
    weight = torch.randn(V_PADDED, H, generator=g) * 0.3
    weight[V:] = 0.0  # padding rows are zero, as VocabParallelEmbedding initializes them
    target = torch.randint(0, V, (rows,), generator=g)
    target[3] = target[17] = -100
    upstream = torch.rand(rows, generator=g) + 0.5  # a different loss gradient per token
    return hidden, weight, target, upstream


def _run(fused: bool, hidden, weight, target, upstream, precision: str):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        if fused:
            losses = linear_cross_entropy(hidden, weight, target, V)
        else:
            logits = F.linear(hidden, weight)[..., :V].float()
            losses = F.cross_entropy(logits, target, reduction="none")
    (losses * upstream).sum().backward()
    return losses.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 1000])
def test_fp32_equals_unfused(monkeypatch, rows_per_chunk):
    monkeypatch.setattr(cross_entropy, "_rows_per_chunk", lambda vocab: rows_per_chunk)
    inputs = _inputs()
    fused, reference = _run(True, *inputs, "fp32"), _run(False, *inputs, "fp32")
    for name, a, b in zip(("losses", "hidden grad", "weight grad"), fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert fused[0][3] == 0.0 and fused[0][17] == 0.0
    assert fused[2][V:].abs().max() == 0.0  # padding rows: zero gradient
    assert fused[1][3].abs().max() == 0.0  # an ignored token sends no gradient back


def test_bf16_autocast_matches_unfused_within_bf16_rounding():
    inputs = _inputs(rows=64)
    fused, reference = _run(True, *inputs, "bf16"), _run(False, *inputs, "bf16")
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    assert fused[2].dtype == torch.float32
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-5, atol=1e-5)  # same bf16 logits, fp32 softmax
    for a, b in zip(fused[1:], reference[1:]):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()  # bf16 GEMMs on both sides, rounded differently
    exact = _run(False, *inputs, "fp32")
    assert (fused[0] - exact[0]).abs().max() < 0.05  # and both are close to fp32


def test_bf16_parameters_without_autocast():
    hidden, weight, target, upstream = _inputs()
    fused = _run(True, hidden.bfloat16(), weight.bfloat16(), target, upstream, "fp32")
    reference = _run(False, hidden.bfloat16(), weight.bfloat16(), target, upstream, "fp32")
    assert fused[1].dtype == torch.bfloat16 and fused[2].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(fused[1:], reference[1:]):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


def test_gpt_at_tp1_trains_like_the_unfused_head():
    from shardlm.models.config import ModelConfig
    from shardlm.models.gpt import GPT
    from shardlm.parallel import ParallelContext

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=V, dropout=0.0)
    tokens = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (True, False):
        model = GPT(cfg, ParallelContext.single(), seed=5)
        assert model.padded_vocab_size > V
        if fused:
            losses = model(tokens[:, :-1], tokens[:, 1:])
        else:
            losses = model.loss(model.output_layer(model.hidden_states(tokens[:, :-1])), tokens[:, 1:])
        losses.mean().backward()
        results.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (fused_losses, fused_grads), (losses, grads) = results
    torch.testing.assert_close(fused_losses, losses, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
