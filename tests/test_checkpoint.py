"""Checkpoints: exact resume (dropout on, both generators disturbed; losses, gradient norms and every parameter
on every rank bitwise), resume on other layouts, crash safety, verification, HF interop.

Reference runs are 1x1 in this process; layouts 2x1 and 1x2 run in one world of 2 processes, 4x1 and
2x2 in one world of 4. Checkpoints travel between them through a temporary folder.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_training import synthetic_data, tiny_config

from shardlm.checkpoint import load_checkpoint, load_model, save_checkpoint
from shardlm.checkpoint import state as checkpoint_state
from shardlm.cli import main
from shardlm.errors import CheckpointWriteError, UserError
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from multiproc import disturb_generators, run_workers

TOL = 1e-5
HALF = 3  # steps before the checkpoint; as many after


def trainer_for(ctx: ParallelContext, tp: int = 1, dropout: float = 0.0) -> Trainer:
    ctx.rng = None
    dp = ctx.world_size // tp
    return Trainer(tiny_config(tp=tp, micro=8 // dp // 2 or 1, dropout=dropout), ctx, synthetic_data())


def losses(trainer: Trainer, steps: int) -> list[float]:
    return [trainer.train_step()["loss"] for _ in range(steps)]


def curve(trainer: Trainer, steps: int) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]


def exact_resume(ctx: ParallelContext, tp: int, folder: str) -> dict:
    """Uninterrupted vs save at HALF + fresh trainer (both generators disturbed) + load, with dropout on: this
    rank's losses and gradient norms after HALF, and whether each of its parameters ends bitwise equal."""
    straight = trainer_for(ctx, tp, dropout=0.2)
    full = curve(straight, 2 * HALF)
    first = trainer_for(ctx, tp, dropout=0.2)
    losses(first, HALF)
    save_checkpoint(first, folder)
    resumed = trainer_for(ctx, tp, dropout=0.2)
    disturb_generators(ctx)
    load_checkpoint(resumed, folder)
    resumed_curve = curve(resumed, HALF)
    same = all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True))
    return {"full": full[HALF:], "resumed": resumed_curve, "same_parameters": same}


def continue_from(ctx: ParallelContext, tp: int, folder: str) -> list[float]:
    trainer = trainer_for(ctx, tp)
    load_checkpoint(trainer, folder)
    assert trainer.step == HALF
    return losses(trainer, HALF)


def worker_layouts(world: int, folders: dict) -> dict:
    ctx_by_tp = {}
    out = {}

    def ctx(tp):
        if tp not in ctx_by_tp:
            ctx_by_tp[tp] = ParallelContext.from_process_group(tp)
        return ctx_by_tp[tp]

    if world == 2:
        out["1x1->2x1"] = continue_from(ctx(2), 2, folders["1x1"])
        trainer = trainer_for(ctx(2), 2)
        losses(trainer, HALF)
        save_checkpoint(trainer, folders["2x1"])
        out["2x1->1x2"] = continue_from(ctx(1), 1, folders["2x1"])
        out["exact 2x1"] = ctx(2).world.all_gather_object(exact_resume(ctx(2), 2, folders["exact"]))
        model, _ = load_model(folders["hf_file"], ctx(2))
        x = torch.load(folders["hf_input"])
        with torch.no_grad():
            out["hf_logits_tp2"] = model.full_logits(model(x))
    else:
        out["1x1->4x1"] = continue_from(ctx(4), 4, folders["1x1"])
        trainer = trainer_for(ctx(4), 4)
        losses(trainer, HALF)
        save_checkpoint(trainer, folders["4x1"])
        out["4x1->2x2"] = continue_from(ctx(2), 2, folders["4x1"])
        out["exact 2x2"] = ctx(2).world.all_gather_object(exact_resume(ctx(2), 2, folders["exact"]))
        out["verification"] = distributed_verification(ctx(4), folders["4x1"], folders["exact"] + "-damaged")
    return out if ctx(1).rank == 0 else None


def distributed_verification(ctx: ParallelContext, checkpoint: str, damaged: str) -> dict:
    """Load a 4-shard checkpoint on 4 ranks counting sha256 passes, then damage one shard of a copy:
    every rank must refuse it, naming the same file."""
    import shutil
    from pathlib import Path

    from shardlm.checkpoint import files

    hashed = []
    real_sha = files.sha256_of
    files.sha256_of = lambda path: hashed.append(Path(path).name) or real_sha(path)
    load_checkpoint(trainer_for(ctx, 4), checkpoint)
    files.sha256_of = real_sha
    if ctx.rank == 0:
        shutil.copytree(files.resolve(checkpoint), damaged)
        shard = Path(damaged) / "model_tp02.safetensors"
        data = bytearray(shard.read_bytes())
        data[-10] ^= 0xFF
        shard.write_bytes(bytes(data))
    ctx.world.barrier()
    try:
        load_checkpoint(trainer_for(ctx, 4), damaged)
        error = None
    except UserError as exc:
        error = str(exc)
    return {"hashed": _gather_names(ctx, hashed), "errors": _gather_names(ctx, [error or ""])}


def _gather_names(ctx: ParallelContext, names: list[str]) -> list[list[str]]:
    """Every rank's list, on every rank."""
    import torch.distributed as dist

    out = [None] * ctx.world_size
    dist.all_gather_object(out, names)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: str(root / name) for name in ("1x1", "2x1", "4x1", "exact", "hf", "hf_file", "hf_input")}


@pytest.fixture(scope="module")
def reference(folders):
    ctx = ParallelContext.single()
    full = losses(trainer_for(ctx), 2 * HALF)
    trainer = trainer_for(ctx)
    losses(trainer, HALF)
    save_checkpoint(trainer, folders["1x1"])
    return full[HALF:]


@pytest.fixture(scope="module")
def hf_model(folders):
    transformers = pytest.importorskip("transformers")
    from shardlm.checkpoint.hf import from_hf

    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                     activation_function="gelu_new", bos_token_id=299, eos_token_id=299)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folders["hf"], safe_serialization=True)
    from_hf(folders["hf"], folders["hf_file"])
    x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.save(x, folders["hf_input"])
    with torch.no_grad():
        return model, x, model(x).logits


@pytest.fixture(scope="module")
def world2(folders, reference, hf_model):
    return run_workers(2, worker_layouts, 2, {**folders, "exact": folders["exact"] + "-w2"})[0]


@pytest.fixture(scope="module")
def world4(folders, reference):
    return run_workers(4, worker_layouts, 4, {**folders, "exact": folders["exact"] + "-w4"})[0]


def assert_close(values, expected):
    assert len(values) == len(expected)
    for a, b in zip(values, expected):
        assert abs(a - b) <= TOL * abs(b), f"{values} vs {expected}"


def assert_exact(per_rank: list[dict]) -> None:
    """On every rank: the resumed losses and gradient norms equal the uninterrupted ones, and every parameter,
    bitwise."""
    for rank, result in enumerate(per_rank):
        assert result["resumed"] == result["full"], f"rank {rank}"
        assert result["same_parameters"], f"rank {rank}"


def test_exact_resume_single_process_is_bitwise(tmp_path):
    assert_exact([exact_resume(ParallelContext.single(), 1, str(tmp_path))])


@pytest.mark.parametrize("key", ["exact 2x1"])
def test_exact_resume_tensor_parallel_is_bitwise(world2, key):
    assert_exact(world2[key])


def test_exact_resume_tp_and_dp_is_bitwise(world4):
    assert_exact(world4["exact 2x2"])


@pytest.mark.parametrize("key", ["1x1->2x1", "2x1->1x2"])
def test_resume_on_another_layout_world2(world2, reference, key):
    assert_close(world2[key], reference)


@pytest.mark.parametrize("key", ["1x1->4x1", "4x1->2x2"])
def test_resume_on_another_layout_world4(world4, reference, key):
    assert_close(world4[key], reference)


def test_each_shard_is_hashed_once_across_ranks(world4):
    hashed = world4["verification"]["hashed"]
    # 4 shards, 4 ranks: each rank hashes its own shard file and its RNG file, nothing else
    assert [sorted(h) for h in hashed] == [sorted([f"model_tp{r:02d}.safetensors", f"rng_rank{r:05d}.safetensors"])
                                           for r in range(4)]


def test_corrupt_shard_is_named_on_every_rank(world4):
    errors = [e[0] for e in world4["verification"]["errors"]]
    assert all("model_tp02.safetensors" in e and "sha256" in e for e in errors), errors


def test_hf_logits_match_transformers_at_tp1_and_tp2(hf_model, folders, world2):
    _, x, expected = hf_model
    model, _ = load_model(folders["hf_file"], ParallelContext.single())
    with torch.no_grad():
        ours = model.full_logits(model(x))
    assert (ours - expected).abs().max().item() < 1e-4
    assert (world2["hf_logits_tp2"] - expected).abs().max().item() < 1e-4


def test_hf_round_trip_is_lossless(hf_model, folders, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, _, _ = hf_model
    assert main(["convert", "--to-hf", str(tmp_path / "back"), "--checkpoint", folders["hf_file"]]) == 0
    again = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "back")).eval()
    original, restored = model.state_dict(), again.state_dict()
    for name, value in original.items():
        if name.endswith(("attn.bias", "attn.masked_bias")):
            continue
        assert torch.equal(value, restored[name]), name


def test_consolidate_inspect_and_load(tmp_path, reference, folders, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "convert", folders["1x1"], "--output", str(out)]) == 0
    assert main(["checkpoint", "inspect", folders["1x1"], "--json"]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert info["step"] == HALF and info["tensor_parallel"] == 1 and info["files_verified"] == 2
    consolidated, _ = load_model(out, ParallelContext.single())
    sharded, _ = load_model(folders["1x1"], ParallelContext.single())
    for (name, a), (_, b) in zip(consolidated.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name
    assert consolidated.wte.weight.shape[0] == consolidated.padded_vocab_size


# ------------------------------------------------------------------------------- crash safety

def saved(tmp_path, steps: int = 1, keep_last: int = 2):
    trainer = trainer_for(ParallelContext.single())
    for _ in range(steps):
        trainer.train_step()
        save_checkpoint(trainer, tmp_path, keep_last=keep_last)
    return trainer


def test_keep_last_n(tmp_path):
    saved(tmp_path, steps=4, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    trainer = saved(tmp_path, steps=1)
    trainer.train_step()
    calls = []

    def crash_on_second_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(tensors, path, metadata=metadata)

    real_save = checkpoint_state.save_file
    monkeypatch.setattr(checkpoint_state, "save_file", crash_on_second_file)
    with pytest.raises(CheckpointWriteError, match=r"step 2: .*/\.tmp-step_00000002/rng_rank00000\.safetensors: "
                       r"disk full; nothing was published; the last good checkpoint is step 1"):
        save_checkpoint(trainer, tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]  # the unfinished folder too
    fresh = trainer_for(ParallelContext.single())
    assert load_checkpoint(fresh, tmp_path)["step"] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_file_is_named(tmp_path, damage):
    saved(tmp_path)
    target = tmp_path / "step_00000001" / "model_tp00.safetensors"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    else:
        target.unlink()
    with pytest.raises(UserError, match="model_tp00.safetensors"):
        load_checkpoint(trainer_for(ParallelContext.single()), tmp_path)


def test_incompatible_model_is_refused(tmp_path):
    saved(tmp_path)
    other = Trainer(tiny_config(), ParallelContext.single(), synthetic_data())
    other.config.model.hidden_size = 64
    with pytest.raises(UserError, match="model.hidden_size=32"):
        load_checkpoint(other, tmp_path)


def test_checkpoint_files_follow_the_umask(tmp_path):
    """safetensors creates its files 0600; checkpoints must be readable by a team sharing the filesystem."""
    import os

    previous = os.umask(0o022)
    try:
        saved(tmp_path)
        out = tmp_path / "model.safetensors"
        assert main(["checkpoint", "convert", str(tmp_path), "--output", str(out)]) == 0
    finally:
        os.umask(previous)
    written = list((tmp_path / "step_00000001").glob("*.safetensors")) + [out]
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o644)}
