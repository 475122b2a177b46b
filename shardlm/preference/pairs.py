"""Preference records -> tokenized pairs: a prompt with a preferred (chosen) and a dispreferred (rejected) answer.

Record shapes (TRL's preference formats):

- `{"prompt": str, "chosen": str, "rejected": str}`: plain text; the answers end with the tokenizer's end token
  (added when missing), nothing is rendered;
- `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`: conversational; the prompt is rendered
  with the chat template and its generation prompt, each answer as the template renders prompt + answer;
- `{"chosen": [messages], "rejected": [messages]}`: conversational with the prompt implicit, the messages both
  share before their last turn.

TPO's records add a gold answer, `reference` (TRL's column: a string, or messages as the answers; with the prompt
implicit its messages share the prompt too), read when the loss trains on it (`preference.loss` with "gold").

Any of them may carry a number `margin` (TRL's reward-modeling column): how much the chosen answer's reward should
exceed the rejected one's (`shardlm.reward`); the preference losses do not read it.

Tokenized as TRL does: the prompt, prompt + chosen and prompt + rejected are tokenized whole, and each answer
starts where its tokens leave the prompt's (the common prefix), so a template that renders the prompt alone
differently, or a token merging across the boundary, cannot misplace the answer. Every problem is a one-line
`UserError` starting with the record's `file:line`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlm.errors import UserError
from shardlm.sft.records import check_messages, read_records
from shardlm.sft.template import ChatTemplate


@dataclass(frozen=True)
class PreferencePair:
    """One record: `prompt` (str or messages), `chosen` and `rejected` (str or messages), `where` (file:line), its
    `margin` (None when it has none) and its `gold` answer (TPO's `reference`; None when not read)."""

    prompt: Any
    chosen: Any
    rejected: Any
    where: str
    margin: float | None = None
    gold: Any = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


@dataclass(frozen=True)
class TokenizedPair:
    """`prompt` ids, then each answer's ids (trained); a sequence is prompt + answer; the record's `margin`; TPO's
    `gold` answer's ids (a third sequence; None without)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    where: str
    margin: float | None = None
    gold: list[int] | None = None

    def __len__(self) -> int:
        """Tokens of the pair's sequences (two, three with a gold answer)."""
        gold = 0 if self.gold is None else len(self.prompt) + len(self.gold)
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected) + gold

    @property
    def parts(self) -> tuple[list[int], ...]:
        """The token lists that identify the pair (its reference table's fingerprint)."""
        return self.prompt, self.chosen, self.rejected

    @property
    def targets(self) -> int:
        """Trained tokens: every answer's."""
        return len(self.chosen) + len(self.rejected) + len(self.gold or [])


def _implicit_prompt(chosen: list, rejected: list, where: str) -> tuple[list, list, list]:
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise UserError(f"{where}: 'chosen' and 'rejected' share no prompt; give a 'prompt' key")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _gold(record: dict[str, Any], where: str, prompt: Any, implicit: list | None) -> Any:
    """The record's checked gold answer (`reference`): of the answers' kind; with an `implicit` prompt (messages) its
    messages after it."""
    gold = record.get("reference")
    if gold in (None, "", []):
        raise UserError(f"{where}: the record has no 'reference' (gold) answer, which preference.loss with \"gold\" "
                        "(TPO) trains on; give one, or drop \"gold\" from the loss")
    if isinstance(gold, str) != isinstance(record["chosen"], str):
        raise UserError(f"{where}: 'reference' must be of the answers' kind (a string, or a message list)")
    if implicit is not None:
        if gold[:len(implicit)] != implicit:
            raise UserError(f"{where}: 'reference' does not start with the prompt 'chosen' and 'rejected' share; give "
                            "a 'prompt' key")
        gold = gold[len(implicit):]
    if isinstance(gold, list):
        check_messages(list(prompt) + list(gold), where)
    return gold


def to_pair(record: dict[str, Any], where: str, gold: bool = False) -> PreferencePair:
    """A checked `PreferencePair` of one record (module docstring); with its gold answer when `gold`."""
    if "completion" in record or "label" in record:
        raise UserError(f"{where}: an unpaired record ('completion', 'label'); set preference.loss=\"kto\" (or "
                        "\"apo_zero_unpaired\") to train on unpaired records, or give 'chosen' and 'rejected'")
    for key in ("chosen", "rejected"):
        if key not in record or record[key] in (None, "", []):
            raise UserError(f"{where}: the record has no {key!r} answer; preference records need 'chosen' and "
                            "'rejected' (and a 'prompt')")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    implicit = None  # the prompt the messages share, when the record has none
    if isinstance(chosen, str) != isinstance(rejected, str) or not isinstance(chosen, (str, list)):
        raise UserError(f"{where}: 'chosen' and 'rejected' must both be strings or both message lists")
    if isinstance(chosen, list):
        if prompt is None:
            prompt, chosen, rejected = _implicit_prompt(chosen, rejected, where)
            implicit = prompt
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        for answer in (chosen, rejected):
            check_messages(list(prompt) + list(answer), where)
    elif not isinstance(prompt, str):
        raise UserError(f"{where}: a text record needs a string 'prompt' beside its string answers")
    if chosen == rejected:
        raise UserError(f"{where}: 'chosen' and 'rejected' are identical, so the pair prefers nothing; drop it")
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or margin != margin):
        raise UserError(f"{where}: 'margin' must be a number, got {margin!r}")
    return PreferencePair(prompt, chosen, rejected, where, None if margin is None else float(margin),
                          _gold(record, where, prompt, implicit) if gold else None)


def load_pairs(paths: str | Path | Sequence[str | Path], gold: bool = False) -> list[PreferencePair]:
    """Every record of one or more JSONL / Parquet files, checked (with their gold answers when `gold`)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    pairs = [to_pair(record, where, gold) for path in paths for record, where in read_records(path)]
    if not pairs:
        raise UserError(f"{', '.join(str(p) for p in paths)}: no records; the file is empty")
    return pairs


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the tokens `a` and `b` begin with alike."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize_pair(template: ChatTemplate, pair: PreferencePair, eos: str | None) -> TokenizedPair:
    """Token ids of a pair (module docstring): conversational records through the chat template, text records
    as they are, each answer ended by `eos` when it does not end with it; a gold answer as the others."""
    answers = [pair.chosen, pair.rejected] + ([] if pair.gold is None else [pair.gold])
    if pair.conversational:
        prompt = template.encode(template.render(pair.prompt, add_generation_prompt=True))
        sequences = [template.encode(template.render(pair.prompt + answer)) for answer in answers]
    else:
        def ended(text: str) -> str:
            return text if eos is None or text.endswith(eos) else text + eos
        prompt = template.encode(pair.prompt)
        sequences = [template.encode(pair.prompt + ended(answer)) for answer in answers]
    start = min(common_prefix(prompt, sequence) for sequence in sequences)
    tokenized = TokenizedPair(prompt[:start], sequences[0][start:], sequences[1][start:], pair.where, pair.margin,
                              sequences[2][start:] if pair.gold is not None else None)
    if tokenized.gold == []:
        raise UserError(f"{pair.where}: the 'reference' (gold) answer renders to no token after the prompt; check the "
                        "record")
    if not tokenized.chosen or not tokenized.rejected:
        raise UserError(f"{pair.where}: an answer renders to no token after the prompt; check the record")
    if tokenized.chosen == tokenized.rejected:
        raise UserError(f"{pair.where}: 'chosen' and 'rejected' tokenize the same, so the pair prefers nothing")
    return tokenized
