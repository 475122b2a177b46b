"""Training equals single-process training, for every TP x DP layout, and the recipe behaves.

The 1x1 reference runs in this process; layouts 2x1 and 1x2 run in one world of 2 processes,
2x2 and 4x1 in one world of 4. Each run trains a tiny GPT for 10 steps on the same synthetic tokens
and returns its per-step losses and its final parameters gathered into the TP=1 layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardlm.config import RunConfig, from_dict
from shardlm.data.gpt_dataset import TokenArrayDataset
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

import agreement
from multiproc import run_workers

VOCAB, STEPS, LAYERS = 100, 10, 2
TOL = 1e-5
# The key bias has an exactly-zero true gradient (softmax ignores a per-query constant), so its
# computed gradient is round-off noise, which Adam with a tiny epsilon would blow up to full-size
# updates that differ between layouts. A larger epsilon keeps noise-level gradients noise-level.
ADAM_EPS = 1e-6


def tiny_config(tp: int = 1, micro: int = 8, dropout: float = 0.0, checkpointing: bool = False,
                precision: str = "fp32", **train) -> RunConfig:
    return from_dict({
        "model": {"num_layers": LAYERS, "hidden_size": 32, "num_heads": 4, "seq_length": 16, "vocab_size": VOCAB,
                  "dropout": dropout},
        "parallel": {"tensor": tp},
        "data": {"text_file": "unused"},
        "train": {"micro_batch_size": micro, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 3, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 7, "precision": precision,
                  "activation_checkpointing": checkpointing, **train},
    })


def synthetic_data(seed: int = 0) -> TokenArrayDataset:
    """A learnable stream: each token is a fixed function of the previous one, 10% noise."""
    rng = np.random.default_rng(seed)
    successor, tokens = rng.permutation(VOCAB), [0]
    for noise, noisy in zip(rng.random(4000), rng.integers(0, VOCAB, 4000)):
        tokens.append(noisy if noise < 0.1 else successor[tokens[-1]])
    return TokenArrayDataset(np.asarray(tokens), 16, seed=3, num_samples=STEPS * 8)


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter in the TP=1 layout: shards gathered over TP, vocabulary padding removed."""
    tp = trainer.ctx.tp
    out = {}
    for name, param in trainer.model.named_parameters():
        value = param.detach()
        if hasattr(param, "tensor_parallel_dim"):
            value = torch.cat(tp.all_gather(value), dim=param.tensor_parallel_dim)
        out[name] = value[:VOCAB].clone() if name == "wte.weight" else value.clone()
    return out


def train_run(ctx: ParallelContext, config: RunConfig, steps: int = STEPS):
    trainer = Trainer(config, ctx, synthetic_data())
    metrics = [trainer.train_step() for _ in range(steps)]
    # the loss and the global gradient norm (before clipping) of every step
    curve = [(m["loss"], m["grad_norm"]) for m in metrics]
    return curve, full_parameters(trainer), trainer


# -------------------------------------------------------------------------------------- in workers

def worker_layouts(layouts):
    """Train each (tp, micro) layout on the whole world; every rank returns its curve and the parameters it
    gathers (its data-parallel replica's, TP shards gathered)."""
    out = {}
    for tp, micro in layouts:
        ctx = ParallelContext.from_process_group(tp)
        losses, params, _ = train_run(ctx, tiny_config(tp=tp, micro=micro))
        out[(tp, micro)] = (losses, params)
    return out


def worker_dropout_and_comm():
    """World of 4 as TP=2 x DP=2: dropout reproducibility, checkpointing, communication counts."""
    ctx = ParallelContext.from_process_group(2)
    out = {}
    runs = {}
    for label, checkpointing in (("a", False), ("b", False), ("ckpt", True)):
        ctx.rng = None
        losses, _, _ = train_run(ctx, tiny_config(tp=2, micro=2, dropout=0.2, checkpointing=checkpointing), steps=4)
        runs[label] = losses
    out["dropout_runs"] = runs

    for checkpointing, dropout in ((False, 0.0), (True, 0.0), (True, 0.1)):
        ctx.rng = None
        config = tiny_config(tp=2, micro=4, checkpointing=checkpointing, dropout=dropout)
        trainer = Trainer(config, ctx, synthetic_data())
        batch = torch.from_numpy(np.stack([trainer.train_data[i] for i in range(4)]))
        ctx.comm.reset()
        loss = trainer.ddp(batch[:, :-1], batch[:, 1:]).mean()
        forward = ctx.comm.snapshot()
        loss.backward()
        out[f"one_pass ckpt={checkpointing} dropout={dropout}"] = {"forward": forward, "total": ctx.comm.snapshot()}
        trainer.optimizer.zero_grad()
        ctx.comm.reset()
        trainer.train_step()  # global batch 8 over DP=2 with micro 4: one micro-batch per rank
        out[f"train_step ckpt={checkpointing} dropout={dropout}"] = ctx.comm.snapshot()
        out["local_parameters"] = sum(p.numel() for p in trainer.params)
    return out


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    torch.manual_seed(0)
    return {micro: train_run(ctx, tiny_config(micro=micro))[:2] for micro in (8, 2)}


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, worker_layouts, [(2, 8), (2, 2), (1, 4), (1, 2)])


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, worker_layouts, [(2, 4), (2, 2), (4, 8), (4, 4)])


@pytest.fixture(scope="module")
def world4_dropout():
    return run_workers(4, worker_dropout_and_comm)[0]


def assert_same_run(run, ref, steps: int = STEPS):
    """A run's (curve, final parameters) equals a reference's first `steps` steps and final parameters within TOL
    (`agreement.assert_same_run`)."""
    (curve, params), (ref_curve, ref_params) = run, ref
    agreement.assert_same_run((curve, params), (ref_curve[:steps], ref_params), steps=steps, tol=TOL)


def assert_matches_reference(run, reference):
    assert_same_run(run, reference[8])


def test_gradient_accumulation_equals_full_batch_single_process(reference):
    assert_matches_reference(reference[2], reference)


@pytest.mark.parametrize("tp,micro", [(2, 8), (2, 2), (1, 4), (1, 2)], ids=["2x1", "2x1-accum", "1x2", "1x2-accum"])
def test_world2_layouts_match_single_process(world2, reference, tp, micro):
    for rank in world2:  # every rank's copy: TP shards gathered, each DP replica on its own
        assert_matches_reference(rank[(tp, micro)], reference)


@pytest.mark.parametrize("tp,micro", [(2, 4), (2, 2), (4, 8), (4, 4)], ids=["2x2", "2x2-accum", "4x1", "4x1-accum"])
def test_world4_layouts_match_single_process(world4, reference, tp, micro):
    for rank in world4:  # every rank's copy: TP shards gathered, each DP replica on its own
        assert_matches_reference(rank[(tp, micro)], reference)


def test_training_reduces_loss(reference):
    losses = [loss for loss, _ in reference[8][0]]
    assert losses[-1] < losses[0] - 0.1
    assert any(norm > 0.5 for _, norm in reference[8][0]), "clipping (at 0.5) should be exercised"


def test_dropout_same_seed_reproduces_bitwise(world4_dropout):
    runs = world4_dropout["dropout_runs"]
    assert runs["a"] == runs["b"]


def test_activation_checkpointing_gives_bitwise_identical_losses(world4_dropout):
    runs = world4_dropout["dropout_runs"]
    assert runs["ckpt"] == runs["a"]


def test_dropout_changes_the_computation(world4_dropout, reference):
    assert world4_dropout["dropout_runs"]["a"][1][0] != pytest.approx(reference[8][0][1][0], rel=1e-4)


def recomputed_all_reduces(checkpointing: bool, dropout: float) -> int:
    """All-reduces that activation checkpointing adds to the backward pass. PyTorch's checkpoint
    stops recomputing once every saved activation is back: with dropout the residual-dropout mask
    after the MLP's all-reduce is needed, so both of a layer's all-reduces rerun (2L); without it the
    recomputation stops before the MLP's all-reduce (L)."""
    if not checkpointing:
        return 0
    return 2 * LAYERS if dropout > 0 else LAYERS


CASES = [(False, 0.0), (True, 0.0), (True, 0.1)]


@pytest.mark.parametrize("checkpointing,dropout", CASES)
def test_tensor_parallel_all_reduces_per_layer(world4_dropout, checkpointing, dropout):
    """2L all-reduces forward, 2L backward (plus the recomputed ones under checkpointing), plus the
    embedding (1 forward), the tied LM head (1 backward) and the cross-entropy (1 SUM + 1 MAX)."""
    counts = world4_dropout[f"one_pass ckpt={checkpointing} dropout={dropout}"]
    forward, total = counts["forward"], counts["total"]
    assert forward["all_reduce/tp"]["calls"] == 2 * LAYERS + 1 + 1
    assert forward["all_reduce_max/tp"]["calls"] == 1
    backward = total["all_reduce/tp"]["calls"] - forward["all_reduce/tp"]["calls"]
    assert backward == 2 * LAYERS + 1 + recomputed_all_reduces(checkpointing, dropout)
    assert total["all_reduce_max/tp"]["calls"] == 1
    # layer all-reduces carry micro x seq x hidden fp32 values each
    layer_bytes = 4 * 16 * 32 * 4
    ce_bytes = 2 * 4 * 16 * 4  # target logit + sum(exp) per token
    embedding_bytes = layer_bytes
    assert forward["all_reduce/tp"]["bytes"] == 2 * LAYERS * layer_bytes + embedding_bytes + ce_bytes


@pytest.mark.parametrize("checkpointing,dropout", CASES)
def test_train_step_communication_is_documented(world4_dropout, checkpointing, dropout):
    stats = world4_dropout[f"train_step ckpt={checkpointing} dropout={dropout}"]
    per_pass = (2 * LAYERS + 2) + (2 * LAYERS + 1) + recomputed_all_reduces(checkpointing, dropout)
    assert stats["all_reduce/tp"]["calls"] == per_pass + 1  # + the global grad-norm scalar
    assert stats["all_reduce_max/tp"]["calls"] == 1
    # DP: every local gradient exactly once (in DDP buckets), plus the logged loss scalar
    assert stats["all_reduce/dp"]["elements"] == world4_dropout["local_parameters"] + 1
    assert stats["all_reduce/dp"]["calls"] >= 2
