"""One rank's training job: set up the parallel context, data and trainer, then train and report."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlm.checkpoint import latest_in, load_checkpoint, save_checkpoint
from shardlm.config import RunConfig, validate
from shardlm.errors import UserError
from shardlm.parallel import init_distributed
from shardlm.training.data import build_datasets, build_tokenizer_for
from shardlm.training.logging import RunLogger
from shardlm.training.trainer import Trainer, check_can_compile, perplexity


def resolve_device(name: str) -> torch.device | None:
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError('train.device="cuda" but no CUDA device is available; use train.device="cpu"')
    return None  # auto: cuda:LOCAL_RANK when available, else cpu


def default_run_dir(config_path: str | None) -> Path:
    stem = Path(config_path).stem if config_path else "run"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _agree_on_run_dir(run_dir: Path | None, config_path: str | None) -> Path:
    """Rank 0 chooses the run directory and every rank uses it."""
    chosen = [str(run_dir or default_run_dir(config_path))]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


@dataclasses.dataclass
class TrainResult:
    """What a finished run leaves in memory: the last step's metrics (with val_loss/val_ppl when there
    is validation data), the run directory and the trainer (model and optimizer)."""

    metrics: dict
    run_dir: Path
    trainer: Trainer


class TerminationFlag:
    """SIGTERM sets a flag; `flag()` tells every rank whether any rank got one (an all-reduce MAX of
    one value over the world per call), so that all ranks save and stop at the same step."""

    def __init__(self, ctx):
        self.ctx, self.received, self.previous = ctx, False, None

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = True

    def __call__(self) -> bool:
        flag = torch.tensor(float(self.received), device=self.ctx.device)
        self.ctx.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def __exit__(self, *exc):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def train(config: RunConfig, run_dir: Path | None = None, config_path: str | None = None) -> TrainResult:
    """Train on this rank (under torchrun or alone); every rank returns the same metrics."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(config, world)
    tokenizer = build_tokenizer_for(config.data)
    if config.model.vocab_size == 0:
        config.model.vocab_size = tokenizer.vocab_size
    t = config.train
    ctx = init_distributed(config.parallel.tensor, t.timeout_s, resolve_device(t.device), config.parallel.pipeline)
    if t.compile:  # before the run directory and the datasets exist
        check_can_compile(ctx.device)
    run_dir = _agree_on_run_dir(run_dir, config_path)
    logger = RunLogger(run_dir, t.steps, ctx.is_main, config.log.interval, config.log.progress,
                       config.log.tensorboard)
    if ctx.is_main:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    valid_samples = (t.steps // max(1, t.eval_interval) + 1) * t.eval_iters * t.micro_batch_size * ctx.dp_size
    train_data, valid_data = build_datasets(config.data, tokenizer, config.model.seq_length, t.seed,
                                            t.steps * t.global_batch_size, valid_samples, config.model.arch)
    trainer = Trainer(config, ctx, train_data, valid_data)
    checkpoints = Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"
    resume_from = latest_in(checkpoints) or (config.checkpoint.load or None)
    if resume_from:
        meta = load_checkpoint(trainer, resume_from)
        logger.resumed_at(trainer.step)
        logger.print(f"resumed from {resume_from} at step {meta['step']} (saved at TP={meta['tensor_parallel']} x "
                     f"PP={meta.get('pipeline_parallel', 1)} x "
                     f"DP={meta['data_parallel']})")
    pipeline = f"PP={ctx.pp_size} ({config.parallel.pipeline_schedule}) x " if ctx.pp_size > 1 else ""
    logger.print(f"shardlm: {trainer.num_parameters() / 1e6:.2f}M parameters | TP={ctx.tp_size} x {pipeline}"
                 f"DP={ctx.dp_size} on {ctx.world_size} {ctx.device.type} rank(s) | "
                 f"vocabulary {config.model.vocab_size} padded to {trainer.model.padded_vocab_size} | "
                 f"run directory {run_dir}")
    save = config.checkpoint.save
    last_saved = trainer.step if resume_from else -1

    def checkpoint_now():
        nonlocal last_saved
        path = save_checkpoint(trainer, checkpoints, config.checkpoint.keep_last)
        last_saved = trainer.step
        logger.print(f"saved checkpoint {path}")

    metrics: dict = {}
    with TerminationFlag(ctx) as terminated:
        while trainer.step < t.steps:
            metrics = trainer.train_step()
            logger.step(metrics, t.steps)
            if t.eval_interval and trainer.step % t.eval_interval == 0 and trainer.step != t.steps:
                val = trainer.evaluate()
                if val is not None:
                    logger.validation(trainer.step, val)
            interval = config.checkpoint.save_interval
            if save and interval and trainer.step % interval == 0 and trainer.step != t.steps:
                checkpoint_now()
            if terminated():
                logger.print(f"SIGTERM: saving at step {trainer.step} and stopping")
                if save:
                    checkpoint_now()
                logger.close(plot=False)
                raise SystemExit(143)
    if save and trainer.step != last_saved:
        checkpoint_now()
    val = trainer.evaluate()
    if val is not None:
        logger.validation(trainer.step, val)
        metrics = {**metrics, "val_loss": val, "val_ppl": perplexity(val)}
    plot = logger.close(plot=config.log.plot)
    if plot is not None:
        print(f"loss curve: {plot}", file=sys.stderr)
    return TrainResult(metrics, run_dir, trainer)
