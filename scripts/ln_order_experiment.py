"""The paper's layer-norm-order experiment for BERT, in miniature on a CPU.

Megatron-LM reports that the original BERT order (post-LN: LayerNorm after each residual add)
degrades as BERT grows past BERT-Large, and that rearranging it (pre-LN: LayerNorm on each sublayer's
input, an un-normalized residual path, a final LayerNorm) trains stably. This script pretrains two
BERTs that differ only in `model.layernorm_order`, from the same initialization seed on the same
batches (a sentence-split public-domain novel, the BERT WordPiece vocabulary, MLM + sentence order),
in the regime where post-LN is known to be fragile (high learning rate, no warmup), and plots both
training-loss curves in one PNG. docs/bert.md records what it showed at this scale (so far: no
separation within a few hundred CPU steps) and the settings tried.

    python scripts/ln_order_experiment.py                                 # defaults: the run in docs/bert.md
    python scripts/ln_order_experiment.py --layers 24 --hidden 64 --lr 1e-2 --steps 300

Prints and writes (next to the PNG, as .json) the final losses of both runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--warmup", type=int, default=0, help="warmup steps (post-LN is fragile without)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--corpus", type=Path, default=None,
                        help="text file (default: $SHARDLM_DATA/corpus/pride_and_prejudice_pg1342.txt)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "ln-order",
                        help="where the preprocessed corpus goes")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "bert_ln_order.png")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser.parse_args(argv)


def gutenberg_body(text: str) -> str:
    """The book between Project Gutenberg's START and END lines (the whole text when it has none)."""
    start, end = text.find("*** START OF"), text.find("*** END OF")
    if start < 0 or end < start:
        return text
    return text[text.index("\n", start) + 1:end]


def prepare_corpus(args: argparse.Namespace, data_dir: Path) -> Path:
    """Sentence-split BERT tokens of the corpus as an indexed dataset; returns its prefix."""
    from shardlm.data.preprocess import PreprocessConfig, preprocess

    prefix = args.work_dir / "corpus"
    if not Path(f"{prefix}.idx").is_file():
        args.work_dir.mkdir(parents=True, exist_ok=True)
        corpus = args.corpus or data_dir / "corpus" / "pride_and_prejudice_pg1342.txt"
        text = args.work_dir / "corpus.txt"
        text.write_text(gutenberg_body(corpus.read_text(encoding="utf-8")), encoding="utf-8")
        preprocess(PreprocessConfig(input=text, output_prefix=prefix, tokenizer="bert",
                                    vocab_file=data_dir / "vocab/bert-base-uncased/vocab.txt",
                                    split_sentences=True), progress=False)
    return prefix


def run_config(args: argparse.Namespace, order: str, prefix: Path, vocab: Path):
    from shardlm.config import from_dict

    return from_dict({
        "model": {"arch": "bert", "layernorm_order": order, "num_layers": args.layers, "hidden_size": args.hidden,
                  "num_heads": args.heads, "seq_length": args.seq_length, "vocab_size": 30522, "dropout": args.dropout},
        "data": {"prefixes": [str(prefix)], "tokenizer": "bert", "vocab_file": str(vocab), "split": "98,2,0"},
        "train": {"micro_batch_size": args.batch, "global_batch_size": args.batch, "steps": args.steps,
                  "lr": args.lr, "min_lr": args.lr, "warmup_steps": args.warmup, "decay_style": "constant",
                  "seed": args.seed, "eval_iters": 8, "clip_grad": 1.0},
    })


def pretrain(config, tokenizer) -> dict:
    """Train one order in this process; returns its per-step losses and final validation loss."""
    from shardlm.parallel import ParallelContext
    from shardlm.training.data import build_datasets
    from shardlm.training.trainer import Trainer

    t = config.train
    train, valid = build_datasets(config.data, tokenizer, config.model.seq_length, t.seed,
                                  t.steps * t.global_batch_size, t.eval_iters * t.micro_batch_size, "bert")
    trainer = Trainer(config, ParallelContext.single(), train, valid)
    start, losses = time.perf_counter(), []
    for _ in range(t.steps):
        losses.append(trainer.train_step()["loss"])
        if len(losses) % 25 == 0:
            print(f"  {config.model.layernorm_order}-LN step {len(losses)}: loss {np.mean(losses[-25:]):.3f}",
                  file=sys.stderr)
    return {"losses": losses, "valid_loss": trainer.evaluate(), "seconds": time.perf_counter() - start}


def moving_average(values: list[float], window: int) -> np.ndarray:
    window = max(1, min(window, len(values)))
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot(results: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    window = max(1, args.steps // 20)
    for order, color in (("post", "tab:red"), ("pre", "tab:blue")):
        losses = results[order]["losses"]
        axes.plot(range(1, len(losses) + 1), losses, color=color, alpha=0.2, linewidth=0.8)
        smooth = moving_average(losses, window)
        name = "original BERT" if order == "post" else "rearranged"
        label = f"{order}-LN ({name}): final {results[order]['final']:.2f}"
        axes.plot(range(window, window + len(smooth)), smooth, color=color, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (MLM + SOP)")
    axes.set_title(f"BERT {args.layers} layers x {args.hidden} hidden, lr {args.lr:g}, warmup {args.warmup}, "
                   f"batch {args.batch} x {args.seq_length}", fontsize=9)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from shardlm.data.tokenizers import build_tokenizer
    from shardlm.paths import shared_data_dir

    data_dir = shared_data_dir()
    vocab = data_dir / "vocab/bert-base-uncased/vocab.txt"
    prefix = prepare_corpus(args, data_dir)
    tokenizer = build_tokenizer("bert", vocab)
    results = {}
    for order in ("post", "pre"):
        print(f"training {order}-LN ...", file=sys.stderr)
        result = pretrain(run_config(args, order, prefix, vocab), tokenizer)
        tail = max(1, args.steps // 10)
        result["final"] = float(np.mean(result["losses"][-tail:]))  # mean of the last 10% of steps
        results[order] = result
    plot(results, args)
    summary = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               **{order: {"final_train_loss": r["final"], "first_train_loss": r["losses"][0],
                          "valid_loss": r["valid_loss"], "seconds": r["seconds"], "losses": r["losses"]}
                  for order, r in results.items()}}
    args.output.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    for order in ("post", "pre"):
        r = results[order]
        print(f"{order}-LN: first loss {r['losses'][0]:.3f}, final (last 10% of steps) {r['final']:.3f}, "
              f"validation {r['valid_loss']:.3f}, {r['seconds']:.0f} s")
    print(f"plot: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
