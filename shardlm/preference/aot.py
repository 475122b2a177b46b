"""AOT (alignment via optimal transport, Melnyk et al., 2024), as TRL's `DPOTrainer` has it, exact at every layout.

With u the policy's margin log pi(y_c | x) - log pi(y_r | x) of each pair, v the reference's, c and r the chosen and
the rejected answers' log-ratios to the reference, l(z) = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z) and N the
pairs:

    aot            (1 / N) sum_k l(beta (u_(k) - v_(k)))     u and v each sorted on its own
    aot_unpaired   (1 / N) sum_k l(beta (c_(k) - r_(k)))     c and r each sorted on its own

TRL sorts within each device's micro-batch, so its loss depends on the micro-batch size and the number of
processes. shardlm sorts the whole global batch (an evaluation: all its pairs), every layout alike. A sum in sorted
order is a sum over the pairs in their own order, each pair i the rank(i)-th term: aot's term of pair i is
l(beta (u_i - v_(rank_u(i)))), where v_(rank_u(i)) is a constant once the ranks are known. The ranks come from a
forward pass without gradient over the step's micro-batches before them (`PreferenceLoss.prepare`, as KTO's
reference point), gathered over DP (`match`); each pair's matched constants then make each micro-batch's loss its
share of the global batch's, value and gradient alike. aot_unpaired's term of pair i is l(beta (c_i -
r_(rank_c(i)))) + t - t.detach(), t = l(beta (c_(rank_r(i)) - r_i)): the first terms sum to the loss, t gives r_i
the gradient of the sorted term it stands in and adds nothing to the value. With one process and one micro-batch a
step it is TRL's. The pass before the step must see the training forward's values: no dropout (TRL's
`disable_dropout` default; checked).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AOT_LOSSES = ("aot", "aot_unpaired")


def sorted_keys(policy: torch.Tensor, reference: torch.Tensor, loss: str) -> torch.Tensor:
    """The two columns (n, 2) AOT sorts, of the policy's and the reference's sequence log-probabilities (n, 2):
    aot (u, v), aot_unpaired (c, r)."""
    if loss == "aot":
        return torch.stack([policy[:, 0] - policy[:, 1], reference[:, 0] - reference[:, 1]], dim=1)
    return policy - reference


def match(batches: list[dict], loss: str, dp) -> None:
    """Give each micro-batch holding the policy's log-probabilities (`policy` (P, 2), with `reference` (P, 2))
    its `aot` (P, 2) fp64 from the whole global batch's keys (`sorted_keys`, gathered over `dp`): aot column 0 v_i -
    v_(rank_u(i)), the shift of the pair's reference margin to the one its rank matches (column 1 unused);
    aot_unpaired (r_(rank_c(i)), c_(rank_r(i)))."""
    held = [b for b in batches if "policy" in b]  # under pipeline stages the last stage's
    keys = torch.cat([sorted_keys(b["policy"], b["reference"], loss) for b in held]) if held else torch.zeros(
        (0, 2), dtype=torch.float64, device=batches[0]["inputs"].device if batches else None)
    everyone, first = dp.all_gather_rows(keys)
    ordered, order = torch.sort(everyone, dim=0, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(0, order, torch.arange(len(everyone), device=order.device).unsqueeze(1).expand_as(order))
    mine = ranks[first:first + len(keys)]
    if loss == "aot":
        matched = torch.stack([keys[:, 1] - ordered[mine[:, 0], 1], torch.zeros_like(keys[:, 1])], dim=1)
    else:
        matched = torch.stack([ordered[mine[:, 0], 1], ordered[mine[:, 1], 0]], dim=1)
    for batch, part in zip(held, matched.split([len(b["policy"]) for b in held])):
        batch["aot"] = part


def aot_losses(loss: str, ratio: torch.Tensor, matched: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """Per-pair terms (P,) of `loss` from the log-ratios r (P, 2) and the pairs' `aot` (`match`; module
    docstring); their sum over the global batch is N times its loss."""

    def smoothed(z):
        return -(1 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)

    if loss == "aot":
        return smoothed(ratio[:, 0] - ratio[:, 1] + matched[:, 0])
    rejected = smoothed(matched[:, 1] - ratio[:, 1])
    return smoothed(ratio[:, 0] - matched[:, 0]) + rejected - rejected.detach()
