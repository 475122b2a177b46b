"""`shardlm train CONFIG.toml [KEY=VALUE ...] [--nproc-per-node N] [--run-dir DIR]`.

Without `--nproc-per-node` the command trains in this process, or as one worker of an outer
`torchrun` (single- or multi-node). With it, the command validates the config and then starts N
local workers through PyTorch's elastic launcher, exactly as `torchrun --standalone` would.
"""

from __future__ import annotations

import argparse
import copy
import os


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="pretrain or fine-tune (SFT) a model from a TOML config, on any parallel layout",
        description="Train a model from a TOML config. Overrides: section.key=value (e.g. train.lr=3e-4).",
    )
    parser.add_argument("config", help="TOML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="start this many local worker processes (elastic launcher)")
    parser.add_argument("--run-dir", default=None, help="where logs and plots go (default runs/<config>-<time>)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="with --nproc-per-node: restart failed workers this many times (they resume from "
                             "the latest checkpoint in the run directory)")
    parser.add_argument("--shutdown-timeout", type=int, default=None, metavar="SECONDS",
                        help="with --nproc-per-node: how long the workers get after SIGTERM to finish their step "
                             "and save before they are killed (default 300)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shardlm.checkpoint.init import resolve_init
    from shardlm.checkpoint.peft import resolve_adapter
    from shardlm.config import load_config
    from shardlm.errors import UserError
    from shardlm.parallel.staged import backend_name
    from shardlm.training.run import disable_dropout
    from shardlm.validation import validate

    config = load_config(args.config, args.overrides)
    # [model] keys left at their defaults take checkpoint.init_from's values (the run's own checkpoint's on a restart)
    resolve_init(config, Path(args.run_dir) if args.run_dir else None)
    adapter_line = resolve_adapter(config)  # and [lora] keys the peft adapter's settings
    under_launcher = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    nproc = args.nproc_per_node
    world = nproc if nproc and not under_launcher else int(os.environ.get("WORLD_SIZE", "1"))
    if args.print_config:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(config), indent=2))
        return 0
    checked = copy.deepcopy(config)  # validated as `train` will run it: a post-training run without dropout
    disable_dropout(checked)
    validate(checked, world)
    backend_name()  # a bad SHARDLM_BACKEND is one line here, not one per worker
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc-per-node={nproc} must be at least 1")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        raise UserError(f"--shutdown-timeout={args.shutdown_timeout} must be at least 0 (seconds)")
    if nproc and not under_launcher:
        return launch_local(args, nproc, config)

    from shardlm.training.run import train

    if adapter_line and int(os.environ.get("RANK", "0")) == 0:  # once, by the process that trains
        print(adapter_line, flush=True)

    try:
        result = train(config, Path(args.run_dir) if args.run_dir else None, args.config)
    except RuntimeError as exc:
        if is_timeout(exc):
            raise UserError(f"a collective timed out after train.timeout_s={config.train.timeout_s:g}s: "
                            "a peer stopped responding (check the other ranks' logs)") from None
        if peer_exited(exc):
            raise UserError(f"a peer process exited during a collective ({exc}); its own log says why") from None
        raise
    metrics = result.metrics
    if "val_loss" in metrics and int(os.environ.get("RANK", "0")) == 0:
        ppl = f" | perplexity {metrics['val_ppl']:.2f}" if "val_ppl" in metrics else ""
        print(f"final validation loss {metrics['val_loss']:.4f}{ppl}")
    return 0


def is_timeout(exc: BaseException) -> bool:
    """True for the errors torch.distributed (and shardlm's shared-memory collectives) raise when a
    collective outlives its timeout."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def peer_exited(exc: BaseException) -> bool:
    """True for the error of a shared-memory collective whose peer process has exited."""
    text = str(exc)
    return text.startswith("shared-memory") and "has exited" in text


def launch_local(args: argparse.Namespace, nproc: int, config) -> int:
    """Re-run this command on `nproc` local workers via torch.distributed.run (torchrun); SIGTERM and
    Ctrl-C end it with exit code 143 / 130 and no traceback (`shardlm.training.launcher`)."""
    import time
    from pathlib import Path

    from shardlm.training.launcher import DEFAULT_SHUTDOWN_TIMEOUT_S, launch

    run_dir = args.run_dir or str(Path("runs") / f"{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    argv = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts",
            str(args.max_restarts), "-m", "shardlm", "train",
            args.config, *args.overrides, "--run-dir", run_dir]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    checkpoints = Path(config.checkpoint.dir) if config.checkpoint.dir else Path(run_dir) / "checkpoints"
    grace = DEFAULT_SHUTDOWN_TIMEOUT_S if args.shutdown_timeout is None else args.shutdown_timeout
    return launch(argv, grace, checkpoints)
