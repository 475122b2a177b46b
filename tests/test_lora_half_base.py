"""A LoRA run under bf16 autocast stores the frozen base's projection weights in bf16 (`lora.apply.store_base_in`),
with fp32 parameters (the adapters' own dtype) as with half ones: the weights QLoRA would store in NF4 (every
projection of the layers and depths, every expert's stacks). Only GEMMs read them, and autocast would cast each to
bf16 for each GEMM, so:

- training is the same bit for bit: 2 bf16 steps' losses and gradient norms, and every trained parameter after them,
  equal the control's (the base kept in fp32 and cast by autocast, as before), with fp32 and with half parameters,
  for every family the planner's LoRA tests build (GPT, GQA Llama, a Mixtral-shaped MoE with its experts adapted, MLA
  with and without the query's low rank, DeepSeek-V3's shape with its depth, the Gated DeltaNet hybrid, Nemotron-H,
  Kimi Linear, GLM-5, DeepSeek-V4 with its depth), the layout tests' Gemma 4 (dense and MoE), OLMo 3, Mistral
  Small 4 and gpt-oss, and under full and selective recomputation; in fp16 (with its loss scaling) too, the base
  then in fp16 (GQA Llama, Mixtral);
- those weights are bf16, every other frozen parameter (embedding, norms, routers, a Gated DeltaNet layer's z, b, a)
  stays fp32, the trained ones in the parameters' dtype;
- a layer's autograd keeps the bf16 parameters themselves, no bf16 copy of a frozen weight (the control keeps one of
  every projection, 2 bytes an element): the planner's `saved_weight_bytes` says 0 with half parameters, and with
  fp32 ones takes full fine-tuning's casts of them off;
- the planner's count: a trainer's frozen storages are `LoraCount.base_bytes()` with `half_base`, 2 bytes a
  projection element (`test_plan_lora.test_state_bytes_equal_a_lora_trainers` holds its state bytes to the plan).

Layouts: `test_lora_half_base_layouts.py`.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from test_plan_lora import MICRO, VOCAB, batches, model_config, run_config

from shardlm.config import LoraConfig, from_dict
from shardlm.lora import apply
from shardlm.lora.apply import base_weights, describe_half_base
from shardlm.parallel import ParallelContext
from shardlm.plan.lora import lora_count
from shardlm.plan.lora_memory import lora_fsdp_gathered_bytes, saved_weight_bytes
from shardlm.plan.memory import numeric_format
from shardlm.training.trainer import Trainer

HALF = {"precision": "bf16", "param_dtype": "half"}
PARAMS = {"half": HALF, "fp32": {"precision": "bf16", "param_dtype": "fp32"}}
FP16 = {"precision": "fp16", "param_dtype": "fp32", "initial_loss_scale": 1024.0}  # the base in fp16; a scale
# that overflows no step (at 2^32 both steps would be skipped, nothing trained)
FAMILIES = {  # shape of test_plan_lora: [lora]
    "gpt": {"rank": 4},
    "llama-gqa": {"rank": 4, "modules_to_save": ["norm"]},
    "mixtral": {"rank": 2, "targets": ["all-linear", "experts"]},
    "mla": {"rank": 4},
    "mla-no-q-lora": {"rank": 4},
    "mla-depth": {"rank": 2, "targets": ["all-linear", "experts"]},
    "hybrid": {"rank": 4},
    "nemotron-h": {"rank": 2, "targets": ["all-linear", "experts"]},
    "kimi-linear": {"rank": 2, "targets": ["all-linear", "experts"], "modules_to_save": ["embedding"]},
    "glm-5": {"rank": 2, "targets": ["q_a", "q_b", "kv_a", "o", "experts"]},  # kv_b: below
    "deepseek-v4": {"rank": 2, "targets": ["all-linear", "experts"]},
}


def keep_fp32(model, dtype):
    """The control: the base left in fp32, autocast casting each weight for each GEMM."""


def trained(name: str, lora: dict | None = None, train: dict = HALF) -> tuple[list, dict, Trainer]:
    trainer = Trainer(run_config(name, lora or FAMILIES[name], **train), ParallelContext.single(), batches())
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(2))]
    return curve, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}, trainer


CASES = [(name, "half", "none") for name in FAMILIES] + [(name, "fp32", "none") for name in FAMILIES] + \
    [("llama-gqa", "fp32", "full"), ("mixtral", "half", "selective"), ("hybrid", "fp32", "selective"),
     ("llama-gqa", "fp16", "none"), ("mixtral", "fp16", "none")]


@pytest.mark.parametrize("name,parameters,recompute", CASES)
def test_training_is_the_autocast_casts_bit_for_bit(name, parameters, recompute):
    train = {**(FP16 if parameters == "fp16" else PARAMS[parameters]), "recompute": recompute}
    curve, params, trainer = trained(name, train=train)
    stored = {id(getattr(m, attribute)) for m, attribute in base_weights(trainer.model)}
    assert stored, "no projection weight found"
    half = torch.float16 if train["precision"] == "fp16" else torch.bfloat16
    trained_dtype = half if train["param_dtype"] == "half" else torch.float32
    for n, p in trainer.model.named_parameters():
        expected = half if id(p) in stored else trained_dtype if p.requires_grad else torch.float32
        assert p.dtype == expected, (n, p.dtype)
    config = trainer.config
    count = lora_count(config.model, config.lora, 1, half_base=True)
    frozen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in trainer.model.parameters() if not p.requires_grad}
    assert sum(frozen.values()) == count.base_bytes() and count.halved == sum(
        getattr(m, a).numel() for m, a in base_weights(trainer.model)) > 0
    with mock.patch.object(apply, "store_base_in", keep_fp32):
        control_curve, control, control_trainer = trained(name, train=train)
    assert all(p.dtype == torch.float32 for p in control_trainer.model.parameters() if not p.requires_grad)
    assert np.isfinite(curve).all(), curve  # both steps taken (fp16's loss scaling skips none)
    assert curve == control_curve
    assert params.keys() == control.keys() and all(torch.equal(params[n], control[n]) for n in params)


def sft_family(name: str, train: dict):
    """The layout tests' SFT configs of the families the planner's shapes leave out, with LoRA on every projection:
    Gemma 4 (dense, with per-layer inputs and shared keys and values; MoE beside its MLP), OLMo 3, Mistral Small 4,
    gpt-oss (sinks, biased experts: their biases stay fp32)."""
    from test_gemma4_layouts import gemma4_config
    from test_mistral4_layouts import mistral4_config
    from test_olmo3_layouts import olmo3_config
    from test_sft_layouts import sft_config

    if name.startswith("gemma4"):
        config = gemma4_config(name.split()[1], lora=4, **train)
    elif name == "olmo3":
        config = olmo3_config(lora=4, **train)
    elif name == "mistral4":
        config = mistral4_config(lora=4, **train)
    else:
        config = sft_config("oss", moe=True, **train)
        config.lora.rank, config.lora.targets = 4, ["all-linear", "experts"]
    return config


@pytest.mark.parametrize("name", ["gemma4 dense", "gemma4 moe", "olmo3", "mistral4", "gpt-oss"])
def test_the_other_families_train_as_the_fp32_base_bit_for_bit(name):
    """2 bf16 steps with fp32 parameters (half ones for gpt-oss), each the control's bit for bit (losses, gradient
    norms, every trained parameter), the projections and experts bf16."""
    from test_sft_layouts import train_data, valid_data

    def run():
        train = {**PARAMS["half" if name == "gpt-oss" else "fp32"], "steps": 2}
        trainer = Trainer(sft_family(name, train), ParallelContext.single(), train_data(), valid_data())
        curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(2))]
        dtypes = {getattr(m, a).dtype for m, a in base_weights(trainer.model)}
        return curve, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}, dtypes

    curve, params, dtypes = run()
    with mock.patch.object(apply, "store_base_in", keep_fp32):
        control_curve, control, control_dtypes = run()
    assert dtypes == {torch.bfloat16} and control_dtypes == {torch.float32}
    assert curve == control_curve
    assert params.keys() == control.keys() and all(torch.equal(params[n], control[n]) for n in params)


def test_the_run_logs_the_half_base():
    _, _, trainer = trained("llama-gqa")
    ffn = trainer.config.model.ffn_size
    values = 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * ffn * 32)  # 2 layers: q, o; k, v (2 KV heads of 8); the MLP
    assert describe_half_base(trainer.model) == (f"lora: 14 frozen projection weights of this rank in bfloat16: "
                                                 f"{2 * values / 2**20:,.2f} MiB instead of {4 * values / 2**20:,.2f} "
                                                 "MiB in fp32")


def test_sparse_attentions_absorbed_kv_b_rounds_its_sum_once_more():
    """GLM-5's sparse attention multiplies by kv_b's weight with its adapter's update added (`mla.absorption`): the
    control rounds fp32 weight + update once to bf16, the half base adds the update to the weight already rounded.
    The same function up to that rounding: 2 steps within 1e-4 of the control, not bit for bit."""
    lora = {"rank": 2}
    curve, params, _ = trained("glm-5", lora)
    with mock.patch.object(apply, "store_base_in", keep_fp32):
        control_curve, control, _ = trained("glm-5", lora)
    assert curve[0] == control_curve[0]  # B = 0: the update is 0 at the first step
    assert curve != control_curve and np.allclose(curve, control_curve, rtol=1e-3, atol=0)
    assert all(torch.allclose(params[n].float(), control[n].float(), rtol=1e-2, atol=1e-4) for n in params)


SHAPE = {"arch": "llama", "num_layers": 2, "hidden_size": 40, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 56, "seq_length": 12, "vocab_size": VOCAB, "dropout": 0.0}
LAYER = 2 * 40 * 40 + 2 * 20 * 40 + 3 * 56 * 40  # q and o, k and v, gate, up and down


def bf16_copies(train: dict) -> dict:
    """One bf16 forward and backward of a LoRA trainer with `train`'s parameters (shapes distinct from every
    activation's): {storage: bytes} of the bf16 matrices of a frozen weight's shape that layer 1's autograd keeps,
    other than the parameters themselves."""
    config = from_dict({"model": SHAPE, "data": {"text_file": "unused"}, "lora": {"rank": 4},
                        "train": {**train, "micro_batch_size": MICRO, "global_batch_size": MICRO, "steps": 2}})
    trainer = Trainer(config, ParallelContext.single(), [b[:13] for b in batches()])
    layer = trainer.model.layers["1"]
    frozen = {tuple(p.shape) for p in layer.parameters() if p.ndim == 2 and not p.requires_grad}
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    found, inside = {}, [False]

    def pack(tensor):
        storage = tensor.untyped_storage().data_ptr()
        if inside[0] and tensor.dtype == torch.bfloat16 and tensor.ndim == 2 and storage not in parameters and \
                (tuple(tensor.shape) in frozen or tuple(tensor.shape[::-1]) in frozen):
            found[storage] = tensor.untyped_storage().nbytes()
        return tensor

    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    tokens = torch.from_numpy(np.stack([b[:12] for b in batches()[:MICRO]]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trainer.autocast():
        trainer.model(tokens, tokens).mean().backward()
    return found


@pytest.mark.parametrize("parameters", list(PARAMS))
def test_a_layer_keeps_the_half_weights_not_copies_of_them(parameters):
    """The planner: with half parameters full fine-tuning's format counts no casts, and LoRA adds none; with fp32 ones
    it counts a bf16 copy of every GEMM weight, which LoRA's projections no longer take."""
    config = from_dict({"model": SHAPE, "data": {"text_file": "unused"}, "lora": {"rank": 4}})
    fmt = numeric_format("bf16", "shardlm", parameters)
    assert bf16_copies(PARAMS[parameters]) == {}
    assert saved_weight_bytes(config.model, config.lora, 1, 1, fmt) == (0 if parameters == "half" else -2 * LAYER)
    with mock.patch.object(apply, "store_base_in", keep_fp32):
        assert sum(bf16_copies(PARAMS[parameters]).values()) == 2 * LAYER  # the control: a copy of every projection


def test_the_plan_counts_the_half_base():
    """Llama 3 8B, LoRA r = 16 on all-linear, bf16 with half or fp32 parameters: its 6.98 billion projection weights
    in 2 bytes, the rest (embedding, output layer, norms) in 4; the planner's line says so. In fp32, all in 4."""
    from shardlm.plan.lora_memory import describe_lora, lora_summary
    from shardlm.plan.models import MODEL_PRESETS

    cfg, lora = MODEL_PRESETS["llama3-8b"], from_dict({"model": SHAPE, "lora": {"rank": 16}}).lora
    fp32, half = lora_count(cfg, lora, 1), lora_count(cfg, lora, 1, half_base=True)
    projections = 32 * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336)
    assert half.halved == projections and half.frozen == fp32.frozen - projections
    assert fp32.base_bytes() - half.base_bytes() == 2 * projections
    for parameters in PARAMS:
        line = describe_lora(lora_summary(cfg, lora, numeric_format("bf16", "shardlm", parameters)))
        assert f"{projections:,} projection weights in half" in line, line
    assert "in half" not in describe_lora(lora_summary(cfg, lora, numeric_format("fp32")))


@pytest.mark.parametrize("name", ["llama-gqa", "mla-depth"])
def test_fsdp_gathers_the_half_projections_as_they_are_stored(name):
    """The planner's FSDP gathers: with half parameters FSDP gathers every float in bf16, so the half base gathers
    what the fp32 one did; with fp32 parameters the projections gather in 2 bytes instead of 4, those of the two
    gathered layers and of the root (DeepSeek-V3's depth), and with pipeline stages (every unit gathered) all."""
    cfg, lora = model_config(name), LoraConfig(rank=2, targets=["all-linear", "experts"])
    fp32, half = lora_count(cfg, lora, 1), lora_count(cfg, lora, 1, half_base=True)
    assert half.halved > 0 and (half.root_halved > 0) == (name == "mla-depth")
    for accumulation, pipeline in ((1, False), (4, False), (4, True)):
        assert lora_fsdp_gathered_bytes(half, 2, accumulation, pipeline) == \
            lora_fsdp_gathered_bytes(fp32, 2, accumulation, pipeline)
    layer = half.gathered_layer[1] // 2  # the largest layer's projection elements
    assert layer == fp32.gathered_layer[0] - half.gathered_layer[0] > 0
    assert lora_fsdp_gathered_bytes(fp32, 4, 1) - lora_fsdp_gathered_bytes(half, 4, 1) == \
        2 * (2 * layer + half.root_halved)
    assert lora_fsdp_gathered_bytes(fp32, 4, 4, pipeline=True) - lora_fsdp_gathered_bytes(half, 4, 4, pipeline=True) \
        == 2 * half.halved
