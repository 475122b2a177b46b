"""KTO (Kahneman-Tversky optimization) on unpaired examples, exact at every layout.

Each example is a prompt, one completion and a label: desirable or undesirable (`shardlm.preference.unpaired`).
With r = log pi(y | x) - log pi_ref(y | x) of the example's completion and z0 the reference point,

    desirable     w_d (1 - sigmoid(beta (r - z0)))
    undesirable   w_u (1 - sigmoid(beta (z0 - r)))

(`preference.desirable_weight`, `preference.undesirable_weight`), averaged over the global batch's examples as
DPO's losses are over its pairs. z0 is the KL divergence of the policy from the reference, estimated on mismatched
sequences (each example's prompt with another example's completion, its "KL sequence"): the mean over the
examples of log pi(y' | x) - log pi_ref(y' | x), clamped at 0 and without gradient, as TRL computes it.
`apo_zero_unpaired` (APO-zero's unpaired form, D'Oosterlinck et al., 2024, as TRL has it) has no reference point
and no KL sequences: desirable w_d (1 - sigmoid(beta r)), undesirable w_u sigmoid(beta r).

Where TRL takes that mean over each device's micro-batch (its KL, and so every loss, depends on the micro-batch
size and the number of processes), shardlm takes it over the whole global batch, every layout alike: before a
step's (or an evaluation's) micro-batches, one forward pass without gradient over their KL sequences (packed in
rows of their own, `kl` in each micro-batch, beside the examples' rows) records the policy's log-probabilities,
and one all-reduce over DP (and the pipeline group, whose last stage alone holds them) gives z0. With one process
and one micro-batch a step it is TRL's.
"""

from __future__ import annotations

import torch

from shardlm.config import PreferenceConfig

UNPAIRED = ("kto", "apo_zero_unpaired")
KL_LOSSES = ("kto",)
"""The unpaired losses with the KL reference point (APO-zero's unpaired form has none: z0 = 0)."""
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "kl")
"""Logged as TRL logs them: the mean reward (beta r) of the desirable and of the undesirable examples, their
difference, and the step's z0."""


def kto_losses(cfg: PreferenceConfig, logps: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor,
               kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-example losses (P,), rewards beta r (P,), detached) of the completions' log-probabilities (P,), the
    reference's (P,), the labels (P,) bool (True: desirable) and z0 (a scalar); fp64."""
    ratio = logps - reference
    if cfg.loss == "apo_zero_unpaired":  # push desirable completions up and undesirable ones down, with no z0
        desirable = cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * ratio))
        undesirable = cfg.undesirable_weight * torch.sigmoid(cfg.beta * ratio)
    else:
        desirable = cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * (ratio - kl)))
        undesirable = cfg.undesirable_weight * (1 - torch.sigmoid(cfg.beta * (kl - ratio)))
    return torch.where(labels, desirable, undesirable), cfg.beta * ratio.detach()


SUMS = ("loss", "desirable reward", "desirable", "undesirable reward", "undesirable")
"""What `metric_sums` adds up over a step's examples."""


def metric_sums(losses: torch.Tensor, rewards: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(len(SUMS),) fp64: the losses' sum, the desirable examples' reward sum and count, the undesirable ones'."""
    desirable = labels.double()
    return torch.stack([losses.detach().sum(), (rewards * desirable).sum(), desirable.sum(),
                        (rewards * (1 - desirable)).sum(), (1 - desirable).sum()]).cpu()


def metrics_of(sums: torch.Tensor, kl: float) -> dict[str, float]:
    """The step's `METRICS` from the global batch's `metric_sums` (a label without examples gives its mean 0)."""
    chosen = sums[1].item() / max(sums[2].item(), 1.0)
    rejected = sums[3].item() / max(sums[4].item(), 1.0)
    return {"rewards_chosen": chosen, "rewards_rejected": rejected, "reward_margin": chosen - rejected, "kl": kl}


def estimate_kl(batches: list[dict], ctx) -> torch.Tensor:
    """z0 of a step (module docstring): the mean over the micro-batches' examples of their KL sequences' policy
    minus reference log-probabilities, summed over DP (and the pipeline group: only its last stage recorded
    them), clamped at 0; an fp64 scalar, the same on every rank."""
    sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for batch in batches:
        part = batch["kl"]
        if "policy" in part:
            sums[0] += (part["policy"][:, 0] - part["reference"][:, 0]).sum()
            sums[1] += len(part["pairs"])
    ctx.dp.all_reduce(sums)
    if ctx.pp_size > 1:
        ctx.pp.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0)


def desirable_share(labels: list[bool]) -> str:
    """`n desirable and m undesirable examples` of a run's labels."""
    desirable = sum(labels)
    return f"{desirable} desirable and {len(labels) - desirable} undesirable examples"

