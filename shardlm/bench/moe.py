"""Mixture-of-Experts training on one CPU: shardlm against transformers' Mixtral, and expert parallelism.

One small Mixtral-shaped model (`MOE_BENCH`: Llama layers whose MLPs are 8 SwiGLU experts, top-2,
softmax routing with the chosen weights renormalised, no aux loss) trains the same batch in every
program, with forward + backward + global-norm clipping + fused AdamW, taking turns in a new order
every round (`common.round_orders`):

- `shardlm`: a shardlm Trainer step (grouped-GEMM experts, fp32 router; in bf16 each expert's rows are
  padded to a multiple of `shardlm.models.moe.PAD_ROWS` on the CPU).
- `hf` (transformers as shipped): `MixtralForCausalLM` with its defaults. In transformers 5 the
  default expert implementation is `grouped_mm`, the kernel shardlm uses: as shipped and same
  kernels are one program there.
- `hf_eager`: the same model with `experts_implementation="eager"`, the per-expert loop that
  transformers shipped before 5.0 and still falls back to.

Which precision each side's expert GEMMs ran in is measured (`expert_gemm_dtypes`) and reported: under
bf16 autocast, transformers' `grouped_mm` experts run in the weights' dtype, fp32.

In a second world of 2 processes (in fp32, and again in bf16 where the CPU has native bf16), expert
parallelism: EP=2 (2 processes x 1 thread, each rank half of
the experts and half of the batch, tokens exchanged by all-to-all) against one process x 2 threads
running the whole batch, and DP=2 without EP (experts replicated) as the dense reference. The
all-to-all bytes of one EP=2 step, summed over the EP group, are checked against the formula
(`all_to_all_formula`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from shardlm.bench.breakdown import breakdown
from shardlm.bench.common import (
    cpu_features,
    interleaved,
    median_cell,
    native_precisions,
    round_orders,
    summary,
    timed_between_barriers,
    torch_threads,
)
from shardlm.models.config import ModelConfig
from shardlm.plan.flops import flops_per_token


@dataclass(frozen=True)
class MoEShape:
    """A Mixtral-shaped model and batch."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 512
    seq_length: int = 256
    micro_batch: int = 4
    vocab_size: int = 8192

    def model(self) -> dict:
        """The `[model]` section (shardlm's keys)."""
        return {"arch": "llama", "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "ffn_hidden_size": self.expert_ffn,
                "seq_length": self.seq_length, "vocab_size": self.vocab_size, "dropout": 0.0, "rope_theta": 1e6,
                "moe_num_experts": self.num_experts, "moe_top_k": self.top_k, "moe_ffn_hidden_size": self.expert_ffn,
                "moe_norm_topk_prob": True}

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(ModelConfig(**self.model()))

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads "
                f"({self.num_kv_heads} KV), {self.num_experts} SwiGLU experts of width {self.expert_ffn}, "
                f"top-{self.top_k}, sequence {self.seq_length}, micro-batch {self.micro_batch}, "
                f"vocabulary {self.vocab_size}")

    def trainer(self, ctx, expert: int = 1, global_batch: int | None = None, **train):
        """A shardlm Trainer of this shape on random tokens for `ctx` (expert-parallel size `expert`)."""
        from shardlm.config import from_dict
        from shardlm.data.gpt_dataset import TokenArrayDataset
        from shardlm.training.trainer import Trainer

        global_batch = global_batch or self.micro_batch * ctx.world_size
        config = from_dict({
            "model": self.model(), "parallel": {"expert": expert}, "data": {"text_file": "in-memory"},
            "train": {"micro_batch_size": self.micro_batch, "global_batch_size": global_batch, "steps": 1000,
                      "lr": 1e-4, "clip_grad": 1.0, "precision": "fp32", **train}})
        tokens = np.random.default_rng(0).integers(0, self.vocab_size, 100 * self.tokens)
        return Trainer(config, ctx, TokenArrayDataset(tokens, self.seq_length, seed=0, num_samples=1000 * global_batch))


MOE_BENCH = MoEShape()
MOE_QUICK = MoEShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, num_experts=4, expert_ffn=128,
                     seq_length=64, micro_batch=2, vocab_size=512)


def hf_step(shape: MoEShape, experts_implementation: str | None, precision: str = "fp32", seed: int = 0):
    """One training step of transformers' MixtralForCausalLM (SDPA attention) on the shape."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                           intermediate_size=shape.expert_ffn, num_hidden_layers=shape.num_layers,
                           num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                           num_local_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
                           max_position_embeddings=shape.seq_length, rope_theta=1e6, tie_word_embeddings=False)
    kwargs = {"attn_implementation": "sdpa"}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = MixtralForCausalLM._from_config(config, **kwargs).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    batch = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length),
                          generator=torch.Generator().manual_seed(seed))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.model = model
    return step, model.config._experts_implementation


GEMM_OPS = ("_grouped_mm", "mm", "addmm", "bmm")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def expert_gemm_dtypes(model: torch.nn.Module, experts_class: str, run) -> str:
    """The dtypes the GEMMs inside the first `experts_class` module of `model` ran in during `run()` (one
    training step): under autocast they are not always the autocast dtype. transformers' `grouped_mm`
    experts cast their input to the weights' dtype and `torch._grouped_mm` is not an autocast op, so in a
    "bf16" step with fp32 weights they run in fp32; its per-expert loop (`F.linear`) runs in bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in GEMM_OPS:
                seen.add(DTYPE_NAMES.get(args[0].dtype, str(args[0].dtype)))
            return func(*args, **(kwargs or {}))

    module = next(m for m in model.modules() if any(c.__name__ == experts_class for c in type(m).__mro__))
    mode = Record()
    handles = [module.register_forward_pre_hook(lambda *_: mode.__enter__() and None),  # None: inputs unchanged
               module.register_forward_hook(lambda *_: mode.__exit__(None, None, None) and None)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return "+".join(sorted(seen))


def single_process(shape: MoEShape, repeats: int, threads: int = 2, warmup: int = 1) -> dict:
    """tokens/s of shardlm and transformers' Mixtral in each precision the CPU runs natively, the ratios, and one
    profiled step of shardlm and hf by kind of operator (`breakdown`, after the timed rounds). `warmup`: untimed
    rounds before the timed ones (a quick run's 0: the experts' dtype step has run every program once)."""
    from shardlm.parallel import ParallelContext

    features = cpu_features()
    precisions = native_precisions(features)
    out: dict = {"config": f"{shape.describe()}, {threads} threads", "cpu_features": features,
                 "precisions": precisions}
    with torch_threads(threads):
        for precision in precisions:
            hf, shipped = hf_step(shape, None, precision)
            hf_eager, trainer = hf_step(shape, "eager", precision)[0], shape.trainer(ParallelContext.single(),
                                                                                     precision=precision)
            programs = {"shardlm": trainer.train_step, "hf": hf, "hf_eager": hf_eager}
            experts_dtype = {"shardlm": expert_gemm_dtypes(trainer.model, "GroupedExperts", trainer.train_step),
                             "hf": expert_gemm_dtypes(hf.model, "MixtralExperts", hf),
                             "hf_eager": expert_gemm_dtypes(hf_eager.model, "MixtralExperts", hf_eager)}
            times = interleaved(programs, repeats, warmup=warmup)
            tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
            figures = {f"{name}_tokens_per_sec": summary(values) for name, values in tokens.items()}
            figures |= {f"{name}_step_ms": summary([1000 * t for t in ts]) for name, ts in times.items()}
            figures["breakdown"] = {name: breakdown(programs[name]) for name in ("shardlm", "hf")}
            for other, key in (("hf", "ratio"), ("hf_eager", "ratio_eager")):
                figures[key] = summary([a / b for a, b in zip(tokens["shardlm"], tokens[other])])
            figures["hf_experts_implementation"] = shipped
            figures["experts_dtype"] = experts_dtype
            figures["shardlm_gflops"] = figures["shardlm_tokens_per_sec"]["median"] * shape.flops_per_token / 1e9
            out[precision] = figures
    return out


def expert_parallel_worker(shape: MoEShape, repeats: int, precision: str = "fp32", warmup: int = 1) -> dict:
    """On both ranks of a world of 2: EP=2, DP=2 and one process x 2 threads (rank 0; rank 1 waits)
    on the same global batch of 2 micro-batches; the all-to-all bytes of one EP=2 step. `warmup`: untimed rounds
    of every program first (a quick run's 0)."""
    from shardlm.parallel import ParallelContext

    rank = dist.get_rank()
    ep2 = shape.trainer(ParallelContext.from_process_group(1, expert_parallel=2), expert=2, precision=precision)
    dp2 = shape.trainer(ParallelContext.from_process_group(1), expert=1, precision=precision)
    one = shape.trainer(ParallelContext.single(), global_batch=2 * shape.micro_batch,
                        precision=precision) if rank == 0 else None
    programs = {"ep2": (ep2.train_step, True, 1), "dp2": (dp2.train_step, True, 1),
                "one_process": (lambda: one.train_step(), rank == 0, 2)}
    for _ in range(warmup):
        for run, here, threads in programs.values():
            timed_between_barriers(run, here, threads)
    ep2.ctx.comm.reset()
    timed_between_barriers(ep2.train_step, True, 1)
    mine = ep2.ctx.comm.snapshot().get("all_to_all/ep", {"calls": 0, "bytes": 0})
    traffic = ep2.ctx.world.all_gather_object({"calls": mine["calls"], "bytes": mine["bytes"]})
    times = {name: [] for name in programs}
    for order in round_orders(programs, repeats):
        for name in order:
            run, here, threads = programs[name]
            times[name].append(timed_between_barriers(run, here, threads))
    return {"times": times, "traffic": traffic} if rank == 0 else None


def all_to_all_formula(shape: MoEShape, ep: int = 2, bytes_per_value: int = 4, combine_bytes: int | None = None
                       ) -> dict:
    """All-to-all calls per rank and bytes summed over the EP group in a training step (one micro-batch
    per rank). Per MoE layer each rank makes 3 calls forward (the E per-expert counts, int64; dispatch;
    combine) and 2 backward (the two row exchanges' gradients). Dispatch sends a rank's N k (token,
    slot) rows of h values and combine returns the R rows its experts computed, backward the reverse, so
    a rank sends 2 (N k + R) rows (own rows included, as `all_to_all_single` takes them); R depends on
    the routing, but over the group the R add up to ep N k: 4 ep N k rows per layer. Dispatch and its
    gradient carry `bytes_per_value` a value, combine and its gradient `combine_bytes` (default the same):
    under bf16 autocast the tokens leave in fp32 (the residual stream) and the experts' outputs return
    in bf16 (4 and 2)."""
    combine_bytes = bytes_per_value if combine_bytes is None else combine_bytes
    values = shape.tokens * shape.top_k * shape.hidden_size
    per_layer = ep * (shape.num_experts * 8 + 2 * values * (bytes_per_value + combine_bytes))
    return {"calls_per_rank": 5 * shape.num_layers, "bytes": shape.num_layers * per_layer, "bytes_per_layer": per_layer}


def expert_parallel(shape: MoEShape, repeats: int, precision: str = "fp32", warmup: int = 1) -> dict:
    """EP=2 efficiency (tokens/s at EP=2 over one process x 2 threads, same global batch) and traffic."""
    from shardlm.parallel.spawn import run_workers

    result = run_workers(2, expert_parallel_worker, shape, repeats, precision, warmup, timeout=1800)[0]
    tokens = 2 * shape.tokens
    rates = {name: [tokens / t for t in ts] for name, ts in result["times"].items()}
    formula, traffic = all_to_all_formula(shape, combine_bytes=2 if precision == "bf16" else 4), result["traffic"]
    measured = {"calls_per_rank": [t["calls"] for t in traffic], "bytes": sum(t["bytes"] for t in traffic)}
    return {"config": f"{shape.describe()}, global batch {2 * shape.micro_batch}", "precision": precision,
            **{f"{name}_tokens_per_sec": summary(values) for name, values in rates.items()},
            "ep2_efficiency": summary([a / b for a, b in zip(rates["ep2"], rates["one_process"])]),
            "dp2_efficiency": summary([a / b for a, b in zip(rates["dp2"], rates["one_process"])]),
            "all_to_all": {"measured": measured, "formula": formula,
                           "matches_formula": measured["bytes"] == formula["bytes"] and all(
                               calls == formula["calls_per_rank"] for calls in measured["calls_per_rank"])}}


def moe_bench(quick: bool, repeats: int) -> dict:
    """The `moe` section of `make bench`."""
    shape, warmup = (MOE_QUICK, 0) if quick else (MOE_BENCH, 1)
    out = {"single_process": single_process(shape, repeats, warmup=warmup),
           "expert_parallel": expert_parallel(shape, repeats, warmup=warmup)}
    native = "bf16" in out["single_process"]["precisions"]  # the CPU multiplies bf16 natively
    out["expert_parallel_bf16"] = (expert_parallel(shape, repeats, "bf16", warmup) if native else
                                   {"skipped": out["single_process"]["cpu_features"].get("bf16_note")
                                    or "no native bf16 on this CPU"})
    return out


def markdown_lines(m: dict) -> list[str]:
    """The `moe` section of BENCHMARKS.md."""
    single, ep = m["single_process"], m["expert_parallel"]
    lines = ["## Mixture-of-Experts (`moe`)", "", f"Config: {single['config']}. One process: shardlm against "
             "transformers' `MixtralForCausalLM` (SDPA attention) computing the same function; `hf` is transformers "
             "as shipped, whose default expert kernel is reported below, `hf_eager` its per-expert loop.", "",
             "| precision | shardlm tokens/s | hf tokens/s | hf_eager tokens/s | shardlm / hf (`moe.single_process."
             "<p>.ratio`) | shardlm / hf_eager | hf's experts_implementation | experts' GEMMs ran in (shardlm / hf / "
             "hf_eager) |", "|---|---|---|---|---|---|---|---|"]
    for precision in single["precisions"]:
        f = single[precision]
        ran = f.get("experts_dtype", {})
        lines.append(f"| {precision} | {median_cell(f['shardlm_tokens_per_sec'], digits=0)} | "
                     f"{median_cell(f['hf_tokens_per_sec'], digits=0)} | "
                     f"{median_cell(f['hf_eager_tokens_per_sec'], digits=0)} | "
                     f"**{median_cell(f['ratio'])}** | {median_cell(f['ratio_eager'])} | "
                     f"{f['hf_experts_implementation']} | "
                     f"{' / '.join(ran.get(name, '?') for name in ('shardlm', 'hf', 'hf_eager'))} |")
    lines += ["", "The last column is measured inside one training step (the dtype of the GEMMs in the first "
              "experts module): transformers' `grouped_mm` experts cast their input to the weights' dtype and "
              "`torch._grouped_mm` is not autocast-enabled, so its bf16 step runs the experts in fp32; shardlm's "
              "run in bf16, each expert's rows padded to a multiple of `PAD_ROWS` on the CPU (docs/moe.md)."]
    a2a = ep["all_to_all"]
    lines += ["", f"Expert parallelism, {ep['config']}: EP=2 runs 2 processes x 1 thread (each half of the experts and "
              "of the batch), one process runs the whole batch with 2 threads; DP=2 without EP replicates the experts. "
              "fp32, and bf16 (autocast) where the CPU multiplies bf16 natively.",
              "", "| layout | tokens/s | / one process x 2 threads |", "|---|---|---|",
              f"| one process x 2 threads | {median_cell(ep['one_process_tokens_per_sec'], digits=0)} | 1 |",
              f"| EP=2 (`moe.expert_parallel.ep2_efficiency`) | {median_cell(ep['ep2_tokens_per_sec'], digits=0)} | "
              f"**{median_cell(ep['ep2_efficiency'])}** |",
              f"| DP=2, experts replicated | {median_cell(ep['dp2_tokens_per_sec'], digits=0)} | "
              f"{median_cell(ep['dp2_efficiency'])} |"]
    bf16 = m.get("expert_parallel_bf16") or {}
    if "ep2_efficiency" in bf16:
        lines += [f"| bf16: one process x 2 threads | {median_cell(bf16['one_process_tokens_per_sec'], digits=0)} "
                  "| 1 |",
                  f"| bf16: EP=2 (`moe.expert_parallel_bf16.ep2_efficiency`) | "
                  f"{median_cell(bf16['ep2_tokens_per_sec'], digits=0)} | **{median_cell(bf16['ep2_efficiency'])}** |",
                  f"| bf16: DP=2, experts replicated | {median_cell(bf16['dp2_tokens_per_sec'], digits=0)} | "
                  f"{median_cell(bf16['dp2_efficiency'])} |"]
    lines += ["",
              f"All-to-all of one EP=2 step, summed over the group: {a2a['measured']['bytes']:,} bytes in "
              f"{a2a['measured']['calls_per_rank']} calls per rank; formula {a2a['formula']['bytes']:,} bytes "
              f"({a2a['formula']['bytes_per_layer']:,} per MoE layer), {a2a['formula']['calls_per_rank']} calls "
              f"per rank: **`moe.expert_parallel.all_to_all.matches_formula` = {a2a['matches_formula']}**."]
    if "all_to_all" in bf16:
        b2a = bf16["all_to_all"]
        lines += ["", f"In bf16 (tokens dispatched in fp32, the residual stream's dtype; expert outputs combined in "
                  f"bf16): {b2a['measured']['bytes']:,} bytes, formula {b2a['formula']['bytes']:,}: "
                  f"`moe.expert_parallel_bf16.all_to_all.matches_formula` = {b2a['matches_formula']}."]
    return lines + [""]
