"""QLoRA under bf16 autocast: the NF4 weights are dequantized straight into bf16 (`nf4.compute_dtype`), so a layer's
GEMMs take them as they are and `nf4.dequantize_again` saves references, not autocast's bf16 copies of them.

- With half parameters and with fp32 parameters, the tensors a QLoRA layer's autograd keeps (what `dequantize_again`'s
  pack hook returns as tensors) hold no bf16 matrix of a frozen weight's shape; the NF4 weights are saved as
  references, one or more a GEMM. The control: dequantized in fp32 and cast by autocast (as before), the layer keeps
  a bf16 copy of every projection.
- Training is the same, bit for bit: 2 bf16 steps' losses and gradient norms, and every adapter after them, equal
  the run that dequantizes in fp32 and lets autocast cast (the same fp32 values rounded once either way); the
  backward, outside autocast, dequantizes in fp32 and casts as the forward did.
- The planner's `saved_weight_bytes`: with half parameters none (LoRA's projections stored in bf16, QLoRA's in NF4);
  with fp32 parameters both less the casts full fine-tuning counts.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from test_plan_lora import MICRO, VOCAB, batches

from shardlm.config import from_dict
from shardlm.lora import nf4
from shardlm.parallel import ParallelContext
from shardlm.plan.lora import lora_count
from shardlm.plan.lora_memory import saved_weight_bytes
from shardlm.plan.memory import numeric_format
from shardlm.training.trainer import Trainer

SHAPE = {"arch": "llama", "num_layers": 2, "hidden_size": 40, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 56, "seq_length": 12, "vocab_size": VOCAB, "dropout": 0.0}
PARAMS = {"half": "half", "fp32": "fp32"}


def qlora_config(param_dtype: str, quantize: str = "nf4"):
    return from_dict({"model": SHAPE, "data": {"text_file": "unused"}, "lora": {"rank": 4, "quantize": quantize},
                      "train": {"precision": "bf16", "param_dtype": param_dtype, "micro_batch_size": MICRO,
                                "global_batch_size": MICRO, "steps": 2, "seed": 5}})


def cast_by_autocast(dtype, device_type):
    """The control: dequantized in the weight's own dtype, autocast casting it for each GEMM."""
    return dtype


def layer_saves(param_dtype: str) -> tuple[dict, int]:
    """One bf16 forward and backward of a QLoRA trainer's model: in layer 1, the bytes of bf16 matrices of a frozen
    weight's shape that autograd keeps as tensors, and how many NF4 weights it keeps as references."""
    trainer = Trainer(qlora_config(param_dtype), ParallelContext.single(), [b[:13] for b in batches()])
    layer = trainer.model.layers["1"]
    frozen = {tuple(m.weight.shape) for m in layer.modules()
              if hasattr(m, "parametrizations") and "weight" in m.parametrizations}  # the NF4 weights' shapes
    copies, references, inside = {}, [0], [False]
    pack = nf4._pack

    def counted(tensor):
        saved = pack(tensor)
        if inside[0] and isinstance(saved, tuple):
            references[0] += 1
        elif inside[0] and tensor.dtype == torch.bfloat16 and tensor.ndim == 2 and \
                (tuple(tensor.shape) in frozen or tuple(tensor.shape[::-1]) in frozen):
            copies[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return saved

    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    tokens = torch.from_numpy(np.stack([b[:12] for b in batches()[:MICRO]]))
    assert frozen, "no NF4 weight in the layer"
    with mock.patch.object(nf4, "_pack", counted), trainer.autocast():
        trainer.model(tokens, tokens).mean().backward()
    return copies, references[0]


@pytest.mark.parametrize("param_dtype", list(PARAMS))
def test_nf4_weights_are_saved_as_references_not_bf16_copies(param_dtype):
    copies, references = layer_saves(param_dtype)
    assert copies == {} and references >= 7, (copies, references)  # q, k, v, o, gate, up, down
    with mock.patch.object(nf4, "compute_dtype", cast_by_autocast):
        copies, _ = layer_saves(param_dtype)
    assert sum(copies.values()) == 2 * (2 * 40 * 40 + 2 * 20 * 40 + 3 * 56 * 40), copies  # the control


def run(param_dtype: str) -> tuple[list, dict]:
    trainer = Trainer(qlora_config(param_dtype), ParallelContext.single(), [b[:13] for b in batches()])
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(2))]
    return curve, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("param_dtype", list(PARAMS))
def test_training_is_the_autocast_casts_bit_for_bit(param_dtype):
    curve, adapters = run(param_dtype)
    with mock.patch.object(nf4, "compute_dtype", cast_by_autocast):
        control_curve, control = run(param_dtype)
    assert curve == control_curve
    assert adapters.keys() == control.keys() and all(torch.equal(adapters[n], control[n]) for n in adapters)


def test_the_planner_counts_no_bf16_copies_of_nf4_weights():
    lora, qlora = qlora_config("half", quantize="").lora, qlora_config("half").lora
    cfg, layer = qlora_config("half").model, 2 * 40 * 40 + 2 * 20 * 40 + 3 * 56 * 40
    half, fp32 = numeric_format("bf16", "shardlm", "half"), numeric_format("bf16")
    assert saved_weight_bytes(cfg, lora, 1, 1, half) == 0  # LoRA's half base: saved as it is too
    assert saved_weight_bytes(cfg, qlora, 1, 1, half) == 0
    assert lora_count(cfg, qlora, 1).layer_quantized == layer
    assert saved_weight_bytes(cfg, qlora, 1, 1, fp32) == -2 * layer
    assert saved_weight_bytes(cfg, lora, 1, 1, fp32) == -2 * layer  # LoRA's projections in bf16: no casts either
