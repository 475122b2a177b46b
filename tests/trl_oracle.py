"""A module fixture for test files that run TRL's trainers as oracles on the CPU: import `trl_scores_answers_only`
into the test module and TRL's fused log-probability forward scores only the positions with a label, as it does on a
GPU, instead of every position of the rows (its CPU path, which the prompts and the padding make several times
longer over the 151,936-entry vocabulary). Each scored token's value is the same function of its own hidden state
either way, to the rounding of a matrix product over another number of rows."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def trl_scores_answers_only():
    utils = pytest.importorskip("trl.trainer.utils")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "_use_triton", lambda device: True)
        yield
