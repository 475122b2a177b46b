"""On-policy distillation (GKD's lambda): a share of the steps train on the student's own completions.

On such a step (drawn from train.seed and the step, the same on every rank) each conversation of the step's rows is
cut before its last answer: the prompt is its tokens up to the one that predicts that answer's first token. The
prompts are split over the DP x CP ranks and completed by the student at the training layout (`shardlm.rl.rollout`'s
KV-cached generator, each sequence from its own seed; under pipeline stages each decoding step runs through them),
gathered, and packed into the step's rows as RL's rounds are (`shardlm.rl.batch.StepRows`; completions that no
longer fit the step's rows are left out). The divergence then runs over the sampled tokens, as over the records'
own answers on the other steps.

Sequence-level KD (`distill.seq_kd`, TRL's GKD option): the steps that are not on-policy take the teacher's
completions of the same prompts in place of the records' answers, sampled the same way by the frozen teacher at the
training layout (`teacher_generator`; under pipeline stages through the teacher's own stages, `FrozenStages`).
Under FSDP the teacher's root stays gathered from its sampling to the step's own release (`release_teacher`).
"""

from __future__ import annotations

import numpy as np

from shardlm.errors import UserError


def last_answer_prompt(row: dict, start: int, end: int) -> list[int] | None:
    """The prompt of the packed document [start, end) of `row` (dict of (T,) arrays): its tokens up to and
    including the one whose target is its last answer's first token; None for a document with no answer."""
    trained = np.flatnonzero(row["labels"][start:end] != -100)
    if not len(trained):
        return None
    gaps = np.flatnonzero(np.diff(trained) > 1)
    first = trained[gaps[-1] + 1] if len(gaps) else trained[0]
    return row["input_ids"][start:start + first + 1].tolist()


def step_prompts(dataset, first_sample: int, rows: int) -> list[list[int]]:
    """The prompts of every conversation in the step's rows `first_sample` .. `first_sample + rows - 1`."""
    prompts = []
    for j in range(rows):
        row = dataset[first_sample + j]
        starts = [*np.flatnonzero(row["position_ids"] == 0).tolist(), len(row["position_ids"])]
        for start, end in zip(starts[:-1], starts[1:]):
            prompt = last_answer_prompt(row, start, end)
            if prompt is not None:
                prompts.append(prompt)
    return prompts


class OnPolicyDistill:
    """`train_step()` in the trainer's place (module docstring): the student's `generator`, and under seq_kd the
    teacher's (`teacher_generator`)."""

    def __init__(self, trainer, generator, pad_id: int, teacher_generator=None):
        self.trainer, self.generator, self.pad_id = trainer, generator, pad_id
        self.teacher_generator = teacher_generator
        self.cfg, self.ctx = trainer.config.distill, trainer.ctx

    def on_policy(self, step: int) -> bool:
        seed = self.trainer.config.train.seed
        return bool(np.random.default_rng([seed, step, 4639]).random() < self.cfg.lmbda)

    def train_step(self) -> dict:
        trainer = self.trainer
        on_policy = self.on_policy(trainer.step)
        kinds = {"on_policy": float(on_policy)} | ({"seq_kd": float(not on_policy)} if self.teacher_generator else {})
        if not on_policy and self.teacher_generator is None:
            return trainer.train_step() | kinds
        rows = self.sampled_rows(self.generator if on_policy else self.teacher_generator)
        offline, trainer.train_data = trainer.train_data, rows
        try:
            metrics = trainer.train_step()
        finally:
            trainer.train_data = offline
        return metrics | kinds | {"completion_length": rows.num_tokens / max(rows.num_sequences, 1)}

    def sampled_rows(self, generator):
        """The step's rows with every last answer replaced by `generator`'s completion (the student's or the
        teacher's)."""
        from shardlm.rl.batch import StepRows
        from shardlm.rl.rollout import gather_samples, sampling_share, sequence_seed
        from shardlm.sft.packing import plan_bins

        trainer, ctx = self.trainer, self.ctx
        t, m = trainer.config.train, trainer.config.model
        prompts = step_prompts(trainer.train_data, trainer.consumed_samples, t.global_batch_size)
        share = sampling_share(len(prompts), ctx)
        with trainer.autocast():
            local = generator.generate([prompts[j] for j in share],
                                       [sequence_seed(t.seed, trainer.step, j) for j in share], trainer.step, share)
        rollouts = gather_samples(local, ctx)
        packing = trainer.config.sft.packing if trainer.config.sft.packing in ("bfd", "ffd") else "bfd"
        bins = plan_bins([len(r.prompt) + len(r.completion) for r in rollouts], m.seq_length, packing)
        kept = sorted(j for members in bins[:t.global_batch_size] for j in members)
        if not kept:
            raise UserError("no on-policy completion fits model.seq_length; raise it or lower distill.max_new_tokens")
        rollouts = [rollouts[j] for j in kept]
        return StepRows(rollouts, np.zeros(len(rollouts)), "dapo", self.cfg.max_new_tokens, False,
                        t.global_batch_size, m.seq_length, self.pad_id, packing)


def samplers(trainer, sampling, stops: set[int], stop_requested=None) -> tuple:
    """(the student's sampler, the teacher's under seq_kd else None) of `trainer` at its layout, with `sampling`
    (a `SamplingConfig`) and the `stops` ids: the teacher's decodes through its own pipeline stages
    (`shardlm.training.frozen.FrozenStages`)."""
    from shardlm.rl.rollout import InProcessGenerator
    from shardlm.training.frozen import FrozenStages

    lockstep = trainer.ctx.world_size > 1
    student = InProcessGenerator(trainer.model, trainer.ctx, sampling, stops, lockstep=lockstep,
                                 pipeline=trainer.pipeline, stop_requested=stop_requested)
    if not trainer.config.distill.seq_kd:
        return student, None
    stages = FrozenStages.of(trainer.teacher, trainer.ctx) if trainer.pipeline is not None else None
    return student, InProcessGenerator(trainer.teacher, trainer.ctx, sampling, stops, lockstep=lockstep,
                                       pipeline=stages, stop_requested=stop_requested)


FILTERS = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
"""The sampling options of [distill] and the value that turns each off."""


def sampling_of(cfg):
    """The `SamplingConfig` of a run's on-policy (and seq_kd) completions, from its [distill] section."""
    from shardlm.eval.generate import SamplingConfig

    return SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.sampling_temperature,
                          **{name: getattr(cfg, name) for name in FILTERS})


def start_on_policy(trainer, template, tokenizer_path, stop_requested=None):
    """(the run's `OnPolicyDistill`, the line that describes it), once the trainer holds the starting weights."""
    from shardlm.rl.setup import end_ids, stop_ids

    cfg = trainer.config.distill
    eod, pad_id = end_ids(template)
    student, teacher = samplers(trainer, sampling_of(cfg), stop_ids(eod, pad_id, tokenizer_path), stop_requested)
    filters = ", ".join(f"{name} {getattr(cfg, name):g}" for name, off in FILTERS.items() if getattr(cfg, name) != off)
    line = (f"distill: on-policy on a share {cfg.lmbda:g} of the steps"
            + (", the teacher's completions on the others (seq_kd)" if cfg.seq_kd else "")
            + f" (completions of at most {cfg.max_new_tokens} tokens sampled by the "
            f"{'student and the teacher' if cfg.seq_kd else 'student'} at temperature {cfg.sampling_temperature:g}"
            + (f", {filters}" if filters else "") + ")")
    return OnPolicyDistill(trainer, student, pad_id if pad_id is not None else 0, teacher), line
