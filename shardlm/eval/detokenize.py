"""Undo WikiText's tokenization before BPE, exactly as the Megatron-LM zero-shot evaluation does.

WikiText is stored word-tokenized: ` @-@ ` inside hyphenated words, spaces around punctuation and
inside brackets and quotes, `= = Heading = =`, ` 's`. A BPE model trained on raw web text would be
scored on text it never sees, so the paper turns it back into ordinary text first. The rules and
their order follow the reference implementation (`tasks/zeroshot_gpt/detokenizer.py`), so our token
counts and perplexities are comparable with the paper's.
"""

from __future__ import annotations

import re

# (kind, pattern, replacement), applied in this order; kind "str" is a plain substring replace.
WIKITEXT_RULES: tuple[tuple[str, str, str], ...] = (
    # contractions: a plural possessive ("players ' union" -> "players' union")
    ("str", "s '", "s'"),
    # Kept for fidelity with the reference: its slashes make it match only the literal "/' 5/".
    ("re", r"/' [0-9]/", r"/'[0-9]/"),
    # number separators: 1 @,@ 000 -> 1,000; 2 @.@ 5 -> 2.5; well @-@ known -> well-known
    ("str", " @-@ ", "-"),
    ("str", " @,@ ", ","),
    ("str", " @.@ ", "."),
    # no space before punctuation
    ("str", " : ", ": "),
    ("str", " ; ", "; "),
    ("str", " . ", ". "),
    ("str", " ! ", "! "),
    ("str", " ? ", "? "),
    ("str", " , ", ", "),
    # no space just inside brackets and quotes
    ("re", r"\(\s*([^\)]*?)\s*\)", r"(\1)"),
    ("re", r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
    ("re", r"{\s*([^}]*?)\s*}", r"{\1}"),
    ("re", r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    ("re", r"'\s*([^']*?)\s*'", r"'\1'"),
    # headings: "= = Career = =" -> "== Career =="
    ("str", "= = = =", "===="),
    ("str", "= = =", "==="),
    ("str", "= =", "=="),
    # degrees, line edges, WikiText's number placeholder, possessive 's
    ("str", " \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    ("str", " \n", "\n"),
    ("str", "\n ", "\n"),
    ("str", " N ", " 1 "),
    ("str", " 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    """WikiText's word-tokenized text -> ordinary text (the paper's rules, in the reference's order)."""
    for kind, pattern, replacement in WIKITEXT_RULES:
        if kind == "str":
            text = text.replace(pattern, replacement)
        else:
            text = re.sub(pattern, replacement, text)
    return text


def count_original_tokens(raw_text: str) -> int:
    """T_orig of the adjusted perplexity: words of the *tokenized* file, split on single spaces after
    stripping, as the reference counts them (245,566 for WikiText-103 test)."""
    return len(raw_text.strip().split(" "))
