"""Fold a one-process (TP=1) LoRA model's adapters into its base: W + scale B A for every adapted projection and
every adapted expert matrix, a QLoRA base dequantized first. What `convert --merge` exports."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.lora.adapter import LoRA
from shardlm.lora.experts import ExpertLoRA
from shardlm.lora.nf4 import dequantize_all


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """In place: NF4 weights become full-precision parameters (`dequantize_all`), each adapter's update is added
    to its weight (each expert's to its matrix), and the adapters are removed. TP=1 only (whole weights)."""
    dequantize_all(model)
    for module in list(model.modules()):
        adapter = getattr(module, "lora", None)
        if isinstance(adapter, LoRA):
            module.weight += adapter.delta_weight().to(module.weight.dtype)
        elif isinstance(adapter, ExpertLoRA):
            names = ("gate", "up", "down") if adapter.gated else ("fc", "proj")
            for name in names[:-1]:
                update = torch.bmm(getattr(adapter, f"B_{name}"), adapter.A_in) * adapter.scale
                getattr(module, name).add_(update.to(getattr(module, name).dtype))
            out = names[-1]
            update = torch.bmm(getattr(adapter, f"B_{out}"), getattr(adapter, f"A_{out}")) * adapter.scale
            getattr(module, out).add_(update.to(getattr(module, out).dtype))
        else:
            continue
        module.lora = None
