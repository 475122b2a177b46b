"""What every benchmark shares: the BENCH shape, timing with statistics, the machine's description."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

from shardlm.cpu import cpu_flags, simulated_kind
from shardlm.models.config import ModelConfig
from shardlm.plan.flops import flops_per_token

FIGURES = "docs/figures"
"""Where the bench's plots go, relative to the folder of BENCHMARKS.md (`--out`), which links them from there."""


@dataclass(frozen=True)
class BenchShape:
    """Model and batch of a throughput benchmark."""

    num_layers: int = 8
    hidden_size: int = 512
    num_heads: int = 8
    seq_length: int = 512
    micro_batch: int = 4
    vocab_size: int = 8192
    activation: str = "gelu_tanh"
    """GPT-2's tanh-approximated GeLU, the function transformers' GPT2Config computes by default."""

    def model_config(self) -> ModelConfig:
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
                           seq_length=self.seq_length, vocab_size=self.vocab_size, dropout=0.0,
                           activation=self.activation)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model_config())

    def trainer(self, ctx, tp: int = 1, global_batch: int | None = None, parallel: dict | None = None, **train):
        """A real shardlm Trainer of this shape on random tokens, for `ctx` (TP=`tp`; other `[parallel]`
        keys, such as the pipeline's, from `parallel`)."""
        import numpy as np

        from shardlm.config import from_dict
        from shardlm.data.gpt_dataset import TokenArrayDataset
        from shardlm.training.trainer import Trainer

        global_batch = global_batch or self.micro_batch * (ctx.world_size // tp)
        config = from_dict({
            "model": {"num_layers": self.num_layers, "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                      "seq_length": self.seq_length, "vocab_size": self.vocab_size, "dropout": 0.0,
                      "activation": self.activation},
            "parallel": {"tensor": tp, **(parallel or {})}, "data": {"text_file": "in-memory"},
            "train": {"micro_batch_size": self.micro_batch, "global_batch_size": global_batch, "steps": 1000,
                      "lr": 1e-4, "precision": "fp32", **train},
        })
        tokens = np.random.default_rng(0).integers(0, self.vocab_size, 200 * self.tokens)
        data = TokenArrayDataset(tokens, self.seq_length, seed=0, num_samples=1000 * global_batch)
        return Trainer(config, ctx, data)

    def describe(self, precision: str = "fp32", vocabulary: bool = True) -> str:
        gelu = "tanh GeLU" if self.activation == "gelu_tanh" else "erf GeLU"
        vocab = f", vocabulary {self.vocab_size}" if vocabulary else ""
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads, sequence "
                f"{self.seq_length}, micro-batch {self.micro_batch}{vocab}, {gelu}, {precision}, dropout 0")


BENCH = BenchShape()
QUICK = BenchShape(num_layers=2, hidden_size=128, num_heads=4, seq_length=128, micro_batch=2, vocab_size=1024)


def summary(values: list[float]) -> dict:
    """Median, min, max and the raw values (rounded for the report)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": [round(v, 6) for v in values]}


def median_cell(fig: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """A `summary` as one report cell: "median (min low, max high)", each times `scale`; "n/a" when absent."""
    if not fig:
        return "n/a"
    low, high = fig["min"] * scale, fig["max"] * scale
    return f"{fig['median'] * scale:.{digits}f} (min {low:.{digits}f}, max {high:.{digits}f})"


def round_orders(names, repeats: int, seed: int = 0) -> list[list]:
    """`repeats` orders of `names`, one per timing round, so that no program keeps running right after
    the same other one, whose leftover heap, caches and idle threads would favour or penalize it.
    (Rotating one order, A B C then B C A, would not do: A would follow C in every round but one.)
    Each round takes, of 32 seeded shuffles, the one whose neighbour pairs (the previous round's last
    program included) ran together least so far. The same seed gives every rank the same orders."""
    def neighbours(run):
        return list(zip(run, run[1:]))

    rng, names = random.Random(seed), list(names)
    together: Counter = Counter()
    orders: list[list] = []
    last: list = []  # the previous round's last program
    for _ in range(repeats):
        best = min((rng.sample(names, len(names)) for _ in range(32)),
                   key=lambda order: sum(together[pair] ** 2 for pair in neighbours(last + order)))
        together.update(neighbours(last + best))
        orders.append(best)
        last = best[-1:]
    return orders


def interleaved(programs: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time each zero-argument program `repeats` times, one round of all of them per repeat in the
    orders of `round_orders`, after `warmup` rounds. Returns seconds per call; the i-th times of two
    programs come from the same round."""
    for _ in range(warmup):
        for run in programs.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in programs}
    for order in round_orders(programs, repeats):
        for name in order:
            start = time.perf_counter()
            programs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def cpu_features() -> dict:
    """The CPU's matrix features, from its flags (`shardlm.cpu.cpu_flags`) and PyTorch/oneDNN.

    `matrix` is the best of "AMX" (AMX-BF16 tiles), "AVX-512-BF16", "AVX-512", "AVX2" or "other";
    `native_bf16` is true with AMX or AVX-512-BF16, the instructions that multiply bf16 in hardware (without
    them oneDNN emulates bf16 and its GEMMs run slower than fp32); `bf16_note` says why bf16 is skipped.
    Under a simulated kind (`SHARDLM_CPU_KIND`) every field follows that kind's flags (`simulated` names it):
    neither the kernel nor oneDNN is asked, since they would describe this machine instead."""
    kind = simulated_kind()
    flags = cpu_flags() or set()
    amx = "amx_bf16" in flags
    if kind is None and not amx and hasattr(torch._C, "_cpu") and hasattr(torch._C._cpu, "_init_amx"):
        amx = bool(torch._C._cpu._init_amx())  # asks the kernel for AMX state; false where there is none
    avx512_bf16 = "avx512_bf16" in flags
    matrix = next((name for name, present in (("AMX", amx), ("AVX-512-BF16", avx512_bf16),
                                              ("AVX-512", "avx512f" in flags), ("AVX2", "avx2" in flags))
                   if present), "other")
    if kind is None:
        onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    else:  # oneDNN runs bf16 from AVX-512 on (emulated below AVX-512-BF16)
        onednn_bf16 = "avx512f" in flags
    native = (amx or avx512_bf16) and onednn_bf16
    note = None if native else (f"bf16 skipped: this CPU's best matrix instructions are {matrix} (no AMX or "
                                "AVX-512-BF16), so bf16 matmuls are emulated and slower than fp32")
    return {"matrix": matrix, "amx": amx, "avx512_bf16": avx512_bf16, "avx512": "avx512f" in flags,
            "avx2": "avx2" in flags, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": onednn_bf16, "native_bf16": native, "bf16_note": note, "simulated": kind}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": load}


def timed_between_barriers(run, runs_here: bool, threads: int) -> float:
    """In a multi-process benchmark: barrier, `run()` (on the ranks that take part, with `threads` threads),
    barrier; the seconds in between, the same span on every rank."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.barrier()
    start = time.perf_counter()
    if runs_here:
        run()
    dist.barrier()
    return time.perf_counter() - start


def steady(times: list[float], tokens: list[float], warmup: int) -> dict:
    """Step times (s) and real tokens per step after the first `warmup` steps: tokens/s over those steps."""
    times, tokens = times[warmup:], tokens[warmup:]
    if not times:
        raise RuntimeError("no step left after the warm-up steps")
    return {"step_s": times, "tokens": tokens, "tokens_per_sec": sum(tokens) / sum(times)}


@contextlib.contextmanager
def torch_threads(threads: int):
    """Run the block with `threads` intra-op threads, then restore the number before it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def native_precisions(features: dict) -> list[str]:
    """The precisions a CPU comparison runs (`cpu_features`): fp32, and bf16 where the CPU multiplies it natively."""
    return ["fp32"] + (["bf16"] if features["native_bf16"] else [])


@contextlib.contextmanager
def uncached_datasets():
    """Run the block with Hugging Face `datasets`' cache and progress bars off and a random fingerprint for every
    transform: TRL's trainers tokenize through `Dataset.map`, whose fingerprint pickles the whole tokenizer (about
    13 s for Qwen3's 151,936 tokens on a 2-core CPU), worth nothing when nothing is cached. A random fingerprint is
    what `datasets` itself falls back to when a transform cannot be hashed."""
    import datasets
    from datasets import arrow_dataset, fingerprint

    caching, progress = datasets.is_caching_enabled(), datasets.is_progress_bar_enabled()
    saved = fingerprint.update_fingerprint, arrow_dataset.update_fingerprint

    def random_fingerprint(*args, **kwargs) -> str:
        return fingerprint.generate_random_fingerprint()

    datasets.disable_caching()
    datasets.disable_progress_bars()
    fingerprint.update_fingerprint = arrow_dataset.update_fingerprint = random_fingerprint
    try:
        yield
    finally:
        fingerprint.update_fingerprint, arrow_dataset.update_fingerprint = saved
        if caching:
            datasets.enable_caching()
        if progress:
            datasets.enable_progress_bars()
