"""Command line of the data pipeline: `shardlm preprocess`, `shardlm tokenizer train`, `shardlm corpus ...`.

Only argparse is imported at module level; each command imports its (heavier) module when it runs.
Every `run_*` takes the parsed namespace and returns an exit code; bad input raises `UserError`,
which `shardlm.cli.main` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOKENIZER_CHOICES = ("gpt2", "bert", "json")


def _add_tokenizer_flags(parser: argparse.ArgumentParser, default: str | None) -> None:
    help_text = "gpt2 (encoder.json + vocab.bpe), bert (vocab.txt) or json (tokenizer.json)"
    choices = TOKENIZER_CHOICES
    if default == "words":
        choices = ("words", *TOKENIZER_CHOICES)
        help_text = "how to count tokens: words (whitespace, default), or " + help_text
    parser.add_argument("--tokenizer", choices=choices, default=default, required=default is None, help=help_text)
    parser.add_argument("--vocab-file", type=Path, help="encoder.json / vocab.txt / tokenizer.json")
    parser.add_argument("--merges-file", type=Path, help="vocab.bpe / merges.txt (gpt2 only)")
    parser.add_argument("--cased", action="store_true", help="bert: do not lower-case the text")


def _add_input_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json-key", default="text", help="key of the document text in .jsonl records")
    parser.add_argument("--txt-mode", choices=("paragraph", "line"), default="paragraph",
                        help=".txt documents: blank-line separated paragraphs (default) or one per line")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers) -> None:
    """Register `preprocess`, `tokenizer` and `corpus` on the top-level subparsers."""
    preprocess = subparsers.add_parser(
        "preprocess", help="tokenize documents into Megatron .bin/.idx files",
        description="Tokenize .jsonl/.txt(.gz) documents into PREFIX.bin + PREFIX.idx (Megatron-LM format).")
    preprocess.add_argument("--input", type=Path, required=True, help=".jsonl, .txt, or either with .gz")
    preprocess.add_argument("--output-prefix", type=Path, required=True, help="writes PREFIX.bin and PREFIX.idx")
    _add_tokenizer_flags(preprocess, default=None)
    _add_input_flags(preprocess)
    preprocess.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    preprocess.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (BERT)")
    preprocess.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    preprocess.add_argument("--skip-bad-lines", action="store_true",
                            help="skip malformed .jsonl lines (counted) instead of failing")
    preprocess.set_defaults(func=run_preprocess)

    tokenizer = subparsers.add_parser("tokenizer", help="train a tokenizer vocabulary")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = tokenizer_sub.add_parser("train", help="train a BPE or WordPiece vocabulary -> DIR/tokenizer.json")
    train.add_argument("--input", type=Path, nargs="+", required=True, help="text files (.jsonl/.txt/.gz)")
    train.add_argument("--kind", choices=("bpe", "wordpiece"), required=True)
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--output", type=Path, required=True, help="directory for tokenizer.json")
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--cased", action="store_true", help="wordpiece: do not lower-case the text")
    _add_input_flags(train)
    train.set_defaults(func=run_tokenizer_train)

    corpus = subparsers.add_parser("corpus", help="clean a corpus: filter, dedup, overlap")
    corpus_sub = corpus.add_subparsers(dest="corpus_command", metavar="ACTION", required=True)
    filter_ = corpus_sub.add_parser("filter", help="drop documents shorter than --min-tokens")
    filter_.add_argument("--input", type=Path, required=True, help=".jsonl, .txt, or either with .gz")
    filter_.add_argument("--output", type=Path, required=True, help=".jsonl (or .jsonl.gz)")
    filter_.add_argument("--min-tokens", type=int, default=128, help="keep documents with at least this many")
    _add_tokenizer_flags(filter_, default="words")
    _add_input_flags(filter_)
    filter_.set_defaults(func=run_corpus_filter)

    dedup = corpus_sub.add_parser("dedup", help="remove near-duplicates (MinHash LSH, Jaccard > threshold)")
    dedup.add_argument("--input", type=Path, required=True, help=".jsonl, .txt, or either with .gz")
    dedup.add_argument("--output", type=Path, required=True, help=".jsonl (or .jsonl.gz)")
    dedup.add_argument("--threshold", type=float, default=0.7)
    dedup.add_argument("--num-perm", type=int, default=128, help="MinHash permutations")
    dedup.add_argument("--shingle-size", type=int, default=5, help="words per shingle")
    _add_input_flags(dedup)
    dedup.set_defaults(func=run_corpus_dedup)

    overlap = corpus_sub.add_parser("overlap", help="percentage of eval n-grams present in training data")
    overlap.add_argument("--eval", type=Path, required=True, help="evaluation set (.jsonl/.txt/.gz)")
    overlap.add_argument("--train", type=Path, nargs="+", required=True, help="training corpus files")
    overlap.add_argument("--ngram", type=int, default=8)
    overlap.add_argument("--output", type=Path, help="also write the report as JSON here")
    _add_input_flags(overlap)
    overlap.set_defaults(func=run_corpus_overlap)


def _check_positive(value: int, flag: str) -> None:
    from shardlm.errors import UserError

    if value < 1:
        raise UserError(f"{flag} {value} must be at least 1")


def run_preprocess(args: argparse.Namespace) -> int:
    from shardlm.data.preprocess import PreprocessConfig, preprocess

    config = PreprocessConfig(
        input=args.input, output_prefix=args.output_prefix, tokenizer=args.tokenizer,
        vocab_file=args.vocab_file, merges_file=args.merges_file, lower_case=not args.cased,
        json_key=args.json_key, txt_mode=args.txt_mode, append_eod=args.append_eod,
        split_sentences=args.split_sentences, workers=args.workers, skip_bad_lines=args.skip_bad_lines,
    )
    result = preprocess(config, progress=not args.no_progress)
    bad_lines = f"{result.bad_lines} bad lines"
    if result.bad_line_numbers:
        more = ", ..." if result.bad_lines > 5 else ""
        bad_lines += f" (lines {', '.join(map(str, result.bad_line_numbers[:5]))}{more})"
    print(f"wrote {args.output_prefix}.bin/.idx: {result.documents} documents, {result.sequences} sequences, "
          f"{result.tokens} tokens in {result.seconds:.1f} s ({result.documents_per_second:.0f} docs/s, "
          f"{result.bytes_read / max(result.seconds, 1e-9) / 1e6:.2f} MB/s); "
          f"skipped {result.empty_documents} empty documents and {bad_lines}")
    return 0


def run_tokenizer_train(args: argparse.Namespace) -> int:
    from shardlm.data.tokenizer_train import train_tokenizer

    path = train_tokenizer(args.input, args.kind, args.vocab_size, args.output, lower_case=not args.cased,
                           min_frequency=args.min_frequency, json_key=args.json_key, txt_mode=args.txt_mode,
                           show_progress=not args.no_progress)
    print(f"wrote {path}")
    return 0


def run_corpus_filter(args: argparse.Namespace) -> int:
    from shardlm.data.corpus import filter_short_documents

    _check_positive(args.min_tokens, "--min-tokens")
    count_tokens = None
    if args.tokenizer != "words":
        from shardlm.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(args.tokenizer, args.vocab_file, args.merges_file, not args.cased)
        count_tokens = lambda text: len(tokenizer.encode(text))
    result = filter_short_documents(args.input, args.output, args.min_tokens, count_tokens, args.json_key,
                                    args.txt_mode, progress=not args.no_progress)
    print(f"wrote {args.output}: kept {result.kept} of {result.read} documents, "
          f"dropped {result.removed} under {args.min_tokens} tokens")
    return 0


def run_corpus_dedup(args: argparse.Namespace) -> int:
    from shardlm.data.corpus import deduplicate
    from shardlm.errors import UserError

    if not 0.0 < args.threshold < 1.0:
        raise UserError(f"--threshold {args.threshold} must be between 0 and 1")
    _check_positive(args.num_perm, "--num-perm")
    _check_positive(args.shingle_size, "--shingle-size")
    result = deduplicate(args.input, args.output, args.threshold, args.num_perm, args.shingle_size,
                         json_key=args.json_key, txt_mode=args.txt_mode, progress=not args.no_progress)
    print(f"wrote {args.output}: kept {result.kept} of {result.read} documents, "
          f"removed {result.removed} near-duplicates (Jaccard > {args.threshold})")
    return 0


def run_corpus_overlap(args: argparse.Namespace) -> int:
    from shardlm.data.corpus import atomic_write_text
    from shardlm.data.overlap import overlap_report

    _check_positive(args.ngram, "--ngram")
    report = overlap_report(args.eval, args.train, args.ngram, args.json_key, args.txt_mode,
                            progress=not args.no_progress)
    text = json.dumps(report.to_dict(), indent=2)
    if args.output is not None:
        atomic_write_text(args.output, text + "\n")
    print(f"{report.percent:.2f}% of {report.eval_ngrams} {args.ngram}-grams of {args.eval} occur in the "
          f"training data ({report.percent_unique:.2f}% of {report.eval_unique_ngrams} distinct)")
    sys.stdout.flush()
    return 0
