"""DeepSeek Sparse Attention on one CPU (`make bench` section `sparse_attention`).

- `layer`: one MLA layer's attention (`LatentAttention`, `LAYER_BENCH`: hidden 256, 8 heads, query and key/value
  latents of 128, qk 32 + 16, v 32; a lightning indexer of 16 heads of 32 channels) forward + backward on one
  sequence (batch 1, fp32, 2 threads), DSA (each query's `index_topk` keys, the indexer's KL loss attached as in
  training) against dense MLA: the same module with index_topk = 0, the same weights without the indexer (PyTorch's
  causal SDPA, a flash kernel on the CPU). Per length of `LENGTHS`: milliseconds of each program, taking turns in a
  new order every round (`common.round_orders`), dense / DSA per round, and the indexer's choice (its O(T^2) scoring
  and top-k, at its own small width) inside the DSA time; the bytes saved for the backward that are alive when the
  forward ends (`shardlm.plan.measure.SavedPeak`; `saved_activation_bytes` would also count what the indexer's
  divergence saves and frees chunk by chunk inside the forward) and the most bytes alive at once in forward +
  backward (`PeakMemory`), from one untimed call (the warm-up). The lengths have a time budget (`LAYER_BUDGET_S`) as in
  `shardlm.bench.linear_attention`: a length runs fewer rounds when the next would end past it, and is skipped with
  its projection when even one round would. `python -m shardlm.bench.sparse_attention --long` runs every length
  and top-k of `LONG_LENGTHS` and `LONG_TOPKS` without a budget (tens of minutes on 2 cores).
- `layer_bytes`: the saved bytes per token of one layer at DeepSeek-V3.2's proportions (`LAYER_V32_PROPORTIONS`),
  dense against DSA, from one untimed call each (`layer_bytes`).
- `train_vs_hf`: a tiny DeepSeek-V3.2 (`V32_BENCH`: `shardlm.bench.deepseek`'s DeepSeek-V3 shape with an indexer per
  layer choosing 64 of the 256 keys of a row) trains as `shardlm.bench.hf_compare` describes, in fp32 only: shardlm's
  Trainer on the converted checkpoint against transformers' `DeepseekV32ForCausalLM` as shipped (`hf`; its indexer's
  top-k becomes a dense (T, T) mask for SDPA) and with its per-expert loop (`hf_eager`), same weights, same batch,
  the loss check of steps 1 and 2 first. transformers computes no indexer loss (its indexer runs without gradient),
  so shardlm runs with `index_loss_coeff` = 0 there; `shardlm_kl` is shardlm's step with the indexer's KL loss
  (coefficient 1, as shardlm trains DSA), timed in the same rounds.
- `v4_train_vs_hf`: a tiny DeepSeek-V4 (`shardlm.bench.sparse_attention_v4`: hyper-connections, HCA and CSA
  compressed attention with its indexer, hash-routed and sqrt-softplus MoE) the same way against transformers'
  `DeepseekV4ForCausalLM` as shipped, fp32 only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.bench import hf_compare
from shardlm.bench.breakdown import breakdown
from shardlm.bench.common import cpu_features, interleaved, median_cell, summary, torch_threads
from shardlm.bench.deepseek import DeepSeekShape
from shardlm.bench.hf_compare import HFModel
from shardlm.bench.linear_attention import projected_seconds, timed_rounds
from shardlm.models.config import ModelConfig

LENGTHS = (4096, 8192, 16384, 32768)
QUICK_LENGTHS = (64, 256)
LONG_LENGTHS = (4096, 8192, 16384, 32768)
LONG_TOPKS = (512, 2048)
LAYER_BUDGET_S = 90.0
"""Seconds for the `layer` programs: past it a length runs fewer rounds, or none (skipped)."""
PREFIX = "layers.0.attn"


@dataclass(frozen=True)
class LayerShape:
    """One MLA layer (the names of `ModelConfig`) with a lightning indexer of `index_heads` heads of `index_head_dim`
    channels choosing `index_topk` keys a query (the default; a run may ask for others)."""

    hidden_size: int = 256
    num_heads: int = 8
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    index_heads: int = 16
    index_head_dim: int = 32
    index_topk: int = 512

    def config(self, seq_length: int, index_topk: int) -> ModelConfig:
        """The layer's ModelConfig; `index_topk` 0: dense MLA (no indexer)."""
        sparse = {"index_topk": index_topk, "index_heads": self.index_heads,
                  "index_head_dim": self.index_head_dim} if index_topk else {}
        return ModelConfig(arch="llama", attention="mla", num_layers=1, hidden_size=self.hidden_size,
                           num_heads=self.num_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                           qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                           v_head_dim=self.v_head_dim, seq_length=seq_length, vocab_size=256, dropout=0.0, **sparse)

    def describe(self) -> str:
        return (f"one MLA layer's attention: hidden {self.hidden_size}, {self.num_heads} heads, q_lora_rank "
                f"{self.q_lora_rank}, kv_lora_rank {self.kv_lora_rank}, qk {self.qk_nope_head_dim}+"
                f"{self.qk_rope_head_dim}, v {self.v_head_dim}; indexer {self.index_heads} heads of "
                f"{self.index_head_dim}")


LAYER_BENCH = LayerShape()
LAYER_QUICK = LayerShape(hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, index_heads=4, index_head_dim=16, index_topk=16)
LAYER_V32_PROPORTIONS = LayerShape(hidden_size=512, num_heads=32, q_lora_rank=256, kv_lora_rank=256,
                                   qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_heads=16,
                                   index_head_dim=64, index_topk=512)
"""DeepSeek-V3.2's layer in proportion (a quarter of its 128 heads and of its top-k 2,048, half its widths: qk 128 +
64, v 128, kv_lora_rank 512, an indexer of 64 heads of 128, whose width per key is 20% of dense attention's, as
here): `layer_bytes` measures what DSA keeps for the backward against dense MLA at these proportions, where
`LAYER_BENCH`'s 8 narrow heads make the indexer as wide as the attention."""
BYTES_LENGTH = 2048
BYTES_QUICK_LENGTH = 64


def build_layer(shape: LayerShape, seq_length: int, index_topk: int):
    """A `LatentAttention` in training mode, one process; the same weights for every `index_topk` (each weight's
    seed is its name's), the indexer's added when `index_topk` > 0."""
    from shardlm.models.mla import LatentAttention
    from shardlm.parallel import ParallelContext

    return LatentAttention(shape.config(seq_length, index_topk), ParallelContext.single(), 1234, PREFIX).train()


def layer_inputs(shape: LayerShape, seq_length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x and the output gradient, each (1, seq_length, hidden) fp32, from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, seq_length, shape.hidden_size, generator=generator) for _ in range(2))


def layer_program(layer, x: torch.Tensor, grad: torch.Tensor):
    """A program: layer(x) forward and its backward from `grad` (x a fresh leaf), gradients then dropped. On a sparse
    layer `run.choice_s` collects the seconds of each call's choice of keys (`LatentAttention.top_k`)."""
    choice_s: list[float] = []
    if layer.indexer is not None:
        top_k = layer.top_k

        def timed_top_k(*args):
            start = time.perf_counter()
            out = top_k(*args)
            choice_s.append(time.perf_counter() - start)
            return out

        layer.top_k = timed_top_k  # the instance's, read by `choose`

    def run():
        layer(x.detach().requires_grad_()).backward(grad)
        layer.zero_grad(set_to_none=True)

    run.choice_s = choice_s
    return run


def layer_memory(layer, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """One forward + backward of `layer` as `layer_program` runs it: the bytes autograd saved for the backward that
    are still alive when the forward ends (`SavedPeak.live`; parameters excluded, each storage once; tensors saved
    and freed inside the forward, such as the indexer's per-chunk gradients, do not count) and the most bytes the
    forward + backward held at once (`PeakMemory`: the tensors it created, parameter gradients included)."""
    from shardlm.plan.measure import PeakMemory, SavedPeak

    with PeakMemory() as peak:
        with SavedPeak(layer) as saved:
            out = layer(x.detach().requires_grad_())
        kept = saved.live
        out.backward(grad)
        del out
    layer.zero_grad(set_to_none=True)
    return {"saved_bytes": kept, "peak_bytes": peak.peak}


def layer_bytes(quick: bool) -> dict:
    """Saved bytes per token of one layer at `LAYER_V32_PROPORTIONS` (`LAYER_QUICK` when `quick`), dense MLA and DSA
    at its top-k, from one untimed forward + backward each (`layer_memory`) at `BYTES_LENGTH` tokens (per token
    bytes do not depend on the length at a fixed k: both grow as T)."""
    shape, length = (LAYER_QUICK, BYTES_QUICK_LENGTH) if quick else (LAYER_V32_PROPORTIONS, BYTES_LENGTH)
    x, grad = layer_inputs(shape, length)
    dense, dsa = (layer_memory(build_layer(shape, length, k), x, grad) for k in (0, shape.index_topk))
    return {"config": f"{shape.describe()}; DSA top-{shape.index_topk}; {length:,} tokens, batch 1, fp32",
            "tokens": length, "dense_saved_bytes_per_token": dense["saved_bytes"] / length,
            "dsa_saved_bytes_per_token": dsa["saved_bytes"] / length,
            "saved_ratio": dsa["saved_bytes"] / dense["saved_bytes"]}


def _names(topks: tuple[int, ...]) -> list[str]:
    return ["dense"] + [f"dsa_{k}" for k in topks]


def _row(seq_length: int, memory: dict, times: dict, choice: dict) -> dict:
    """One length's figures from each program's bytes (`layer_memory`), seconds per round and, for DSA, seconds of the
    choice per round."""
    ms = {name: [1000 * t for t in ts] for name, ts in times.items()}
    row: dict = {"tokens": seq_length, "rounds": len(ms["dense"]), "dense_ms": summary(ms["dense"]),
                 "dense_saved_bytes": memory["dense"]["saved_bytes"], "dense_peak_bytes": memory["dense"]["peak_bytes"]}
    for name in ms:
        if name == "dense":
            continue
        timed = summary(ms[name])
        row[name] = {"ms": timed, "choice_ms": summary([1000 * t for t in choice[name]]),
                     "speedup": summary([d / s for d, s in zip(ms["dense"], ms[name])]),
                     "saved_bytes": memory[name]["saved_bytes"], "peak_bytes": memory[name]["peak_bytes"],
                     "saved_ratio": memory[name]["saved_bytes"] / memory["dense"]["saved_bytes"],
                     "us_per_token": 1000 * timed["median"] / seq_length}
    row["dense_us_per_token"] = 1000 * row["dense_ms"]["median"] / seq_length
    return row


def layer_rows(shape: LayerShape, lengths: tuple[int, ...], topks: tuple[int, ...], rounds: int, deadline: float,
               threads: int = 2) -> dict:
    """Per length: the dense and each DSA program's ms per forward + backward, dense / DSA per round, the choice's ms
    inside DSA's, saved and peak bytes, rounds run (up to `rounds`; fewer when the `deadline`, time.perf_counter(),
    comes first); a length whose projected round (with its untimed first call) would not end before the deadline is
    skipped with its projection."""
    rows: list[dict] = []
    done: list[tuple[int, float]] = []
    with torch_threads(threads):
        for seq_length in lengths:
            projection = projected_seconds(done, seq_length)
            left = deadline - time.perf_counter()
            if projection is not None and 2 * projection > left:
                rows.append({"tokens": seq_length, "skipped": f"projected {projection:.0f} s a round (and as much "
                                                              f"again for its first call), {max(left, 0):.0f} s left"})
                continue
            x, grad = layer_inputs(shape, seq_length)
            programs, memory = {}, {}
            for name, k in zip(_names(topks), (0, *topks)):
                layer = build_layer(shape, seq_length, k)
                memory[name] = layer_memory(layer, x, grad)  # the untimed first call
                programs[name] = layer_program(layer, x, grad)
            times = timed_rounds(programs, rounds, deadline)
            rows.append(_row(seq_length, memory, times, {name: run.choice_s for name, run in programs.items()}))
            done.append((seq_length, sum(statistics.median(ts) for ts in times.values())))
    return {"config": f"{shape.describe()}; batch 1, fp32, forward + backward, {threads} threads, up to {rounds} "
                      "rounds", "topks": list(topks), "rows": rows, "rounds": rounds}


@dataclass(frozen=True)
class V32Shape(DeepSeekShape):
    """`DeepSeekShape` with DeepSeek Sparse Attention: an indexer of `index_heads` heads of `index_head_dim`
    channels per layer choosing `index_topk` keys a query."""

    index_topk: int = 64
    index_heads: int = 16
    index_head_dim: int = 32

    def hf_config(self):
        """transformers' DeepseekV32Config of this shape (fp32, untied embeddings, no multi-token prediction)."""
        from transformers import DeepseekV32Config

        return DeepseekV32Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.dense_ffn,
            moe_intermediate_size=self.expert_ffn, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
            n_shared_experts=self.shared_experts, n_routed_experts=self.num_experts,
            routed_scaling_factor=self.routed_scaling, kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim, n_group=self.groups, topk_group=self.topk_groups,
            num_experts_per_tok=self.top_k, first_k_dense_replace=self.dense_layers, norm_topk_prob=True,
            index_topk=self.index_topk, index_n_heads=self.index_heads, index_head_dim=self.index_head_dim,
            max_position_embeddings=self.seq_length, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    def describe(self) -> str:
        return (f"{super().describe()}; DeepSeek Sparse Attention: an indexer of {self.index_heads} heads of "
                f"{self.index_head_dim} per layer choosing {self.index_topk} of the {self.seq_length} keys")


V32_BENCH = V32Shape()
V32_QUICK = V32Shape(num_layers=2, hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16, dense_ffn=128, num_experts=4, expert_ffn=64, groups=2,
                     topk_groups=1, seq_length=64, micro_batch=2, vocab_size=512, index_topk=16, index_heads=16,
                     index_head_dim=16)


def save_hf_model(shape: V32Shape, folder: Path, seed: int = 0) -> Path:
    """A random fp32 DeepseekV32ForCausalLM of `shape` saved in `folder`, the routers and expert biases drawn as in
    `shardlm.bench.deepseek.save_hf_model`."""
    from transformers import DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(shape.hf_config()).float()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.1)
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(folder)
    return folder


OVERRIDES = {"moe_expert_bias": True, "moe_expert_bias_rate": 0.0, "moe_aux_loss_coeff": 0.0, "mtp_layers": 0}
DEEPSEEK_V32 = HFModel("DeepseekV32ForCausalLM", "DeepseekV32Experts", save_hf_model,
                       model_overrides={**OVERRIDES, "index_loss_coeff": 0.0})
"""The comparison's transformers side (its default attention, as shipped) and shardlm's keys: the expert bias fixed,
no aux loss, no multi-token prediction and no indexer loss, as transformers trains."""


def train_vs_hf(shape: V32Shape, repeats: int, threads: int = 2, warmup: int = 1) -> dict:
    """`hf_compare.single_process` in fp32 only, with shardlm's step with the indexer's KL loss (`shardlm_kl`) in the
    same rounds: step ms and tokens/s of each program, ratios shardlm / hf and shardlm / hf_eager per round (and
    shardlm_kl / hf), the loss check, one profiled step of shardlm and hf (`breakdown`), whether the median meets
    the goal. `warmup`: untimed rounds first (a quick run's 0: only `shardlm_kl` has not run a step before)."""
    from shardlm.checkpoint.hf import from_hf

    family = DEEPSEEK_V32
    out: dict = {"config": f"{shape.describe()}, {threads} threads", "cpu_features": cpu_features(),
                 "precisions": ["fp32"]}
    rows = hf_compare.random_rows(shape)
    with torch_threads(threads), tempfile.TemporaryDirectory() as tmp:
        folder = family.save(shape, Path(tmp) / "hf")
        checkpoint = from_hf(folder, Path(tmp) / "model.safetensors")
        hf, (attention, shipped) = hf_compare.hf_step(family, folder, rows, None)
        hf_eager = hf_compare.hf_step(family, folder, rows, "eager")[0]
        trainer = hf_compare.shardlm_trainer(checkpoint, shape, rows, "fp32", family.model_overrides)
        programs = {"shardlm": trainer.train_step, "hf": hf, "hf_eager": hf_eager}
        experts_dtype: dict = {}  # recorded in the loss check's second step
        out["loss_check"] = hf_compare.loss_check(  # fresh models: their first two steps
            programs, hf_compare.dtype_recorder(family, trainer, experts_dtype))
        with_kl = hf_compare.shardlm_trainer(checkpoint, shape, rows, "fp32", OVERRIDES)
        programs["shardlm_kl"] = with_kl.train_step
        times = interleaved(programs, repeats, warmup=warmup)
        tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
        figures = {"breakdown": {name: breakdown(programs[name]) for name in ("shardlm", "hf")}}
        figures |= {f"{name}_step_ms": summary([1000 * t for t in ts]) for name, ts in times.items()}
        figures |= {f"{name}_tokens_per_sec": summary(values) for name, values in tokens.items()}
        for name, other, key in (("shardlm", "hf", "ratio"), ("shardlm", "hf_eager", "ratio_eager"),
                                 ("shardlm_kl", "hf", "ratio_kl")):
            figures[key] = summary([a / b for a, b in zip(tokens[name], tokens[other])])
        figures |= {"hf_experts_implementation": shipped, "hf_attn_implementation": attention,
                    "experts_dtype": experts_dtype}
        out["fp32"] = figures
    ratio = out["fp32"]["ratio"]
    out["goal"] = {"ratio_at_least": hf_compare.GOAL, "fp32_ratio": ratio["median"],
                   "met": ratio["median"] >= hf_compare.GOAL,
                   "rounds_at_goal": sum(r >= hf_compare.GOAL for r in ratio["values"]), "rounds": len(ratio["values"])}
    return out


def layer_bench(quick: bool, repeats: int, lengths: tuple[int, ...] | None = None,
                topks: tuple[int, ...] | None = None, budget_s: float | None = None) -> dict:
    """The section's `layer` figures: `lengths` and `topks` in place of the defaults (`LENGTHS`, the shape's top-k;
    `--quick`: `QUICK_LENGTHS` on `LAYER_QUICK`), up to min(repeats, 3) rounds within `budget_s` seconds (None:
    `LAYER_BUDGET_S`, or none when `quick`)."""
    shape = LAYER_QUICK if quick else LAYER_BENCH
    budget = budget_s if budget_s is not None else (math.inf if quick else LAYER_BUDGET_S)
    return layer_rows(shape, lengths or (QUICK_LENGTHS if quick else LENGTHS), topks or (shape.index_topk,),
                      min(repeats, 3), time.perf_counter() + budget)


def sparse_attention_bench(quick: bool, repeats: int, **layer) -> dict:
    """The `sparse_attention` section of `make bench` (`layer`: `layer_bench`'s keywords)."""
    from shardlm.bench.sparse_attention_v4 import v4_train_vs_hf

    return {"layer": layer_bench(quick, repeats, **layer), "layer_bytes": layer_bytes(quick),
            "train_vs_hf": train_vs_hf(V32_QUICK if quick else V32_BENCH, repeats, warmup=0 if quick else 1),
            "v4_train_vs_hf": v4_train_vs_hf(quick, repeats)}


def _bytes(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def layer_lines(d: dict) -> list[str]:
    """The `sparse_attention.layer` table of BENCHMARKS.md."""
    lines = ["## DeepSeek Sparse Attention against dense MLA, one layer (`sparse_attention.layer`)", "",
             f"Config: {d['config']}. DSA: each query attends to its `index_topk` keys, chosen by the lightning "
             "indexer (its KL loss attached, as in training); dense: the same module and weights with index_topk = 0 "
             "(causal SDPA, a flash kernel on the CPU: no (T, T) tensor, its saved bytes grow as T). Choice: the "
             "indexer's scoring of every key and its top-k, inside DSA's time (O(T^2) at the indexer's width). "
             "Bytes: saved for the backward and alive when the forward ends (`SavedPeak`), and the most alive at once "
             "in forward + backward (`PeakMemory`).", "",
             "| tokens | program | ms | of it, choice ms | dense / DSA (`...rows[].dsa_<k>.speedup`) | us/token | "
             "saved for backward | DSA / dense saved | peak | rounds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in d["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['tokens']:,} | skipped: {row['skipped']} | | | | | | | | 0 |")
            continue
        lines.append(f"| {row['tokens']:,} | dense | {median_cell(row['dense_ms'], digits=0)} | | | "
                     f"{row['dense_us_per_token']:.0f} | {_bytes(row['dense_saved_bytes'])} | | "
                     f"{_bytes(row['dense_peak_bytes'])} | {row['rounds']} |")
        for k in d["topks"]:
            s = row.get(f"dsa_{k}")
            if s is None:
                continue
            lines.append(f"| {row['tokens']:,} | DSA, top-{k} | {median_cell(s['ms'], digits=0)} | "
                         f"{median_cell(s['choice_ms'], digits=0)} | **{median_cell(s['speedup'])}** | "
                         f"{s['us_per_token']:.0f} | {_bytes(s['saved_bytes'])} | {s['saved_ratio']:.2f} | "
                         f"{_bytes(s['peak_bytes'])} | {row['rounds']} |")
    return lines + [""]


def markdown_lines(d: dict) -> list[str]:
    """The `sparse_attention` section of BENCHMARKS.md."""
    train = d["train_vs_hf"]
    lines = hf_compare.markdown_lines(train, "sparse_attention.train_vs_hf", "DeepSeek-V3.2 training step",
                                      f"`DeepseekV32ForCausalLM` ({train['fp32']['hf_attn_implementation']} attention "
                                      "over the indexer's dense (T, T) mask)")
    f = train["fp32"]
    lines[-1:-1] = ["", f"With the indexer's KL loss (`shardlm_kl`, as shardlm trains DSA; transformers trains no "
                        f"indexer): {median_cell(f['shardlm_kl_step_ms'], digits=1)} ms/step, "
                        f"{median_cell(f['ratio_kl'])} x transformers' tokens/s "
                        "(`sparse_attention.train_vs_hf.fp32.ratio_kl`)."]
    if "v4_train_vs_hf" in d:
        from shardlm.bench import sparse_attention_v4

        lines += sparse_attention_v4.markdown_lines(d["v4_train_vs_hf"])
    lines += layer_lines(d["layer"])
    if "layer_bytes" in d:
        b = d["layer_bytes"]
        dense, dsa = b["dense_saved_bytes_per_token"], b["dsa_saved_bytes_per_token"]
        lines += ["### What DSA keeps for the backward at DeepSeek-V3.2's proportions "
                  "(`sparse_attention.layer_bytes`)", "",
                  f"Config: {b['config']}. Bytes saved for the backward and alive when the forward ends, per token: "
                  f"dense MLA {dense:,.0f}, DSA {dsa:,.0f}: **DSA / dense {b['saved_ratio']:.2f}** "
                  "(`sparse_attention.layer_bytes.saved_ratio`).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlm.bench.sparse_attention`: the section alone, its JSON (with the machine) and markdown on
    stdout."""
    from shardlm.bench.common import machine

    parser = argparse.ArgumentParser(prog="python -m shardlm.bench.sparse_attention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help=f"lengths {LONG_LENGTHS} and top-k {LONG_TOPKS}, no budget")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: check the harness, not the numbers")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed rounds of the training step (default 7; the layer's: at most 3)")
    parser.add_argument("--layer-only", action="store_true", help="the layer's figures alone")
    args = parser.parse_args(argv)
    layer = {"lengths": LONG_LENGTHS, "topks": LONG_TOPKS, "budget_s": math.inf} if args.long else {}
    if args.layer_only:
        result = {"machine": machine(), "layer": layer_bench(args.quick, args.repeats, **layer)}
        lines = layer_lines(result["layer"])
    else:
        result = {"machine": machine(), **sparse_attention_bench(args.quick, args.repeats, **layer)}
        lines = markdown_lines(result)
    print(json.dumps(result, indent=2, default=float))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
