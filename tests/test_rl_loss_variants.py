"""The RL losses' terms on chosen log-probabilities, against TRL's `_compute_loss` restated on its padded layout.

The TRL comparison (`test_rl_trl.py`) trains on a fixture where, at the second step, every negative-advantage
token's ratio has fallen, so INTELLECT-2's cap (`rl.delta`) cannot bite there, and no ratio is extreme. Here the
ratios are chosen: five sequences (one truncated and masked) packed into two rows by `StepRows`, the old
log-probabilities set so the token ratios spread over about 0.3 to 3.3 on both signs of the advantage (one token at
e^25, past VESPO's clamp). shardlm's `RLLoss` on the packed rows gives the loss and the gradient of every token's
log-probability; `trl_loss` below (TRL 1.16's lines on one padded row a sequence, a completion mask, advantages
(B, 1)) gives them independently. Each case within 1e-12 (the gradients, float64) and 1e-6 relative (the loss, which
`RLLoss` returns in float32); each option's control (the option off) moves the gradient by more than 1e-3.
A round split between two steps (`rl.generation_batch_size`) weighs each step as TRL normalizes it. RLOO
(`RLOOTrainer`'s loss: each sequence's whole ratio clipped, the mean over the sequences) and GMPO (TRL's experimental
`GMPOTrainer`: the geometric mean of the token ratios, each clipped in log space by its advantage's sign) count the
masked sequence's constant -A (its ratio exp(0)) in the loss, without gradient, as TRL does.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shardlm.config import RLConfig
from shardlm.parallel import ParallelContext
from shardlm.rl.batch import StepRows
from shardlm.rl.loss import RLLoss, rl_parts
from shardlm.rl.rollout import Rollout

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12], [13, 14], [15, 16, 17]]
LENGTHS = [5, 4, 3, 5, 2]  # completion tokens; the fourth is truncated at MAX and masked
ADVANTAGES = [0.9, -0.6, -1.3, -0.8, 0.4]
MAX, SEQ, ROWS, EPS, EPS_HIGH, BETA = 5, 24, 2, 0.2, 0.28, 0.04


def chosen() -> dict[str, torch.Tensor]:
    """(B, MAX) padded logp, old and ref log-probabilities and the completion mask; the advantages (B, 1)."""
    rng = np.random.default_rng(7)
    logp = rng.uniform(-4.0, -0.5, size=(len(LENGTHS), MAX))
    old = logp - rng.uniform(-1.2, 1.2, size=logp.shape)
    old[0, 2] = logp[0, 2] - 25.0  # a positive sequence's token at ratio e^25 (VESPO clamps its log at 20)
    # the negative sequences: one drifted a little (mean old - logp 0.075, its ratios 0.82-1.11, inside the clip),
    # one whose ratios rose (e^0.7, e^0.2, e^0.5: a sequence ratio e^0.47)
    old[1, :4] = logp[1, :4] - np.array([0.1, -0.15, -0.2, -0.05])
    old[2, :3] = logp[2, :3] - np.array([0.7, 0.2, 0.5])
    ref = logp - rng.uniform(-0.5, 0.5, size=logp.shape)
    mask = np.array([[1.0] * n + [0.0] * (MAX - n) for n in LENGTHS])
    mask[3] = 0.0  # the truncated one, masked
    values = {"logp": logp, "old": old, "ref": ref, "mask": mask}
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()} | {
        "advantage": torch.tensor(ADVANTAGES, dtype=torch.float64)[:, None]}


def trl_loss(cfg: RLConfig, t: dict, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """TRL's loss (one accumulation step, one process) of the padded `logp` (B, T), and its metric: the mean VESPO
    weight over the sequences."""
    mask, advantage, old = t["mask"], t["advantage"], t["old"]
    log_ratio = logp - old
    if cfg.loss == "gmpo":  # GMPOTrainer: the geometric mean of the sign-aware log-space-clipped token ratios
        clamped = torch.clamp(log_ratio, min=-cfg.epsilon, max=cfg.epsilon_high)
        clipped = torch.where(advantage > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
        coef = torch.exp((clipped * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
        kl = torch.exp(t["ref"] - logp) - (t["ref"] - logp) - 1
        loss = (-coef * advantage[:, 0] + cfg.beta * (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        low, high = (log_ratio < -cfg.epsilon) & (advantage < 0), (log_ratio > cfg.epsilon_high) & (advantage > 0)
        metrics = {f"clip_ratio/{name}_mean": ((share * mask).sum() / mask.sum()).item()
                   for name, share in (("low", low), ("high", high), ("region", low | high))}
        return loss, metrics
    if cfg.loss == "rloo":  # RLOOTrainer: the sequence's masked sum, its clipped ratio, the mean over sequences
        coef_1 = torch.exp((logp * mask).sum(1) - (old * mask).sum(1))
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        advantage = advantage[:, 0]
        low, high = (coef_1 < 1 - cfg.epsilon) & (advantage < 0), (coef_1 > 1 + cfg.epsilon_high) & (advantage > 0)
        metrics = {f"clip_ratio/{name}_mean": share.double().mean().item()
                   for name, share in (("low", low), ("high", high), ("region", low | high))}
        return -torch.min(coef_1 * advantage, coef_2 * advantage).mean(), metrics
    if cfg.importance_sampling == "sequence":
        weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        weights = log_ratio
    coef_1 = torch.exp(weights)
    per_token_kl = (torch.exp(t["ref"] - logp) - (t["ref"] - logp) - 1) * coef_1
    metrics = {}
    if cfg.loss == "sapo":
        temperatures = torch.where(advantage > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantage
    elif cfg.loss == "vespo":
        with torch.no_grad():
            seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            log_w = torch.clamp(seq_log_ratio, math.log(1e-8), 20.0)
            nonneg = advantage >= 0
            k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
            lam = torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi * advantage * logp
        metrics["vespo/phi_seq_mean"] = phi.mean().item()
    else:
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        if cfg.delta:
            coef_1 = torch.clamp(coef_1, max=cfg.delta)
        per_token_loss = -torch.min(coef_1 * advantage, coef_2 * advantage)
    if cfg.off_policy_mask_threshold:
        drift = ((old - logp.detach()) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        per_token_loss = per_token_loss * ((advantage >= 0) | (drift <= cfg.off_policy_mask_threshold))
    per_token_loss = per_token_loss + cfg.beta * per_token_kl
    if cfg.loss in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, metrics


def shardlm_loss(cfg: RLConfig, t: dict, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """`RLLoss` on the sequences packed into ROWS rows of SEQ tokens, the padded `logp` placed at the positions that
    predict each completion token (gradients flow back to it), and the metrics it logs."""
    rollouts = [Rollout(p, list(range(20, 20 + n)), [math.nan] * n, j == 3) for j, (p, n) in
                enumerate(zip(PROMPTS, LENGTHS))]
    rows = StepRows(rollouts, np.array(ADVANTAGES), cfg.loss, MAX, True, ROWS, SEQ, 0)
    fields = {k: torch.from_numpy(v) for k, v in rows.fields.items()}
    part = rl_parts([fields], ParallelContext.single())[0]
    trained = part["targets"] != -100
    sequence = part["sequence"][trained]
    token = torch.cat([torch.arange(n) for n in torch.bincount(sequence, minlength=len(LENGTHS))])
    # packed order: sequences in order within each row, so the running index within a sequence is its token
    order = torch.argsort(sequence, stable=True)
    index = torch.empty_like(token)
    index[order] = token
    packed = torch.zeros(part["targets"].shape, dtype=torch.float64).masked_scatter(trained, logp[sequence, index])
    for name, key in (("old_logp", "old"), ("ref_logp", "ref")):
        part[name] = torch.zeros_like(packed).masked_scatter(trained, t[key][sequence, index])
    model = SimpleNamespace(training=True, entropies=[], logit_temperature=None)
    rl = RLLoss(cfg, ParallelContext.single(), model, round_steps=cfg.num_iterations)
    loss = rl.of_token_losses(-packed, part)
    return loss, rl.take_metrics()


CASES = {
    "grpo_delta": {"loss": "grpo", "delta": 1.5},
    "dapo_delta_opsm": {"loss": "dapo", "delta": 1.4, "off_policy_mask_threshold": 0.05},
    "gspo_delta": {"loss": "grpo", "importance_sampling": "sequence", "delta": 1.3},
    "luspo_gspo_opsm": {"loss": "luspo", "importance_sampling": "sequence", "off_policy_mask_threshold": 0.05},
    "sapo": {"loss": "sapo", "sapo_temperature_pos": 1.5, "sapo_temperature_neg": 2.5},
    "vespo": {"loss": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5},
    "rloo_masked": {"loss": "rloo", "epsilon_high": 0.1},
    "gmpo_masked": {"loss": "gmpo", "epsilon": 0.4, "epsilon_high": 0.3},
}


def gradients(cfg: RLConfig, loss_of) -> tuple[float, torch.Tensor, dict]:
    t = chosen()
    logp = t["logp"].clone().requires_grad_()
    loss, metrics = loss_of(cfg, t, logp)
    loss.backward()
    return loss.item(), logp.grad, metrics


def config(case: dict) -> RLConfig:
    return RLConfig(**{"num_iterations": 2, "beta": BETA, "epsilon": EPS, "epsilon_high": EPS_HIGH} | case)


@pytest.mark.parametrize("name", list(CASES))
def test_packed_rows_give_trl_loss_and_gradients(name):
    cfg = config(CASES[name])
    want_loss, want_grad, want_metrics = gradients(cfg, trl_loss)
    got_loss, got_grad, got_metrics = gradients(cfg, shardlm_loss)
    assert got_loss == pytest.approx(want_loss, rel=1e-6), (got_loss, want_loss)
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-12), (got_grad - want_grad).abs().max()
    mask = chosen()["mask"] > 0
    assert not want_grad[3].any() and want_grad[mask].abs().max() > 0  # the masked one has none, the others some
    if cfg.loss not in ("rloo", "gmpo"):  # (RLOO clips whole sequences, GMPO clips to constants: some have none)
        assert want_grad[mask].abs().min() > 0
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, abs=1e-12), (key, got_metrics[key], value)


@pytest.mark.parametrize("name, option", [("grpo_delta", "delta"), ("gspo_delta", "delta"),
                                          ("dapo_delta_opsm", "delta"),
                                          ("dapo_delta_opsm", "off_policy_mask_threshold"),
                                          ("luspo_gspo_opsm", "off_policy_mask_threshold")])
def test_each_option_changes_the_gradient(name, option):
    """The controls: each case's option set to 0 (off) moves TRL's gradient, so the cases above reach it."""
    with_option = gradients(config(CASES[name]), trl_loss)[1]
    without = gradients(config({k: v for k, v in CASES[name].items() if k != option}), trl_loss)[1]
    assert (with_option - without).abs().max() > 1e-3


def test_vespo_weights_reach_their_clamps():
    """The chosen ratios reach VESPO's edges: a sequence whose weight underflows to 0 (its log-ratio clamped at 20)
    and the masked sequence's weight exactly 1; the others strictly between."""
    t = chosen()
    cfg = config(CASES["vespo"])
    log_ratio = t["logp"] - t["old"]
    total = (log_ratio.clamp(-20, 20) * t["mask"]).sum(-1)
    assert total[0] > 20
    _, metrics = trl_loss(cfg, t, t["logp"])
    assert 0 < metrics["vespo/phi_seq_mean"] < 1


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dapo", "luspo", "dr_grpo"])
def test_a_round_of_two_steps_weighs_each_step_as_trl(loss):
    """`StepRows` of a round split between two steps (`split_round`, rl.generation_batch_size): each step's
    sequences packed into its own ROWS rows, in the step's half of the row range; the loss weights of each step sum,
    per sequence, to TRL's normalizer of that step: the step's own sequences (grpo, luspo, dr_grpo) or tokens (bnpo),
    and for dapo the round's tokens over the 2 steps (TRL's generation batch), so the steps' sums differ."""
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in rng.integers(1, MAX + 1, size=8)]
    rollouts = [Rollout([5, 6], list(range(20, 20 + n)), [math.nan] * n, False) for n in lengths]
    step_of = np.array([0, 1, 1, 0, 1, 0, 0, 1])
    rows = StepRows(rollouts, np.ones(8), loss, MAX, False, ROWS, SEQ, 0, step_of=step_of)
    sequence, weight = rows.fields["sequence"], rows.fields["weight"]
    assert len(rows) == 2 * ROWS
    for step in (0, 1):
        part = slice(step * ROWS, (step + 1) * ROWS)
        own = [j for j in range(8) if step_of[j] == step]
        assert sorted(set(sequence[part].ravel()) - {-1}) == own  # the step's sequences, and only them, in its rows
        tokens = sum(lengths[j] for j in own)
        want = {"grpo": 1.0, "luspo": tokens / 4, "dr_grpo": tokens / (4 * MAX), "bnpo": 1.0,
                "dapo": tokens / (sum(lengths) / 2)}[loss]
        assert weight[part].sum() == pytest.approx(want, rel=1e-12), (loss, step)
        assert rows.fields["token_weight"][part].sum() == pytest.approx(1.0, rel=1e-12)  # metrics: the step's means
    assert sum(lengths[j] for j in range(8) if step_of[j] == 0) != sum(lengths) / 2  # dapo's steps differ from bnpo's
