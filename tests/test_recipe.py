"""The training recipe in one process: loss scaling, reduced precision, schedule, clipping, groups."""

from __future__ import annotations

import math

import pytest
import torch
from test_training import synthetic_data, tiny_config

from shardlm.parallel import ParallelContext
from shardlm.training.loss_scaler import DynamicLossScaler
from shardlm.training.optim import clip_grad_norm, learning_rate
from shardlm.training.trainer import Trainer


def make_trainer(**train) -> Trainer:
    return Trainer(tiny_config(micro=4, **train), ParallelContext.single(), synthetic_data())


def snapshot(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def inject_overflow(trainer: Trainer):
    """Make the next backward produce an inf gradient in one parameter; returns the hook handle."""
    return trainer.params[3].register_hook(lambda grad: torch.full_like(grad, float("inf")))


def test_fp16_overflow_skips_step_and_halves_scale():
    trainer = make_trainer(precision="fp16", initial_loss_scale=1024.0, hysteresis=1, loss_scale_window=3)
    clean = trainer.train_step()
    assert not clean["skipped"] and math.isfinite(clean["grad_norm"])
    before = snapshot(trainer)
    moments = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
    handle = inject_overflow(trainer)
    metrics = trainer.train_step()
    handle.remove()
    assert metrics["skipped"] and metrics["loss_scale"] == 1024.0
    assert trainer.scaler.scale == 512.0, "one overflow with hysteresis 1 halves the scale"
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(trainer))), "weights must not change"
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, trainer.optimizer.state.values()))
    assert trainer.skipped_steps == 1
    after = trainer.train_step()
    assert not after["skipped"] and after["loss_scale"] == 512.0
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(trainer))), "a clean step updates"


def test_fp16_hysteresis_delays_the_backoff_and_window_grows():
    scaler = DynamicLossScaler(initial_scale=256.0, window=2, hysteresis=2, min_scale=64.0)
    scaler.update(overflow=True)
    assert scaler.scale == 256.0, "first overflow is absorbed by hysteresis"
    scaler.update(overflow=True)
    assert scaler.scale == 128.0
    scaler.update(overflow=True)
    assert scaler.scale == 64.0
    scaler.update(overflow=True)
    assert scaler.scale == 64.0, "never below min_loss_scale"
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 128.0, "window clean steps double the scale"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_tracks_fp32(precision):
    """Half-precision matmuls on tiny shapes: losses within a few percent of fp32, still learning."""
    reference = make_trainer()
    half = make_trainer(precision=precision, initial_loss_scale=2.0**12)
    ref_losses = [reference.train_step()["loss"] for _ in range(4)]
    losses = [half.train_step()["loss"] for _ in range(4)]
    assert all(p.dtype == torch.float32 for p in half.params), "master weights stay fp32"
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / b < 0.02


def test_learning_rate_schedule():
    args = dict(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=10)
    assert [learning_rate(s, style="cosine", **args) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(4, style="cosine", **args) == pytest.approx(1.0)
    assert learning_rate(9, style="cosine", **args) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert learning_rate(14, style="cosine", **args) == pytest.approx(0.1)
    assert learning_rate(100, style="cosine", **args) == pytest.approx(0.1)
    assert learning_rate(9, style="linear", **args) == pytest.approx(0.55)
    assert learning_rate(9, style="constant", **args) == 1.0


def test_clipping_equals_torch_clip_grad_norm():
    trainer = make_trainer()
    batch = torch.from_numpy(trainer.train_data[0][None])
    trainer.model(batch[:, :-1], batch[:, 1:]).mean().backward()
    grads = [p.grad.clone() for p in trainer.params]
    norm = clip_grad_norm(trainer.params, 0.01, trainer.ctx)
    ours = [p.grad.clone() for p in trainer.params]
    for p, g in zip(trainer.params, grads):
        p.grad = g
    torch_norm = torch.nn.utils.clip_grad_norm_(trainer.params, 0.01)
    assert norm.item() == pytest.approx(torch_norm.item(), rel=1e-6)
    assert all(torch.allclose(a, p.grad, rtol=1e-6, atol=0) for a, p in zip(ours, trainer.params))


def test_no_weight_decay_on_biases_and_layernorm():
    trainer = make_trainer(weight_decay=0.1)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    assert all(p.ndim == 2 for p in decay["params"]) and "wte.weight" in decayed and "wpe" in decayed
    assert not any("ln" in n or n.endswith("bias") for n in decayed)
    assert {names[id(p)] for p in no_decay["params"]} >= {"ln_f.weight", "ln_f.bias", "layers.0.attn.qkv.bias"}


def test_scaled_init_of_residual_projections():
    trainer = Trainer(tiny_config(), ParallelContext.single(), synthetic_data())
    model = trainer.model
    layers = model.cfg.num_layers
    for layer in model.layers.values():
        assert layer.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert layer.attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.1)
        assert layer.mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.1)
