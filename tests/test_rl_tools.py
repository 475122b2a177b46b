"""The chat template's side of tool calling (`shardlm.rl.tools`) against TRL's and transformers' own, and the loop's
edge cases (`shardlm.rl.agent`).

- `parse_reply` gives the message TRL's `parse_response` gives with Qwen3's response template, for every reply of
  REPLIES (text, reasoning, one and two calls, text before a call, a call without arguments, malformed calls that
  fall back to plain text, an unclosed reasoning block); where the two differ by design (text on both sides of a
  call: TRL keeps the text after the calls only, shardlm both) the test says so;
- `suffix_ids` of Qwen3's template equals TRL's `_get_tool_suffix_ids` (which swaps in its prefix-preserving training
  template) for one and two tool results;
- the tools' schemas are transformers' `get_json_schema`'s, rendered into the prompt as `apply_chat_template(tools=)`
  renders them;
- `call_tools`: a result's `str()`, an unknown tool, a raising tool, arguments that are not an object, an async tool;
- `ToolLoop`: results that would pass model.seq_length end the sequence (TRL's check against the model's length),
  and rl.max_tool_calling_iterations stops the rounds.
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from chat_cache import template_parsed_once  # noqa: F401 (parses the chat template once per module)
from test_rl_tools_layouts import EOD, ByteTemplate, call

from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.rl.agent import ToolLoop
from shardlm.rl.rollout import Rollout
from shardlm.rl.tools import Tool, call_tools, check_template, parse_reply, suffix_ids
from shardlm.sft.template import ChatTemplate


def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def undocumented(a: int) -> int:
    return a


def hermes(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


REPLIES = [
    "Hello there", "  spaced out  \n", "multi\nline\ncontent\n", "<think>\nreason\n</think>\n\nThe answer",
    "<think>\n\n</think>\n\nx", "<think>\nunclosed reasoning", "  <think>r</think>c", "x</think>y",
    hermes("add", a=3, b=4), "Sure.\n" + hermes("add", a=3), "text\n\n" + hermes("add", a=1),
    "<think>\nhmm\n</think>\n\n" + hermes("add", a=3) + "\n" + hermes("add", a=5, b=6),
    '<tool_call>\n{"name": "add"}\n</tool_call>', '<tool_call>{"name":"x","arguments":{}}</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 3</tool_call>', '<tool_call>\n{"name": 5, "arguments": {}}'
    '\n</tool_call>', '<tool_call>\n["not", "a dict"]\n</tool_call>', "a <tool_call> b", "",
]
BOTH_SIDES = "Before.\n" + hermes("add", a=1) + "\nAfter"


@pytest.fixture(scope="module")
def qwen3(data_dir):
    return ChatTemplate.from_dir(data_dir / "chat" / "qwen3")


@pytest.fixture(scope="module")
def hf_tokenizer(data_dir):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from trl.chat_template_utils import add_response_schema

    return add_response_schema(transformers.AutoTokenizer.from_pretrained(data_dir / "chat" / "qwen3"))


@pytest.mark.parametrize("text", REPLIES)
def test_replies_parse_as_trls(qwen3, hf_tokenizer, text):
    from trl.chat_template_utils import parse_response

    cut = "<think>" in text and "</think>" not in text  # a reply cut in its reasoning (TRL keeps an end token there)
    ids = qwen3.encode(text + ("" if cut else "<|im_end|>"))
    prefix = qwen3.encode(qwen3.render([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    assert parse_reply(text) == parse_response(hf_tokenizer, ids, prefix=prefix, tools=[add])


def test_text_on_both_sides_of_a_call_is_kept(qwen3, hf_tokenizer):
    """shardlm keeps the text before and after the calls; TRL's parser keeps the text after them only."""
    from trl.chat_template_utils import parse_response

    ours = parse_reply(BOTH_SIDES)
    theirs = parse_response(hf_tokenizer, qwen3.encode(BOTH_SIDES + "<|im_end|>"), prefix=[], tools=[add])
    assert ours["tool_calls"] == theirs["tool_calls"]
    assert ours["content"] == "Before.\nAfter" and theirs["content"] == "After"


@pytest.mark.parametrize("results", [["7"], ["7", "{'error': 'Tool nope not found.'}"]])
def test_tool_results_render_as_trls(qwen3, hf_tokenizer, results):
    trl = pytest.importorskip("trl")
    from trl.chat_template_utils import get_training_chat_template

    messages = [{"role": "tool", "name": "add", "content": c} for c in results]
    trainer = types.SimpleNamespace(processing_class=hf_tokenizer, _tokenizer=hf_tokenizer, _is_vlm=False,
                                    chat_template=get_training_chat_template(hf_tokenizer), chat_template_kwargs={})
    assert suffix_ids(qwen3, messages) == trl.GRPOTrainer._get_tool_suffix_ids(trainer, messages)


def test_prompts_render_the_tools_as_transformers(qwen3, hf_tokenizer):
    prompt = [{"role": "user", "content": "What is 3 + 4?"}]
    ours = qwen3.encode(qwen3.render(prompt, add_generation_prompt=True, tools=[Tool("m:add", add).schema]))
    theirs = hf_tokenizer.apply_chat_template(prompt, tools=[add], add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    assert ours == theirs and "Add two integers." in qwen3.tokenizer.decode(ours)


def test_templates_without_hermes_calls_are_refused(qwen3):
    check_template(qwen3)
    qwen3_5_like = qwen3.source.replace("<tool_call>\\n", "<function_call>\\n")
    with pytest.raises(UserError, match="does not write a tool call as <tool_call>"):
        check_template(ChatTemplate(qwen3.tokenizer, qwen3_5_like, qwen3.special_tokens))


def test_tool_calls_and_their_failures():
    async def later(a: int) -> int:
        await asyncio.sleep(0)
        return a * 10

    def fails(a: int) -> int:
        raise ValueError(f"no {a}")

    calls = [{"type": "function", "function": {"name": n, "arguments": a}}
             for n, a in (("add", {"a": 3}), ("nope", {}), ("fails", {"a": 2}), ("add", "x"), ("later", {"a": 4}))]
    messages, failures = call_tools(calls, {"add": add, "fails": fails, "later": later})
    assert [m["content"] for m in messages] == ["4", "{'error': 'Tool nope not found.'}", "{'error': 'no 2'}",
                                                messages[3]["content"], "40"]
    assert failures == 3 and "error" in messages[3]["content"] and all(m["role"] == "tool" for m in messages)


def loop_of(max_iterations: int, seq_length: int) -> ToolLoop:
    return ToolLoop([Tool("m:add", add)], ByteTemplate, {EOD}, max_iterations, 400, seq_length,
                    ParallelContext.single())


def replies(reply: str):
    def continue_fn(prompts, seeds, limits, turn, sequences):
        return [Rollout(p, ByteTemplate.encode(reply + "\0")[:k], [0.0] * k, False) for p, k in zip(prompts, limits)]

    return continue_fn


def test_the_loop_stops_at_the_models_length_and_the_iteration_limit():
    first = Rollout([97] * 5, ByteTemplate.encode(call("add", a=1) + "\0"), [0.0] * 52, False)
    calling_again = replies(call("add", a=2))
    one = loop_of(1, 512)
    once = one.run([first], [0], [0], calling_again)[0]
    assert one.calls == 1 and once.messages[-1].get("tool_calls") and once.mask.count(0) > 0  # left unanswered
    three = loop_of(3, 512)
    thrice = three.run([first], [0], [0], calling_again)[0]
    assert three.calls == 3 and sum(m["role"] == "tool" for m in thrice.messages) == 3
    # the first results would make the sequence reach model.seq_length: it ends with its call unanswered
    short = loop_of(0, len(first.prompt) + len(first.completion) + 5).run([first], [0], [0], calling_again)[0]
    assert short.completion == first.completion and short.mask == [1] * len(first.completion)
