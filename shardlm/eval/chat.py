"""Chat generation: render a conversation with the tokenizer's chat template, continue it, stop at end-of-turn.

`shardlm generate --chat --prompt TEXT` (each prompt one user turn) or `--messages FILE.json` (a
conversation: a JSON list of `{"role", "content"}` objects, or `{"messages": [...]}`) renders each
conversation with `shardlm.sft.template.ChatTemplate` and `add_generation_prompt=True` (what
`apply_chat_template(..., add_generation_prompt=True)` gives), tokenizes it with the template's own
tokenizer and generates the assistant turn with `generate_tokens`, which stops a row at the template's
end-of-turn token (Qwen3's `<|im_end|>`, the tokenizer's eos_token unless the template says otherwise) or at
any eos_token_id of the directory's generation_config.json, as transformers' `generate` does (Gemma 4 ends a
turn with `<turn|>`, its eos_token is `<eos>`); that token is not part of the reply (finish reason
"end_of_turn"). The template comes from
`--chat-template DIR` or, by default, from the checkpoint itself when it is a Hugging Face directory, else
the directory of the checkpoint's tokenizer.json (the Hugging Face directory a model was converted from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardlm.errors import UserError
from shardlm.eval.generate import Generation, SamplingConfig, generate_tokens

ROLES = ("system", "user", "assistant", "tool")


def check_prompt(messages: Any, where: str) -> list[dict[str, Any]]:
    """`messages` if it is a conversation to answer (a non-empty list of {role, content} objects that does not
    end with an assistant turn); else a one-line UserError naming `where`."""
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: expected a non-empty JSON list of {{\"role\", \"content\"}} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise UserError(f"{where}: message {i} is not a {{\"role\", \"content\"}} object with role one of "
                            f"{', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise UserError(f"{where}: message {i} ({message['role']}) has no string 'content'")
    if messages[-1]["role"] == "assistant":
        raise UserError(f"{where}: the conversation ends with an assistant turn; end it with a user turn to "
                        "get a reply")
    return messages


def read_messages(path: str | Path) -> list[dict[str, Any]]:
    """The conversation in a JSON file (`check_prompt`)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"messages file not found: {path}; check --messages")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    return check_prompt(value, str(path))


def template_dir(given: str | None, checkpoint: str, config) -> Path:
    """The tokenizer directory whose chat template renders conversations: `given`, else the checkpoint itself
    when it is a Hugging Face directory, else the directory of the checkpoint's tokenizer.json."""
    if given:
        return Path(given)
    if (Path(checkpoint) / "config.json").is_file():
        return Path(checkpoint)
    if config.data.tokenizer == "json" and config.data.vocab_file:
        return Path(config.data.vocab_file).parent
    raise UserError("the checkpoint names no tokenizer directory with a chat template; pass --chat-template DIR "
                    "(a Hugging Face tokenizer directory)")


def generate_chat(model, template, conversations: list[list[dict[str, Any]]], config: SamplingConfig,
                  template_kwargs: dict[str, Any] | None = None) -> list[Generation]:
    """Each conversation's reply: rendered with the generation prompt, continued until end-of-turn.
    `Generation.text` is the decoded reply (special tokens kept as text), without the end-of-turn token."""
    if template.end_of_turn_id is None:
        raise UserError(f"{template.name}: no end-of-turn token to stop at")
    prompts = [template.encode(template.render(c, add_generation_prompt=True, **(template_kwargs or {})))
               for c in conversations]
    top = max(max(p) for p in prompts)
    if top >= model.cfg.vocab_size:
        raise UserError(f"the chat template's tokenizer gives token id {top} but the model has only "
                        f"{model.cfg.vocab_size} tokens; use the tokenizer the model was trained with")
    results = generate_tokens(model, prompts, config, eod=template.end_of_turn_id, ends=template.end_ids)
    for result in results:
        result.finish_reason = "end_of_turn" if result.finish_reason == "eod" else result.finish_reason
        result.text = template.tokenizer.decode(result.tokens, skip_special_tokens=False)
    return results
