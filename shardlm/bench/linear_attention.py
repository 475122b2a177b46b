"""Hybrid linear attention on one CPU (`make bench` section `linear_attention`).

- `train_vs_hf`: a tiny Qwen3.5-MoE (`QWEN35_BENCH`: three Gated DeltaNet layers before each full-attention
  layer, the full ones with an output gate and partial RoPE, zero-centred RMSNorms, MoE MLPs of SwiGLU experts
  plus a shared expert behind a sigmoid gate) trains as `shardlm.bench.hf_compare` describes: shardlm's Trainer
  on the converted checkpoint against transformers' `Qwen3_5MoeForCausalLM` as shipped (`hf`) and with its
  per-expert loop (`hf_eager`), same saved weights, same batch, fp32 loss check of steps 1 and 2 first, in fp32
  and (where the CPU has native bf16) bf16 autocast. transformers' Gated DeltaNet runs its PyTorch fallback
  (`torch_chunk_gated_delta_rule`; flash-linear-attention and causal-conv1d are GPU kernels), the same chunked
  algorithm as `shardlm.models.delta_rule`. The random model's norms, `dt_bias` and router are drawn away from
  their initial values so that every piece takes part in the loss.
- `scaling`: forward + backward of one layer stack on one sequence (batch 1, fp32), the hybrid stack (the
  shape's layer types: 3 Gated DeltaNet + 1 full, dense SwiGLU MLPs), the same stack with Kimi Delta Attention
  (`kda`: as many key as value heads, `linear_value_heads` of `linear_value_dim`, so the state is Gated DeltaNet's)
  and a Nemotron-H stack of twice the blocks (`mamba`, "M-M-M-*-" at 4 layers: a Mamba-2 mixer of
  `linear_value_heads` heads of 2 x hidden / heads channels for each linear layer and attention without positions
  for each full one, each followed by a ReLU^2 MLP block of `dense_ffn`) against a stack of full-attention layers
  of the same width and depth, at each sequence length of `LENGTHS`, taking turns in a new order every round
  (`common.round_orders`; one warm-up round at the shortest length). `speedup` is attention ms / hybrid ms per
  round, `speedup_kda` and `speedup_mamba` the same for the other two. The stacks have a time budget
  (`SCALING_BUDGET_S`, so that the section takes about 6 minutes on a quiet 2-core CPU): a length runs fewer
  rounds when the next would end past it (at least one), and is skipped, with its projection, when even one round
  would (the last length's round time grown as it grew from the length before, quadratically after the first).
  The plot is `docs/figures/linear_attention.png` (`common.FIGURES`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.bench import hf_compare
from shardlm.bench.common import FIGURES, median_cell, round_orders, summary, torch_threads
from shardlm.bench.hf_compare import HFModel

LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (128, 256)
SCALING_BUDGET_S = 300.0
"""Seconds for the `scaling` stacks: past it a length runs fewer rounds, or none (skipped)."""


@dataclass(frozen=True)
class Qwen35Shape:
    """A Qwen3.5-MoE-shaped model and batch. Full attention: `num_heads` query heads over `num_kv_heads` KV heads
    of `head_dim`, RoPE on the first `rope_fraction` of each head's channels. Gated DeltaNet: `linear_key_heads`
    query/key heads of `linear_key_dim`, `linear_value_heads` value heads of `linear_value_dim`, a causal
    convolution of `conv_kernel`. Every `full_attention_interval`-th layer is full attention, the rest linear.
    MLPs: `num_experts` experts of width `expert_ffn`, top-`top_k`, plus a gated shared expert of `shared_ffn`;
    `dense_ffn` is the width of the dense SwiGLU of the `scaling` stacks."""

    num_layers: int = 4
    full_attention_interval: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_fraction: float = 0.25
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_key_dim: int = 64
    linear_value_dim: int = 64
    conv_kernel: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    shared_ffn: int = 256
    dense_ffn: int = 512
    seq_length: int = 512
    micro_batch: int = 2
    vocab_size: int = 8192

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_layers)]

    def hf_config(self):
        """transformers' Qwen3_5MoeTextConfig of this shape (fp32, untied embeddings, no aux loss, no MTP)."""
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_key_heads, linear_num_value_heads=self.linear_value_heads,
            linear_key_head_dim=self.linear_key_dim, linear_value_head_dim=self.linear_value_dim,
            linear_conv_kernel_dim=self.conv_kernel, layer_types=self.layer_types, num_experts=self.num_experts,
            num_experts_per_tok=self.top_k, moe_intermediate_size=self.expert_ffn,
            shared_expert_intermediate_size=self.shared_ffn, max_position_embeddings=max(self.seq_length, 128),
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": self.rope_fraction},
            router_aux_loss_coef=0.0, output_router_logits=False, tie_word_embeddings=False, torch_dtype="float32")

    def stack_config(self, layer_types: list[str], seq_length: int):
        """shardlm's ModelConfig of a `scaling` stack: this shape's widths with `layer_types`, dense SwiGLU MLPs."""
        from shardlm.models.config import ModelConfig

        return ModelConfig(
            arch="llama", num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, ffn_hidden_size=self.dense_ffn,
            seq_length=seq_length, vocab_size=256, dropout=0.0, rope_theta=1e6, rope_fraction=self.rope_fraction,
            qk_norm=True, layer_types=layer_types, linear_num_key_heads=self.linear_key_heads,
            linear_num_value_heads=self.linear_value_heads, linear_key_head_dim=self.linear_key_dim,
            linear_value_head_dim=self.linear_value_dim, linear_conv_kernel=self.conv_kernel,
            attention_output_gate=True, norm_zero_centered=True)

    def describe_layers(self) -> str:
        linear = self.layer_types.count("linear_attention")
        return (f"{self.num_layers} layers ({linear} Gated DeltaNet, {self.num_layers - linear} full attention), "
                f"hidden {self.hidden_size}; full attention {self.num_heads} heads ({self.num_kv_heads} KV) of "
                f"{self.head_dim}, output gate, RoPE on {self.rope_fraction:g} of each head; Gated DeltaNet "
                f"{self.linear_key_heads} key heads of {self.linear_key_dim}, {self.linear_value_heads} value heads "
                f"of {self.linear_value_dim}, convolution {self.conv_kernel}")

    def describe(self) -> str:
        return (f"{self.describe_layers()}; {self.num_experts} SwiGLU experts of width {self.expert_ffn} "
                f"top-{self.top_k} + a gated shared expert of {self.shared_ffn}; sequence {self.seq_length}, "
                f"micro-batch {self.micro_batch}, vocabulary {self.vocab_size}, no aux loss, no MTP")


    def kda_config(self, layer_types: list[str], seq_length: int):
        """The `kda` stack: `stack_config` with Kimi Delta Attention on the linear layers (`linear_value_heads` key
        and value heads of `linear_value_dim`)."""
        return dataclasses.replace(self.stack_config(layer_types, seq_length), linear_attention_rule="kimi_delta",
                                   linear_num_key_heads=self.linear_value_heads,
                                   linear_key_head_dim=self.linear_value_dim)

    @property
    def mamba_pattern(self) -> str:
        """The `mamba` stack's Nemotron-H blocks: "M-" for each linear layer, "*-" for each full one."""
        return "".join("M-" if kind == "linear_attention" else "*-" for kind in self.layer_types)

    def mamba_config(self, seq_length: int):
        """The `mamba` stack: Nemotron-H blocks `mamba_pattern` of this width; Mamba-2 of `linear_value_heads`
        heads (inner width 2 x hidden) in 2 groups of a `linear_key_dim` state, chunks of 128 (the seq_length at
        most); attention without positions as the full layers'; ReLU^2 MLPs of `dense_ffn`."""
        from shardlm.models.config import ModelConfig

        return ModelConfig(
            arch="llama", num_layers=2 * self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, ffn_hidden_size=self.dense_ffn,
            seq_length=seq_length, vocab_size=256, dropout=0.0, layer_pattern=self.mamba_pattern,
            mamba_num_heads=self.linear_value_heads, mamba_head_dim=2 * self.hidden_size // self.linear_value_heads,
            mamba_state_size=self.linear_key_dim, mamba_groups=2, mamba_conv_kernel=self.conv_kernel,
            mamba_chunk_size=min(128, seq_length))


STACKS = ("hybrid", "kda", "mamba", "attention")
"""The `scaling` programs; each but `attention` has a `speedup` (`speedup_<name>` but the hybrid's) against it."""
QWEN35_BENCH = Qwen35Shape()
QWEN35_QUICK = Qwen35Shape(num_layers=2, full_attention_interval=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                           head_dim=32, linear_key_heads=2, linear_value_heads=4, linear_key_dim=16,
                           linear_value_dim=16, num_experts=4, expert_ffn=64, shared_ffn=64, dense_ffn=128,
                           seq_length=128, micro_batch=2, vocab_size=512)


def save_hf_model(shape: Qwen35Shape, folder: Path, seed: int = 0) -> Path:
    """A random fp32 Qwen3_5MoeForCausalLM of `shape` saved in `folder`: every norm weight and `dt_bias` moved by
    N(0, 0.1) off its constant initial value (0 for the zero-centred norms, 1 for the rest), and the routers
    sharpened (std 0.1), so that a norm or gate converted wrongly changes the loss."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(shape.hf_config()).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.add_(torch.randn_like(param), alpha=0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder


QWEN35 = HFModel("Qwen3_5MoeForCausalLM", "Qwen3_5MoeExperts", save_hf_model, attn_implementation=None,
                 model_overrides={"moe_aux_loss_coeff": 0.0})
"""The comparison's transformers side (its default attention, as shipped) and shardlm's keys: no aux loss, as
transformers trains without `output_router_logits`."""


def hf_linear_kernels() -> str:
    """Which Gated DeltaNet kernels transformers can use here: its PyTorch fallback unless flash-linear-attention
    (`fla`) and causal-conv1d are installed (GPU kernels)."""
    found = [name for name in ("fla", "causal_conv1d") if importlib.util.find_spec(name) is not None]
    return f"kernels installed: {', '.join(found)}" if found else "its PyTorch fallback; fla and causal_conv1d absent"


def stack_configs(shape: Qwen35Shape, seq_length: int) -> dict:
    """{`STACKS` name: shardlm ModelConfig} of the `scaling` stacks at `seq_length`."""
    return {"hybrid": shape.stack_config(shape.layer_types, seq_length),
            "kda": shape.kda_config(shape.layer_types, seq_length), "mamba": shape.mamba_config(seq_length),
            "attention": shape.stack_config(["full_attention"] * shape.num_layers, seq_length)}


def stack_program(shape: Qwen35Shape, config, seq_length: int, seed: int = 0):
    """A program: forward + backward of a one-process shardlm stack of `config` (a ModelConfig) on one random
    sequence (1, seq_length, hidden), from a fixed random output gradient."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    model = build_model(config, ParallelContext.single(), seed=1234).train()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, seq_length, shape.hidden_size, generator=generator)
    grad = torch.randn(1, seq_length, shape.hidden_size, generator=generator)

    def run():
        inputs = x.detach().requires_grad_()
        model.run_layers(inputs, model.layers.values()).backward(grad)
        model.zero_grad(set_to_none=True)

    return run


def projected_seconds(done: list[tuple[int, float]], seq_length: int) -> float | None:
    """One round's seconds at `seq_length` grown from the last measured (length, round seconds) as it grew from
    the length before (quadratically when only one was measured); None before any."""
    if not done:
        return None
    (length, seconds), before = done[-1], done[-2] if len(done) > 1 else None
    exponent = 2.0 if before is None else max(1.0, math.log(seconds / before[1]) / math.log(length / before[0]))
    return seconds * (seq_length / length) ** exponent


def timed_rounds(programs: dict, rounds: int, deadline: float, warmup: int = 0) -> dict[str, list[float]]:
    """`common.interleaved` (seconds per call, one round of every program per repeat, in `round_orders`) that
    stops before a round when the last one, taken again, would end after `deadline` (time.perf_counter()); at
    least one round."""
    for _ in range(warmup):
        for run in programs.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in programs}
    last = 0.0
    for order in round_orders(programs, rounds):
        start = time.perf_counter()
        if last and start + last > deadline:
            break
        for name in order:
            begin = time.perf_counter()
            programs[name]()
            times[name].append(time.perf_counter() - begin)
        last = time.perf_counter() - start
    return times


def stack_row(seq_length: int, ms: dict[str, list[float]]) -> dict:
    """A `scaling` row from each stack's ms per round: `<name>_ms` and `<name>_us_per_token` (median), the rounds,
    and attention ms / the stack's per round (`speedup` for the hybrid, `speedup_<name>` for the others)."""
    row: dict = {"tokens": seq_length, "rounds": len(ms["hybrid"])}
    for name in STACKS:
        row[f"{name}_ms"] = summary(ms[name])
        row[f"{name}_us_per_token"] = 1000 * row[f"{name}_ms"]["median"] / seq_length
        if name != "attention":
            key = "speedup" if name == "hybrid" else f"speedup_{name}"
            row[key] = summary([a / h for a, h in zip(ms["attention"], ms[name])])
    return row


def first_faster(rows: list[dict], key: str) -> int | None:
    """The shortest measured length whose median `key` (a speedup) is above 1, or None."""
    faster = [row["tokens"] for row in rows if "skipped" not in row and row[key]["median"] > 1.0]
    return faster[0] if faster else None


def scaling(shape: Qwen35Shape, lengths: tuple[int, ...], rounds: int, deadline: float, threads: int = 2) -> dict:
    """Per length: ms of each of `STACKS` per forward + backward, attention's / each one's per round, microseconds
    per token, the rounds run (up to `rounds`: fewer when the `deadline`, time.perf_counter(), comes first); a
    length whose projected round (all the stacks) would not end before the deadline is skipped with its
    projection."""
    rows: list[dict] = []
    done: list[tuple[int, float]] = []
    with torch_threads(threads):
        for seq_length in lengths:
            projection = projected_seconds(done, seq_length)
            left = deadline - time.perf_counter()
            if projection is not None and projection > left:
                rows.append({"tokens": seq_length, "skipped": f"projected {projection:.0f} s a round, "
                                                              f"{max(left, 0):.0f} s left of the budget"})
                continue
            programs = {name: stack_program(shape, config, seq_length)
                        for name, config in stack_configs(shape, seq_length).items()}
            times = timed_rounds(programs, rounds, deadline, warmup=0 if rows else 1)
            rows.append(stack_row(seq_length, {name: [1000 * t for t in ts] for name, ts in times.items()}))
            done.append((seq_length, sum(rows[-1][f"{name}_ms"]["median"] for name in STACKS) / 1000))
    mamba = shape.mamba_config(lengths[0])
    return {"config": f"{shape.describe_layers()}; dense SwiGLU of {shape.dense_ffn}; kda: the same with Kimi Delta "
                      f"Attention of {shape.linear_value_heads} heads of {shape.linear_value_dim}; mamba: Nemotron-H "
                      f"blocks {shape.mamba_pattern}, Mamba-2 {mamba.mamba_num_heads} heads of {mamba.mamba_head_dim} "
                      "in "
                      f"{mamba.mamba_groups} groups, state {mamba.mamba_state_size}, chunks of 128 (or the length), "
                      f"ReLU^2 MLPs of {shape.dense_ffn}; batch 1, fp32, forward + backward, {threads} threads, up "
                      f"to {rounds} rounds", "rows": rows, "hybrid_layer_types": shape.layer_types,
            "mamba_pattern": shape.mamba_pattern, "rounds": rounds,
            "first_length_hybrid_faster": first_faster(rows, "speedup"),
            "first_length_kda_faster": first_faster(rows, "speedup_kda"),
            "first_length_mamba_faster": first_faster(rows, "speedup_mamba")}


def linear_attention_bench(quick: bool, repeats: int, out_dir: Path | None = None) -> dict:
    """The `linear_attention` section of `make bench`."""
    shape = QWEN35_QUICK if quick else QWEN35_BENCH
    train = hf_compare.single_process(shape, QWEN35, repeats, warmup=0 if quick else 1)
    train["hf_linear_kernels"] = hf_linear_kernels()
    deadline = time.perf_counter() + (math.inf if quick else SCALING_BUDGET_S)
    stacks = scaling(shape, QUICK_LENGTHS if quick else LENGTHS, min(repeats, 3), deadline)
    if out_dir is not None:
        stacks["plot"] = plot(stacks["rows"], Path(out_dir), f"{FIGURES}/linear_attention.png")
    return {"train_vs_hf": train, "scaling": stacks}


def plot(rows: list[dict], out_dir: Path, relative: str) -> str | None:
    """ms per forward + backward against tokens (log-log) of both stacks, written to `out_dir / relative`; `relative`
    (the link from BENCHMARKS.md in `out_dir`), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    measured = [row for row in rows if "skipped" not in row]
    path = out_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(7, 4))
    tokens = [row["tokens"] for row in measured]
    for name, label, style in (("hybrid", "Gated DeltaNet hybrid (3 linear + 1 full)", "o-"),
                               ("kda", "Kimi Delta Attention hybrid (3 linear + 1 full)", "^-"),
                               ("mamba", "Nemotron-H (3 Mamba-2 + 1 attention)", "v-"),
                               ("attention", "full attention only", "s--")):
        axes.plot(tokens, [row[f"{name}_ms"]["median"] for row in measured], style, label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("sequence length (tokens, batch 1)")
    axes.set_ylabel("forward + backward ms (median)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return relative


def markdown_lines(d: dict) -> list[str]:
    """The `linear_attention` section of BENCHMARKS.md."""
    train, stacks = d["train_vs_hf"], d["scaling"]
    lines = hf_compare.markdown_lines(train, "linear_attention.train_vs_hf", "Qwen3.5-MoE training step",
                                      "`Qwen3_5MoeForCausalLM` (Gated DeltaNet: "
                                      f"{train.get('hf_linear_kernels', 'as shipped')})")
    lines += ["## Hybrid layer stack against full attention (`linear_attention.scaling`)", "",
              f"Config: {stacks['config']}. Forward + backward of one sequence through the hybrid stack (layer "
              f"types {', '.join(stacks['hybrid_layer_types'])}), the same with Kimi Delta Attention (`kda`), a "
              f"Nemotron-H stack (`mamba`, blocks {stacks['mamba_pattern']}) and as many "
              "full-attention layers of the same width; they take turns every round. Speedup: full attention ms / "
              "the stack's (`linear_attention.scaling.rows[].speedup`, `.speedup_kda`, `.speedup_mamba`).", "",
              "| tokens | Gated DeltaNet hybrid ms | KDA hybrid ms | Nemotron-H (Mamba-2) ms | full attention ms | "
              "full / Gated DeltaNet | full / KDA | full / Mamba-2 | us/token (GDN, KDA, Mamba-2, full) | rounds |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in stacks["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['tokens']:,} | skipped: {row['skipped']} | | | | | | | | 0 |")
            continue
        per_token = ", ".join(f"{row[f'{name}_us_per_token']:.1f}" for name in STACKS)
        cells = [median_cell(row[f"{name}_ms"], digits=1) for name in STACKS]
        cells += [f"**{median_cell(row[key])}**" for key in ("speedup", "speedup_kda", "speedup_mamba")]
        lines.append(" | ".join([f"| {row['tokens']:,}"] + cells + [per_token, f"{row['rounds']} |"]))
    lines.append("")
    for key, what in (("hybrid", "Gated DeltaNet hybrid"), ("kda", "KDA hybrid"), ("mamba", "Nemotron-H")):
        first = stacks.get(f"first_length_{key}_faster")
        lines.append(f"The shortest length at which the {what} stack was faster (median): **{first:,} tokens**."
                     if first else f"The {what} stack was not faster than full attention at any length measured.")
    if stacks.get("plot"):
        lines += ["", f"![forward + backward ms against sequence length]({stacks['plot']})"]
    return lines + [""]
