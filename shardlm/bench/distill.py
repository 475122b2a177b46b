"""Knowledge distillation on one CPU (`make bench` section `distill`): shardlm's `[distill]` against TRL's
`GKDTrainer` as shipped, offline (the dataset's own answers, no generation).

Student: the `sft` section's tiny random Qwen3 (`shardlm.bench.sft.make_model_dir`: the real 151,936-token
vocabulary of the shared chat tokenizer, tied embeddings, fp32). Teacher: a larger random Qwen3 of the same
vocabulary (`DistillShape.teacher`), saved as a Hugging Face directory that both trainers read. Data: the shared
Dolly conversations under the Qwen3 chat template; the loss is the generalized Jensen-Shannon divergence with beta
0.5 at temperature 1 over each answer token (`GKDTrainer`'s loss ignores its temperature, which only samples),
AdamW at 1e-4, clipping at 1.0.

- TRL: `trl.experimental.gkd.GKDTrainer` with `lmbda=0` (never the student's own samples) and `seq_kd=False`
  (never the teacher's): each step scores the dataset's answers. Its collator (`DataCollatorForChatML`) renders
  and tokenizes the messages inside the step and pads a batch to its longest conversation, so the bench gives it
  one conversation a micro-batch (no padding: at this vocabulary a padded batch's logits would take gigabytes) and
  `trl_conversations_per_step` micro-batches a step, as many conversations as shardlm's rows hold on average.
  Everything else is its default (gradient checkpointing on).
- shardlm: `train` with `[sft]` (bfd-packed rows of `seq_length` tokens, one a micro-batch, `rows_per_step` a step)
  and `[distill]` (the teacher read from the same directory).

The two take turns, one optimizer step each (a shardlm step right after each TRL step, outside TRL's clock,
`sft_trl.trl_run`'s clock); the first `warmup_steps` are not counted. tokens/s counts real (non-padding) tokens:
TRL's `num_input_tokens_seen` over the attention masks, shardlm's rows' documents. `ratio`: shardlm's tokens/s over
TRL's per pair of steps (the goal: >= 1.5, `shardlm.bench.goals`).

The teacher's share of a step (`TeacherClock`, read around each step, so it counts that step's teacher work alone):
shardlm's teacher runs its layers as a module call of the loss and its output layer once in each chunk of the
divergence (`shardlm.distill.loss.DistillLoss`; the chunk's gradient is taken in the forward), all inside the
loss's `teacher_context` blocks: the seconds inside those blocks (the bench wraps the method on the loss
instance) over the step's; `shardlm_teacher_layers_ms` is the layers' part, between a forward pre-hook and a forward
hook on the teacher module. TRL's teacher is one forward per micro-batch, LM head included, timed by the same hooks
on its `teacher_model`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shardlm.bench.common import median_cell, steady, summary, torch_threads, uncached_datasets
from shardlm.bench.sft import SFT_BENCH, SFT_QUICK, SFTShape, ShardlmSteps, chat_data, load_documents, make_model_dir

BETA, TEMPERATURE, LR = 0.5, 1.0, 1e-4


@dataclass(frozen=True)
class DistillShape:
    """The student with its rows and steps (an `SFTShape`) and the teacher's sizes (an `SFTShape` whose rows and
    steps are not read)."""

    student: SFTShape
    teacher: SFTShape

    def describe_teacher(self) -> str:
        t = self.teacher
        return (f"teacher Qwen3 {t.num_layers} layers, hidden {t.hidden_size}, {t.num_heads} heads ({t.num_kv_heads} "
                f"KV) x {t.head_dim}, MLP {t.ffn_hidden_size}, tied embeddings, random init, fp32")


DISTILL_BENCH = DistillShape(
    student=replace(SFT_BENCH, seq_length=1024),
    teacher=replace(SFT_BENCH, num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64,
                    ffn_hidden_size=1536))
"""The `sft` section's student and steps on rows of 1024 tokens (half its rows): about three minutes on a 2-core
CPU; TRL's side holds a conversation's (T, V) logits several times over (0.6 GB each at T = 1024)."""
DISTILL_QUICK = DistillShape(
    student=replace(SFT_QUICK, seq_length=128, rows_per_step=1, steps=3, warmup_steps=1, records=200),
    teacher=replace(SFT_QUICK, num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                    ffn_hidden_size=256))
"""Rows of 128 tokens (the Dolly conversations among the first 200 that fit one), two pairs of steps: the
harness in well under a minute, not figures to quote."""


class TeacherClock:
    """Wall seconds spent in a teacher's work. Entries are forward calls of a module (`hook`) and blocks of a
    context manager (`wrap_context`), each under a label: `seconds` counts the outermost entries only (a forward
    inside a block is not counted twice), `label_seconds[label]` and `calls[label]` every entry of that label.
    `lap()` gives all of them since the previous lap."""

    def __init__(self):
        self.seconds, self.label_seconds, self.calls, self._starts = 0.0, {}, {}, []
        self._lapped: dict[str, float] = {}

    def hook(self, module: torch.nn.Module, label: str = "forward") -> TeacherClock:
        """Time `module`'s forward calls (a forward pre-hook and a forward hook)."""
        self.label_seconds.setdefault(label, 0.0)
        self.calls.setdefault(label, 0)
        module.register_forward_pre_hook(lambda *_: self._enter(label))
        module.register_forward_hook(lambda *_: self._leave(label))
        return self

    def wrap_context(self, owner, name: str, label: str) -> TeacherClock:
        """Time the blocks of `owner.name()`, a context manager factory, replaced on the instance `owner`."""
        original = getattr(owner, name)
        self.label_seconds.setdefault(label, 0.0)
        self.calls.setdefault(label, 0)

        @contextlib.contextmanager
        def timed(*args, **kwargs):
            self._enter(label)
            try:
                with original(*args, **kwargs):
                    yield
            finally:
                self._leave(label)

        setattr(owner, name, timed)
        return self

    def _enter(self, label: str) -> None:
        self.calls[label] += 1
        self._starts.append(time.perf_counter())

    def _leave(self, label: str) -> None:
        elapsed = time.perf_counter() - self._starts.pop()
        self.label_seconds[label] += elapsed
        if not self._starts:
            self.seconds += elapsed

    def totals(self) -> dict[str, float]:
        return {"seconds": self.seconds, **{f"{label}_seconds": s for label, s in self.label_seconds.items()},
                **{f"{label}_calls": n for label, n in self.calls.items()}}

    def lap(self) -> dict[str, float]:
        """{"seconds", "<label>_seconds", "<label>_calls"} since the previous `lap()` (or since the clock was made)."""
        now = self.totals()
        since = {key: value - self._lapped.get(key, 0) for key, value in now.items()}
        self._lapped = now
        return since


def trl_gkd_run(shape: DistillShape, student_dir: Path, teacher_dir: Path, conversations, out_dir: Path,
                threads: int, per_step: int, after_step: Callable[[], None]) -> dict:
    """TRL's GKDTrainer, offline, `per_step` conversations a step (one a micro-batch): per-step seconds between
    `on_step_end` callbacks (data loading included), real tokens, and the teacher's forward seconds and calls
    (`teacher`: a `TeacherClock.lap()` per step); `after_step()` runs at the end of every step, outside the clock."""
    import datasets
    import transformers
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.times, self.tokens, self.teacher = [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            teacher.lap()
            self.last, self.seen = time.perf_counter(), 0

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.last)
            self.tokens.append(state.num_input_tokens_seen - self.seen)
            self.teacher.append(teacher.lap())
            after_step()
            self.last, self.seen = time.perf_counter(), state.num_input_tokens_seen

    m = shape.student
    with uncached_datasets(), torch_threads(threads):
        load = dict(dtype=torch.float32, attn_implementation="sdpa")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(student_dir), **load)
        teacher_model = transformers.AutoModelForCausalLM.from_pretrained(str(teacher_dir), **load)
        args = GKDConfig(
            output_dir=str(out_dir), lmbda=0.0, seq_kd=False, beta=BETA, temperature=TEMPERATURE,
            max_length=m.seq_length, max_steps=m.steps, per_device_train_batch_size=1,
            gradient_accumulation_steps=per_step, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False, seed=0,
            dataloader_num_workers=0, dataloader_pin_memory=False, eval_strategy="no", save_strategy="no",
            report_to=[], logging_steps=10**6, disable_tqdm=True, include_num_input_tokens_seen="non_padding")
        clock = StepClock()
        dataset = datasets.Dataset.from_dict({"messages": [c.messages for c in conversations]})
        trainer = GKDTrainer(model=model, teacher_model=teacher_model, args=args, train_dataset=dataset,
                             processing_class=transformers.AutoTokenizer.from_pretrained(str(student_dir)),
                             callbacks=[clock])
        teacher = TeacherClock().hook(trainer.teacher_model)
        output = trainer.train()
    if not any(clock.tokens):
        raise RuntimeError("TRL counted no input tokens (state.num_input_tokens_seen stayed 0)")
    measured = steady(clock.times, clock.tokens, m.warmup_steps)
    return {**measured, "teacher": clock.teacher[m.warmup_steps:], "train_loss": output.training_loss,
            "gradient_checkpointing": bool(args.gradient_checkpointing)}


def conversations_per_row(docs, seq_length: int) -> float:
    """The mean number of conversations in a bfd-packed row of `seq_length` tokens."""
    from shardlm.sft.packing import PackedRows

    return len(docs) / PackedRows(docs, seq_length, "bfd", seed=None).stats.rows


def distill_bench(quick: bool, data_dir: Path | None = None, threads: int = 2) -> dict:
    """The `distill` section of `make bench`."""
    shape = DISTILL_QUICK if quick else DISTILL_BENCH
    m = shape.student
    records_file, tokenizer_dir = chat_data(data_dir)
    conversations, docs = load_documents(m, records_file, tokenizer_dir)
    per_step = max(1, round(m.rows_per_step * conversations_per_row(docs, m.seq_length)))
    with tempfile.TemporaryDirectory(prefix="shardlm-distill-bench-") as folder:
        folder = Path(folder)
        student_dir, vocab = make_model_dir(m, tokenizer_dir, folder / "student")
        teacher_dir, _ = make_model_dir(replace(shape.teacher, seq_length=m.seq_length), tokenizer_dir,
                                        folder / "teacher")
        records = folder / "records.jsonl"
        records.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in conversations))
        ours = ShardlmSteps(m, student_dir, records, folder / "shardlm", threads,
                            extra=[f"distill.teacher={json.dumps(str(teacher_dir))}", f"distill.beta={BETA}",
                                   f"distill.temperature={TEMPERATURE}", "train.micro_batch_size=1",
                                   f"train.lr={LR}", f"train.min_lr={LR}", 'train.decay_style="constant"',
                                   "train.warmup_steps=0", "train.weight_decay=0.0", "train.clip_grad=1.0"])
        # the teacher's layers are a module call of the loss; its output layer runs in the divergence's chunks, and
        # again in their recomputation in the backward, inside the loss's `teacher_context` blocks
        teacher = TeacherClock().hook(ours.trainer.teacher).wrap_context(ours.trainer.loss, "teacher_context",
                                                                          "context")
        laps = []

        def shardlm_step():
            teacher.lap()
            ours.step()
            laps.append(teacher.lap())

        theirs = trl_gkd_run(shape, student_dir, teacher_dir, conversations, folder / "trl", threads, per_step,
                             after_step=shardlm_step)
    mine = steady(ours.times, ours.tokens, m.warmup_steps)
    teachers = {"shardlm": laps[m.warmup_steps:], "trl": theirs["teacher"]}
    steps_s = {"shardlm": mine["step_s"], "trl": theirs["step_s"]}
    rates = {"shardlm": [n / t for n, t in zip(mine["tokens"], mine["step_s"])],
             "trl": [n / t for n, t in zip(theirs["tokens"], theirs["step_s"])]}
    return {
        "config": f"student {m.describe(vocab)}; {shape.describe_teacher()}; generalized JSD beta {BETA:g} at "
                  f"temperature {TEMPERATURE:g}, {threads} threads, {len(conversations)} Dolly conversations; TRL "
                  f"{per_step} conversations a step, one a micro-batch, shardlm {m.rows_per_step} bfd row(s) of "
                  f"{m.seq_length} tokens a step, one a micro-batch",
        "pairs": len(rates["trl"]),
        "trl_conversations_per_step": per_step,
        "trl_gradient_checkpointing": theirs["gradient_checkpointing"],
        "shardlm_tokens_per_sec": summary(rates["shardlm"]), "trl_tokens_per_sec": summary(rates["trl"]),
        "shardlm_step_ms": summary([t * 1e3 for t in mine["step_s"]]),
        "trl_step_ms": summary([t * 1e3 for t in theirs["step_s"]]),
        "shardlm_real_tokens_per_step": summary(mine["tokens"]), "trl_real_tokens_per_step": summary(theirs["tokens"]),
        "ratio": summary([a / b for a, b in zip(rates["shardlm"], rates["trl"])]),
        "ratio_of_totals": mine["tokens_per_sec"] / theirs["tokens_per_sec"],
        **{f"{name}_teacher_ms": summary([lap["seconds"] * 1e3 for lap in laps]) for name, laps in teachers.items()},
        **{f"{name}_teacher_share": summary([lap["seconds"] / t for lap, t in zip(laps, steps_s[name])])
           for name, laps in teachers.items()},
        **{f"{name}_teacher_forward_calls": [lap["forward_calls"] for lap in laps] for name, laps in teachers.items()},
        "shardlm_teacher_layers_ms": summary([lap["forward_seconds"] * 1e3 for lap in teachers["shardlm"]]),
        "shardlm_teacher_blocks": [lap["context_calls"] for lap in teachers["shardlm"]],
        "shardlm_losses": ours.losses, "trl_train_loss": theirs["train_loss"],
    }


def markdown_lines(r: dict) -> list[str]:
    """The `distill` section of BENCHMARKS.md."""
    lines = ["## Knowledge distillation (`distill`)", "",
             f"{r['config']}. TRL's `GKDTrainer` as shipped, offline (`lmbda=0`, `seq_kd=False`: the dataset's "
             "answers, no generation; gradient checkpointing "
             f"{'on, its default' if r['trl_gradient_checkpointing'] else 'off'}), against shardlm's `[distill]` on "
             f"packed `[sft]` rows. The two take turns, one optimizer step each; {r['pairs']} pairs of steps after "
             "the warm-up; tokens/s counts real (non-padding) tokens.", "",
             "| trainer | real tokens/s | step ms | real tokens per step | teacher ms | teacher share |",
             "|---|---|---|---|---|---|"]
    for name, label in (("shardlm", "shardlm (`train` with `[sft]` and `[distill]`)"),
                        ("trl", "TRL `GKDTrainer`")):
        lines.append(f"| {label} | {median_cell(r[f'{name}_tokens_per_sec'], digits=0)} | "
                     f"{median_cell(r[f'{name}_step_ms'], digits=0)} | "
                     f"{median_cell(r[f'{name}_real_tokens_per_step'], digits=0)} | "
                     f"{median_cell(r[f'{name}_teacher_ms'], digits=0)} | {median_cell(r[f'{name}_teacher_share'])} |")
    lines += ["", f"**shardlm / TRL tokens/s (`distill.ratio`, per pair of steps): {median_cell(r['ratio'])}** "
              f"(goal 1.5); total tokens over total seconds: {r['ratio_of_totals']:.2f}.", "",
              "The teacher's share (`distill.shardlm_teacher_share`, `distill.trl_teacher_share`): the seconds of a "
              "step spent in the teacher, over the step's. shardlm's: inside the loss's `teacher_context` blocks "
              "(timed by a wrapper of that method on the loss): the teacher's layers (a module call; "
              f"{median_cell(r['shardlm_teacher_layers_ms'], digits=0)} ms of it, between a forward pre-hook and a "
              "forward hook) and its output layer once in each chunk of the divergence "
              f"({r['shardlm_teacher_blocks']} blocks in the measured steps, "
              f"{r['shardlm_teacher_forward_calls']} forward calls). TRL's: its `teacher_model`'s forward, LM head "
              f"included, between the same hooks ({r['trl_teacher_forward_calls']} calls, one a conversation).", ""]
    return lines
