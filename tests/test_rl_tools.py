"""The chat template's side of tool calling (`shardlm.rl.tools`) against TRL's and transformers' own, and the loop's
edge cases (`shardlm.rl.agent`).

- `CallFormat.parse` gives the message TRL's `parse_response` gives (its response templates for Qwen3 and Qwen3.5)
  for every reply of HERMES_REPLIES (Qwen3's template: text, reasoning, one and two calls, text before and after a
  call, a call without arguments, string arguments typed by the tool's schema, malformed calls that fall back to
  plain text, an unclosed reasoning block) and XML_REPLIES (Qwen3.5's template, whose generation prompt opens the
  reasoning: parameters typed by the schema, multi-line values, a call without parameters, an unknown tool);
- `suffix_ids` equals TRL's `_get_tool_suffix_ids` (which swaps in its prefix-preserving training templates) for
  one and two tool results, under both templates;
- the tools' schemas are transformers' `get_json_schema`'s, rendered into the prompt as `apply_chat_template(tools=)`
  renders them; a template that renders no tool calls, or calls in a format shardlm does not read, is refused;
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
from shardlm.rl.tools import CallFormat, Tool, call_tools, suffix_ids
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


class NoReset:
    """An environment class without its reset method."""


class Bare:
    """An environment with no tools of its own: a reset and a reward."""

    def reset(self, **record) -> None:
        return None

    def get_reward(self) -> float:
        return 0.0


def hermes(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def add_all(a: int, b: float = 1.0, s: str = "", items: list[int] | None = None, flag: bool = False) -> float:
    """Add several things.

    Args:
        a: An integer.
        b: A number.
        s: A string.
        items: Integers.
        flag: A switch.
    """
    return a + b


HERMES_REPLIES = [
    "Hello there", "  spaced out  \n", "multi\nline\ncontent\n", "<think>\nreason\n</think>\n\nThe answer",
    "<think>\n\n</think>\n\nx", "<think>\nunclosed reasoning", "  <think>r</think>c", "x</think>y",
    hermes("add", a=3, b=4), "Sure.\n" + hermes("add", a=3), "text\n\n" + hermes("add", a=1),
    "Before.\n" + hermes("add", a=1) + "\nAfter",
    "<think>\nhmm\n</think>\n\n" + hermes("add", a=3) + "\n" + hermes("add_all", a=5, b=6),
    hermes("add_all", a="3", b="2.5", s=7, items="[1, 2]", flag="true"), hermes("add_all", a="x3", other="1"),
    '<tool_call>\n{"name": "add"}\n</tool_call>', '<tool_call>{"name":"x","arguments":{}}</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 3</tool_call>', '<tool_call>\n{"name": 5, "arguments": {}}'
    '\n</tool_call>', '<tool_call>\n["not", "a dict"]\n</tool_call>', "a <tool_call> b",
]
XML_REPLIES = [
    "reasoning here\n</think>\n\nSure.\n\n<tool_call>\n<function=add_all>\n<parameter=a>\n3\n</parameter>\n"
    "<parameter=s>\n 75001 \n</parameter>\n<parameter=items>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
    "r\n</think>\n\nplain answer",
    "r\n</think>\n\n<tool_call>\n<function=add>\n</function>\n</tool_call>\n<tool_call>\n<function=zzz>\n"
    "<parameter=q>\nmulti\nline\n</parameter>\n</function>\n</tool_call>",
    "unclosed think", "r</think><tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n</function>",
]


def qwen3_5_template(qwen3: ChatTemplate) -> ChatTemplate:
    """Qwen3.5's chat template (as TRL ships it) over the Qwen3 tokenizer: the same special tokens."""
    from trl.chat_template_utils import qwen3_5_think_chat_template

    return ChatTemplate(qwen3.tokenizer, qwen3_5_think_chat_template, qwen3.special_tokens)


@pytest.fixture(scope="module")
def qwen3(data_dir):
    return ChatTemplate.from_dir(data_dir / "chat" / "qwen3")


def hf_tokenizer(data_dir, chat_template: str | None = None):
    """The shared tokenizer in transformers, with TRL's response template for its chat template (or `chat_template`)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from trl.chat_template_utils import add_response_schema

    tokenizer = transformers.AutoTokenizer.from_pretrained(data_dir / "chat" / "qwen3")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return add_response_schema(tokenizer)


@pytest.fixture(scope="module")
def formats(qwen3, data_dir):
    """{"hermes": (shardlm's CallFormat of Qwen3's template, TRL's tokenizer), "xml": (Qwen3.5's)}."""
    from trl.chat_template_utils import qwen3_5_think_chat_template

    schemas = [Tool("m:add", add).schema, Tool("m:add_all", add_all).schema]
    xml = CallFormat.of(qwen3_5_template(qwen3), schemas)
    return {"hermes": (CallFormat.of(qwen3, schemas), hf_tokenizer(data_dir)),
            "xml": (xml, hf_tokenizer(data_dir, qwen3_5_think_chat_template))}


@pytest.mark.parametrize("kind, text", [("hermes", t) for t in HERMES_REPLIES] + [("xml", t) for t in XML_REPLIES])
def test_replies_parse_as_trls(formats, kind, text):
    from trl.chat_template_utils import parse_response

    ours, tokenizer = formats[kind]
    template = ours.template
    cut = "<think>" in text and "</think>" not in text or kind == "xml" and "</think>" not in text
    ids = template.encode(text + ("" if cut else "<|im_end|>"))  # (a reply cut in its reasoning has no end token)
    prefix = template.encode(template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    theirs = parse_response(tokenizer, ids, prefix=prefix, tools=[add, add_all])
    assert ours.parse(ids, prefix) == theirs
    if "items" in text and "x3" not in text:  # the arguments typed by the tool's schema
        arguments = theirs["tool_calls"][-1]["function"]["arguments"]
        assert isinstance(arguments["a"], int) and isinstance(arguments["items"], list), arguments


@pytest.mark.parametrize("kind", ["hermes", "xml"])
@pytest.mark.parametrize("results", [["7"], ["7", "{'error': 'Tool nope not found.'}"]])
def test_tool_results_render_as_trls(formats, kind, results):
    trl = pytest.importorskip("trl")
    from trl.chat_template_utils import get_training_chat_template

    ours, tokenizer = formats[kind]
    messages = [{"role": "tool", "name": "add", "content": c} for c in results]
    trainer = types.SimpleNamespace(processing_class=tokenizer, _tokenizer=tokenizer, _is_vlm=False,
                                    chat_template=get_training_chat_template(tokenizer), chat_template_kwargs={})
    assert suffix_ids(ours.template, messages) == trl.GRPOTrainer._get_tool_suffix_ids(trainer, messages)


def test_prompts_render_the_tools_as_transformers(qwen3, formats):
    prompt = [{"role": "user", "content": "What is 3 + 4?"}]
    ours = qwen3.encode(qwen3.render(prompt, add_generation_prompt=True, tools=[Tool("m:add", add).schema]))
    theirs = formats["hermes"][1].apply_chat_template(prompt, tools=[add], add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    assert ours == theirs and "Add two integers." in qwen3.tokenizer.decode(ours)


def test_templates_without_readable_calls_are_refused(qwen3):
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    with pytest.raises(UserError, match="cannot render a tool call and its result"):
        CallFormat.of(ChatTemplate(qwen3.tokenizer, plain, qwen3.special_tokens), [])
    other = qwen3.source.replace("<tool_call>\\n", "<function_call>\\n")
    with pytest.raises(UserError, match="writes tool calls in a format shardlm does not parse"):
        CallFormat.of(ChatTemplate(qwen3.tokenizer, other, qwen3.special_tokens), [])


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
    tools = [Tool("m:add", add)]
    return ToolLoop(tools, CallFormat.of(ByteTemplate, [t.schema for t in tools]), {EOD}, max_iterations, 400,
                    seq_length, ParallelContext.single())


def replies(reply: str):
    def continue_fn(prompts, seeds, limits, turn, sequences):
        return [Rollout(p, ByteTemplate.encode(reply + "\0")[:k], [0.0] * k, False) for p, k in zip(prompts, limits)]

    return continue_fn


def test_the_loop_stops_at_the_models_length_and_the_iteration_limit():
    first = Rollout([97] * 5 + ByteTemplate.encode("<a>"), ByteTemplate.encode(call("add", a=1) + "\0"), [0.0] * 52,
                    False)
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
