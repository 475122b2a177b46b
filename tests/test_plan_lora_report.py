"""`shardlm plan` with a [lora] section, end to end: the planner's rows, its activations, the command line's QLoRA
line and JSON, and the one-line errors (the counts under them: `test_plan_lora.py`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardlm.cli import main
from shardlm.config import LoraConfig
from shardlm.models.config import ModelConfig
from shardlm.plan.hardware import gpu_preset
from shardlm.plan.lora import lora_count
from shardlm.plan.lora_memory import (
    lora_fsdp_gathered_bytes,
    lora_fsdp_state_memory,
    lora_state_memory,
    lora_summary,
    saved_weight_bytes,
)
from shardlm.plan.memory import numeric_format
from shardlm.plan.models import MODEL_PRESETS, PlannedModel
from shardlm.plan.planner import PlanRequest, plan


def request(lora: LoraConfig, **kwargs) -> PlanRequest:
    cfg = replace(MODEL_PRESETS["llama3-8b"], seq_length=2048)
    return PlanRequest(model=PlannedModel("llama3-8b", cfg, lora), gpu=gpu_preset("h100"),
                       **({"gpus": 2, "global_batch": 8} | kwargs))


def test_the_plans_rows_are_the_lora_state_and_qlora_is_smaller():
    qlora = LoraConfig(rank=16, quantize="nf4")
    cfg = replace(MODEL_PRESETS["llama3-8b"], seq_length=2048)
    rows = {}
    for name, lora in (("full", LoraConfig()), ("lora", LoraConfig(rank=16)), ("qlora", qlora)):
        result = plan(request(lora, pipeline=1, data_sharding="none", recompute="full", micro_batch=1))
        rows[name] = {row.tp: row for row in result.rows}
    fmt = numeric_format("bf16")
    for tp in (1, 2):
        count = lora_count(cfg, qlora, tp)
        row = rows["qlora"][tp]
        assert row.state == lora_state_memory(count, fmt, 2 // tp)
        assert row.choice.dequantized == 4 * count.layer_quantized > 0
        assert row.choice.total_bytes == row.state.total + row.choice.activation_peak + row.choice.gathered + \
            row.choice.dequantized + int(2.0 * 1e9)  # the default reserve
        assert rows["lora"][tp].choice.dequantized == 0
        assert rows["qlora"][tp].state.total < rows["lora"][tp].state.total < rows["full"][tp].state.total
    # FSDP at DP=2 shards the adapters, their moments and the NF4 base over the two ranks
    fsdp = plan(request(qlora, pipeline=1, data_sharding="full", recompute="full", micro_batch=1))
    row = next(r for r in fsdp.rows if r.tp == 1)
    assert row.state == lora_fsdp_state_memory(lora_count(cfg, qlora, 1), 2)
    assert row.choice.gathered == lora_fsdp_gathered_bytes(lora_count(cfg, qlora, 1), 4, 4)


def test_the_plans_activations_add_what_lora_layers_save_beyond_full_fine_tuning():
    cfg = replace(MODEL_PRESETS["llama3-8b"], seq_length=2048)
    lora, qlora = LoraConfig(rank=16), LoraConfig(rank=16, quantize="nf4")

    def one_gpu_row(config: LoraConfig, **kwargs):
        result = plan(request(config, pipeline=1, micro_batch=1, data_sharding="none", **kwargs))
        return next(row for row in result.rows if row.tp == 1)

    def per_layer(config: LoraConfig, **kwargs) -> int:
        return one_gpu_row(config, **kwargs).choice.activations.per_layer

    fp32 = {"precision": "fp32"}
    for recompute in ("full", "none"):
        extra = per_layer(qlora, recompute=recompute, **fp32) - per_layer(LoraConfig(), recompute=recompute, **fp32)
        assert extra == saved_weight_bytes(cfg, qlora, 1, 1, numeric_format("fp32"), recompute)
    assert extra == 0  # without full recomputation the dequantized weights are dequantized again in the backward
    # Llama 3 8B's layer: q, o 4096 x 4096, k, v 1024 x 4096, gate, up, down 14,336 x 4096; 4 bytes each in fp32
    matrix = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
    assert saved_weight_bytes(cfg, qlora, 1, 1, numeric_format("fp32"), "full") == 4 * matrix
    half = {"precision": "bf16", "param_dtype": "half", "recompute": "none"}
    assert per_layer(lora, **half) == per_layer(LoraConfig(), **half)  # the base's projections in half: no copies
    state, fp32_base = one_gpu_row(lora, **half).state, one_gpu_row(lora, recompute="none", **fp32).state
    assert fp32_base.parameters - state.parameters == 2 * 32 * matrix + 2 * lora_count(cfg, lora, 1).trainable.total
    # bf16 with fp32 parameters: full fine-tuning's format counts a bf16 copy of every GEMM weight, which the
    # projections, stored in bf16, do not take
    assert per_layer(lora, recompute="none") - per_layer(LoraConfig(), recompute="none") == -2 * matrix


def test_the_command_line_prints_the_qlora_line_and_json(tmp_path, capsys):
    path = tmp_path / "qlora.toml"
    path.write_text('[model]\narch = "llama"\nnum_layers = 4\nhidden_size = 256\nnum_heads = 4\nnum_kv_heads = 2\n'
                    'seq_length = 256\nvocab_size = 1000\n\n[lora]\nrank = 8\nquantize = "nf4"\n'
                    'modules_to_save = ["norm"]\n')
    args = ["plan", "--model", str(path), "--gpus", "2", "--gpu", "h100", "--global-batch", "8"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    cfg = ModelConfig(arch="llama", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, seq_length=256,
                      vocab_size=1000)
    lora = LoraConfig(rank=8, quantize="nf4", modules_to_save=["norm"])
    count = lora_count(cfg, lora, 1)
    assert f"QLoRA r=8 on all-linear + norm (whole model): adapters {count.adapters:,} parameters" in out
    assert f"in NF4 at {count.bits_per_weight:.3f} bits a weight" in out and "counted once" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lora"] == json.loads(json.dumps(lora_summary(cfg, lora, numeric_format("bf16"))))
    assert data["lora"]["nf4_bytes"] == count.nf4_bytes and data["lora"]["adapter_parameters"] == count.adapters
    assert all(r["memory_bytes"]["dequantized"] == 4 * count.layer_quantized for r in data["layouts"]
               if r["pp"] == 1 and r["tp"] == 1)


@pytest.mark.parametrize("lora,kwargs,message", [
    (LoraConfig(rank=4), {"implementation": "megatron"}, "[lora] is planned for --implementation shardlm"),
    (LoraConfig(rank=4), {"optimizer": "muon"}, "--optimizer muon with [lora]"),
    (LoraConfig(rank=4, targets=["qkv"]), {}, "lora.targets names qkv, which this llama model does not have"),
    (LoraConfig(rank=4, modules_to_save=["output"], quantize="nf4"), {}, None),
    (LoraConfig(rank=4, quantize="int8"), {}, 'lora.quantize="int8"'),
])
def test_one_line_errors(lora, kwargs, message):
    from shardlm.errors import UserError

    if message is None:  # Llama 3's output layer is untied: training it is fine
        assert plan(request(lora, pipeline=1, **kwargs)).rows
        return
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan(request(lora, pipeline=1, **kwargs))
