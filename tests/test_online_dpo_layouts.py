"""Online DPO (`rl.loss = "online_dpo"`) gives the one-process answer at every layout.

The RL layouts' fixture (`tests/test_rl_layouts.py`): 4 prompts of 3 to 8 tokens a step, two fixed completions each
(1 to 10 tokens, some cut before the end token: `rl.missing_eos_penalty` 0.3 counts), rewarded by their ids; the pairs
chosen by reward, packed best-fit-decreasing into rows of 48 tokens (8 rows a step, empty ones after the pairs'), so
rows and data-parallel ranks hold different numbers of pairs. beta 0.5, the reference the starting weights run in
each step (a LoRA run's base with the adapters off). Over 3 steps, each against one process within 1e-5: the loss,
gradient norm, the chosen and rejected rewards, their margin and accuracy, TRL's `objective/scores_margin`, every
final parameter on every rank: DP=2, TP=2 with SP, CP=2, PP=2, FSDP DP=2, LoRA at DP=2 (against its own one-process
run). The control: the pairs taken the other way round (the worse completion chosen) moves the one-process loss.
"""

from __future__ import annotations

import pytest
from test_moe_parallel import stage_parameters
from test_rl_layouts import MAX, PROMPTS, SEQ, IdsTemplate, SyntheticCompletions, by_ids

from shardlm.parallel import ParallelContext
from shardlm.rl import online_dpo
from shardlm.rl.loop import RLRun
from shardlm.rl.rewards import Reward
from shardlm.training.reference import ReferenceWeights
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import CURVE, assert_every_rank, assert_same_run
from layouts import layout, layout_config, layout_context, spawn_layouts, tiny_model

STEPS, TOL = 3, 1e-5
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "objective/scores_margin")


def online_config(micro: int = 2, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False, lora: int = 0, **train):
    sections = {"sft": {"data": ["unused.jsonl"], "packing": "bfd"},
                "rl": {"loss": "online_dpo", "num_generations": 2, "prompts_per_step": 4, "max_completion_length": MAX,
                       "beta": 0.5, "missing_eos_penalty": 0.3},
                "lora": {"rank": lora, "targets": ["q", "v", "o", "gate", "up", "down"]}}
    return layout_config(tiny_model("llama", SEQ, layers=2, num_kv_heads=2), micro=micro, tp=tp, pp=pp, cp=cp,
                         sp=sp, sections=sections, **{"steps": STEPS, "global_batch_size": 8, **train})


def train_layout(ctx, config) -> dict:
    """STEPS steps of the run as `shardlm.training.run` sets it up: the curve and every parameter."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, None, None)
    reference = ReferenceWeights.of(trainer) if not config.lora.rank else None
    trainer.loss.weights = reference
    run = RLRun(trainer, PROMPTS, IdsTemplate, SyntheticCompletions(), [Reward("by_ids", by_ids, 1.0)], 0, reference)
    curve = []
    for _ in range(STEPS):
        metrics = run.train_step()
        curve.append((metrics["loss"], metrics["grad_norm"], *(metrics[k] for k in METRICS)))
    return {"curve": curve, "params": stage_parameters(trainer.model)}


def run_layout(tp: int, pp: int, cp: int, ep: int, **config) -> dict:
    return train_layout(layout_context(tp, pp, cp, ep), online_config(tp=tp, pp=pp, cp=cp, **config))


WORLD2 = {"dp2": layout(), "tp2 sp": layout(tp=2, sp=True), "cp2": layout(cp=2), "pp2": layout(pp=2),
          "fsdp dp2": layout(data_sharding="full"), "dp2 lora": layout(lora=4)}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2)


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, online_config()), "lora": train_layout(ctx, online_config(lora=4))}


SAME_RUN = {"steps": STEPS, "tol": TOL, "columns": CURVE + METRICS, "absolute": METRICS,
            "from_step_2": ("reward_accuracy",)}
"""Losses, gradient norms and parameters within TOL relative; the rewards, margins and accuracy within TOL absolute
(they start at 0: the policy is its reference); the accuracy from step 2 (at step 1 every margin is rounding)."""


@pytest.mark.parametrize("name", list(WORLD2))
def test_online_dpo_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference["lora" if "lora" in name else "dense"], **SAME_RUN)


def test_the_pairs_are_chosen_by_reward(reference, monkeypatch):
    """The control: the worse completion chosen moves the loss; the run's pairs carry positive score margins."""
    curve = reference["dense"]["curve"]
    assert all(step[-1] >= 0 for step in curve) and any(step[-1] > 0 for step in curve)
    pairs_of = online_dpo.pairs_of

    def reversed_pairs(prompts, rollouts, rewards, penalty):
        pairs, margins = pairs_of(prompts, rollouts, -rewards, penalty)
        return pairs, margins
    monkeypatch.setattr(online_dpo, "pairs_of", reversed_pairs)
    swapped = train_layout(ParallelContext.single(), online_config())["curve"]
    assert max(abs(a[0] - b[0]) for a, b in zip(swapped[1:], curve[1:])) > 1e-3


def test_micro_batch_one_equals_two(reference):
    assert_same_run(train_layout(ParallelContext.single(), online_config(micro=1)), reference["dense"], "micro 1",
                    **SAME_RUN)
