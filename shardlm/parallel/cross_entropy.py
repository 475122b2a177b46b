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


def _rows_per_chunk(vocab: int) -> int:
    """Rows of fp32 logits per chunk, about 16 MiB: large enough that the few elementwise calls per
    chunk cost nothing next to their work (smaller chunks measured no faster on one thread, and slower
    on two threads of a busy machine, where every parallel region waits for both)."""
    return max(1, (1 << 22) // vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    """The output layer and the cross-entropy in one function (one rank holds the whole vocabulary).

    Forward: one GEMM writes the logits (N, V) in the compute dtype; then, a few rows at a time in
    fp32, each row's log-sum-exp and loss are taken and the row is overwritten by its gradient
    `softmax - onehot`, so the logits are never copied, sliced or held in fp32 as a whole. Backward:
    the per-row loss gradients g scale the (N, h) side of each GEMM, dL/dh = g (G W) and
    dL/dW = G^T (g h), never the (N, V) buffer G.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, ignore_index):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), weight[:vocab_size].to(dtype)  # padding rows are never multiplied
            grad = h @ w.t()  # (N, V): the logits, overwritten below by their gradient
            ignored = target == ignore_index
            safe_target = target.masked_fill(ignored, 0)
            losses = torch.empty(h.shape[0], dtype=torch.float32, device=hidden.device)
            rows = _rows_per_chunk(vocab_size)
            for start in range(0, h.shape[0], rows):
                block = grad[start:start + rows]
                x = block.float()  # `block` itself in fp32; an fp32 copy of these rows otherwise
                t = safe_target[start:start + rows].unsqueeze(-1)
                x -= x.max(dim=-1, keepdim=True).values
                target_logit = x.gather(-1, t).squeeze(-1)
                sum_exp = x.exp_().sum(dim=-1, keepdim=True)
                losses[start:start + rows] = sum_exp.squeeze(-1).log() - target_logit
                x.div_(sum_exp).scatter_add_(-1, t, torch.full_like(t, -1.0, dtype=x.dtype))
                if x.data_ptr() != block.data_ptr():
                    block.copy_(x)
        ctx.save_for_backward(grad, h, w, ignored)
        ctx.hidden_dtype, ctx.weight_shape, ctx.weight_dtype = hidden.dtype, weight.shape, weight.dtype
        return losses.masked_fill_(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_losses):
        grad, h, w, ignored = ctx.saved_tensors
        scale = grad_losses.float().masked_fill(ignored, 0.0).unsqueeze(-1)  # (N, 1)
        grad_hidden = grad_weight = None
        with torch.autocast(h.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_hidden = (grad @ w).float().mul_(scale).to(ctx.hidden_dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = torch.empty(ctx.weight_shape, dtype=ctx.weight_dtype, device=h.device)
                real, padding = grad_weight[:grad.shape[1]], grad_weight[grad.shape[1]:]  # contiguous row ranges
                scaled_hidden = (h.float() * scale).to(h.dtype)
                if h.dtype == ctx.weight_dtype:
                    torch.mm(grad.t(), scaled_hidden, out=real)  # (V, h), written in place
                else:
                    real.copy_(grad.t() @ scaled_hidden)
                padding.zero_()  # padding rows get zero gradient
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_size: int,
                         ignore_index: int = -100) -> torch.Tensor:
    """Per-token fp32 cross-entropy of the output layer `hidden @ weight.T`, fused (one TP rank only).

    hidden: (..., h); weight: (V_padded, h), rows >= `vocab_size` being padding; target: (...) int64.
    Returns (...) float32 losses, 0 at `ignore_index`, equal to
    `F.cross_entropy(F.linear(hidden, weight)[..., :vocab_size], target, reduction="none")`, computed in
    the autocast dtype when autocast is on (as `F.linear` would be) with the softmax in fp32. The full
    logits exist once, in the compute dtype, and become their own gradient; no communication.
    """
    losses = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1),
                                       vocab_size, ignore_index)
    return losses.view(target.shape)
