"""`shardlm finetune race|mnli|qqp|squad --checkpoint CKPT --data DIR`: fine-tune a pretrained BERT.

Module-level imports stay light (argparse only). The data is read and checked in the launching
process (bad files fail with one line before any worker starts), then each rank loads the
checkpoint sharded for `--tensor-parallel`, tokenizes, trains and evaluates; rank 0 prints one table
row per epoch and writes `OUTPUT_DIR/metrics.json` after every epoch. `--nproc-per-node M` starts M
local workers (M / tensor-parallel data-parallel ranks); under torchrun each process is one rank.

After the last epoch, `--save` writes the fine-tuned model as one TP=1 file (`saved.py`) and
`--predict` writes a prediction file per dev and test set (`predictions.py`). Such a file given back
as `--checkpoint` (of the same task) carries its head; with `--epochs 0` nothing is trained: the
model is evaluated on the dev sets (and predicts) at any `--tensor-parallel` size. SQuAD's own
options, files, evaluation and predictions are in `squad.py`; it shares the loop and everything else.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from shardlm.errors import UserError

TASKS = ("race", "mnli", "qqp", "squad")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "finetune", help="fine-tune a BERT checkpoint on RACE, MNLI, QQP or SQuAD",
        description="Fine-tune a pretrained BERT checkpoint; reports dev accuracy (QQP: and F1; SQuAD: exact match "
                    "and F1) after every epoch.")
    parser.add_argument("task", choices=TASKS,
                        help="race (4-way multiple choice), mnli (3 classes), qqp (2 classes), squad (answer spans)")
    parser.add_argument("--checkpoint", required=True,
                        help="BERT checkpoint directory or consolidated file, or a model fine-tuned on this task "
                             "(OUTPUT_DIR/model.safetensors of --save)")
    parser.add_argument("--data", required=True,
                        help="RACE: the folder with {train,dev}/{high,middle}/*.txt; MNLI/QQP: the GLUE task folder; "
                             "SQuAD: the train JSON file, or a folder with train-vVERSION.json and dev-vVERSION.json")
    parser.add_argument("--output-dir", default=None,
                        help="where metrics.json, model.safetensors and predictions/ go "
                             "(default runs/finetune-TASK-TIME)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="passes over train; 0: no training, evaluate (and --predict) a fine-tuned --checkpoint")
    parser.add_argument("--save", action="store_true",
                        help="after the last epoch write the model (encoder + head) to OUTPUT_DIR/model.safetensors, "
                             "one TP=1 file")
    parser.add_argument("--predict", action="store_true",
                        help="after the last epoch write OUTPUT_DIR/predictions/SET.tsv for each dev set and each "
                             "test file in --data (GLUE submission format; RACE: id, answer)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (all data-parallel ranks)")
    parser.add_argument("--micro-batch-size", type=int, default=0, help="per rank per pass; 0: no accumulation")
    parser.add_argument("--lr", type=float, default=2e-5, help="peak learning rate")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps spent warming up")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 disables")
    parser.add_argument("--dropout", type=float, default=None, help="dropout everywhere (default: the checkpoint's)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="input length (default: a fine-tuned model's, else min(512, the model's sequence length))")
    parser.add_argument("--max-qa-length", type=int, default=None,
                        help="RACE: tokens kept of question+option; SQuAD: of the question (default: a fine-tuned "
                             "model's, else 128; SQuAD 64)")
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--limit-train", type=int, default=None, help="use only the first N training examples")
    parser.add_argument("--limit-eval", type=int, default=None,
                        help="use only the first N examples of each dev set (test sets are always whole)")
    parser.add_argument("--vocab-file", default=None, help="BERT vocab.txt (default: the checkpoint's data.vocab_file)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel size (ranks per model)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="local worker processes (default: the tensor-parallel size)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    from shardlm.finetune import squad

    squad.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    if not Path(args.checkpoint).exists():
        raise UserError(f"checkpoint not found: {args.checkpoint}; pass a BERT checkpoint with --checkpoint")
    from shardlm.eval.launch import run_command, world_size_for
    from shardlm.finetune.predictions import read_test_sets

    world_size_for(args)
    args.finetuned = check_finetuned(args.checkpoint, args.task, args.epochs)
    if args.task == "squad":
        from shardlm.finetune import squad

        squad.prepare_arguments(args)
        args.examples = squad.load_examples(args, train=args.epochs > 0)
    else:
        args.examples = load_examples(args.task, args.data, args.limit_train, args.limit_eval, train=args.epochs > 0)
    args.tests, args.missing_tests = read_test_sets(args.task, args.data) if args.predict else ({}, [])
    args.output_dir = args.output_dir or str(Path("runs") / f"finetune-{args.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    return run_command(_rank, args)


def _check_numbers(args: argparse.Namespace) -> None:
    checks = [(args.epochs >= 0, f"--epochs={args.epochs} must be at least 0 (0: evaluate without training)"),
              (args.batch_size >= 1, f"--batch-size={args.batch_size} must be at least 1"),
              (args.micro_batch_size >= 0, f"--micro-batch-size={args.micro_batch_size} must be >= 0"),
              (args.lr > 0, f"--lr={args.lr} must be > 0"),
              (0 <= args.warmup < 1, f"--warmup={args.warmup} is a fraction of the steps; use a value in [0, 1)"),
              (args.dropout is None or 0 <= args.dropout < 1, f"--dropout={args.dropout} must be in [0, 1)"),
              (args.eval_batch_size >= 1, f"--eval-batch-size={args.eval_batch_size} must be at least 1"),
              (args.max_qa_length is None or args.max_qa_length >= 1,
               f"--max-qa-length={args.max_qa_length} must be at least 1")]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def num_classes(task: str) -> int:
    """Classes (MNLI 3, QQP 2), choices per question (RACE 4) or scores per token (SQuAD 2: start
    and end) of the task's head."""
    if task == "squad":
        return 2
    if task == "race":
        from shardlm.finetune.race import NUM_CHOICES

        return NUM_CHOICES
    from shardlm.finetune.glue import GLUE_TASKS

    return len(GLUE_TASKS[task].labels)


def check_finetuned(checkpoint: str, task: str, epochs: int):
    """The `FinetunedInfo` of a fine-tuned `checkpoint` file (None for a pretrained BERT), after checking
    that it was fine-tuned on `task`; `epochs` 0 needs a fine-tuned model."""
    from shardlm.finetune.saved import finetuned_info

    info = finetuned_info(checkpoint)
    if info is not None and info.task != task:
        raise UserError(f"{checkpoint} is a model fine-tuned on {info.task}, not {task}; run `shardlm finetune "
                        f"{info.task}` with it, or fine-tune {task} from a pretrained BERT checkpoint")
    if info is not None and info.num_classes != num_classes(task):
        raise UserError(f"{checkpoint} has a {info.num_classes}-way head but {task} has {num_classes(task)} "
                        "classes; use a model saved by `shardlm finetune --save`")
    if info is None and epochs == 0:
        raise UserError(f"--epochs 0 evaluates a fine-tuned model, but {checkpoint} is a pretrained BERT; pass the "
                        f"OUTPUT_DIR/model.safetensors of `shardlm finetune {task} --save`, or train (--epochs >= 1)")
    return info


def load_examples(task: str, data_dir: str, limit_train: int | None, limit_eval: int | None, train: bool = True):
    """(training examples, {evaluation set name: examples}) read from the task's file layout;
    no training examples (and no training file needed) when `train` is False."""
    if not Path(data_dir).is_dir():
        raise UserError(f"--data {data_dir} is not a directory")
    if task == "race":
        from shardlm.finetune.race import read_race

        return (read_race(data_dir, "train", limit_train) if train else [],
                {"dev": read_race(data_dir, "dev", limit_eval)})
    from shardlm.finetune.glue import GLUE_TASKS, glue_file, read_glue

    spec = GLUE_TASKS[task]
    examples = read_glue(glue_file(data_dir, spec, spec.train_file), spec, limit_train) if train else []
    evals = {Path(name).stem: read_glue(glue_file(data_dir, spec, name), spec, limit_eval) for name in spec.eval_files}
    return examples, evals


# --------------------------------------------------------------------------------- on every rank

def _rank(args: argparse.Namespace) -> int:
    import functools

    from shardlm.finetune.glue import GLUE_TASKS
    from shardlm.finetune.heads import span_loss
    from shardlm.finetune.loop import FinetuneSettings, finetune

    ctx, model, config, tokenizer = _load(args)
    seq_length, max_qa_length = _input_lengths(args, config)
    train_examples, eval_examples = args.examples
    squad_run = None
    if args.task == "squad":
        from shardlm.finetune.squad import SquadRun

        squad_run = SquadRun.from_args(args, ctx, tokenizer, seq_length, max_qa_length)
    if squad_run is not None:  # windows of the questions; dev sets keep their questions for decoding
        train = squad_run.features(train_examples, training=True).data if args.epochs else None
        evals = {name: squad_run.evaluation_set(examples) for name, examples in eval_examples.items()}
    else:
        encode = functools.partial(encode_task, args.task, tokenizer=tokenizer, seq_length=seq_length,
                                   max_qa_length=max_qa_length)  # examples -> TaskData
        train = encode(train_examples) if args.epochs else None
        evals = {name: encode(examples) for name, examples in eval_examples.items()}
    f1 = args.task in GLUE_TASKS and GLUE_TASKS[args.task].f1
    columns = _metric_columns(args, f1)
    settings = FinetuneSettings(args.epochs, args.batch_size, args.micro_batch_size, args.lr, args.warmup,
                                args.weight_decay, args.clip_grad, args.seed, args.eval_batch_size)
    output = Path(args.output_dir)
    summary = _summary(args, ctx, settings, seq_length, len(train_examples), evals)
    if ctx.is_main:
        output.mkdir(parents=True, exist_ok=True)
        print(f"finetune {args.task}: {len(train_examples)} training examples, "
              + ", ".join(f"{name} {len(d)}" for name, d in evals.items())
              + f" | length {seq_length} | TP={ctx.tp_size} x DP={ctx.dp_size} | {output / 'metrics.json'}")
        print(_table_header(evals, columns))

    def report(record: dict) -> None:
        if ctx.is_main:
            summary["epochs"].append(record)
            _write_metrics(output / "metrics.json", summary)
            print(_table_row(record, evals, columns), flush=True)

    hooks = {} if squad_run is None else {"loss_fn": span_loss, "evaluate_fn": squad_run.evaluate}
    if args.epochs:
        finetune(model, ctx, train, evals, settings, f1, report, **hooks)
    else:
        report(_evaluate_only(model, ctx, evals, args.eval_batch_size, f1, hooks.get("evaluate_fn")))
    if args.save:
        _save(args, ctx, model, config, seq_length, max_qa_length, summary)
    if args.predict and squad_run is not None:
        squad_run.write_predictions(model, evals, output, summary)
        if ctx.is_main:
            _write_metrics(output / "metrics.json", summary)
    elif args.predict:
        _predict(args, ctx, model, eval_examples, evals, encode, summary)
    return 0


def _metric_columns(args: argparse.Namespace, f1: bool) -> list[tuple[str, str, float]]:
    """(metric key, label, scale to percent) of each evaluation set's table columns."""
    if args.task == "squad":
        from shardlm.finetune.squad import metric_columns

        return metric_columns(args.version)
    return [("accuracy", "acc", 100.0)] + ([("f1", "F1", 100.0)] if f1 else [])


def task_model(task: str, bert, seed: int):
    """The task's head model on `bert`: `MultipleChoiceModel` (RACE), `SpanModel` (SQuAD) or a
    `ClassificationModel`."""
    from shardlm.finetune.heads import ClassificationModel, MultipleChoiceModel, SpanModel

    if task == "squad":
        return SpanModel(bert, seed)
    if task == "race":
        return MultipleChoiceModel(bert, seed)
    return ClassificationModel(bert, num_classes(task), seed)


def _input_lengths(args: argparse.Namespace, config) -> tuple[int, int]:
    """(seq_length, max_qa_length): the flags, else a fine-tuned model's, else the defaults; checked."""
    from shardlm.finetune.squad import DEFAULT_MAX_QUERY_LENGTH

    saved = args.finetuned
    seq_length = args.seq_length or (saved.seq_length if saved else min(512, config.model.seq_length))
    if seq_length > config.model.seq_length or seq_length < 8:
        raise UserError(f"--seq-length={seq_length} must be in [8, the model's seq_length={config.model.seq_length}]")
    default_qa_length = DEFAULT_MAX_QUERY_LENGTH if args.task == "squad" else 128
    return seq_length, args.max_qa_length or (saved.max_qa_length if saved else default_qa_length)


def _summary(args, ctx, settings, seq_length: int, train_examples: int, evals: dict) -> dict:
    """The head of metrics.json: the run's inputs and layout; per-epoch records go to "epochs"."""
    import dataclasses

    return {"task": args.task, "checkpoint": str(args.checkpoint), "data": str(args.data),
            "seq_length": seq_length, "tensor_parallel": ctx.tp_size, "data_parallel": ctx.dp_size,
            "train_examples": train_examples, "eval_examples": {name: len(d) for name, d in evals.items()},
            "settings": dataclasses.asdict(settings), "epochs": []}


def _evaluate_only(model, ctx, evals: dict, batch_size: int, f1: bool, evaluate_fn=None) -> dict:
    """The record of `--epochs 0`: epoch 0, no steps, each dev set's metrics (`evaluate_fn(model, name,
    set)` when given, as in `loop.finetune`)."""
    from shardlm.finetune.loop import evaluate

    record = {"epoch": 0, "steps": 0, "train_loss": None, "lr": None}
    for name, data in evals.items():
        record[name] = (evaluate_fn(model, name, data) if evaluate_fn is not None
                        else evaluate(model, data, ctx, batch_size, f1))
    return record


def _save(args, ctx, model, config, seq_length: int, max_qa_length: int, summary: dict) -> None:
    """`--save`: the model to OUTPUT_DIR/model.safetensors (collective); rank 0 notes it in metrics.json."""
    import copy

    from shardlm.finetune.saved import FinetunedInfo, save_finetuned

    saved_config = copy.deepcopy(config)
    saved_config.parallel.tensor = 1
    if args.dropout is not None:
        saved_config.model.dropout = args.dropout
    if args.vocab_file:
        saved_config.data.tokenizer, saved_config.data.vocab_file = "bert", str(args.vocab_file)
    info = FinetunedInfo(args.task, num_classes(args.task), seq_length, max_qa_length)
    details = {"checkpoint": str(args.checkpoint), "settings": summary["settings"]}
    if args.task == "squad":
        details.update(squad_version=args.version, doc_stride=args.doc_stride)  # defaults when loaded again
    path = save_finetuned(model, ctx, Path(args.output_dir) / "model.safetensors", saved_config, info, details)
    if ctx.is_main:
        summary["model"] = str(path)
        _write_metrics(path.parent / "metrics.json", summary)
        print(f"saved the fine-tuned model to {path}")


def _predict(args, ctx, model, eval_examples: dict, evals: dict, encode, summary: dict) -> None:
    """`--predict`: OUTPUT_DIR/predictions/SET.tsv for every dev and test set; rank 0 writes them and
    lists them (with accuracy where the labels are known) under "predictions" in metrics.json."""
    from shardlm.finetune.loop import predict, task_metrics
    from shardlm.finetune.predictions import example_ids, race_level_accuracy, write_predictions

    sets = {name: (eval_examples[name], data) for name, data in evals.items()}
    sets.update({name: (examples, encode(examples)) for name, examples in args.tests.items()})
    if ctx.is_main and args.missing_tests:
        print(f"note: no test file {', '.join(args.missing_tests)} in {args.data}; "
              + ("no predictions for it" if args.tests else "writing dev predictions only"))
    summary["predictions"] = {}
    for name, (examples, data) in sets.items():
        predicted = predict(model, data, ctx, args.eval_batch_size)  # collective: every rank
        if not ctx.is_main:
            continue
        ids = example_ids(args.task, examples)
        path = write_predictions(Path(args.output_dir) / "predictions" / f"{name}.tsv", args.task, ids, predicted)
        entry = {"file": str(path), "examples": len(examples)}
        if (data.labels >= 0).all():
            entry.update(task_metrics(predicted, data.labels))
            if args.task == "race":
                entry["levels"] = race_level_accuracy(ids, predicted, data.labels)
        summary["predictions"][name] = entry
        print(f"predictions: {path} ({len(examples)} rows)")
    if ctx.is_main:
        _write_metrics(Path(args.output_dir) / "metrics.json", summary)


def encode_task(task: str, examples: list, tokenizer, seq_length: int, max_qa_length: int):
    """A task's examples as model inputs (`TaskData`)."""
    if task == "race":
        from shardlm.finetune.race import encode_race

        return encode_race(examples, tokenizer, seq_length, max_qa_length)
    from shardlm.finetune.inputs import encode_pairs

    return encode_pairs([(e.first, e.second) for e in examples], [e.label for e in examples], tokenizer, seq_length)


def _load(args: argparse.Namespace):
    """(ctx, head model in train mode, its RunConfig, tokenizer) on this rank. A pretrained BERT gets a new
    head drawn from --seed; a fine-tuned model file (`args.finetuned`) comes with its own."""
    import torch

    from shardlm.checkpoint import load_model
    from shardlm.data.tokenizers import build_tokenizer, build_tokenizer_for
    from shardlm.finetune.heads import set_dropout
    from shardlm.finetune.saved import load_finetuned
    from shardlm.parallel import init_distributed

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available; use --device cpu")
    ctx = init_distributed(args.tensor_parallel, device=torch.device("cpu") if args.device == "cpu" else None)
    if args.finetuned is not None:
        model, config = load_finetuned(args.checkpoint, ctx, lambda bert: task_model(args.task, bert, args.seed))
        ctx.seed(args.seed)
    else:
        bert, config = load_model(args.checkpoint, ctx)
        if config.model.arch != "bert":
            raise UserError(f'{args.checkpoint} holds a model.arch="{config.model.arch}" model; '
                            "fine-tuning needs a BERT")
        ctx.seed(args.seed)
        model = task_model(args.task, bert, args.seed)
    if args.dropout is not None:
        set_dropout(model, args.dropout)
    if args.vocab_file:
        tokenizer = build_tokenizer("bert", vocab_file=args.vocab_file)
    else:
        tokenizer = build_tokenizer_for(config.data)
    if tokenizer.cls is None or tokenizer.vocab_size > config.model.vocab_size:
        raise UserError(f"the tokenizer ({tokenizer.vocab_size} tokens) does not fit the checkpoint's BERT "
                        f"({config.model.vocab_size}); pass its WordPiece vocab.txt with --vocab-file")
    return ctx, model.train(), config, tokenizer


def _table_header(evals: dict, columns: list[tuple[str, str, float]]) -> str:
    """Table columns: epoch, steps, train loss, then each metric of `columns` for every evaluation set."""
    names = ["epoch", "steps", "train loss"] + [f"{name} {label}" for _, label, _ in columns for name in evals]
    return " | ".join(f"{c:>12}" for c in names)


def _table_row(record: dict, evals: dict, columns: list[tuple[str, str, float]]) -> str:
    loss = "-" if record["train_loss"] is None else f"{record['train_loss']:.4f}"
    cells = [f"{record['epoch']:>12d}", f"{record['steps']:>12d}", f"{loss:>12}"]
    cells += [f"{scale * record[name][key]:>11.2f}%" for key, _, scale in columns for name in evals]
    return " | ".join(cells)


def _write_metrics(path: Path, summary: dict) -> None:
    """metrics.json through a temporary file and a rename, so a reader never sees half of it."""
    from shardlm.checkpoint.files import write_json_atomic

    write_json_atomic(path, summary)
