"""Low-rank adapters (LoRA) on a frozen base, at every parallel layout (`docs/lora.md`).

`adapter.py` is one adapter and how it splits with its projection; `apply.py` puts adapters on a model's
targeted projections and freezes the rest; `peft.py` reads and writes peft's adapter files and merges adapters
into the base.
"""

from shardlm.lora.adapter import LoRA
from shardlm.lora.apply import AdapterCount, add_adapters, check_lora, count_parameters, is_adapter

__all__ = ["AdapterCount", "LoRA", "add_adapters", "check_lora", "count_parameters", "is_adapter"]
