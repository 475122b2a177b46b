"""Checkpoint save and load time and size for a small model (the BENCH shape, with Adam state)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from shardlm.bench.common import BenchShape, summary


def checkpoint_io(shape: BenchShape, repeats: int) -> dict:
    from shardlm.bench.training import shardlm_step
    from shardlm.checkpoint import load_checkpoint, save_checkpoint

    step, trainer = shardlm_step(shape)
    step()  # Adam moments exist from here on
    folder = Path(tempfile.mkdtemp(prefix="shardlm-bench-"))
    saves, loads = [], []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            path = save_checkpoint(trainer, folder, keep_last=1)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            load_checkpoint(trainer, folder)
            loads.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in path.iterdir())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    params = sum(p.numel() for p in trainer.params)
    return {"config": shape.describe() + f"; {params / 1e6:.1f}M parameters, fp32 weights + Adam moments",
            "bytes": size, "save_s": summary(saves), "load_s": summary(loads),
            "save_mb_per_s": size / 1e6 / summary(saves)["median"]}
