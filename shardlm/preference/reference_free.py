"""The reference-free preference losses: SimPO, ORPO and CPO's, as TRL's `CPOTrainer` and `ORPOTrainer` define them.

With s the answer's score (its sequence log-probability logp; length-normalized, logp / n, for the losses of
`MEAN`), under AlphaPO (`preference.alpha` != 0) the reward shape (1 - p^-alpha) / alpha of p = exp(s) in its
place, d = s_chosen - s_rejected, sigma the sigmoid and eps = label_smoothing:

    simpo      -(1 - eps) log sigma(beta d - gamma) - eps log sigma(-(beta d - gamma))     (s length-normalized)
    cpo        -(1 - eps) log sigma(beta d) - eps log sigma(-beta d)      CPO: DPO without its reference
    cpo_hinge  max(0, 1 - beta d)
    cpo_ipo    (d - 1 / (2 beta))^2                                                       (s length-normalized)
    orpo       -logp_c / n_c - beta log sigma(log odds_c - log odds_r), odds = p / (1 - p) of the length-normalized
               probability (ORPO's lambda is beta; its NLL term built in)

CPO's NLL term (`cpo_alpha`) is the "sft" part of a sum: "cpo+sft" with loss_weights [1, cpo_alpha] (1 each by
default: TRL's cpo_alpha 1), "simpo+sft" (CPO-SimPO), the chosen answers' NLL as a mean over the global batch's
chosen tokens (`shardlm.preference.loss`). Logged rewards: beta s of each answer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REFERENCE_FREE = ("simpo", "orpo", "cpo", "cpo_hinge", "cpo_ipo")
MEAN = ("simpo", "orpo", "cpo_ipo")
"""The reference-free losses of the length-normalized log-probabilities (TRL's `average_log_prob`)."""
ALPHAPO = ("simpo", "cpo", "cpo_hinge", "cpo_ipo")
"""The losses AlphaPO's reward shape applies to (TRL's CPOTrainer's)."""


def reference_free(loss: str) -> bool:
    """Whether `preference.loss` (a sum too: a reference-free loss and "sft") needs no reference model."""
    return any(part in REFERENCE_FREE for part in loss.split("+"))


def scores(loss: str, logps: torch.Tensor, counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """The answers' scores s (P, 2) of the reference-free `loss` (module docstring) from their sequence
    log-probabilities and token counts (P, 2)."""
    s = logps / counts if loss in MEAN else logps
    if alpha and loss in ALPHAPO:
        return (1 - torch.exp(-alpha * s)) / alpha
    return s


def reference_free_losses(cfg, loss: str, logps: torch.Tensor, counts: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per-pair losses (P,) of the reference-free `loss` (its options from `cfg`: a `PreferenceConfig`) from the
    log-probabilities, token counts and scores (`scores`) (P, 2)."""
    beta, eps = cfg.beta, cfg.label_smoothing
    d = s[:, 0] - s[:, 1]
    if loss in ("simpo", "cpo"):
        z = beta * d - (cfg.simpo_gamma if loss == "simpo" else 0.0)
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss == "cpo_hinge":
        return torch.relu(1 - beta * d)
    if loss == "cpo_ipo":
        return (d - 1 / (2 * beta)) ** 2
    mean = logps / counts  # orpo: log odds of the length-normalized probabilities
    odds = mean - torch.log1p(-torch.exp(mean).clamp(max=1 - 1e-12))
    return -mean[:, 0] - beta * F.logsigmoid(odds[:, 0] - odds[:, 1])
