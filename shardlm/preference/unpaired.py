"""Unpaired preference records -> tokenized examples for KTO: a prompt, one completion and a label (desirable or
not), with the mismatched completion that estimates the KL term.

Record shapes (TRL's unpaired preference format, and the paired one unpaired):

- `{"prompt": str, "completion": str, "label": bool}`: plain text; the completion ends with the tokenizer's end
  token (added when missing);
- `{"prompt": [messages], "completion": [messages], "label": bool}`: conversational, rendered with the chat
  template (the prompt with its generation prompt, the completion as the template renders prompt + completion);
- paired records (`prompt`, `chosen`, `rejected`, `shardlm.preference.pairs`): each gives a desirable example
  (its chosen answer) and an undesirable one (its rejected answer). As TRL unpairs them: every chosen example in
  the records' order, then every rejected one, so the rotation below pairs a prompt with another record's answer.

Tokenized as TRL does: the prompt and prompt + completion whole, the completion starting where their tokens part.

The KL sequence of an example (KTO's reference point z0 = KL(policy || reference), estimated on mismatched
prompt-completion pairs) is its prompt followed by another example's completion tokens: the completions rotated
by one within consecutive groups of `group` examples (TRL rotates within each batch of its per-device size:
example i gets the completion of i - 1, the group's first the group's last). A last group of one example takes
the completion before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlm.errors import UserError
from shardlm.preference.pairs import common_prefix, to_pair
from shardlm.sft.records import check_messages, read_records
from shardlm.sft.template import ChatTemplate


@dataclass(frozen=True)
class UnpairedExample:
    """One example: `prompt` (str or messages), `completion` (str or messages), `label` (True: desirable),
    `where` (file:line)."""

    prompt: Any
    completion: Any
    label: bool
    where: str

    @property
    def conversational(self) -> bool:
        return isinstance(self.completion, list)


@dataclass(frozen=True)
class TokenizedExample:
    """`prompt` ids, the `completion` ids (trained) and the KL sequence's mismatched completion ids `kl_completion`
    (module docstring; None for a loss without the KL term); `label` True where the completion is desirable."""

    prompt: list[int]
    completion: list[int]
    kl_completion: list[int] | None
    label: bool
    where: str

    @property
    def sequence_lengths(self) -> tuple[int, int]:
        """Tokens of the example's sequence and of its KL sequence (0 without one)."""
        kl = 0 if self.kl_completion is None else len(self.prompt) + len(self.kl_completion)
        return len(self.prompt) + len(self.completion), kl

    def __len__(self) -> int:
        """The longer of its two sequences: what it takes of a row, whose examples and KL sequences are packed side
        by side (`shardlm.preference.data`)."""
        return max(self.sequence_lengths)

    @property
    def parts(self) -> tuple[list[int], ...]:
        """The token lists (and the label) that identify the example (its reference table's fingerprint)."""
        return self.prompt, self.completion, self.kl_completion or [], [int(self.label)]

    @property
    def targets(self) -> int:
        """Trained tokens: the completion's (the KL sequence is scored, not trained)."""
        return len(self.completion)


def is_unpaired(record: dict[str, Any]) -> bool:
    return "completion" in record or "label" in record


def to_example(record: dict[str, Any], where: str) -> UnpairedExample:
    """A checked `UnpairedExample` of one unpaired record (module docstring)."""
    for key in ("prompt", "completion", "label"):
        if key not in record or record[key] in (None, "", []):
            raise UserError(f"{where}: the record has no {key!r}; unpaired preference records need 'prompt', "
                            "'completion' and 'label' (true: desirable, false: undesirable)")
    prompt, completion, label = record["prompt"], record["completion"], record["label"]
    if not isinstance(label, bool):
        raise UserError(f"{where}: 'label' is {label!r}; it must be true (desirable) or false (undesirable)")
    if isinstance(completion, list):
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        check_messages(list(prompt) + list(completion), where)
    elif not isinstance(completion, str) or not isinstance(prompt, str):
        raise UserError(f"{where}: 'prompt' and 'completion' must both be strings, or 'completion' a message list")
    return UnpairedExample(prompt, completion, label, where)


def load_examples(paths: str | Path | Sequence[str | Path]) -> list[UnpairedExample]:
    """Every record of one or more JSONL / Parquet files as examples: unpaired records in order, or paired records
    unpaired (module docstring). Records of both shapes in one run are refused."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    records = [(record, where) for path in paths for record, where in read_records(path)]
    if not records:
        raise UserError(f"{', '.join(str(p) for p in paths)}: no records; the file is empty")
    unpaired = [is_unpaired(record) for record, _ in records]
    if all(unpaired):
        return [to_example(record, where) for record, where in records]
    if any(unpaired):
        where = records[unpaired.index(True)][1]
        raise UserError(f"{where}: an unpaired record ('completion', 'label') among paired ones ('chosen', "
                        "'rejected'); give one shape per run")
    pairs = [to_pair(record, where) for record, where in records]
    return ([UnpairedExample(p.prompt, p.chosen, True, p.where) for p in pairs]
            + [UnpairedExample(p.prompt, p.rejected, False, p.where) for p in pairs])


def tokenize_example(template: ChatTemplate, example: UnpairedExample, eos: str | None) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of an example: conversational records through the chat template, text records
    as they are with the completion ended by `eos` when it does not end with it."""
    if example.conversational:
        prompt = template.encode(template.render(example.prompt, add_generation_prompt=True))
        whole = template.encode(template.render(example.prompt + example.completion))
    else:
        ended = example.completion if eos is None or example.completion.endswith(eos) else example.completion + eos
        prompt, whole = template.encode(example.prompt), template.encode(example.prompt + ended)
    start = common_prefix(prompt, whole)
    if start == len(whole):
        raise UserError(f"{example.where}: the completion renders to no token after the prompt; check the record")
    return prompt[:start], whole[start:]


def kl_completions(completions: list[list[int]], group: int) -> list[list[int]]:
    """Each example's mismatched completion: rotated by one within consecutive groups of `group` (module
    docstring). Needs at least two examples."""
    if len(completions) < 2:
        raise UserError("KTO estimates its KL term from other examples' completions and needs at least 2 examples; "
                        "add records")
    rotated = []
    for start in range(0, len(completions), max(1, group)):
        block = completions[start:start + max(1, group)]
        if len(block) == 1:
            rotated.append(completions[start - 1])
        else:
            rotated += [block[-1]] + block[:-1]
    return rotated


def tokenize_examples(template: ChatTemplate, examples: list[UnpairedExample], eos: str | None,
                      group: int) -> list[TokenizedExample]:
    """Tokenized examples with their KL sequences' completions (`kl_completions` over `examples` in order; none with
    `group` 0, for a loss without the KL term)."""
    tokens = [tokenize_example(template, e, eos) for e in examples]
    mismatched = kl_completions([completion for _, completion in tokens], group) if group else [None] * len(tokens)
    return [TokenizedExample(prompt, completion, kl, e.label, e.where)
            for (prompt, completion), kl, e in zip(tokens, mismatched, examples)]
