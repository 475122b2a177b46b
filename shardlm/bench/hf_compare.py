"""One CPU training step of shardlm against a transformers model converted from the same saved weights.

The `deepseek` and `gpt_oss` sections of `make bench` compare the same way: a random transformers model of a
small shape is saved with `save_pretrained` and converted with `shardlm.checkpoint.hf.from_hf`, so every
program starts from the same weights, and each program trains the same batch (micro_batch, seq_length) of
random tokens: forward + backward + global-norm clipping at 1.0 + fused AdamW (lr 1e-4 constant, weight decay
0.01 on matrices), taking turns in a new order every round (`common.round_orders`):

- `shardlm`: a shardlm Trainer step on the converted checkpoint (grouped-GEMM experts, fp32 router).
- `hf` (transformers as shipped): the model with its default attention and experts implementations (both
  reported), unless the family fixes the attention (`HFModel.attn_implementation`).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardlm.bench.breakdown import breakdown
from shardlm.bench.common import cpu_features, interleaved, median_cell, native_precisions, summary, torch_threads
from shardlm.bench.moe import expert_gemm_dtypes

GOAL = 1.2  # shardlm tokens/s / transformers' as shipped, fp32
LOSS_TOL = 1e-4


@dataclass(frozen=True)
class HFModel:
    """What one model family's comparison needs from transformers and shardlm."""

    causal_lm: str
    """transformers' class, e.g. "DeepseekV3ForCausalLM"."""
    experts_class: str | None
    """The class name of transformers' experts module (whose GEMMs' dtypes are measured); None for a dense model
    (no `hf_eager` program then)."""
    save: Callable
    """save(shape, folder) -> folder: a random fp32 model of `shape` saved there."""
    attn_implementation: str | None = None
    """transformers' attention for `hf` and `hf_eager`; None: the model's default, as shipped."""
    model_overrides: dict = dataclasses.field(default_factory=dict)
    """shardlm `[model]` keys set on the converted config (e.g. no aux loss, as transformers trains)."""


class FixedBatch:
    """A dataset whose sample i is row i % len(rows) of `rows` (n, seq_length + 1): every step trains the
    same micro-batch, the batch transformers' programs train."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[i % len(self.rows)]


def random_rows(shape, seed: int = 0) -> np.ndarray:
    """(micro_batch, seq_length + 1) int64 random tokens: inputs are [:, :-1], targets [:, 1:]."""
    return np.random.default_rng(seed).integers(0, shape.vocab_size, (shape.micro_batch, shape.seq_length + 1))


def shardlm_trainer(checkpoint: Path, shape, rows: np.ndarray, precision: str, model_overrides: dict):
    """A shardlm Trainer (one process, TP=1) of the converted checkpoint's model and weights on `rows`."""
    from shardlm.checkpoint.init import init_weights, open_source
    from shardlm.checkpoint.state import consolidated_config
    from shardlm.config import from_dict
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    saved = dataclasses.asdict(consolidated_config(checkpoint))
    saved["model"].update(model_overrides)
    saved["data"]["text_file"] = "in-memory"
    saved["train"].update(micro_batch_size=shape.micro_batch, global_batch_size=shape.micro_batch, steps=1000,
                          lr=1e-4, warmup_steps=0, decay_style="constant", weight_decay=0.01, clip_grad=1.0,
                          precision=precision)
    trainer = Trainer(from_dict(saved), ParallelContext.single(), FixedBatch(rows))
    init_weights(trainer, open_source(checkpoint))
    return trainer


def hf_step(family: HFModel, folder: Path, rows: np.ndarray, experts_implementation: str | None,
            precision: str = "fp32"):
    """One training step of transformers' `family.causal_lm` loaded from `folder` on `rows`; the step returns
    its loss (detached). `step.model` is the model. Also returns the (attention, experts) implementations it
    ran."""
    import transformers

    kwargs = {"dtype": torch.float32}
    if family.attn_implementation is not None:
        kwargs["attn_implementation"] = family.attn_implementation
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = getattr(transformers, family.causal_lm).from_pretrained(folder, **kwargs).train()
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
    return step, (model.config._attn_implementation, getattr(model.config, "_experts_implementation", None))


def loss_check(programs: dict, second=None) -> dict:
    """Two steps of each fresh fp32 program on the same batch: step 1's loss (same weights) and step 2's
    (after one clipped AdamW update), each program's largest difference from shardlm's, and `match`
    (every difference within LOSS_TOL). `second(name, run)`, if given, runs each program's step 2 and returns
    what `run()` returned (`dtype_recorder`'s: the experts' dtypes are measured in that step)."""
    losses = {name: [] for name in programs}
    for step in range(2):
        for name, run in programs.items():
            out = second(name, run) if second is not None and step == 1 else run()
            losses[name].append(float(out["loss"] if isinstance(out, dict) else out))
    diffs = {name: max(abs(a - b) for a, b in zip(values, losses["shardlm"]))
             for name, values in losses.items() if name != "shardlm"}
    return {"losses": losses, "max_abs_difference": diffs, "tolerance": LOSS_TOL,
            "match": all(d <= LOSS_TOL for d in diffs.values())}


def dtype_recorder(family: HFModel, trainer, into: dict):
    """A `loss_check` `second`: runs a program's step while recording the dtypes of its expert GEMMs
    (`moe.expert_gemm_dtypes`) into `into[name]`, and returns the step's output."""
    def second(name: str, run):
        output = []
        model, experts = (trainer.model, "GroupedExperts") if name == "shardlm" else (run.model, family.experts_class)
        into[name] = expert_gemm_dtypes(model, experts, lambda: output.append(run()))
        return output[0]

    return second


def experts_dtypes(family: HFModel, programs: dict, trainer) -> dict:
    """The dtype each program's expert GEMMs ran in (`moe.expert_gemm_dtypes`)."""
    out = {"shardlm": expert_gemm_dtypes(trainer.model, "GroupedExperts", trainer.train_step)}
    return out | {name: expert_gemm_dtypes(run.model, family.experts_class, run) for name, run in programs.items()
                  if name != "shardlm"}


def single_process(shape, family: HFModel, repeats: int, threads: int = 2, fp32_only: bool = False,
                   warmup: int = 1) -> dict:
    """Per precision: step ms and tokens/s of shardlm, hf and hf_eager, ratios shardlm / hf and shardlm /
    hf_eager per round, the expert GEMMs' dtypes, the implementations transformers ran, one profiled step of
    shardlm and hf by kind of operator (`breakdown`, after the timed rounds); the fp32 loss check;
    the CPU's features; whether the fp32 median ratio meets GOAL. `fp32_only`: no bf16 run (a quick run's);
    `warmup`: untimed rounds before the timed ones (a quick run's 0: the loss check's and the experts' dtype steps
    have run every program already)."""
    features = cpu_features()
    precisions = ["fp32"] if fp32_only else native_precisions(features)
    out: dict = {"config": f"{shape.describe()}, {threads} threads", "cpu_features": features,
                 "precisions": precisions}
    rows = random_rows(shape)
    with torch_threads(threads), tempfile.TemporaryDirectory() as tmp:
        from shardlm.checkpoint.hf import from_hf

        folder = family.save(shape, Path(tmp) / "hf")
        checkpoint = from_hf(folder, Path(tmp) / "model.safetensors")
        for precision in precisions:
            hf, (attention, shipped) = hf_step(family, folder, rows, None, precision)
            trainer = shardlm_trainer(checkpoint, shape, rows, precision, family.model_overrides)
            programs = {"shardlm": trainer.train_step, "hf": hf}
            if family.experts_class:
                programs["hf_eager"] = hf_step(family, folder, rows, "eager", precision)[0]
            experts_dtype: dict = {}
            if precision == "fp32":  # fresh models: their first step is the check; the second records the dtypes
                out["loss_check"] = loss_check(programs, dtype_recorder(family, trainer, experts_dtype)
                                               if family.experts_class else None)
            elif family.experts_class:
                experts_dtype = experts_dtypes(family, programs, trainer)
            times = interleaved(programs, repeats, warmup=warmup)
            tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
            figures = {"breakdown": {name: breakdown(programs[name]) for name in ("shardlm", "hf")}}
            figures |= {f"{name}_step_ms": summary([1000 * t for t in ts]) for name, ts in times.items()}
            figures |= {f"{name}_tokens_per_sec": summary(values) for name, values in tokens.items()}
            for other, key in (("hf", "ratio"), ("hf_eager", "ratio_eager")):
                if other in tokens:
                    figures[key] = summary([a / b for a, b in zip(tokens["shardlm"], tokens[other])])
            figures["hf_experts_implementation"] = shipped
            figures["hf_attn_implementation"] = attention
            figures["experts_dtype"] = experts_dtype
            out[precision] = figures
    fp32 = out["fp32"]["ratio"]
    out["goal"] = {"ratio_at_least": GOAL, "fp32_ratio": fp32["median"], "met": fp32["median"] >= GOAL,
                   "rounds_at_goal": sum(r >= GOAL for r in fp32["values"]), "rounds": len(fp32["values"])}
    return out


def markdown_lines(d: dict, key: str, title: str, hf_model: str) -> list[str]:
    """BENCHMARKS.md's section `key` (## `title`) of a `single_process` result against transformers' `hf_model`
    (e.g. "`DeepseekV3ForCausalLM` (SDPA attention)")."""
    check, goal = d["loss_check"], d["goal"]
    diffs = ", ".join(f"{name} {value:.1e}" for name, value in check["max_abs_difference"].items())
    lines = [f"## {title} (`{key}`)", "",
             f"Config: {d['config']}. One process: shardlm (the converted checkpoint) against transformers' "
             f"{hf_model} from the same saved weights on the same batch; `hf` is "
             "transformers as shipped, whose default experts implementation is reported below, `hf_eager` its "
             "per-expert loop. CPU matrix features: "
             f"{d['cpu_features']['matrix']}" + (f" ({d['cpu_features']['bf16_note']})"
                                                 if d['cpu_features'].get('bf16_note') else "") + ".", "",
             f"Same model: step-1 loss shardlm {check['losses']['shardlm'][0]:.6f}, largest difference over steps 1 "
             f"and 2 ({diffs}) within {check['tolerance']:g}: **`{key}.loss_check.match` = {check['match']}**.",
             "", "| precision | shardlm ms/step | hf ms/step | hf_eager ms/step | shardlm tokens/s | hf tokens/s | "
             f"hf_eager tokens/s | shardlm / hf (`{key}.<p>.ratio`) | shardlm / hf_eager | hf's "
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
              f"`{key}.goal.met` = {goal['met']}). Where the rounds' min and max straddle the goal they disagree "
              "(a busy machine does that; its load average is in the header): read the median with its spread."]
    return lines + [""]
