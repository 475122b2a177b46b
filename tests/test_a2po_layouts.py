"""A*-PO (`rl.loss = "a2po"`) gives the one-process answer at every layout.

The RL layouts' model and fixed completions (`test_rl_layouts`: 1-10 ids, some truncated), 6 prompts, 4 a step
(one completion each, packed into 4 rows of 48 tokens, 2 a micro-batch), 3 steps; stage 1 takes 3 samples of each
prompt (the fixed completions of round -1). The reward: 0 for the two "hopeless" prompts (their samples all score 0,
so `rl.filter_all_incorrect` leaves them out, as the run's line says), else the completion's ids' sum mod 7 over 6.
Each layout against one process within 1e-5 (loss, gradient norm, entropy, implicit reward, reward, V*, advantage
of each step; the values and the prompts kept; every final parameter): DP=2, TP=2 with SP, CP=2 (each sequence's
log-probability summed over its CP ranks, forward and backward), PP=2, FSDP DP=2, LoRA at DP=2 (the reference its
base, the adapters off). The control: at CP=2 each rank's part of a sequence's log-probability taken as the whole
(no sum over CP) trains, and ends off. One process: the weights of each sequence make the loss its mean over the
global batch's sequences (micro-batch 1 equals micro-batch 4)."""

from __future__ import annotations

import pytest
from test_moe_parallel import stage_parameters
from test_rl_layouts import PROMPTS, IdsTemplate, SyntheticCompletions, rl_config

from shardlm.parallel import ParallelContext
from shardlm.rl import loss as loss_module
from shardlm.rl.a2po import prepare
from shardlm.rl.loop import RLRun
from shardlm.rl.prompts import Prompt
from shardlm.rl.rewards import Reward
from shardlm.training.reference import ReferenceWeights
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank, assert_trained_but_off
from layouts import layout, layout_context, spawn_layouts

STEPS, TOL = 3, 1e-5
COLUMNS = ("loss", "grad norm", "entropy", "implicit_reward", "reward", "v_star", "advantage")
HOPELESS = {1, 4}
A2PO_PROMPTS = [Prompt(p.ids, p.prompt, {"kind": "hopeless" if i in HOPELESS else "fair"})
                for i, p in enumerate(PROMPTS)]


class Completions(SyntheticCompletions):
    """`SyntheticCompletions`, stage 1's round (-1) drawn as round 1000."""

    def generate(self, prompts, seeds, round_index=0, sequences=None):
        return super().generate(prompts, seeds, 1000 if round_index < 0 else round_index, sequences)


def scored(prompts, completions, completion_ids, kind, **columns):
    return [0.0 if k == "hopeless" else (sum(ids) % 7) / 6 for ids, k in zip(completion_ids, kind)]


def a2po_config(micro: int = 2, **spec):
    config = rl_config(micro=micro, rows=4, **spec)
    config.rl.loss, config.rl.num_generations, config.rl.beta, config.rl.sync_ref_model = "a2po", 1, 0.0, False
    config.rl.num_iterations, config.rl.mask_truncated_completions = 1, False
    config.rl.num_value_samples, config.rl.beta1, config.rl.beta2 = 3, 0.5, 0.05
    config.train.steps = STEPS
    return config


def train_a2po(ctx, config) -> dict:
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, None, None)
    reference = ReferenceWeights.of(trainer) if not config.lora.rank else None
    run = RLRun(trainer, A2PO_PROMPTS, IdsTemplate, Completions(), [Reward("scored", scored, 1.0)], 0, reference)
    line = prepare(run, None, resumed=False)
    curve = []
    for _ in range(STEPS):
        metrics = run.train_step()
        curve.append(tuple(metrics[k.replace("grad norm", "grad_norm")] for k in COLUMNS))
    return {"curve": curve, "params": stage_parameters(trainer.model), "values": run.values.tolist(),
            "kept": [p.prompt for p in run.prompts], "line": line}


def run_a2po(tp: int, pp: int, cp: int, ep: int, unsummed: bool = False, **spec) -> dict:
    if unsummed:  # the control: a sequence's sums left on each CP rank (no all-reduce over CP)
        real = loss_module.sequence_sums
        loss_module.sequence_sums = lambda values, batch, cp: real(values, batch, ParallelContext.single().cp)
    try:
        return train_a2po(layout_context(tp, pp, cp, ep), a2po_config(tp=tp, pp=pp, cp=cp, ep=ep, **spec))
    finally:
        if unsummed:
            loss_module.sequence_sums = real


WORLD2 = {"dp2": layout(), "tp2 sp": layout(tp=2, sp=True), "cp2": layout(cp=2), "pp2": layout(pp=2),
          "fsdp dp2": layout(data_sharding="full"), "dp2 lora": layout(lora=4),
          "control cp2 unsummed": layout(cp=2, unsummed=True)}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_a2po, WORLD2)


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {"dense": train_a2po(ctx, a2po_config()), "lora": train_a2po(ctx, a2po_config(lora=4)),
            "micro 1": train_a2po(ctx, a2po_config(micro=1)), "micro 4": train_a2po(ctx, a2po_config(micro=4))}


SAME_RUN = {"steps": STEPS, "tol": TOL, "columns": COLUMNS, "absolute": ("implicit_reward", "advantage")}
"""The implicit reward (0 at the first step, where the policy is its reference) and the advantage (r - V*, either
sign) within TOL absolute; the rest relative."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in WORLD2 if not n.startswith("control")])
def test_a2po_at_two_ranks_equals_one_process(world2, reference, name):
    ref = reference["lora" if "lora" in name else "dense"]
    for value in assert_every_rank(world2, name, ref, **SAME_RUN):
        assert value["values"] == pytest.approx(ref["values"], rel=1e-12) and value["kept"] == ref["kept"]


@pytest.mark.timeout(600)
def test_the_sums_must_span_the_cp_ranks(world2, reference):
    from multiproc import check_result

    for value in check_result(world2, "control cp2 unsummed"):
        assert_trained_but_off(value["curve"], value["params"], reference["dense"]["params"], STEPS, "layers.")


def test_stage_one_leaves_the_hopeless_prompts_out(reference):
    """The hopeless prompts' V* is 0 and they are left out; the others' is the soft maximum of positive rewards;
    after the first step the policy is off its reference (an implicit reward)."""
    dense = reference["dense"]
    assert dense["kept"] == [p.prompt for i, p in enumerate(A2PO_PROMPTS) if i not in HOPELESS]
    assert "2 prompts whose samples all scored 0 left out" in dense["line"], dense["line"]
    assert all(v > 0 for v in dense["values"]), dense["values"]
    assert dense["curve"][0][3] == 0.0 and all(abs(step[3]) > 0 for step in dense["curve"][1:]), dense["curve"]


def test_micro_batches_change_nothing(reference):
    for name in ("micro 1", "micro 4"):
        assert_every_rank([{"same": ("ok", reference[name])}], "same", reference["dense"], **SAME_RUN)
