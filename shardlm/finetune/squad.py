"""`shardlm finetune squad`: SQuAD 1.1 / 2.0 extractive question answering.

The pieces: `squad_data.py` reads and checks the official JSON files, `squad_features.py` cuts each
question's context into `[CLS] question [SEP] window [SEP]` rows with the answer's token span,
`heads.SpanModel` scores every position as an answer start and end, the shared loop (`loop.py`)
trains it with `heads.span_loss`, `squad_decode.py` turns the logits of all of a question's windows
into an answer, and `squad_metrics.py` scores the answers as the official scripts do. This module
joins them for the command line: its options, the files it reads, and per rank the evaluation
(every rank decodes the gathered logits, so every rank holds the same metrics) and the prediction
files `OUTPUT_DIR/predictions/predictions.json` (and `null_odds.json` for 2.0).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.errors import UserError
from shardlm.finetune.squad_data import VERSIONS, SquadExample, read_squad, squad_files
from shardlm.finetune.squad_decode import DecodeSettings, decode_answers, write_prediction_files
from shardlm.finetune.squad_features import SquadFeatures, encode_squad
from shardlm.finetune.squad_metrics import squad_scores

DEFAULT_MAX_QUERY_LENGTH = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The SQuAD options of `shardlm finetune`."""
    group = parser.add_argument_group("squad")
    group.add_argument("--version", choices=VERSIONS, default=None,
                       help="SQuAD 1.1 (answerable questions only) or 2.0 (no-answer questions too); "
                            "default: a fine-tuned model's, else 1.1")
    group.add_argument("--dev", default=None,
                       help="SQuAD: the dev JSON file (default: DATA/dev-vVERSION.json when --data is a folder)")
    group.add_argument("--train-articles", default=None,
                       help="SQuAD: train on articles START:END of the train file only (e.g. 0:4)")
    group.add_argument("--dev-articles", default=None,
                       help="SQuAD: evaluate on articles START:END of the dev file only (e.g. 4:)")
    group.add_argument("--doc-stride", type=int, default=None,
                       help="SQuAD: tokens between the starts of a long context's windows (default: a fine-tuned "
                            "model's, else 128)")
    group.add_argument("--max-answer-length", type=int, default=30, help="SQuAD: longest answer in tokens")
    group.add_argument("--n-best", type=int, default=20, help="SQuAD: start and end positions tried per window")
    group.add_argument("--null-threshold", type=float, default=0.0,
                       help="SQuAD 2.0: answer nothing when null score - best span score exceeds this")


def prepare_arguments(args: argparse.Namespace) -> None:
    """`--version` and `--doc-stride` default to a fine-tuned model's (so that reloading it gives the
    same inputs), else 1.1 and 128; bad numbers are one-line errors."""
    saved = saved_settings(args.checkpoint)
    args.version = args.version or saved.get("squad_version") or "1.1"
    if args.doc_stride is None:
        args.doc_stride = saved.get("doc_stride", 128)
    for flag, value in (("--doc-stride", args.doc_stride), ("--max-answer-length", args.max_answer_length),
                        ("--n-best", args.n_best)):
        if value < 1:
            raise UserError(f"{flag}={value} must be at least 1")


def saved_settings(checkpoint: str) -> dict:
    """The SQuAD settings a fine-tuned model file keeps (`squad_version`, `doc_stride`; {} for another file)."""
    from shardlm.checkpoint.state import safetensors_metadata

    path = Path(checkpoint)
    if not path.is_file():
        return {}
    details = safetensors_metadata(path).get("finetune")
    return json.loads(details) if details else {}


def load_examples(args: argparse.Namespace, train: bool) -> tuple[list[SquadExample], dict[str, list[SquadExample]]]:
    """(training questions, {"dev": dev questions}) from --data / --dev (after `prepare_arguments`)."""
    train_file, dev_file = squad_files(args.data, args.dev, args.version)
    examples = read_squad(train_file, args.version, args.train_articles) if train else []
    dev = read_squad(dev_file, args.version, args.dev_articles, flags=("--dev", "--dev-articles"))
    unsplit = args.train_articles is None and args.dev_articles is None
    if train and unsplit and train_file.resolve() == dev_file.resolve():
        raise UserError(f"--data and --dev are the same file {dev_file}; split it with --train-articles and "
                        "--dev-articles (e.g. 0:4 and 4:)")
    if args.limit_train is not None:
        examples = examples[:args.limit_train]
    return examples, {"dev": dev[:args.limit_eval] if args.limit_eval is not None else dev}


@dataclass
class SquadSet:
    """An evaluation set: its questions and their windows. Its length is the number of questions."""

    examples: list[SquadExample]
    features: SquadFeatures

    def __len__(self) -> int:
        return len(self.examples)


class SquadRun:
    """SQuAD on one rank: encodes questions, evaluates and writes predictions.

    `seq_length`, `max_query_length` (the question's tokens kept) and `doc_stride` shape the inputs;
    `decode` chooses the answers; `ctx` and `batch_size` are the evaluation's."""

    def __init__(self, tokenizer, ctx, seq_length: int, max_query_length: int, doc_stride: int,
                 decode: DecodeSettings, batch_size: int):
        self.tokenizer, self.ctx = tokenizer, ctx
        self.seq_length, self.max_query_length, self.doc_stride = seq_length, max_query_length, doc_stride
        self.decode, self.batch_size = decode, batch_size

    @classmethod
    def from_args(cls, args: argparse.Namespace, ctx, tokenizer, seq_length: int, max_query_length: int) -> SquadRun:
        """The run of `shardlm finetune squad`'s flags (after `prepare_arguments`)."""
        decode = DecodeSettings(args.version, args.n_best, args.max_answer_length, args.null_threshold)
        return cls(tokenizer, ctx, seq_length, max_query_length, args.doc_stride, decode, args.eval_batch_size)

    def features(self, examples: list[SquadExample], training: bool) -> SquadFeatures:
        return encode_squad(examples, self.tokenizer, self.seq_length, self.doc_stride, self.max_query_length,
                            training)

    def evaluation_set(self, examples: list[SquadExample]) -> SquadSet:
        return SquadSet(examples, self.features(examples, training=False))

    def answers(self, model, squad_set: SquadSet) -> tuple[dict[str, str], dict[str, float]]:
        """(predictions, null odds) of every question; collective over the DP group."""
        from shardlm.finetune.loop import model_outputs

        logits = model_outputs(model, squad_set.features.data, self.ctx, self.batch_size,
                               lambda x: x.float(), (self.seq_length, 2), torch.float32)  # (F, L, 2)
        return decode_answers(squad_set.examples, squad_set.features, logits.numpy(), self.decode)

    def evaluate(self, model, name: str, squad_set: SquadSet) -> dict:
        """The official script's scores of `model` on `squad_set` (v2.0: with the null odds, so the best
        threshold too), plus "examples" (questions) and "windows"."""
        predictions, null_odds = self.answers(model, squad_set)
        scores = squad_scores(squad_set.examples, predictions, self.decode.version,
                              null_odds if self.decode.version == "2.0" else None)
        return {**scores, "examples": len(squad_set), "windows": len(squad_set.features)}

    def write_predictions(self, model, evals: dict[str, SquadSet], output_dir: Path, summary: dict) -> None:
        """`--predict`: OUTPUT_DIR/predictions/predictions.json (+ null_odds.json for 2.0) of the dev set,
        written by global rank 0, listed under "predictions" in metrics.json with their scores."""
        summary["predictions"] = {}
        for name, squad_set in evals.items():
            predictions, null_odds = self.answers(model, squad_set)  # collective: every rank
            if not self.ctx.is_main:
                continue
            folder = output_dir / "predictions" if name == "dev" else output_dir / "predictions" / name
            paths = write_prediction_files(folder, predictions, null_odds)
            scores = squad_scores(squad_set.examples, predictions, self.decode.version,
                                  null_odds if self.decode.version == "2.0" else None)
            summary["predictions"][name] = {"files": [str(p) for p in paths], "examples": len(squad_set), **scores}
            print(f"predictions: {', '.join(str(p) for p in paths)} ({len(squad_set)} questions)")


def metric_columns(version: str) -> list[tuple[str, str, float]]:
    """(metric key, table label, scale) of the per-epoch table: exact match and F1 (2.0: also the
    best F1 over no-answer thresholds), already in percent."""
    if version == "1.1":
        return [("exact_match", "EM", 1.0), ("f1", "F1", 1.0)]
    return [("exact", "EM", 1.0), ("f1", "F1", 1.0), ("best_f1", "best F1", 1.0)]

