"""SQuAD inputs as the standard BERT recipe builds them: `[CLS] question [SEP] context window [SEP]`.

- The question is cut to `max_query_length` WordPieces (64 by default).
- The context is tokenized once, keeping each WordPiece's character offsets in the original
  context (the `tokenizers` library's encodings carry them). A context longer than the room left,
  `seq_length - len(question) - 3` tokens, is cut into windows that start `doc_stride` tokens apart,
  the last one ending at the context's end, so every context token is in at least one window.
- A token appearing in several windows is scored only in the window where it has the most context
  on both sides (`min(left, right) + 0.01 * window length`, as the recipe does): `max_context`.
- Answers are aligned from characters to tokens: the first token that ends after the answer's first
  character, the last token that starts before its end. A training window that does not contain
  the whole answer, and every window of an unanswerable question, points both positions at [CLS]
  (position 0), which is how the model learns "no answer".
- Predicted spans go back to text through the offsets, `context[start_char:end_char]`, so the answer
  keeps the context's own spelling and spacing (not detokenized WordPieces).

Every window of every question is one row (a "feature") of a `SquadFeatures`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardlm.errors import UserError
from shardlm.finetune.inputs import TaskData, pair_row
from shardlm.finetune.squad_data import SquadExample

NO_OFFSET = -1


@dataclass
class SquadFeatures:
    """The windows of a list of questions. `data` holds the model inputs, (F, L) each, and in `labels`
    (F, 2) the start and end token positions of the answer (0, 0: [CLS], no answer in this window).
    `example_index` (F,) says which question a window belongs to; `offsets` (F, L, 2) the character
    span [start, end) of each context token in its context (-1 for question, special and padding
    tokens); `max_context` (F, L) bool marks the tokens this window scores (see the module docstring)."""

    data: TaskData
    example_index: np.ndarray
    offsets: np.ndarray
    max_context: np.ndarray

    def __len__(self) -> int:
        return len(self.data)


def tokenize_with_offsets(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(WordPiece ids, [(start_char, end_char)] per token) of each text, no special tokens added."""
    encodings = tokenizer.backend.encode_batch(list(texts), add_special_tokens=False)
    return [(e.ids, [tuple(o) for o in e.offsets]) for e in encodings]


def char_span_to_tokens(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """Token positions (first, last) covering characters [start, end) of the text, or None when no
    token overlaps it (an answer made only of characters the tokenizer drops, e.g. spaces)."""
    first = next((i for i, (_, e) in enumerate(offsets) if e > start), None)
    last = next((i for i in range(len(offsets) - 1, -1, -1) if offsets[i][0] < end), None)
    if first is None or last is None or last < first:
        return None
    return first, last


def context_windows(num_tokens: int, room: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of the windows over `num_tokens` context tokens: `room` tokens at most each,
    starting `doc_stride` apart, until one reaches the end (one window for a short context)."""
    windows, start = [], 0
    while True:
        length = min(room, num_tokens - start)
        windows.append((start, length))
        if start + length >= num_tokens:
            return windows
        start += min(length, doc_stride)


def max_context_windows(windows: list[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """(num_tokens,) the window in which each context token has its most context: the largest
    min(tokens left of it, tokens right of it) + 0.01 x window length, the first such window on ties."""
    starts, lengths = (np.asarray(v)[:, None] for v in zip(*windows))  # (W, 1) each
    position = np.arange(num_tokens)[None, :]  # (1, n)
    score = np.minimum(position - starts, starts + lengths - 1 - position) + 0.01 * lengths
    inside = (position >= starts) & (position < starts + lengths)
    return np.where(inside, score, -np.inf).argmax(0)


def encode_squad(examples: list[SquadExample], tokenizer, seq_length: int, doc_stride: int = 128,
                 max_query_length: int = 64, training: bool = False) -> SquadFeatures:
    """Questions -> their windows (see the module docstring). With `training`, answerable questions
    get the token span of their first answer in the windows that contain all of it."""
    room = seq_length - 3 - min(max_query_length, seq_length)
    if room < 1 or doc_stride < 1:
        raise UserError(f"--seq-length={seq_length}, --max-qa-length={max_query_length} and --doc-stride="
                        f"{doc_stride} leave no room for the context; use a longer sequence or a shorter question")
    contexts = {}
    for example in examples:
        contexts.setdefault(example.context, None)
    tokenized = dict(zip(contexts, tokenize_with_offsets(tokenizer, list(contexts))))
    questions = tokenizer.encode_batch([e.question for e in examples])
    rows, labels, owners, offsets, max_context = [], [], [], [], []
    for index, (example, question) in enumerate(zip(examples, questions)):
        question = question[:max_query_length]
        ids, char_offsets = tokenized[example.context]
        answer = None
        if training and example.answers:
            first = example.answers[0]
            answer = char_span_to_tokens(char_offsets, first.start, first.start + len(first.text))
        windows = context_windows(len(ids), seq_length - 3 - len(question), doc_stride)
        shift = len(question) + 2  # [CLS] question [SEP] come before the window
        best_window = max_context_windows(windows, len(ids))
        for number, (start, length) in enumerate(windows):
            rows.append(pair_row(question, ids[start:start + length], seq_length, tokenizer.cls, tokenizer.sep,
                                 tokenizer.pad))
            span = (0, 0)
            if answer is not None and start <= answer[0] and answer[1] < start + length:
                span = (answer[0] - start + shift, answer[1] - start + shift)
            labels.append(span)
            owners.append(index)
            window_offsets = np.full((seq_length, 2), NO_OFFSET, dtype=np.int32)
            window_offsets[shift:shift + length] = char_offsets[start:start + length] if length else NO_OFFSET
            offsets.append(window_offsets)
            scored = np.zeros(seq_length, dtype=bool)
            scored[shift:shift + length] = best_window[start:start + length] == number
            max_context.append(scored)
    data = _stack(rows, labels, seq_length)
    return SquadFeatures(data, np.asarray(owners, dtype=np.int64),
                         np.stack(offsets) if offsets else np.zeros((0, seq_length, 2), np.int32),
                         np.stack(max_context) if max_context else np.zeros((0, seq_length), bool))


def _stack(rows: list[tuple], labels: list[tuple[int, int]], seq_length: int) -> TaskData:
    """`pair_row` rows and (start, end) labels -> TaskData of (F, L) arrays and (F, 2) labels."""
    arrays = [np.asarray([r[k] for r in rows]).reshape(len(rows), seq_length) for k in range(3)]
    return TaskData(arrays[0].astype(np.int32), arrays[1].astype(np.int8), arrays[2].astype(np.int8),
                    np.asarray(labels, dtype=np.int64).reshape(len(rows), 2))


def span_text(context: str, offsets: np.ndarray, start: int, end: int) -> str:
    """The context's text from token `start` to token `end` (inclusive) of one window, through the
    (L, 2) character offsets of its tokens."""
    return context[int(offsets[start, 0]):int(offsets[end, 1])]
