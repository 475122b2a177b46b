"""Multi-turn rollouts with tools and environments (`shardlm.rl.agent`, `shardlm.rl.environments`) give the
one-process answer at every layout.

The replies are fixed by (round, sequence, turn) (`ScriptedReplies`), written in a byte-level toy chat format
(`ByteTemplate`: one token a character, the end-of-turn id closing each message) that the Hermes parser reads: some
sequences answer at once, some call the tool `double` and then their environment's `remember` (a second round of
results), some call `double` with an argument it refuses (a failure) or an unknown tool, and some replies after the
results run out of room (truncated). Each sequence has its environment (`Ledger`), reset before each sampling on the
main rank (its observation appended to the prompt, whose ids every rank receives), whose `get_reward` is a reward of
its own. The tools run on the main rank and their results reach every rank; each rank continues its own share of the
sequences that called; the results' tokens are in the packed rows without labels. DAPO with the KL to the starting
weights, two iterations a round (the old log-probabilities of a scoring pass) and masked truncation, 4 steps (2
rounds), packed into 8 rows of 256 tokens: the loss, gradient norm, KL, entropy, clip ratios, rewards (the
environment's too) and tool metrics, and every final parameter on every rank, within 1e-5 of one process at DP=2,
TP=2 with SP, PP=2, CP=2 (a sequence's tool results split over the CP ranks), and TP=2 x DP=2 and CP=2 x PP=2 on
four ranks. The rows really hold tool results (masked tokens inside the sequences), and a reply's tokens stop at the
room each sequence has left (`test_each_reply_stops_at_its_room`, which also samples with per-sequence limits at
TP=2, PP=2 and CP=2: each row's tokens the one-process run's, a limited row the first tokens of the unlimited one).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_moe_parallel import stage_parameters

from shardlm.eval.generate import SamplingConfig
from shardlm.parallel import ParallelContext
from shardlm.rl.agent import ToolLoop
from shardlm.rl.environments import Environments
from shardlm.rl.loop import RLRun
from shardlm.rl.prompts import Prompt
from shardlm.rl.rewards import Reward
from shardlm.rl.rollout import InProcessGenerator, Rollout, gather_samples, sampling_share
from shardlm.rl.tools import CallFormat, Tool
from shardlm.training.reference import ReferenceWeights
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank
from layouts import layout, layout_config, layout_context, spawn_layouts, tiny_model
from multiproc import check_result

VOCAB, SEQ, STEPS, GROUP, MAX, TOL = 130, 256, 4, 4, 200, 1e-5


def letters(i: int) -> str:
    return "".join(map(chr, np.random.default_rng(i).integers(97, 123, 3 + i)))


EOD = VOCAB - 1
COLUMNS = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "reward", "rewards/Ledger/mean", "completions/mean_length", "tools/call_frequency",
           "tools/failure_frequency")
PROMPTS = [Prompt([], [{"role": "user", "content": letters(i)}],
                  {"index": i}) for i in range(4)]
"""Their ids are rendered after each sampling's environment reset (`Environments.start`)."""


def double(n: int) -> int:
    """Double a number.

    Args:
        n: The number.
    """
    if n > 6:
        raise ValueError("too large")
    return 2 * n


class Ledger:
    """The sequences' environment: the numbers the policy asked it to remember."""

    def __init__(self):
        self.entries = []

    def reset(self, prompt, index, **columns) -> str:
        self.entries = []
        return f" ({index})"

    def remember(self, n: int) -> str:
        """Remember a number.

        Args:
            n: The number.
        """
        self.entries.append(n)
        return f"{len(self.entries)} kept"

    def get_reward(self) -> float:
        return 0.1 * sum(self.entries)


class ByteTemplate:
    """A toy chat format over one token a character (ids below 128), each message `<role>content` closed by the
    end-of-turn id EOD (the character NUL), an assistant's calls written as Hermes <tool_call>{json}</tool_call>
    blocks; the prompts end with the assistant's opening "<a>"."""

    name, end_ids, end_of_turn, response_template = "byte template", frozenset({EOD}), "\0", None

    class tokenizer:  # noqa: N801 - as `ChatTemplate.tokenizer`
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(chr(i) if i < 128 else "" if skip_special_tokens else "\0" for i in ids)

    @staticmethod
    def encode(text: str) -> list[int]:
        return [EOD if c == "\0" else ord(c) for c in text]

    @staticmethod
    def render(messages, add_generation_prompt=False, tools=None) -> str:
        calls = ["".join(call(c["function"]["name"], **c["function"]["arguments"]) for c in m.get("tool_calls", []))
                 for m in messages]
        text = "".join(f"<{m['role'][0]}>{m['content']}{c}\0" for m, c in zip(messages, calls))
        return text + ("<a>" if add_generation_prompt else "")


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def script(round_index: int, j: int) -> list[str]:
    """Sequence j's replies in a round (each closed by the end-of-turn id unless it ends in "~": cut at the room)."""
    kind, n = (j + round_index) % 5, j % 8
    return [["answer " * (1 + n % 3)],
            [call("double", n=n), f"it is {2 * n}"],
            ["go " + call("double", n=n % 4), call("remember", n=n % 3 + 1), "done"],  # the environment's tool too
            [call("nope"), "x" * 150 + "~"],  # an unknown tool, then a reply too long for the room: truncated
            [call("double", n=n + 7), "failed"]][kind]  # refused by the tool


class ScriptedReplies:
    """Replies fixed by (round, sequence, turn) (`script`), cut to each sequence's room (`limits`)."""

    def generate(self, prompts, seeds, round_index=0, sequences=None, limits=None, turn=0):
        out = []
        for row, (prompt, j) in enumerate(zip(prompts, sequences)):
            text = script(round_index, j)[turn]
            ids = ByteTemplate.encode(text[:-1] if text.endswith("~") else text + "\0")
            ids = ids[:MAX if limits is None else limits[row]]
            out.append(Rollout(prompt, ids, [float("nan")] * len(ids), not ids or ids[-1] != EOD))
        return out


def tool_reward(prompts, completions, **columns):
    """Half a point a tool result, plus the last message's length over 40."""
    return [0.5 * sum(m["role"] == "tool" for m in c) + len(c[-1]["content"]) / 40 for c in completions]


def tools_config(micro: int = 2, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False):
    sections = {"sft": {"data": ["unused.jsonl"]},
                "rl": {"loss": "dapo", "num_generations": GROUP, "prompts_per_step": 2, "max_completion_length": MAX,
                       "beta": 0.04, "epsilon": 0.02, "epsilon_high": 0.03, "num_iterations": 2,
                       "mask_truncated_completions": True, "temperature": 0.9, "max_tool_calling_iterations": 3}}
    model = tiny_model("llama", SEQ, layers=2, num_kv_heads=2, vocab_size=VOCAB)
    return layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, sp=sp, sections=sections,
                         steps=STEPS, global_batch_size=8)


def train_layout(ctx, config) -> dict:
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, None, None)
    r = config.rl
    tools = [Tool("test:double", double)]
    environments = Environments("test_rl_tools_layouts:Ledger", tools, ByteTemplate, ctx)
    loop = ToolLoop(tools, CallFormat.of(ByteTemplate, environments.schemas), {EOD}, r.max_tool_calling_iterations,
                    MAX, SEQ, ctx, environments.tools_of)
    rewards = [Reward("tool_reward", tool_reward, 1.0), environments.reward()]
    run = RLRun(trainer, PROMPTS, ByteTemplate, ScriptedReplies(), rewards, 0, ReferenceWeights.of(trainer),
                agent=loop, environments=environments)
    curve, untrained = [], 0
    for _ in range(STEPS):
        metrics = run.train_step()
        curve.append(tuple(metrics[k] for k in COLUMNS))
        f = run.rows.fields
        untrained += int(((f["sequence"] >= 0) & (f["labels"] == -100)).sum())
    return {"curve": curve, "params": stage_parameters(trainer.model), "untrained": untrained}


def prompt_ids(i: int) -> list[int]:
    return ByteTemplate.encode(ByteTemplate.render(PROMPTS[i].prompt, add_generation_prompt=True))


def sampler(ctx, config) -> InProcessGenerator:
    """The starting weights' (init std 0.3) sampler at `config`'s layout: at most 12 tokens, temperature 0.9,
    top-k 50."""
    config.model.init_std = 0.3
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, None, None)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=50)
    return InProcessGenerator(trainer.model, ctx, sampling, EOD, lockstep=ctx.world_size > 1,
                              pipeline=trainer.pipeline)


def sample_layout(ctx, config) -> dict:
    """Rollouts of 8 sequences by `sampler`, each with its own limit (0 to 9 tokens)."""
    generator = sampler(ctx, config)
    share = sampling_share(8, ctx)
    limits = [(3 * j) % 10 for j in range(8)]
    local = generator.generate([prompt_ids(j % 4) for j in share], [100 + j for j in share], 0, share,
                               limits=[limits[j] for j in share], turn=1)
    gathered = gather_samples(local, ctx)
    return {"tokens": [r.completion for r in gathered], "logps": [r.logps for r in gathered], "limits": limits}


def run_layout(tp: int, pp: int, cp: int, ep: int, sample: bool = False, **config) -> dict:
    ctx = layout_context(tp, pp, cp, ep)
    config = tools_config(tp=tp, pp=pp, cp=cp, **config)
    return sample_layout(ctx, config) if sample else train_layout(ctx, config)


WORLD2 = {"dp2": layout(), "tp2 sp": layout(tp=2, sp=True), "pp2": layout(pp=2), "cp2": layout(cp=2),
          "sample tp2 sp": layout(tp=2, sp=True, sample=True), "sample pp2": layout(pp=2, sample=True),
          "sample cp2": layout(cp=2, sample=True)}
WORLD4 = {"tp2 dp2": layout(tp=2), "cp2 pp2": layout(cp=2, pp=2)}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def reference():
    return train_layout(ParallelContext.single(), tools_config())


SAME_RUN = {"steps": STEPS, "tol": TOL, "columns": COLUMNS,
            "absolute": ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                         "tools/call_frequency", "tools/failure_frequency")}


def test_the_rows_hold_untrained_tool_results(reference):
    """The reference run called tools (some failing), appended their results and trained around them, and clipped."""
    curve = dict(zip(COLUMNS, np.array(reference["curve"]).max(axis=0)))
    assert curve["tools/call_frequency"] > 0.5 and curve["tools/failure_frequency"] > 0.1, curve
    assert curve["clip_ratio/region_mean"] > 0, curve
    assert reference["untrained"] > 8 * STEPS * 10, reference["untrained"]  # beyond each sequence's prompt


@pytest.mark.parametrize("name", [n for n in WORLD2 if not n.startswith("sample")])
def test_tools_at_two_ranks_equal_one_process(world2, reference, name):
    values = assert_every_rank(world2, name, reference, **SAME_RUN)
    assert all(v["untrained"] == reference["untrained"] for v in values)


@pytest.mark.parametrize("name", list(WORLD4))
def test_tools_at_four_ranks_equal_one_process(world4, reference, name):
    assert_every_rank(world4, name, reference, **SAME_RUN)


@pytest.mark.parametrize("name", [n for n in WORLD2 if n.startswith("sample")])
def test_each_reply_stops_at_its_room(world2, name):
    """Sampling with a limit for each sequence: every layout's tokens are one process's (log-probabilities within
    TOL), each row has at most its limit, and a limited row's tokens are the first ones of the same sequence
    sampled with the whole room (its own seed: the limit changes nothing before it)."""
    ctx = ParallelContext.single()
    ref = sample_layout(ctx, tools_config())
    unlimited = sampler(ctx, tools_config()).generate([prompt_ids(j % 4) for j in range(8)],
                                                      [100 + j for j in range(8)], 0, list(range(8)))
    for tokens, limit, full in zip(ref["tokens"], ref["limits"], unlimited):
        assert len(tokens) <= limit and tokens == full.completion[:len(tokens)], (tokens, limit, full.completion)
        assert len(tokens) == min(limit, len(full.completion))
    assert any(len(t) < len(f.completion) for t, f in zip(ref["tokens"], unlimited))  # some stopped at their limit
    for rank, value in enumerate(check_result(world2, name)):
        assert value["tokens"] == ref["tokens"], f"{name} rank {rank}"
        for got, want in zip(value["logps"], ref["logps"]):
            assert np.allclose(got, want, rtol=0, atol=TOL), f"{name} rank {rank}"
