"""`make demo-distill`: a distilled student learns its teacher faster than the same student fine-tuned alone.

1. teacher: configs/sft-teacher-tiny.toml (4 layers, hidden 128) fine-tuned briefly on the Dolly records
   (`shardlm train`);
2. student (a): configs/distill-tiny.toml (2 layers, hidden 64) distilled from that teacher ([distill], jsd);
3. student (b): the same config with `distill.teacher=""`, plain SFT: the same random init (train.seed), records,
   row order, steps and learning rates, only the loss differs;
4. every --eval-every steps, each student's checkpoint (and the shared init, step 0) is scored on the held-out
   conversations, which the teacher never trained on either, by one evaluator: a `Trainer` with the distillation
   config and the checkpoint's weights loaded, whose `evaluate()` is the distillation loss (`DistillLoss`) over
   their answer tokens, the same measure for both students; and by its cross-entropy on the records' own answers;
5. OUTPUT/distill_demo.json and OUTPUT/distill_demo.png: both divergence curves; the figures are printed.

    python scripts/distill_demo.py runs/distill-demo
    python scripts/distill_demo.py /tmp/out --teacher-steps 2 --student-steps 2 --eval-every 1   # a smoke run

The three runs go to OUTPUT/teacher, OUTPUT/distilled and OUTPUT/sft (replaced on each call); only each student's
last checkpoint is kept once scored. One torch thread by default (--threads): on 2 cores it took the least CPU time
(545 s for the whole demo against 742 s at two threads), and docs/distillation.md quotes that run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

from shardlm.bench.common import machine
from shardlm.cli import main as shardlm
from shardlm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TEACHER, STUDENT = ROOT / "configs" / "sft-teacher-tiny.toml", ROOT / "configs" / "distill-tiny.toml"
STUDENTS = ("distilled", "sft")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="folder for the three runs, distill_demo.json and the PNG")
    parser.add_argument("--teacher-steps", type=int, default=None, help="the teacher's train.steps (default: its "
                                                                        "config's)")
    parser.add_argument("--student-steps", type=int, default=None, help="each student's train.steps (default: "
                                                                        "configs/distill-tiny.toml's)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between two scored checkpoints")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for all three runs and the evaluators (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the least CPU time, as measured "
                                                               "in docs/distillation.md; 0: torch's default)")
    return parser.parse_args(argv)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def train(config: Path, run_dir: Path, overrides: list[str]) -> dict:
    """`shardlm train CONFIG --run-dir RUN_DIR OVERRIDES` in this process, from scratch; returns its wall and CPU
    seconds and its last validation loss (metrics.jsonl)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # an old checkpoint there would be resumed, not trained again
    wall, cpu = time.perf_counter(), cpu_seconds()
    code = shardlm(["train", str(config), "--run-dir", str(run_dir), *overrides])
    if code:
        raise SystemExit(f"distill_demo: shardlm train {config.name} failed (exit code {code})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val_loss"] for r in records if "val_loss" in r]
    return {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu,
            "val_loss": val_loss[-1] if val_loss else None}


def evaluator(config_path: Path, overrides: list[str]):
    """A one-process `Trainer` of `config_path` whose `evaluate()` covers the whole held-out set (the conversations
    [sft] holds out, packed into rows): with a [distill] teacher the validation divergence, without one the
    cross-entropy. Its weights are the run's init (the same train.seed) until a checkpoint is loaded."""
    from shardlm.parallel import ParallelContext
    from shardlm.sft.dataset import build_sft_datasets
    from shardlm.training.run import check_vocabulary
    from shardlm.training.trainer import Trainer

    config = load_config(config_path, overrides)
    data = build_sft_datasets(config.sft, config.model.seq_length, config.train.seed)
    check_vocabulary(config, data.template.tokenizer.get_vocab_size(), data.max_token_id)
    config.train.eval_iters = -(-len(data.valid) // config.train.micro_batch_size)  # every held-out row
    return Trainer(config, ParallelContext.single(), None, data.valid), data.valid_stats


def checkpoints(run_dir: Path) -> dict[int, Path]:
    """{step: directory} of a run's saved checkpoints."""
    return {int(path.name.split("_")[1]): path for path in sorted((run_dir / "checkpoints").glob("step_*"))}


def score(trainers: dict, path: Path | None) -> dict[str, float]:
    """{measure: value} of the weights in checkpoint `path` (None: the evaluators' own init)."""
    from shardlm.checkpoint.init import init_weights, open_source

    if path is not None:
        for trainer in trainers.values():
            init_weights(trainer, open_source(path))
    return {name: trainer.evaluate() for name, trainer in trainers.items()}


def prune(run_dir: Path) -> None:
    """Keep a run's last checkpoint only (each of the others holds the weights and both Adam moments)."""
    saved = checkpoints(run_dir)
    for step, path in saved.items():
        if step != max(saved):
            shutil.rmtree(path)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4), dpi=100)
    labels = {"distilled": "(a) distilled from the teacher (jsd)", "sft": "(b) SFT on the records' answers"}
    for name, color in zip(STUDENTS, ("tab:blue", "tab:orange")):
        steps, values = zip(*summary["curves"][name])
        axes.plot(steps, values, marker="o", markersize=3, color=color,
                  label=f"{labels[name]}: final {values[-1]:.3f}")
    axes.set_xlabel("student step")
    axes.set_ylabel("validation divergence from the teacher")
    teacher = summary["teacher"]
    axes.set_title(f"student {summary['student']}, teacher {teacher['model']} ({teacher['steps']} SFT steps)\n"
                   f"{summary['divergence']} on {summary['held_out']}", fontsize=8)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def describe(config) -> str:
    m = config.model
    return f"{m.num_layers} layers x hidden {m.hidden_size}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start_wall, start_cpu = time.perf_counter(), cpu_seconds()
    common = [*args.overrides, "log.progress=false", "log.plot=false", "log.tensorboard=false"]
    teacher = [*common, *([f"train.steps={args.teacher_steps}"] if args.teacher_steps else [])]
    student = [*common, f'distill.teacher="{out / "teacher" / "checkpoints"}"',
               *([f"train.steps={args.student_steps}"] if args.student_steps else [])]
    teacher_config, steps = load_config(TEACHER, teacher), load_config(STUDENT, student).train.steps
    saving = [f"checkpoint.save_interval={args.eval_every}", f"checkpoint.keep_last={steps // args.eval_every + 1}",
              "train.eval_interval=0"]  # scored from the checkpoints below, by the same evaluator
    runs = {"teacher": train(TEACHER, out / "teacher", teacher),
            "distilled": train(STUDENT, out / "distilled", [*student, *saving]),
            "sft": train(STUDENT, out / "sft", [*student, *saving, 'distill.teacher=""'])}
    wall, cpu = time.perf_counter(), cpu_seconds()
    divergence, held_out = evaluator(STUDENT, student)
    trainers = {"divergence": divergence, "cross_entropy": evaluator(STUDENT, [*student, 'distill.teacher=""'])[0]}
    init = score(trainers, None)  # step 0: both students' init
    scores = {name: {0: init, **{step: score(trainers, path) for step, path in checkpoints(out / name).items()}}
              for name in STUDENTS}
    for name in STUDENTS:
        prune(out / name)
    runs["evaluation"] = {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu}
    runs["total"] = {"wall_s": time.perf_counter() - start_wall, "cpu_s": cpu_seconds() - start_cpu}
    d = divergence.config.distill
    summary = {
        "teacher": {"model": describe(teacher_config), "steps": teacher_config.train.steps,
                    "val_loss": runs["teacher"]["val_loss"]},
        "student": describe(divergence.config), "steps": steps, "eval_every": args.eval_every,
        "divergence": f"{d.loss}, beta {d.beta:g}, temperature {d.temperature:g}",
        "held_out": f"{held_out.documents} held-out conversations, {held_out.targets} answer tokens",
        "curves": {name: [[step, s["divergence"]] for step, s in scores[name].items()] for name in STUDENTS},
        "cross_entropy": {name: [[step, s["cross_entropy"]] for step, s in scores[name].items()]
                          for name in STUDENTS},
        "distilled_run_val_loss": runs["distilled"]["val_loss"],
        "wall_s": {name: run["wall_s"] for name, run in runs.items()},
        "cpu_s": {name: run["cpu_s"] for name, run in runs.items()},
        "cpu": machine()["cpu"], "cores": os.cpu_count(), "threads": torch.get_num_threads(),
    }
    summary["distilled_passes_sft_final_at"] = next(
        (step for step, value in summary["curves"]["distilled"] if value <= summary["curves"]["sft"][-1][1]), None)
    (out / "distill_demo.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "distill_demo.png")
    report(summary, out)
    return 0


def report(summary: dict, out: Path) -> None:
    """The figures, as docs/distillation.md quotes them."""
    print(f"distill_demo: teacher {summary['teacher']['model']}, {summary['teacher']['steps']} SFT steps, held-out "
          f"cross-entropy {summary['teacher']['val_loss']:.3f}; students {summary['student']}, "
          f"{summary['steps']} steps each; {summary['held_out']}")
    print(f"distill_demo: validation divergence from the teacher ({summary['divergence']}) / held-out "
          "cross-entropy:")
    print("  step   (a) distilled          (b) SFT")
    ce = {name: dict(summary["cross_entropy"][name]) for name in STUDENTS}
    for (step, a), (_, b) in zip(summary["curves"]["distilled"], summary["curves"]["sft"]):
        print(f"  {step:>4}   {a:.4f} / {ce['distilled'][step]:6.3f}     {b:.4f} / {ce['sft'][step]:6.3f}")
    passed = summary["distilled_passes_sft_final_at"]
    print(f"distill_demo: (a) reaches (b)'s final divergence at step {passed} of {summary['steps']}"
          if passed is not None else "distill_demo: (a) never reaches (b)'s final divergence")
    wall, cpu = summary["wall_s"], summary["cpu_s"]
    print(f"distill_demo: {wall['total']:.0f} s wall, {cpu['total']:.0f} s CPU (teacher {cpu['teacher']:.0f}, "
          f"distilled {cpu['distilled']:.0f}, sft {cpu['sft']:.0f}, evaluation {cpu['evaluation']:.0f}) on "
          f"{summary['cores']} x {summary['cpu']}, {summary['threads']} torch threads")
    print(f"distill_demo: {out / 'distill_demo.json'}, {out / 'distill_demo.png'}")


if __name__ == "__main__":
    sys.exit(main())
