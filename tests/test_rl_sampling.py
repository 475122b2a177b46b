"""The rollouts' sampler draws from the distribution `shardlm.eval.generate.filter_logits` defines (temperature,
top-k, top-p, min-p, after `penalize_repetition`), which is transformers' logits processors' (the repetition penalty,
min-p), and returns the unfiltered temperature-scaled log-probabilities."""

from __future__ import annotations

import pytest
import torch

from shardlm.eval.generate import filter_logits
from shardlm.rl.rollout import sample_next

GRID = 4000


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
                                                      (1.0, 12, 0.6), (1.0, 0, 0.9999)])
def test_the_sampler_draws_the_filtered_distribution(temperature, top_k, top_p):
    """Uniforms on a grid of GRID points: each token is picked GRID x its probability times, within one (the
    inverse CDF of a distribution over contiguous intervals), the probabilities of `filter_logits` (float64, sorted:
    another computation)."""
    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(1)) * 2
    uniform = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    counts = torch.zeros(3, 97)
    for u in uniform:
        chosen, logps = sample_next(logits, u.repeat(3), temperature, top_k, top_p)
        counts[torch.arange(3), chosen] += 1
    want = filter_logits(logits, temperature, top_k, top_p) * GRID
    assert (counts - want).abs().max() <= 1.0 + 1e-6, (counts - want).abs().max()
    torch.testing.assert_close(logps, torch.log_softmax(logits.double() / temperature, -1).float())


def test_top_p_reaches_past_the_first_candidates():
    """A flat distribution whose nucleus needs more than the first 64 candidates (the search widens): over a grid of
    uniforms, exactly the 500 tokens of the 0.5 nucleus are picked."""
    logits = torch.zeros(1, 1000)
    chosen = {int(sample_next(logits, torch.tensor([(i + 0.5) / 2000]), 1.0, 0, 0.5)[0]) for i in range(2000)}
    assert len(chosen) == 500, len(chosen)


FILTERS = [(1.0, 0, 1.0, 0.1, 1.0), (0.7, 0, 1.0, 0.0, 1.5), (1.3, 8, 0.9, 0.05, 1.2), (0.9, 0, 0.8, 0.2, 0.8)]
"""(temperature, top_k, top_p, min_p, repetition_penalty): min-p alone, the penalty alone, both after top-k and top-p,
and a penalty below 1 (which favours the repeated ids)."""


def transformers_probs(logits: torch.Tensor, seen: torch.Tensor, temperature, top_k, top_p, min_p, penalty):
    """The distribution transformers' `generate` samples from: its logits processors in its own order (repetition
    penalty; temperature, top-k, top-p, min-p warpers), then the softmax."""
    from transformers.generation import logits_process as lp

    processors = [lp.RepetitionPenaltyLogitsProcessor(penalty=float(penalty)), lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        processors.append(lp.TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        processors.append(lp.TopPLogitsWarper(top_p=top_p))
    if min_p:
        processors.append(lp.MinPLogitsWarper(min_p=min_p))
    scores = logits.clone()
    for processor in processors:
        scores = processor(seen, scores)
    return scores.double().softmax(dim=-1)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,penalty", FILTERS)
def test_min_p_and_the_repetition_penalty_are_transformers(temperature, top_k, top_p, min_p, penalty):
    """`penalize_repetition` then `filter_logits` give the distribution of transformers' logits processors (the
    oracle TRL's generation runs), on rows whose seen ids repeat and carry logits of both signs: the same support,
    the probabilities within 1e-6; the rollouts' sampler draws it over a grid of uniforms (each token GRID x its
    probability times, within one), and its log-probabilities stay the unpenalized, unfiltered policy's."""
    pytest.importorskip("transformers")
    from shardlm.eval.generate import penalize_repetition

    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(2)) * 2
    seen = torch.tensor([[3, 5, 5, 40], [0, 96, 7, 7], [11, 12, 13, 14]])
    logits[0, 3], logits[1, 7] = -1.5, 4.0  # a negative and the largest logit among the seen ids
    want = transformers_probs(logits, seen, temperature, top_k, top_p, min_p, penalty)
    got = filter_logits(penalize_repetition(logits, seen, penalty), temperature, top_k, top_p, min_p)
    assert torch.equal(got > 0, want > 0), (got > 0) ^ (want > 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    uniform = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    counts = torch.zeros(3, 97)
    for u in uniform:
        chosen, logps = sample_next(logits, u.repeat(3), temperature, top_k, top_p, min_p, penalty, seen)
        counts[torch.arange(3), chosen] += 1
    assert (counts - want * GRID).abs().max() <= 1.0 + 1e-6, (counts - want * GRID).abs().max()
    torch.testing.assert_close(logps, torch.log_softmax(logits.double() / temperature, -1).float())
    if penalty != 1.0:  # the control: without the penalty the distribution is another
        assert (filter_logits(logits, temperature, top_k, top_p, min_p) - want).abs().max() > 1e-3
