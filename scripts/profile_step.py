"""Where a training step's time goes: shardlm against transformers, operator by operator, on the bench's shapes.

    python scripts/profile_step.py deepseek --precision fp32 --steps 4
    python scripts/profile_step.py gpt_oss --precision bf16
    python scripts/profile_step.py moe
    python scripts/profile_step.py qwen3_5_moe
    python scripts/profile_step.py gemma4 --precision bf16     # and the other `families` shapes
    python scripts/profile_step.py deepseek_v32                # and deepseek_v4 (`sparse_attention`'s steps)

Builds the same two programs the `deepseek` / `gpt_oss` / `moe` / `linear_attention` sections of `make bench`
compare (a random transformers model saved and converted, `shardlm.bench.hf_compare`; for `moe`,
`shardlm.bench.moe`'s Mixtral and its shardlm twin), warms each up for two steps, then runs `--steps` steps of
each under `torch.profiler` (CPU, `--threads` threads) and prints, per program, the step's milliseconds and the
operators with the largest self time (ms per step), side by side, with each operator's share of its step. The
table names where one program spends time the other does not (e.g. a kernel transformers calls less often, or
a copy shardlm makes); it does not time the programs against each other: `make bench` does, in turns.

`--faults` runs the steps unprofiled instead and prints each program's median step time and the page faults its
steps take (fresh pages the kernel maps and zeroes when glibc hands big blocks back and takes them again): run it
once as it is and once with `MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824` (README,
"Training") to see what the allocator costs a step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shardlm.bench.breakdown import self_times

FAMILY_NAMES = ("mistral4", "olmo3", "minimax_m2", "gemma4", "kimi_linear", "nemotron_h")
"""The `families` section's shapes (`shardlm.bench.families.SHAPES`)."""


def programs(family: str, precision: str, tmp: Path) -> dict:
    """{"shardlm": step, "hf": step} of the bench's full-size shape of `family`."""
    from shardlm.bench import hf_compare
    from shardlm.checkpoint.hf import from_hf

    if family == "moe":
        from shardlm.bench.moe import MOE_BENCH, hf_step
        from shardlm.parallel import ParallelContext

        trainer = MOE_BENCH.trainer(ParallelContext.single(), precision=precision)
        return {"shardlm": trainer.train_step, "hf": hf_step(MOE_BENCH, None, precision)[0]}
    if family == "deepseek":
        from shardlm.bench.deepseek import DEEPSEEK as model
        from shardlm.bench.deepseek import DS_BENCH as shape
    elif family == "gpt_oss":
        from shardlm.bench.gpt_oss import GPT_OSS as model
        from shardlm.bench.gpt_oss import OSS_BENCH as shape
    elif family == "deepseek_v32":
        from shardlm.bench.sparse_attention import DEEPSEEK_V32 as model
        from shardlm.bench.sparse_attention import V32_BENCH as shape
    elif family == "deepseek_v4":
        from shardlm.bench.sparse_attention_v4 import DEEPSEEK_V4 as model
        from shardlm.bench.sparse_attention_v4 import V4_BENCH as shape
    elif family in FAMILY_NAMES:
        from shardlm.bench.families import FAMILIES, SHAPES

        model, shape = FAMILIES[family], SHAPES[family]
    else:
        from shardlm.bench.linear_attention import QWEN35 as model
        from shardlm.bench.linear_attention import QWEN35_BENCH as shape
    rows = hf_compare.random_rows(shape)
    folder = model.save(shape, tmp / "hf")
    checkpoint = from_hf(folder, tmp / "model.safetensors")
    trainer = hf_compare.shardlm_trainer(checkpoint, shape, rows, precision, model.model_overrides)
    hf = hf_compare.hf_step(model, folder, rows, None, precision)[0]
    return {"shardlm": trainer.train_step, "hf": hf}


def faults(step, steps: int) -> str:
    """`steps` unprofiled calls of `step`: the median step time and minor page faults per step."""
    times, counts = [], []
    for _ in range(steps):
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - start))
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return f"{statistics.median(times):.1f} ms a step, {statistics.median(counts):,.0f} page faults a step"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=("deepseek", "gpt_oss", "moe", "qwen3_5_moe", "deepseek_v32", "deepseek_v4",
                                                     *FAMILY_NAMES))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--faults", action="store_true", help="time the steps and count their page faults instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        runs = programs(args.family, args.precision, Path(tmp))
        for step in runs.values():  # warm-up: kernels built, caches filled
            step()
            step()
        if args.faults:
            for name, step in runs.items():
                print(f"{name}: " + faults(step, args.steps))
            return
        measured = {name: self_times(step, args.steps) for name, step in runs.items()}
    (ours_ms, ours), (theirs_ms, theirs) = measured["shardlm"], measured["hf"]
    print(f"{args.family} {args.precision}, {args.threads} threads: shardlm {ours_ms:.1f} ms a step, "
          f"transformers {theirs_ms:.1f} ms (profiled; the profiler adds its own time to both)")
    print(f"{'operator':<44} {'shardlm ms':>11} {'share':>6} {'hf ms':>9} {'share':>6} {'shardlm - hf':>13}")
    names = sorted(set(ours) | set(theirs), key=lambda n: -max(ours.get(n, 0.0), theirs.get(n, 0.0)))
    for name in names[:args.top]:
        a, b = ours.get(name, 0.0), theirs.get(name, 0.0)
        print(f"{name[:44]:<44} {a:>11.1f} {a / ours_ms:>6.1%} {b:>9.1f} {b / theirs_ms:>6.1%} {a - b:>+13.1f}")


if __name__ == "__main__":
    main()
