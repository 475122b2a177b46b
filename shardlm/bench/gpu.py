"""`make bench-gpu`: bf16 training throughput, TFLOP/s and MFU on one CUDA GPU (not run in CI).

Shapes: GPT-2 medium (355M), large (774M) and XL (1.5B) at sequence 1024, and the paper's 1.2B
weak-scaling baseline (40 layers, hidden 1536, 16 heads, vocabulary 51,200). Each runs shardlm's
real training step (bf16 autocast over fp32 master weights, fused AdamW, flash SDPA) for a few
steps, optionally under `torch.compile`, and prints one JSON line per figure. MFU = model FLOPs
(`flops_per_token`, no recompute) / step time / the GPU's dense bf16 peak.

`--global-batch` accumulates micro-batches into each optimizer step, as real training does.
`--param-dtype half` keeps bf16 parameters with fp32 master weights in the optimizer.
`--profile N` adds one profiled step per shape: the N kernels (operators on the CPU) that took the most
time, one JSON line each, after a line with the share of the step outside GEMMs and attention
(`outside_gemm_attention`, matched by kernel name).

`--against REV [--rounds N]` runs revision REV's tree and the working tree alternately, each run its own
process, and prints their speed ratio per shape (shardlm/bench/gpu_against.py says how to read it).

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
              device: torch.device, param_dtype: str = "fp32", profile: int = 0,
              global_batch: int = 0) -> list[dict]:
    """The shape's figures (one dict), then with `profile` its top operators by device time."""
    import numpy as np

    from shardlm.config import from_dict
    from shardlm.data.gpt_dataset import TokenArrayDataset
    from shardlm.parallel import ParallelContext
    from shardlm.plan.flops import flops_per_token
    from shardlm.training.trainer import Trainer, device_peak_tflops

    model = {"seq_length": 1024, "vocab_size": 50257, "dropout": 0.0, **SHAPES[name]}
    seq, vocab = model["seq_length"], model["vocab_size"]
    global_batch = global_batch or micro_batch
    config = from_dict({"model": model, "data": {"text_file": "in-memory"},
                        "train": {"micro_batch_size": micro_batch, "global_batch_size": global_batch,
                                  "steps": 1000, "precision": "bf16", "activation_checkpointing": checkpointing,
                                  "param_dtype": param_dtype, "compile": compile_model}})
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    samples = (steps + 4) * global_batch
    tokens = np.random.default_rng(0).integers(0, vocab, samples * (seq + 1) + 2 * seq)
    data = TokenArrayDataset(tokens, seq, seed=0, num_samples=samples)
    trainer = Trainer(config, ParallelContext.single(device), data)
    for _ in range(2):
        trainer.train_step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_sec = global_batch * seq / seconds
    tflops = tokens_per_sec * flops_per_token(config.model) / 1e12
    peak = device_peak_tflops(device)
    result = {"shape": name, "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "micro_batch": micro_batch,
            "global_batch": global_batch, "compile": compile_model, "activation_checkpointing": checkpointing,
            "parameters": trainer.model.num_parameters(), "step_s": seconds, "tokens_per_sec": tokens_per_sec,
            "tflops": tflops, "mfu": tflops / peak if peak else None,
            "param_dtype": param_dtype,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None}
    return [result, *(profile_step(trainer, name, profile, sync) if profile else [])]


def profile_step(trainer, name: str, top: int, sync) -> list[dict]:
    """One more training step under torch.profiler: its `top` operators by self device time (CPU time on
    the CPU), each as {"shape", "op", "ms", "calls", "share"}, after one summary line whose "outside"
    share is the time in operators other than GEMMs and attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.train_step()
        sync()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    # on the GPU the kernels themselves (their launching operators would count them twice, and the
    # annotated ranges such as the optimizer step overlap them)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0 and e.device_type == kind
              and not (cuda and getattr(e, "is_user_annotation", False))]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    core = ("gemm", "mm", "matmul", "linear", "attention", "flash", "fmha", "sdpa", "cutlass", "sm90", "nvjet")
    outside = sum(getattr(e, attr) for e in events if not any(k in e.key.lower() for k in core))
    rows = [{"shape": name, "profile": "total", "ms": total / 1e3, "outside_gemm_attention": outside / total}]
    rows += [{"shape": name, "op": e.key[:120], "ms": getattr(e, attr) / 1e3, "calls": e.count,
              "share": getattr(e, attr) / total} for e in events[:top]]
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m shardlm.bench.gpu`."""
    parser = argparse.ArgumentParser(prog="python -m shardlm.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[s for s in SHAPES if s != "smoke"], choices=list(SHAPES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=0,
                        help="sequences per optimizer step (default: one micro-batch, no accumulation)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer layer (train.compile)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--param-dtype", choices=("fp32", "half"), default="fp32",
                        help="half: bf16 parameters, fp32 master weights in the optimizer")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile one more step and print its N costliest operators (with --against: up to N "
                             "operators whose call counts differ between the trees)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: check the harness on the smoke shape only")
    parser.add_argument("--against", metavar="REV",
                        help="run REV's tree (a git revision, or a folder holding a shardlm package) and the working "
                             "tree alternately and print their ratio per shape")
    parser.add_argument("--rounds", type=int, default=2, help="with --against: runs of each tree (even: ABBA order)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("shardlm: error: make bench-gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.against:
        return against(args, parser)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    for name in args.shapes:
        try:
            results = run_shape(name, args.micro_batch, args.steps, args.compile, args.checkpointing, device,
                                args.param_dtype, args.profile, args.global_batch)
        except torch.cuda.OutOfMemoryError:
            results = [{"shape": name, "error": "out of memory at this micro-batch"}]
        for result in results:
            print(json.dumps(result), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return 0


def against(args, parser) -> int:
    """`--against`: the side-by-side comparison; a user mistake or a failed run is one line on stderr."""
    from shardlm.bench.gpu_against import RunFailed, compare
    from shardlm.errors import UserError

    try:
        return compare(args, parser)
    except UserError as error:
        print(f"shardlm: error: {error}", file=sys.stderr)
        return error.exit_code
    except RunFailed as error:
        print(f"shardlm: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
