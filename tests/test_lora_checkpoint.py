"""A LoRA run's checkpoints: the adapters and their optimizer only, naming the base; bitwise resume; any layout.

- One process, dropout 0.1 in the model and in the adapters: 3 steps, save, 3 more, against a fresh trainer
  (both generators disturbed) that loads the save: losses, gradient norms and every parameter bitwise. The
  checkpoint's model file holds exactly the adapters (and their two AdamW moments), and its metadata names the
  base (here the seeded random start) with a fingerprint.
- Saved at TP=2 with SP (2 ranks) after 2 steps, loaded by one process: the next 2 steps' losses and gradient
  norms equal the TP=2 run's own continuation within 1e-5.
- Loading adapters on another base (another seed draws another random base) is one error naming both;
  a LoRA checkpoint into a run without [lora], and a full checkpoint into a LoRA run, are one error each.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_lora_layouts import lora_config
from test_moe_parallel import full_parameters
from test_sft_layouts import train_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from multiproc import disturb_generators, run_workers


def with_dropout(**overrides):
    config = lora_config(arch="llama", micro=4, lora={"dropout": 0.1}, steps=6, **overrides)
    config.model.dropout = 0.1
    return config


def curve(trainer: Trainer, steps: int) -> list:
    return [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]


def test_resume_is_bitwise_and_saves_the_adapters_only(tmp_path):
    ctx = ParallelContext.single()
    trainer = Trainer(with_dropout(), ctx, train_data())
    curve(trainer, 3)
    saved = save_checkpoint(trainer, tmp_path)
    straight = curve(trainer, 3)
    ctx.rng = None
    resumed = Trainer(with_dropout(), ctx, train_data())
    disturb_generators(ctx)
    load_checkpoint(resumed, tmp_path)
    assert curve(resumed, 3) == straight
    after, expected = full_parameters(resumed.model), full_parameters(trainer.model)
    assert all(torch.equal(after[name], value) for name, value in expected.items())

    adapters = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora." in n for n in adapters)
    with safe_open(str(next(saved.glob("model_*.safetensors"))), framework="pt") as f:
        keys = set(f.keys())
    assert keys == {f"{kind}/{n}" for n in adapters for kind in ("model", "exp_avg", "exp_avg_sq")}
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["lora"]["base"] == "random initialization (train.seed=7)" and len(meta["lora"]["sha256"]) == 64


def save_at_tp2(path: str) -> list:
    """TP=2 with SP: 2 steps, save into `path`, 2 more; the 2 more steps' curve (every rank)."""
    ctx = ParallelContext.from_process_group(2)
    trainer = Trainer(lora_config(arch="llama", tp=2, sp=True), ctx, train_data())
    curve(trainer, 2)
    save_checkpoint(trainer, path)
    return curve(trainer, 2)


def test_a_checkpoint_saved_at_tp2_continues_on_one_process(tmp_path):
    continued = run_workers(2, save_at_tp2, str(tmp_path), timeout=300)
    assert continued[0] == continued[1]
    trainer = Trainer(lora_config(arch="llama"), ParallelContext.single(), train_data())
    load_checkpoint(trainer, tmp_path)
    for (loss, norm), (ref_loss, ref_norm) in zip(curve(trainer, 2), continued[0]):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(norm - ref_norm) <= 1e-5 * ref_norm


def test_another_base_or_no_lora_is_one_error(tmp_path):
    ctx = ParallelContext.single()
    trainer = Trainer(lora_config(arch="llama"), ctx, train_data())
    trainer.train_step()
    save_checkpoint(trainer, tmp_path / "lora")
    other_base = lora_config(arch="llama", seed=8)
    with pytest.raises(UserError, match=r"trained on the base random initialization \(train.seed=7\).*train.seed=8"):
        load_checkpoint(Trainer(other_base, ctx, train_data()), tmp_path / "lora")
    plain = lora_config(arch="llama", lora={"rank": 0})
    with pytest.raises(UserError, match="the checkpoint trained adapters but this run trains every weight"):
        load_checkpoint(Trainer(plain, ctx, train_data()), tmp_path / "lora")
    full = Trainer(plain, ctx, train_data())
    save_checkpoint(full, tmp_path / "full")
    with pytest.raises(UserError, match="the checkpoint trained every weight but this run trains adapters"):
        load_checkpoint(Trainer(lora_config(arch="llama"), ctx, train_data()), tmp_path / "full")
    assert from_dict({"lora": {"rank": 2}}).lora.rank == 2
