"""Group-relative advantages (GRPO), as TRL's `GRPOTrainer` computes them.

The rewards of the G completions of each prompt form a group. With r the weighted sum of the reward functions'
values (a function that returns None for a completion is left out of that sum; a completion no function scored is
"unscorable"), the advantage is r minus its group's mean, divided by `scale` + 1e-4 where `scale` is the group's
std ("group"), the whole batch's std ("batch": the group mean is still subtracted) or nothing ("none"). Stds are
unbiased (n - 1), over the scored completions (NaN below two, whose advantages become 0). A group whose rewards are
all equal has advantage 0 everywhere (and no NaN); an unscorable completion gets advantage 0 and is left out of its
group's mean.

With several reward functions, `rl.multi_objective_aggregation = "normalize_then_sum"` (GDPO) normalizes each
function's rewards within its group first ((x - mean) / (std + 1e-4)), sums them with the weights, and normalizes
that sum over the whole batch (`decoupled_advantages`), as TRL does.
"""

from __future__ import annotations

import numpy as np


def nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """The unbiased std over the non-NaN values (TRL's `nanstd`): NaN where fewer than two values."""
    count = np.sum(~np.isnan(x), axis=axis)
    mean = np.nanmean(x, axis=axis, keepdims=axis is not None)
    variance = np.nansum((x - mean) ** 2, axis=axis) / np.maximum(count - 1, 1)
    return np.where(count > 1, np.sqrt(variance), np.nan)


def combine_rewards(per_function: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(N, F) rewards (NaN where a function returned None) and (F,) weights -> (N,) weighted sums, NaN where no
    function scored the completion."""
    total = np.nansum(per_function * weights[None, :], axis=1)
    total[np.isnan(per_function).all(axis=1)] = np.nan
    return total


def decoupled_advantages(per_function: np.ndarray, weights: np.ndarray, group: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """GDPO: (N, F) rewards (NaN where a function returned None), (F,) weights, groups of `group` consecutive
    completions -> ((N,) advantages, (N,) whether the batch's std of the summed normalized rewards was 0)."""
    n, functions = per_function.shape
    with np.errstate(invalid="ignore", divide="ignore"):
        grouped = per_function.reshape(-1, group, functions)
        mean = np.nanmean(grouped, axis=1, keepdims=True)
        std = nanstd(grouped, axis=1)[:, None, :]
        summed = combine_rewards(((grouped - mean) / (std + 1e-4)).reshape(n, functions), weights)
        batch_std = nanstd(summed) if n > 1 else 0.0
        advantages = (summed - np.nanmean(summed)) / (batch_std + 1e-4)
    return np.nan_to_num(advantages, nan=0.0), np.full(n, bool(np.isclose(batch_std, 0.0)))


def rloo_advantages(rewards: np.ndarray, group: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """RLOO (TRL's RLOOTrainer): (N,) rewards (NaN: unscorable), groups of `group` -> ((N,) advantages, (N,) whether
    the group's std was 0). Each completion's baseline is the mean of its group's other scorable rewards; `normalize`:
    the advantages over the batch to mean 0 and std 1 (+1e-4); an unscorable completion, or one alone in its group,
    gets 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        grouped = rewards.reshape(-1, group)
        counts = np.repeat(np.sum(~np.isnan(grouped), axis=1), group)
        sums = np.repeat(np.nansum(grouped, axis=1), group)
        advantages = rewards - (sums - rewards) / (counts - 1)
        if normalize:
            advantages = (advantages - np.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
        std = np.repeat(nanstd(grouped, axis=1), group)
    return np.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0), np.isclose(std, 0.0)


def group_advantages(rewards: np.ndarray, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """(N,) rewards (NaN: unscorable), groups of `group` consecutive completions -> ((N,) advantages, (N,) whether
    the completion's std was 0, for `frac_reward_zero_std`); float64."""
    with np.errstate(invalid="ignore"):  # an all-NaN group: its mean is NaN, its advantages become 0
        grouped = rewards.reshape(-1, group)
        mean = np.repeat(np.nanmean(grouped, axis=1), group)
        if scale == "batch":
            std = np.full_like(rewards, nanstd(rewards) if rewards.size > 1 else 0.0)
        else:
            std = np.repeat(nanstd(grouped, axis=1), group)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + 1e-4)
    return np.nan_to_num(advantages, nan=0.0), np.isclose(std, 0.0)
