"""Mistral Small 4's pieces train at every layout as one process does (fp32, within 1e-5: losses, gradient norms,
the validation loss and every final parameter on every rank; `test_sft_layouts`' packed SFT rows of 32 tokens).

The model: `test_sft_layouts`' MLA Llama, 2 layers of 4 experts (softmax scores, 2 groups of 2, the best group's
top-2 renormalized: Mistral 4's routing, groups ranked by their top-2 sum) and Llama 4's query scaling with a step
of 4 positions (beta 0.5), so the scale changes 7 times along a row, restarting in every packed document.
- world 2: TP=2 with SP, CP=2 (each rank's zigzag tokens scaled at their positions in the whole document), PP=2,
  DP=2 with ZeRO-1, FSDP DP=2, EP=2 and LoRA at TP=2 with SP;
- the control: at CP=2 the queries scaled at their positions within the rank's part (not the row's) end far off.
"""

from __future__ import annotations

import contextlib

import pytest
from test_sft_layouts import STEPS, TOL, sft_config, train_layout

from shardlm.models import mla
from shardlm.parallel import ParallelContext

from agreement import assert_every_rank, assert_trained_but_off
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result

MISTRAL4 = {"moe_score": "softmax", "moe_group_score": "top2_sum", "moe_groups": 2, "moe_topk_groups": 1,
            "moe_norm_topk_prob": True, "moe_routed_scaling": 1.5, "moe_shared_experts": 1,
            "query_scale_beta": 0.5, "query_scale_positions": 4}


def mistral4_config(lora: int = 0, **kwargs):
    config = sft_config("mla", moe=True, **kwargs)
    for key, value in MISTRAL4.items():
        setattr(config.model, key, value)
    config.lora.rank, config.lora.targets = lora, ["q_b", "kv_b", "o", "gate", "up", "down"]
    return config


@contextlib.contextmanager
def broken(control: str | None):
    """"local positions": the query scale computed from each rank's token count, 0 .. T/C - 1."""
    scale = mla.query_scale
    if control == "local positions":
        def local(positions, beta, step):
            import torch
            here = torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
            return scale(here, beta, step)
        mla.query_scale = local
    try:
        yield
    finally:
        mla.query_scale = scale


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, **config) -> dict:
    with broken(control):
        return train_layout(layout_context(tp, pp, cp, ep), mistral4_config(tp=tp, pp=pp, cp=cp, ep=ep, **config))


WORLD2 = {
    "tp2 sp": layout(tp=2, sp=True),
    "cp2": layout(cp=2),
    "pp2": layout(pp=2, micro=1),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2": layout(ep=2),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
}
CONTROLS = {"control cp2 local positions": layout(cp=2, control="local positions")}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS)


@pytest.fixture(scope="module")
def reference():
    """One process at the layouts' micro-batch 2 (the MoE balancing loss is per micro-batch); PP=2 runs micro-batch
    1, against its own reference."""
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, mistral4_config()), "micro1": train_layout(ctx, mistral4_config(micro=1)),
            "lora": train_layout(ctx, mistral4_config(lora=4))}


def kind_of(name: str) -> str:
    return "lora" if "lora" in name else "micro1" if name.startswith("pp2") else "dense"


@pytest.mark.parametrize("name", list(WORLD2))
def test_mistral4_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], steps=STEPS, tol=TOL)


def test_queries_scaled_at_local_positions_end_far_off(world2, reference):
    for value in check_result(world2, "control cp2 local positions"):
        assert_trained_but_off(value["curve"], value["params"], reference["dense"]["params"], STEPS, ".attn.")
