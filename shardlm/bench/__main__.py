"""`make bench` (`python -m shardlm.bench`): every benchmark, then BENCHMARKS.md and benchmarks.json.

Sections: training throughput vs transformers, CPU MFU, tensor-parallel efficiency vs PyTorch's TP,
communication vs the formula, memory per rank, the pipeline's bubble and memory per stage, the
planner's memory and step-time ratios for PP x TP x DP layouts against measurements, Mixture-of-Experts
training against transformers' Mixtral and expert parallelism, a tiny DeepSeek-V3's training step
against transformers' DeepseekV3ForCausalLM, a tiny gpt-oss's (sinks, sliding windows, biased experts) against
GptOssForCausalLM, a tiny Qwen3.5-MoE's (Gated DeltaNet) against Qwen3_5MoeForCausalLM and a hybrid layer stack
against full attention as the sequence grows, a tiny DeepSeek-V3.2's (DeepSeek Sparse Attention) against
DeepseekV32ForCausalLM and one sparse MLA layer against dense MLA at long sequences, the newer families' steps (Mistral
Small 4, OLMo 3, MiniMax-M2) against their transformers classes, context parallelism at a long
sequence (and what a sliding window saves in the ring),
data sharding (none, distributed optimizer, FSDP) at DP=2, supervised fine-tuning (per-document attention
over packed rows, throughput against TRL's SFTTrainer, packing efficiency), LoRA against TRL + peft, QLoRA's memory
per rank at one process and FSDP DP=2 against `shardlm plan`'s, DPO against
TRL's DPOTrainer, GRPO steps and decoding against TRL's GRPOTrainer and transformers' generate, knowledge
distillation against TRL's GKDTrainer (offline, the teacher's share of the step),
Muon against AdamW, checkpoint I/O, preprocessing, evaluation and generation. `--quick` runs tiny shapes (a smoke
test of the harness, not figures to quote).

Each section runs in a new Python process (`_in_own_process`), so its figures are those of a fresh run, whatever
ran before it; `--only` reproduces one section's figures as the whole run measured them. `--quick` runs every
section in this process instead (its figures are not quoted; a new interpreter per section costs seconds of imports
and a fork server's start each).
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from shardlm.bench.common import BENCH, QUICK, machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlm.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: check the harness, not the numbers")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per figure (default 7)")
    parser.add_argument("--out", default=".", help="folder for BENCHMARKS.md and benchmarks.json")
    parser.add_argument("--only", nargs="*", help="run only these sections")
    parser.add_argument("--skip", nargs="*", default=[], help="leave these sections out")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # one section in this process (the runner's child)
    parser.add_argument("--section-out", help=argparse.SUPPRESS)  # where that child leaves its figures (pickle)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else BENCH
    repeats = 2 if args.quick else args.repeats
    sections = {
        "train_vs_hf": lambda results: _train(shape, repeats, results, args.quick),
        "tp2_efficiency": lambda results: _tensor_parallel(shape, repeats, results, args.quick),
        "memory": lambda results: _memory(args.quick),
        "pipeline": lambda results: _pipeline(args.quick, repeats, args.out),
        "plan3d": lambda results: _plan3d(args.quick, repeats),
        "moe": lambda results: _moe(args.quick, repeats),
        "deepseek": lambda results: _deepseek(args.quick, repeats),
        "gpt_oss": lambda results: _gpt_oss(args.quick, repeats),
        "linear_attention": lambda results: _linear_attention(args.quick, repeats, args.out),
        "sparse_attention": lambda results: _sparse_attention(args.quick, repeats),
        "families": lambda results: _families(args.quick, repeats),
        "context_parallel": lambda results: _context_parallel(args.quick, repeats),
        "window": lambda results: _window(args.quick, repeats),
        "fsdp": lambda results: _fsdp(args.quick, repeats),
        "sft": lambda results: _sft(args.quick, repeats, results),
        "lora": lambda results: _lora(args.quick),
        "qlora_memory": lambda results: _qlora_memory(args.quick),
        "preference": lambda results: _preference(args.quick),
        "rl": lambda results: _rl(args.quick),
        "distill": lambda results: _distill(args.quick),
        "optimizers": lambda results: _optimizers(args.quick, args.out),
        "checkpoint": lambda results: _checkpoint(shape, 3 if not args.quick else 1),
        "preprocess": lambda results: _preprocess(args.quick),
        "eval": lambda results: _eval(args.quick),
    }
    unknown = sorted((set(args.only or []) | set(args.skip)) - set(sections))
    if unknown:
        parser.error(f"no section named {', '.join(unknown)}; the sections are {', '.join(sections)}")
    if args.section is not None:
        return _run_section(args.section, sections[args.section], Path(args.section_out))
    results: dict = {"machine": machine(), "repeats": repeats, "quick": args.quick, "errors": {},
                     "gpu_note": "The GPU benchmark is `make bench-gpu` (one CUDA GPU; not part of `make bench`); "
                                 "see docs/benchmarks-gpu.md for its last recorded result."}
    started = time.time()
    common = (["--quick"] if args.quick else []) + ["--repeats", str(args.repeats), "--out", args.out]
    for name in sections:
        if (args.only and name not in args.only) or name in args.skip:
            continue
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        section_start = time.time()
        done = _in_this_process(name, sections[name], results) if args.quick else _in_own_process(name, common, results)
        outcome = "done" if done else f"failed ({results['errors'][name]})"
        print(f"bench: {name} {outcome} in {time.time() - section_start:.0f} s", file=sys.stderr, flush=True)
    results["total_seconds"] = time.time() - started
    from shardlm.bench.report import write_reports

    write_reports(results, Path(args.out))
    print(f"bench: wrote {Path(args.out) / 'BENCHMARKS.md'} and benchmarks.json in {results['total_seconds']:.0f} s",
          file=sys.stderr)
    return 1 if results["errors"] else 0


def _in_own_process(name: str, common: list[str], results: dict) -> bool:
    """Runs section `name` in a new Python process (`--section`) and merges what it measured into `results`.

    Each section starts from a fresh process, as a user's training run does, so no section's figures depend on
    what ran before it in the same interpreter (allocator state, lingering objects and threads: the families'
    shardlm / transformers ratios were seen 15% apart between a section run alone and the same section after
    twelve others). A section that fails, or whose process dies, is an entry of results["errors"]; the others
    still run. Returns whether the section succeeded."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "section.pkl"
        proc = subprocess.run([sys.executable, "-m", "shardlm.bench", *common, "--section", name,
                               "--section-out", str(out)])
        if not out.exists():
            results["errors"][name] = f"the section's process exited with code {proc.returncode} before reporting"
            return False
        measured = pickle.loads(out.read_bytes())
    return _merged(name, measured, results)


def _in_this_process(name: str, run, results: dict) -> bool:
    """Runs section `name` here and merges what it set into `results`, as `_in_own_process` does (for `--quick`); the
    thread count a section set is put back for the next one."""
    from shardlm.bench.common import torch_threads

    measured: dict = {"errors": {}}
    with torch_threads(torch.get_num_threads()):
        _measure(name, run, measured)
    return _merged(name, measured, results)


def _merged(name: str, measured: dict, results: dict) -> bool:
    """A section's figures and errors (`measured`) into `results`; whether the section succeeded."""
    results["errors"].update(measured.pop("errors"))
    results.update(measured)
    return name not in results["errors"]


def _measure(name: str, run, results: dict) -> None:
    """Runs one section, its figures (or its one-line error) into `results`."""
    try:
        value = run(results)
    except Exception as exc:  # noqa: BLE001 - a failed section is reported, the others still run
        traceback.print_exc()
        results["errors"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    else:
        if value is not None:
            results[name] = value


def _run_section(name: str, run, out: Path) -> int:
    """The child's side of `_in_own_process`: runs one section here and pickles {name: its figures, every other
    key the section set (e.g. `mfu` beside `train_vs_hf`), "errors": {...}} to `out`."""
    results: dict = {"errors": {}}
    _measure(name, run, results)
    out.write_bytes(pickle.dumps(results))
    return 0


def _train(shape, repeats, results, quick):
    from shardlm.bench.training import (
        GEMM_SIZES,
        PROBE_GFLOP,
        QUICK_PROBE_GFLOP,
        QUICK_VOCABULARIES,
        VOCABULARIES,
        WARMUP,
        cpu_mfu,
        train_vs_hf,
    )

    figures = train_vs_hf(shape, repeats, threads=2, vocab_sizes=QUICK_VOCABULARIES if quick else VOCABULARIES,
                          gemm_sizes=(256,) if quick else GEMM_SIZES, compiled=not quick,
                          probe_gflop=QUICK_PROBE_GFLOP if quick else PROBE_GFLOP, warmup=0 if quick else WARMUP)
    results["mfu"] = cpu_mfu(figures, shape)
    return figures


def _tensor_parallel(shape, repeats, results, quick):
    from shardlm.bench.tensor_parallel import tensor_parallel_efficiency

    figures = tensor_parallel_efficiency(shape, repeats, warmup=0 if quick else 1)  # quick: no untimed round
    results["comm"] = figures.pop("comm")  # measured in the same run; its own key, `comm.matches_formula`
    return figures


def _memory(quick):
    from shardlm.bench.memory import memory_per_rank

    return memory_per_rank(quick)


def _pipeline(quick, repeats, out_dir):
    from shardlm.bench.pipeline import pipeline_bubble
    from shardlm.bench.zero_bubble import zero_bubble_schedules

    return pipeline_bubble(quick, repeats) | {"zero_bubble": zero_bubble_schedules(quick, repeats, out_dir)}


def _plan3d(quick, repeats):
    from shardlm.bench.plan3d import plan_against_cpu

    return plan_against_cpu(quick, repeats)


def _moe(quick, repeats):
    from shardlm.bench.moe import moe_bench

    return moe_bench(quick, repeats)


def _deepseek(quick, repeats):
    from shardlm.bench.deepseek import deepseek_bench

    return deepseek_bench(quick, repeats)


def _gpt_oss(quick, repeats):
    from shardlm.bench.gpt_oss import gpt_oss_bench

    return gpt_oss_bench(quick, repeats)


def _linear_attention(quick, repeats, out):
    from shardlm.bench.linear_attention import linear_attention_bench

    return linear_attention_bench(quick, repeats, out)


def _families(quick, repeats):
    from shardlm.bench.families import families_bench

    return families_bench(quick, repeats)


def _sparse_attention(quick, repeats):
    from shardlm.bench.sparse_attention import sparse_attention_bench

    return sparse_attention_bench(quick, repeats)


def _context_parallel(quick, repeats):
    from shardlm.bench.context_parallel import context_parallel_bench

    return context_parallel_bench(quick, repeats)


def _window(quick, repeats):
    from shardlm.bench.window import window_bench

    return window_bench(quick, repeats)


def _fsdp(quick, repeats):
    from shardlm.bench.fsdp import fsdp_bench

    return fsdp_bench(quick, repeats)


def _sft(quick, repeats, results):
    from shardlm.bench.sft import sft_bench

    figures = sft_bench(quick, repeats)
    if "error" in figures["throughput"]:  # the attention and packing figures stay; the run still fails
        results["errors"]["sft.throughput"] = figures["throughput"]["error"]
    return figures


def _lora(quick):
    from shardlm.bench.lora import lora_bench

    return lora_bench(quick)


def _qlora_memory(quick):
    from shardlm.bench.qlora_memory import qlora_memory_bench

    return qlora_memory_bench(quick)


def _preference(quick):
    from shardlm.bench.preference import preference_bench

    return preference_bench(quick)


def _rl(quick):
    from shardlm.bench.rl import rl_bench

    return rl_bench(quick)


def _distill(quick):
    from shardlm.bench.distill import distill_bench

    return distill_bench(quick)


def _optimizers(quick, out):
    from shardlm.bench.optimizers import optimizers_bench

    return optimizers_bench(quick, out)


def _checkpoint(shape, repeats):
    from shardlm.bench.storage import checkpoint_io

    return checkpoint_io(shape, repeats)


def _preprocess(quick: bool):
    from shardlm.data.bench import CORPUS_FILES, benchmark_preprocess

    with tempfile.TemporaryDirectory() as folder:  # --quick: Tiny Shakespeare alone, once
        return benchmark_preprocess(folder, workers=(1, 2), repeats=1 if quick else 3,
                                    files=CORPUS_FILES[-1:] if quick else CORPUS_FILES)


def _eval(quick: bool = False):
    from shardlm.eval import bench

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if quick:  # a few windows and tokens, timed once: the harness, not the figures
        return {"wikitext": bench.eval_throughput(num_tokens=512, repeats=1),
                "generation": bench.generation_latency(new_tokens=8, repeats=1)}
    return {"wikitext": bench.eval_throughput(), "generation": bench.generation_latency()}


if __name__ == "__main__":
    sys.exit(main())
