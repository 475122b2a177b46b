"""TR-DPO's synced reference (`rl.sync_ref_model`) goes into checkpoints at every layout and comes back at any.

At each layout of world 2 (TP=2 with SP, PP=2, FSDP DP=2, ZeRO-1 DP=2, an MoE at EP=2) an RL trainer's reference
is set to 2 x the starting weights + a shift of the parameter's own (`shift`, from its name: the norms' equal
weights differ too, so a tensor read under another's name shows), shard by shard (the same values at every
layout), and saved with the checkpoint (`reference/...` tensors beside `model/...`). A fresh trainer at the same
layout loads the checkpoint and the reference (`load_reference`: under FSDP through its sharded parameters) and
holds the saved shards bit for bit; one process loads each layout's checkpoint (resharded: TP shards joined, the
pipeline stages' files, FSDP's shards gathered when saved, each expert by its global index) and its reference is
2 x its own weights + the shift, bit for bit, every parameter. A checkpoint without a reference is refused in one
line.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from test_rl_layouts import rl_config, rl_run

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.checkpoint.reference import load_reference
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.reference import ReferenceWeights
from shardlm.training.trainer import Trainer

from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result

CASES = {"tp2 sp": layout(tp=2, sp=True), "pp2": layout(pp=2), "fsdp dp2": layout(data_sharding="full"),
         "zero dp2": layout(distributed_optimizer=True), "ep2 moe": layout(ep=2, moe=True)}


def shift(name: str) -> float:
    """A value of the parameter's own, the same at every layout (its name's)."""
    return 0.5 + zlib.crc32(name.encode()) % 997 / 997


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def with_reference(ctx, config) -> Trainer:
    """A trainer of `config` whose checkpoints keep its run's reference (as `shardlm.training.run` sets it)."""
    trainer, run = rl_run(ctx, config)
    trainer.synced_reference = run.reference
    return trainer


def save_and_reload(tp: int, pp: int, cp: int, ep: int, folder: str, name: str, **options) -> dict:
    """The reference 2 x the weights + `shift`, saved; whether a fresh trainer at this layout reads it back
    bitwise."""
    ctx = layout_context(tp, pp, cp, ep)
    config = rl_config(tp=tp, pp=pp, cp=cp, ep=ep, **options)
    trainer = with_reference(ctx, config)
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    with torch.no_grad():
        for p, r in zip(trainer.synced_reference.params, trainer.synced_reference.saved, strict=True):
            r.mul_(2.0).add_(shift(names[id(p)]))
    path = save_checkpoint(trainer, Path(folder) / name)
    fresh = with_reference(ctx, config)
    load_checkpoint(fresh, path)
    load_reference(fresh, path)
    pairs = zip(trainer.synced_reference.saved, fresh.synced_reference.saved, strict=True)
    return {"same": all(torch.equal(local(a), local(b)) for a, b in pairs), "path": str(path)}


def reference_cases(folder: str) -> dict:
    return {name: (lambda name=name, spec=spec: save_and_reload(folder=folder, name=name, **spec))
            for name, spec in CASES.items()}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synced-reference")
    return spawn_layouts(2, save_and_reload, {}, more=reference_cases, more_args=(str(folder),))


@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_comes_back_at_its_layout_and_in_one_process(world2, name):
    values = check_result(world2, name)
    assert all(v["same"] for v in values), values
    trainer = Trainer(rl_config(moe="moe" in name), ParallelContext.single(), None, None)
    trainer.synced_reference = ReferenceWeights.of(trainer)
    load_checkpoint(trainer, values[0]["path"])
    load_reference(trainer, values[0]["path"])
    saved = {id(p): r for p, r in zip(trainer.synced_reference.params, trainer.synced_reference.saved, strict=True)}
    named = dict(trainer.model.named_parameters())
    assert len(named) == len(saved)
    for name, p in named.items():
        assert torch.equal(saved[id(p)], p.detach() * 2.0 + shift(name)), name


def test_a_checkpoint_without_a_reference_is_refused(tmp_path):
    trainer = Trainer(rl_config(), ParallelContext.single(), None, None)
    path = save_checkpoint(trainer, tmp_path)  # no synced reference
    trainer.synced_reference = ReferenceWeights.of(trainer)
    with pytest.raises(UserError, match="holds no synced reference .* resume with rl.sync_ref_model=false"):
        load_reference(trainer, path)
