"""Every rank's generator states in a checkpoint (Python, numpy, torch CPU and CUDA, the model-parallel tracker):
restored on the same layout, they make a resumed run draw what the uninterrupted run draws (dropout, sampling)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from shardlm.parallel import ParallelContext


def rng_file(rank: int) -> str:
    """Rank `rank`'s file of generator states in a checkpoint directory."""
    return f"rng_rank{rank:05d}.safetensors"


def rng_tensors(ctx: ParallelContext) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of this rank's generator states, for its safetensors file."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        tensors["torch_cuda"] = torch.cuda.get_rng_state(ctx.device)
    for name, state in (ctx.rng.get_states() if ctx.rng else {}).items():
        tensors[f"tracker/{name}"] = state.cpu()
    np_state = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np_state[1].astype(np.int64))
    metadata = {"python": json.dumps(random.getstate()), "numpy": json.dumps([np_state[0], *np_state[2:]])}
    return tensors, metadata


def restore_rng(ctx: ParallelContext, path: Path) -> None:
    """Set this rank's generators to the states its file `path` holds."""
    from safetensors import safe_open

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    torch.set_rng_state(tensors["torch_cpu"])
    if ctx.device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], ctx.device)
    if ctx.rng is not None:
        ctx.rng.set_states({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker/")})
    python = json.loads(metadata["python"])
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, pos, has_gauss, cached = json.loads(metadata["numpy"])
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
