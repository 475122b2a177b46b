"""`shardlm eval wikitext|lambada` and `shardlm generate`: evaluate or sample a saved checkpoint.

Module-level imports stay light (argparse only); torch and the model load when a command runs.
Every command takes `--tensor-parallel N` (split the model over N ranks) and `--nproc-per-node M`
(start M local workers, default N; M / N data-parallel ranks share the evaluation windows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shardlm.errors import UserError
from shardlm.eval.loading import check_inputs, load_for_evaluation


def _add_common(parser: argparse.ArgumentParser, data_help: str | None = None) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory or consolidated file")
    if data_help:
        parser.add_argument("--data", default=None, help=data_help)
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel size (ranks per model)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="local worker processes (default: the tensor-parallel size)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda:LOCAL_RANK when available, else cpu")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def add_parser(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="WikiText-103 perplexity, LAMBADA accuracy or lm-evaluation-harness "
                                                              "tasks of a checkpoint",
                                     description="Zero-shot evaluations of the Megatron-LM paper, and "
                                                 "lm-evaluation-harness tasks.")
    tasks = evaluate.add_subparsers(dest="task", metavar="TASK")
    tasks.required = True

    wikitext = tasks.add_parser("wikitext", help="perplexity with overlapping windows (and the adjusted one)")
    _add_common(wikitext, "WikiText wiki.test.tokens (default: the shared WikiText-103 test file)")
    wikitext.add_argument("--stride", type=int, default=32, help="tokens scored per window after the first")
    wikitext.add_argument("--context", type=int, default=None, help="window length (default model.seq_length)")
    wikitext.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    wikitext.add_argument("--max-lines", type=int, default=None, help="evaluate only the first N lines")
    wikitext.add_argument("--no-progress", action="store_true", help="no progress bar")
    wikitext.set_defaults(func=run_wikitext)

    lambada = tasks.add_parser("lambada", help="last-word accuracy (greedy, teacher-forced)")
    _add_common(lambada, "LAMBADA lambada_test.jsonl (default: the shared copy)")
    lambada.add_argument("--strict", action="store_true", help="every BPE token of the last word must be right")
    lambada.add_argument("--batch-size", type=int, default=8, help="examples per forward pass")
    lambada.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")
    lambada.add_argument("--no-progress", action="store_true", help="no progress bar")
    lambada.set_defaults(func=run_lambada)

    from shardlm.eval.harness_cli import add_harness_parser

    add_harness_parser(tasks, _add_common)

    generate = subparsers.add_parser("generate", help="sample text from a checkpoint",
                                     description="Continue prompts with greedy or top-k / top-p sampling.")
    _add_common(generate)
    generate.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    generate.add_argument("--prompt-file", default=None, help="a file with one prompt per line")
    generate.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt")
    generate.add_argument("--greedy", action="store_true", help="always take the most likely token")
    generate.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0: greedy)")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    generate.add_argument("--min-p", type=float, default=0.0,
                          help="drop tokens below this share of the most likely one's probability (0: none)")
    generate.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="divide the positive logits of ids already in the row by this, multiply the negative "
                               "ones (1: none)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.add_argument("--no-cache", action="store_true", help="recompute the prefix every step")
    generate.add_argument("--ignore-eod", action="store_true", help="keep going after an end-of-document token")
    generate.add_argument("--chat", action="store_true",
                          help="each --prompt is a user turn: render it with the chat template, stop at end-of-turn")
    generate.add_argument("--messages", action="append", default=[], metavar="FILE.json",
                          help="a conversation to answer (JSON list of {role, content}); implies --chat; repeatable")
    generate.add_argument("--chat-template", default=None, metavar="DIR",
                          help="tokenizer directory with the chat template (default: the checkpoint's tokenizer's)")
    generate.add_argument("--template-var", action="append", default=[], metavar="KEY=VALUE",
                          help="a chat template variable, VALUE read as JSON if it parses (enable_thinking=false)")
    generate.set_defaults(func=run_generate)


# ----------------------------------------------------------------------------------- entry points

def run_wikitext(args: argparse.Namespace) -> int:
    args.data = _data_path(args.data, "wikitext/wikitext-103/wiki.test.tokens")
    check_inputs(args)
    from shardlm.eval.launch import run_command

    return run_command(_wikitext_rank, args)


def run_lambada(args: argparse.Namespace) -> int:
    args.data = _data_path(args.data, "lambada/lambada_test.jsonl")
    check_inputs(args)
    from shardlm.eval.launch import run_command

    return run_command(_lambada_rank, args)


def run_generate(args: argparse.Namespace) -> int:
    if args.chat or args.messages:
        return run_chat(args)
    prompts = list(args.prompt)
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(f"prompt file not found: {path}; check --prompt-file")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise UserError("no prompt given; pass --prompt TEXT (repeatable) or --prompt-file FILE")
    args.prompts = prompts
    _sampling_config(args).validate()
    check_inputs(args)
    from shardlm.eval.launch import run_command

    return run_command(_generate_rank, args)


def run_chat(args: argparse.Namespace) -> int:
    from shardlm.eval.chat import check_prompt, read_messages

    if args.prompt_file:
        raise UserError("--prompt-file is not read in chat mode; give --prompt TEXT or --messages FILE.json")
    args.conversations = [check_prompt([{"role": "user", "content": p}], "--prompt") for p in args.prompt]
    args.conversations += [read_messages(path) for path in args.messages]
    if not args.conversations:
        raise UserError("no conversation given; pass --prompt TEXT (a user turn) or --messages FILE.json")
    args.template_kwargs = {}
    for item in args.template_var:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--template-var {item!r} must be KEY=VALUE")
        try:
            args.template_kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            args.template_kwargs[key] = value
    _sampling_config(args).validate()
    check_inputs(args)
    from shardlm.eval.launch import run_command

    return run_command(_chat_rank, args)


# --------------------------------------------------------------------------------- on every rank

def _chat_rank(args: argparse.Namespace) -> int:
    from shardlm.eval.chat import generate_chat, template_dir
    from shardlm.sft.template import ChatTemplate

    ctx, model, config = load_for_evaluation(args, with_config=True)
    template = ChatTemplate.from_dir(template_dir(args.chat_template, args.checkpoint, config))
    start = time.perf_counter()
    results = generate_chat(model, template, args.conversations, _sampling_config(args), args.template_kwargs)
    seconds = time.perf_counter() - start
    if ctx.is_main:
        if args.json:
            print(json.dumps({"conversations": args.conversations, "generations": [r.to_dict() for r in results],
                              "seconds": seconds}))
        else:
            for result in results:
                print(f"{result.text}\n[{len(result.tokens)} tokens, stopped: {result.finish_reason}]\n")
    return 0



def _wikitext_rank(args: argparse.Namespace) -> int:
    from shardlm.eval.wikitext import evaluate_wikitext, read_text

    ctx, model, tokenizer = load_for_evaluation(args)
    text = read_text(args.data, args.max_lines)
    start = time.perf_counter()
    result = evaluate_wikitext(model, tokenizer, text, stride=args.stride, context=args.context,
                               batch_size=args.batch_size, progress=not (args.no_progress or args.json))
    seconds = time.perf_counter() - start
    report = {**result.to_dict(), "seconds": seconds, "tokens_per_second": result.scored_tokens / seconds,
              "tensor_parallel": ctx.tp_size, "data_parallel": ctx.dp_size}
    if ctx.is_main:
        _print(args, report, [
            f"WikiText ({args.data}): {result.bpe_tokens} BPE tokens, {result.original_tokens} original tokens",
            f"context {result.context}, stride {result.stride}, {result.windows} windows, "
            f"TP={ctx.tp_size} x DP={ctx.dp_size}, {report['tokens_per_second']:.0f} tokens/s",
            f"loss {result.loss:.4f} | perplexity {result.perplexity:.3f} | "
            f"adjusted perplexity {result.adjusted_perplexity:.3f}",
        ])
    return 0


def _lambada_rank(args: argparse.Namespace) -> int:
    from shardlm.eval.lambada import evaluate_lambada, read_lambada

    ctx, model, tokenizer = load_for_evaluation(args)
    texts = read_lambada(args.data, args.limit)
    start = time.perf_counter()
    result = evaluate_lambada(model, tokenizer, texts, strict=args.strict, batch_size=args.batch_size,
                              progress=not (args.no_progress or args.json))
    report = {**result.to_dict(), "seconds": time.perf_counter() - start,
              "tensor_parallel": ctx.tp_size, "data_parallel": ctx.dp_size}
    if ctx.is_main:
        mode = "strict" if result.strict else "non-strict"
        _print(args, report, [f"LAMBADA ({mode}, {args.data}): accuracy {100 * result.accuracy:.2f}% "
                              f"({result.correct}/{result.examples}, {result.truncated} contexts truncated)"])
    return 0


def _generate_rank(args: argparse.Namespace) -> int:
    from shardlm.eval.generate import generate

    ctx, model, tokenizer = load_for_evaluation(args)
    start = time.perf_counter()
    results = generate(model, tokenizer, args.prompts, _sampling_config(args))
    seconds = time.perf_counter() - start
    if ctx.is_main:
        if args.json:
            print(json.dumps({"prompts": args.prompts, "generations": [r.to_dict() for r in results],
                              "seconds": seconds}))
        else:
            for prompt, result in zip(args.prompts, results):
                print(f"{prompt}{result.text}\n[{len(result.tokens)} tokens, stopped: {result.finish_reason}]\n")
    return 0


# -------------------------------------------------------------------------------------- helpers

def _data_path(given: str | None, default_relative: str) -> str:
    if given:
        return given
    from shardlm.paths import shared_data_dir

    return str(shared_data_dir() / default_relative)


def _sampling_config(args: argparse.Namespace):
    from shardlm.eval.generate import SamplingConfig

    return SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                          top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, stop_at_eod=not args.ignore_eod,
                          use_cache=not args.no_cache)


def _print(args: argparse.Namespace, report: dict, lines: list[str]) -> None:
    print(json.dumps(report) if args.json else "\n".join(lines))
