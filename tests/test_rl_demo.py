"""scripts/rl_demo.py (`make demo-rl`) end to end at toy sizes: the tokenizer, a 3-step SFT warm-up and a 3-step
GRPO run through `shardlm train`, the held-out figures before and after. Not the learning claim (that needs the
full run, docs/rl.md "Learning"): that the demo measures what it says it does."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rl_demo.py"
KEYS = {"model", "difficulty", "sft_steps", "rl_steps", "loss", "rollouts", "records", "held_out", "reward",
        "sft_loss", "samples", "held_out_reward", "held_out_accuracy", "prompt_accuracy", "examples", "wall_s", "cpu_s",
        "cpu", "cores", "threads", "reward_first5", "reward_last5"}
STEPS = 3


def demo():
    spec = importlib.util.spec_from_file_location("rl_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The demo at toy sizes: 200 SFT problems (a third of the 610), 16 RL prompts, 12 held out; 3 steps of each
    run, 2 prompts x 4 completions a round. The warm-up's learning rate is raised so that its greedy replies are
    digits already (they are all "1111"), which the accuracy checks below need."""
    out = tmp_path_factory.mktemp("rl_demo") / "demo"
    module = demo()
    sets = ["rl.prompts_per_step=2", "rl.num_generations=4", "train.global_batch_size=4",
            "train.micro_batch_size=4"]
    sft = ["train.global_batch_size=4", "train.micro_batch_size=4", "train.lr=3e-2", "train.warmup_steps=0"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = module.main([str(out), "--sft-steps", str(STEPS), "--rl-steps", str(STEPS), "--sft-records", "200",
                            "--prompts", "16", "--held-out", "12", *[a for s in sets for a in ("--set", s)],
                            *[a for s in sft for a in ("--sft-set", s)]])
    assert code == 0
    return module, out, json.loads((out / "rl_demo.json").read_text()), printed.getvalue()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def problems(records: list[dict]) -> set[str]:
    return {r["prompt"][0]["content"] for r in records}


@pytest.mark.timeout(120)
def test_the_demo_writes_its_curves_and_figure(run):
    """The JSON has its keys, a reward and an SFT loss at every step, the first-5 / last-5 means of that curve,
    times and the CPU; the PNG is written; the figures are printed."""
    _, out, summary, printed = run
    assert set(summary) == KEYS, set(summary) ^ KEYS
    assert [step for step, _ in summary["reward"]] == list(range(1, STEPS + 1)), summary["reward"]
    assert [step for step, _ in summary["sft_loss"]] == list(range(1, STEPS + 1)), summary["sft_loss"]
    rewards = [value for _, value in summary["reward"]]
    assert all(0 <= value <= 1 for value in rewards), rewards
    assert summary["reward_first5"] == pytest.approx(sum(rewards) / STEPS)
    assert summary["rl_steps"] == summary["sft_steps"] == STEPS and summary["loss"] == "dapo"
    assert summary["records"] == {"sft": 200, "prompts": 16, "held_out": 12}
    for key in ("wall_s", "cpu_s"):
        assert set(summary[key]) == {"sft", "rl", "evaluation", "total"} and summary[key]["total"] > 0
    assert summary["cpu"] and summary["threads"] == 1
    assert (out / "rl_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"first 5 steps {summary['reward_first5']:.3f}" in printed and "s CPU" in printed, printed


@pytest.mark.timeout(120)
def test_each_run_trains_on_its_own_problems_and_none_held_out(run):
    """The warm-up trained on sft.jsonl, the RL run on prompts.jsonl from the warm-up's weights (their checkpoints'
    configs say so), and no held-out problem is in either file; the RL run used the demo's tokenizer."""
    _, out, _, _ = run
    held_out = read_jsonl(out / "held_out.jsonl")
    assert len(problems(held_out)) == len(held_out) == 12
    for name in ("sft", "prompts"):
        assert not problems(read_jsonl(out / f"{name}.jsonl")) & problems(held_out), name
    for run_name, data in (("sft", "sft.jsonl"), ("rl", "prompts.jsonl")):
        latest = (out / run_name / "checkpoints" / "latest").read_text().strip()
        config = json.loads((out / run_name / "checkpoints" / latest / "meta.json").read_text())["config"]
        assert config["sft"]["data"] == [str(out / data)], config["sft"]
        assert config["sft"]["tokenizer"] == str(out / "tokenizer")
        assert config["rl"]["loss"] == ("" if run_name == "sft" else "dapo")
        assert config["checkpoint"]["init_from"] == ("" if run_name == "sft" else str(out / "sft" / "checkpoints"))


@pytest.mark.timeout(120)
def test_held_out_accuracy_is_the_math_reward_of_the_greedy_replies(run):
    """The accuracies are those of the held-out records' greedy replies (kept in "examples"): the same checkpoint
    scored against answers equal to its own replies is right on every record with a number, and against answers
    no reply gives, on none."""
    module, out, summary, _ = run
    held_out = read_jsonl(out / "held_out.jsonl")
    for when, run_name in (("before", "sft"), ("after", "rl")):
        replies = summary["examples"][when]
        assert [r["prompt"] for r in replies] == [r["prompt"][0]["content"] for r in held_out]
        right = [r["right"] for r in replies]
        assert summary["held_out_accuracy"][when] == pytest.approx(sum(right) / len(right)), replies
        checkpoints, tokenizer = out / run_name / "checkpoints", out / "tokenizer"
        own = [{**r, "answer": e["reply"].strip()} for r, e in zip(held_out, replies) if e["reply"].strip().isdigit()]
        assert own, replies
        model, template = module.loaded(checkpoints, tokenizer)
        assert module.scored(model, template, own, 4)[0] == 1.0, own
        wrong = [{**r, "answer": "123456"} for r in held_out]
        assert module.scored(model, template, wrong, 4)[0] == 0.0


@pytest.mark.timeout(120)
def test_the_sampled_reward_and_prompt_accuracy_are_the_math_rewards_they_name(run):
    """The held-out mean reward is `scored` at the RL run's temperature over seeds 0 .. samples - 1 (each seed's
    share recomputed here, one by one), and it is not the greedy figure's rerun; the prompt accuracy is the greedy
    share over the distinct RL prompts."""
    module, out, summary, _ = run
    held_out, prompts = read_jsonl(out / "held_out.jsonl"), read_jsonl(out / "prompts.jsonl")
    distinct = list({r["prompt"][0]["content"]: r for r in prompts}.values())
    assert summary["samples"] == 8 and 0 < len(distinct) <= len(prompts)
    for when, run_name in (("before", "sft"), ("after", "rl")):
        model, template = module.loaded(out / run_name / "checkpoints", out / "tokenizer")
        runs = [module.scored(model, template, held_out, 4, 1.0, seed) for seed in range(8)]
        assert summary["held_out_reward"][when] == pytest.approx(sum(share for share, _ in runs) / 8)
        assert len({tuple(e["reply"] for e in examples) for _, examples in runs}) > 1  # sampled: the seeds differ
        assert summary["prompt_accuracy"][when] == pytest.approx(module.scored(model, template, distinct, 4)[0])
