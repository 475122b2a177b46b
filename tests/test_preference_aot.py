"""AOT's losses (`shardlm.preference.aot`): each micro-batch's per-pair terms, from the ranks of the whole global
batch, sum to TRL's sorted loss over the batch, value and gradient, however the pairs are split into micro-batches.

The fixture: 9 pairs' sequence log-probabilities and the reference's, random (fp64), in micro-batches of 4, 3 and 2
pairs. The oracle is TRL's `DPOTrainer` (1.16) code for `aot` and `aot_unpaired` as its source writes it: the
batch's margins (or the chosen and the rejected log-ratios) each sorted with `torch.sort`, DPO's smoothed logistic
loss on their differences, averaged; fp64, so within 1e-12. The control: sorting each micro-batch on its own (TRL's
per-device batches) gives another loss, so the test sees the global ranks. The trainer's runs (the pass before the
step, the ranks gathered over DP): `tests/test_preference_layouts.py`; against TRL's `DPOTrainer` step by step:
`tests/test_preference_trl.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlm.parallel import ParallelContext
from shardlm.preference import aot

SPLIT, BETA = (4, 3, 2), 0.5
ONE_RANK = ParallelContext.single().dp


def fixture_values() -> tuple[torch.Tensor, torch.Tensor]:
    """(the policy's log-probabilities (9, 2), the reference's (9, 2)), chosen first."""
    generator = torch.Generator().manual_seed(3)
    reference = -30 * torch.rand(9, 2, dtype=torch.float64, generator=generator) - 5
    return reference + torch.randn(9, 2, dtype=torch.float64, generator=generator), reference


def trl_loss(loss: str, logps: torch.Tensor, reference: torch.Tensor, eps: float) -> torch.Tensor:
    """TRL's `aot` / `aot_unpaired` loss of a batch, as its `DPOTrainer._compute_loss` computes it."""
    if loss == "aot":
        logratios_sorted, _ = torch.sort(logps[:, 0] - logps[:, 1], dim=0)
        ref_logratios_sorted, _ = torch.sort(reference[:, 0] - reference[:, 1], dim=0)
        delta = logratios_sorted - ref_logratios_sorted
    else:
        chosen_sorted, _ = torch.sort(logps[:, 0] - reference[:, 0], dim=0)
        rejected_sorted, _ = torch.sort(logps[:, 1] - reference[:, 1], dim=0)
        delta = chosen_sorted - rejected_sorted
    per_sequence = -F.logsigmoid(BETA * delta) * (1 - eps) - F.logsigmoid(-BETA * delta) * eps
    return per_sequence.mean()


def shardlm_loss(loss: str, logps: torch.Tensor, reference: torch.Tensor, eps: float,
                 split: tuple = SPLIT) -> torch.Tensor:
    """The sum over micro-batches of their pairs' terms (`aot.aot_losses`) over the batch's pair count, the ranks
    matched over the micro-batches of `split` (`aot.match`) as the trainer's pass before the step does."""
    batches = [{"policy": p.detach(), "reference": r, "inputs": torch.zeros(1)}
               for p, r in zip(logps.split(split), reference.split(split))]
    aot.match(batches, loss, ONE_RANK)
    total = sum(aot.aot_losses(loss, p - b["reference"], b["aot"], BETA, eps).sum()
                for p, b in zip(logps.split(split), batches))
    return total / len(logps)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("loss", aot.AOT_LOSSES)
def test_the_terms_sum_to_trls_sorted_loss(loss, eps):
    logps, reference = fixture_values()
    values, grads = [], []
    for compute in (trl_loss, shardlm_loss):
        x = logps.clone().requires_grad_(True)
        value = compute(loss, x, reference, eps)
        values.append(value.item())
        grads.append(torch.autograd.grad(value, x)[0])
    assert abs(values[0] - values[1]) <= 1e-12 * abs(values[0]), values
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-15), grads
    # the control: TRL's per-micro-batch sort (each micro-batch its own batch) misses the global batch's loss
    per_micro_batch = sum(len(p) * trl_loss(loss, p, r, eps) for p, r in zip(logps.split(SPLIT),
                                                                            reference.split(SPLIT))) / len(logps)
    assert abs(per_micro_batch.item() - values[0]) > 1e-3, (per_micro_batch, values)


def test_the_ranks_disagree_in_the_fixture():
    """The fixture's policy margins are not in the reference's order (nor the chosen log-ratios in the rejected
    ones'), so the sorted loss is not DPO's."""
    logps, reference = fixture_values()
    for columns in (aot.sorted_keys(logps, reference, "aot"), aot.sorted_keys(logps, reference, "aot_unpaired")):
        assert not torch.equal(columns[:, 0].argsort(), columns[:, 1].argsort())


def test_the_matched_values_of_a_batch_in_order_are_its_own():
    """Where both columns are in the same order, every pair is matched with itself: aot's shift is 0 and
    aot_unpaired's constants are its own log-ratios (DPO's loss)."""
    index = torch.arange(6, dtype=torch.float64)
    reference = -torch.stack([index, 2 * index + 1], dim=1)  # margins 1, 2, ..., 6
    logps = reference + torch.linspace(0.0, 1.0, 6, dtype=torch.float64).unsqueeze(1) * torch.tensor([1.0, 0.5])
    batches = [{"policy": logps[:3], "reference": reference[:3]}, {"policy": logps[3:], "reference": reference[3:]}]
    aot.match(batches, "aot", ONE_RANK)
    assert torch.equal(torch.cat([b["aot"][:, 0] for b in batches]), torch.zeros(6, dtype=torch.float64))
    aot.match(batches, "aot_unpaired", ONE_RANK)
    ratio = logps - reference
    assert torch.equal(torch.cat([b["aot"] for b in batches]), ratio.flip(1))
