"""WikiText-103 perplexity as the paper reports it: plain and adjusted to the original word count.

The test file is read, detokenized (`shardlm.eval.detokenize`), BPE-tokenized as one stream and
scored with overlapping windows (`shardlm.eval.perplexity`). With L the total loss (nats) over the
N - 1 scored BPE tokens and T_orig the word count of the original tokenized file:

    perplexity          = exp(L / (N - 1))
    adjusted_perplexity = exp(L / (T_orig - 1))

The adjusted figure divides the same total loss by the number of *words*, so it is comparable with
word-level models whatever the tokenizer; it is the number the paper's table gives.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from shardlm.errors import UserError
from shardlm.eval.detokenize import count_original_tokens, wikitext_detokenize
from shardlm.eval.perplexity import evaluate_stream


@dataclass
class WikitextResult:
    """What `shardlm eval wikitext` reports (all ranks get the same values)."""

    bpe_tokens: int
    """N: BPE tokens of the detokenized text."""
    original_tokens: int
    """T_orig: space-separated words of the original file."""
    scored_tokens: int
    """Tokens whose loss was summed: N - 1."""
    total_loss: float
    """Summed loss (nats) over the scored tokens."""
    loss: float
    """total_loss / (N - 1)."""
    perplexity: float
    """exp(loss)."""
    adjusted_perplexity: float
    """exp(total_loss / (T_orig - 1))."""
    context: int
    stride: int
    windows: int

    def to_dict(self) -> dict:
        return asdict(self)


def read_text(path: str | Path, max_lines: int | None = None) -> str:
    """The file's text (its first `max_lines` lines when given); UserError when unreadable."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"evaluation data not found: {path}; pass an existing file with --data")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc.__class__.__name__}; pass a UTF-8 text file") from exc
    if max_lines is not None:
        text = "".join(text.splitlines(keepends=True)[:max_lines])
    return text


def evaluate_wikitext(model, tokenizer, raw_text: str, *, stride: int = 32, context: int | None = None,
                      batch_size: int = 8, progress: bool = False) -> WikitextResult:
    """Perplexity and adjusted perplexity of `model` on WikiText-format `raw_text` (tokenized form).

    model: a `GPT` sharded for its `ctx` (TP inside, windows over DP); tokenizer: the GPT-2 BPE (or
    the model's own); context: window length (default the model's sequence length).
    """
    original = count_original_tokens(raw_text)
    tokens = tokenizer.encode(wikitext_detokenize(raw_text))
    if len(tokens) < 2 or original < 2:
        raise UserError("the evaluation text has fewer than 2 tokens; pass a longer --data file")
    result = evaluate_stream(model, tokens, stride=stride, context=context, batch_size=batch_size,
                             progress=progress, desc="wikitext")
    return WikitextResult(
        bpe_tokens=len(tokens), original_tokens=original, scored_tokens=result.scored_tokens,
        total_loss=result.total_loss, loss=result.loss, perplexity=result.perplexity,
        adjusted_perplexity=math.exp(min(result.total_loss / (original - 1), 700.0)),
        context=context or model.cfg.seq_length, stride=stride, windows=result.num_windows,
    )
