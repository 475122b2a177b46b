"""RL rewards: the math and format built-ins judge hand-written completions; load_rewards finds user functions
and fails in one line; score calls each function once, TRL-style; the arithmetic task's answers are right."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest

from shardlm.errors import UserError
from shardlm.rl.arithmetic import arithmetic_records, arithmetic_sft_records, write_arithmetic
from shardlm.rl.rewards import Reward, format_reward, load_rewards, math_answer, reward_names, score
from shardlm.sft.records import to_conversation


def judge(completion, answer):
    return math_answer(["p"], [completion], answer=[answer])[0]


@pytest.mark.parametrize("completion, answer, expected", [
    ("So the total is \\boxed{42}.", "42", 1.0),
    ("\\boxed{41} is wrong, it is 42", "42", 0.0),  # the boxed answer wins over a later number
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),  # 3/4 = 0.75 exactly
    ("\\boxed{{1}+{2}=3}", "3", 1.0),  # braces balanced: the box holds "{1}+{2}=3", whose last number is 3
    ("First 7, then 12, finally 19", "19", 1.0),
    ("First 7, then 12, finally 19", "12", 0.0),  # the last number, not any number
    ("It drops to -5 degrees", "-5", 1.0),
    ("8-3", "5", 0.0),  # "-3" after a digit is subtraction: last number 3
    ("8-3 = 5", "5", 1.0),
    ("so (3+5)-4", "4", 1.0),  # a minus after a closing bracket is subtraction too
    ("Ids 1,2345", "2345", 1.0),  # "1,2345" is no thousands number: 1 and 2345
    ("It costs $3.25", "3.25", 1.0),
    ("It costs 3.25", "3.2500001", 1.0),  # |3.25 - 3.2500001| / 3.2500001 = 3.1e-8 < 1e-6
    ("It costs 3.25", "3.2501", 0.0),  # relative gap 3.1e-5 > 1e-6
    ("They have 1,234 sheep", "1234", 1.0),
    ("They have 1,234,567 sheep", 1234567, 1.0),
    ("1000001", "1000000", 0.0),  # integers compare exactly, though within 1e-6 relative
    ("Half of 3/2 is 3/4", "0.75", 1.0),
    ("0.75", "3/4", 1.0),
    ("x = 12, as 1/0 is undefined", "12", 1.0),  # a fraction over 0 is no number
    ("The answer is 72.", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K: after "####"
    ("The answer is 24.", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 0.0),
    ("48/2 = 24\n#### 72\nCheck: 48 + 24 = 72 is 3 digits", "72", 1.0),  # the first number after "####"
    ("I do not know.", "42", 0.0),
    ("42", 42.0, 1.0),
    ("42", "\\boxed{42}", 1.0),
    ("42", None, None),
    ("42", "no number here", None),
    ([{"role": "assistant", "content": "\\boxed{9}"}], "9", 1.0),
    ([{"role": "assistant", "content": "9, I guess"}, {"role": "assistant", "content": "it is 8"}], "9", 0.0),
])
def test_math_answer(completion, answer, expected):
    assert judge(completion, answer) == expected


def test_math_answer_without_an_answer_column_is_a_user_error():
    with pytest.raises(UserError, match='no "answer" column'):
        math_answer(["p"], ["42"])


def test_format_reward():
    reward = format_reward(r"<think>.*</think>\s*\d+")
    completions = ["<think>7 and\n5</think> 12", "12", "<think>x</think> 12 extra", [{"content": "<think></think>3"}]]
    assert reward(prompts=[""] * 4, completions=completions) == [1.0, 0.0, 0.0, 1.0]


USER_MODULE = """
def length_score(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]

def level_bonus(completions, level, **kwargs):
    return [None if lv is None else lv * 0.5 for lv in level]

def crash(completions, **kwargs):
    return 1 / 0

def too_few(completions, **kwargs):
    return [1.0]

def text_values(completions, **kwargs):
    return ["good"] * len(completions)

def not_a_list(completions, **kwargs):
    return 3.0

def flags(completions, **kwargs):
    return [c == "yes" for c in completions]

def positional_only(prompts, completions):
    return [0.0] * len(completions)

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "my_rewards.py"
    for name in ("my_rewards", "shardlm_reward_my_rewards"):  # the next test's module is another file
        sys.modules.pop(name, None)


def one_line_error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        load_rewards(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_load_rewards_builtins_and_user_functions(user_module):
    rewards = load_rewards(["math", "format", "my_rewards:length_score", f"{user_module}:level_bonus"],
                           [1.0, 0.5, 2, -1], format_pattern=r"\d+")
    assert [r.name for r in rewards] == ["math", "format", "my_rewards:length_score", f"{user_module}:level_bonus"]
    assert [r.weight for r in rewards] == [1.0, 0.5, 2.0, -1.0]
    assert rewards[0].function is math_answer
    assert rewards[1].function(prompts=[""], completions=["12", "x"]) == [1.0, 0.0]
    assert reward_names(rewards) == ["math", "format", "length_score", "level_bonus"]
    assert [r.weight for r in load_rewards(["math", "math"], [])] == [1.0, 1.0]


def test_load_rewards_errors_are_one_line(user_module, tmp_path):
    assert "does not import (No module named 'no_such_module'); check the module path or PYTHONPATH" in \
        one_line_error(["no_such_module:score"])
    (tmp_path / "broken.py").write_text("raise RuntimeError('no config\\nset BROKEN_CONFIG')\n")
    assert 'rl.rewards: "broken:f" does not import (no config); check' in one_line_error(["broken:f"])
    assert "does not exist" in one_line_error([f"{tmp_path}/missing.py:f"])
    assert "has no attribute 'nope'" in one_line_error(["my_rewards:nope"])
    assert "is a int, not a function" in one_line_error(["my_rewards:NOT_CALLABLE"])
    assert "unexpected keyword argument 'completion_ids'" in one_line_error(["my_rewards:positional_only"])
    assert "neither a built-in reward" in one_line_error(["nonsense"])
    assert "is not a valid regular expression" in one_line_error(["format"], format_pattern="(unclosed")
    assert "rl.format_pattern is empty" in one_line_error(["format"])
    assert "has 1 values for 2 rewards" in one_line_error(["math", "my_rewards:flags"], [1.0])
    assert "give a finite number" in one_line_error(["math"], [math.inf])
    assert "rl.rewards is empty" in one_line_error([])


def score_one(name, completions=("a", "b", "c"), **columns):
    n = len(completions)
    rewards = load_rewards([name])
    return score(rewards, ["p"] * n, list(completions), [[1] * (i + 1) for i in range(n)], columns)


def one_line_score_error(name, **columns) -> str:
    with pytest.raises(UserError) as info:
        score_one(name, **columns)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_score_table_passes_columns_and_completion_ids(user_module):
    rewards = load_rewards(["math", "my_rewards:length_score", "my_rewards:level_bonus", "my_rewards:flags"],
                           [1, 1, 1, 1])
    completions = ["12", "yes", [{"role": "assistant", "content": "\\boxed{5}"}]]
    table = score(rewards, ["p"] * 3, completions, [[4, 5], [6], [7, 8, 9]],
                  {"answer": ["12", None, "6"], "level": [2, None, 4], "prompt": ["dropped"] * 3})
    assert table.dtype == np.float64 and table.shape == (3, 4)
    expected = np.array([[1.0, 2.0, 1.0, 0.0],  # math: 12 == 12; two ids; level 2 * 0.5; not "yes"
                         [np.nan, 1.0, np.nan, 1.0],  # no answer, no level -> NaN; bool True -> 1.0
                         [0.0, 3.0, 2.0, 0.0]])  # 5 != 6
    np.testing.assert_array_equal(table, expected)


def test_score_calls_each_function_once_with_all_completions():
    calls = []

    def counting(prompts, completions, completion_ids, **kwargs):
        calls.append((list(completions), completion_ids, sorted(kwargs)))
        return [0.0] * len(completions)

    score([Reward("counting", counting, 1.0)], ["p", "q"], ["a", "b"], [[1], [2, 3]], {"answer": ["1", "2"]})
    assert calls == [(["a", "b"], [[1], [2, 3]], ["answer"])]


def test_score_accepts_async_functions_and_arrays():
    async def judge_async(completions, **kwargs):
        return [0.25] * len(completions)

    def as_array(completions, **kwargs):
        return np.arange(len(completions), dtype=np.float32)

    rewards = [Reward("judge", judge_async, 1.0), Reward("array", as_array, 1.0)]
    np.testing.assert_array_equal(score(rewards, ["p"] * 2, ["a", "b"], [[1], [2]], {}), [[0.25, 0.0], [0.25, 1.0]])


def test_score_errors_are_one_line(user_module):
    crash = r'reward "my_rewards:crash" raised ZeroDivisionError: division by zero \(at .*my_rewards.py:9\)'
    assert re.fullmatch(crash, one_line_score_error("my_rewards:crash"))  # line 9 of USER_MODULE: 1 / 0
    assert one_line_score_error("my_rewards:too_few") == \
        'reward "my_rewards:too_few" returned 1 values for 3 completions; return one per completion'
    assert "returned a str ('good') for completion 0" in one_line_score_error("my_rewards:text_values")
    assert "returned a float; return a list of 3 numbers" in one_line_score_error("my_rewards:not_a_list")
    assert one_line_score_error("math").startswith('reward "math": the records have no "answer" column')


def expression_value(prompt: str) -> int:
    """The prompt's expression evaluated independently of the generator: only digits, spaces and + - *."""
    expression = re.fullmatch(r"Compute ([\d +*-]+)\. Answer with the number only\.", prompt).group(1)
    return eval(expression)  # safe: the pattern admits only integers and + - *


@pytest.mark.parametrize("difficulty", ["small", "easy", "medium"])
def test_arithmetic_records_are_deterministic_and_correct(difficulty):
    records = arithmetic_records(200, seed=3, difficulty=difficulty)
    assert records == arithmetic_records(200, seed=3, difficulty=difficulty)
    assert records != arithmetic_records(200, seed=4, difficulty=difficulty)
    values = [expression_value(r["prompt"]) for r in records]
    assert [r["answer"] for r in records] == [str(v) for v in values]
    assert min(values) >= 0
    assert math_answer([r["prompt"] for r in records], [r["answer"] for r in records],
                       answer=[r["answer"] for r in records]) == [1.0] * len(records)
    assert math_answer([r["prompt"] for r in records], [f"It is {v + 1}." for v in values],
                       answer=[r["answer"] for r in records]) == [0.0] * len(records)


def test_arithmetic_difficulties():
    easy = [expression_value(r["prompt"]) for r in arithmetic_records(300, seed=0)]
    assert max(easy) <= 98  # 49 + 49
    small = [r["prompt"].removesuffix(" Answer with the number only.") for r in arithmetic_records(9000, 0, "small")]
    operands = [int(n) for p in small for n in re.findall(r"\d+", p)]
    assert max(operands) == 19 and min(operands) == 0 and len(set(small)) == 610  # 20 x 20 sums, 210 differences
    assert {re.sub(r"\d+", "n", p) for p in small} == {"Compute n + n.", "Compute n - n."}
    # adding "small" left the other difficulties' problems as they were (the first three of seed 0 before it)
    assert [r["prompt"][8:-30] for r in arithmetic_records(3, 0)] == ["48 + 26", "25 - 19", "37 - 13"]
    assert [r["prompt"][8:-30] for r in arithmetic_records(3, 0, "medium")] == ["7 * 8", "31 + 25 + 19", "7 * 76"]
    medium = [r["prompt"].removesuffix(" Answer with the number only.") for r in arithmetic_records(300, 0, "medium")]
    assert {re.sub(r"\d+", "n", p) for p in medium} == {"Compute n + n.", "Compute n - n.", "Compute n * n.",
                                                        "Compute n + n + n."}
    with pytest.raises(UserError, match="'hard' is not known"):
        arithmetic_records(3, seed=0, difficulty="hard")


def test_arithmetic_sft_records_read_as_sft_conversations(tmp_path):
    rl, sft = arithmetic_records(20, seed=5), arithmetic_sft_records(20, seed=5)
    assert [(r["prompt"], r["answer"]) for r in rl] == [(s["prompt"], s["completion"]) for s in sft]
    for form in (sft, arithmetic_sft_records(20, seed=5, conversational=True)):
        conversation = to_conversation(form[0], "test:1")
        assert [m["role"] for m in conversation.messages] == ["user", "assistant"]
        assert conversation.messages[1]["content"] == rl[0]["answer"] and conversation.train_from == 1
    path = write_arithmetic(tmp_path / "sub" / "train.jsonl", 20, seed=5, difficulty="easy", sft=True)
    assert [json.loads(line) for line in path.read_text().splitlines()] == sft
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"]  # no temporary file left behind


def test_held_out_prompts_are_a_seeded_draw_apart_from_the_training_ones():
    """`hold_out` (rl.eval_prompts): `count` prompts drawn by the seed, the same draw each time and another under
    another seed, none of them trained on, each part in the pool's order; holding out every prompt is refused."""
    from shardlm.rl.prompts import Prompt, hold_out

    pool = [Prompt([i], f"prompt {i}") for i in range(20)]
    train, held = hold_out(pool, 5, seed=3)
    assert len(held) == 5 and len(train) == 15 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert [p.prompt for p in train + held] != [p.prompt for p in pool]  # a draw, not the last five
    assert train == sorted(train, key=pool.index) and held == sorted(held, key=pool.index)
    assert hold_out(pool, 5, seed=3) == (train, held) and hold_out(pool, 5, seed=4)[1] != held
    assert hold_out(pool, 0, seed=3) == (pool, [])
    with pytest.raises(UserError, match="rl.eval_prompts=20 holds out every one of the 20 prompts"):
        hold_out(pool, 20, seed=3)


def test_the_rounds_take_the_prompts_shuffled_or_in_order():
    """`round_prompts`: each epoch every prompt once, in an order shuffled by (seed, epoch), or with sft.shuffle
    false (TRL's `shuffle_dataset=False`) in the records' order, rounds running on across epochs."""
    from shardlm.rl.prompts import round_prompts

    shuffled = [round_prompts(5, 2, r, seed=1) for r in range(5)]
    first, second = sum(shuffled[:2], []) + shuffled[2][:1], shuffled[2][1:] + sum(shuffled[3:], [])
    assert sorted(first) == sorted(second) == list(range(5)) and first != second and first != list(range(5))
    assert [round_prompts(5, 2, r, seed=1, shuffle=False) for r in range(3)] == [[0, 1], [2, 3], [4, 0]]
