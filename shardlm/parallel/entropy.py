"""The entropy of each position's next-token distribution under the vocabulary-parallel output layer, for logging
(an RL run logs the policy's mean entropy over the completion tokens, as TRL does). No gradient.

Each rank computes each chunk of rows' logits once, over its slice of the vocabulary: its own max m_r per row, and
against it the sum of exponentials s_r = sum exp(z - m_r) and of exponential-weighted logits t_r = sum exp(z - m_r)
(z - m_r). The ranks agree on the row's max M (one all-reduce MAX of N values), then each rescales its sums to it,
s = sum_r exp(m_r - M) s_r and t = sum_r exp(m_r - M) (t_r + (m_r - M) s_r) (one all-reduce SUM of 2 x N values):
H = log s - t / s. Rows run in chunks of about 16 MiB of logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.parallel.comm import Communicator


@torch.no_grad()
def vocab_parallel_entropy(hidden: torch.Tensor, weight: torch.Tensor, tp: Communicator, vocab_size: int,
                           softcap: tuple[float, float] | None = None) -> torch.Tensor:
    """hidden (..., h) replicated over the TP group, weight (V_padded / tp, h) this rank's rows (rows >= `vocab_size`
    globally are padding) -> (...) float32 entropies (nats) of softmax(hidden @ weight.T) over the real vocabulary;
    with `softcap` = (cap, s), of softmax(s tanh(hidden @ weight.T / cap)) (Gemma's soft cap)."""
    def logits(rows: torch.Tensor) -> torch.Tensor:
        z = (rows @ w.t()).float()
        return z if softcap is None else torch.tanh(z / softcap[0]) * softcap[1]

    shape, flat = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
    local, start = weight.shape[0], tp.rank * weight.shape[0]
    real = max(0, min(local, vocab_size - start))
    w = weight[:real].to(flat.dtype)
    n = flat.shape[0]
    rows = max(1, (1 << 22) // max(real, 1))
    local_max = torch.full((n,), float("-inf"), device=flat.device)
    sums = torch.zeros(2, n, dtype=torch.float32, device=flat.device)  # s_r, t_r against this rank's max
    for first in range(0, n if real else 0, rows):
        chunk = slice(first, first + rows)
        z = logits(flat[chunk])
        local_max[chunk] = z.amax(dim=-1)
        shifted = z - local_max[chunk].unsqueeze(-1)
        weights = shifted.exp()
        sums[0, chunk] = weights.sum(dim=-1)
        sums[1, chunk] = (weights * shifted).sum(dim=-1)
    if tp.size > 1:
        row_max = tp.all_reduce(local_max.clone(), op=dist.ReduceOp.MAX)
        gap = local_max - row_max  # -inf where this rank holds no real column (padding only): its share is 0
        scale, held = gap.exp(), sums[0] > 0
        sums = torch.stack((sums[0] * scale, torch.where(held, (sums[1] + gap * sums[0]) * scale, 0.0)))
        tp.all_reduce(sums)
    return (sums[0].log() - sums[1] / sums[0]).view(shape)
