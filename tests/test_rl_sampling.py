"""The rollouts' sampler draws from the distribution `shardlm.eval.generate.filter_logits` defines (temperature,
top-k, top-p), and returns the unfiltered temperature-scaled log-probabilities."""

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
