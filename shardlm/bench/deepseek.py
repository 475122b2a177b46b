"""A tiny DeepSeek-V3 training step on one CPU: shardlm against transformers' DeepseekV3ForCausalLM.

One small DeepSeek-V3 (`DS_BENCH`: multi-head latent attention with a query low-rank path, the first
layer dense, then MoE layers of routed SwiGLU experts chosen by sigmoid scores plus a fixed expert bias
(`e_score_correction_bias`), group-limited top-k, top-k renormalised and scaled by `routed_scaling`, one
shared expert; no multi-token prediction, no aux loss) is built by transformers in fp32, saved with
`save_pretrained` and converted with `shardlm.checkpoint.hf.from_hf`, so every program starts from the
same weights. Each program trains the same batch (micro_batch, seq_length) of random tokens: forward +
backward + global-norm clipping at 1.0 + fused AdamW (lr 1e-4 constant, weight decay 0.01 on matrices),
taking turns in a new order every round (`common.round_orders`):

- `shardlm`: a shardlm Trainer step on the converted checkpoint (grouped-GEMM experts, fp32 router).
- `hf` (transformers as shipped): `DeepseekV3ForCausalLM` with SDPA attention and its default experts
  implementation (reported: `grouped_mm` in transformers 5, the kernel shardlm uses).
- `hf_eager`: the same model with `experts_implementation="eager"`, transformers' per-expert loop.

Before timing, the first step's loss of each program on the same batch is compared with shardlm's (fp32;
`loss_check`, tolerance 1e-4), and again after one AdamW update, so that the programs compared compute the
same model. Precisions: fp32, and bf16 autocast where the CPU multiplies bf16 natively (`cpu_features`);
which dtype each program's expert GEMMs ran in is measured (`moe.expert_gemm_dtypes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardlm.bench.common import cpu_features, interleaved, median_cell, summary
from shardlm.bench.moe import expert_gemm_dtypes

GOAL = 1.2  # shardlm tokens/s / transformers' as shipped, fp32
LOSS_TOL = 1e-4


@dataclass(frozen=True)
class DeepSeekShape:
    """A DeepSeek-V3-shaped model and batch. Attention: per head a query/key of qk_nope_head_dim +
    qk_rope_head_dim channels and a value of v_head_dim; queries through (hidden -> q_lora_rank -> heads),
    keys and values through (hidden -> kv_lora_rank + qk_rope_head_dim -> heads). MLPs: `dense_layers`
    dense SwiGLU layers of width `dense_ffn`, then `num_experts` routed experts of width `expert_ffn`
    (top-`top_k` in the best `topk_groups` of `groups` groups) plus `shared_experts` shared ones."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    dense_layers: int = 1
    dense_ffn: int = 512
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    shared_experts: int = 1
    groups: int = 4
    topk_groups: int = 2
    routed_scaling: float = 2.5
    seq_length: int = 256
    micro_batch: int = 4
    vocab_size: int = 8192

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    def hf_config(self):
        """transformers' DeepseekV3Config of this shape (fp32, untied embeddings, no multi-token prediction)."""
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.dense_ffn,
            moe_intermediate_size=self.expert_ffn, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
            n_shared_experts=self.shared_experts, n_routed_experts=self.num_experts,
            routed_scaling_factor=self.routed_scaling, kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim, n_group=self.groups, topk_group=self.topk_groups,
            num_experts_per_tok=self.top_k, first_k_dense_replace=self.dense_layers, norm_topk_prob=True,
            max_position_embeddings=self.seq_length, rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_nextn_predict_layers=0, torch_dtype="float32")

    def describe(self) -> str:
        return (f"{self.num_layers} layers ({self.dense_layers} dense of width {self.dense_ffn}), hidden "
                f"{self.hidden_size}, {self.num_heads} MLA heads (q_lora_rank {self.q_lora_rank}, kv_lora_rank "
                f"{self.kv_lora_rank}, qk {self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v {self.v_head_dim}), "
                f"{self.num_experts} routed experts of width {self.expert_ffn} top-{self.top_k} (sigmoid + "
                f"expert bias, {self.groups} groups / top {self.topk_groups}, scaling {self.routed_scaling}) + "
                f"{self.shared_experts} shared, sequence {self.seq_length}, micro-batch {self.micro_batch}, "
                f"vocabulary {self.vocab_size}, no MTP, no aux loss")


DS_BENCH = DeepSeekShape()
DS_QUICK = DeepSeekShape(num_layers=2, hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=16,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, dense_ffn=128, num_experts=4,
                         expert_ffn=64, groups=2, topk_groups=1, seq_length=64, micro_batch=2, vocab_size=512)


def save_hf_model(shape: DeepSeekShape, folder: Path, seed: int = 0) -> Path:
    """A random fp32 DeepseekV3ForCausalLM of `shape` saved in `folder`, with a non-zero expert bias (drawn
    uniform in +-0.05, so that it moves the routing) and a router of std 0.1 (sharper than its 0.02 init)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(shape.hf_config()).float()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.1)
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(folder)
    return folder


class FixedBatch:
    """A dataset whose sample i is row i % len(rows) of `rows` (n, seq_length + 1): every step trains the
    same micro-batch, the batch transformers' programs train."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[i % len(self.rows)]


def random_rows(shape: DeepSeekShape, seed: int = 0) -> np.ndarray:
    """(micro_batch, seq_length + 1) int64 random tokens: inputs are [:, :-1], targets [:, 1:]."""
    return np.random.default_rng(seed).integers(0, shape.vocab_size, (shape.micro_batch, shape.seq_length + 1))


def shardlm_trainer(checkpoint: Path, shape: DeepSeekShape, rows: np.ndarray, precision: str):
    """A shardlm Trainer (one process, TP=1) of the converted checkpoint's model and weights on `rows`."""
    from shardlm.checkpoint.init import init_weights, open_source
    from shardlm.checkpoint.state import consolidated_config
    from shardlm.config import from_dict
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    saved = dataclasses.asdict(consolidated_config(checkpoint))
    saved["model"].update(moe_expert_bias=True, moe_expert_bias_rate=0.0, moe_aux_loss_coeff=0.0, mtp_layers=0)
    saved["data"]["text_file"] = "in-memory"
    saved["train"].update(micro_batch_size=shape.micro_batch, global_batch_size=shape.micro_batch, steps=1000,
                          lr=1e-4, warmup_steps=0, decay_style="constant", weight_decay=0.01, clip_grad=1.0,
                          precision=precision)
    trainer = Trainer(from_dict(saved), ParallelContext.single(), FixedBatch(rows))
    init_weights(trainer, open_source(checkpoint))
    return trainer


def hf_step(folder: Path, rows: np.ndarray, experts_implementation: str | None, precision: str = "fp32"):
    """One training step of transformers' DeepseekV3ForCausalLM loaded from `folder` (SDPA attention) on
    `rows`; the step returns its loss (detached). `step.model` is the model; also returns the experts
    implementation it ran."""
    from transformers import DeepseekV3ForCausalLM

    kwargs = {"attn_implementation": "sdpa", "dtype": torch.float32}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = DeepseekV3ForCausalLM.from_pretrained(folder, **kwargs).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=1e-4, fused=True)
    batch = torch.from_numpy(rows)
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step.model = model
    return step, model.config._experts_implementation


def loss_check(programs: dict) -> dict:
    """Two steps of each fresh fp32 program on the same batch: step 1's loss (same weights) and step 2's
    (after one clipped AdamW update), each program's largest difference from shardlm's, and `match`
    (every difference within LOSS_TOL)."""
    losses = {name: [] for name in programs}
    for _ in range(2):
        for name, run in programs.items():
            out = run()
            losses[name].append(float(out["loss"] if isinstance(out, dict) else out))
    diffs = {name: max(abs(a - b) for a, b in zip(values, losses["shardlm"]))
             for name, values in losses.items() if name != "shardlm"}
    return {"losses": losses, "max_abs_difference": diffs, "tolerance": LOSS_TOL,
            "match": all(d <= LOSS_TOL for d in diffs.values())}


def single_process(shape: DeepSeekShape, repeats: int, threads: int = 2) -> dict:
    """Per precision: step ms and tokens/s of shardlm, hf and hf_eager, ratios shardlm / hf and shardlm /
    hf_eager per round, the expert GEMMs' dtypes; the fp32 loss check; the CPU's features."""
    features = cpu_features()
    precisions = ["fp32"] + (["bf16"] if features["native_bf16"] else [])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict = {"config": f"{shape.describe()}, {threads} threads", "cpu_features": features,
                 "precisions": precisions}
    rows = random_rows(shape)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            from shardlm.checkpoint.hf import from_hf

            folder = save_hf_model(shape, Path(tmp) / "hf")
            checkpoint = from_hf(folder, Path(tmp) / "model.safetensors")
            for precision in precisions:
                hf, shipped = hf_step(folder, rows, None, precision)
                hf_eager = hf_step(folder, rows, "eager", precision)[0]
                trainer = shardlm_trainer(checkpoint, shape, rows, precision)
                programs = {"shardlm": trainer.train_step, "hf": hf, "hf_eager": hf_eager}
                if precision == "fp32":  # fresh models: their first step is the check
                    out["loss_check"] = loss_check(programs)
                experts_dtype = {"shardlm": expert_gemm_dtypes(trainer.model, "GroupedExperts", trainer.train_step),
                                 "hf": expert_gemm_dtypes(hf.model, "DeepseekV3Experts", hf),
                                 "hf_eager": expert_gemm_dtypes(hf_eager.model, "DeepseekV3Experts", hf_eager)}
                times = interleaved(programs, repeats, warmup=1)
                tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
                figures = {f"{name}_step_ms": summary([1000 * t for t in ts]) for name, ts in times.items()}
                figures |= {f"{name}_tokens_per_sec": summary(values) for name, values in tokens.items()}
                for other, key in (("hf", "ratio"), ("hf_eager", "ratio_eager")):
                    figures[key] = summary([a / b for a, b in zip(tokens["shardlm"], tokens[other])])
                figures["hf_experts_implementation"] = shipped
                figures["experts_dtype"] = experts_dtype
                out[precision] = figures
    finally:
        torch.set_num_threads(previous)
    fp32 = out["fp32"]["ratio"]
    out["goal"] = {"ratio_at_least": GOAL, "fp32_ratio": fp32["median"], "met": fp32["median"] >= GOAL,
                   "rounds_at_goal": sum(r >= GOAL for r in fp32["values"]), "rounds": len(fp32["values"])}
    return out


def deepseek_bench(quick: bool, repeats: int) -> dict:
    """The `deepseek` section of `make bench`."""
    return single_process(DS_QUICK if quick else DS_BENCH, repeats)


def markdown_lines(d: dict) -> list[str]:
    """The `deepseek` section of BENCHMARKS.md."""
    check, goal = d["loss_check"], d["goal"]
    diffs = ", ".join(f"{name} {value:.1e}" for name, value in check["max_abs_difference"].items())
    lines = ["## DeepSeek-V3 training step (`deepseek`)", "",
             f"Config: {d['config']}. One process: shardlm (the converted checkpoint) against transformers' "
             "`DeepseekV3ForCausalLM` (SDPA attention) from the same saved weights on the same batch; `hf` is "
             "transformers as shipped, whose default experts implementation is reported below, `hf_eager` its "
             "per-expert loop. CPU matrix features: "
             f"{d['cpu_features']['matrix']}" + (f" ({d['cpu_features']['bf16_note']})"
                                                 if d['cpu_features'].get('bf16_note') else "") + ".", "",
             f"Same model: step-1 loss shardlm {check['losses']['shardlm'][0]:.6f}, largest difference over steps 1 "
             f"and 2 ({diffs}) within {check['tolerance']:g}: **`deepseek.loss_check.match` = {check['match']}**.",
             "", "| precision | shardlm ms/step | hf ms/step | hf_eager ms/step | shardlm tokens/s | hf tokens/s | "
             "hf_eager tokens/s | shardlm / hf (`deepseek.<p>.ratio`) | shardlm / hf_eager | hf's "
             "experts_implementation | experts' GEMMs ran in (shardlm / hf / hf_eager) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for precision in d["precisions"]:
        f = d[precision]
        ran = f.get("experts_dtype", {})
        lines.append(" | ".join(
            [f"| {precision}"] + [median_cell(f[f"{n}_step_ms"], digits=1) for n in ("shardlm", "hf", "hf_eager")]
            + [median_cell(f[f"{n}_tokens_per_sec"], digits=0) for n in ("shardlm", "hf", "hf_eager")]
            + [f"**{median_cell(f['ratio'])}**", median_cell(f["ratio_eager"]), f["hf_experts_implementation"],
               " / ".join(ran.get(name, "?") for name in ("shardlm", "hf", "hf_eager"))]) + " |")
    met = "met" if goal["met"] else "not met"
    lines += ["", f"Goal shardlm / hf (as shipped) >= {goal['ratio_at_least']} in fp32: **{met}** (median "
              f"{goal['fp32_ratio']:.2f}, {goal['rounds_at_goal']} of {goal['rounds']} rounds at or above it; "
              f"`deepseek.goal.met` = {goal['met']}). Where the rounds' min and max straddle the goal they disagree "
              "(a busy machine does that; its load average is in the header): read the median with its spread."]
    return lines + [""]
