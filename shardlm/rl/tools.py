"""Tools an RL policy may call while it completes a prompt, and the chat template's side of a tool call: the tools'
JSON schemas, the replies parsed into messages, the tool results' tokens.

A tool is a Python function named in `rl.tools` as the rewards are (`pkg.mod:fn` or `path/to/file.py:fn`), with type
hints and a Google-style docstring: its schema is the one transformers' `get_json_schema` writes (and
`apply_chat_template(tools=...)` renders), so the prompts are the ones TRL's GRPOTrainer renders with the same
functions. A reply is parsed by transformers' response parser (`parse_response`, TRL's too) with a response template:
the tokenizer directory's own (`response_template` in tokenizer_config.json), else the one of the format the chat
template writes a call in, found by rendering one (`CallFormat`):

- "hermes" (Qwen2.5, Qwen3 and many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
- "xml" (Qwen3.5, Qwen3-Coder, Nemotron 3): `<tool_call><function=NAME><parameter=KEY>value</parameter>...` blocks;

each after an optional `<think>` block (opened by the prompt itself where the template's generation prompt opens
it). The message is `{"role": "assistant", "content", "reasoning_content", "tool_calls": [{"type": "function",
"function": {"name", "arguments"}}]}`, the arguments typed by the tool's schema ("7" an integer where the parameter is
one); a reply that does not parse (a malformed call) is plain text, as TRL falls back. A call's result is `str()` of
what the function returns, or `{'error': message}` when it raises or is unknown (a failure, counted). The tokens of
the results (`suffix_ids`) are what the template renders after an assistant turn that called tools: the tool
messages and the next generation prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from shardlm.errors import UserError
from shardlm.rl.rewards import load_function, settled
from shardlm.sft.template import ChatTemplate

_SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")
_THINK = {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"}
_CALLS = {
    "hermes": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
               "transform": {"type": "function", "function": "{content}"}},
    "xml": {"open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>", "close_pattern": r"</tool_call>\s*",
            "repeats": True, "content": "xml-inline",
            "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                             "value_parser": {"name": "text"}},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
}
"""How each format's calls read, as transformers' response templates describe a field (the "xml" values kept as
text, then typed by the tool's schema)."""


def function_schema(function: Callable[..., Any], name: str) -> dict:
    """The JSON schema of one tool function, as transformers' `get_json_schema` writes it (the library that
    `apply_chat_template` itself uses): {"type": "function", "function": {"name", "description", "parameters"}}."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise UserError("rl.tools needs the transformers library (5.15 or later) for the tools' schemas and the "
                        "replies' parsing; pip install 'shardlm[tools]'") from None
    try:
        return get_json_schema(function)
    except Exception as exc:  # transformers' TypeHintParsingException and DocstringParsingException
        raise UserError(f'rl.tools: "{name}" has no JSON schema ({" ".join(str(exc).split())}); give it type '
                        "hints and a Google-style docstring with an Args: line for each argument") from None


class Tool:
    """One tool: its config `name` ("module:function"), the `function` and its `schema`."""

    def __init__(self, name: str, function: Callable[..., Any]):
        self.name, self.function = name, function
        self.schema = function_schema(function, name)
        self.function_name = self.schema["function"]["name"]


def load_tools(names: list[str]) -> list[Tool]:
    """The run's tools, imported and their schemas made (cheap: before any expensive work); one-line errors."""
    tools = [Tool(name, load_function(name, "rl.tools")) for name in names]
    seen: dict[str, str] = {}
    for tool in tools:
        if tool.function_name in seen:
            raise UserError(f'rl.tools: "{seen[tool.function_name]}" and "{tool.name}" are both called '
                            f"{tool.function_name!r}; the model names a tool by its function's name")
        seen[tool.function_name] = tool.name
    return tools


class CallFormat:
    """How a chat template's replies are parsed (module docstring): `response_template`, transformers' description
    of a reply, and the tools' `schemas` that type the arguments. `CallFormat.of(template, schemas)` checks that
    the template renders a whole call exchange (user -> assistant with tool_calls -> tool, each part visible, as TRL
    checks) and finds its format; one-line error otherwise."""

    def __init__(self, template: ChatTemplate, response_template: dict, schemas: list[dict]):
        self.template, self.response_template, self.schemas = template, response_template, schemas

    @classmethod
    def of(cls, template: ChatTemplate, schemas: list[dict]) -> CallFormat:
        try:
            from transformers.utils.chat_parsing.response_parser import parse_response  # noqa: F401
        except ImportError:
            raise UserError("rl.tools needs transformers 5.15 or later to parse the replies' calls; pip install "
                            "'shardlm[tools]'") from None
        name, key, value, content = _SENTINELS
        calls = [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "name": name, "content": content}]
        try:
            text = template.render(messages)
        except UserError:
            text = ""
        if not all(s in text for s in _SENTINELS):
            raise UserError(f"rl.tools: the {template.name} cannot render a tool call and its result (a user, an "
                            "assistant turn with tool_calls, a tool message); use a template with tool support "
                            "(sft.template)")
        if template.response_template is not None:
            return cls(template, template.response_template, schemas)
        if f"<function={name}>" in text and f"<parameter={key}>" in text:
            kind = "xml"
        elif re.search(r"<tool_call>\s*\{\s*\"name\":\s*\"" + name, text):
            kind = "hermes"
        else:
            raise UserError(f"rl.tools: the {template.name} writes tool calls in a format shardlm does not parse "
                            "(it reads <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> and Qwen3.5's "
                            "<tool_call><function=...>); give the tokenizer a response_template in "
                            "tokenizer_config.json, or use such a template (sft.template)")
        user = [{"role": "user", "content": "hi"}]
        opening = template.render(user, add_generation_prompt=True)[len(template.render(user)):]
        fields = {"reasoning_content": _THINK, "tool_calls": _CALLS[kind],
                  "content": {"close_pattern": re.escape(template.end_of_turn or "") + r"\s*", "content": "text"}}
        return cls(template, {"defaults": {"role": "assistant"}, "start_anchor": opening.split("<think>")[0],
                              "fields": fields}, schemas)

    def parse(self, ids: list[int], prefix: list[int]) -> dict:
        """One reply's ids (its end token included) after the `prefix` ids (the prompt, and the completion so far)
        -> its message, as TRL's `parse_response` gives it: plain text when it does not parse."""
        from transformers.utils.chat_parsing.response_parser import parse_response

        decode = self.template.tokenizer.decode
        try:
            message = parse_response(decode(ids, skip_special_tokens=False), self.response_template,
                                     prefix=decode(prefix, skip_special_tokens=False), tools=self.schemas)
            if not isinstance(message, dict):
                raise ValueError("not a message")
            if isinstance(message.get("content"), str) and self.template.end_of_turn:
                message["content"] = message["content"].removesuffix(self.template.end_of_turn)
            message["content"] = message.get("content") or ""
            _check_calls(message.get("tool_calls"))
        except (ValueError, TypeError):  # a malformed call: the reply is its text
            message = {"role": "assistant", "content": decode(ids, skip_special_tokens=True)}
        return message


def _check_calls(calls: Any) -> None:
    """ValueError unless `calls` is None or a list of calls, each with a string name (arguments default to {})."""
    if calls is None:
        return
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ValueError("tool_calls must be a list of dicts")
    for call in calls:
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call needs a string name")
        if function.get("arguments") is None:
            function["arguments"] = {}


def call_tools(calls: list[dict], tools: dict[str, Callable[..., Any]]) -> tuple[list[dict], int]:
    """Run one reply's `calls` in order -> (the tool messages, how many failed); `tools` by function name. A call's
    content is `str()` of the result, or of `{'error': message}` (TRL's) when the tool is unknown, its arguments are
    not an object or it raises."""
    messages, failures = [], 0
    for call in calls:
        function = call.get("function", {})
        name = function.get("name", "unknown")
        try:
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            result = settled(tools[name](**function.get("arguments", {})))
        except Exception as exc:  # a tool's failure is the model's to learn from, not the run's
            failures += 1
            result = {"error": str(exc)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages, failures


def suffix_ids(template: ChatTemplate, tool_messages: list[dict]) -> list[int]:
    """The tokens that follow an assistant turn calling tools (its end-of-turn token included): the template's
    rendering of `tool_messages` and of the next generation prompt, found as TRL finds them, by rendering a dummy
    turn with and without them. The turn's end is its k-th end-of-turn token, k counted in the dummy's rendering
    alone, so templates that render a finished turn differently once others follow (Qwen3's reasoning block) give
    the same suffix."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    before = template.encode(template.render(dummy))
    full = template.encode(template.render(dummy + tool_messages, add_generation_prompt=True))
    ends = [t for t, i in enumerate(before) if i in template.end_ids]
    if not ends:
        if full[:len(before)] != before:
            raise UserError(f"rl.tools: the {template.name} renders an assistant turn differently once tool "
                            "results follow it and closes no turn with an end token; use another template")
        return full[len(before):]
    seen = [t for t, i in enumerate(full) if i in template.end_ids]
    if len(seen) < len(ends) or full[:ends[0]] != before[:ends[0]]:
        raise UserError(f"rl.tools: the {template.name} renders the tool results in an unexpected way; use another "
                        "template")
    return full[seen[len(ends) - 1] + 1:]
