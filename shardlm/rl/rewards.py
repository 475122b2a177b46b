"""Reward functions for online RL, called the way TRL's `GRPOTrainer` calls them.

A reward function is `fn(prompts, completions, completion_ids=None, **columns) -> list[float | None]`:
`prompts` and `completions` are lists of N items (strings for text records; for conversational records a prompt
is a message list and a completion is `[{"role": "assistant", "content": text}]`), `completion_ids` the N
completions' token ids, and each other column of the records a keyword argument holding a list of N values.
`None` means "this function does not judge this completion" and becomes NaN in `score`'s table. So any function
written for TRL (e.g. `def f(completions, **kwargs)`) works here unchanged; an `async def` one is awaited.

Rewards are named in a run's config: a built-in (`math`, `format`) or `module:function`, where `module` is an
importable dotted path (`pkg.mod:fn`) or a Python file (`path/to/rewards.py:fn`); or a trained reward model,
`model:PATH`, which every rank scores at the training layout (`shardlm.rl.reward_model`; its column of `score`'s
table is left NaN here and filled by the run).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from shardlm.errors import UserError
from shardlm.rl.reward_model import PREFIX as MODEL_PREFIX
from shardlm.rl.reward_model import open_reward_model

BUILTINS = ("math", "format")
FIXED_ARGUMENTS = ("prompt", "completion", "completion_ids")
"""Record columns never passed as keyword arguments (TRL drops the same ones)."""

# A number: an optional minus that does not follow a word or a closing bracket (so "8-3" ends in 3, not -3),
# then 1,234[.5] (thousands separators), 12[.5] or .5; then an optional "/denominator" (a fraction).
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(rf"(?<![A-Za-z0-9_.])(?:(?<![A-Za-z0-9_)\]}}])-)?{_UNSIGNED}(?:/\d+(?!\.\d))?")
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_RELATIVE_TOLERANCE = Fraction(1, 10**6)


@dataclass
class Reward:
    """One reward function of a run. `name`: as given in the config ("math", "format", "module:function" or
    "model:PATH"); `function`: called as TRL calls it (module docstring; None for a reward model); `weight`: its
    factor in the weighted sum of rewards; `model`: a reward model's path (empty for a function)."""

    name: str
    function: Callable[..., Any] | None
    weight: float
    model: str = ""


def completion_text(completion: Any) -> str:
    """The text of one completion: the string itself, or the last message's `content` of a message list."""
    if isinstance(completion, list):
        completion = completion[-1].get("content") if completion else ""
    return completion if isinstance(completion, str) else ""


def _to_fraction(token: str) -> Fraction | None:
    numerator, _, denominator = token.replace(",", "").partition("/")
    if denominator and int(denominator) == 0:
        return None
    return Fraction(numerator) / (int(denominator) if denominator else 1)


def numbers_in(text: str) -> list[Fraction]:
    """The numbers written in `text`, in order, as exact fractions ("-1,234.5" -> -2469/2, "3/4" and
    "\\frac{3}{4}" -> 3/4; a fraction over 0 is skipped)."""
    text = text.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    text = _LATEX_FRACTION.sub(r"\1/\2", text).replace("$", "")
    values = (_to_fraction(token) for token in _NUMBER.findall(text))
    return [value for value in values if value is not None]


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (braces balanced), or None when there is none or it
    is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def extract_answer(text: str) -> Fraction | None:
    """The number a text answers with, None if none: after the last "####" (GSM8K's answer line), the first
    number there; else the last `\\boxed{...}`'s last number; else the text's last number."""
    if "####" in text:
        found = numbers_in(text.rsplit("####", 1)[1])
        return found[0] if found else None
    boxed = last_boxed(text)
    found = numbers_in(boxed if boxed is not None else text)
    return found[-1] if found else None


def _reference(answer: Any) -> Fraction | None:
    if isinstance(answer, bool) or answer is None:
        return None
    if isinstance(answer, numbers.Integral):
        return Fraction(int(answer))
    if isinstance(answer, numbers.Real):
        return Fraction(repr(float(answer))) if math.isfinite(answer) else None
    return extract_answer(str(answer))


def same_number(a: Fraction, b: Fraction) -> bool:
    """Integers compare exactly; anything else within a relative 1e-6 of the larger magnitude."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return abs(a - b) <= _RELATIVE_TOLERANCE * max(abs(a), abs(b))


def math_answer(prompts: list, completions: list, answer: list | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 where the completion's answer (`extract_answer`: its "####" line, its last `\\boxed{}` or its last
    number) equals the record's `answer` column (a number, or a string: "42", "3/4", "\\boxed{42}", GSM8K's
    "... #### 42"), else 0.0.

    None for a completion whose record's answer is None or holds no number: this reward cannot judge it.
    Shapes: N prompts, N completions, N answers in; N values out. No `answer` column at all is a `UserError`.
    """
    if answer is None:
        raise UserError('the records have no "answer" column; the math reward compares each completion with it')
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = _reference(reference)
        if expected is None:
            scores.append(None)
            continue
        got = extract_answer(completion_text(completion))
        scores.append(1.0 if got is not None and same_number(got, expected) else 0.0)
    return scores


def format_reward(pattern: str) -> Callable[..., list[float]]:
    """A reward function giving 1.0 where the whole completion text matches `pattern` (`re.fullmatch`, with
    `re.DOTALL` so `.` crosses lines), else 0.0. A pattern that does not compile raises `re.error`."""
    compiled = re.compile(pattern, re.DOTALL)

    def format_match(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        return [1.0 if compiled.fullmatch(completion_text(c)) else 0.0 for c in completions]

    return format_match


def _import_module(name: str, module_path: str, option: str) -> Any:
    if not (module_path.endswith(".py") or "/" in module_path):
        return importlib.import_module(module_path)
    path = Path(module_path)
    if not path.is_file():
        raise UserError(f'{option}: "{name}" names the file {path}, which does not exist; '
                        "give the path of a .py file (relative to the working directory) or a module name")
    module_name = f"shardlm_reward_{path.stem}"
    loaded = sys.modules.get(module_name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded  # a second reward from the same file
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # a module's dataclasses and pickling look themselves up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_function(name: str, option: str = "rl.rewards") -> Callable[..., Any]:
    """The function `name` ("pkg.mod:fn" or "path/to/file.py:fn") names, for the config option `option` (a reward's
    signature checked too); one-line errors naming the option."""
    module_path, _, attribute = name.rpartition(":")
    if not module_path or not attribute:
        what, example = ((f"neither a built-in reward ({', '.join(BUILTINS)}) nor", "rewards:score")
                         if option == "rl.rewards" else ("not", "tools:search"))
        raise UserError(f'{option}: "{name}" is {what} module:function; write e.g. mypackage.{example} or '
                        f"path/to/{example.replace(':', '.py:')}")
    try:
        module = _import_module(name, module_path, option)
    except UserError:
        raise
    except Exception as exc:  # an import may fail with anything the module raises
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UserError(f'{option}: "{name}" does not import ({reason}); check the module path or PYTHONPATH') \
            from exc
    function = getattr(module, attribute, None)
    if function is None:
        raise UserError(f'{option}: "{name}": module {module_path} has no attribute {attribute!r}; '
                        "check the function's name")
    if not callable(function):
        raise UserError(f'{option}: "{name}" is a {type(function).__name__}, not a function; name a function')
    if option == "rl.rewards":
        _check_signature(name, function)
    return function


def _check_signature(name: str, function: Callable[..., Any]) -> None:
    """Fail now, not after the model is loaded, when `function` cannot take TRL's keyword arguments."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some C callables have no signature; calling them will tell
        return
    try:
        signature.bind_partial(prompts=[], completions=[], completion_ids=[])
    except TypeError as exc:
        raise UserError(f'rl.rewards: "{name}" cannot be called as a reward ({exc}); give it the signature '
                        "(prompts, completions, **kwargs)") from None


def load_rewards(names: list[str], weights: list[float] | None = None, format_pattern: str = "") -> list[Reward]:
    """The run's reward functions, imported and checked (cheap: call it before any expensive work).

    `names`: built-ins ("math", "format") or "module:function" ("pkg.mod:fn" or "path/to/file.py:fn").
    `weights`: one per name, or empty/None for 1.0 each. `format_pattern`: the regular expression of the
    "format" reward. Every problem is a one-line `UserError` naming the reward and the fix.
    """
    if not names:
        raise UserError('rl.rewards is empty; name at least one reward: "math", "format", module:function or '
                        'model:PATH')
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise UserError(f"rl.reward_weights has {len(weights)} values for {len(names)} rewards ({', '.join(names)}); "
                        "give one weight per reward, or none for 1.0 each")
    rewards = []
    for name, weight in zip(names, weights, strict=True):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise UserError(f'rl.reward_weights: the weight of "{name}" is {weight!r}; give a finite number')
        if name.startswith(MODEL_PREFIX):  # a reward model: checked now, loaded at the layout by the run
            open_reward_model(name[len(MODEL_PREFIX):])
            rewards.append(Reward(name=name, function=None, weight=float(weight), model=name[len(MODEL_PREFIX):]))
            continue
        if name == "math":
            function = math_answer
        elif name == "format":
            if not format_pattern:
                raise UserError('rl.rewards has "format" but rl.format_pattern is empty; set it to the regular '
                                'expression a whole completion must match, e.g. "<think>.*</think>.*"')
            try:
                function = format_reward(format_pattern)
            except re.error as exc:
                raise UserError(f"rl.format_pattern {format_pattern!r} is not a valid regular expression ({exc}); "
                                "fix the pattern") from None
        else:
            function = load_function(name)
        rewards.append(Reward(name=name, function=function, weight=float(weight)))
    return rewards


def reward_names(rewards: list[Reward]) -> list[str]:
    """Names to log under (`rewards/<name>/mean`, as TRL): a built-in's name, else the function's `__name__`
    (a `functools.partial` unwrapped; a callable object's class name)."""
    names = []
    for reward in rewards:
        if reward.name in BUILTINS:
            names.append(reward.name)
            continue
        if reward.model:  # as TRL names a reward model: its directory's name
            names.append(Path(reward.model).name)
            continue
        function = reward.function
        while isinstance(function, functools.partial):
            function = function.func
        names.append(getattr(function, "__name__", type(function).__name__))
    return names


def _call(reward: Reward, kwargs: dict[str, Any]) -> Any:
    try:
        result = settled(reward.function(**kwargs))
    except UserError as exc:
        raise UserError(f'reward "{reward.name}": {exc}') from exc
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        message = (str(exc).splitlines() or [""])[0]
        raise UserError(f'reward "{reward.name}" raised {type(exc).__name__}: {message} '
                        f"(at {frame.filename}:{frame.lineno})") from exc
    return result


def settled(result: Any) -> Any:
    """`result`, or what it resolves to when it is awaitable (an `async def` reward or tool's)."""
    return asyncio.run(_await(result)) if inspect.isawaitable(result) else result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _as_float(reward: Reward, value: Any, index: int) -> float:
    if value is None:
        return math.nan
    if not isinstance(value, (numbers.Real, np.bool_)):
        raise UserError(f'reward "{reward.name}" returned a {type(value).__name__} ({value!r:.40}) for completion '
                        f"{index}; each value must be a number or None")
    value = float(value)
    if math.isinf(value):
        raise UserError(f'reward "{reward.name}" returned {value} for completion {index}; rewards must be finite '
                        "(return None to leave a completion unjudged)")
    return value


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> np.ndarray:
    """Every reward function called once on all N completions: a float64 array (N, F), F = len(rewards),
    NaN where a function returned None.

    `prompts`, `completions`, `completion_ids`: N each. `columns`: the records' other columns, each a list
    of N values, passed as keyword arguments ("prompt", "completion" and "completion_ids" are left out).
    A function that raises or returns anything but N numbers/None is a one-line `UserError`.
    """
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n or any(len(v) != n for v in columns.values()):
        raise ValueError(f"score: {len(prompts)} prompts, {n} completions, {len(completion_ids)} completion_ids and "
                         f"columns of {sorted({len(v) for v in columns.values()})} values; all must be equal")
    kwargs = {key: value for key, value in columns.items() if key not in FIXED_ARGUMENTS}
    kwargs.update(prompts=prompts, completions=completions, completion_ids=completion_ids)
    table = np.empty((n, len(rewards)), dtype=np.float64)
    for j, reward in enumerate(rewards):
        if reward.model:  # scored by every rank at the layout (`shardlm.rl.reward_model`), filled by the run
            table[:, j] = np.nan
            continue
        values = _call(reward, kwargs)
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
            values = values.tolist()  # a numpy array or torch tensor, as TRL accepts
        if not isinstance(values, (list, tuple)):
            raise UserError(f'reward "{reward.name}" returned a {type(values).__name__}; return a list of '
                            f"{n} numbers (or None), one per completion")
        if len(values) != n:
            raise UserError(f'reward "{reward.name}" returned {len(values)} values for {n} completions; return one '
                            "per completion")
        table[:, j] = [_as_float(reward, value, i) for i, value in enumerate(values)]
    return table
