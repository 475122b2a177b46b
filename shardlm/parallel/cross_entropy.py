"""Cross-entropy over vocabulary-parallel logits, without ever gathering them.

Each TP rank holds logits for its vocabulary slice, `(..., V/p)`. Per row the ranks agree on the
max logit (all-reduce MAX), then on the target logit (only the owning rank contributes) and the sum
of exponentials (one all-reduce SUM of both, stacked; a third row of the stack carries the sum of
logits when label smoothing is on). So the loss communicates O(batch x sequence) scalars, whatever
the vocabulary size. The backward, `softmax - onehot`, needs no communication.

Entries at or beyond `vocab_size` (the padding that makes the vocabulary divisible by 128 x TP) are
excluded from the softmax, so the loss never depends on the padding a TP size implies. Label
smoothing spreads its mass over the *full* real vocabulary, not over the local shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.parallel.comm import Communicator


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size, ignore_index, label_smoothing):
        input_dtype = logits.dtype
        local_vocab = logits.shape[-1]
        start = tp.rank * local_vocab
        logits = logits.float()
        padding = None
        if start + local_vocab > vocab_size:  # this shard holds padding entries: mask them out
            padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padding, float("-inf"))

        row_max = logits.max(dim=-1).values
        tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)

        ignored = target == ignore_index
        outside = (target < start) | (target >= start + local_vocab) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        sums = [target_logit, None]
        if label_smoothing > 0:
            real = shifted if padding is None else shifted.masked_fill(padding, 0.0)
            sums.append(real.sum(dim=-1))
        exp = shifted.exp_()  # reuses `shifted`'s storage: from here on it holds exp(logit - max)
        sums[1] = exp.sum(dim=-1)
        stacked = tp.all_reduce(torch.stack(sums))
        target_logit, sum_exp = stacked[0], stacked[1]

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            mean_log_prob = stacked[2] / vocab_size - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored, padding)
        ctx.label_smoothing, ctx.vocab_size, ctx.input_dtype = label_smoothing, vocab_size, input_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored, padding = ctx.saved_tensors
        smoothing = ctx.label_smoothing
        grad = softmax  # saved buffer is not needed again; update it in place
        rows = grad.view(-1, grad.shape[-1])
        flat_target = local_target.view(-1)
        owned = (~outside).view(-1).to(grad.dtype)
        index = torch.arange(rows.shape[0], device=grad.device)
        rows[index, flat_target] -= (1.0 - smoothing) * owned
        if smoothing > 0:
            uniform = torch.full((grad.shape[-1],), smoothing / ctx.vocab_size, device=grad.device)
            if padding is not None:
                uniform = uniform.masked_fill(padding, 0.0)
            grad -= uniform
        grad *= grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: Communicator,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-parallel logits, in fp32.

    logits: (..., V_padded / tp) this rank's vocabulary slice (any float dtype);
    target: (...) int64 global token ids, `ignore_index` where no loss is wanted;
    vocab_size: the real vocabulary size (entries beyond it are padding; default: no padding).
    Returns (...) float32 losses, 0 at ignored positions, equal to
    `F.cross_entropy(full_logits[..., :vocab_size], target, reduction="none", ...)`.
    Talks to the TP group: one all-reduce MAX and one all-reduce SUM of O(batch x sequence) values.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * tp.size
    if tp.size == 1:  # one rank holds the whole vocabulary: PyTorch's fused kernel computes the same
        real = logits[..., :vocab_size].float()
        losses = F.cross_entropy(real.reshape(-1, vocab_size), target.reshape(-1), reduction="none",
                                 ignore_index=ignore_index, label_smoothing=label_smoothing)
        return losses.view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, ignore_index, label_smoothing)

