"""Checkpoint directories on disk: atomic publication, manifests with checksums, `latest`, retention.

    CHECKPOINT_DIR/
      latest                      "step_00000100" (replaced atomically, after the directory is complete)
      step_00000100/
        meta.json                 step, layout, config, trainer counters, tensor table, file manifest
        model_tp00.safetensors    TP rank 0's parameters and Adam moments (written by its DP rank 0)
        rng_rank00000.safetensors every rank's generator states

A save writes into `.tmp-step_00000100/`, flushes every file to disk, then renames the directory and
finally updates `latest`: a crash at any point leaves the previous checkpoint and `latest` intact.
Each file's size and sha256 are in the manifest; a load verifies them (hashing each file on one rank
only) and names the bad file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from shardlm.errors import UserError

LATEST = "latest"
META = "meta.json"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ordinary_permissions(path: Path) -> None:
    """Give `path` the permissions of a newly created file under the current umask (safetensors creates its
    files 0600, which would hide checkpoints from the rest of a team sharing a filesystem)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_atomically(path: Path, write) -> Path:
    """`write(tmp)` into a hidden temporary file beside `path`, give it ordinary permissions, flush it to
    disk and rename it over `path`: a crash leaves the old file or none, never half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        ordinary_permissions(tmp)
        fsync_file(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


def write_consolidated(path: Path, tensors: dict, config: dict, step: int = 0) -> Path:
    """A consolidated checkpoint file: every tensor at TP=1 under its `model/` name, and the run's config (as
    a plain dict) and step in the safetensors metadata; written atomically."""
    from safetensors.torch import save_file

    metadata = {"format": "shardlm-consolidated-v1", "step": str(step), "config": json.dumps(config)}
    return write_atomically(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def file_record(path: Path) -> dict:
    """Size and sha256 of a written checkpoint file, after giving it ordinary permissions and flushing it."""
    ordinary_permissions(path)
    fsync_file(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def write_json_atomic(path: Path, value) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(value, indent=2)))


def publish(tmp_dir: Path, final_dir: Path, keep_last: int) -> None:
    """Rename a complete temporary checkpoint into place, point `latest` at it, prune old ones."""
    fsync_dir(tmp_dir)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    tmp_dir.replace(final_dir)
    fsync_dir(final_dir.parent)
    latest = final_dir.parent / LATEST
    tmp = final_dir.parent / f".{LATEST}.tmp"
    tmp.write_text(final_dir.name + "\n")
    fsync_file(tmp)
    tmp.replace(latest)
    fsync_dir(final_dir.parent)
    steps = sorted(p for p in final_dir.parent.glob("step_*") if p.is_dir())
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old != final_dir:
            shutil.rmtree(old, ignore_errors=True)


def remove_unfinished(directory: Path) -> None:
    """Delete what an interrupted save left in `directory`: `.tmp-step_*` folders and a `.latest.tmp`.
    Published checkpoints and `latest` stay. Only call it when no rank can still be writing."""
    for tmp in Path(directory).glob(".tmp-step_*"):
        shutil.rmtree(tmp, ignore_errors=True)
    (Path(directory) / f".{LATEST}.tmp").unlink(missing_ok=True)


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from itself or from its parent holding `latest`."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not (path / META).is_file():
        raise UserError(f"{path} is not a shardlm checkpoint ({META} missing); pass a step_* directory "
                        "or the folder holding `latest`")
    return path


def latest_in(directory: Path) -> Path | None:
    """The checkpoint `latest` points to in `directory`, or None when there is none."""
    if not (directory / LATEST).is_file():
        return None
    return resolve(directory)


def read_meta(checkpoint: Path) -> dict:
    try:
        return json.loads((checkpoint / META).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"checkpoint metadata {checkpoint / META} is unreadable ({exc}); "
                        "use an earlier checkpoint") from None


def verify(checkpoint: Path, meta: dict, names: list[str], world=None, device="cpu") -> None:
    """Check presence, size and sha256 of the named files against the manifest; UserError names a bad file.

    With `world` (a `Communicator` over all ranks loading together, every one passing the same `names`),
    every rank checks sizes, but each file's sha256 is computed by one rank only (file i by rank i mod
    world size) and one all-reduce tells every rank the first bad file, so a checkpoint on a shared
    filesystem is read for hashing once in all, not once per rank. `device`: where that collective's
    tensor lives (the rank's device, for NCCL).
    """
    manifest = meta["files"]
    for name in names:
        path = checkpoint / name
        expected = manifest.get(name)
        if expected is None:
            raise UserError(f"checkpoint {checkpoint} has no file {name} in its manifest")
        if not path.is_file():
            raise UserError(f"checkpoint file {path} is missing; use an earlier checkpoint")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise UserError(f"checkpoint file {path} is truncated or altered: {size} bytes, expected "
                            f"{expected['bytes']}; use an earlier checkpoint")
    rank, size = (world.rank, world.size) if world is not None else (0, 1)
    bad = len(names)
    for i, name in enumerate(names):
        if i % size == rank and sha256_of(checkpoint / name) != manifest[name]["sha256"]:
            bad = i
            break
    if size > 1:
        import torch
        import torch.distributed as dist

        first_bad = torch.tensor([bad], dtype=torch.int64, device=device)
        world.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        bad = int(first_bad.item())
    if bad < len(names):
        raise UserError(f"checkpoint file {checkpoint / names[bad]} is corrupt (sha256 mismatch); "
                        "use an earlier checkpoint")
