"""`shardlm finetune race|mnli|qqp --checkpoint CKPT --data DIR`: fine-tune a pretrained BERT.

Module-level imports stay light (argparse only). The data is read and checked in the launching
process (bad files fail with one line before any worker starts), then each rank loads the
checkpoint sharded for `--tensor-parallel`, tokenizes, trains and evaluates; rank 0 prints one table
row per epoch and writes `OUTPUT_DIR/metrics.json` after every epoch. `--nproc-per-node M` starts M
local workers (M / tensor-parallel data-parallel ranks); under torchrun each process is one rank.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shardlm.errors import UserError

TASKS = ("race", "mnli", "qqp")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "finetune", help="fine-tune a BERT checkpoint on RACE, MNLI or QQP",
        description="Fine-tune a pretrained BERT checkpoint; reports dev accuracy (and QQP F1) after every epoch.")
    parser.add_argument("task", choices=TASKS, help="race (4-way multiple choice), mnli (3 classes), qqp (2 classes)")
    parser.add_argument("--checkpoint", required=True, help="BERT checkpoint directory or consolidated file")
    parser.add_argument("--data", required=True,
                        help="RACE: the folder with {train,dev}/{high,middle}/*.txt; MNLI/QQP: the GLUE task folder")
    parser.add_argument("--output-dir", default=None, help="where metrics.json goes (default runs/finetune-TASK-TIME)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (all data-parallel ranks)")
    parser.add_argument("--micro-batch-size", type=int, default=0, help="per rank per pass; 0: no accumulation")
    parser.add_argument("--lr", type=float, default=2e-5, help="peak learning rate")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps spent warming up")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 disables")
    parser.add_argument("--dropout", type=float, default=None, help="dropout everywhere (default: the checkpoint's)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="input length (default: min(512, the model's sequence length))")
    parser.add_argument("--max-qa-length", type=int, default=128, help="RACE: tokens kept of question+option")
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--limit-train", type=int, default=None, help="use only the first N training examples")
    parser.add_argument("--limit-eval", type=int, default=None, help="use only the first N examples of each dev set")
    parser.add_argument("--vocab-file", default=None, help="BERT vocab.txt (default: the checkpoint's data.vocab_file)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel size (ranks per model)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="local worker processes (default: the tensor-parallel size)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    if not Path(args.checkpoint).exists():
        raise UserError(f"checkpoint not found: {args.checkpoint}; pass a BERT checkpoint with --checkpoint")
    from shardlm.eval.launch import run_command, world_size_for

    world_size_for(args)
    args.examples = load_examples(args.task, args.data, args.limit_train, args.limit_eval)
    args.output_dir = args.output_dir or str(Path("runs") / f"finetune-{args.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    return run_command(_rank, args)


def _check_numbers(args: argparse.Namespace) -> None:
    checks = [(args.epochs >= 1, f"--epochs={args.epochs} must be at least 1"),
              (args.batch_size >= 1, f"--batch-size={args.batch_size} must be at least 1"),
              (args.micro_batch_size >= 0, f"--micro-batch-size={args.micro_batch_size} must be >= 0"),
              (args.lr > 0, f"--lr={args.lr} must be > 0"),
              (0 <= args.warmup < 1, f"--warmup={args.warmup} is a fraction of the steps; use a value in [0, 1)"),
              (args.dropout is None or 0 <= args.dropout < 1, f"--dropout={args.dropout} must be in [0, 1)"),
              (args.eval_batch_size >= 1, f"--eval-batch-size={args.eval_batch_size} must be at least 1"),
              (args.max_qa_length >= 1, f"--max-qa-length={args.max_qa_length} must be at least 1")]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def load_examples(task: str, data_dir: str, limit_train: int | None, limit_eval: int | None):
    """(training examples, {evaluation set name: examples}) read from the task's file layout."""
    if not Path(data_dir).is_dir():
        raise UserError(f"--data {data_dir} is not a directory")
    if task == "race":
        from shardlm.finetune.race import read_race

        return read_race(data_dir, "train", limit_train), {"dev": read_race(data_dir, "dev", limit_eval)}
    from shardlm.finetune.glue import GLUE_TASKS, glue_file, read_glue

    spec = GLUE_TASKS[task]
    train = read_glue(glue_file(data_dir, spec, spec.train_file), spec, limit_train)
    evals = {Path(name).stem: read_glue(glue_file(data_dir, spec, name), spec, limit_eval) for name in spec.eval_files}
    return train, evals


# --------------------------------------------------------------------------------- on every rank

def _rank(args: argparse.Namespace) -> int:
    import dataclasses

    from shardlm.finetune.glue import GLUE_TASKS
    from shardlm.finetune.heads import ClassificationModel, MultipleChoiceModel, set_dropout
    from shardlm.finetune.loop import FinetuneSettings, finetune

    ctx, bert, config, tokenizer = _load(args)
    seq_length = args.seq_length or min(512, config.model.seq_length)
    if seq_length > config.model.seq_length or seq_length < 8:
        raise UserError(f"--seq-length={seq_length} must be in [8, the model's seq_length={config.model.seq_length}]")
    train_examples, eval_examples = args.examples
    train = encode_task(args.task, train_examples, tokenizer, seq_length, args.max_qa_length)
    evals = {name: encode_task(args.task, examples, tokenizer, seq_length, args.max_qa_length)
             for name, examples in eval_examples.items()}
    f1 = args.task != "race" and GLUE_TASKS[args.task].f1
    ctx.seed(args.seed)
    if args.task == "race":
        model = MultipleChoiceModel(bert, args.seed)
    else:
        model = ClassificationModel(bert, len(GLUE_TASKS[args.task].labels), args.seed)
    if args.dropout is not None:
        set_dropout(model, args.dropout)
    settings = FinetuneSettings(args.epochs, args.batch_size, args.micro_batch_size, args.lr, args.warmup,
                                args.weight_decay, args.clip_grad, args.seed, args.eval_batch_size)
    output = Path(args.output_dir)
    summary = {"task": args.task, "checkpoint": str(args.checkpoint), "data": str(args.data),
               "seq_length": seq_length, "tensor_parallel": ctx.tp_size, "data_parallel": ctx.dp_size,
               "train_examples": len(train), "eval_examples": {name: len(d) for name, d in evals.items()},
               "settings": dataclasses.asdict(settings), "epochs": []}
    if ctx.is_main:
        output.mkdir(parents=True, exist_ok=True)
        print(f"finetune {args.task}: {len(train)} training examples, "
              + ", ".join(f"{name} {len(d)}" for name, d in evals.items())
              + f" | length {seq_length} | TP={ctx.tp_size} x DP={ctx.dp_size} | {output / 'metrics.json'}")
        print(_table_header(evals, f1))

    def report(record: dict) -> None:
        if ctx.is_main:
            summary["epochs"].append(record)
            (output / "metrics.json").write_text(json.dumps(summary, indent=2))
            print(_table_row(record, evals, f1), flush=True)

    finetune(model, ctx, train, evals, settings, f1, report)
    return 0


def encode_task(task: str, examples: list, tokenizer, seq_length: int, max_qa_length: int):
    """A task's examples as model inputs (`TaskData`)."""
    if task == "race":
        from shardlm.finetune.race import encode_race

        return encode_race(examples, tokenizer, seq_length, max_qa_length)
    from shardlm.finetune.inputs import encode_pairs

    return encode_pairs([(e.first, e.second) for e in examples], [e.label for e in examples], tokenizer, seq_length)


def _load(args: argparse.Namespace):
    """(ctx, BERT model in train mode, its RunConfig, tokenizer) on this rank."""
    import torch

    from shardlm.checkpoint import load_model
    from shardlm.data.tokenizers import build_tokenizer
    from shardlm.parallel import init_distributed
    from shardlm.training.data import build_tokenizer_for

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available; use --device cpu")
    ctx = init_distributed(args.tensor_parallel, device=torch.device("cpu") if args.device == "cpu" else None)
    model, config = load_model(args.checkpoint, ctx)
    if config.model.arch != "bert":
        raise UserError(f'{args.checkpoint} holds a model.arch="{config.model.arch}" model; fine-tuning needs a BERT')
    if args.vocab_file:
        tokenizer = build_tokenizer("bert", vocab_file=args.vocab_file)
    else:
        tokenizer = build_tokenizer_for(config.data)
    if tokenizer.cls is None or tokenizer.vocab_size > config.model.vocab_size:
        raise UserError(f"the tokenizer ({tokenizer.vocab_size} tokens) does not fit the checkpoint's BERT "
                        f"({config.model.vocab_size}); pass its WordPiece vocab.txt with --vocab-file")
    return ctx, model.train(), config, tokenizer


def _table_header(evals: dict, f1: bool) -> str:
    columns = ["epoch", "steps", "train loss"] + [f"{name} acc" for name in evals]
    columns += [f"{name} F1" for name in evals] if f1 else []
    return " | ".join(f"{c:>12}" for c in columns)


def _table_row(record: dict, evals: dict, f1: bool) -> str:
    cells = [f"{record['epoch']:>12d}", f"{record['steps']:>12d}", f"{record['train_loss']:>12.4f}"]
    cells += [f"{100 * record[name]['accuracy']:>11.2f}%" for name in evals]
    cells += [f"{100 * record[name]['f1']:>11.2f}%" for name in evals] if f1 else []
    return " | ".join(cells)
