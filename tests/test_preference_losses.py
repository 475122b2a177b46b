"""Each preference loss has the value its paper gives, on two pairs written out here and computed by hand.

The fixture: two pairs' sequence log-probabilities, answer token counts and reference log-probabilities, chosen
first. The first pair's chosen answer gains on the reference and its rejected answer loses (d = +2.5), the
second the other way round (d = -3.75), and every answer has its own token count, so a swapped sign, a swapped
side, a count of the wrong answer or a hinge without its clip each change a number. The expected values are
Python `math` on the papers' formulas, not torch:

- DPO (Rafailov et al.): -log sigmoid(beta d), with r = log pi - log pi_ref and d = r_chosen - r_rejected;
- conservative DPO (cDPO, label smoothing eps): -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d);
- IPO (Azar et al., eq. 17): (d' - 1 / (2 beta))^2, d' of each r divided by its answer's token count (as TRL
  computes IPO);
- hinge (SLiC, Zhao et al.): max(0, 1 - beta d);
- SimPO (Meng et al.): -log sigmoid(beta (logp_c / n_c - logp_r / n_r) - gamma);
- ORPO (Hong et al.): NLL of the chosen answer per token + lambda * -log sigmoid(log odds_c - log odds_r), odds
  = p / (1 - p) of the per-token probability p = exp(logp / n), lambda = beta;
- the rest of TRL's `DPOTrainer` losses, as its 1.16 source writes them: robust DPO (Chowdhury et al.), EXO (Ji et
  al., eq. 16), DiscoPOP (Chris Lu et al., eq. 5), length-normalized DPO (sigmoid_norm), NCA (Chen et al.), BCO's
  pair form, SPPO's hard-label form, APO-zero and APO-down (D'Oosterlinck et al., eqs. 7 and 8), and DPO over the
  f-DPO scores (Wang et al.: forward KL 1 - 1/t, Jensen-Shannon log(2t / (t + 1)), alpha (t^(alpha - 1) - 1) /
  (alpha - 1), t = exp(r)), each written here with `math` on t and r;
and the rewards TRL logs: beta r (the reference-free losses: beta logp / n), the margin and the accuracy.
All in fp64, within 1e-12 relative.

`tests/test_preference_trl.py` runs DPO against TRL's `DPOTrainer` step by step, compares IPO's and hinge's losses
with TRL's on the trained model's pairs, and checks ORPO's odds-ratio term on this fixture against TRL's
`ORPOTrainer.odds_ratio_loss`.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardlm.config import PreferenceConfig
from shardlm.preference.loss import pair_losses

LOGPS = [[-12.0, -15.5], [-20.25, -9.0]]
COUNTS = [[4, 7], [9, 3]]
REFERENCE = [[-13.0, -14.0], [-18.0, -10.5]]
BETA, GAMMA, TOL = 0.5, 0.3, 1e-12


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def log_odds(mean_logp: float) -> float:
    """log (p / (1 - p)) of p = exp(mean_logp)."""
    return mean_logp - math.log(1 - math.exp(mean_logp))


def sigmoid(x: float) -> float:
    return math.exp(log_sigmoid(x))


def f_score(kind: str, r: float) -> float:
    """f'(t) at t = exp(r) (the module docstring's f-DPO scores)."""
    t = math.exp(r)
    if kind == "forward_kl":
        return 1 - 1 / t
    if kind == "js_divergence":
        return math.log(2 * t / (t + 1))
    if kind == "alpha_divergence":
        return (t ** (ALPHA - 1) - 1) / (ALPHA - 1)
    return r


def by_hand(loss: str, eps: float = 0.0, divergence: str = "reverse_kl") -> tuple[list[float], list[tuple]]:
    """(each pair's loss, each pair's (chosen reward, rejected reward)) from the module docstring's formulas."""
    losses, rewards = [], []
    for (lc, lr), (nc, nr), (rc, rr) in zip(LOGPS, COUNTS, REFERENCE):
        d = f_score(divergence, lc - rc) - f_score(divergence, lr - rr)
        mc, mr = lc / nc, lr / nr
        c, r = BETA * (lc - rc), BETA * (lr - rr)
        z = BETA * d
        norm = BETA * (f_score(divergence, lc - rc) / nc - f_score(divergence, lr - rr) / nr)
        if loss in OTHERS:
            value = OTHERS[loss](z, c, r, norm, eps)
        elif loss == "sigmoid":
            value = -(1 - eps) * log_sigmoid(BETA * d) - eps * log_sigmoid(-BETA * d)
        elif loss == "ipo":
            value = (norm / BETA - 1 / (2 * BETA)) ** 2
        elif loss == "hinge":
            value = max(0.0, 1 - BETA * d)
        elif loss == "simpo":
            value = -(1 - eps) * log_sigmoid(BETA * (mc - mr) - GAMMA) - eps * log_sigmoid(GAMMA - BETA * (mc - mr))
        elif loss == "cpo":
            value = -(1 - eps) * log_sigmoid(BETA * (lc - lr)) - eps * log_sigmoid(-BETA * (lc - lr))
        elif loss == "cpo_hinge":
            value = max(0.0, 1 - BETA * (lc - lr))
        elif loss == "cpo_ipo":
            value = ((mc - mr) - 1 / (2 * BETA)) ** 2
        else:  # orpo
            value = -mc - BETA * log_sigmoid(log_odds(mc) - log_odds(mr))
        losses.append(value)
        rewards.append((BETA * mc, BETA * mr) if loss in ("simpo", "orpo", "cpo_ipo")
                       else (BETA * lc, BETA * lr) if loss in ("cpo", "cpo_hinge")
                       else (BETA * (lc - rc), BETA * (lr - rr)))
    return losses, rewards


OTHERS = {  # (z = beta (s_c - s_r), c = beta r_c, r = beta r_r, z over token means, eps) -> the pair's loss
    "robust": lambda z, c, r, n, eps: (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps),
    "exo_pair": lambda z, c, r, n, eps: (sigmoid(z) * (log_sigmoid(z) - math.log(1 - eps))
                                         + sigmoid(-z) * (log_sigmoid(-z) - math.log(eps))),
    "discopop": lambda z, c, r, n, eps: (-log_sigmoid(z) * (1 - sigmoid(z / TAU))
                                         + math.exp(-z) * sigmoid(z / TAU)),
    "sigmoid_norm": lambda z, c, r, n, eps: -log_sigmoid(n),
    "nca_pair": lambda z, c, r, n, eps: -log_sigmoid(c) - 0.5 * log_sigmoid(-c) - 0.5 * log_sigmoid(-r),
    "bco_pair": lambda z, c, r, n, eps: -log_sigmoid(c) - log_sigmoid(-r),
    "sppo_hard": lambda z, c, r, n, eps: (c / BETA - 0.5 / BETA) ** 2 + (r / BETA + 0.5 / BETA) ** 2,
    "apo_zero": lambda z, c, r, n, eps: 1 - sigmoid(c) + sigmoid(r),
    "apo_down": lambda z, c, r, n, eps: sigmoid(c) + 1 - sigmoid(c - r),
}
ALPHA, TAU = 0.3, 0.05
FREE = ("simpo", "orpo", "cpo", "cpo_hinge", "cpo_ipo")


def shardlm_losses(loss: str, eps: float = 0.0, divergence: str = "reverse_kl"):
    cfg = PreferenceConfig(loss=loss, beta=BETA, label_smoothing=eps, simpo_gamma=GAMMA, discopop_tau=TAU,
                           f_divergence_type=divergence, f_alpha_divergence_coef=ALPHA)
    reference = None if loss in FREE else torch.tensor(REFERENCE, dtype=torch.float64)
    return pair_losses(cfg, torch.tensor(LOGPS, dtype=torch.float64), torch.tensor(COUNTS, dtype=torch.float64),
                       reference)


CASES = {"dpo": ("sigmoid", 0.0), "cdpo": ("sigmoid", 0.2), "ipo": ("ipo", 0.0), "hinge": ("hinge", 0.0),
         "simpo": ("simpo", 0.0), "orpo": ("orpo", 0.0), "robust": ("robust", 0.2), "exo_pair": ("exo_pair", 1e-3),
         "discopop": ("discopop", 0.0), "sigmoid_norm": ("sigmoid_norm", 0.0), "nca_pair": ("nca_pair", 0.0),
         "bco_pair": ("bco_pair", 0.0), "sppo_hard": ("sppo_hard", 0.0), "apo_zero": ("apo_zero", 0.0),
         "apo_down": ("apo_down", 0.0), "smoothed simpo": ("simpo", 0.2), "cpo": ("cpo", 0.0),
         "smoothed cpo": ("cpo", 0.2), "cpo_hinge": ("cpo_hinge", 0.0), "cpo_ipo": ("cpo_ipo", 0.0)} | {
    f"{loss} {kind}": (loss, 0.2 if loss == "robust" else 0.0, kind)
    for kind in ("forward_kl", "js_divergence", "alpha_divergence")
    for loss in ("sigmoid", "ipo", "hinge", "robust", "discopop", "sigmoid_norm")}


@pytest.mark.parametrize("name", list(CASES))
def test_each_loss_equals_its_formula_by_hand(name):
    loss, eps, *divergence = CASES[name]
    losses, metrics = shardlm_losses(loss, eps, *divergence)
    want, rewards = by_hand(loss, eps, *divergence)
    for pair, (got, expected) in enumerate(zip(losses.tolist(), want)):
        assert abs(got - expected) <= TOL * max(1.0, abs(expected)), f"{loss} pair {pair}: {got} vs {expected}"
    for pair, (chosen, rejected) in enumerate(rewards):
        assert math.isclose(metrics["rewards_chosen"][pair].item(), chosen, rel_tol=TOL)
        assert math.isclose(metrics["rewards_rejected"][pair].item(), rejected, rel_tol=TOL)
        assert math.isclose(metrics["reward_margin"][pair].item(), chosen - rejected, rel_tol=TOL)
        assert metrics["reward_accuracy"][pair].item() == float(chosen > rejected)


def test_a_weighted_sum_adds_the_chosen_tokens_nll():
    """MPO's sum (TRL's loss_type ["sigmoid", "bco_pair", "sft"], loss_weights [0.8, 0.2, 1.0]): each pair's
    0.8 DPO + 0.2 BCO + its chosen answer's NLL x pairs / chosen tokens, so the mean over the pairs is the weighted
    means plus the NLL per chosen token of the batch (here 2 pairs and 4 + 9 chosen tokens)."""
    cfg = PreferenceConfig(loss="sigmoid+bco_pair+sft", loss_weights=[0.8, 0.2, 1.0], beta=BETA)
    share = 2 / (COUNTS[0][0] + COUNTS[1][0])
    losses, _ = pair_losses(cfg, torch.tensor(LOGPS, dtype=torch.float64), torch.tensor(COUNTS, dtype=torch.float64),
                            torch.tensor(REFERENCE, dtype=torch.float64), share)
    dpo, bco = by_hand("sigmoid")[0], by_hand("bco_pair")[0]
    nll = -(LOGPS[0][0] + LOGPS[1][0]) / (COUNTS[0][0] + COUNTS[1][0])
    want = 0.8 * sum(dpo) / 2 + 0.2 * sum(bco) / 2 + nll
    assert abs(losses.mean().item() - want) <= TOL * want, (losses.mean().item(), want)


@pytest.mark.parametrize("loss", ["simpo", "cpo", "cpo_hinge", "cpo_ipo"])
def test_alphapo_shapes_each_answers_score(loss):
    """AlphaPO (`alpha` 0.3, TRL's CPOConfig alpha): each answer's score s (its log-probability, per token for simpo
    and cpo_ipo) becomes (1 - exp(s)^-alpha) / alpha in the loss and the logged rewards (beta times it); written
    with `math` on exp(s)."""
    cfg = PreferenceConfig(loss=loss, beta=BETA, simpo_gamma=GAMMA, alpha=ALPHA)
    losses, metrics = pair_losses(cfg, torch.tensor(LOGPS, dtype=torch.float64),
                                  torch.tensor(COUNTS, dtype=torch.float64), None)
    for pair, ((lc, lr), (nc, nr)) in enumerate(zip(LOGPS, COUNTS)):
        sc, sr = (lc / nc, lr / nr) if loss in ("simpo", "cpo_ipo") else (lc, lr)
        c, r = ((1 - math.exp(s) ** -ALPHA) / ALPHA for s in (sc, sr))
        want = {"simpo": -log_sigmoid(BETA * (c - r) - GAMMA), "cpo": -log_sigmoid(BETA * (c - r)),
                "cpo_hinge": max(0.0, 1 - BETA * (c - r)), "cpo_ipo": ((c - r) - 1 / (2 * BETA)) ** 2}[loss]
        assert abs(losses[pair].item() - want) <= TOL * max(1.0, abs(want)), (loss, pair, losses[pair].item(), want)
        assert math.isclose(metrics["rewards_chosen"][pair].item(), BETA * c, rel_tol=TOL)
        assert math.isclose(metrics["rewards_rejected"][pair].item(), BETA * r, rel_tol=TOL)
    assert (losses - torch.tensor(by_hand(loss)[0], dtype=torch.float64)).abs().max() > 1e-3  # the shape moves it


def test_cpo_adds_the_chosen_tokens_nll():
    """CPO as TRL's CPOTrainer trains it ("cpo+sft", cpo_alpha the second weight, 0.5 here): the mean over the
    pairs is the CPO loss's mean plus cpo_alpha x the NLL per chosen token of the batch."""
    cfg = PreferenceConfig(loss="cpo+sft", loss_weights=[1.0, 0.5], beta=BETA)
    share = 2 / (COUNTS[0][0] + COUNTS[1][0])
    losses, _ = pair_losses(cfg, torch.tensor(LOGPS, dtype=torch.float64), torch.tensor(COUNTS, dtype=torch.float64),
                            None, share)
    nll = -(LOGPS[0][0] + LOGPS[1][0]) / (COUNTS[0][0] + COUNTS[1][0])
    want = sum(by_hand("cpo")[0]) / 2 + 0.5 * nll
    assert abs(losses.mean().item() - want) <= TOL * want, (losses.mean().item(), want)


def test_the_fixture_reaches_both_sides_of_each_loss():
    """The fixture is not a degenerate point: the hinge is active on one pair and clipped on the other; label
    smoothing changes DPO's value; per-token IPO differs from IPO on the summed log-ratios; the accuracy is 1 on
    one pair and 0 on the other."""
    hinge, _ = by_hand("hinge")
    assert hinge[0] == 0.0 and hinge[1] > 0
    cpo_hinge, _ = by_hand("cpo_hinge")
    assert cpo_hinge[0] == 0.0 and cpo_hinge[1] > 0
    assert all(abs(a - b) > 0.1 for a, b in zip(by_hand("sigmoid")[0], by_hand("sigmoid", 0.2)[0]))
    summed = [((lc - rc) - (lr - rr) - 1 / (2 * BETA)) ** 2 for (lc, lr), (rc, rr) in zip(LOGPS, REFERENCE)]
    assert all(abs(a - b) > 0.1 for a, b in zip(by_hand("ipo")[0], summed))
    assert shardlm_losses("sigmoid")[1]["reward_accuracy"].tolist() == [1.0, 0.0]
    # each f-divergence moves DPO's value, and the alpha divergence is not its alpha = 1 limit
    for kind in ("forward_kl", "js_divergence", "alpha_divergence"):
        assert all(abs(a - b) > 0.01 for a, b in zip(by_hand("sigmoid")[0], by_hand("sigmoid", 0.0, kind)[0]))
    # DiscoPOP's gate is open on one pair and closed on the other (both of its parts reached)
    assert [round(sigmoid(BETA * ((lc - rc) - (lr - rr)) / TAU)) for (lc, lr), (rc, rr) in zip(LOGPS, REFERENCE)] \
        == [1, 0]


def test_a_batch_without_its_reference_needs_adapters_to_switch_off():
    """The reference of a run without LoRA is a precomputed table or its own weights; a batch that reached the loss
    without either would otherwise take the policy itself as its reference (the loss stuck at ln 2 with no error)."""
    from shardlm.parallel import ParallelContext
    from shardlm.preference.loss import PreferenceLoss

    loss = PreferenceLoss(PreferenceConfig(loss="dpo"), ParallelContext.single(), torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="no precomputed reference log-probabilities, no reference weights and "
                                           "no LoRA adapters"):
        loss.reference_logps(lambda *args, **kwargs: None, {"inputs": None, "targets": None, "documents": None})


def test_length_weights_are_trls_shared_and_tail_masks():
    """LD-DPO's token weights on packed rows (`length_weights`): two rows, three pair occurrences with answers of 2 to
    5 tokens (one pair twice in a row is two occurrences, and a shorter chosen answer as well as a shorter rejected
    one), prompts and padding between them. Each answer's weights are those TRL's lines give on its own padded row:
    1 where the completion mask's cumsum is in [1, min(n_c, n_r)], alpha after; 0 off the answers."""
    from shardlm.preference.loss import length_weights, pair_occurrences

    alpha = 0.25
    # (pair, side, answer length) of each answer along a row, a 2-token prompt before each pair and a pad after
    rows = [[(0, 0, 3), (0, 1, 5), (1, 0, 4), (1, 1, 2)], [(2, 0, 2), (2, 1, 2), (0, 0, 3), (0, 1, 5)]]
    pair, side, labels, expected = [], [], [], []
    for answers in rows:
        p, s, lab, want = [], [], [], []
        lengths = {(a, b): n for a, b, n in answers}
        for a, b, n in answers:
            prompt = 2 if b == 0 else 0
            p += [a] * (prompt + n)
            s += [0] * prompt + [b] * n
            lab += [-100] * prompt + [7] * n
            shared = min(lengths[(a, 0)], lengths[(a, 1)])
            mask = torch.tensor([0] * 3 + [1] * n + [0] * 4)  # TRL's completion mask on the answer's own padded row
            position = mask.cumsum(0)
            trl = ((position > 0) & (position <= shared)).double() + alpha * (position > shared).double()
            want += [0.0] * prompt + trl[mask.bool()].tolist()
        p, s, lab, want = p + [-1], s + [-1], lab + [-100], want + [0.0]  # a padding token
        pair.append(p)
        side.append(s)
        labels.append(lab)
        expected.append(want)
    width = max(len(r) for r in pair)

    def pad(row: list, value) -> list:
        return row + [value] * (width - len(row))

    pair = torch.tensor([pad(r, -1) for r in pair])
    side = torch.tensor([pad(r, -1) for r in side])
    labels = torch.tensor([pad(r, -100) for r in labels])
    expected = torch.tensor([pad(r, 0.0) for r in expected], dtype=torch.float64)
    _, occurrence = pair_occurrences(pair)
    got = length_weights(labels, occurrence, side, alpha)
    assert torch.equal(got, expected), (got, expected)
    assert (got == alpha).sum() == 2 + 2 + 2  # the tails: pair 0's rejected (twice) and pair 1's chosen
