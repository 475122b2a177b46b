"""Tools an RL policy may call while it completes a prompt, and the chat template's side of a tool call: the tools'
JSON schemas, the replies parsed into messages, the tool results' tokens.

A tool is a Python function named in `rl.tools` as the rewards are (`pkg.mod:fn` or `path/to/file.py:fn`), with type
hints and a Google-style docstring: its schema is the one transformers' `get_json_schema` writes (and
`apply_chat_template(tools=...)` renders), so the prompts are the ones TRL's GRPOTrainer renders with the same
functions. A reply is parsed as the Hermes format that Qwen2.5, Qwen3 and many other templates render a call in:

    optional <think>reasoning</think>, text, then <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks

into `{"role": "assistant", "content": text, "reasoning_content": ..., "tool_calls": [{"type": "function",
"function": {"name", "arguments"}}]}`, the message TRL's `parse_response` gives for these templates. A block that is
not a JSON object with a string "name" makes the whole reply plain text (no call), as TRL falls back. A call's result
is `str()` of what the function returns, or `{'error': message}` when it raises or is unknown (a failure, counted).
The tokens of the results (`suffix_ids`) are what the template renders after an assistant turn that called tools:
the tool messages and the next generation prompt.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from shardlm.errors import UserError
from shardlm.sft.template import ChatTemplate

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_THINK = re.compile(r"^\s*<think>\n?(.*?)\n?(?:</think>\s*|$)", re.DOTALL)
_SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")


def function_schema(function: Callable[..., Any], name: str) -> dict:
    """The JSON schema of one tool function, as transformers' `get_json_schema` writes it (the library that
    `apply_chat_template` itself uses): {"type": "function", "function": {"name", "description", "parameters"}}."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise UserError("rl.tools needs the transformers library for the tools' JSON schemas; pip install "
                        "'shardlm[tools]' (or transformers)") from None
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
    from shardlm.rl.rewards import load_function

    tools = [Tool(name, load_function(name, "rl.tools")) for name in names]
    seen: dict[str, str] = {}
    for tool in tools:
        if tool.function_name in seen:
            raise UserError(f'rl.tools: "{seen[tool.function_name]}" and "{tool.name}" are both called '
                            f"{tool.function_name!r}; the model names a tool by its function's name")
        seen[tool.function_name] = tool.name
    return tools


def check_template(template: ChatTemplate) -> None:
    """UserError unless the template renders a whole tool call exchange (user -> assistant with tool_calls -> tool,
    each part visible, as TRL checks) in the Hermes format that `parse_reply` reads."""
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
    found = [_call_of(m.group(1)) for m in _CALL.finditer(text)]
    if {"name": name, "arguments": {key: value}} not in found:
        raise UserError(f"rl.tools: the {template.name} does not write a tool call as <tool_call>{{\"name\": ..., "
                        "\"arguments\": ...}</tool_call> (the Hermes format of Qwen2.5 and Qwen3, the one shardlm "
                        "parses); use such a template (sft.template)")


def _call_of(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("name"), str) else None


def parse_reply(text: str) -> dict:
    """One assistant reply's text (special tokens kept, the end-of-turn token cut) -> its message (module
    docstring): `content` is the text outside the reasoning and the tool calls, stripped."""
    message: dict[str, Any] = {"role": "assistant"}
    think = _THINK.match(text)
    if think:
        if think.group(1).strip():
            message["reasoning_content"] = think.group(1).strip()
        text = text[think.end():]
    calls = list(_CALL.finditer(text))
    parsed = [_call_of(m.group(1)) for m in calls]
    if any(call is None for call in parsed):
        return {"role": "assistant", "content": text.strip()}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {**call, "arguments": call.get("arguments") or {}}}
                                 for call in parsed]
        text = (text[:calls[0].start()].strip() + "\n" + text[calls[-1].end():].strip()).strip()
    message["content"] = text.strip()
    return message


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
            result = tools[name](**function.get("arguments", {}))
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
        except Exception as exc:  # a tool's failure is the model's to learn from, not the run's
            failures += 1
            result = {"error": str(exc)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages, failures


async def _await(awaitable: Any) -> Any:
    return await awaitable


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
