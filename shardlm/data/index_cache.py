"""Caching sample indices as `.npy` files named by a hash of every parameter that shaped them.

Indices are built once (by whichever process gets there first), saved under temporary names and
renamed, so concurrent builders (several ranks) never read a half-written file; later runs load
them with `np.load(mmap_mode="r")`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardlm.data.corpus import atomic_write_text
from shardlm.errors import UserError


def description_hash(description: dict) -> str:
    """A short stable hash of a JSON-serialisable description."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def file_signature(path: Path) -> dict:
    """Size and modification time: a rewritten data file gives new cache names."""
    stat = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cached_arrays(
    cache_dir: Path, stem: str, description: dict, names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Load arrays `names` for `description` from `cache_dir`, building and saving them if absent.

    Files are `cache_dir/{stem}_{hash}_{name}.npy` plus a `{stem}_{hash}.json` with the description.
    """
    key = description_hash(description)
    paths = {name: cache_dir / f"{stem}_{key}_{name}.npy" for name in names}
    if all(path.is_file() for path in paths.values()):
        return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    arrays = build()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache_dir / f"{stem}_{key}.json", json.dumps(description, indent=1, default=str))
        for name, path in paths.items():
            _atomic_save(path, arrays[name])
    except OSError as exc:
        raise UserError(f"cannot write the index cache in {cache_dir} ({exc.strerror}); "
                        "pass a writable cache_dir (data.cache_dir)") from exc
    return arrays


def _atomic_save(path: Path, array: np.ndarray) -> None:
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as stream:
        np.save(stream, np.ascontiguousarray(array))
    os.replace(temporary, path)
