"""The runs the `preference` section of `make bench` compares (`shardlm.bench.preference`, `shardlm.bench.kto`):
TRL's trainers as shipped, step by step with shardlm's steps in between (`trl_run`), the real tokens of shardlm's
packed rows (`pair_row_tokens`), its reference pass (`timed_reference`) and the figures both report
(`side_by_side`)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shardlm.bench.common import steady, summary, torch_threads, uncached_datasets

BETA, LR = 0.1, 1e-4
"""Both comparisons' beta and (constant) learning rate."""


def shardlm_steps(model, model_dir: Path, data: Path, out: Path, threads: int, loss: str):
    """shardlm's side (`bench.sft.ShardlmSteps`) of a preference comparison: `loss` at BETA, the records in order,
    a constant learning rate LR, no weight decay, clipping at 1, each step's tokens counted by `pair_row_tokens`."""
    from shardlm.bench.sft import ShardlmSteps

    return ShardlmSteps(model, model_dir, data, out, threads, count_tokens=pair_row_tokens,
                        extra=[f'preference.loss="{loss}"', f"preference.beta={BETA}", "sft.shuffle=false",
                               f"train.lr={LR}", f"train.min_lr={LR}", 'train.decay_style="constant"',
                               "train.warmup_steps=0", "train.weight_decay=0.0", "train.clip_grad=1.0"])


def pair_row_tokens(data, step: int, rows_per_step: int) -> int:
    """Real tokens of the packed pair rows that step `step` (1, 2, ...) read: those of a pair (`pair` >= 0)."""
    rows = range((step - 1) * rows_per_step, step * rows_per_step)
    return int(sum((data[i]["pair"] >= 0).sum() for i in rows))


def trl_run(steps: int, warmup_steps: int, model_dir: Path, records: list[dict], item_tokens: list[int],
            per_step: int, out_dir: Path, threads: int, after_step, kto: bool = False) -> dict:
    """TRL's DPOTrainer (or with `kto` its KTOTrainer) as shipped on the records in order, `per_step` a step for
    `steps` steps, the first `warmup_steps` not counted:
    per-step seconds (from one `on_step_end` to the next), real tokens (`item_tokens` per record) and the seconds in
    its reference model's forwards; `after_step()` runs outside its clock."""
    import datasets
    import transformers
    import trl

    trainer_class = trl.KTOTrainer if kto else trl.DPOTrainer

    class InOrder(trainer_class):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    reference = {"seconds": 0.0}

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.times, self.reference = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.reference_seen = time.perf_counter(), reference["seconds"]

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.last)
            self.reference.append(reference["seconds"] - self.reference_seen)
            self.reference_seen = reference["seconds"]
            after_step()
            self.last = time.perf_counter()

    with uncached_datasets(), torch_threads(threads):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        common = dict(output_dir=str(out_dir), max_length=None, beta=BETA, per_device_train_batch_size=per_step,
                      max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                      weight_decay=0.0, max_grad_norm=1.0, logging_steps=10**6, report_to=[], save_strategy="no",
                      use_cpu=True, seed=0, dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True,
                      bf16=False, fp16=False)
        args = (trl.KTOConfig(**common, train_sampling_strategy="sequential") if kto
                else trl.DPOConfig(**common, loss_type=["sigmoid"]))
        clock = StepClock()
        trainer = InOrder(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                          processing_class=transformers.AutoTokenizer.from_pretrained(str(model_dir)),
                          callbacks=[clock])
        started = {}
        trainer.ref_model.register_forward_pre_hook(lambda *_: started.update(t=time.perf_counter()))
        trainer.ref_model.register_forward_hook(
            lambda *_: reference.update(seconds=reference["seconds"] + time.perf_counter() - started["t"]))
        output = trainer.train()
    tokens = [sum(item_tokens[i * per_step:(i + 1) * per_step]) for i in range(len(clock.times))]
    measured = steady(clock.times, tokens, warmup_steps)
    return {**measured, "reference_s": clock.reference[warmup_steps:], "train_loss": output.training_loss}


def timed_reference(trainer, threads: int) -> float:
    """Seconds of shardlm's precomputed reference pass over the training data (the pass before its first step, run
    again after the steps: the same work)."""
    from shardlm.preference.reference import precompute_reference

    with torch_threads(threads):
        start = time.perf_counter()
        precompute_reference(trainer, trainer.train_data)
        return time.perf_counter() - start


def side_by_side(ours, theirs: dict, warmup_steps: int, reference_s: float) -> tuple[dict, list[float]]:
    """(the figures both comparisons report, shardlm's counted step seconds) of shardlm's steps `ours` (a
    `ShardlmSteps`) and TRL's `trl_run` result: tokens/s of each per step (TRL's also without its reference
    forwards), step ms, TRL's reference share, the ratios per pair of steps, both runs' losses."""
    mine = steady(ours.times, ours.tokens, warmup_steps)
    rates = {"shardlm": [n / t for n, t in zip(mine["tokens"], mine["step_s"])],
             "trl": [n / t for n, t in zip(theirs["tokens"], theirs["step_s"])],
             "trl_without_reference": [n / (t - r) for n, t, r in zip(theirs["tokens"], theirs["step_s"],
                                                                      theirs["reference_s"])]}
    return {
        "pairs": len(rates["trl"]),
        **{f"{name}_tokens_per_sec": summary(values) for name, values in rates.items()},
        "shardlm_step_ms": summary([t * 1e3 for t in mine["step_s"]]),
        "trl_step_ms": summary([t * 1e3 for t in theirs["step_s"]]),
        "trl_reference_share": summary([r / t for r, t in zip(theirs["reference_s"], theirs["step_s"])]),
        "shardlm_reference_s": reference_s,
        "ratio": summary([a / b for a, b in zip(rates["shardlm"], rates["trl"])]),
        "ratio_without_trl_reference": summary([a / b for a, b in zip(rates["shardlm"],
                                                                      rates["trl_without_reference"])]),
        "shardlm_losses": ours.losses, "trl_train_loss": theirs["train_loss"],
    }, mine["step_s"]
