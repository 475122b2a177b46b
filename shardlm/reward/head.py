"""A reward model's score head: one linear map from a sequence's last final hidden state to its scalar reward
(Hugging Face's `XForSequenceClassification` with `num_labels = 1`, `score`), exact at every layout.

The head is whole on every rank. Under tensor parallelism without sequence parallelism the final-norm output is
whole on every TP rank too, so each rank computes the same rewards and gradients, as for the norms. Under sequence
parallelism each TP rank holds a chunk of the sequence: it scores the last tokens in its chunk, the rewards are
summed over TP in the forward (each rank's tokens then get their own gradient, `reduce_from_tensor_parallel`) and
the head's gradient is summed over TP after the backward (it is marked `sequence_parallel`). Under context
parallelism a sequence's last token lies on one CP rank: the rewards are summed over CP forward and backward
(`sum_over`, as the preference losses sum log-probabilities), every CP rank computing the same pair losses.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.parallel import reduce_from_tensor_parallel, sum_over
from shardlm.parallel.init import param_seed

SCORE = "score"
"""The head's attribute on the model and its parameter's name (`score.weight`), as Hugging Face names it."""


def add_score_head(model: nn.Module, seed: int) -> nn.Module:
    """Give a decoder LM (built, before pipeline stages, compilation or data parallelism wrap it) its score head
    (1, h), drawn from N(0, init_std^2) by the run's `seed` (and the head's name), the same on every rank, as
    transformers initializes it. The head replaces the language-model head on the last pipeline stage: the last
    stage keeps the final norm and the head, and an untied output layer is dropped (its weights never get a
    gradient). Returns the model."""
    cfg = model.cfg
    head = nn.Linear(cfg.hidden_size, 1, bias=False)
    generator = torch.Generator().manual_seed(param_seed(seed, SCORE))
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * cfg.init_std)
    device = next(model.parameters()).device
    model.score = head.to(device)
    if model.sequence_parallel:  # each TP rank's gradient comes from the last tokens of its chunk
        model.score.weight.sequence_parallel = True
    if getattr(model, "lm_head", None) is not None:
        model.lm_head = None
    model.LAST_STAGE = ("ln_f", SCORE)
    return model


def last_tokens(position_ids: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """(b, T) True at the last token of every sequence of packed rows: a token of a sequence (`owner` >= 0) whose
    next position restarts at 0 (the next sequence, or the padding, whose positions restart too) or ends the row."""
    restart = torch.ones_like(owner, dtype=torch.bool)
    restart[:, :-1] = position_ids[:, 1:] == 0
    return (owner >= 0) & restart


def sequence_rewards(model: nn.Module, hidden: torch.Tensor, batch: dict, ctx) -> torch.Tensor:
    """(P, 2) rewards, chosen first, of the micro-batch's pair occurrences from this rank's final-norm output
    `hidden` (b, T_local, h), or its (b, T_local / tp, h) chunk under sequence parallelism, and the batch's `last`,
    `occurrence` and `side` (b, T_local) (`shardlm.reward.loss.reward_parts`); summed over TP (sequence
    parallelism) and CP, with gradients as the module docstring says. fp64."""
    last, occurrence, side = batch["last"], batch["occurrence"], batch["side"]
    if model.sequence_parallel:
        chunk = slice(ctx.tp_rank * hidden.shape[1], (ctx.tp_rank + 1) * hidden.shape[1])
        last, occurrence, side = last[:, chunk], occurrence[:, chunk], side[:, chunk]
    scores = model.score(hidden[last]).squeeze(-1).double()
    slot = occurrence[last] * 2 + side[last]
    rewards = torch.zeros(2 * len(batch["pairs"]), dtype=torch.float64, device=hidden.device).index_add(
        0, slot, scores)
    if model.sequence_parallel:
        rewards = reduce_from_tensor_parallel(rewards, ctx.tp)
    if ctx.cp_size > 1:
        rewards = sum_over(rewards, ctx.cp)
    return rewards.view(-1, 2)
