"""Language-model loss of a long token stream with overlapping windows, under TP and DP.

The windows (`shardlm.eval.windows`) are dealt round-robin over the data-parallel ranks; each rank
runs its windows in batches (the last window may be shorter: it is padded and its padding ignored)
and computes per-token losses with the vocabulary-parallel cross-entropy on its TP slice of the
logits, so logits are never gathered and padding vocabulary entries never count. Only the scored
positions go through the output layer: with stride s of context L, a window needs s of its L rows of
logits, which for a small model is most of the work saved. The summed loss
and the number of scored tokens are then all-reduced over DP (in float64); every rank returns the
same totals, and the token count is checked against the N - 1 targets of the stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardlm.errors import UserError
from shardlm.eval.head import logits_at
from shardlm.eval.windows import Window, evaluation_windows
from shardlm.parallel import vocab_parallel_cross_entropy

IGNORE = -100


@dataclass
class StreamLoss:
    """Totals of one evaluation: `total_loss` (nats, summed over scored tokens), `scored_tokens`."""

    total_loss: float
    scored_tokens: int
    num_windows: int

    @property
    def loss(self) -> float:
        """Mean loss per scored token (nats)."""
        return self.total_loss / max(1, self.scored_tokens)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


def window_batch(tokens: torch.Tensor, windows: Sequence[Window], context: int, pad_id: int):
    """Inputs (B, T) and targets (B, T) of a batch of windows; unscored targets are IGNORE.
    tokens: (N,) int64 on the model's device. T is the longest window of the batch (<= context)."""
    length = max(w.end - w.start for w in windows)
    inputs = torch.full((len(windows), length), pad_id, dtype=torch.long, device=tokens.device)
    targets = torch.full_like(inputs, IGNORE)
    for row, w in enumerate(windows):
        n = w.end - w.start
        inputs[row, :n] = tokens[w.start:w.end]
        targets[row, w.first_scored:n] = tokens[w.start + 1 + w.first_scored:w.end + 1]
    return inputs, targets


@torch.no_grad()
def evaluate_stream(model, tokens: Sequence[int], *, stride: int = 32, context: int | None = None,
                    batch_size: int = 8, progress: bool = False, desc: str = "eval") -> StreamLoss:
    """Summed loss of every token of `tokens` (after the first) under `model`, in overlapping windows.

    model: a `GPT` (its `ctx` gives the TP and DP groups); tokens: the whole stream (same on every
    rank); context: window length (default model.cfg.seq_length); stride: new tokens scored per
    window. Talks to the TP group inside the model and to the DP group once at the end.
    """
    ctx = model.ctx
    context = context or model.cfg.seq_length
    if context > model.cfg.seq_length:
        raise UserError(f"context={context} is longer than the model's seq_length={model.cfg.seq_length}; "
                        "pass a smaller --context")
    windows = evaluation_windows(len(tokens), context, stride)
    mine = windows[ctx.dp_rank::ctx.dp_size]
    stream = torch.as_tensor(list(tokens), dtype=torch.long, device=ctx.device)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # loss sum, scored tokens
    bar = _progress(len(mine), desc, enabled=progress and ctx.is_main)
    for first in range(0, len(mine), batch_size):
        batch = mine[first:first + batch_size]
        inputs, targets = window_batch(stream, batch, context, pad_id=0)
        losses = scored_losses(model, inputs, targets)
        totals[0] += losses.double().sum()
        totals[1] += losses.numel()
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    model.train(was_training)
    ctx.dp.all_reduce(totals)
    scored = int(totals[1].item())
    if scored != max(len(tokens) - 1, 0):
        raise RuntimeError(f"windows scored {scored} tokens, expected {len(tokens) - 1}")
    return StreamLoss(totals[0].item(), scored, len(windows))


def scored_losses(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(M,) fp32 losses of the M positions whose target is not IGNORE. inputs, targets: (B, T).
    Vocabulary-parallel cross-entropy over the TP group; padding entries never count."""
    keep = targets != IGNORE
    logits = logits_at(model, inputs, keep)
    return vocab_parallel_cross_entropy(logits, targets[keep], model.ctx.tp, vocab_size=model.cfg.vocab_size)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="window", dynamic_ncols=True)
