"""A LoRA model's base: its adapters switched off for a block (`adapters_off`), the reference of a LoRA run's
preference or RL loss (a forward of the base with no second copy of the weights)."""

from __future__ import annotations

import contextlib

from shardlm.lora.adapter import LoRA
from shardlm.lora.experts import ExpertLoRA


def _adapters(model) -> list:
    return [m for m in model.modules() if isinstance(m, (LoRA, ExpertLoRA))]


def has_adapters(model) -> bool:
    """Whether `model` carries LoRA adapters (whose base is a LoRA run's reference)."""
    return bool(_adapters(model))


@contextlib.contextmanager
def adapters_off(model):
    """The base model: every LoRA adapter's scale 0 for the block (the reference of a LoRA run)."""
    adapters = _adapters(model)
    scales = [m.scale for m in adapters]
    for m in adapters:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(adapters, scales):
            m.scale = scale
