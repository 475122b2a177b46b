"""BERT's masked-language-model corruption, with whole-word n-gram masking (the paper's BERT recipe).

Of the maskable positions (everything but [CLS]/[SEP]), `mask_prob` (15%) are chosen for
prediction. Units are whole words when `whole_word` (a WordPiece `##` piece joins the word before
it), and spans of 1..`max_ngram` consecutive units are drawn with probability proportional to 1/n,
as in Megatron-LM's n-gram masking. Each chosen position becomes [MASK] with probability 0.8, a
uniformly random vocabulary id with 0.1, and stays unchanged with 0.1; its label is the original id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE_LABEL = -100


@dataclass
class MaskingConfig:
    """How tokens are chosen and corrupted for the masked-LM loss."""

    mask_prob: float = 0.15  # fraction of maskable tokens to predict
    mask_token_prob: float = 0.8  # chosen tokens replaced by [MASK]
    random_token_prob: float = 0.1  # chosen tokens replaced by a random id (the rest stay as they are)
    whole_word: bool = True  # mask all WordPiece pieces of a word together
    max_ngram: int = 3  # spans of up to this many words (1 = single words)


def continuation_flags(tokenizer) -> np.ndarray:
    """(vocab_size,) bool: True for WordPiece continuation pieces (`##...`)."""
    flags = np.zeros(tokenizer.vocab_size, dtype=bool)
    for token_id in range(tokenizer.vocab_size):
        token = tokenizer.id_to_token(token_id)
        flags[token_id] = bool(token) and token.startswith("##")
    return flags


def word_spans(tokens: np.ndarray, maskable: np.ndarray, is_continuation: np.ndarray | None) -> list[list[int]]:
    """Positions grouped into maskable units (words if `is_continuation` is given, else single tokens)."""
    spans: list[list[int]] = []
    for position in np.flatnonzero(maskable):
        joins = (is_continuation is not None and spans and spans[-1][-1] == position - 1
                 and is_continuation[tokens[position]])
        if joins:
            spans[-1].append(int(position))
        else:
            spans.append([int(position)])
    return spans


def mask_tokens(
    tokens: np.ndarray, maskable: np.ndarray, config: MaskingConfig, mask_id: int, vocab_size: int,
    rng: np.random.Generator, is_continuation: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupt `tokens` (L,) for masked LM; returns (corrupted tokens (L,), labels (L,) with -100 elsewhere).

    `maskable` (L,) bool marks positions that may be chosen (not [CLS]/[SEP]/padding).
    """
    spans = word_spans(tokens, maskable, is_continuation if config.whole_word else None)
    budget = max(1, int(round(int(maskable.sum()) * config.mask_prob)))
    ngram_sizes = np.arange(1, config.max_ngram + 1)
    ngram_probs = 1.0 / ngram_sizes
    ngram_probs /= ngram_probs.sum()
    chosen = np.zeros(len(tokens), dtype=bool)
    count = 0
    for start in rng.permutation(len(spans)):
        if count >= budget:
            break
        n = int(rng.choice(ngram_sizes, p=ngram_probs))
        positions = [p for span in spans[start:start + n] for p in span]
        # Fall back to shorter spans when the longer one would overshoot the budget.
        while n > 1 and count + len(positions) > budget:
            n -= 1
            positions = [p for span in spans[start:start + n] for p in span]
        if chosen[positions].any() or count + len(positions) > budget:
            continue
        chosen[positions] = True
        count += len(positions)
    labels = np.full(len(tokens), IGNORE_LABEL, dtype=np.int64)
    labels[chosen] = tokens[chosen]
    corrupted = tokens.astype(np.int64).copy()
    positions = np.flatnonzero(chosen)
    draws = rng.random(len(positions))
    to_mask = positions[draws < config.mask_token_prob]
    to_random = positions[(draws >= config.mask_token_prob)
                          & (draws < config.mask_token_prob + config.random_token_prob)]
    corrupted[to_mask] = mask_id
    corrupted[to_random] = rng.integers(0, vocab_size, size=len(to_random))
    return corrupted, labels
