"""The entropy of each position's next-token distribution under the vocabulary-parallel output layer: logged by an RL
run (the policy's mean entropy over the completion tokens, as TRL logs it) and, with a gradient, its entropy bonus;
and the log of its sum of squared probabilities, log sum p^2 (WPO's weights in a preference run), no gradient.

Each rank computes each chunk of rows' logits z over its slice of the vocabulary: its own max m_r per row, and
against it the sum of exponentials s_r = sum exp(z - m_r) and of exponential-weighted logits t_r = sum exp(z - m_r)
(z - m_r). The ranks agree on the row's max M (one all-reduce MAX of N values), then each rescales its sums to it,
s = sum_r exp(m_r - M) s_r and t = sum_r exp(m_r - M) (t_r + (m_r - M) s_r) (one all-reduce SUM of 2 x N values):
H = log s - t / s, and t / s = E_p[z] - M. log sum p^2 = log q - 2 log s with q = sum exp(2 (z - M)), rescaled
the same way (exp(2 (m_r - M))) and summed in the same all-reduce. Rows run in chunks of about 16 MiB of logits.

The gradient (only when one is wanted: `vocab_parallel_entropy` on tensors that require one, with grad mode on) needs
no communication: dH/dz_j = -p_j (z_j - E_p[z]), p_j = exp(z_j - M - log s), from the three saved per-row values and
the logits recomputed chunk by chunk (never held whole). Each rank's input gradient is its slice's share, summed over
TP by the caller's `f`, as for the output layer itself; its weight gradient is its own rows'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.parallel.comm import Communicator


def _chunk_rows(real: int) -> int:
    return max(1, (1 << 22) // max(real, 1))


def _logits(rows: torch.Tensor, w: torch.Tensor, softcap: tuple[float, float] | None) -> torch.Tensor:
    """(n, h) rows -> (n, real) fp32 logits over this rank's real rows of the vocabulary, capped under `softcap`."""
    z = (rows @ w.t()).float()
    return z if softcap is None else torch.tanh(z / softcap[0]) * softcap[1]


def _entropy_stats(flat: torch.Tensor, w: torch.Tensor, tp: Communicator, softcap: tuple[float, float] | None,
                   squares: bool = False) -> tuple[torch.Tensor, ...]:
    """(N, h) rows, this rank's (real, h) rows of the weight -> each row's global max M, log s and t / s (N,) fp32,
    and with `squares` log sum p^2 (module docstring)."""
    n, real = flat.shape[0], w.shape[0]
    rows = _chunk_rows(real)
    local_max = torch.full((n,), float("-inf"), device=flat.device)
    sums = torch.zeros(3 if squares else 2, n, dtype=torch.float32, device=flat.device)  # s_r, t_r (, q_r)
    for first in range(0, n if real else 0, rows):
        chunk = slice(first, first + rows)
        z = _logits(flat[chunk], w, softcap)
        local_max[chunk] = z.amax(dim=-1)
        shifted = z - local_max[chunk].unsqueeze(-1)
        weights = shifted.exp()
        sums[0, chunk] = weights.sum(dim=-1)
        sums[1, chunk] = (weights * shifted).sum(dim=-1)
        if squares:
            sums[2, chunk] = weights.square_().sum(dim=-1)
    row_max = local_max
    if tp.size > 1:
        row_max = tp.all_reduce(local_max.clone(), op=dist.ReduceOp.MAX)
        gap = local_max - row_max  # -inf where this rank holds no real column (padding only): its share is 0
        scale, held = gap.exp(), sums[0] > 0
        rescaled = [sums[0] * scale, torch.where(held, (sums[1] + gap * sums[0]) * scale, 0.0)]
        if squares:
            rescaled.append(sums[2] * scale.square())
        sums = tp.all_reduce(torch.stack(rescaled))
    stats = (row_max, sums[0].log(), sums[1] / sums[0])
    return stats + ((sums[2].log() - 2 * stats[1],) if squares else ())


def _real_rows(weight: torch.Tensor, tp: Communicator, vocab_size: int) -> torch.Tensor:
    """This rank's rows of the (V_padded / tp, h) output weight that are real vocabulary entries (none past
    `vocab_size`: padding)."""
    return weight[:max(0, min(weight.shape[0], vocab_size - tp.rank * weight.shape[0]))]


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat, weight, tp, vocab_size, softcap):
        device = flat.device.type  # the GEMMs in the autocast dtype (as `F.linear` would run), the same both ways
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else flat.dtype
        with torch.autocast(device, enabled=False):
            rows, w = flat.to(dtype), _real_rows(weight, tp, vocab_size).to(dtype)
            row_max, log_sum, mean_shift = _entropy_stats(rows, w, tp, softcap)
        ctx.save_for_backward(rows, w, row_max, log_sum, mean_shift)
        ctx.softcap, ctx.hidden_dtype = softcap, flat.dtype
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return log_sum - mean_shift

    @staticmethod
    def backward(ctx, grad_entropy):
        flat, w, row_max, log_sum, mean_shift = ctx.saved_tensors
        grad_hidden = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        grad_weight = torch.zeros(ctx.weight_shape, dtype=torch.float32, device=flat.device)
        g = grad_entropy.float()
        with torch.autocast(flat.device.type, enabled=False):
            _entropy_backward(flat, w, row_max, log_sum, mean_shift, g, ctx.softcap, grad_hidden, grad_weight)
        return grad_hidden.to(ctx.hidden_dtype), grad_weight.to(ctx.weight_dtype), None, None, None


def _entropy_backward(flat, w, row_max, log_sum, mean_shift, g, softcap, grad_hidden, grad_weight) -> None:
    """`_VocabParallelEntropy`'s backward, chunk by chunk of rows: the logits recomputed as the forward made them,
    dH/dz = -g p (z - E_p[z]) (through the soft cap's slope), written into the fp32 gradients in place."""
    real = w.shape[0]
    rows = _chunk_rows(real)
    for first in range(0, flat.shape[0] if real else 0, rows):
        chunk = slice(first, first + rows)
        raw = (flat[chunk] @ w.t()).float()
        z = raw if softcap is None else torch.tanh(raw / softcap[0]) * softcap[1]
        shifted = z - row_max[chunk].unsqueeze(-1)
        p = (shifted - log_sum[chunk].unsqueeze(-1)).exp()
        grad_z = p.mul_(shifted.sub_(mean_shift[chunk].unsqueeze(-1))).mul_(-g[chunk].unsqueeze(-1))
        if softcap is not None:  # d(s tanh(z / cap)) / dz = s / cap (1 - tanh^2)
            tanh = z / softcap[1]
            grad_z = grad_z * (1 - tanh * tanh) * (softcap[1] / softcap[0])
        grad_hidden[chunk] = grad_z @ w.float()
        grad_weight[:real] += grad_z.t() @ flat[chunk].float()


def vocab_parallel_entropy(hidden: torch.Tensor, weight: torch.Tensor, tp: Communicator, vocab_size: int,
                           softcap: tuple[float, float] | None = None) -> torch.Tensor:
    """hidden (..., h) replicated over the TP group (after `f`), weight (V_padded / tp, h) this rank's rows (rows >=
    `vocab_size` globally are padding) -> (...) float32 entropies (nats) of softmax(hidden @ weight.T) over the real
    vocabulary; with `softcap` = (cap, s), of softmax(s tanh(hidden @ weight.T / cap)) (Gemma's soft cap). With a
    gradient when grad mode is on and hidden or weight requires one (module docstring); the padding rows get 0."""
    shape, flat = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _VocabParallelEntropy.apply(flat, weight, tp, vocab_size, softcap).view(shape)
    with torch.no_grad():
        _, log_sum, mean_shift = _entropy_stats(flat, _real_rows(weight, tp, vocab_size).to(flat.dtype), tp, softcap)
    return (log_sum - mean_shift).view(shape)


@torch.no_grad()
def vocab_parallel_log_sum_sq_probs(hidden: torch.Tensor, weight: torch.Tensor, tp: Communicator, vocab_size: int,
                                    softcap: tuple[float, float] | None = None) -> torch.Tensor:
    """As `vocab_parallel_entropy`'s arguments -> (...) float32 log sum_v p_v^2 of softmax(hidden @ weight.T) over the
    real vocabulary (WPO's alignment term), without gradient."""
    shape, flat = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
    w = _real_rows(weight, tp, vocab_size).to(flat.dtype)
    return _entropy_stats(flat, w, tp, softcap, squares=True)[3].view(shape)
