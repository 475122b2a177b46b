"""Single-process training throughput: shardlm at TP=1 vs HuggingFace GPT2LMHeadModel (SDPA).

Measured at the BENCH shape with two vocabularies, BENCH's 8,192 and GPT-2's 50,257 (where the LM
head and the loss are a large part of the step), in fp32 and, on a CPU with native bf16 (AMX or
AVX-512-BF16), in bf16 autocast too. Every program runs forward + backward + global-norm clipping +
fused AdamW on the same shape and batch, with the same threads, taking turns in a new order every
round (`common.round_orders`) so machine noise hits all alike. All compute the same function:
GPT-2's tanh-approximated GeLU, SDPA attention, tied LM head, mean cross-entropy.

- `shardlm`: a real shardlm Trainer step (`model.activation = "gelu_tanh"`).
- `shardlm_train`: `shardlm train` itself (`shardlm.training.run.train`, the CLI's loop with its
  progress bar, metrics.jsonl and TensorBoard logging, on an indexed dataset), one loop iteration
  per call: what the step costs with everything around it.
- `shardlm_half` (bf16 only): the Trainer step with half-precision parameters
  (`train.param_dtype = "half"`: bf16 weights, fp32 gradient buffers and master weights).
- `hf`: transformers as shipped: `GPT2Config` defaults (`activation_function="gelu_new"`, GPT-2's
  GeLU written as eight tensor ops in Python) and fused AdamW, the Trainer's default optimizer on
  torch >= 2.8; in bf16 its forward and loss under autocast, as transformers' Trainer runs `bf16=True`.
- `hf_fused_gelu`: the control: the same transformers model told to use PyTorch's one-kernel tanh
  GeLU (`activation_function="gelu_pytorch_tanh"`). It shows what is left of the ratio when both
  programs use the same kernels everywhere.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from shardlm.bench.breakdown import breakdown
from shardlm.bench.common import BenchShape, cpu_features, interleaved, native_precisions, summary, torch_threads
from shardlm.training.parallelize import can_compile

HF_VARIANTS = {"hf": "gelu_new", "hf_fused_gelu": "gelu_pytorch_tanh"}
VOCABULARIES = (8192, 50257)
"""BENCH's vocabulary and GPT-2's real one."""
QUICK_VOCABULARIES = (1024, 3000)
"""--quick: a multiple of 128 and one that needs padding."""
GEMM_SIZES = (1024, 2048)
"""Square GEMM probes: 1024 (the ceiling `make bench` has always used) and 2048 (faster on some CPUs)."""
WARMUP = 1
PROBE_GFLOP = 2 * 2 * 2048**3 / 1e9
"""Work of each square GEMM probe: about 34 GFLOP (0.15-0.3 s here), long enough that a scheduling hiccup does not
decide it (2 x 2048^3-sized matmuls' worth at every size)."""
QUICK_PROBE_GFLOP = PROBE_GFLOP / 16
"""--quick: a sixteenth (about 2 GFLOP), enough to check the harness; the figures are not quoted."""


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def shardlm_step(shape: BenchShape, precision: str = "fp32", **train):
    """A zero-argument function running one real shardlm training step (the Trainer's), and the trainer."""
    from shardlm.parallel import ParallelContext

    trainer = shape.trainer(ParallelContext.single(), precision=precision, **train)
    return trainer.train_step, trainer


def hf_step(shape: BenchShape, activation: str = "gelu_new", seed: int = 0, precision: str = "fp32"):
    """One training step of transformers' GPT2LMHeadModel (SDPA attention) on the shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=shape.vocab_size, n_positions=shape.seq_length, n_embd=shape.hidden_size,
                        n_layer=shape.num_layers, n_head=shape.num_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, activation_function=activation, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    batch = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length),
                          generator=torch.Generator().manual_seed(seed))

    def step():
        with autocast(precision):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


class TrainCommand:
    """`shardlm train` (`shardlm.training.run.train`) running in a thread, one loop iteration per call.

    The thread waits at the start of every Trainer step; a call lets it go and returns when it reaches
    the next one, so a call times one whole iteration of the CLI's loop: the step, the progress bar
    and metrics logging, the validation and checkpoint checks and the SIGTERM agreement. `calls` is how
    many calls will be made; `close()` lets the last step and the run's end go (untimed).
    """

    def __init__(self, shape: BenchShape, precision: str, calls: int, folder: Path, threads: int, **train):
        from shardlm.config import from_dict
        from shardlm.data.indexed import IndexedDatasetWriter, token_dtype_for_vocab
        from shardlm.training.trainer import Trainer

        prefix = folder / f"tokens-{shape.vocab_size}"
        if not prefix.with_suffix(".idx").exists():
            tokens = np.random.default_rng(0).integers(0, shape.vocab_size, 64 * (shape.seq_length + 1))
            with IndexedDatasetWriter(prefix, token_dtype_for_vocab(shape.vocab_size)) as writer:
                writer.add_document([tokens])
        self.config = from_dict({
            "model": {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size, "num_heads": shape.num_heads,
                      "seq_length": shape.seq_length, "vocab_size": shape.vocab_size, "dropout": 0.0,
                      "activation": shape.activation},
            "data": {"prefixes": [str(prefix)], "split": "1,0,0"},
            "train": {"micro_batch_size": shape.micro_batch, "global_batch_size": shape.micro_batch,
                      "steps": calls + 1, "lr": 1e-4, "precision": precision, **train},
            "checkpoint": {"save": False}, "log": {"plot": False},
        })
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"train-{shape.vocab_size}-{precision}-", dir=folder))
        self.threads, self.error = threads, None
        self._go, self._arrived = threading.Semaphore(0), threading.Semaphore(0)
        self._trainer_class, self._original = Trainer, Trainer.train_step
        command = self

        def gated_step(trainer):
            if threading.current_thread() is command.thread:
                command._arrived.release()
                command._go.acquire()
            return command._original(trainer)

        Trainer.train_step = gated_step
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._wait()

    def _run(self):
        from shardlm.training.run import train

        torch.set_num_threads(self.threads)  # OpenMP's thread count is per thread
        try:
            train(self.config, self.run_dir)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc
        self._arrived.release()

    def _wait(self):
        self._arrived.acquire()
        if self.error is not None:
            self.close()
            raise RuntimeError(f"shardlm train failed in the benchmark: {self.error}") from self.error

    def __call__(self):
        self._go.release()
        self._wait()

    def close(self):
        self._go.release()
        self.thread.join()
        self._trainer_class.train_step = self._original


def gemm_probe(size: int, precision: str, calls: int):
    """A zero-argument program of `calls` square size x size matmuls in the precision's dtype, and its FLOPs."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)

    def run():
        for _ in range(calls):
            a @ b

    return run, calls * 2 * size**3


def step_gemm_probe(shape: BenchShape, precision: str):
    """A zero-argument program of exactly the GEMMs of the step's linear layers, alone and back to back, and
    their FLOPs: per layer QKV (h -> 3h), the projection (h -> h) and the MLP (h -> 4h -> h), then the LM head
    (h -> V), each as its forward and its backward's two GEMMs (dX = dY W, dW = dY^T X) on the step's
    tokens x h activations. Its rate is the ceiling the step's own shapes allow (the attention products and
    everything else excluded), where the square probes measure the CPU's best."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    h, tokens = shape.hidden_size, shape.tokens
    pairs = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)] * shape.num_layers + [(h, shape.vocab_size)]
    gemms = []
    for width_in, width_out in pairs:
        x, w = torch.randn(tokens, width_in, dtype=dtype), torch.randn(width_out, width_in, dtype=dtype)
        gemms.append((x, w, torch.randn(tokens, width_out, dtype=dtype)))

    def run():
        for x, w, dy in gemms:
            torch.nn.functional.linear(x, w)
            dy @ w
            dy.t() @ x

    return run, sum(3 * 2 * tokens * a * b for a, b in pairs)


def compare(shape: BenchShape, precision: str, repeats: int, threads: int, folder: Path,
            gemm_sizes=GEMM_SIZES, compiled: bool = True, probe_gflop: float = PROBE_GFLOP,
            warmup: int = WARMUP) -> dict:
    """tokens/s of every program on one (vocabulary, precision) and the ratios, over interleaved repeats.

    GEMM probes (square matmuls of each size in `gemm_sizes`, in the precision's dtype) run in the same
    rounds, so each repeat's MFU divides the step's FLOP rate by the GEMM rate measured seconds
    apart, under the same machine load. With `compiled` (and a C++ compiler), shardlm's step with
    `train.compile` runs in the rounds too; its compilation happens in the warm-up round. `probe_gflop`: the
    work of each square probe (`make bench`'s 34; --quick's `QUICK_PROBE_GFLOP`); `warmup`: untimed rounds first
    (--quick's 0, without `compiled`)."""
    probes = {f"gemm_{n}": gemm_probe(n, precision, calls=max(1, round(probe_gflop * 1e9 / (2 * n**3))))
              for n in gemm_sizes}
    probes["gemm_step"] = step_gemm_probe(shape, precision)
    programs = {"shardlm": shardlm_step(shape, precision)[0]}
    if precision != "fp32":
        programs["shardlm_half"] = shardlm_step(shape, precision, param_dtype="half")[0]
    if compiled and can_compile(torch.device("cpu")):
        programs["shardlm_compiled"] = shardlm_step(shape, precision, compile=True)[0]
    programs.update({name: hf_step(shape, activation, precision=precision) for name, activation in HF_VARIANTS.items()})
    programs.update({name: run for name, (run, _) in probes.items()})
    command = TrainCommand(shape, precision, warmup + repeats, folder, threads)
    try:
        times = interleaved({"shardlm_train": command, **programs}, repeats, warmup=warmup)
    finally:
        command.close()
    gemm = {name.removeprefix("gemm_"): [flops / t for t in times.pop(name)] for name, (_, flops) in probes.items()}
    own = gemm.pop("step")
    tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
    result = {f"{name}_tokens_per_sec": summary(values) for name, values in tokens.items()}

    def ratio(a, b):
        return summary([x / y for x, y in zip(tokens[a], tokens[b])])

    for name in [p for p in tokens if p.startswith("shardlm")]:
        suffix = name.removeprefix("shardlm")
        result[f"ratio{suffix}"] = ratio(name, "hf")
        result[f"ratio{suffix}_same_kernels"] = ratio(name, "hf_fused_gelu")
    result["train_command_over_step"] = ratio("shardlm_train", "shardlm")
    result["breakdown"] = breakdown(programs["shardlm"])  # one profiled step, after the timed rounds
    result["gemm_gflops"] = {n: summary([r / 1e9 for r in rates]) for n, rates in gemm.items()}
    first, best = gemm[str(gemm_sizes[0])], [max(rs) for rs in zip(*gemm.values())]
    result["step_gemm_gflops"] = summary([r / 1e9 for r in own])
    result["step_gemm_of_best"] = summary([r / b for r, b in zip(own, best)])
    for name in ("shardlm", "shardlm_half"):
        if name in tokens:  # achieved matmul FLOP/s over the GEMM rate of the same repeat
            achieved = [t * shape.flops_per_token for t in tokens[name]]
            result[f"mfu{name.removeprefix('shardlm')}"] = {
                "fraction": summary([a / g for a, g in zip(achieved, first)]),
                "fraction_of_best": summary([a / g for a, g in zip(achieved, best)]),
                "fraction_of_step_gemms": summary([a / g for a, g in zip(achieved, own)])}
    return result


def train_vs_hf(shape: BenchShape, repeats: int, threads: int = 2, vocab_sizes=VOCABULARIES,
                gemm_sizes=GEMM_SIZES, compiled: bool = True, probe_gflop: float = PROBE_GFLOP,
                warmup: int = WARMUP) -> dict:
    """Every (vocabulary, precision) comparison, the CPU's features and GEMM ceilings, and the CPU MFU.

    Top-level `ratio`, `ratio_same_kernels` and `*_tokens_per_sec` are the fp32 figures at the first
    vocabulary (BENCH's), as before; `by_vocabulary[V][precision]` holds all of them."""
    features = cpu_features()
    precisions = native_precisions(features)
    by_vocabulary: dict = {}
    with torch_threads(threads), tempfile.TemporaryDirectory() as folder:
        for vocab in vocab_sizes:
            for precision in precisions:
                figures = compare(replace(shape, vocab_size=vocab), precision, repeats, threads, Path(folder),
                                  gemm_sizes, compiled, probe_gflop, warmup)
                by_vocabulary.setdefault(str(vocab), {})[precision] = figures
    result = {"config": shape.describe("fp32 and bf16 autocast" if "bf16" in precisions else "fp32",
                                       vocabulary=False) + f", {threads} threads",
              "threads": threads, "hf_activation": HF_VARIANTS, "cpu_features": features, "precisions": precisions,
              "vocabularies": [int(v) for v in vocab_sizes], "by_vocabulary": by_vocabulary}
    result.update(by_vocabulary[str(vocab_sizes[0])]["fp32"])
    return result


def cpu_mfu(figures: dict, shape: BenchShape) -> dict:
    """CPU model-FLOPs utilization per vocabulary and precision, from the GEMM probes `compare` ran
    between the steps: achieved matmul FLOP/s of the shardlm Trainer step (model FLOPs) over the GEMM
    rate in the same dtype and threads, as the median of per-repeat ratios. `fraction` divides by
    the first probe size's rate, `fraction_of_best` by the best size's. Top-level keys: fp32 at
    BENCH's vocabulary."""
    rows: dict = {}
    ceilings: dict = {}
    for vocab, by_precision in figures["by_vocabulary"].items():
        flops = replace(shape, vocab_size=int(vocab)).flops_per_token
        for precision, fig in by_precision.items():
            gemm = {n: s["median"] for n, s in fig["gemm_gflops"].items()}
            for n, rate in gemm.items():
                ceilings.setdefault(precision, {}).setdefault(n, []).append(rate)
            for program in ("shardlm", "shardlm_half"):
                if f"{program}_tokens_per_sec" not in fig:
                    continue
                paired = fig[f"mfu{program.removeprefix('shardlm')}"]
                rows.setdefault(vocab, {})[f"{precision}{program.removeprefix('shardlm')}"] = {
                    "flops_per_token": flops,
                    "achieved_gflops": fig[f"{program}_tokens_per_sec"]["median"] * flops / 1e9,
                    "gemm_ceiling_gflops": next(iter(gemm.values())), "fraction": paired["fraction"]["median"],
                    "fraction_range": [paired["fraction"]["min"], paired["fraction"]["max"]],
                    "best_gemm_ceiling_gflops": max(gemm.values()),
                    "fraction_of_best": paired["fraction_of_best"]["median"],
                    "step_gemm_gflops": fig["step_gemm_gflops"]["median"],
                    "step_gemm_of_best": fig["step_gemm_of_best"]["median"],
                    "fraction_of_step_gemms": paired["fraction_of_step_gemms"]["median"],
                    "breakdown": fig["breakdown"]}
    first = rows[str(figures["vocabularies"][0])]["fp32"]
    return {**first, "gemm_ceilings_gflops": {p: {n: statistics.median(v) for n, v in by_size.items()}
                                              for p, by_size in ceilings.items()},
            "by_vocabulary": rows}
