"""The Mixture-of-Experts layer's routing arithmetic (`shardlm.models.moe` builds the layer on it): the top-k choice
with an expert bias and group limits (`route`, `group_rule`), the load-balancing losses over a micro-batch and per
sequence (`balance_losses`, `sequence_balance_loss`), and `AttachLoss`, which carries them on the layer's output."""

from __future__ import annotations

import torch

from shardlm.models.config import ModelConfig
from shardlm.parallel import reduce_from_tensor_parallel


def group_rule(cfg: ModelConfig) -> str:
    """How expert groups are ranked (`model.moe_group_score`): "top2_sum" or "max"; "auto" by the score kind."""
    if cfg.moe_group_score != "auto":
        return cfg.moe_group_score
    return "max" if cfg.moe_score == "softmax" else "top2_sum"


def route(scores: torch.Tensor, top_k: int, bias: torch.Tensor | None = None, groups: int = 0,
          topk_groups: int = 0, norm_topk_prob: bool = True, scaling: float = 1.0, group_rule: str = "top2_sum"):
    """(N, E) fp32 scores -> (indices (N, k) int64, weights (N, k) fp32).

    Selection uses scores + bias (the bias steers which experts are chosen, never their weights); with
    `groups`, only experts of each token's best `topk_groups` groups are eligible, a group's score being
    the sum of its two best experts' (`group_rule` "top2_sum", DeepSeek-V3) or its best expert's ("max",
    DeepSeek-V2's group_limited_greedy over softmax scores, as transformers computes it)."""
    select = scores if bias is None else scores + bias
    if groups:
        N, E = select.shape
        grouped = select.view(N, groups, E // groups)
        if group_rule == "max":
            group_score = grouped.max(dim=-1).values  # (N, groups)
        else:
            group_score = grouped.topk(min(2, E // groups), dim=-1).values.sum(-1)  # (N, groups)
        best = group_score.topk(topk_groups, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        select = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(N, E)
    indices = select.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return indices, weights * scaling


def balance_losses(logits: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, aux_coeff: float,
                   z_coeff: float, token_groups: tuple = ()) -> torch.Tensor:
    """aux + z losses (fp32 scalar, see the module docstring) of this micro-batch's tokens.

    logits, probs: (N, E) fp32 of this rank's tokens (probs summing to 1 per token); indices: (N, k).
    `token_groups`: the `Communicator`s whose ranks hold the micro-batch's other tokens (TP under sequence
    parallelism, CP under context parallelism): token counts, probability and z sums and N are summed over
    each (the sums by `g`, whose backward keeps each rank's gradient on its own tokens), so every rank gets
    the loss of the whole token set."""
    N, E = probs.shape
    k = indices.shape[1]
    counts = torch.bincount(indices.reshape(-1), minlength=E).to(probs.dtype)
    prob_sum = probs.sum(0)
    z_sum = torch.logsumexp(logits, dim=-1).pow(2).sum().reshape(1)
    tokens = torch.tensor([float(N)], device=probs.device)
    for group in token_groups:
        group.all_reduce(counts)
        group.all_reduce(tokens)
        prob_sum = reduce_from_tensor_parallel(prob_sum, group)
        z_sum = reduce_from_tensor_parallel(z_sum, group)
    aux = aux_coeff * E * (counts / (tokens * k) * prob_sum / tokens).sum()
    return aux + z_coeff * (z_sum / tokens).sum()


def sequence_balance_loss(probs: torch.Tensor, batch: int, top_k: int, coeff: float,
                          token_groups: tuple = ()) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (fp32 scalar) of this micro-batch's `batch` rows.

    probs: (B T, E) fp32 normalized scores of this rank's tokens, row-major (B, T); per sequence b,
      loss_b = E / (k T) sum_e count_{b,e} x (1 / T) sum_t p_{b,t,e}
    with count_{b,e} the tokens of b whose top-k of the unbiased scores (not the routed, bias-steered choice)
    hold e, and T the whole sequence's length; the loss is coeff x the mean over the rows. Counts, probability
    sums and T are summed over `token_groups` (ranks holding other parts of the same rows), as Megatron-Core's
    seq_aux_loss does."""
    E = probs.shape[1]
    per_row = probs.view(batch, -1, E)
    top = per_row.topk(top_k, dim=-1).indices
    counts = torch.zeros_like(per_row).scatter_(-1, top, 1.0).sum(1)  # (B, E)
    prob_sum = per_row.sum(1)  # (B, E)
    tokens = torch.tensor([float(per_row.shape[1])], device=probs.device)
    for group in token_groups:
        group.all_reduce(counts)
        group.all_reduce(tokens)
        prob_sum = reduce_from_tensor_parallel(prob_sum, group)
    return coeff * E * (counts * prob_sum).sum() / (top_k * tokens * tokens * batch).squeeze()


class AttachLoss(torch.autograd.Function):
    """Identity on `y`; in the backward, the scalar `loss` receives gradient `scale` (the layer's
    `loss_scale`), so the loss joins the objective wherever `y` is used."""

    @staticmethod
    def forward(ctx, y, loss, scale):
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None
