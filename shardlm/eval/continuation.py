"""Log-likelihood of continuations under vocabulary-parallel logits, without gathering them.

A request is a pair of token lists (context, continuation). The model reads `context +
continuation` without its last token, keeping the last `seq_length + 1` tokens of a pair that is
too long (as lm-evaluation-harness's `hf` backend does), and only the continuation's positions go
through the output layer. Each rank then holds (M, V_padded / tp) logits for the M scored positions;
the vocabulary-parallel cross-entropy gives -log p(token) and the vocabulary-parallel argmax tells
whether greedy decoding would have produced it, so the full (M, V) logits never exist anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardlm.errors import UserError
from shardlm.eval.head import logits_at
from shardlm.eval.vocab_parallel import vocab_parallel_argmax
from shardlm.parallel import vocab_parallel_cross_entropy


def pack_continuations(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], limit: int,
                       device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A right-padded batch of (context, continuation) pairs, each cut to its last `limit` tokens:
    inputs (B, T) ids, labels (B, T) next ids, scored (B, T) True at the continuation's positions;
    T = the longest pair minus one."""
    sequences = [(list(context) + list(continuation))[-limit:] for context, continuation in pairs]
    length = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(pairs), length, dtype=torch.long)
    labels = torch.zeros_like(inputs)
    scored = torch.zeros(len(pairs), length, dtype=torch.bool)
    for row, (sequence, (_, continuation)) in enumerate(zip(sequences, pairs)):
        n = len(sequence) - 1
        inputs[row, :n] = torch.tensor(sequence[:-1])
        labels[row, :n] = torch.tensor(sequence[1:])
        scored[row, n - len(continuation):n] = True
    return inputs.to(device), labels.to(device), scored.to(device)


@torch.no_grad()
def continuation_logprobs(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
    """(sum of log p(continuation token | preceding tokens), all tokens greedy) for each pair.

    model: a causal LM sharded for its `ctx` (`model.cfg.seq_length`, `model.cfg.vocab_size`,
    `model(tokens)` -> (B, T, V_padded / tp)); pairs: B (context ids, continuation ids), the
    context non-empty. One forward of a (B, T) right-padded batch, T the longest pair minus one;
    right padding never reaches a scored position under causal attention. Talks to the TP group
    (the model's collectives, 2 all-reduces of the cross-entropy and 2 of the argmax, O(M) values).
    Every TP rank must call it with the same pairs; all return the same values.
    """
    ctx, seq_length = model.ctx, model.cfg.seq_length
    if not pairs:
        return []
    for context, continuation in pairs:
        if not context or not continuation:
            raise UserError("a log-likelihood request has an empty context or continuation; "
                            "give both at least one token")
        if len(continuation) > seq_length:
            raise UserError(f"a continuation of {len(continuation)} tokens is longer than the model's "
                            f"seq_length={seq_length}; shorten it")
    inputs, labels, scored = pack_continuations(pairs, seq_length + 1, ctx.device)
    was_training = model.training
    model.eval()
    logits = logits_at(model, inputs, scored)  # (M, V_padded / tp): continuation positions only
    model.train(was_training)
    targets = labels[scored]  # (M,)
    losses = vocab_parallel_cross_entropy(logits, targets, ctx.tp, vocab_size=model.cfg.vocab_size)
    wrong = vocab_parallel_argmax(logits, ctx.tp, model.cfg.vocab_size) != targets
    rows = scored.nonzero()[:, 0]  # the request each scored position belongs to
    logprob = torch.zeros(len(pairs), dtype=torch.float64, device=ctx.device).index_add_(0, rows, -losses.double())
    misses = torch.zeros(len(pairs), device=ctx.device).index_add_(0, rows, wrong.float())
    return [(float(lp), bool(m == 0)) for lp, m in zip(logprob.tolist(), misses.tolist())]
