"""N-gram overlap of an evaluation set with a training corpus (the paper's contamination check).

Text is lower-cased and cut into word tokens (`corpus.words`); n-grams never cross documents.
The report gives the percentage of the evaluation set's n-gram occurrences whose n-gram also
occurs somewhere in the training corpus (the paper reports at most 10.8% of WikiText-103 test and
1.4% of LAMBADA 8-grams), and the same over distinct n-grams. Only the evaluation n-grams are held
in memory; the training corpus streams through.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from shardlm.data.corpus import progress_iter, words
from shardlm.data.documents import iter_documents


@dataclass
class OverlapReport:
    """Counts and percentages of evaluation n-grams found in the training corpus."""

    ngram: int
    eval_ngrams: int  # occurrences in the evaluation set
    eval_unique_ngrams: int
    overlapping_ngrams: int  # occurrences whose n-gram is in the training corpus
    overlapping_unique_ngrams: int
    percent: float  # 100 * overlapping_ngrams / eval_ngrams
    percent_unique: float

    def to_dict(self) -> dict:
        return asdict(self)


def ngrams(text: str, n: int) -> Iterable[tuple[str, ...]]:
    tokens = words(text)
    return (tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def overlap_report(
    eval_path: str | Path, train_paths: Sequence[str | Path], ngram: int = 8, json_key: str = "text",
    txt_mode: str = "paragraph", progress: bool = True,
) -> OverlapReport:
    """Percentage of `eval_path`'s word `ngram`-grams that also occur in the files `train_paths`."""
    eval_counts: Counter[tuple[str, ...]] = Counter()
    for document in iter_documents(eval_path, json_key=json_key, txt_mode=txt_mode):
        eval_counts.update(ngrams(document.text, ngram))
    found: set[tuple[str, ...]] = set()
    for train_path in train_paths:
        documents = iter_documents(train_path, json_key=json_key, txt_mode=txt_mode)
        for document in progress_iter(documents, f"overlap {Path(train_path).name}", progress):
            found.update(g for g in ngrams(document.text, ngram) if g in eval_counts)
    total = sum(eval_counts.values())
    overlapping = sum(eval_counts[g] for g in found)
    return OverlapReport(
        ngram=ngram, eval_ngrams=total, eval_unique_ngrams=len(eval_counts),
        overlapping_ngrams=overlapping, overlapping_unique_ngrams=len(found),
        percent=100.0 * overlapping / max(total, 1), percent_unique=100.0 * len(found) / max(len(eval_counts), 1),
    )
