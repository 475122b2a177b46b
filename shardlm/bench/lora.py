"""LoRA fine-tuning on one CPU (`make bench` section `lora`): shardlm's adapters against full fine-tuning and
against TRL + peft as shipped.

The model and data are the `sft` section's (`shardlm.bench.sft`): a tiny random Qwen3 with the real 151,936-token
vocabulary and tied embeddings, the shared Dolly conversations under its chat template, bfd-packed rows, fp32.
Adapters of rank 16, alpha 32, dropout 0 on every attention and MLP projection (`lora.targets = ["all-linear"]`,
peft's `target_modules="all-linear"`: the same seven projections a layer).

- `throughput`: three trainers take turns, one optimizer step each: TRL's `SFTTrainer` with peft's `LoraConfig`
  (bfd packing, padding-free, assistant-only loss; its loop drives), then after each of its steps shardlm with
  `[lora]` and shardlm fine-tuning every weight, in alternating order, outside TRL's clock. The first
  `warmup_steps` steps are not counted. tokens/s counts real (non-padding) tokens, as the `sft` section does.
  `ratio_lora_over_trl_peft` (the goal: >= 1.2) and `ratio_lora_over_full` are per round of steps.
- `memory`: for shardlm with adapters and fine-tuning every weight, after the runs: the parameters' bytes (the
  frozen base included), the AdamW moments' bytes, and the most bytes one more optimizer step allocates beyond
  them (activations, gradients, temporaries; `shardlm.plan.measure.PeakMemory`, exact).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from shardlm.bench.common import median_cell, steady, summary, torch_threads
from shardlm.bench.sft import SFT_BENCH, SFT_QUICK, ShardlmSteps, chat_data, load_documents, make_model_dir

RANK, ALPHA = 16, 32.0
LORA_OVERRIDES = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}", 'lora.targets=["all-linear"]', "lora.dropout=0.0"]


def memory(trainer) -> dict:
    """Parameter and AdamW-moment bytes of a trainer, and the peak bytes one more step allocates beyond them."""
    from shardlm.plan.measure import PeakMemory

    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    moments = sum(v.numel() * v.element_size() for state in trainer.optimizer.state.values()
                  for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    with torch_threads(2), PeakMemory() as peak:
        trainer.train_step()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"parameter_bytes": params, "adam_moment_bytes": moments, "step_peak_bytes": peak.peak,
            "trainable_parameters": trainable, "total_bytes": params + moments + peak.peak}


def lora_bench(quick: bool, data_dir: Path | None = None, threads: int = 2) -> dict:
    """The `lora` section of `make bench`."""
    from peft import LoraConfig

    from shardlm.bench.sft_trl import trl_run

    shape = SFT_QUICK if quick else SFT_BENCH
    records_file, tokenizer_dir = chat_data(data_dir)
    conversations, _ = load_documents(shape, records_file, tokenizer_dir)
    with tempfile.TemporaryDirectory(prefix="shardlm-lora-bench-") as folder:
        folder = Path(folder)
        model_dir, vocab = make_model_dir(shape, tokenizer_dir, folder / "model")
        records = folder / "records.jsonl"
        records.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in conversations))
        lora = ShardlmSteps(shape, model_dir, records, folder / "lora", threads, extra=LORA_OVERRIDES)
        full = ShardlmSteps(shape, model_dir, records, folder / "full", threads)
        turn = [0]

        def after_trl_step():
            for steps in ((lora, full) if turn[0] % 2 == 0 else (full, lora)):
                steps.step()
            turn[0] += 1

        peft = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear",
                          task_type="CAUSAL_LM")
        theirs = trl_run(shape, model_dir, conversations, folder / "trl", threads, after_step=after_trl_step,
                         peft_config=peft)
        memories = {"lora": memory(lora.trainer), "full": memory(full.trainer)}
    runs = {"lora": steady(lora.times, lora.tokens, shape.warmup_steps),
            "full": steady(full.times, full.tokens, shape.warmup_steps)}
    rates = {name: [n / t for n, t in zip(run["tokens"], run["step_s"])] for name, run in runs.items()}
    rates["trl_peft"] = [n / t for n, t in zip(theirs["tokens"], theirs["step_s"])]
    return {
        "config": f"{shape.describe(vocab)}, adapters r={RANK} alpha={ALPHA:g} on all seven projections of every "
                  f"layer, {threads} threads, {len(conversations)} Dolly conversations",
        "rounds": len(rates["trl_peft"]),
        **{f"{name}_tokens_per_sec": summary(values) for name, values in rates.items()},
        "lora_step_ms": summary([t * 1e3 for t in runs["lora"]["step_s"]]),
        "full_step_ms": summary([t * 1e3 for t in runs["full"]["step_s"]]),
        "trl_peft_step_ms": summary([t * 1e3 for t in theirs["step_s"]]),
        "ratio_lora_over_trl_peft": summary([a / b for a, b in zip(rates["lora"], rates["trl_peft"])]),
        "ratio_lora_over_full": summary([a / b for a, b in zip(rates["lora"], rates["full"])]),
        "memory": memories,
        "lora_losses": lora.losses, "full_losses": full.losses, "trl_peft_train_loss": theirs["train_loss"],
    }


def markdown_lines(r: dict) -> list[str]:
    """The `lora` section of BENCHMARKS.md."""
    lines = ["## LoRA fine-tuning (`lora`)", "",
             f"{r['config']}. Three trainers take turns, one optimizer step each (TRL + peft, then shardlm with "
             f"adapters and shardlm fine-tuning every weight in alternating order); {r['rounds']} rounds after the "
             "warm-up; tokens/s counts real (non-padding) tokens.", "",
             "| trainer | real tokens/s | step ms |", "|---|---|---|"]
    for name, label in (("lora", "shardlm, `[lora]`"), ("full", "shardlm, every weight"),
                        ("trl_peft", "TRL `SFTTrainer` + peft `LoraConfig`")):
        lines.append(f"| {label} | {median_cell(r[f'{name}_tokens_per_sec'], digits=0)} | "
                     f"{median_cell(r[f'{name}_step_ms'], digits=0)} |")
    lines += ["", f"**shardlm LoRA / TRL + peft tokens/s (`lora.ratio_lora_over_trl_peft`, per round): "
              f"{median_cell(r['ratio_lora_over_trl_peft'])}** (goal 1.2); shardlm LoRA / shardlm every weight: "
              f"{median_cell(r['ratio_lora_over_full'])}.", "",
              "| shardlm | trainable parameters | parameters MiB | AdamW moments MiB | one step's peak beyond them MiB "
              "| total MiB |", "|---|---|---|---|---|---|"]
    for name, label in (("lora", "`[lora]`"), ("full", "every weight")):
        m = r["memory"][name]
        lines.append(f"| {label} | {m['trainable_parameters']:,} | {m['parameter_bytes'] / 2**20:,.1f} | "
                     f"{m['adam_moment_bytes'] / 2**20:,.1f} | {m['step_peak_bytes'] / 2**20:,.1f} | "
                     f"{m['total_bytes'] / 2**20:,.1f} |")
    lines.append("")
    return lines
