"""Small models with known predictions for the evaluation and generation tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from shardlm.parallel import ParallelContext, vocab_parallel_cross_entropy

PADDING_LOGIT = 50.0  # far above every real logit: counting or predicting padding would show


class BigramModel(nn.Module):
    """A single-rank stand-in for GPT whose logits at a position depend only on that position's token:
    `table[token]` over the real vocabulary, then `padded - vocab` padding entries set to PADDING_LOGIT.
    Implements what the evaluators use: cfg, ctx, forward(tokens[, targets]), full_logits."""

    def __init__(self, table: torch.Tensor, padded_vocab_size: int, seq_length: int = 64):
        super().__init__()
        vocab = table.shape[1]
        self.cfg = SimpleNamespace(seq_length=seq_length, vocab_size=vocab)
        self.ctx = ParallelContext.single()
        padding = torch.full((table.shape[0], padded_vocab_size - vocab), PADDING_LOGIT)
        self.register_buffer("table", torch.cat([table.float(), padding], dim=1))
        self.calls: list[tuple[int, ...]] = []

    def forward(self, tokens, targets=None, ignore_index=-100, cache=None):
        self.calls.append(tuple(tokens.shape))
        logits = self.table[tokens]  # (B, T, V_padded)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.ctx.tp, vocab_size=self.cfg.vocab_size,
                                            ignore_index=ignore_index)

    def full_logits(self, local_logits):
        return local_logits[..., :self.cfg.vocab_size]


class SuccessorModel(BigramModel):
    """Predicts `successor[token]` with logit 10 (others 0), over a vocabulary of `vocab_size` ids."""

    def __init__(self, successor: dict[int, int], vocab_size: int, padded_vocab_size: int, default: int = 0,
                 seq_length: int = 64):
        nn.Module.__init__(self)
        self.cfg = SimpleNamespace(seq_length=seq_length, vocab_size=vocab_size)
        self.ctx = ParallelContext.single()
        self.padded = padded_vocab_size
        self.successor = successor
        self.default = default
        self.calls = []

    def forward(self, tokens, targets=None, ignore_index=-100, cache=None):
        self.calls.append(tuple(tokens.shape))
        predicted = tokens.clone().apply_(lambda t: self.successor.get(t, self.default))
        logits = torch.zeros(*tokens.shape, self.padded)
        logits.scatter_(-1, predicted.unsqueeze(-1), 10.0)
        logits[..., self.cfg.vocab_size:] = PADDING_LOGIT
        return logits
