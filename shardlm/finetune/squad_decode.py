"""From start/end logits to answers: the standard recipe's n-best span search over all windows.

For each window of a question, the `n_best` highest start logits and the `n_best` highest end logits
(over all positions) are paired; a pair is a candidate when both tokens are context tokens, the start
is scored in this window (`max_context`), end >= start and the span has at most
`max_answer_length` tokens. Its score is start logit + end logit; the best candidate over all
windows gives the answer text, cut from the original context through the token offsets.

SQuAD 2.0: position 0 ([CLS]) scores "no answer", `start[0] + end[0]`, the smallest over the
question's windows (the window most confident there is an answer). The no-answer odds are
`null score - best span score`; the question is answered "" (no answer) when they exceed
`null_threshold` (0 by default; the best threshold on dev is reported by `squad_metrics`). A question
without any candidate span gets "" (and, in 2.0, the null score itself as its odds).

Output files, in the formats the official evaluation scripts read: `predictions.json` ({id: text})
and, for 2.0, `null_odds.json` ({id: odds}), both in question order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlm.checkpoint.files import write_atomically
from shardlm.finetune.squad_data import SquadExample
from shardlm.finetune.squad_features import NO_OFFSET, SquadFeatures, span_text


@dataclass(frozen=True)
class DecodeSettings:
    """How answers are chosen from the logits (the standard recipe's defaults)."""

    version: str = "1.1"
    """"1.1" (always answer) or "2.0" (answer "" when the no-answer odds exceed the threshold)."""
    n_best: int = 20
    """Start and end positions considered per window."""
    max_answer_length: int = 30
    """Longest answer, in tokens."""
    null_threshold: float = 0.0
    """2.0: predict no answer when null score - best span score exceeds this."""


@dataclass(frozen=True)
class Span:
    """A candidate answer: its score (start + end logit) and its text."""

    score: float
    text: str


def window_spans(logits: np.ndarray, offsets: np.ndarray, max_context: np.ndarray, context: str,
                 settings: DecodeSettings) -> list[Span]:
    """The candidate spans of one window: `logits` (L, 2) start/end, `offsets` (L, 2), `max_context` (L,)."""
    starts = np.argsort(-logits[:, 0], kind="stable")[:settings.n_best]
    ends = np.argsort(-logits[:, 1], kind="stable")[:settings.n_best]
    spans = []
    for start in starts.tolist():
        if offsets[start, 0] == NO_OFFSET or not max_context[start]:
            continue
        for end in ends.tolist():
            if offsets[end, 0] == NO_OFFSET or end < start or end - start + 1 > settings.max_answer_length:
                continue
            spans.append(Span(float(logits[start, 0] + logits[end, 1]), span_text(context, offsets, start, end)))
    return spans


def decode_answers(examples: list[SquadExample], features: SquadFeatures, logits: np.ndarray,
                   settings: DecodeSettings) -> tuple[dict[str, str], dict[str, float]]:
    """(predictions {id: text}, null odds {id: odds}; empty for 1.1) from (F, L, 2) logits of `features`."""
    windows: list[list[int]] = [[] for _ in examples]
    for feature, owner in enumerate(features.example_index.tolist()):
        windows[owner].append(feature)
    predictions, null_odds = {}, {}
    for example, mine in zip(examples, windows):
        spans = [span for f in mine for span in window_spans(logits[f], features.offsets[f], features.max_context[f],
                                                             example.context, settings)]
        best = max(spans, key=lambda s: s.score, default=None)  # the first of equal scores
        text = best.text if best is not None else ""
        if settings.version == "2.0":
            null_score = min(float(logits[f, 0, 0] + logits[f, 0, 1]) for f in mine)
            odds = null_score - best.score if best is not None else null_score
            null_odds[example.id] = odds
            text = "" if odds > settings.null_threshold else text
        predictions[example.id] = text
    return predictions, null_odds


def write_prediction_files(folder: Path, predictions: dict[str, str], null_odds: dict[str, float]) -> list[Path]:
    """`folder/predictions.json` and, when there are odds (2.0), `folder/null_odds.json`, each
    written atomically (call on one rank). Returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in (("predictions.json", predictions), ("null_odds.json", null_odds)):
        if name == "null_odds.json" and not content:
            continue
        text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"
        write_atomically(folder / name, lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"))
        written.append(folder / name)
    return written
