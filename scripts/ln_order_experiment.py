"""The paper's layer-norm-order experiment for BERT, in miniature on a CPU.

Megatron-LM reports that the original BERT order (post-LN: LayerNorm after each residual add)
degrades as BERT grows past BERT-Large, and that rearranging it (pre-LN: LayerNorm on each sublayer's
input, an un-normalized residual path, a final LayerNorm) trains stably. This script pretrains two
BERTs that differ only in `model.layernorm_order`, from the same initialization seed on the same
batches (a sentence-split public-domain novel, the BERT WordPiece vocabulary, MLM + sentence order),
in the regime where post-LN is known to be fragile (high learning rate, no warmup), and plots both
training-loss curves in one PNG. docs/bert.md records what it showed at this scale and the settings
tried: an early post-LN loss spike, then the same loss; with a small WordPiece vocabulary trained on
the corpus and single-token masking, post-LN even learns sooner. The paper's degradation did not
appear in any run a 2-core CPU affords.

    python scripts/ln_order_experiment.py                                 # defaults: the run in docs/bert.md
    python scripts/ln_order_experiment.py --vocab-size 512 --no-whole-word-masking --dropout 0 \
        --layers 12 --hidden 64 --heads 2 --seq-length 32 --batch 32 --lr 1e-3 --steps 1500

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
    parser.add_argument("--vocab-size", type=int, default=30522,
                        help="30522: the BERT WordPiece vocabulary; otherwise a WordPiece of this size trained on "
                             "the corpus (`shardlm tokenizer train --kind wordpiece`)")
    parser.add_argument("--whole-word-masking", action=argparse.BooleanOptionalAction, default=True,
                        help="mask whole words as n-grams of up to 3 (the paper's); --no-whole-word-masking "
                             "masks single tokens, so a word's other pieces give its masked piece away")
    parser.add_argument("--residual-init", choices=("scaled", "unscaled"), default="scaled",
                        help="scaled: shardlm's (and Megatron's) init_std / sqrt(2 layers) on the two projections "
                             "that feed the residual path; unscaled: init_std everywhere, as the original BERT")
    parser.add_argument("--init-std", type=float, default=0.02, help="std of the normal initialization")
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


def prepare_corpus(args: argparse.Namespace, data_dir: Path) -> tuple[Path, str, Path]:
    """Sentence-split tokens of the corpus as an indexed dataset.

    Returns (prefix, tokenizer kind, vocabulary file): the BERT vocabulary for --vocab-size 30522,
    else a WordPiece of --vocab-size entries trained on the corpus itself.
    """
    from shardlm.data.preprocess import PreprocessConfig, preprocess
    from shardlm.data.tokenizer_train import train_tokenizer

    corpus = args.corpus or data_dir / "corpus" / "pride_and_prejudice_pg1342.txt"
    work = args.work_dir / f"{corpus.stem}-v{args.vocab_size}"
    text, prefix = work / "corpus.txt", work / "corpus"
    if args.vocab_size == 30522:
        kind, vocab = "bert", data_dir / "vocab/bert-base-uncased/vocab.txt"
    else:
        kind, vocab = "json", work / "tokenizer.json"
    if not Path(f"{prefix}.idx").is_file():
        work.mkdir(parents=True, exist_ok=True)
        text.write_text(gutenberg_body(corpus.read_text(encoding="utf-8")), encoding="utf-8")
        if kind == "json":
            train_tokenizer([text], "wordpiece", args.vocab_size, work, show_progress=False)
        preprocess(PreprocessConfig(input=text, output_prefix=prefix, tokenizer=kind, vocab_file=vocab,
                                    split_sentences=True), progress=False)
    return prefix, kind, vocab


def run_config(args: argparse.Namespace, order: str, prefix: Path, kind: str, vocab: Path, vocab_size: int):
    from shardlm.config import from_dict

    return from_dict({
        "model": {"arch": "bert", "layernorm_order": order, "num_layers": args.layers, "hidden_size": args.hidden,
                  "num_heads": args.heads, "seq_length": args.seq_length, "vocab_size": vocab_size,
                  "dropout": args.dropout, "init_std": args.init_std},
        "data": {"prefixes": [str(prefix)], "tokenizer": kind, "vocab_file": str(vocab), "split": "98,2,0",
                 "whole_word_masking": args.whole_word_masking},
        "train": {"micro_batch_size": args.batch, "global_batch_size": args.batch, "steps": args.steps,
                  "lr": args.lr, "min_lr": args.lr, "warmup_steps": args.warmup, "decay_style": "constant",
                  "seed": args.seed, "eval_iters": 8, "clip_grad": 1.0, "precision": "fp32"},
    })


def unscale_residual_init(model, num_layers: int) -> None:
    """Undo the depth scaling of the residual projections' init (std init_std / sqrt(2 l) -> init_std),
    giving the original BERT initialization, normal(0, init_std) everywhere. Before any step."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                parameter.mul_((2 * num_layers) ** 0.5)


def pretrain(config, tokenizer, residual_init: str = "scaled") -> dict:
    """Train one order in this process; returns its per-step losses and final validation loss."""
    from shardlm.parallel import ParallelContext
    from shardlm.training.data import build_datasets
    from shardlm.training.trainer import Trainer

    t = config.train
    train, valid = build_datasets(config.data, tokenizer, config.model.seq_length, t.seed,
                                  t.steps * t.global_batch_size, t.eval_iters * t.micro_batch_size, "bert")
    trainer = Trainer(config, ParallelContext.single(), train, valid)
    if residual_init == "unscaled":
        unscale_residual_init(trainer.model, config.model.num_layers)
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
    masking = "whole-word" if args.whole_word_masking else "token"
    axes.set_title(f"BERT {args.layers} layers x {args.hidden} hidden, lr {args.lr:g}, warmup {args.warmup}, "
                   f"batch {args.batch} x {args.seq_length}\nvocab {args.vocab_size}, {masking} masking, "
                   f"{args.residual_init} residual init", fontsize=8)
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
    prefix, kind, vocab = prepare_corpus(args, data_dir)
    tokenizer = build_tokenizer(kind, vocab)
    results = {}
    for order in ("post", "pre"):
        print(f"training {order}-LN ...", file=sys.stderr)
        result = pretrain(run_config(args, order, prefix, kind, vocab, tokenizer.vocab_size), tokenizer,
                          args.residual_init)
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
