"""LoRA's half base at every layout: under bf16 autocast the frozen projection weights are stored in bf16
(`lora.apply.store_base_in`) on each rank's shards, TP's, EP's, a pipeline stage's and FSDP's, and each layout trains
exactly as its control, the same layout with the base kept in fp32 and cast by autocast: 4 steps' losses and
gradient norms, the validation loss and every trained parameter bit for bit. (How each layout compares with one
process is `test_lora_layouts.py`'s and `test_qlora_layouts.py`'s subject: bf16 rounding would hide it here.)

Model and data as `test_lora_layouts` (4-layer Llama on packed SFT rows, adapters of rank 4 on every projection;
the MoE: 2 layers of 4 experts top-2 with adapters on the experts too). World 2: TP=2 with SP, FSDP DP=2 (frozen
bf16 shards beside trainable ones in one unit), PP=2 x 2 virtual stages, EP=2 (the experts' stacks in bf16), with
half parameters; FSDP DP=2 with fp32 ones (FSDP then gathers fp32 and bf16 tensors in one unit: as bytes).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from test_lora_half_base import keep_fp32
from test_lora_layouts import STEPS, lora_config
from test_moe_parallel import stage_parameters
from test_sft_layouts import train_data, valid_data

from shardlm.lora import apply
from shardlm.lora.apply import base_weights
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from layouts import layout, layout_context, selected_cases, spawn_layouts
from multiproc import check_result


def one_run(tp: int, pp: int, cp: int, ep: int, params: str = "half", **spec) -> dict:
    ctx = layout_context(tp, pp, cp, ep) if dist.is_initialized() else ParallelContext.single()
    config = lora_config(tp=tp, pp=pp, cp=cp, ep=ep, precision="bf16", param_dtype=params, **spec)
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, train_data(), valid_data())
    dtypes = {getattr(m, a).dtype for m, a in base_weights(trainer.model)}
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    trained = {n: p for n, p in stage_parameters(trainer.model).items() if ".lora." in n}
    return {"curve": curve, "trained": trained, "dtypes": dtypes, "valid": trainer.evaluate()}


def run_both(tp: int, pp: int, cp: int, ep: int, **spec) -> dict:
    """The half base's run and its control's at one layout."""
    half = one_run(tp, pp, cp, ep, **spec)
    with mock.patch.object(apply, "store_base_in", keep_fp32):
        control = one_run(tp, pp, cp, ep, **spec)
    return {"half": half, "control": control}


WORLD2 = {
    "tp2 sp": layout(tp=2, sp=True, arch="llama"),
    "fsdp dp2": layout(arch="llama", data_sharding="full"),
    "pp2 virtual2": layout(pp=2, virtual=2, micro=1, arch="llama"),
    "ep2 moe": layout(ep=2, arch="llama", moe=True),
    "fsdp dp2 fp32 params": layout(arch="llama", data_sharding="full", params="fp32"),
}


@pytest.fixture(scope="module")
def world2(request):
    return spawn_layouts(2, run_both, selected_cases(request, WORLD2))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(WORLD2))
def test_each_layout_trains_as_its_control_bit_for_bit(world2, name):
    for rank, value in enumerate(check_result(world2, name)):
        half, control = value["half"], value["control"]
        assert half["dtypes"] == {torch.bfloat16}, (name, rank, half["dtypes"])
        assert control["dtypes"] == {torch.float32}, (name, rank)
        assert half["curve"] == control["curve"], (name, rank)
        assert half["valid"] == control["valid"], (name, rank)
        assert half["trained"] and half["trained"].keys() == control["trained"].keys(), (name, rank)
        for n, p in half["trained"].items():
            assert torch.equal(p, control["trained"][n]), (name, rank, n)
