"""`shardlm eval harness`: lm-evaluation-harness tasks on a checkpoint, tensor-parallel, offline.

    shardlm eval harness --checkpoint C --tasks T1,T2 [--include-path DIR] [--limit N] [--batch-size B]
        [--tensor-parallel N --nproc-per-node N] [--output results.json]

Every rank loads its shard of the model; TP rank 0 runs the harness (`lm_eval.simple_evaluate`
with the `shardlm` model) and the other ranks join each forward pass it makes
(`shardlm.eval.harness_calls`); only rank 0 prints and writes. The shipped tasks
(`lambada_openai_local`, `wikitext_local`) read the shared data folder; `--include-path` adds task
YAMLs of your own. The harness's built-in tasks are indexed only when a named task is not found
among these (that takes seconds). `HF_DATASETS_OFFLINE` and `HF_HUB_OFFLINE` default to 1, so
nothing is downloaded. `python -m shardlm.eval.harness_cli ARGS` is lm-eval's own command line with
the `shardlm` model registered (lm-eval 0.4 finds no models outside its package by itself).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from shardlm.errors import UserError

OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def add_harness_parser(tasks, add_common) -> None:
    """The `harness` subcommand of `shardlm eval` (tasks: its subparsers; add_common: the shared flags)."""
    harness = tasks.add_parser("harness", help="lm-evaluation-harness tasks (needs shardlm[eval])",
                               description="Run lm-evaluation-harness tasks on a checkpoint, tensor-parallel.")
    add_common(harness)
    harness.add_argument("--tasks", required=True, help="comma-separated task names, e.g. lambada_openai_local")
    harness.add_argument("--include-path", action="append", default=[], help="a folder of task YAMLs (repeatable)")
    harness.add_argument("--limit", type=float, default=None, help="evaluate the first N documents of each task")
    harness.add_argument("--batch-size", type=int, default=8, help="requests per forward pass")
    harness.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    harness.add_argument("--bootstrap-iters", type=int, default=100000,
                         help="bootstrap resamples for standard errors (0: skip them)")
    harness.add_argument("--log-samples", action="store_true", help="keep every request and answer in --output")
    harness.add_argument("--output", default=None, help="write the harness's results as JSON to this file")
    harness.set_defaults(func=run_harness)


def run_harness(args: argparse.Namespace) -> int:
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("lm-evaluation-harness is not installed; pip install 'shardlm[eval]'") from None
    from shardlm.eval.launch import run_command, world_size_for
    from shardlm.eval.loading import check_inputs

    check_inputs(args)
    if world_size_for(args) != args.tensor_parallel:
        raise UserError(f"--nproc-per-node={world_size_for(args)} must equal --tensor-parallel="
                        f"{args.tensor_parallel}: the harness runs one model replica")
    if args.batch_size < 1:
        raise UserError(f"--batch-size={args.batch_size} must be at least 1")
    for folder in args.include_path:
        if not Path(folder).is_dir():
            raise UserError(f"--include-path {folder} is not a folder; pass a folder of task YAMLs")
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.task_list:
        raise UserError("--tasks is empty; name at least one task, e.g. --tasks lambada_openai_local")
    with tempfile.TemporaryDirectory(prefix="shardlm-tasks-") as rendered:
        args.include_dirs, args.include_defaults = resolve_tasks(args.task_list, args.include_path, rendered)
        return run_command(_harness_rank, args)


def resolve_tasks(names: list[str], include_path: list[str], rendered: str) -> tuple[list[str], bool]:
    """(include folders, whether the built-in tasks are needed) for `names`; the shipped tasks are
    written into `rendered`. A missing task or data file is a UserError."""
    from lm_eval.tasks import TaskManager

    from shardlm.eval.harness_tasks import render_tasks
    from shardlm.paths import shared_data_dir

    shipped = render_tasks(shared_data_dir(), rendered)
    include = [rendered, *include_path]
    defaults = False
    known = set(TaskManager(include_path=include, include_defaults=False).all_tasks)
    if not set(names) <= known:
        defaults = True
        known = set(TaskManager(include_path=include, include_defaults=True).all_tasks)
    missing = [n for n in names if n not in known]
    if missing:
        raise UserError(f"unknown harness task(s) {missing}; shardlm ships {sorted(shipped)}, "
                        "add your own YAMLs with --include-path DIR")
    for name in names:
        for path in shipped.get(name, []):
            if not path.is_file():
                raise UserError(f"task {name} reads {path}, which does not exist; set SHARDLM_DATA to the "
                                "shared data folder")
    return include, defaults


def _harness_rank(args: argparse.Namespace) -> int:
    from shardlm.eval.harness_calls import HarnessScorer, TensorParallelCalls
    from shardlm.eval.loading import load_for_evaluation

    ctx, model, tokenizer = load_for_evaluation(args)
    if ctx.dp_size != 1:
        raise UserError(f"the harness runs one model replica; use {ctx.tp_size} processes for "
                        f"--tensor-parallel={ctx.tp_size}")
    calls = TensorParallelCalls(HarnessScorer(model, tokenizer), ctx)
    if not calls.is_leader:
        calls.serve()
        return 0
    try:
        results = _evaluate(args, calls)
    finally:
        calls.close()
    if args.output:
        from lm_eval.utils import handle_non_serializable

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=2, default=handle_non_serializable,
                                                ensure_ascii=False), encoding="utf-8")
    if args.json:
        print(json.dumps({"results": results["results"], "tensor_parallel": ctx.tp_size}, default=str))
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0


def _evaluate(args: argparse.Namespace, calls) -> dict:
    """lm_eval.simple_evaluate on TP rank 0 with the loaded model."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from shardlm.eval.harness import ShardLM

    lm = ShardLM(checkpoint=args.checkpoint, batch_size=args.batch_size, calls=calls)
    limit = None if args.limit is None else int(args.limit) if float(args.limit).is_integer() else args.limit
    manager = TaskManager(include_path=args.include_dirs, include_defaults=args.include_defaults)
    return simple_evaluate(model=lm, tasks=args.task_list, num_fewshot=args.num_fewshot, limit=limit,
                           bootstrap_iters=args.bootstrap_iters, log_samples=args.log_samples,
                           task_manager=manager)


def lm_eval_main() -> None:
    """lm-eval's command line with the `shardlm` model registered."""
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    from lm_eval.__main__ import cli_evaluate

    import shardlm.eval.harness  # noqa: F401  (registers the model)

    cli_evaluate()


if __name__ == "__main__":
    lm_eval_main()
