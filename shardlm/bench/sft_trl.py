"""TRL's side of the `sft` benchmark: one SFTTrainer run of the tiny Qwen3, timed per optimizer step.

`trl_run` fine-tunes with `trl.SFTTrainer` (`packing=True, packing_strategy="bfd", padding_free=True,
assistant_only_loss=True`, SDPA attention, fp32, no evaluation or saving, no dataloader workers) and records,
between two `on_step_end` callbacks, each step's seconds (data loading included), its input tokens
(`state.num_input_tokens_seen`: a padding-free batch is one (1, N) row of the N real tokens of its packed rows)
and the seconds spent in TRL's fused LM head and log-probabilities (`LogProbClock`). After each step's clock
stops, `after_step` gives the other trainer its turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from shardlm.bench.common import steady, torch_threads, uncached_datasets


def trl_run(shape, model_dir: Path, conversations, out_dir: Path, threads: int = 2,
            after_step: Callable[[], None] | None = None, peft_config=None) -> dict:
    """Fine-tune with TRL's SFTTrainer at `shape` (an `sft.SFTShape`: its steps, rows per step, row length and
    warm-up steps); per-step times between `on_step_end` callbacks. `after_step()` runs at the end of every step,
    outside TRL's timing (the other trainer's turn). `peft_config`: a peft `LoraConfig` (TRL + peft trains
    adapters)."""
    import datasets
    import transformers
    import trl

    head = LogProbClock()

    class StepClock(transformers.TrainerCallback):
        """Seconds, input tokens and LM-head seconds of each optimizer step, from one `on_step_end` to the next."""

        def __init__(self):
            self.times, self.tokens, self.head = [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.seen, self.head_seen = time.perf_counter(), 0, head.seconds

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.tokens.append(state.num_input_tokens_seen - self.seen)
            self.head.append(head.seconds - self.head_seen)
            self.seen, self.head_seen = state.num_input_tokens_seen, head.seconds
            if after_step is not None:
                after_step()
            self.last = time.perf_counter()

    with uncached_datasets(), torch_threads(threads):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        args = trl.SFTConfig(
            output_dir=str(out_dir), max_steps=shape.steps, per_device_train_batch_size=shape.rows_per_step,
            gradient_accumulation_steps=1, learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0,
            max_length=shape.seq_length, packing=True, packing_strategy="bfd", padding_free=True,
            assistant_only_loss=True, dataloader_num_workers=0, dataloader_pin_memory=False, use_cpu=True,
            eval_strategy="no", save_strategy="no", report_to=[], logging_steps=10**6, disable_tqdm=True,
            include_num_input_tokens_seen=True, seed=0, bf16=False, fp16=False)
        clock = StepClock()
        dataset = datasets.Dataset.from_dict({"messages": [c.messages for c in conversations]})
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[clock], peft_config=peft_config)
        with head:
            output = trainer.train()
    if not any(clock.tokens):
        raise RuntimeError("TRL counted no input tokens (state.num_input_tokens_seen stayed 0)")
    measured = steady(clock.times, clock.tokens, shape.warmup_steps)
    head_fraction = sum(clock.head[shape.warmup_steps:]) / sum(measured["step_s"]) if head.patched else None
    return {**measured, "lm_head_loss_fraction": head_fraction, "train_loss": output.training_loss,
            "padding_free": bool(trainer.args.padding_free), "assistant_only_loss": bool(args.assistant_only_loss)}


class LogProbClock:
    """`with LogProbClock() as clock:` adds the seconds spent in the forward and backward of TRL's fused LM head
    and log-probabilities (`trl.kernels.chunked_logprob.ChunkedLogProbFunction`, its torch fallback on a CPU) to
    `clock.seconds`; `patched` is false when this TRL has no such function."""

    def __init__(self):
        self.seconds, self.patched, self._saved = 0.0, False, None

    def __enter__(self):
        try:
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction as function
        except ImportError:
            return self
        self._saved = (function, function.forward, function.backward)
        function.forward, function.backward = self._timed(function.forward), self._timed(function.backward)
        self.patched = True
        return self

    def _timed(self, run):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return staticmethod(timed)

    def __exit__(self, *exc):
        if self._saved:
            function, forward, backward = self._saved
            function.forward, function.backward = staticmethod(forward), staticmethod(backward)
            self._saved = None
