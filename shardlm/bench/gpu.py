"""`make bench-gpu`: bf16 training throughput, TFLOP/s and MFU on one CUDA GPU (not run in CI).

Shapes: GPT-2 medium (355M), large (774M) and XL (1.5B) at sequence 1024, and the paper's 1.2B
weak-scaling baseline (40 layers, hidden 1536, 16 heads, vocabulary 51,200). Each runs shardlm's
real training step (bf16 autocast over fp32 master weights, fused AdamW, flash SDPA) for a few
steps, optionally under `torch.compile`, and prints one JSON line per figure. MFU = model FLOPs
(`flops_per_token`, no recompute) / step time / the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SHAPES = {
    "gpt2-355m": dict(num_layers=24, hidden_size=1024, num_heads=16),
    "gpt2-774m": dict(num_layers=36, hidden_size=1280, num_heads=20),
    "gpt2-1.5b": dict(num_layers=48, hidden_size=1600, num_heads=25),
    "paper-1.2b": dict(num_layers=40, hidden_size=1536, num_heads=16, vocab_size=51200),
}


def run_shape(name: str, micro_batch: int, steps: int, compile_model: bool, checkpointing: bool) -> dict:
    import numpy as np

    from shardlm.config import from_dict
    from shardlm.data.gpt_dataset import TokenArrayDataset
    from shardlm.models.config import flops_per_token
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer, device_peak_tflops

    model = {"seq_length": 1024, "vocab_size": 50257, "dropout": 0.0, **SHAPES[name]}
    config = from_dict({"model": model, "data": {"text_file": "in-memory"},
                        "train": {"micro_batch_size": micro_batch, "global_batch_size": micro_batch,
                                  "steps": 1000, "precision": "bf16", "activation_checkpointing": checkpointing}})
    device = torch.device("cuda", 0)
    tokens = np.random.default_rng(0).integers(0, 50257, (steps + 3) * micro_batch * 1025 + 2048)
    data = TokenArrayDataset(tokens, 1024, seed=0, num_samples=(steps + 3) * micro_batch)
    trainer = Trainer(config, ParallelContext.single(device), data)
    if compile_model:
        for layer in trainer.model.layers:
            layer.compile()
    for _ in range(2):
        trainer.train_step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_sec = micro_batch * 1024 / seconds
    tflops = tokens_per_sec * flops_per_token(config.model) / 1e12
    peak = device_peak_tflops(device)
    return {"shape": name, "gpu": torch.cuda.get_device_name(device), "micro_batch": micro_batch,
            "compile": compile_model, "activation_checkpointing": checkpointing,
            "parameters": trainer.model.num_parameters(), "step_s": seconds, "tokens_per_sec": tokens_per_sec,
            "tflops": tflops, "mfu": tflops / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlm.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer layer")
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("shardlm: error: make bench-gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    for name in args.shapes:
        try:
            result = run_shape(name, args.micro_batch, args.steps, args.compile, args.checkpointing)
        except torch.cuda.OutOfMemoryError:
            result = {"shape": name, "error": "out of memory at this micro-batch"}
        print(json.dumps(result), flush=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
