"""A small rule-based sentence splitter for BERT preprocessing (no model, nothing to download).

A sentence ends at `.`, `!` or `?` (optionally followed by closing quotes or brackets) when
whitespace and then an upper-case letter, a digit or an opening quote/bracket follow, unless the
word before the period is a known abbreviation ("Mr.", "e.g.") or a single letter (an initial, as
in "J. R. R. Tolkien"). Blank lines always end a sentence. It is wrong on some text, as every
rule-based splitter is; for BERT's sentence pairs a rare bad split costs little.
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf al fig no vol pp ch ed eds gen col lt sgt capt "
    "rev gov sen rep jan feb mar apr jun jul aug sep sept oct nov dec inc ltd co corp u.s u.k".split()
)
_BOUNDARY = re.compile(r"""([.!?]+["'”’)\]]*)(\s+)(?=["'“‘(\[]?[A-Z0-9])""")
_BLANK_LINES = re.compile(r"\n\s*\n")
_LAST_WORD = re.compile(r"(\S+)$")


def _is_abbreviation(text_before: str) -> bool:
    match = _LAST_WORD.search(text_before)
    if match is None:
        return False
    word = match.group(1).lstrip("\"'“‘([").rstrip(".").lower()
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, stripped, in order; empty input gives an empty list."""
    sentences: list[str] = []
    for block in _BLANK_LINES.split(text):
        start = 0
        for match in _BOUNDARY.finditer(block):
            end = match.end(1)
            if match.group(1) == "." and _is_abbreviation(block[start:match.start(1)]):
                continue
            sentence = block[start:end].strip()
            if sentence:
                sentences.append(sentence)
            start = match.end(2)
        tail = block[start:].strip()
        if tail:
            sentences.append(tail)
    return sentences
