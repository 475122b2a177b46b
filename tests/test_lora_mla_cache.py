"""MLA's cached decoding with LoRA adapters: the cached step multiplies by kv_b's weight directly (the absorbed
query and output), so an adapter on kv_b must be folded into that weight (`W + scale B A`).

A tiny DeepSeek-V3-shaped model (`test_mla_parallel.mla_config`: q-LoRA, YaRN off, a dense first layer and a MoE
layer) with adapters of rank 4 on q_a, q_b, kv_a, kv_b and o, every B drawn non-zero so each adapter changes the
output; prompt of 5 tokens, then 7 steps of one token through the cache. fp32: the cached logits equal the
uncached forward's within 1e-5 (`rel`: ||a - b|| / ||b||), on one process.
The control drops the fold (the cached step uses kv_b's base weight alone) and must end more than 1e-3 off.
"""

from __future__ import annotations

import contextlib

import torch
from test_mla_parallel import cached_and_full as cached_and_logits
from test_mla_parallel import mla_config
from test_training import VOCAB

from shardlm.config import LoraConfig
from shardlm.lora import LoRA, add_adapters
from shardlm.models import build_model
from shardlm.models.mla import LatentAttention
from shardlm.parallel import ParallelContext

from agreement import rel

TOL = 1e-5


def model_with_adapters():
    cfg = mla_config().model
    cfg.vocab_size = VOCAB
    ctx = ParallelContext.single()
    model = build_model(cfg, ctx, seed=3)
    adapters = add_adapters(model, LoraConfig(rank=4, alpha=8.0, targets=["q_a", "q_b", "kv_a", "kv_b", "o"]), ctx,
                            seed=3)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=generator) * 0.3)
    return model.eval(), adapters


def cached_and_full(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoded steps' logits and the full forward's, after the 5-token prompt."""
    cached, full, _ = cached_and_logits(model)
    return cached[:, 5:], full[:, 5:]


@contextlib.contextmanager
def without_fold():
    """The control's bug: the absorbed step computes with kv_b's base weight, its adapter left out."""
    absorbed = LatentAttention.absorbed

    def unfolded(self, *args):
        adapter, self.kv_b.lora = self.kv_b.lora, None
        try:
            return absorbed(self, *args)
        finally:
            self.kv_b.lora = adapter

    LatentAttention.absorbed = unfolded
    try:
        yield
    finally:
        LatentAttention.absorbed = absorbed


def test_cached_steps_with_adapters_equal_the_full_forward():
    model, adapters = model_with_adapters()
    assert sum(name.endswith(".kv_b") for name in adapters) == 2 and all(isinstance(a, LoRA)
                                                                         for a in adapters.values())
    cached, full = cached_and_full(model)
    assert rel(cached, full) <= TOL, rel(cached, full)
    with without_fold():
        broken, _ = cached_and_full(model)
    assert rel(broken, full) > 1e-3, rel(broken, full)  # the fold is what the cached step needs
    for adapter in adapters.values():  # and the adapters matter: without them the logits move as much
        adapter.B.data.zero_()
    base, _ = cached_and_full(model)
    assert rel(base, full) > 1e-3
