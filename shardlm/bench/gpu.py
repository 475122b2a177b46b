"""`make bench-gpu`: bf16 training throughput, TFLOP/s and MFU on one CUDA GPU (not run in CI).

Shapes: GPT-2 medium (355M), large (774M) and XL (1.5B) at sequence 1024, and the paper's 1.2B
weak-scaling baseline (40 layers, hidden 1536, 16 heads, vocabulary 51,200). Each runs shardlm's
real training step (bf16 autocast over fp32 master weights, fused AdamW, flash SDPA) for a few
steps, optionally under `torch.compile`, and prints one JSON line per figure. MFU = model FLOPs
(`flops_per_token`, no recompute) / step time / the GPU's dense bf16 peak.

`--device cpu --shapes smoke` runs the same code on a tiny model on the CPU: a check of the harness
(the test suite runs it), not a figure.
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
    "smoke": dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=128, vocab_size=512),
}


def run_shape(name: str, micro_batch: int, steps: int, compile_model: bool, checkpointing: bool,
              device: torch.device) -> dict:
    import numpy as np

    from shardlm.config import from_dict
    from shardlm.data.gpt_dataset import TokenArrayDataset
    from shardlm.models.config import flops_per_token
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer, device_peak_tflops

    model = {"seq_length": 1024, "vocab_size": 50257, "dropout": 0.0, **SHAPES[name]}
    seq, vocab = model["seq_length"], model["vocab_size"]
    config = from_dict({"model": model, "data": {"text_file": "in-memory"},
                        "train": {"micro_batch_size": micro_batch, "global_batch_size": micro_batch,
                                  "steps": 1000, "precision": "bf16", "activation_checkpointing": checkpointing}})
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = np.random.default_rng(0).integers(0, vocab, (steps + 3) * micro_batch * (seq + 1) + 2 * seq)
    data = TokenArrayDataset(tokens, seq, seed=0, num_samples=(steps + 3) * micro_batch)
    trainer = Trainer(config, ParallelContext.single(device), data)
    if compile_model:
        for layer in trainer.model.layers.values():
            layer.compile()
    for _ in range(2):
        trainer.train_step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_sec = micro_batch * seq / seconds
    tflops = tokens_per_sec * flops_per_token(config.model) / 1e12
    peak = device_peak_tflops(device)
    return {"shape": name, "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "micro_batch": micro_batch,
            "compile": compile_model, "activation_checkpointing": checkpointing,
            "parameters": trainer.model.num_parameters(), "step_s": seconds, "tokens_per_sec": tokens_per_sec,
            "tflops": tflops, "mfu": tflops / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlm.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[s for s in SHAPES if s != "smoke"], choices=list(SHAPES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer layer")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: check the harness on the smoke shape only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("shardlm: error: make bench-gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    for name in args.shapes:
        try:
            result = run_shape(name, args.micro_batch, args.steps, args.compile, args.checkpointing, device)
        except torch.cuda.OutOfMemoryError:
            result = {"shape": name, "error": "out of memory at this micro-batch"}
        print(json.dumps(result), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
