"""The entropy of each position's next-token distribution under the vocabulary-parallel output layer, for logging
(an RL run logs the policy's mean entropy over the completion tokens, as TRL does). No gradient.

Each TP rank holds its slice of the vocabulary; the ranks agree on each row's max (one all-reduce MAX of N values)
and on the sum of exponentials and of exponential-weighted logits (one all-reduce SUM of 2 x N values):
H = log sum exp(z - m) - sum exp(z - m) (z - m) / sum exp(z - m). Rows run in chunks of about 16 MiB of logits.
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
    row_max = torch.full((n,), float("-inf"), device=flat.device)
    for first in range(0, n if real else 0, rows):
        row_max[first:first + rows] = logits(flat[first:first + rows]).amax(dim=-1)
    tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
    sums = torch.zeros(2, n, dtype=torch.float32, device=flat.device)  # sum exp(z - m), sum exp(z - m) (z - m)
    for first in range(0, n if real else 0, rows):
        chunk = slice(first, first + rows)
        shifted = logits(flat[chunk]) - row_max[chunk].unsqueeze(-1)
        weights = shifted.exp()
        sums[0, chunk] = weights.sum(dim=-1)
        sums[1, chunk] = (weights * shifted).sum(dim=-1)
    tp.all_reduce(sums)
    return (sums[0].log() - sums[1] / sums[0]).view(shape)
