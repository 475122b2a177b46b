"""The `shardlm` command line: one subcommand per pipeline stage.

Each stage module exposes `add_parser(subparsers)`, which registers its subcommand and sets
`func=run` on it. Modules are imported only when their command is parsed, so `shardlm --help` stays
fast and one stage's optional dependency never breaks another stage.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shardlm.errors import UserError

# subcommand -> module with add_parser(subparsers)
COMMANDS = {
    "train": "shardlm.training.cli",
    "preprocess": "shardlm.data.cli",
    "tokenizer": "shardlm.data.cli",
    "corpus": "shardlm.data.cli",
    "plan": "shardlm.plan.cli",
    "checkpoint": "shardlm.checkpoint.cli",
    "convert": "shardlm.checkpoint.cli",
    "eval": "shardlm.eval.cli",
    "generate": "shardlm.eval.cli",
    "finetune": "shardlm.finetune.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlm",
        description="Megatron-style training of GPT, BERT, Llama-family and Mixture-of-Experts models: "
                    "tensor, pipeline, context, expert and data parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    registered = set()
    for module_name in COMMANDS.values():
        if module_name in registered:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("shardlm"):
                continue  # stage not built in this version
            raise
        module.add_parser(sub)
        registered.add(module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shardlm import signals

    try:
        with signals.stop_signals():  # from the start: building the parser imports torch, which takes seconds
            parser = build_parser()
            # Dotted overrides may come after options (`train c.toml --run-dir d train.lr=1`): collect them.
            args, extra = parser.parse_known_args(argv)
            if extra:
                if not hasattr(args, "overrides") or any(a.startswith("-") for a in extra):
                    parser.error(f"unrecognized arguments: {' '.join(extra)}")
                args.overrides = [*args.overrides, *extra]
            result = args.func(args)
    except UserError as exc:
        if not exc.every_rank or signals.is_main_process():  # the same error on every rank: one line
            print(f"shardlm: error: {exc}", file=sys.stderr)
        return UserError.exit_code
    except signals.Terminated:
        signals.report_stop("shardlm: stopped by SIGTERM")
        return signals.TERMINATED_EXIT_CODE
    except KeyboardInterrupt:
        signals.report_stop("shardlm: interrupted")
        return signals.INTERRUPTED_EXIT_CODE
    return int(result or 0)
