"""SQuAD exact match and F1, computed as the official evaluation scripts compute them.

Both scripts (`evaluate-v1.1.py`, `evaluate-v2.0.py`) compare *normalized* answers: lower case,
ASCII punctuation (`string.punctuation`) removed, the words a / an / the removed, whitespace
collapsed. Exact match is 1 when the normalized texts are equal; F1 is the harmonic mean of the
precision and recall of the shared words (a bag of words, so repeats count as often as they occur
in both). A question scores the maximum over its reference answers. Where they differ:

- v1.1 scores every reference; a prediction or reference that normalizes to nothing has F1 0.
- v2.0 drops references that normalize to nothing; an unanswerable question's only reference is
  the empty answer, so it scores 1 (both metrics) only for an empty prediction, and any answer
  scores 0 against it. Totals are broken down into HasAns (answerable) and NoAns questions.
- v2.0 with a no-answer probability per question (`null_odds.json`) predicts "no answer" where it
  exceeds the threshold 1.0, and reports the best threshold: questions sorted by that probability,
  predicting no answer for all of them first, then answering one more question at a time (its
  prediction from `predictions.json`), the threshold being the odds of the last question answered
  where the total score is highest (`best_exact`, `best_exact_thresh`, `best_f1`, `best_f1_thresh`).

A question missing from the predictions scores 0 (the v1.1 script's rule; shardlm always predicts
every question). Figures are percentages, as the scripts print them.
"""

from __future__ import annotations

import re
import string
from collections import Counter

from shardlm.finetune.squad_data import SquadExample

PUNCTUATION = frozenset(string.punctuation)
ARTICLES = re.compile(r"\b(a|an|the)\b")
DEFAULT_NA_PROB_THRESHOLD = 1.0


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> int:
    """1 when the normalized prediction equals the normalized reference, else 0."""
    return int(normalize_answer(prediction) == normalize_answer(reference))


def f1_score(prediction: str, reference: str, version: str = "2.0") -> float:
    """Word-level F1 of the normalized texts. v2.0: two empty texts score 1 and one empty text 0;
    v1.1: any empty text scores 0."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if version == "2.0" and (not predicted or not gold):
        return float(predicted == gold)
    shared = sum((Counter(predicted) & Counter(gold)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(gold)
    return 2 * precision * recall / (precision + recall)


def references(example: SquadExample, version: str) -> list[str]:
    """The texts a prediction is scored against: all answers (v1.1); v2.0: those that do not normalize
    to nothing, or the empty answer when none is left (unanswerable questions)."""
    texts = [a.text for a in example.answers]
    if version == "1.1":
        return texts
    return [t for t in texts if normalize_answer(t)] or [""]


def question_scores(example: SquadExample, prediction: str, version: str) -> tuple[float, float]:
    """(exact match, F1) of one prediction: the maxima over the question's references."""
    texts = references(example, version)
    return (max(exact_match(prediction, t) for t in texts),
            max(f1_score(prediction, t, version) for t in texts))


def squad_scores(examples: list[SquadExample], predictions: dict[str, str], version: str,
                 null_odds: dict[str, float] | None = None,
                 na_prob_threshold: float = DEFAULT_NA_PROB_THRESHOLD) -> dict:
    """The official script's output for `predictions` (id -> text) on `examples`.

    v1.1: {"exact_match", "f1"}. v2.0: {"exact", "f1", "total"}, the same for "HasAns_" and "NoAns_"
    questions where there are any, and given `null_odds` (id -> no-answer score) also "best_exact",
    "best_exact_thresh", "best_f1", "best_f1_thresh" (a question whose odds exceed `na_prob_threshold`
    counts as answered "no answer" in "exact" and "f1")."""
    exact, f1 = {}, {}
    for example in examples:
        if example.id not in predictions:
            exact[example.id], f1[example.id] = 0.0, 0.0
        else:
            exact[example.id], f1[example.id] = question_scores(example, predictions[example.id], version)
    if version == "1.1":
        return {"exact_match": _percent(exact.values()), "f1": _percent(f1.values())}
    raw_exact, raw_f1 = dict(exact), dict(f1)
    if null_odds is not None:
        for example in examples:
            if null_odds.get(example.id, 0.0) > na_prob_threshold:
                exact[example.id] = f1[example.id] = float(example.is_impossible)
    result = _totals(examples, exact, f1, "")
    for prefix, subset in (("HasAns_", [e for e in examples if not e.is_impossible]),
                           ("NoAns_", [e for e in examples if e.is_impossible])):
        if subset:
            result.update(_totals(subset, exact, f1, prefix))
    if null_odds is not None:
        for name, scores in (("exact", raw_exact), ("f1", raw_f1)):
            best, threshold = best_threshold(examples, predictions, scores, null_odds)
            result[f"best_{name}"], result[f"best_{name}_thresh"] = best, threshold
    return result


def best_threshold(examples: list[SquadExample], predictions: dict[str, str], scores: dict[str, float],
                   null_odds: dict[str, float]) -> tuple[float, float]:
    """(best total score in percent, the no-answer threshold that gives it), as the v2.0 script finds it:
    start from predicting no answer everywhere (the unanswerable questions score 1 each), then answer
    the questions one at a time in increasing order of their no-answer odds; an answerable question
    gains its score, an unanswerable one loses 1 if its prediction is not empty."""
    total = best = float(sum(e.is_impossible for e in examples))
    threshold = 0.0
    for example in sorted(examples, key=lambda e: null_odds.get(e.id, 0.0)):
        if example.is_impossible:
            total -= 1.0 if predictions.get(example.id) else 0.0
        else:
            total += scores[example.id]
        if total > best:
            best, threshold = total, null_odds.get(example.id, 0.0)
    return 100.0 * best / max(len(examples), 1), threshold


def _totals(examples: list[SquadExample], exact: dict, f1: dict, prefix: str) -> dict:
    return {f"{prefix}exact": _percent(exact[e.id] for e in examples),
            f"{prefix}f1": _percent(f1[e.id] for e in examples), f"{prefix}total": len(examples)}


def _percent(values) -> float:
    values = list(values)
    return 100.0 * sum(values) / len(values) if values else 0.0
