"""Does Muon train better than AdamW here? (`make bench` section `optimizers`)

A tiny Llama (4 layers, hidden 128, 4 heads with 2 KV heads, rows of 128 tokens, the GPT-2 vocabulary) trains on
the shared Tiny Shakespeare text (GPT-2 BPE; its first 90% trains, the rest validates) for the same steps and
tokens with AdamW and with Muon (`train.optimizer = "muon"`, Moonlight's "match_rms_adamw" scale, so one learning
rate serves Muon's matrices and AdamW's rest), each at every learning rate of a small sweep, warm-up then cosine
decay, fp32, one process x 2 threads. Reported: each run's validation loss at the end (and at every evaluation, for
the plot `docs/figures/optimizers.png`), each optimizer's best, and the median step time of each (Muon's Newton-Schulz
iterations against AdamW's update). The runs alternate, AdamW and Muon at one learning rate after the other.
"""

from __future__ import annotations

import time
from pathlib import Path

from shardlm.bench.common import FIGURES, summary, torch_threads

LEARNING_RATES = (1e-3, 3e-3, 1e-2)
QUICK_LEARNING_RATES = (3e-3,)
ROWS, EVAL_ITERS = 8, 8
"""Rows of 128 tokens a step and validation batches an evaluation (`make bench`'s)."""
QUICK_ROWS, QUICK_EVAL_ITERS = 2, 2
"""--quick's: a quarter of the tokens through the 50,257-wide output layer, which costs most of a step here."""


def run(optimizer: str, lr: float, steps: int, eval_every: int, data, threads: int = 2, rows: int = ROWS,
        eval_iters: int = EVAL_ITERS) -> dict:
    """One run of `rows` rows a step: validation losses (`eval_iters` batches) every `eval_every` steps and the
    step times."""
    from shardlm.config import from_dict
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    train, valid = data
    config = from_dict({
        "model": {"arch": "llama", "num_layers": 4, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2,
                  "seq_length": 128, "vocab_size": 50257, "dropout": 0.0},
        "data": {"text_file": "unused"},
        "train": {"micro_batch_size": rows, "global_batch_size": rows, "steps": steps, "lr": lr, "min_lr": lr / 10,
                  "warmup_steps": max(1, steps // 10), "weight_decay": 0.01, "clip_grad": 1.0, "seed": 1,
                  "eval_iters": eval_iters, "optimizer": optimizer, "muon_adjust_lr": "match_rms_adamw",
                  "precision": "fp32"},
    })
    with torch_threads(threads):
        trainer = Trainer(config, ParallelContext.single(), train, valid)
        times, curve = [], []
        for step in range(1, steps + 1):
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
            if step % eval_every == 0 or step == steps:
                curve.append((step, trainer.evaluate()))
    return {"valid_loss": curve[-1][1], "curve": curve, "step_ms": summary([t * 1e3 for t in times[1:]])}


def corpus(steps: int, characters: int | None = None, rows: int = ROWS):
    """(train, valid) token samples of Tiny Shakespeare (its first `characters`, or all) for `steps` steps of
    `rows` rows of 128 tokens."""
    import tempfile

    from shardlm.config import DataConfig
    from shardlm.data.tokenizers import build_tokenizer_for
    from shardlm.paths import shared_data_dir
    from shardlm.training.data import text_file_datasets

    text = (shared_data_dir() / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:characters]
    with tempfile.TemporaryDirectory(prefix="shardlm-optimizers-bench-") as folder:
        path = Path(folder) / "text.txt"
        path.write_text(text, encoding="utf-8")
        data = DataConfig(text_file=str(path), split="90,10")
        return text_file_datasets(data, build_tokenizer_for(data), 128, 1, steps * rows)


def optimizers_bench(quick: bool, out_dir: Path | None = None) -> dict:
    """The `optimizers` section of `make bench`."""
    steps, rates = (4, QUICK_LEARNING_RATES) if quick else (200, LEARNING_RATES)
    rows, eval_iters = (QUICK_ROWS, QUICK_EVAL_ITERS) if quick else (ROWS, EVAL_ITERS)
    eval_every = steps // 2 if quick else steps // 10
    data = corpus(steps, 40_000 if quick else None, rows)
    runs: dict[str, dict[str, dict]] = {"adamw": {}, "muon": {}}
    for lr in rates:
        for optimizer in ("adamw", "muon"):
            runs[optimizer][f"{lr:g}"] = run(optimizer, lr, steps, eval_every, data, rows=rows, eval_iters=eval_iters)
    best = {name: min(by_lr.items(), key=lambda kv: kv[1]["valid_loss"]) for name, by_lr in runs.items()}
    result = {
        "config": f"Llama 4 layers, hidden 128, 4 heads (2 KV), rows of 128 tokens, GPT-2 vocabulary, {rows} rows a "
                  f"step, {steps} steps ({steps * rows * 128:,} tokens), Tiny Shakespeare (90% train, 10% validation), "
                  "fp32, one process x 2 threads; Muon with the match_rms_adamw scale",
        "runs": runs,
        "best": {name: {"lr": float(lr), "valid_loss": r["valid_loss"]} for name, (lr, r) in best.items()},
        "muon_minus_adamw_best_valid_loss": best["muon"][1]["valid_loss"] - best["adamw"][1]["valid_loss"],
        "step_ms_ratio_muon_over_adamw": best["muon"][1]["step_ms"]["median"] / best["adamw"][1]["step_ms"]["median"],
    }
    if out_dir is not None:
        result["plot"] = plot(runs, Path(out_dir), f"{FIGURES}/optimizers.png")
    return result


def plot(runs: dict, out_dir: Path, relative: str) -> str | None:
    """Validation loss against step for every run, written to `out_dir / relative`; `relative` (the link from
    BENCHMARKS.md in `out_dir`), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    path = out_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, style in (("adamw", "--"), ("muon", "-")):
        for lr, r in runs[name].items():
            steps, losses = zip(*r["curve"])
            axes.plot(steps, losses, style, label=f"{name} lr {lr}")
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return relative


def markdown_lines(r: dict) -> list[str]:
    """The `optimizers` section of BENCHMARKS.md."""
    lines = ["## Muon against AdamW (`optimizers`)", "", f"{r['config']}.", "",
             "| optimizer | lr | final validation loss | step ms |", "|---|---|---|---|"]
    for name in ("adamw", "muon"):
        for lr, run_result in r["runs"][name].items():
            lines.append(f"| {name} | {lr} | {run_result['valid_loss']:.4f} | "
                         f"{run_result['step_ms']['median']:.1f} |")
    best, diff = r["best"], r["muon_minus_adamw_best_valid_loss"]
    verdict = "Muon trained better" if diff < 0 else "Muon did not beat AdamW"
    lines += ["", f"Best: AdamW {best['adamw']['valid_loss']:.4f} (lr {best['adamw']['lr']:g}), Muon "
              f"{best['muon']['valid_loss']:.4f} (lr {best['muon']['lr']:g}): **{verdict} at this scale** "
              f"(`optimizers.muon_minus_adamw_best_valid_loss` = {diff:+.4f}); Muon's step took "
              f"{r['step_ms_ratio_muon_over_adamw']:.2f}x AdamW's (`optimizers.step_ms_ratio_muon_over_adamw`)."]
    if r.get("plot"):
        lines += ["", f"![validation loss against step]({r['plot']})"]
    lines.append("")
    return lines
