"""Multi-turn rollouts with tools (rl.tools) against TRL's `GRPOTrainer(tools=...)` (1.16), step by step.

A random two-layer Qwen3 with the real vocabulary and Qwen3's chat template (which renders the tools' schemas into the
system turn and a call as <tool_call>{json}</tool_call>) is saved beside the shared tokenizer. Both trainers get the
same two tools, `add` and `spell` below, the same 2 conversational prompts and the same replies: each of the G = 4
sequences of a prompt follows a script of replies (SCRIPTS), tokenized as Qwen3 writes them, the reply after the k-th
round of tool results being its k-th. TRL's generation is replaced by a subclass's `_generate_single_turn`, which
finds each sequence by its prompt and first reply and answers with its next reply (TRL cuts it to the completion's
room); shardlm reads the replies from `rl.completions` with their `"turn"`. Between the replies each trainer parses
the calls, runs the tools and appends the rendered results itself: a call and its answer, two calls in one reply, an
unknown tool and a tool that raises (failures), a malformed call (plain text, no call), a result too long for the
completion's room (dropped: the sequence ends), a reply truncated at rl.max_completion_length, two rounds of tools,
and rl.max_tool_calling_iterations = 1 stopping the second. A third case adds TRL's `environment_factory` (`Counter`,
shardlm's rl.environment; its own ENV_SCRIPTS): one instance a sequence, reset with the record's columns (its
observation appended to the prompt), its `increment` method a tool on its own state (a refused call among them), its
`get_reward` a reward of its own, and a reward function reading `environments=`.

Checked, for each case: every sequence's completion ids and its tool mask (the tool results' tokens untrained) equal
TRL's, token for token; every step's loss, gradient norm, KL, entropy, clip ratios, rewards (the reward functions read
the completions as messages: the replies' contents, their tool calls, the tool results; and the environments),
completion lengths (the policy's tokens only) and TRL's tools/call_frequency and tools/failure_frequency within
TOL = 1e-5 (measured: at most 7.3e-7, a gradient norm; the environment's rewards 1.6e-7), as test_rl_trl.py's
comparisons (absolute below 1, relative above). The control: without the tool mask (every
completion token trained) shardlm misses TRL's numbers by far more than TOL.
"""

from __future__ import annotations

import json

import pytest
import torch
from chat_cache import template_parsed_once  # noqa: F401 (parses the chat template once per module)
from llama_reference import tiny_qwen3_policy
from test_rl_trl import ADAM_EPS, LR, SEED, TEMPERATURE, TOL, same_training
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")
transformers = import_or_skip("transformers")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.rl import agent  # noqa: E402
from shardlm.rl.prompts import round_prompts  # noqa: E402
from shardlm.sft.template import ChatTemplate  # noqa: E402
from shardlm.training.run import train  # noqa: E402

G, STEPS, MAX_COMPLETION, SEQ, ROWS, MICRO = 4, 2, 64, 400, 8, 4


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    if a < 0 or b < 0:
        raise ValueError("negative numbers are not supported")
    return a + b


def spell(n: int) -> str:
    """Spell a number out.

    Args:
        n: The number.
    """
    return " ".join(["many"] * n)


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


PROMPTS = [
    {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"},
    {"prompt": [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 6 x 7?"}],
     "answer": "42"},
]
LONG = "Seven is the answer here, since three and four more make seven when we count them all one by one. " * 2
# Each prompt's G sequences: their replies in order (True: finished, the end-of-turn id follows; False: truncated)
SCRIPTS = [
    [[(call("add", a=3, b=4), True), ("The answer is 7.", True)],
     [("7", True)],
     [(call("add", a=3, b=4) + "\n" + call("add", a=-1, b=2), True), ("Seven", True)],  # two calls, one raises
     [(call("nope"), True), (LONG, False)]],  # an unknown tool, then a reply cut at the completion's end
    [[(call("add", a=6, b=36), True), ("Almost. " + call("add", a=40, b=2), True), ("42", True)],  # two rounds
     [(call("spell", n=60), True)],  # a result too long for the room left: the sequence ends here
     [("Let me add.\n" + call("add", a=40, b=2), True), ("42.", True)],
     [('<tool_call>\n{"name": "add", "arguments": {"a": 6</tool_call>', True)]],  # malformed: plain text
]


ENV_SCRIPTS = [
    [[(call("increment", by=3) + "\n" + call("increment", by=4), True), ("7", True)],  # two calls on one state
     [("7", True)],
     [(call("increment", by=-1), True), ("No.", True)],  # refused by the environment
     [(call("increment", by=7), True), (call("add", a=1, b=2), True), ("done", True)]],  # then a plain tool
    [[(call("increment", by=40), True), (call("increment", by=2), True), ("42", True)],
     [(call("increment", by=42), True), ("42", True)],
     [(call("nope"), True), ("?", True)],
     [("42", True)]],
]


class Counter:
    """An environment (TRL's environment_factory): a counter the policy raises toward the record's answer."""

    def __init__(self):
        self.total, self.target = 0, 0

    def reset(self, answer, **kwargs) -> str:
        self.total, self.target = 0, int(answer)
        return f" Reach {answer}."

    def increment(self, by: int) -> int:
        """Raise the counter.

        Args:
            by: How much.
        """
        if by < 0:
            raise ValueError("the counter only goes up")
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else -abs(self.total - self.target) / 10


def counter_state(completions, environments, **kwargs) -> list[float]:
    """A reward reading the environments: a tenth of each counter's total."""
    return [0.1 * environment.total for environment in environments]


def tool_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """The answer in the last message's content, 0.3 a tool result, 0.2 a reply with tool calls, 0.05 a word of the
    replies' contents: rewards that read every part of the messages."""
    values = []
    for messages, expected in zip(completions, answer):
        replies = [m for m in messages if m["role"] == "assistant"]
        words = sum(len(m["content"].split()) for m in replies)
        values.append(float(expected in messages[-1]["content"]) + 0.3 * sum(m["role"] == "tool" for m in messages)
                      + 0.2 * sum(bool(m.get("tool_calls")) for m in replies) + 0.05 * words)
    return values


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    """The tiny Qwen3 directory, the prompts and the replies (completions.jsonl: every sequence's every reply, by
    round, sequence and turn); "replies": [prompt][k][turn] reply ids; "first": (prompt, first reply) -> k."""
    root = tmp_path_factory.mktemp("rl_tools_trl")
    tiny_qwen3_policy(root / "hf", data_dir, SEQ, hidden=64, head_dim=16)
    template = ChatTemplate.from_dir(root / "hf")
    eos = template.tokenizer.token_to_id("<|im_end|>")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    replies = {}
    for name, scripts in (("completions", SCRIPTS), ("completions_env", ENV_SCRIPTS)):
        replies[name] = [[[template.encode(text) + ([eos] if finished else []) for text, finished in script]
                          for script in group] for group in scripts]
        lines = []
        for r in range(STEPS):
            owners = round_prompts(len(PROMPTS), len(PROMPTS), r, SEED)
            lines += [json.dumps({"step": r, "sequence": j, "turn": turn, "ids": ids}) for j in range(len(owners) * G)
                      for turn, ids in enumerate(replies[name][owners[j // G]][j % G])]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return {"root": root, "hf": root / "hf", "replies": replies,
            "tokenizer": transformers.AutoTokenizer.from_pretrained(root / "hf")}


def replies_of(case: dict) -> str:
    return "completions_env" if case.get("environment") else "completions"


def prompt_index(messages: list[dict]) -> int:
    """Which of PROMPTS `messages` is (an environment's observation may follow its last message's text)."""
    return next(i for i, p in enumerate(PROMPTS) if messages[-1]["content"].startswith(p["prompt"][-1]["content"])
                and len(messages) == len(p["prompt"]))


def trl_run(setup, name: str, case: dict) -> tuple[list[dict], list[dict]]:
    """(TRL's logged steps, each round's sequences as {"completion": ids, "mask": tool mask}) for `case`."""
    from transformers import AutoModelForCausalLM

    replies, seen = setup["replies"][replies_of(case)], []
    prompt_ids = {}  # a prompt's token ids -> its index, learnt from TRL's first turn

    class ScriptedReplies(trl.GRPOTrainer):
        turns: dict = {}

        def _generate_single_turn(self, prompt_ids_list, *args, **kwargs):
            out = []
            for ids in prompt_ids_list:
                ids = tuple(ids)
                i = next((i for p, i in prompt_ids.items() if ids[:len(p)] == p), None)
                if i is None:  # a first turn: the next sequence of this prompt's group
                    i = prompt_index(self._prompt_of[ids])
                    prompt_ids[ids] = i
                p = next(p for p, j in prompt_ids.items() if j == i)
                rest = ids[len(p):]
                if not rest:
                    k = self.turns.setdefault(("next", i), 0)
                    self.turns[("next", i)] = (k + 1) % G
                    out.append(list(replies[i][k][0]))
                    continue
                k = next(k for k in range(G) if rest[:len(replies[i][k][0])] == tuple(replies[i][k][0]))
                turn = self.turns[(i, k)] = self.turns.get((i, k), 0) + 1
                out.append(list(replies[i][k][turn]))
            return out, None

        def _tool_call_loop(self, *args):
            result = super()._tool_call_loop(*args)
            seen.append([{"completion": list(c), "mask": list(m)} for c, m in zip(result[2], result[0])])
            return result

        def _tokenize_prompts(self, prompts):
            prompt_ids, images, fields = super()._tokenize_prompts(prompts)
            self._prompt_of = {tuple(ids): p for ids, p in zip(prompt_ids, prompts)}
            self.turns = {k: v for k, v in self.turns.items() if k[0] == "next"}  # a new round's replies
            return prompt_ids, images, fields

    args = trl.GRPOConfig(
        output_dir=str(setup["root"] / f"trl_{name}"), num_generations=G, per_device_train_batch_size=G * len(PROMPTS),
        gradient_accumulation_steps=1, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=ADAM_EPS, max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=SEED, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
        log_completions=False, beta=case.get("beta", 0.0), loss_type=case.get("loss", "grpo"),
        num_iterations=case.get("num_iterations", 1),
        mask_truncated_completions=case.get("mask_truncated_completions", False),
        max_tool_calling_iterations=case.get("max_tool_calling_iterations"))
    model = AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    with uncached_datasets():
        environment = {"environment_factory": Counter} if case.get("environment") else {}
        rewards = [tool_reward] + ([counter_state] if environment else [])
        trainer = ScriptedReplies(model=model, reward_funcs=rewards, args=args, tools=[add, spell],
                                  train_dataset=datasets.Dataset.from_list(PROMPTS),
                                  processing_class=setup["tokenizer"], **environment)
        trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log], seen


def shardlm_run(setup, name: str, case: dict, trained_tool_results: bool = False) -> tuple[list[dict], list[dict]]:
    """(shardlm's metrics.jsonl steps, each round's sequences as {"completion", "mask"}) for `case`;
    `trained_tool_results`: the control, every completion token trained (the tool mask dropped)."""
    seen = []
    run = agent.ToolLoop.run

    def recorded(self, *args):
        rollouts = run(self, *args)
        seen.append([{"completion": r.completion, "mask": r.mask} for r in rollouts])
        for r in rollouts if trained_tool_results else ():
            r.mask = None
        return rollouts

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(agent.ToolLoop, "run", recorded)
        steps = shardlm_train(setup, name, case)
    return steps, seen


def shardlm_train(setup, name: str, case: dict) -> list[dict]:
    rl = {"loss": f'"{case.get("loss", "grpo")}"', "beta": case.get("beta", 0.0),
          "num_iterations": case.get("num_iterations", 1),
          "mask_truncated_completions": str(case.get("mask_truncated_completions", False)).lower(),
          "max_tool_calling_iterations": case.get("max_tool_calling_iterations") or 0}
    overrides = [f"checkpoint.init_from={setup['hf']}", "checkpoint.save=false",
                 f"sft.data=[\"{setup['root'] / 'prompts.jsonl'}\"]", *(f"rl.{k}={v}" for k, v in rl.items()),
                 f"rl.num_generations={G}", f"rl.prompts_per_step={len(PROMPTS)}", f"rl.temperature={TEMPERATURE}",
                 f"rl.max_completion_length={MAX_COMPLETION}",
                 f"rl.completions=\"{setup['root'] / replies_of(case)}.jsonl\"",
                 'rl.rewards=["test_rl_tools_trl:tool_reward"' + (', "test_rl_tools_trl:counter_state"]'
                                                                 if case.get("environment") else "]"),
                 *(['rl.environment="test_rl_tools_trl:Counter"'] if case.get("environment") else []),
                 'rl.tools=["test_rl_tools_trl:add", "test_rl_tools_trl:spell"]',
                 f"model.seq_length={SEQ}", *same_training(STEPS, MICRO, ROWS)]
    run_dir = setup["root"] / f"shardlm_{name}"
    train(load_config(None, overrides), run_dir=run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"val_loss"' not in line]


CASES = {
    "grpo_kl_twice": {"beta": 0.04, "num_iterations": 2},
    "dapo_masked_one_round_of_tools": {"loss": "dapo", "mask_truncated_completions": True,
                                       "max_tool_calling_iterations": 1},
    "grpo_kl_environment": {"beta": 0.04, "environment": True},
}
METRICS = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
           "completions/max_length", "completions/clipped_ratio", "tools/call_frequency", "tools/failure_frequency",
           "rewards/Counter/mean", "rewards/Counter/std", "rewards/counter_state/mean")


def differences(ours: list[dict], theirs: list[dict]) -> dict:
    assert len(ours) == len(theirs) == STEPS, (ours, theirs)
    worst: dict = {}
    for mine, trls in zip(ours, theirs):
        for key in METRICS:
            if key in trls:
                gap = abs(mine[key] - trls[key]) / max(1.0, abs(trls[key])) if key in mine else float("inf")
                worst[key] = max(worst.get(key, 0.0), gap)
    return worst


def as_set(rounds: list[list[dict]]) -> list[list[tuple]]:
    """Each round's sequences, order aside (TRL's sampler orders them its own way)."""
    return [sorted((tuple(s["completion"]), tuple(s["mask"])) for s in sequences) for sequences in rounds]


@pytest.fixture(scope="module")
def trl_runs(setup):
    """`trl_runs(name)`: `trl_run` of CASES[name], once per module."""
    done: dict = {}

    def run(name: str):
        if name not in done:
            done[name] = trl_run(setup, name, CASES[name])
        return done[name]

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_tool_calling_follows_trl(setup, trl_runs, name):
    """The same multi-turn completions and tool masks as TRL's, and every step's metrics within TOL."""
    theirs, trl_rounds = trl_runs(name)
    ours, our_rounds = shardlm_run(setup, name, CASES[name])
    assert as_set(our_rounds) == as_set(trl_rounds)
    masks = [m for s in our_rounds[0] for m in s["mask"]]
    assert 0 in masks and 1 in masks  # tool results were appended (and left untrained)
    worst = differences(ours, theirs)
    assert {"tools/call_frequency", "tools/failure_frequency"} <= set(worst), worst
    assert theirs[0]["tools/failure_frequency"] > 0 and theirs[0]["tools/call_frequency"] > 0.5, theirs[0]
    assert all(value <= TOL for value in worst.values()), {k: v for k, v in worst.items() if v > TOL}


def test_training_the_tool_results_misses_trl(setup, trl_runs):
    """The control: the same run with the tool results' tokens trained (no tool mask) misses TRL's loss, gradient
    norm and completion lengths by far more than TOL, so the comparison above can fail."""
    theirs, _ = trl_runs("grpo_kl_twice")
    ours, _ = shardlm_run(setup, "trained_tool_results", CASES["grpo_kl_twice"], trained_tool_results=True)
    worst = differences(ours, theirs)
    assert min(worst["grad_norm"], worst["completions/mean_length"]) > 100 * TOL, worst
