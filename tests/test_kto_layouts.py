"""KTO gives the one-process answer at every layout: its KL reference point is the global batch's, not a micro-batch's.

Data: 40 synthetic unpaired examples (`test_preference_layouts`' token stream: a desirable completion continues
its prompt, an undesirable one does not), each with its KL sequence (its prompt and a completion rotated within
groups of 8), packed best-fit-decreasing into rows of 48 tokens, so rows hold different numbers of examples.
The reference is precomputed by the starting weights (for the training and the 12 held-out examples), or is a
LoRA run's base (adapters off).

Checks, each against one process within 1e-5 (fp32: losses, gradient norms, the rewards, margin and KL estimate,
the validation loss before and after training, every final parameter on every rank):
- step 1's loss and the first validation loss are each example's 0.5 by its label's weight, averaged, at every
  layout (the policy is its reference, and z0 is 0);
- world 2: DP=2, TP=2 with SP, CP=2, PP=2 (the KL sequences forward through the stages before the step, z0
  summed over the pipeline group), FSDP (the no-gradient pass before the training one), and a LoRA run whose
  reference is the base at PP=2 (the base's and the policy's passes of the KL sequences through the stages),
  against its own one-process run;
- one process: micro-batch 1 equals micro-batch 8, and the later steps' z0 is positive (the clamp at 0 does not
  hide it). The control: z0 taken from the first micro-batch alone (TRL's per-micro-batch estimate) moves the
  micro-batch-1 run off the micro-batch-8 one by far more than the bound.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from test_preference_layouts import SEQ, STEPS, TOL, preference_config, synthetic_pairs
from test_preference_layouts import train_layout as train_pairs_layout

from shardlm.parallel import ParallelContext
from shardlm.preference import kto
from shardlm.preference.data import PairDataset, PairRows
from shardlm.preference.unpaired import TokenizedExample, kl_completions

from agreement import CURVE, assert_every_rank, assert_same_run
from layouts import layout, layout_context, spawn_layouts

WEIGHTS = (1.0, 1.3)


def synthetic_examples(count: int, seed: int, kl: bool = True) -> list[TokenizedExample]:
    """Each of `synthetic_pairs`' pairs gives one example: its chosen answer (desirable) or its rejected one, by a
    draw of `seed`; without KL sequences unless `kl`."""
    labels = np.random.default_rng([seed, 3]).random(count) < 0.5
    pairs = synthetic_pairs(count, seed)
    completions = [p.chosen if label else p.rejected for p, label in zip(pairs, labels)]
    mismatched = kl_completions(completions, 8) if kl else [None] * count
    return [TokenizedExample(p.prompt, c, k, bool(label), p.where)
            for p, c, k, label in zip(pairs, completions, mismatched, labels)]


def kto_config(loss: str = "kto", **config):
    base = preference_config(**config)
    base.preference.loss = loss
    base.preference.desirable_weight, base.preference.undesirable_weight = WEIGHTS
    return base


def train_layout(ctx: ParallelContext, config) -> dict:
    """`test_preference_layouts.train_layout` on the synthetic examples (with KL sequences where the loss uses them)
    and KTO's metrics."""
    kl = config.preference.loss in kto.KL_LOSSES
    data = (PairDataset(PairRows(synthetic_examples(40, 1, kl), SEQ, seed=5)),
            PairDataset(PairRows(synthetic_examples(12, 2, kl), SEQ, seed=None), epochs=1))
    return train_pairs_layout(ctx, config, data, kto.METRICS)


@contextlib.contextmanager
def first_micro_batch_kl():
    """z0 from the first micro-batch's examples alone (as a per-micro-batch estimate has it), not the global
    batch's."""
    estimate = kto.estimate_kl
    kto.estimate_kl = lambda batches, ctx: estimate(batches[:1], ctx)
    try:
        yield
    finally:
        kto.estimate_kl = estimate


def run_layout(tp: int, pp: int, cp: int, ep: int, **config) -> dict:
    return train_layout(layout_context(tp, pp, cp, ep), kto_config(tp=tp, cp=cp, ep=ep, pp=pp, **config))


WORLD2 = {
    "dp2": layout(),
    "tp2 sp": layout(tp=2, sp=True),
    "cp2": layout(cp=2),
    "pp2": layout(pp=2),
    "fsdp dp2": layout(data_sharding="full"),
    "pp2 lora": layout(pp=2, lora=4),
}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2)


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, kto_config()), "lora": train_layout(ctx, kto_config(lora=4))}


SAME_RUN = {"steps": STEPS, "tol": TOL, "columns": CURVE + kto.METRICS, "absolute": kto.METRICS}
"""Losses, gradient norms, validation losses and parameters within TOL relative; the rewards, margin and z0 within
TOL absolute (differences of log-probabilities: near 0 a relative bound would measure rounding)."""


def at_the_reference(examples: list[TokenizedExample]) -> float:
    """The loss where the policy is its reference: 0.5 an example by its label's weight, averaged."""
    return float(np.mean([0.5 * WEIGHTS[0 if e.label else 1] for e in examples]))


def assert_starts_at_the_reference(value: dict, train_examples: list, where: str) -> None:
    first, valid = value["curve"][0], value["valid"][0]
    assert abs(first[0] - at_the_reference(train_examples)) <= 1e-6, f"{where}: step 1 loss {first[0]}"
    assert abs(valid - at_the_reference(synthetic_examples(12, 2))) <= 1e-6, f"{where}: first validation {valid}"
    assert first[-1] == 0.0, f"{where}: step 1 z0 {first[-1]}"


def first_batch_examples(kl: bool = True) -> list[TokenizedExample]:
    """The examples of step 1's 8 rows (rows with KL sequences, or without)."""
    data = PairDataset(PairRows(synthetic_examples(40, 1, kl), SEQ, seed=5))
    indices = {int(i) for row in range(8) for i in data[row]["pair"] if i >= 0}
    return [data.rows.pairs[i] for i in sorted(indices)]


@pytest.mark.parametrize("name", list(WORLD2))
def test_kto_at_two_ranks_equals_one_process(world2, reference, name):
    ref = reference["lora" if "lora" in name else "dense"]
    for rank, value in enumerate(assert_every_rank(world2, name, ref, **SAME_RUN)):
        assert_starts_at_the_reference(value, first_batch_examples(), f"{name} rank {rank}")


def test_kto_one_process_learns_with_a_positive_kl(reference):
    """The loss falls, the desirable examples' rewards rise above the undesirable ones', and z0 turns positive after
    the first update, so the comparisons above include it."""
    for kind in ("dense", "lora"):
        curve = reference[kind]["curve"]
        assert curve[-1][0] < curve[0][0] and curve[-1][4] > 0, (kind, curve)
        assert max(step[5] for step in curve[1:]) > 100 * TOL, (kind, curve)


def test_micro_batch_one_equals_micro_batch_eight(reference):
    """Eight micro-batches of different example counts equal one micro-batch of the 8 rows: z0 is the global batch's
    (the control, which trains, its loss falling: the first micro-batch's z0 moves the run off by far more than the
    bound)."""
    ones = train_layout(ParallelContext.single(), kto_config(micro=1))
    eights = train_layout(ParallelContext.single(), kto_config(micro=8))
    assert_same_run(ones, eights, "micro 1", **SAME_RUN)
    assert_starts_at_the_reference(ones, first_batch_examples(), "micro 1")
    with first_micro_batch_kl():
        control = train_layout(ParallelContext.single(), kto_config(micro=1))
    assert all(np.isfinite(step[0]) for step in control["curve"]) and control["curve"][-1][0] < control["curve"][0][0]
    assert max(abs(a[0] - b[0]) / b[0] for a, b in zip(control["curve"], eights["curve"])) > 100 * TOL


def test_apo_zero_unpaired_micro_batch_one_equals_micro_batch_eight():
    """`apo_zero_unpaired` (no reference point, rows without KL sequences): micro-batch 1 equals micro-batch 8 and
    starts at the loss of a policy equal to its reference, z0 0 throughout; it learns the labels."""
    ones = train_layout(ParallelContext.single(), kto_config("apo_zero_unpaired", micro=1))
    eights = train_layout(ParallelContext.single(), kto_config("apo_zero_unpaired", micro=8))
    assert_same_run(ones, eights, "apo micro 1", **SAME_RUN)
    assert_starts_at_the_reference(ones, first_batch_examples(kl=False), "apo micro 1")
    curve = eights["curve"]
    assert all(step[5] == 0.0 for step in curve) and curve[-1][0] < curve[0][0] and curve[-1][4] > 0, curve
