"""What every benchmark shares: the BENCH shape, timing with statistics, the machine's description."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from shardlm.models.config import ModelConfig, flops_per_token


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
                      "lr": 1e-4, **train},
        })
        tokens = np.random.default_rng(0).integers(0, self.vocab_size, 200 * self.tokens)
        data = TokenArrayDataset(tokens, self.seq_length, seed=0, num_samples=1000 * global_batch)
        return Trainer(config, ctx, data)

    def describe(self) -> str:
        gelu = "tanh GeLU" if self.activation == "gelu_tanh" else "erf GeLU"
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads, sequence "
                f"{self.seq_length}, micro-batch {self.micro_batch}, vocabulary {self.vocab_size}, {gelu}, fp32, "
                "dropout 0")


BENCH = BenchShape()
QUICK = BenchShape(num_layers=2, hidden_size=128, num_heads=4, seq_length=128, micro_batch=2, vocab_size=1024)


def summary(values: list[float]) -> dict:
    """Median, min, max and the raw values (rounded for the report)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": [round(v, 6) for v in values]}


def interleaved(programs: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time each zero-argument program `repeats` times, alternating A B C, B C A, C A B, ... after
    `warmup` rounds. Rotating the order keeps one program from always running right after the same
    other one (whose leftover heap and caches would favour or penalize it). Returns seconds per call."""
    for _ in range(warmup):
        for run in programs.values():
            run()
    names = list(programs)
    times: dict[str, list[float]] = {name: [] for name in programs}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            programs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def matmul_ceiling(threads: int, size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 GEMM FLOP/s on this CPU with `threads` threads (square size x size matrices)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    torch.set_num_threads(previous)
    return best


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
