"""Multi-turn rollouts with tools (rl.tools), as TRL's GRPOTrainer runs its tool-calling loop.

After the policy's first reply to each prompt, every rank parses the replies (`tools.CallFormat.parse`: the same
messages everywhere). While some replies call tools, and at most rl.max_tool_calling_iterations times:

  1. the main rank runs the calls (a tool may have side effects: once, as the reward functions run) and hands
     the tool messages to every rank (a broadcast);
  2. each sequence that called appends the template's tokens of the results and of the next generation prompt
     (`tools.suffix_ids`) to its completion, unless the completion would then pass rl.max_completion_length or
     the sequence model.seq_length: that sequence stops with its reply as it is (its calls unanswered);
  3. the policy continues those sequences (prompt + completion so far as the prompt, each data x context-parallel
     rank its share, at most the completion's remaining tokens), each from a seed of its own for the turn;
  4. the new replies are parsed, and those that call tools go round again.

A completion is then every reply and tool result in order. The tool results' tokens are part of the sequence the
policy reads, but never trained: `Rollout.mask` is 0 on them (the rows give them no label), and the completion
lengths, the token means and the normalizers count the policy's own tokens only, as TRL's tool mask does. The reward
functions get each completion as its messages (assistant replies with their tool_calls, tool results). A sequence's
tokens depend only on its seeds and the tools' answers, never on the layout.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from shardlm.rl.rollout import Rollout
from shardlm.rl.tools import CallFormat, Tool, call_tools, suffix_ids


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a sequence's `turn`-th continuation after tool results (turn >= 1), from its own seed."""
    return int(np.random.SeedSequence([seed, turn, 3]).generate_state(1, np.uint64)[0] >> 1)


class ToolLoop:
    """The tool-calling loop of a run (module docstring). `continue_fn(prompts, seeds, limits, turn, sequences)`
    samples continuations at the layout and returns every rank's rollouts in order."""

    def __init__(self, tools: list[Tool], call_format: CallFormat, stops: set[int], max_iterations: int,
                 max_completion_length: int, seq_length: int, ctx, tools_of=None):
        self.tools = {tool.function_name: tool.function for tool in tools}
        self.tools_of = tools_of  # rl.environment: each sequence's own tools, by its position (main rank)
        self.format, self.template, self.stops, self.ctx = call_format, call_format.template, stops, ctx
        self.max_iterations = max_iterations or float("inf")
        self.max_completion_length, self.seq_length = max_completion_length, seq_length
        self.calls = self.failures = 0  # the last `run`'s, for the metrics

    def reply(self, ids: list[int], prefix: list[int]) -> dict:
        """The message of one reply's ids after the `prefix` ids (an empty reply: none)."""
        return self.format.parse(ids, prefix) if ids else {}

    def run(self, first: list[Rollout], seeds: list[int], sequences: list[int], continue_fn) -> list[Rollout]:
        """Every sequence's whole rollout, from its first reply `first` (every rank's, in order; `seeds` and
        `sequences` theirs)."""
        completions = [list(r.completion) for r in first]
        masks = [[1] * len(r.completion) for r in first]
        logps = [list(r.logps) for r in first]
        messages = [[m] if (m := self.reply(r.completion, r.prompt)) else [] for r in first]
        pending = [j for j, m in enumerate(messages) if m and m[-1].get("tool_calls")]
        self.calls = self.failures = 0
        turn = 0
        while pending and turn < self.max_iterations:
            turn += 1
            answers = self.answer([messages[j][-1]["tool_calls"] for j in pending], pending)
            going = []
            for j, tool_messages in zip(pending, answers):
                suffix = suffix_ids(self.template, tool_messages)
                grown = len(completions[j]) + len(suffix)
                if grown > self.max_completion_length or len(first[j].prompt) + grown >= self.seq_length:
                    continue  # the results do not fit: the sequence ends with its calls unanswered
                completions[j] += suffix
                masks[j] += [0] * len(suffix)
                logps[j] += [float("nan")] * len(suffix)
                messages[j] += tool_messages
                going.append(j)
            if not going:
                break
            more = continue_fn([first[j].prompt + completions[j] for j in going],
                               [turn_seed(seeds[j], turn) for j in going],
                               [self.max_completion_length - len(completions[j]) for j in going], turn,
                               [sequences[j] for j in going])
            pending = []
            for j, rollout in zip(going, more):
                message = self.reply(rollout.completion, first[j].prompt + completions[j])
                completions[j] += rollout.completion
                masks[j] += [1] * len(rollout.completion)
                logps[j] += rollout.logps
                if message:
                    messages[j].append(message)
                    if message.get("tool_calls"):
                        pending.append(j)
        return [Rollout(r.prompt, c, lp, not c or c[-1] not in self.stops, m, msg)
                for r, c, lp, m, msg in zip(first, completions, logps, masks, messages)]

    def answer(self, calls: list[list[dict]], sequences: list[int]) -> list[list[dict]]:
        """Each reply's tool messages (`sequences`: the replies' positions): run on the main rank, handed to every
        rank; counts the calls and failures."""
        result: list = [None]
        if self.ctx.rank == 0:
            answered = [call_tools(c, self.tools if self.tools_of is None else self.tools_of(j))
                        for c, j in zip(calls, sequences)]
            result = [([m for m, _ in answered], sum(f for _, f in answered))]
        if self.ctx.world_size > 1:
            dist.broadcast_object_list(result, src=0)
        tool_messages, failures = result[0]
        self.calls += sum(len(c) for c in calls)
        self.failures += failures
        return tool_messages
