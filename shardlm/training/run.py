"""One rank's training job: set up the parallel context, data and trainer, then train and report."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlm.checkpoint import latest_in, load_checkpoint, save_checkpoint
from shardlm.checkpoint.files import read_meta, remove_unfinished
from shardlm.checkpoint.init import describe, init_weights, resolve_init
from shardlm.checkpoint.peft import load_adapter, resolve_adapter
from shardlm.checkpoint.reference import load_bema, load_reference
from shardlm.config import RunConfig
from shardlm.data.tokenizers import build_tokenizer_for
from shardlm.errors import UserError
from shardlm.lora import count_parameters
from shardlm.lora.apply import describe_half_base
from shardlm.lora.nf4 import describe_base
from shardlm.parallel import init_distributed
from shardlm.preference import reference_mode
from shardlm.rl.rollout import GenerationStopped
from shardlm.sft.dataset import build_sft_datasets
from shardlm.signals import TERMINATED_EXIT_CODE, exit_interrupted, is_main_process, report_stop
from shardlm.training.bema import BEMA, bema_validation, write_bema
from shardlm.training.cpu_precision import precision_warning, resolve_precision
from shardlm.training.data import build_datasets
from shardlm.training.logging import RunLogger
from shardlm.training.parallelize import check_can_compile
from shardlm.training.reference import ReferenceWeights
from shardlm.training.trainer import Trainer, perplexity
from shardlm.validation import validate


def check_vocabulary(config: RunConfig, tokenizer_size: int, max_token_id: int) -> None:
    """An SFT run's model vocabulary (the checkpoint's, else the tokenizer's) must hold every token id."""
    if config.model.vocab_size == 0:
        config.model.vocab_size = tokenizer_size
    if max_token_id >= config.model.vocab_size:
        raise UserError(f"the chat data has token id {max_token_id} but the model's vocabulary has "
                        f"{config.model.vocab_size} entries; use the model's own tokenizer (sft.tokenizer)")


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


class StopSignals:
    """SIGTERM and Ctrl-C inside `train` (main thread only; the previous handlers return afterwards).

    SIGTERM only sets a flag; `agree_to_stop(ctx)` tells every rank whether any rank got one (an
    all-reduce MAX of one value over the world per call), so that all ranks finish the same step, save
    and stop together. The first SIGINT raises KeyboardInterrupt at once (later ones are ignored) and is
    remembered, so that the errors a peer's exit then causes in collectives read as the interruption."""

    def __init__(self):
        self.terminate_requested = self.interrupted = False
        self.previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._terminate),
                             signal.SIGINT: signal.signal(signal.SIGINT, self._interrupt)}
        return self

    def _terminate(self, signum, frame):
        self.terminate_requested = True

    def _interrupt(self, signum, frame):
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt()

    def agree_to_stop(self, ctx) -> bool:
        flag = torch.tensor(float(self.terminate_requested), device=ctx.device)
        ctx.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class Progress:
    """Where a run stands, for the line a Ctrl-C prints: the last finished step, the checkpoint folder
    and the logger (None until they exist)."""

    step: int = 0
    checkpoints: Path | None = None
    logger: RunLogger | None = None


def train(config: RunConfig, run_dir: Path | None = None, config_path: str | None = None) -> TrainResult:
    """Train on this rank (under torchrun or alone); every rank returns the same metrics.

    SIGTERM: every rank finishes its current step, they save, the main rank prints one line naming the
    checkpoint, and all raise SystemExit(143). Ctrl-C: every rank stops at once, an unfinished save is
    removed (`latest` still names the last complete checkpoint), the main rank prints
    `interrupted at step N; last checkpoint: ...`, and all exit with 130 (`exit_interrupted`)."""
    progress = Progress()
    with StopSignals() as signals:
        try:
            return _train(config, run_dir, config_path, signals, progress)
        except BaseException as exc:
            if isinstance(exc, SystemExit) or not signals.interrupted:
                raise
            report_interrupt(progress)
            exit_interrupted()


def report_interrupt(progress: Progress) -> None:
    """After a Ctrl-C, on the main rank: remove an unfinished save, print where the run stopped."""
    if not is_main_process():
        return
    last = "none"
    if progress.checkpoints is not None:
        with contextlib.suppress(OSError, UserError):
            remove_unfinished(progress.checkpoints)
            latest = latest_in(progress.checkpoints)
            if latest is not None:
                last = f"step {read_meta(latest)['step']} ({latest})"
    if progress.logger is not None:
        with contextlib.suppress(Exception):
            progress.logger.close(plot=False)  # ends a progress bar's line
    report_stop(f"shardlm: interrupted at step {progress.step}; last checkpoint: {last}")


def start_preference(trainer, run_dir: Path, resumed: bool) -> str:
    """Give a preference run's loss its reference: precomputed by the starting weights (saved in the run directory,
    read back on a resume), the starting weights kept (`trainer.loss.weights`), or the LoRA base; returns the line
    that says which."""
    from shardlm.preference.reference import load_reference, pairs_fingerprint, precompute_references, save_reference

    config, mode = trainer.config, reference_mode(trainer.config)
    line = f"preference: {config.preference.loss} loss, beta {config.preference.beta:g}, "
    if trainer.train_data.rows.labels is not None:  # KTO
        from shardlm.preference.kto import desirable_share

        line += desirable_share(trainer.train_data.rows.labels) + ", "
    line += "reference: "
    if mode == "weights":
        p = config.preference
        return line + "the starting weights (a copy, one forward each step)" + (
            f", synced every {p.ref_model_sync_steps} steps ({p.ref_model_mixup_alpha:g} of the policy)"
            if p.sync_ref_model else "")
    if mode != "precomputed":
        return line + {"none": "none (reference-free)", "adapters": "the base (adapters off)"}[mode]
    data = {"train": trainer.train_data, "valid": trainer.valid_data}
    pairs = {split: d.num_pairs for split, d in data.items() if d is not None}
    fingerprints = {split: pairs_fingerprint(d) for split, d in data.items() if d is not None}
    if resumed:
        trainer.loss.tables = load_reference(run_dir, pairs, fingerprints, config.preference.ld_alpha)
        return line + f"read from {run_dir}"
    trainer.loss.tables = precompute_references(trainer, data)
    if trainer.ctx.is_main:
        save_reference(trainer.loss.tables, run_dir, fingerprints, config.preference.ld_alpha)
    unit = trainer.train_data.rows.stats.unit
    return line + f"precomputed by the starting weights for {' and '.join(f'{n} {s}' for s, n in pairs.items())} {unit}"


def disable_dropout(config: RunConfig) -> str | None:
    """A preference, RL or distillation run with its section's `disable_dropout` (TRL's default) trains without
    dropout: model.dropout, model.attention_dropout and lora.dropout set to 0, in place (what config.json and the
    checkpoints then record). Returns the line that says so when it turned some off, else None."""
    sections = [s for s, on in (("preference", config.preference.loss), ("rl", config.rl.loss),
                                ("distill", config.distill.teacher), ("reward", config.reward.loss)) if on]
    m, lora = config.model, config.lora
    if not sections or not getattr(config, sections[0]).disable_dropout:
        return None
    was = {"model.dropout": m.dropout, "model.attention_dropout": max(m.attention_dropout, 0.0),
           "lora.dropout": lora.dropout if lora.rank else 0.0}
    m.dropout, m.attention_dropout, lora.dropout = 0.0, 0.0, 0.0
    turned = [f"{k}={v:g}" for k, v in was.items() if v > 0]
    return (f"dropout off for {sections[0]} ({', '.join(turned)} set to 0; {sections[0]}.disable_dropout=false "
            "keeps it)") if turned else None


def _train(config: RunConfig, run_dir: Path | None, config_path: str | None, signals: StopSignals,
           progress: Progress) -> TrainResult:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_source = resolve_init(config, run_dir)  # before validation: [model] may take the checkpoint's shape
    adapter_line = resolve_adapter(config)  # and [lora] the peft adapter's settings
    dropout_line = disable_dropout(config)  # TRL's default for preference, RL and distillation runs
    validate(config, world)
    t = config.train
    sft = rl = None
    if config.rl.loss:  # prompts, tokenizer and reward functions, before any process group exists
        from shardlm.rl.setup import load_rl_inputs

        rl = load_rl_inputs(config)
        check_vocabulary(config, rl.template.tokenizer.get_vocab_size(), rl.max_token_id)
    elif config.sft.data:  # chat (or preference) records, tokenized and packed before any process group exists
        build = build_sft_datasets
        if config.preference.loss or config.reward.loss:  # pairs (a reward model's too)
            from shardlm.preference.dataset import build_preference_datasets

            build = build_preference_datasets
        if config.preference.loss:
            from shardlm.preference.kto import KL_LOSSES, UNPAIRED

            # KTO: each example's KL sequence takes a completion of its group of a global batch's size
            loss = config.preference.loss
            build = functools.partial(build_preference_datasets, unpaired=loss in UNPAIRED,
                                      kl_group=t.global_batch_size if loss in KL_LOSSES else 0,
                                      gold="gold" in loss.split("+"))
        sft = build(config.sft, config.model.seq_length, t.seed, config.checkpoint.init_from)
        check_vocabulary(config, sft.template.tokenizer.get_vocab_size(), sft.max_token_id)
        if config.distill.teacher:  # the student's vocabulary is known now: the teacher's must be the same
            from shardlm.distill import check_teacher

            if (problem := check_teacher(config)) is not None:
                raise UserError(problem)
    else:
        tokenizer = build_tokenizer_for(config.data)
        if config.model.vocab_size == 0:
            config.model.vocab_size = tokenizer.vocab_size
    ctx = init_distributed(config.parallel.tensor, t.timeout_s, resolve_device(t.device), config.parallel.pipeline,
                           config.parallel.expert, config.parallel.context)
    if t.compile:  # before the run directory and the datasets exist
        check_can_compile(ctx.device)
    chosen = resolve_precision(t, ctx.device, all_ranks=True)  # "auto": before anything reads the precision
    if ctx.is_main:
        if chosen:
            print(f"shardlm: {chosen}", flush=True)
        warning = precision_warning(t.precision, ctx.device)
        if warning:
            print(f"shardlm: {warning}", file=sys.stderr)
    run_dir = _agree_on_run_dir(run_dir, config_path)
    cross_entropy = not (config.preference.loss or config.rl.loss or config.distill.teacher or config.reward.loss)
    logger = progress.logger = RunLogger(run_dir, t.steps, ctx.is_main, config.log.interval, config.log.progress,
                                         config.log.tensorboard, perplexity=cross_entropy)
    if ctx.is_main:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    valid_samples = (t.steps // max(1, t.eval_interval) + 1) * t.eval_iters * t.micro_batch_size * ctx.dp_size
    if sft is not None:
        train_data, valid_data = sft.train, sft.valid
        logger.print(sft.summary())
    elif rl is not None:  # each generation round makes the step's rows (`shardlm.rl.loop`)
        train_data, valid_data = None, None
        logger.print(rl.summary())
    else:
        train_data, valid_data = build_datasets(config.data, tokenizer, config.model.seq_length, t.seed,
                                                t.steps * t.global_batch_size, valid_samples, config.model.arch)
    trainer = Trainer(config, ctx, train_data, valid_data)
    checkpoints = progress.checkpoints = (Path(config.checkpoint.dir) if config.checkpoint.dir
                                          else run_dir / "checkpoints")
    if ctx.is_main:  # what a killed run's unfinished save left; no rank saves before the next barrier
        remove_unfinished(checkpoints)
    # a checkpoint of this run (a restart after a crash) wins over checkpoint.load and checkpoint.init_from
    resume_from = latest_in(checkpoints) or (config.checkpoint.load or None)
    reference = None
    # the starting weights kept: RL's KL reference, a preference run's live reference (preference.reference="weights")
    keep_reference = ((rl is not None and (config.rl.beta > 0 or config.rl.loss == "a2po") and not config.lora.rank)
                      or (trainer.preference and reference_mode(config) == "weights"))
    if keep_reference and resume_from:  # rebuilt from where the run started, before the checkpoint replaces them
        if init_source is not None:
            init_weights(trainer, init_source)
        reference = ReferenceWeights.of(trainer)
    if resume_from:
        meta = load_checkpoint(trainer, resume_from)
        logger.resumed_at(trainer.step)
        logger.print(f"resumed from {resume_from} at step {meta['step']} (saved at TP={meta['tensor_parallel']} x "
                     f"PP={meta.get('pipeline_parallel', 1)} x "
                     f"DP={meta['data_parallel']})")
    elif init_source is not None:
        init_weights(trainer, init_source)
        logger.print(describe(init_source))
    if dropout_line:
        logger.print(dropout_line)
    if adapter_line:  # the [lora] keys the adapter set (`shardlm train` printed them when it resolved them)
        logger.print(adapter_line)
    if config.checkpoint.init_adapter and not resume_from:
        logger.print(load_adapter(trainer, config.checkpoint.init_adapter))
    if keep_reference and not resume_from:
        reference = ReferenceWeights.of(trainer)
    bema_reference = config.bema.enabled and config.bema.update_ref_model
    if trainer.sync is not None or bema_reference:  # moved by TR-DPO's syncs or BEMA: checkpoints keep it
        trainer.synced_reference = reference
        if resume_from:
            load_reference(trainer, resume_from)
    if config.bema.enabled:  # the weights' BEMA copies, from the starting weights or the checkpoint's
        trainer.bema = BEMA(config.bema, trainer, reference if bema_reference else None)
        if resume_from:
            load_bema(trainer, resume_from)
        logger.print(trainer.bema.describe())
    if trainer.preference:
        trainer.loss.weights = reference  # (None unless preference.reference = "weights" or online DPO's)
        if not config.rl.loss:  # (online DPO's pairs come with each step)
            logger.print(start_preference(trainer, run_dir, resumed=bool(resume_from)))
    if trainer.reward:
        from shardlm.reward.loss import describe_run

        logger.print(describe_run(trainer))
    step, rl_run = trainer.train_step, None
    if rl is not None:
        from shardlm.rl.setup import start_rl

        rl_run, line = start_rl(trainer, rl, reference, stop_requested=lambda: signals.terminate_requested,
                                run_dir=run_dir)
        if resume_from:  # a checkpoint taken in the middle of a round keeps the round's rows
            rl_run.restore(Path(resume_from))
        step = rl_run.train_step
        logger.print(line)
        if config.rl.loss == "a2po":  # stage 1: each training prompt's optimal value, from the starting weights
            from shardlm.rl.a2po import prepare

            logger.print(prepare(rl_run, run_dir, resumed=bool(resume_from)))
    if config.distill.teacher and (config.distill.lmbda > 0 or config.distill.seq_kd):  # GKD's mix of samples
        from shardlm.distill.on_policy import start_on_policy
        from shardlm.sft.dataset import tokenizer_dir

        on_policy, line = start_on_policy(trainer, sft.template, tokenizer_dir(config.sft, config.checkpoint.init_from),
                                          stop_requested=lambda: signals.terminate_requested)
        step = on_policy.train_step
        logger.print(line)
    progress.step = trainer.step
    pipeline = f"PP={ctx.pp_size} ({config.parallel.pipeline_schedule}) x " if ctx.pp_size > 1 else ""
    experts = f" (EP={ctx.ep_size})" if ctx.ep_size > 1 else ""
    exchange = context_exchange(config.model, config.parallel.cp_comm)
    context = f"CP={ctx.cp_size} ({exchange}) x " if ctx.cp_size > 1 else ""
    logger.print(f"shardlm: {trainer.num_parameters() / 1e6:.2f}M parameters | TP={ctx.tp_size} x {context}{pipeline}"
                 f"DP={ctx.dp_size}{experts} on {ctx.world_size} {ctx.device.type} rank(s) | "
                 f"vocabulary {config.model.vocab_size} padded to {trainer.model.padded_vocab_size} | "
                 f"run directory {run_dir}")
    if config.lora.rank:
        logger.print(count_parameters(trainer.model, ctx).describe())
    if config.lora.quantize:
        logger.print(describe_base(trainer.model))
    elif config.lora.rank and config.train.precision in ("bf16", "fp16"):
        logger.print(describe_half_base(trainer.model))
    if trainer.teacher is not None:
        from shardlm.distill.teacher import describe_teacher

        logger.print(describe_teacher(trainer.teacher, config.distill.teacher))
    save = config.checkpoint.save
    last_saved = (trainer.step, Path(resume_from)) if resume_from else (-1, None)

    def checkpoint_now() -> Path:
        nonlocal last_saved
        if trainer.step != last_saved[0]:
            last_saved = (trainer.step, save_checkpoint(trainer, checkpoints, config.checkpoint.keep_last))
            if rl_run is not None:
                rl_run.save_round(last_saved[1])
        return last_saved[1]

    def stop_on_sigterm():
        if not save:
            message = f"SIGTERM: stopping at step {trainer.step} without saving (checkpoint.save=false)"
        elif trainer.step == 0:
            message = "SIGTERM: stopping before the first step; nothing to save"
        else:
            message = f"SIGTERM: saving at step {trainer.step} and stopping; saved checkpoint {checkpoint_now()}"
        logger.close(plot=False)
        report_stop(message)
        raise SystemExit(TERMINATED_EXIT_CODE)

    def validate_now() -> dict:
        """The validation loss (when the run has held-out data) and an RL run's held-out rewards, logged."""
        out = {}
        val = trainer.evaluate()
        if val is not None:
            held_out = trainer.loss.take_eval_metrics() if trainer.reward else {}  # val_accuracy, val_margin
            held_out |= bema_validation(trainer)  # val_bema_loss: the BEMA weights on the same held-out data
            logger.validation(trainer.step, val, held_out)
            out = {"val_loss": val} | ({"val_ppl": perplexity(val)} if logger.perplexity else {}) | held_out
        if rl_run is not None:
            try:
                rewards = rl_run.evaluate()
            except GenerationStopped:  # a SIGTERM while the held-out completions were sampled
                stop_on_sigterm()
            if rewards:
                logger.rl_validation(trainer.step, rewards)
                out |= rewards
        return out

    metrics: dict = {}
    while trainer.step < t.steps:
        if signals.agree_to_stop(ctx):  # checked before each step: a SIGTERM during setup stops here
            stop_on_sigterm()
        try:
            metrics = step()
        except GenerationStopped:  # a SIGTERM while the rollouts were sampled: the last finished step is saved
            stop_on_sigterm()
        progress.step = trainer.step
        logger.step(metrics, t.steps)
        if t.eval_interval and trainer.step % t.eval_interval == 0 and trainer.step != t.steps:
            validate_now()
        interval = config.checkpoint.save_interval
        if save and interval and trainer.step % interval == 0 and trainer.step != t.steps:
            logger.print(f"saved checkpoint {checkpoint_now()}")
    if save and trainer.step != last_saved[0]:
        logger.print(f"saved checkpoint {checkpoint_now()}")
    if trainer.bema is not None:
        logger.print(write_bema(trainer, last_saved[1] if save else None, run_dir))
    metrics = {**metrics, **validate_now()}
    plot = logger.close(plot=config.log.plot)
    if plot is not None:
        print(f"loss curve: {plot}", file=sys.stderr)
    return TrainResult(metrics, run_dir, trainer)


def context_exchange(model, cp_comm: str) -> str:
    """What context-parallel ranks exchange, for the run's banner: K/V by `parallel.cp_comm` ("ring" or
    "allgather"), except where the family gathers instead (DeepSeek-V4: its compressed entries and each chunk's halo,
    `shardlm.models.compressed_context`; DeepSeek Sparse Attention: whole rows' latents and indexer keys)."""
    if model.hc_mult:
        return "entries and halos gathered"
    if model.index_topk and model.attention == "mla":
        return "latents gathered"
    return cp_comm
