"""Chat templates and loss masks: render a conversation the way transformers does, tokenize it, mark what is trained.

`ChatTemplate.from_dir(dir)` reads a Hugging Face tokenizer directory: `tokenizer.json` (loaded with the
`tokenizers` library), the template from `chat_template.jinja` or `tokenizer_config.json`'s
`chat_template`, and the named special tokens of `tokenizer_config.json`. The template is compiled in
jinja2's `ImmutableSandboxedEnvironment` with the same options, filters and globals as transformers'
`apply_chat_template` (`trim_blocks`, `lstrip_blocks`, loop controls, a non-escaping `tojson`,
`raise_exception`, `strftime_now`, and the named special tokens as variables), so the text and the token
ids are the ones transformers produces. Templates are untrusted code from a checkpoint: one that reaches
for Python internals (`''.__class__`) fails with one line instead of running.

The loss mask (1 = the token is a training target) is found in one of two ways:

- `generation-tags`: the template marks assistant output with `{% generation %}...{% endgeneration %}`;
  every token overlapping a marked span is trained (what `return_assistant_tokens_mask=True` gives).
- `prefix` (templates without tags, Qwen3's among them): for each trained assistant turn i, the
  conversation before it is rendered with `add_generation_prompt=True`; that text must be a prefix of the
  whole conversation's text (else one-line error: the template renders earlier turns differently once the
  conversation goes on). The turn's tokens run from the first token that reaches past that prefix up to
  and including the first end-of-turn token (`eos_token` of `tokenizer_config.json`, e.g. `<|im_end|>`, or
  an eos_token_id of `generation_config.json`, e.g. Gemma 4's `<turn|>`, unless `end_of_turn` names one);
  the newline the template writes after it, and everything up to the next assistant turn, is not trained.
  Comparing text and then token offsets gives the same start as comparing the prompt's token ids with the
  conversation's, and still works when a token spans the boundary (a reply that starts with a newline
  joins the prompt's last newline into one token, which is then trained, as TRL and generation tags do).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shardlm.data.tokenizers import shared_tokenizer
from shardlm.errors import UserError
from shardlm.sft.records import Conversation

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records the body's character span."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller):
        text = caller()
        state = self.environment.shardlm_tracking
        if state is not None:
            blocks, spans = state
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, as transformers' does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _Dict:
    """`dict(...)` for templates without the type object itself (as transformers' `TemplateDict`)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def compile_template(source: str, name: str = "chat template") -> jinja2.Template:
    """Compile `source` in an `ImmutableSandboxedEnvironment` set up like transformers'; errors are one line."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTracker, jinja2.ext.loopcontrols])
    env.shardlm_tracking = None
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise UserError(f"{name} does not compile: {_one_line(exc)}") from None


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or type(value) in (str, int, float, bool):
        return value
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop keys whose value is None and alias reasoning fields, as `apply_chat_template` does."""
    out = []
    for message in messages:
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _token_string(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TokenizedConversation:
    """A tokenized conversation: `input_ids` (n,) and `loss_mask` (n,), 1 where the token is a training target."""

    input_ids: list[int]
    loss_mask: list[int]
    where: str = ""

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


def generation_stop_ids(path: Path) -> tuple[int, ...]:
    """The eos_token_id (one id or a list) of a directory's generation_config.json, where transformers' `generate`
    reads the ids that end a reply; () without one."""
    config_path = path / "generation_config.json"
    if not config_path.is_file():
        return ()
    try:
        ids = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        raise UserError(f"{config_path} is not a JSON object; fix or remove it") from None
    ids = [ids] if isinstance(ids, int) else ids or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f"{config_path}: eos_token_id {ids!r} is not a token id or a list of them")
    return tuple(ids)


class ChatTemplate:
    """A tokenizer plus its chat template. `mask_method` is `"generation-tags"` or `"prefix"` (module docstring)."""

    def __init__(self, tokenizer, source: str, special_tokens: dict[str, str], end_of_turn: str | None = None,
                 name: str = "chat template", stop_ids: tuple[int, ...] = (), response_template: dict | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.response_template = response_template  # transformers' parser of a reply, if the directory has one
        self.source = source
        self.name = name
        self.variables: dict[str, Any] = {}  # rendered with every conversation (a run's sft.chat_template_kwargs)
        self.special_tokens = special_tokens
        self.template = compile_template(source, name)
        self.mask_method = "generation-tags" if GENERATION_TAG.search(source) else "prefix"
        self.end_of_turn = end_of_turn or special_tokens.get("eos_token")
        self.end_of_turn_id = tokenizer.token_to_id(self.end_of_turn) if self.end_of_turn else None
        # Every id that closes a turn: the end-of-turn token and, unless one was named, the directory's
        # generation_config.json eos_token_id (Gemma's turns end with <turn|> while its eos_token is <eos>)
        self.end_ids = frozenset(i for i in (self.end_of_turn_id, *([] if end_of_turn else stop_ids)) if i is not None)
        if self.mask_method == "prefix" and self.end_of_turn_id is None:
            raise UserError(f"{name}: no end-of-turn token ({self.end_of_turn!r} is not in the vocabulary); "
                            "pass end_of_turn= the token that closes an assistant turn")

    @classmethod
    def from_dir(cls, path: str | Path, end_of_turn: str | None = None, template: str | None = None) -> ChatTemplate:
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template of a tokenizer directory.

        `template` replaces the directory's own template (e.g. a variant with `{% generation %}` tags).
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"{path}: no tokenizer.json; give a Hugging Face tokenizer directory")
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        source = template
        if source is None and (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if source is None:
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates: use the default one
                source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str) or not source.strip():
            raise UserError(f"{path}: the tokenizer has no chat template (none in tokenizer_config.json, no "
                            "chat_template.jinja); use a chat model's tokenizer or pass a template")
        special = {k: s for k in SPECIAL_TOKEN_NAMES if (s := _token_string(config.get(k))) is not None}
        response = config.get("response_template")
        return cls(shared_tokenizer(path / "tokenizer.json"), source, special, end_of_turn,
                   name=f"chat template of {path}", stop_ids=generation_stop_ids(path),
                   response_template=response if isinstance(response, dict) else None)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, spans: list | None,
                template_kwargs: dict[str, Any], tools: list[dict] | None = None) -> str:
        variables = {**self.special_tokens, **_plain(self.variables), **_plain(template_kwargs)}
        variables.update(messages=_prepare_messages(messages), tools=_plain(tools) if tools else None, documents=None,
                         add_generation_prompt=add_generation_prompt)
        env = self.template.environment
        try:
            if spans is None:
                return self.template.render(**variables)
            blocks: list[str] = []
            env.shardlm_tracking = (blocks, spans)
            try:
                for block in self.template.generate(**variables):
                    blocks.append(block)
            finally:
                env.shardlm_tracking = None
            return "".join(blocks)
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise UserError(f"{self.name} failed to render: {_one_line(exc)}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict] | None = None, **template_kwargs) -> str:
        """The conversation as text, as `apply_chat_template(messages, tools=tools, tokenize=False, ...)` renders it
        (`tools`: JSON schemas)."""
        return self._render(messages, add_generation_prompt, None, template_kwargs, tools)

    def render_with_spans(self, messages: list[dict[str, Any]], **template_kwargs) -> tuple[str, list[tuple[int, int]]]:
        """The text and the `[start, end)` character spans of its `{% generation %}` blocks."""
        spans: list[tuple[int, int]] = []
        text = self._render(messages, False, spans, template_kwargs)
        return text, spans

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (special tokens in it are parsed; none are added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize(self, conversation: Conversation | list[dict[str, Any]], **template_kwargs) -> TokenizedConversation:
        """Render and tokenize one conversation and build its loss mask; `template_kwargs` go to the template
        (e.g. `enable_thinking=False`). Raises a one-line `UserError` when no token is left to train."""
        if not isinstance(conversation, Conversation):
            conversation = Conversation(messages=conversation, where="conversation")
        messages, where = conversation.messages, conversation.where
        if self.mask_method == "generation-tags":
            text, spans = self.render_with_spans(messages, **template_kwargs)
        else:
            text, spans = self.render(messages, **template_kwargs), []
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets, mask = encoding.ids, encoding.offsets, [0] * len(encoding.ids)
        if self.mask_method == "generation-tags":
            span = 0
            for t, (start, end) in enumerate(offsets):
                while span < len(spans) and start >= spans[span][1]:
                    span += 1
                if span == len(spans):
                    break
                if end > spans[span][0]:
                    mask[t] = 1
            if conversation.train_from > 0:
                cut = self._turn_start(messages, conversation.train_from, text, offsets, where, template_kwargs)
                mask[:cut] = [0] * cut
        else:
            for i, message in enumerate(messages):
                if i < conversation.train_from or message.get("role") != "assistant":
                    continue
                start = self._turn_start(messages, i, text, offsets, where, template_kwargs)
                end = next((t for t in range(start, len(ids)) if ids[t] in self.end_ids), None)
                if end is None:
                    raise UserError(f"{where}: no end-of-turn token {self.end_of_turn!r} after assistant turn "
                                    f"(message {i}); pass the template's end_of_turn token")
                mask[start:end + 1] = [1] * (end + 1 - start)
        if not any(mask):
            raise UserError(f"{where}: no assistant token to train on after applying the {self.name}")
        return TokenizedConversation(ids, mask, where)

    def _turn_start(self, messages, i: int, text: str, offsets, where: str, template_kwargs) -> int:
        """Index of the first token past the rendering of `messages[:i]` plus the generation prompt."""
        prompt = self.render(messages[:i], add_generation_prompt=True, **template_kwargs)
        if not text.startswith(prompt):
            raise UserError(f"{where}: the {self.name} renders the conversation before message {i} differently "
                            "when it continues, so the assistant turn cannot be found by prefix; add "
                            "{% generation %} tags to the template")
        return next((t for t, (_, end) in enumerate(offsets) if end > len(prompt)), len(offsets))


def tokenize_conversations(template: ChatTemplate, conversations: list[Conversation],
                           **template_kwargs) -> list[TokenizedConversation]:
    """`template.tokenize` for each conversation, in order."""
    return [template.tokenize(c, **template_kwargs) for c in conversations]
