"""Importance-weighted on-policy distillation (IW-OPD; TRL's `IWOPDTrainer`, `distillation_objective="iw_opd"`):
the per-token reverse KL of on-policy distillation with each answer token's advantage weighted by how much of its
document's disagreement with the teacher is still ahead of it.

Per answer token i of a document, with s_i and t_i the student's and the teacher's log-probabilities of the token
at the distillation temperature (the student's taken as the sampler's: in-process generation makes them equal):

    a_i = t_i - s_i                                     (no gradient)
    w_i = 1 + gamma (1 - P_i / max(S, epsilon))          P_i = sum_{j < i} |a_j|, S = sum_j |a_j| over the document
    loss_i = -w_i a_i s_i                                (gradient -w_i a_i grad s_i)

so the first tokens, where a wrong turn costs the whole rest of the answer, weigh up to 1 + gamma and the last
ones 1. TRL sums over a row's completion; a packed row holds several documents, each summed alone (a prompt's
tokens add 0). Under context parallelism a document's tokens lie on every CP rank (the zigzag split), so the |a|
of the whole rows are gathered over CP before the sums (`prefix_weights`).
"""

from __future__ import annotations

import torch

from shardlm.data.zigzag import zigzag_split
from shardlm.models.documents import Documents
from shardlm.parallel import Communicator
from shardlm.parallel.mappings import gather_zigzag_rows

METRICS = ("iw_opd/mean_advantage", "iw_opd/mean_abs_advantage", "iw_opd/mean_weight")
"""The step's means over the global batch's answer tokens (TRL's names), beside `iw_opd/min_weight` and
`iw_opd/max_weight`."""


def prefix_weights(size: torch.Tensor, documents: Documents | None, cp: Communicator, gamma: float,
                   epsilon: float) -> torch.Tensor:
    """size (B, T_local) each token's |a| (0 off the answer tokens; this CP rank's zigzag part) -> (B, T_local) the
    weights w (module docstring) of this rank's tokens, each document's sums taken over its whole length. Without
    `documents` each row is one document."""
    whole = gather_zigzag_rows(size.detach(), cp)
    weights = torch.ones_like(whole)
    rows = documents.offsets if documents is not None else [[0, whole.shape[1]]] * whole.shape[0]
    for b, offsets in enumerate(rows):
        for start, end in zip(offsets, offsets[1:]):
            part = whole[b, start:end]
            before = part.cumsum(0) - part
            weights[b, start:end] = 1.0 + gamma * (1.0 - before / part.sum().clamp_min(epsilon))
    return weights if cp.size == 1 else zigzag_split(weights, cp.size, cp.rank)


class Tally:
    """The step's IW-OPD figures as a rank sees them (its answer tokens), summed over DP x CP and the pipeline
    group in `take` (the TP ranks hold the same tokens): means of the weighted advantage w a, of |a| and of w, and
    the extreme weights."""

    def __init__(self):
        self.sums = torch.zeros(4, dtype=torch.float64)  # w a, |a|, w, tokens
        self.extremes = torch.tensor([-torch.inf, -torch.inf], dtype=torch.float64)  # max w, -min w

    def add(self, advantage: torch.Tensor, weights: torch.Tensor) -> None:
        """One micro-batch's answer tokens: (n,) a and (n,) w."""
        if not advantage.numel():
            return
        a, w = advantage.detach().double(), weights.detach().double()
        self.sums += torch.stack([(w * a).sum(), a.abs().sum(), w.sum(), a.new_tensor(float(a.numel()))]).cpu()
        self.extremes = torch.maximum(self.extremes, torch.stack([w.max(), -w.min()]).cpu())

    def take(self, ctx) -> dict[str, float]:
        """The step's figures over the global batch, the same on every rank; then reset."""
        sums, extremes = self.sums.to(ctx.device, copy=True), self.extremes.to(ctx.device, copy=True)
        ctx.dp_cp.all_reduce(sums)
        ctx.dp_cp.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        if ctx.pp_size > 1:  # the last stage alone computed them
            ctx.pp.all_reduce(sums)
            ctx.pp.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        self.sums.zero_()
        self.extremes.fill_(-torch.inf)
        tokens = max(sums[3].item(), 1.0)
        means = {name: sums[i].item() / tokens for i, name in enumerate(METRICS)}
        return means | {"iw_opd/min_weight": -extremes[1].item(), "iw_opd/max_weight": extremes[0].item()}
