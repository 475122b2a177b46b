"""Reward modeling (the Bradley-Terry loss of a score head on packed pairs) gives the one-process answer at every
layout.

Data: the preference layouts' 40 synthetic pairs (`tests/test_preference_layouts.py`), every third with a margin,
packed best-fit-decreasing into rows of 48 tokens (rows hold different numbers of pairs), 12 held-out pairs; rewards
centered (coefficient 0.05). Each sequence's reward is the score head on its last token's final hidden state.

Checks, each against one process within 1e-5 (fp32: losses, gradient norms, accuracy, margin, mean, minimum and
maximum reward, the validation loss before and after training, every final parameter on every rank, the head's
included):
- world 2: DP=2, TP=2 (the head whole on both ranks), TP=2 with SP (each rank scores the last tokens of its chunk:
  the rewards summed over TP, the head's gradient summed after the backward), CP=2 (each last token on one CP
  rank, the rewards summed over CP forward and backward), PP=2 and PP=2 x 2 virtual stages (4 layers; the head on
  the last stage, no tied embedding copy there), DP=2 with ZeRO-1, FSDP, an MoE at EP=2, and LoRA (r 4 on q, v,
  up; the head trained whole beside the adapters) at TP=2 with SP and PP=2 against its own one-process run;
- world 4: CP=2 x TP=2 with SP, PP=2 x FSDP DP=2;
- the controls: under SP the head's gradient not summed over TP moves the TP=2 SP run's parameters; at one process,
  the margins dropped, or the centering, move the gradient norms;
- one process: micro-batch 1 equals micro-batch 8; packed rows score each sequence as it scores alone, and the
  training loss falls.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_moe_parallel import stage_parameters
from test_preference_layouts import synthetic_pairs

from shardlm.models import build_model
from shardlm.parallel import ParallelContext
from shardlm.preference.data import PairDataset, PairRows
from shardlm.reward.head import add_score_head
from shardlm.reward.loss import RewardLoss, reward_parts
from shardlm.training.data import micro_batches
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import CURVE, assert_every_rank, assert_same_run, assert_trained_but_off
from layouts import MIXTRAL, layout, layout_config, layout_context, spawn_layouts, tiny_model

SEQ, STEPS, TOL = 48, 4, 1e-5
METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def with_margins(pairs: list) -> list:
    return [dataclasses.replace(p, margin=0.25 * (i % 4)) if i % 3 == 0 else p for i, p in enumerate(pairs)]


def datasets() -> tuple[PairDataset, PairDataset]:
    return (PairDataset(PairRows(with_margins(synthetic_pairs()), SEQ, seed=5)),
            PairDataset(PairRows(with_margins(synthetic_pairs(12, seed=2)), SEQ, seed=None), epochs=1))


def reward_config(micro: int = 2, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, sp: bool = False,
                  moe: bool = False, center: float = 0.05, virtual: int = 1, layers: int = 2, lora: int = 0, **train):
    model = tiny_model("llama", SEQ, layers=layers, num_kv_heads=2) | (MIXTRAL if moe else {})
    sections = {"sft": {"data": ["unused.jsonl"]},
                "reward": {"loss": "bradley_terry", "center_rewards_coefficient": center},
                "lora": {"rank": lora, "targets": ["q", "v", "up"]}}
    return layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, virtual=virtual, sections=sections,
                         **{"steps": STEPS, "eval_iters": 8, "lr": 3e-3, **train})


def train_layout(ctx: ParallelContext, config, data: tuple | None = None) -> dict:
    """STEPS steps from the same starting weights: the curve (loss, gradient norm, `METRICS`), the validation loss
    before and after, the held-out accuracy after, and every parameter."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, *(data or datasets()))
    valid = [trainer.evaluate()]
    trainer.loss.take_eval_metrics()
    curve = []
    for _ in range(STEPS):
        m = trainer.train_step()
        curve.append((m["loss"], m["grad_norm"], *(m[k] for k in METRICS)))
    valid.append(trainer.evaluate())
    return {"curve": curve, "valid": valid, "held_out": trainer.loss.take_eval_metrics(),
            "params": stage_parameters(trainer.model)}


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, **config) -> dict:
    import shardlm.reward.head as head

    original = head.add_score_head
    if control == "head gradient not summed over TP":  # (parallelize imports it at its call)
        def unmarked(model, seed):
            original(model, seed)
            del model.score.weight.sequence_parallel
            return model
        head.add_score_head = unmarked
    try:
        return train_layout(layout_context(tp, pp, cp, ep), reward_config(tp=tp, cp=cp, ep=ep, pp=pp, **config))
    finally:
        head.add_score_head = original


WORLD2 = {
    "dp2": layout(),
    "tp2": layout(tp=2),
    "tp2 sp": layout(tp=2, sp=True),
    "cp2": layout(cp=2),
    "pp2": layout(pp=2),
    "pp2 virtual2": layout(pp=2, virtual=2, micro=1, layers=4),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2 moe": layout(ep=2, moe=True),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
    "pp2 lora": layout(pp=2, lora=4),
}
CONTROL = "control tp2 sp head gradient not summed"
WORLD4 = {
    "cp2 tp2 sp": layout(cp=2, tp=2, sp=True),
    "pp2 fsdp dp2": layout(pp=2, data_sharding="full"),
}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | {CONTROL: layout(tp=2, sp=True,
                                                                 control="head gradient not summed over TP")})


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, reward_config()), "moe": train_layout(ctx, reward_config(moe=True)),
            "micro1": train_layout(ctx, reward_config(micro=1)),
            "four layers": train_layout(ctx, reward_config(micro=1, layers=4)),
            "lora": train_layout(ctx, reward_config(lora=4))}


SAME_RUN = {"steps": STEPS, "tol": TOL, "columns": CURVE + METRICS, "absolute": METRICS,
            "from_step_2": ("accuracy",)}
"""Losses, gradient norms, validation losses and parameters within TOL relative; the rewards, margin and accuracy
within TOL absolute (they cross 0); the accuracy from step 2 (at step 1 a margin can be rounding noise around 0)."""


def reference_of(name: str, reference: dict) -> dict:
    kind = next((kind for kind in ("moe", "lora") if kind in name), "four layers" if "virtual" in name else "dense")
    return reference[kind]


@pytest.mark.parametrize("name", list(WORLD2))
def test_reward_model_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference_of(name, reference), **SAME_RUN)


@pytest.mark.parametrize("name", list(WORLD4))
def test_reward_model_at_four_ranks_equals_one_process(world4, reference, name):
    assert_every_rank(world4, name, reference_of(name, reference), **SAME_RUN)


def test_the_heads_gradient_is_summed_over_tp_under_sp(world2, reference):
    """The control: without its `sequence_parallel` mark, each TP rank updates the head with the gradient of the
    last tokens in its own chunk only: the head ends off the one-process run's."""
    for value in world2[0:1]:
        status, run = value[CONTROL]
        assert status == "ok", run
        assert_trained_but_off(run["curve"], run["params"], reference["dense"]["params"], STEPS, "score")


@pytest.mark.parametrize("option, off", [("center", 0.0), ("margins", None)])
def test_the_centering_and_the_margins_reach_the_run(reference, option, off):
    data = None
    if option == "margins":
        plain = datasets()
        for d in plain:
            d.rows.pairs = [dataclasses.replace(p, margin=None) for p in d.rows.pairs]
        data = plain
    config = reward_config(**({"center": off} if option == "center" else {}))
    curve = train_layout(ParallelContext.single(), config, data)["curve"]
    assert max(abs(a[1] - b[1]) for a, b in zip(curve, reference["dense"]["curve"])) > 1e-3


def test_micro_batch_one_equals_micro_batch_eight(reference):
    eight = train_layout(ParallelContext.single(), reward_config(micro=8))
    assert_same_run(reference["micro1"], eight, "micro 1", **SAME_RUN)
    assert_same_run(reference["dense"], eight, "micro 2", **SAME_RUN)


def test_the_one_process_run_learns(reference):
    """The training pairs' loss falls (4 steps over 40 pairs: the held-out pairs' random rejected answers are not
    learned yet), and the held-out accuracy and margin are reported."""
    run = reference["dense"]
    assert run["curve"][-1][0] < run["curve"][0][0] - 0.1, run["curve"]
    assert 0 <= run["held_out"]["val_accuracy"] <= 1 and set(run["held_out"]) == {"val_accuracy", "val_margin"}


def test_packed_rows_score_each_sequence_as_alone():
    """The rewards of 8 packed rows equal each pair's two sequences scored alone (the head on the last token)."""
    ctx = ParallelContext.single()
    config = reward_config()
    model = add_score_head(build_model(config.model, ctx, seed=3), seed=3)
    with torch.no_grad():
        model.score.weight.normal_()
    data = datasets()[0]
    batch = micro_batches(data, 0, 8, 8, 0, 1, torch.device("cpu"))[0]
    part = reward_parts([batch], ctx)[0]
    loss = RewardLoss(config.reward, ctx, model)
    from shardlm.reward.head import sequence_rewards

    packed = model(part["inputs"], documents=part["documents"],
                   then=lambda hidden: sequence_rewards(model, hidden, part, ctx))
    assert part["pairs"].numel() > 8  # rows hold several pairs
    for occurrence, index in enumerate(part["pairs"].tolist()):
        pair = data.rows.pairs[index]
        for side, answer in enumerate((pair.chosen, pair.rejected)):
            hidden = model(torch.tensor([pair.prompt + answer]), hidden_only=True)
            alone = model.score(hidden[0, -1]).double()
            assert torch.allclose(packed[occurrence, side], alone, rtol=1e-5, atol=1e-6), (index, side)
    assert loss.margins == {}
