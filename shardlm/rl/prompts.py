"""An RL run's prompts: records of [sft]'s data (or the built-in task's), tokenized as TRL tokenizes them.

A record is `{"prompt": text or messages, ...}` (TRL's prompt-only formats): a text prompt is taken as it is, a
message list is rendered with the chat template and its generation prompt. The record's other keys (an `answer`,
a test case) are its columns, handed to the reward functions as keyword arguments. Every problem is a one-line
`UserError` starting with the record's `file:line`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardlm.errors import UserError
from shardlm.sft.records import check_messages, read_records
from shardlm.sft.template import ChatTemplate


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token `ids`, the `prompt` as the reward functions see it (text or messages), the record's
    other `columns` and `where` it came from (file:line)."""

    ids: list[int]
    prompt: Any
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def to_prompt(template: ChatTemplate, record: dict[str, Any], where: str, tools: list[dict] | None = None
              ) -> Prompt:
    """A tokenized `Prompt` of one record (module docstring); `tools`: the JSON schemas of rl.tools and
    rl.environment, rendered by the template into a conversational prompt (with them, even none, a text prompt is
    refused)."""
    prompt = record.get("prompt")
    if prompt in (None, "", []):
        raise UserError(f"{where}: the record has no 'prompt'; RL records need a 'prompt' (text or messages)")
    if isinstance(prompt, list):
        check_messages(prompt + [{"role": "assistant", "content": ""}], where)  # the turns the answer would follow
        ids = template.encode(template.render(prompt, add_generation_prompt=True, tools=tools or None))
    elif tools is not None:
        raise UserError(f"{where}: rl.tools and rl.environment need conversational prompts (a list of messages, which "
                        "the chat template renders with the tools); this one is text")
    elif isinstance(prompt, str):
        ids = template.encode(prompt)
    else:
        raise UserError(f"{where}: 'prompt' must be a string or a list of messages, not {type(prompt).__name__}")
    if not ids:
        raise UserError(f"{where}: the prompt tokenizes to no token; check the record")
    return Prompt(ids, prompt, {k: v for k, v in record.items() if k != "prompt"}, where)


def load_prompts(template: ChatTemplate, paths: Sequence[str | Path] = (), records: Sequence[dict] = (),
                 tools: list[dict] | None = None) -> list[Prompt]:
    """Every prompt of the JSONL / Parquet files `paths` (or of `records`, a built-in task's), tokenized (with the
    `tools`' schemas, rl.tools)."""
    prompts = [to_prompt(template, record, where, tools) for path in paths for record, where in read_records(path)]
    prompts += [to_prompt(template, record, f"task:{i + 1}", tools) for i, record in enumerate(records)]
    if not prompts:
        raise UserError(f"{', '.join(str(p) for p in paths) or 'the task'}: no prompts; the data is empty")
    return prompts


def hold_out(prompts: list[Prompt], count: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(the prompts to train on, the `count` held out for evaluation): a draw by `seed`, each part in the pool's
    order. UserError when nothing would be left to train on."""
    if count >= len(prompts):
        raise UserError(f"rl.eval_prompts={count} holds out every one of the {len(prompts)} prompts; lower it")
    held = set(np.random.default_rng([seed, 19]).permutation(len(prompts))[:count].tolist())
    return ([p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held])


def round_prompts(count: int, per_round: int, round_index: int, seed: int, shuffle: bool = True) -> list[int]:
    """The indices of generation round `round_index`'s `per_round` prompts among `count`: the prompts in an order
    shuffled by (seed, epoch), epoch after epoch (`shuffle` false, sft.shuffle's: the records' order, as TRL's
    `shuffle_dataset=False`), each round taking the next `per_round`."""
    first = round_index * per_round
    orders: dict[int, np.ndarray] = {}
    picked = []
    for position in range(first, first + per_round):
        epoch, within = divmod(position, count)
        if epoch not in orders:
            orders[epoch] = (np.random.default_rng([seed, 11, epoch]).permutation(count) if shuffle
                             else np.arange(count))
        picked.append(int(orders[epoch][within]))
    return picked
