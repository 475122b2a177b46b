"""The output layer and the vocabulary-parallel cross-entropy as one function, for training.

Unfused, the output layer writes the logits (N, V/p) and the loss then reads and writes them again
and again: a max, a shifted copy, an exponential, a sum, a division, and in the backward the one-hot
subtraction and the scaling by the loss gradient (at TP=1, PyTorch's log-softmax, an NLL gradient
filled with zeros and, with a padded vocabulary, a copy of the real columns and a zero-filled
gradient for the slice). Here one GEMM writes this rank's logits over its *real* vocabulary rows in
the compute dtype, and a few passes turn that buffer into its own gradient `softmax - onehot`, a
chunk of rows at a time in fp32, so the logits are never copied, sliced or held in fp32 as a whole.
On a GPU and in half precision, the GEMMs' width is the real rows rounded up to a multiple of 64
(`_gemm_width`; the padding columns take no part in the softmax and get zero gradient).
The backward scales the (N, h) side of its two GEMMs by the per-token loss gradients g:
dL/dh = g (G W) and dL/dW = G^T (g h).

The vocabulary-parallel semantics are those of `vocab_parallel_cross_entropy`: each TP rank holds
its slice of the vocabulary and the logits are never gathered; the ranks agree on each row's max
(one all-reduce MAX of N values) and on the target logit and the sum of exponentials (one all-reduce
SUM of 2 x N values). The input gradient is all-reduced by `f` (the caller's
`copy_to_tensor_parallel` or sequence-parallel all-gather), as for the unfused output layer.

With a soft cap (Gemma's `final_logit_softcap`: the loss is over s tanh(z / cap) of the logits z, s = cap / the
temperature) the capped values are made chunk by chunk from the logits too: the rows' max is the cap of the
uncapped max (tanh is increasing), and the gradient softmax - onehot is multiplied by s / cap (1 - tanh^2), so
the unfused path's (B, T, V) copies (the divided, the tanh, the scaled logits and their gradients) never exist.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.parallel import invariant
from shardlm.parallel.comm import Communicator


def _rows_per_chunk(vocab: int, device: torch.device) -> int:
    """Rows of fp32 logits per chunk: about 16 MiB on the CPU, large enough that the few elementwise
    calls per chunk cost nothing next to their work (smaller chunks measured no faster on one thread,
    and slower on two threads of a busy machine, where every parallel region waits for both); 512 MiB
    on a GPU, where each call is a kernel launch: 16 MiB chunks would be about 600 launches per
    micro-batch of 8,192 tokens at GPT-2's vocabulary."""
    budget = 1 << 22 if device.type == "cpu" else 1 << 27
    return max(1, budget // max(1, vocab))


def _gemm_width(real: int, local: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows of this rank's weight that the GEMMs multiply: the `real` ones, rounded up to a multiple of
    64 (never past the `local` rows) except for fp32 on the CPU. At an odd width such as GPT-2's
    50,257, cuBLAS falls back to unaligned kernels, which ran the three head GEMMs 5-7x slower on an
    H200, and oneDNN's bf16 head + loss ran 11% slower on the CPU (paired, 2 threads, 2,048 tokens,
    hidden 512). MKL's fp32 GEMM showed no difference, so fp32 on the CPU keeps the exact width."""
    if device.type == "cpu" and dtype == torch.float32:
        return real
    return min(local, -(-real // 64) * 64)


def _exp_to_gradient(x: torch.Tensor, block: torch.Tensor, sum_exp: torch.Tensor, outside: torch.Tensor,
                     local_target: torch.Tensor) -> None:
    """Rows x = exp(logit - max) (fp32) -> softmax - onehot, written into `block` (x itself, or the
    half-precision rows x was copied from). Targets outside this rank's vocabulary get no -1."""
    x.div_(sum_exp.unsqueeze(-1))
    x.scatter_add_(-1, local_target, (~outside).to(x.dtype).neg_().unsqueeze(-1))
    if x.data_ptr() != block.data_ptr():
        block.copy_(x)


def _capped(logits: torch.Tensor, softcap: tuple[float, float],
            in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits z (any dtype) -> fp32 (s tanh(z / cap), tanh(z / cap)), two new tensors; softcap = (cap, s).
    `in_place` (fp32 logits no longer needed): tanh(z / cap) is made in the logits' own storage."""
    cap, scale = softcap
    if in_place:
        tanh = logits.div_(cap)
    else:
        tanh = logits.float().div_(cap) if logits.dtype != torch.float32 else logits / cap
    tanh.tanh_()
    return tanh * scale, tanh


def _slope_times_into(tanh: torch.Tensor, x: torch.Tensor, softcap: tuple[float, float]) -> torch.Tensor:
    """tanh := x d(s tanh(z / cap)) / dz = x s / cap (1 - tanh^2) in place, x the gradient of the capped values
    (three passes); returns tanh."""
    cap, scale = softcap
    return torch.addcmul(x, x, tanh.square_(), value=-1.0, out=tanh).mul_(scale / cap)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, tp, vocab_size, ignore_index, softcap):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        local, start = weight.shape[0], tp.rank * weight.shape[0]
        real = max(0, min(local, vocab_size - start))  # this shard's rows of the real vocabulary
        width = _gemm_width(real, local, dtype, hidden.device)
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), weight[:width].to(dtype)
            logits = invariant.matmul(h, w.t()) if invariant.enabled() else h @ w.t()  # (N, width)
            grad = logits[:, :real]  # the real logits, turned into their gradient below
            ignored = target == ignore_index
            outside = (target < start) | (target >= start + real) | ignored
            local_target = (target - start).masked_fill(outside, 0).unsqueeze(-1)
            n, rows = h.shape[0], _rows_per_chunk(real, h.device)
            whole = tp.size == 1  # every row is complete here: one pass per chunk, nothing to agree on in between
            in_place = grad.dtype == torch.float32  # fp32 logits are worked on where they are
            row_max = torch.full((n,), float("-inf"), device=hidden.device)
            if real and not whole:
                row_max = grad.amax(dim=-1).float()
                if softcap:  # the capped values' max is the cap of the max
                    row_max = _capped(row_max, softcap)[0]
            tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
            sums = torch.zeros(2, n, dtype=torch.float32, device=hidden.device)  # target logit, sum of exp
            for first in range(0, n if real else 0, rows):
                chunk = slice(first, first + rows)
                if softcap:  # the logits stay for the second pass (TP); at one rank fp32 tanh replaces them
                    x, tanh = _capped(grad[chunk], softcap, in_place=whole and in_place)
                else:
                    x = grad[chunk].float()  # the rows themselves in fp32, else an fp32 copy of them
                x -= (x.amax(dim=-1) if whole else row_max[chunk]).unsqueeze(-1)
                sums[0, chunk] = x.gather(-1, local_target[chunk]).squeeze(-1)
                sums[1, chunk] = x.exp_().sum(dim=-1)
                if whole and softcap:
                    _exp_to_gradient(x, x, sums[1, chunk], outside[chunk], local_target[chunk])
                    slope = _slope_times_into(tanh, x, softcap)
                    if not in_place:  # (in place, tanh is grad[chunk] and the gradient is already there)
                        grad[chunk].copy_(slope)
                elif whole:
                    _exp_to_gradient(x, grad[chunk], sums[1, chunk], outside[chunk], local_target[chunk])
            sums[0].masked_fill_(outside, 0.0)
            tp.all_reduce(sums)
            target_logit, sum_exp = sums[0], sums[1]
            for first in range(0, 0 if whole or not real else n, rows):
                chunk = slice(first, first + rows)
                block = grad[chunk]  # fp32: holds exp() from the pass above; else recompute it, not round it twice
                if softcap:  # the block still holds the logits: recompute the capped values and their slope
                    x, tanh = _capped(block, softcap)
                    x.sub_(row_max[chunk].unsqueeze(-1)).exp_()
                    _exp_to_gradient(x, x, sum_exp[chunk], outside[chunk], local_target[chunk])
                    block.copy_(_slope_times_into(tanh, x, softcap))
                    continue
                x = block if in_place else block.float().sub_(row_max[chunk].unsqueeze(-1)).exp_()
                _exp_to_gradient(x, block, sum_exp[chunk], outside[chunk], local_target[chunk])
            losses = (sum_exp.log() - target_logit).masked_fill_(ignored, 0.0)
            logits[:, real:].zero_()  # padding columns: no gradient
        ctx.save_for_backward(logits, h, w, ignored)
        ctx.hidden_dtype, ctx.weight_shape, ctx.weight_dtype = hidden.dtype, weight.shape, weight.dtype
        return losses

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
                rows, padding = grad_weight[:grad.shape[1]], grad_weight[grad.shape[1]:]  # contiguous row ranges
                scaled_hidden = (h.float() * scale).to(h.dtype)
                if h.dtype == ctx.weight_dtype:
                    torch.mm(grad.t(), scaled_hidden, out=rows)  # (width, h), written in place
                else:
                    rows.copy_(grad.t() @ scaled_hidden)
                padding.zero_()  # padding rows beyond the GEMM's width get zero gradient
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, tp: Communicator,
                         vocab_size: int, ignore_index: int = -100,
                         softcap: tuple[float, float] | None = None) -> torch.Tensor:
    """Per-token fp32 cross-entropy of the vocabulary-parallel output layer `hidden @ weight.T`, fused.

    hidden: (..., h), replicated over the TP group (after `f`); weight: (V_padded / tp, h), this rank's
    rows of the (tied) output layer, global rows >= `vocab_size` being padding; target: (...) int64
    global token ids. Returns (...) float32 losses, 0 at `ignore_index`, equal to
    `vocab_parallel_cross_entropy(F.linear(hidden, weight), target, tp, vocab_size, ignore_index)`,
    computed in the autocast dtype when autocast is on (as `F.linear` would be), the softmax in fp32.
    Talks to the TP group: one all-reduce MAX of N values and one all-reduce SUM of 2 x N values.
    `softcap` = (cap, s): the loss of softmax(s tanh(logits / cap)) instead (Gemma's soft cap, s = cap / the
    temperature), equal to the unfused path over the capped logits.
    """
    hidden, flat = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        if hidden.device.type == "cpu":  # only the rows with a target (chat and RL rows mask their prompts); on a GPU
            kept = (flat != ignore_index).nonzero().squeeze(-1)  # the count would cost a synchronization
            if 0 < len(kept) < len(flat):  # (none kept: the whole rows, so the loss still reaches the weights)
                losses = torch.zeros(flat.shape, dtype=torch.float32, device=hidden.device)
                part = _LinearCrossEntropy.apply(hidden[kept], weight, flat[kept], tp, vocab_size, ignore_index,
                                                 softcap)
                return losses.index_put((kept,), part).view(target.shape)
        return _LinearCrossEntropy.apply(hidden, weight, flat, tp, vocab_size, ignore_index, softcap).view(
            target.shape)
    # No gradient (an evaluation, a preference run's reference pass): only the rows with a target get logits, a
    # vocabulary's worth each; chat rows spend a third or more of their tokens on prompts and padding. Every TP
    # rank holds the same targets, so all keep the same rows (or, with none, all skip the collectives).
    kept = (flat != ignore_index).nonzero().squeeze(-1)
    losses = torch.zeros(flat.shape, dtype=torch.float32, device=hidden.device)
    if len(kept):
        losses[kept] = _LinearCrossEntropy.apply(hidden[kept], weight, flat[kept], tp, vocab_size, ignore_index,
                                                 softcap)
    return losses.view(target.shape)
