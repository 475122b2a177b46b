"""`make demo-rl`: GRPO learns the built-in arithmetic task on a laptop CPU within minutes.

1. tokenizer: a task-sized tokenizer (printable ASCII characters, the six words of the task's prompt, a
   three-token chat template `<|user|>...<|end|><|assistant|>...<|end|>`), written with the `tokenizers`
   library to OUTPUT/tokenizer: 124 tokens instead of Qwen3's 151,936, so each answer digit is one token and a
   prompt 25 tokens;
2. data: disjoint arithmetic problems (`shardlm.rl.arithmetic`) for the SFT warm-up (OUTPUT/sft.jsonl), the RL
   prompts (OUTPUT/prompts.jsonl) and the held-out prompts (OUTPUT/held_out.jsonl), which neither run sees;
3. SFT: `shardlm train configs/grpo-tiny.toml` with the RL switched off (`rl.loss=""`) and the SFT records as
   `sft.data`: a short warm-up that stops at partial competence, so GRPO's groups are not all wrong;
4. RL: `shardlm train configs/grpo-tiny.toml checkpoint.init_from=OUTPUT/sft/checkpoints ...`: the [rl] section
   (DAPO) from the warm-up's weights, on the RL prompts;
5. before RL (the warm-up's weights) and after (the RL run's last checkpoint), each answer judged by the "math"
   reward: the held-out prompts' mean reward, `--samples` completions each sampled at the run's temperature (what
   RL maximizes, on prompts it never saw); their greedy accuracy; the greedy accuracy on the distinct RL prompts;
6. OUTPUT/rl_demo.json and OUTPUT/rl_demo.png: the mean reward of every RL step and the figures of 5; the figures
   are printed.

    python scripts/rl_demo.py runs/rl-demo
    python scripts/rl_demo.py /tmp/out --sft-steps 2 --rl-steps 2 --held-out 8   # a smoke run

The two runs go to OUTPUT/sft and OUTPUT/rl (replaced on each call). One torch thread by default (--threads).
`shardlm train configs/grpo-tiny.toml` repeats step 4 once `make demo-rl` has written runs/rl-demo.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import string
import sys
import time
from pathlib import Path

import torch

from shardlm.bench.common import machine
from shardlm.cli import main as shardlm
from shardlm.rl.arithmetic import DIFFICULTIES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo-tiny.toml"
SPECIAL = ("<|pad|>", "<|user|>", "<|assistant|>", "<|end|>")
TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
WORDS = ("Compute", "Answer", "with", "the", "number", "only")  # shardlm.rl.arithmetic.PROMPT
# The warm-up's settings on top of configs/grpo-tiny.toml (rl.loss="" turns the RL off): 64 problems a step
SFT_SETTINGS = ("train.global_batch_size=32", "train.micro_batch_size=32", "train.lr=3e-3", "train.min_lr=3e-4",
                "train.warmup_steps=20", "sft.valid_fraction=0", "train.eval_interval=0")
SEEDS = {"sft": 1, "prompts": 2, "held_out": 3}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="folder for the tokenizer, the data, both runs, rl_demo.json "
                                                  "and the PNG")
    parser.add_argument("--sft-steps", type=int, default=400, help="steps of the SFT warm-up")
    parser.add_argument("--rl-steps", type=int, default=None, help="the RL run's train.steps (default: "
                                                                   "configs/grpo-tiny.toml's)")
    parser.add_argument("--difficulty", default="small", choices=DIFFICULTIES,
                        help="arithmetic difficulty of every set (shardlm.rl.arithmetic)")
    parser.add_argument("--sft-records", type=int, default=2000, help="problems of the warm-up")
    parser.add_argument("--prompts", type=int, default=1000, help="RL prompts (drawn with repeats from the problems "
                                                                  "not held out)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out prompts, none trained on")
    parser.add_argument("--samples", type=int, default=8, help="completions sampled for each held-out prompt")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both runs (repeatable)")
    parser.add_argument("--sft-set", dest="sft_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the warm-up only (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    return parser.parse_args(argv)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_tokenizer(folder: Path) -> Path:
    """A task-sized Hugging Face tokenizer directory: one token per printable ASCII character, the words of the
    task's prompt (`WORDS`) as one token each, the special tokens of `SPECIAL`, `TEMPLATE` as the chat template,
    `<|end|>` ending a turn. Built with `tokenizers`: a BPE model over single characters whose merges spell out
    `WORDS` only (any other word stays in characters: nothing is lost), words split off by the pre-tokenizer, the
    tokens' concatenation as the decoder. Nothing is downloaded."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    characters = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable + newline
    merges = [(word[:i], word[i]) for word in WORDS for i in range(1, len(word))]
    tokens = [*SPECIAL, *characters, *dict.fromkeys(a + b for a, b in merges)]
    bpe = models.BPE({token: i for i, token in enumerate(tokens)}, merges)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z]+|[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|end|>", "pad_token": "<|pad|>",
              "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def problem_sets(count: dict[str, int], difficulty: str) -> dict[str, list[dict]]:
    """{"sft": SFT records, "prompts": RL records, "held_out": RL records}, conversational, each set seeded by
    `SEEDS`; no problem of "held_out" is in the other two, and "held_out" has no repeats."""
    from shardlm.rl.arithmetic import arithmetic_records, arithmetic_sft_records

    held_out, seen = [], set()
    for record in arithmetic_records(20 * count["held_out"], SEEDS["held_out"], difficulty, conversational=True):
        if record["prompt"][0]["content"] not in seen and len(held_out) < count["held_out"]:
            seen.add(record["prompt"][0]["content"])
            held_out.append(record)
    if len(held_out) < count["held_out"]:
        raise SystemExit(f"rl_demo: {difficulty} arithmetic has fewer than {count['held_out']} distinct problems")

    def fresh(records: list[dict], size: int) -> list[dict]:
        kept = [r for r in records if r["prompt"][0]["content"] not in seen][:size]
        if len(kept) < size:
            raise SystemExit(f"rl_demo: too few {difficulty} problems outside the held-out set")
        return kept

    return {"sft": fresh(arithmetic_sft_records(4 * count["sft"], SEEDS["sft"], difficulty, conversational=True),
                         count["sft"]),
            "prompts": fresh(arithmetic_records(4 * count["prompts"], SEEDS["prompts"], difficulty,
                                                conversational=True), count["prompts"]),
            "held_out": held_out}


def train(run_dir: Path, overrides: list[str]) -> dict:
    """`shardlm train configs/grpo-tiny.toml --run-dir RUN_DIR OVERRIDES` in this process, from scratch; returns
    its wall and CPU seconds and its metrics.jsonl records."""
    shutil.rmtree(run_dir, ignore_errors=True)  # an old checkpoint there would be resumed, not trained again
    wall, cpu = time.perf_counter(), cpu_seconds()
    code = shardlm(["train", str(CONFIG), "--run-dir", str(run_dir), *overrides])
    if code:
        raise SystemExit(f"rl_demo: shardlm train {run_dir.name} failed (exit code {code})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu, "metrics": records}


def scored(model, template, records: list[dict], max_new_tokens: int, temperature: float = 0.0,
           seed: int = 0) -> tuple[float, list]:
    """(the share of `records` whose reply the "math" reward scores 1, each record's `{"prompt", "answer", "reply",
    "right"}`): the replies of `generate_chat` (what `shardlm generate --chat` runs; greedy at temperature 0) in
    one batch."""
    from shardlm.eval.chat import generate_chat
    from shardlm.eval.generate import SamplingConfig
    from shardlm.rl.rewards import math_answer

    replies = generate_chat(model, template, [r["prompt"] for r in records],
                            SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed))
    scores = math_answer([r["prompt"] for r in records], [g.text for g in replies],
                         answer=[r["answer"] for r in records])
    examples = [{"prompt": r["prompt"][0]["content"], "answer": r["answer"], "reply": g.text, "right": s == 1.0}
                for r, g, s in zip(records, replies, scores)]
    return sum(scores) / len(records), examples


def loaded(checkpoints: Path, tokenizer: Path):
    """(the checkpoint's model on one process, the tokenizer's chat template)."""
    from shardlm.checkpoint.init import load_model
    from shardlm.parallel import ParallelContext
    from shardlm.sft.template import ChatTemplate

    return load_model(checkpoints, ParallelContext.single())[0], ChatTemplate.from_dir(tokenizer)


def evaluate(checkpoints: Path, tokenizer: Path, sets: dict, max_new_tokens: int, temperature: float,
             samples: int) -> dict:
    """One checkpoint's figures: "reward", the mean "math" reward of `samples` completions of each held-out prompt
    at `temperature` (seeds 0 .. samples - 1); "greedy", (the held-out greedy accuracy, its examples); "prompts",
    the greedy accuracy on the distinct RL prompts."""
    model, template = loaded(checkpoints, tokenizer)
    held_out = sets["held_out"]
    rewards = [scored(model, template, held_out, max_new_tokens, temperature, seed)[0] for seed in range(samples)]
    distinct = list({r["prompt"][0]["content"]: r for r in sets["prompts"]}.values())
    return {"reward": sum(rewards) / samples, "greedy": scored(model, template, held_out, max_new_tokens),
            "prompts": scored(model, template, distinct, max_new_tokens)[0]}


def plot(summary: dict, path: Path) -> None:
    """The mean reward of every RL step (and its running mean) with the held-out figures before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4), dpi=100)
    steps, rewards = zip(*summary["reward"])
    axes.plot(steps, rewards, color="tab:blue", alpha=0.35, linewidth=1, label="mean reward of the step's rollouts")
    window = max(1, len(rewards) // 10)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    axes.plot(steps, smooth, color="tab:blue", linewidth=2, label=f"its running mean ({window} steps)")
    sampled, held = summary["held_out_reward"], summary["held_out_accuracy"]
    axes.plot([0, steps[-1]], [sampled["before"], sampled["after"]], "o-", color="tab:green",
              label=f"held-out mean reward, sampled: {sampled['before']:.2f} -> {sampled['after']:.2f}")
    axes.plot([0, steps[-1]], [held["before"], held["after"]], "s--", color="tab:orange",
              label=f"held-out accuracy, greedy: {held['before']:.2f} -> {held['after']:.2f}")
    axes.set_xlabel("RL step")
    axes.set_ylabel("reward (1: right answer) / accuracy")
    axes.set_ylim(-0.02, 1.02)
    axes.set_title(f"{summary['loss']} on {summary['difficulty']} arithmetic after {summary['sft_steps']} SFT steps: "
                   f"{summary['model']}\n{summary['held_out']} held-out prompts; {summary['wall_s']['total']:.0f} s "
                   f"on {summary['threads']} thread(s) of {summary['cpu']}", fontsize=8)
    axes.legend(fontsize=8, loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def summarize(args: argparse.Namespace, config, sets: dict, runs: dict, figures: dict) -> dict:
    """rl_demo.json's content: the settings, every RL step's mean reward, the SFT loss curve, before and after RL the
    held-out sampled reward, greedy accuracy and replies and the RL prompts' greedy accuracy, the runs' wall and CPU
    seconds and the machine."""
    rl_metrics = [r for r in runs["rl"]["metrics"] if "reward" in r]
    m, r = config.model, config.rl
    summary = {
        "model": f"{m.num_layers} layers x hidden {m.hidden_size}, a {m.vocab_size}-token vocabulary",
        "difficulty": args.difficulty, "sft_steps": args.sft_steps, "rl_steps": len(rl_metrics),
        "loss": r.loss, "rollouts": f"{r.num_generations} completions x {r.prompts_per_step} prompts a round, "
                                    f"{r.num_iterations} step(s) each, temperature {r.temperature:g}",
        "records": {name: len(records) for name, records in sets.items()}, "held_out": len(sets["held_out"]),
        "reward": [[rec["step"], rec["reward"]] for rec in rl_metrics],
        "sft_loss": [[rec["step"], rec["loss"]] for rec in runs["sft"]["metrics"] if "loss" in rec],
        "samples": args.samples,
        "held_out_reward": {when: f["reward"] for when, f in figures.items()},
        "held_out_accuracy": {when: f["greedy"][0] for when, f in figures.items()},
        "prompt_accuracy": {when: f["prompts"] for when, f in figures.items()},
        "examples": {when: f["greedy"][1] for when, f in figures.items()},
        "wall_s": {name: run["wall_s"] for name, run in runs.items()},
        "cpu_s": {name: run["cpu_s"] for name, run in runs.items()},
        "cpu": machine()["cpu"], "cores": os.cpu_count(), "threads": torch.get_num_threads(),
    }
    rewards = [value for _, value in summary["reward"]]
    k = min(5, len(rewards))
    summary["reward_first5"], summary["reward_last5"] = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start_wall, start_cpu = time.perf_counter(), cpu_seconds()
    from shardlm.config import load_config
    from shardlm.rl.arithmetic import write_records
    from shardlm.sft.template import ChatTemplate

    tokenizer = write_tokenizer(out / "tokenizer")
    sets = problem_sets({"sft": args.sft_records, "prompts": args.prompts, "held_out": args.held_out},
                        args.difficulty)
    paths = {name: write_records(out / f"{name}.jsonl", records) for name, records in sets.items()}
    common = [*args.overrides, f'sft.tokenizer="{tokenizer}"', "log.progress=false", "log.plot=false",
              "log.tensorboard=false", "log.interval=1"]
    rl_overrides = [*common, f'checkpoint.init_from="{out / "sft" / "checkpoints"}"', 'rl.task=""',
                    f'sft.data=["{paths["prompts"]}"]', *([f"train.steps={args.rl_steps}"] if args.rl_steps else [])]
    config = load_config(CONFIG, [*rl_overrides, 'checkpoint.init_from=""'])
    config.model.vocab_size = ChatTemplate.from_dir(tokenizer).tokenizer.get_vocab_size()
    runs = {"sft": train(out / "sft", [*common, 'rl.loss=""', 'rl.task=""', 'checkpoint.init_from=""',
                                       f'sft.data=["{paths["sft"]}"]', f"train.steps={args.sft_steps}",
                                       *SFT_SETTINGS, *args.sft_overrides])}
    runs["rl"] = train(out / "rl", rl_overrides)
    wall, cpu = time.perf_counter(), cpu_seconds()
    length, temperature = config.rl.max_completion_length, config.rl.temperature
    figures = {when: evaluate(out / run / "checkpoints", tokenizer, sets, length, temperature, args.samples)
               for when, run in (("before", "sft"), ("after", "rl"))}
    runs["evaluation"] = {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu}
    runs["total"] = {"wall_s": time.perf_counter() - start_wall, "cpu_s": cpu_seconds() - start_cpu}
    summary = summarize(args, config, sets, runs, figures)
    (out / "rl_demo.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "rl_demo.png")
    report(summary, out)
    return 0


def report(summary: dict, out: Path) -> None:
    """The figures, as docs/rl.md quotes them."""
    held = summary["held_out_accuracy"]
    print(f"rl_demo: {summary['model']}; {summary['sft_steps']} SFT steps on {summary['records']['sft']} "
          f"{summary['difficulty']} problems, then {summary['rl_steps']} {summary['loss']} steps "
          f"({summary['rollouts']}) on {summary['records']['prompts']} prompts")
    print(f"rl_demo: mean reward, first 5 steps {summary['reward_first5']:.3f}, last 5 steps "
          f"{summary['reward_last5']:.3f}")
    sampled, own = summary["held_out_reward"], summary["prompt_accuracy"]
    print(f"rl_demo: held-out mean reward ({summary['samples']} completions sampled for each of {summary['held_out']} "
          f"prompts trained on by neither run): {sampled['before']:.3f} before RL, {sampled['after']:.3f} after")
    print(f"rl_demo: held-out accuracy (greedy): {held['before']:.3f} before RL, {held['after']:.3f} after")
    print(f"rl_demo: accuracy on the RL prompts (greedy): {own['before']:.3f} before RL, {own['after']:.3f} after")
    wall, cpu = summary["wall_s"], summary["cpu_s"]
    print(f"rl_demo: {wall['total']:.0f} s wall, {cpu['total']:.0f} s CPU (SFT {cpu['sft']:.0f}, RL {cpu['rl']:.0f}, "
          f"evaluation {cpu['evaluation']:.0f}) on {summary['cores']} x {summary['cpu']}, {summary['threads']} torch "
          "threads")
    print(f"rl_demo: {out / 'rl_demo.json'}, {out / 'rl_demo.png'}")


if __name__ == "__main__":
    sys.exit(main())
