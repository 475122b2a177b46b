"""The trainer's loss of a reward-model run: the Bradley-Terry loss of packed preference pairs, as TRL's
RewardTrainer (1.16) computes it, exact at every layout.

Each pair's two sequences (prompt + chosen, prompt + rejected) are two documents of a packed row
(`shardlm.preference.data`); a sequence's reward r is the score head on its last token's final hidden state
(`shardlm.reward.head`). Per pair, with m the record's `margin` (0 without) and c = center_rewards_coefficient:

    -log sigmoid(r_chosen - r_rejected - m) + c (r_chosen + r_rejected)^2

The loss of the global batch is the mean over its pairs: each micro-batch returns its pairs' summed losses over
`divisor` = pairs of the global batch / (micro-batches x DP) (`shardlm.preference.loss.preference_parts`), so a
micro-batch split or a data-parallel layout changes nothing (TRL's mean is per device micro-batch, the same when
every micro-batch holds as many pairs).

Logged as TRL logs them: `accuracy` (the chosen reward above the rejected one), `margin` (their mean difference),
`min_reward`, `mean_reward`, `max_reward` over both answers, and `rewards_chosen` / `rewards_rejected`; held out,
`val_accuracy` and `val_margin`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.config import RewardConfig
from shardlm.data.zigzag import zigzag_split
from shardlm.preference.loss import preference_parts
from shardlm.reward.head import last_tokens, sequence_rewards

SUMS = ("accuracy", "margin", "rewards_chosen", "rewards_rejected", "pairs")
"""Per-pair values summed over a step's pairs (then divided by their count, the last)."""


def reward_parts(batches: list[dict], ctx, count_pairs: bool = True) -> list[dict]:
    """`preference_parts` of this rank's micro-batches of pair rows, each with `last` (b, T / C): the last token of
    each sequence (`last_tokens`, found on the whole rows, then this CP rank's zigzag part)."""
    parts = preference_parts(batches, ctx, count_pairs)
    for batch, part in zip(batches, parts):
        last = last_tokens(batch["position_ids"], batch["pair"])
        part["last"] = zigzag_split(last, ctx.cp_size, ctx.cp_rank) if ctx.cp_size > 1 else last
    return parts


def pair_losses(cfg: RewardConfig, rewards: torch.Tensor, margin: torch.Tensor | None) -> torch.Tensor:
    """(P,) losses (module docstring) of the pairs' rewards (P, 2), chosen first, and their margins (P,) or None."""
    difference = rewards[:, 0] - rewards[:, 1]
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference)
    if cfg.center_rewards_coefficient:
        losses = losses + cfg.center_rewards_coefficient * (rewards[:, 0] + rewards[:, 1]) ** 2
    return losses


class RewardLoss:
    """`loss(forward, batch)` of a `reward_parts` micro-batch (the model's forward runs the head on its final-norm
    output inside its call), or `of_hidden(hidden, batch)` on the last pipeline stage. Training calls add their
    pairs' sums, minimum and maximum to the step's (`take_metrics`); evaluation calls to the held-out ones
    (`take_eval_metrics`)."""

    def __init__(self, cfg: RewardConfig, ctx, model):
        self.cfg, self.ctx, self.model = cfg, ctx, model
        self.margins: dict[str, torch.Tensor] = {}  # "train" / "valid" -> (pairs,) the records' margins
        self.sums = {split: torch.zeros(len(SUMS), dtype=torch.float64) for split in ("train", "valid")}
        self.extremes = torch.tensor([-torch.inf, -torch.inf], dtype=torch.float64)  # max, -min of the rewards

    def set_margins(self, datasets: dict) -> None:
        """The records' margins of each split ({"train": PairDataset, "valid": ...}, None skipped); a split whose
        records have none has no table (no margin)."""
        for split, data in datasets.items():
            pairs = data.rows.pairs if data is not None else []
            if any(pair.margin is not None for pair in pairs):
                self.margins[split] = torch.tensor([pair.margin or 0.0 for pair in pairs], dtype=torch.float64)

    def attach_margins(self, parts: list[dict], split: str) -> list[dict]:
        """Give each micro-batch of `split` its pairs' margins (when the split has any)."""
        table = self.margins.get(split)
        for part in parts:
            part["margin"] = None if table is None else table.to(part["pairs"].device)[part["pairs"]]
        return parts

    def __call__(self, forward, batch: dict) -> torch.Tensor:
        rewards = forward(batch["inputs"], documents=batch["documents"],
                          then=lambda hidden: sequence_rewards(self.model, hidden, batch, self.ctx))
        return self.of_rewards(rewards, batch)

    def of_hidden(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        """The last pipeline stage's loss of one micro-batch from its final-norm output."""
        return self.of_rewards(sequence_rewards(self.model, hidden, batch, self.ctx), batch)

    def of_rewards(self, rewards: torch.Tensor, batch: dict) -> torch.Tensor:
        """The micro-batch's share of the global batch's mean pair loss, from its pairs' rewards (P, 2)."""
        losses = pair_losses(self.cfg, rewards, batch["margin"])
        values = rewards.detach()
        difference = values[:, 0] - values[:, 1]
        split = "train" if self.model.training else "valid"
        self.sums[split] += torch.stack([(difference > 0).double().sum(), difference.sum(), values[:, 0].sum(),
                                         values[:, 1].sum(), torch.tensor(float(len(values)), dtype=torch.float64)
                                         ]).cpu()
        if self.model.training and len(values):
            self.extremes = torch.maximum(self.extremes, torch.stack([values.max(), -values.min()]).cpu())
        return (losses.sum() / batch["divisor"]).float()

    def _reduced(self, split: str) -> torch.Tensor:
        """The split's sums over DP (and the pipeline group, whose last stage alone computed them), then reset."""
        sums = self.sums[split].to(self.ctx.device, copy=True)
        self.ctx.dp.all_reduce(sums)
        if self.ctx.pp_size > 1:
            self.ctx.pp.all_reduce(sums)
        self.sums[split].zero_()
        return sums

    def take_metrics(self) -> dict[str, float]:
        """The step's means over the global batch's pairs (module docstring), then reset."""
        sums = self._reduced("train")
        extremes = self.extremes.to(self.ctx.device, copy=True)
        self.ctx.dp.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        if self.ctx.pp_size > 1:
            self.ctx.pp.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        self.extremes.fill_(-torch.inf)
        pairs = max(sums[-1].item(), 1.0)
        means = {name: sums[i].item() / pairs for i, name in enumerate(SUMS[:-1])}
        means["mean_reward"] = (means["rewards_chosen"] + means["rewards_rejected"]) / 2
        return means | {"min_reward": -extremes[1].item(), "max_reward": extremes[0].item()}

    def take_eval_metrics(self) -> dict[str, float]:
        """The last evaluation's `val_accuracy` and `val_margin` over the held-out pairs it ran, then reset."""
        sums = self._reduced("valid")
        pairs = sums[-1].item()
        if pairs == 0:
            return {}
        return {"val_accuracy": sums[0].item() / pairs, "val_margin": sums[1].item() / pairs}


def describe_run(trainer) -> str:
    """The run's line: the loss, the centering, the margins and where the head started."""
    cfg, data = trainer.config.reward, trainer.train_data
    with_margin = sum(data.rows.pairs[i].margin is not None for i in data.rows.kept)
    line = f"reward model: {cfg.loss} loss over {len(data.rows.kept)} training pairs"
    if cfg.center_rewards_coefficient:
        line += f", rewards centered (coefficient {cfg.center_rewards_coefficient:g})"
    line += f", {with_margin} with a margin" if with_margin else ", no margins"
    return line
