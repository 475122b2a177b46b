"""A verifiable task made on the spot from a seed: short arithmetic problems with integer answers.

A record is `{"prompt": "Compute 23 + 48. Answer with the number only.", "answer": "71"}`, the shape the
built-in "math" reward reads (`shardlm.rl.rewards.math_answer`). Difficulties:

- `small`: a sum or a difference of two numbers below 20, never negative ("Compute 13 + 6. ..."): 610 distinct
  problems, learnt by a tiny model in a minute (the warm-up of `scripts/rl_demo.py`, `make demo-rl`).
- `easy`: a sum or a difference of two numbers below 50, never negative ("Compute 41 - 17. ...").
- `medium`: one of, equally often, an easy problem, a product of a one-digit and a one- or two-digit
  number ("Compute 7 * 23. ..."), or a sum of three numbers below 50 ("Compute 12 + 30 + 7. ...").

The same `(count, seed, difficulty)` always gives the same records (`random.Random(seed)`); problems may
repeat within a set, and sets of different seeds may share problems.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardlm.errors import UserError

DIFFICULTIES = ("small", "easy", "medium")
PROMPT = "Compute {expression}. Answer with the number only."


def _two_terms(rng: random.Random, below: int = 50) -> tuple[str, int]:
    a, b = rng.randrange(below), rng.randrange(below)
    if rng.random() < 0.5:
        return f"{a} + {b}", a + b
    a, b = max(a, b), min(a, b)
    return f"{a} - {b}", a - b


def _small(rng: random.Random) -> tuple[str, int]:
    return _two_terms(rng, below=20)


def _product(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 99)
    if rng.random() < 0.5:
        a, b = b, a
    return f"{a} * {b}", a * b


def _three_terms(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randrange(50), rng.randrange(50), rng.randrange(50)
    return f"{a} + {b} + {c}", a + b + c


def _problems(count: int, seed: int, difficulty: str) -> list[tuple[str, int]]:
    """`count` pairs `(expression, value)`, e.g. `("23 + 48", 71)`."""
    if difficulty not in DIFFICULTIES:
        raise UserError(f"arithmetic difficulty {difficulty!r} is not known; use one of {', '.join(DIFFICULTIES)}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise UserError(f"arithmetic count {count!r} must be a whole number >= 0")
    rng = random.Random(seed)
    kinds = {"small": (_small,), "easy": (_two_terms,), "medium": (_two_terms, _product, _three_terms)}[difficulty]
    return [rng.choice(kinds)(rng) for _ in range(count)]


def _prompt(expression: str, conversational: bool) -> str | list[dict[str, str]]:
    text = PROMPT.format(expression=expression)
    return [{"role": "user", "content": text}] if conversational else text


def arithmetic_records(count: int, seed: int, difficulty: str = "easy",
                       conversational: bool = False) -> list[dict[str, Any]]:
    """`count` RL records `{"prompt": str, "answer": "<int>"}` (module docstring).

    `conversational`: the prompt as TRL's conversational form `[{"role": "user", "content": text}]` (so a
    rollout renders it with the chat template, as SFT renders its records) instead of the plain string.
    """
    return [{"prompt": _prompt(expression, conversational), "answer": str(value)}
            for expression, value in _problems(count, seed, difficulty)]


def arithmetic_sft_records(count: int, seed: int, difficulty: str = "easy",
                           conversational: bool = False) -> list[dict[str, Any]]:
    """The same `count` problems as `arithmetic_records(count, seed, difficulty)`, as SFT records
    `{"prompt": str, "completion": "<int>"}` for a warm-up that teaches a tiny model the task first.

    `shardlm.sft.records` reads two strings as one user turn and one assistant turn and renders them with the
    tokenizer's chat template, training only the completion; with `conversational`, prompt and completion are
    the equivalent message lists (`[{"role": "user", ...}]`, `[{"role": "assistant", ...}]`), read the same way.
    """
    records = []
    for expression, value in _problems(count, seed, difficulty):
        completion = [{"role": "assistant", "content": str(value)}] if conversational else str(value)
        records.append({"prompt": _prompt(expression, conversational), "completion": completion})
    return records


def write_records(path: str | Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write `records` as JSONL (one object a line) atomically: a temporary file in the same folder, then
    `os.replace`, so a reader never sees half a file. Creates the folder. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def write_arithmetic(path: str | Path, count: int, seed: int, difficulty: str = "easy", sft: bool = False,
                     conversational: bool = False) -> Path:
    """Write `arithmetic_records` (or, with `sft`, `arithmetic_sft_records`) to `path` as JSONL, atomically."""
    make = arithmetic_sft_records if sft else arithmetic_records
    return write_records(path, make(count, seed, difficulty, conversational=conversational))
