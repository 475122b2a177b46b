"""QLoRA starts and trains a base whose full-precision copy would not fit in the process's memory.

The base: a random Qwen3 of 8 layers, hidden 512, MLP 2,048 (31.5M projection weights: 120 MiB in fp32), saved as a
Hugging Face directory in bf16 (60 MiB). Each worker caps its own private writable memory (`RLIMIT_DATA`,
`shardlm.bench.memory_cap`) at what it holds after start-up (its process groups included), plus the safetensors file
(which safetensors maps privately while reading, and the limit counts), plus `BUDGET` (50 MiB): together less than
the base's fp32 projections alone (110 MiB against 120 MiB), so at no point could a full-precision copy of the base
be held. glibc is told to return every large free block (`mallopt(M_MMAP_THRESHOLD, 64 KiB)`), so the cap measures
what is held, not what the allocator keeps.

- QLoRA (`lora.quantize = "nf4"`, no recomputation) builds the model layer by layer into NF4, reads the base tensor
  by tensor (each quantized whole as it arrives) and trains 2 steps under the cap (the cap changes no arithmetic:
  what it proves is that the run fits);
- FSDP DP=2 (each of the two ranks capped alike) trains under it too, to the one-process run's losses within 1e-5;
- the control: plain LoRA (the base kept in fp32) runs out of memory under the same cap.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from test_lora_peft import VOCAB, run_config

from shardlm.bench.memory_cap import data_bytes, is_out_of_memory, peak_resident_bytes

from multiproc import run_workers

BUDGET = 50 * 2**20
STEPS = 2


def write_base(root):
    """The module docstring's Qwen3, saved in bf16; returns (root, its fp32 projection bytes)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    projections = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    model.to(torch.bfloat16).save_pretrained(root)
    return root, 4 * projections


def batches():
    import numpy as np
    from test_lora_peft import SEQ

    rng = np.random.default_rng(5)
    return [rng.integers(0, VOCAB, size=SEQ + 1) for _ in range(4 * STEPS)]


def capped_run(root: str, quantize: bool, cap_extra: int | None, fsdp: bool = False) -> dict:
    """In a worker: cap this process (`cap_extra` beyond its data once its process groups exist; None: no cap),
    build the trainer, load the base, train. {"losses", "peak_resident_bytes"} or {"out_of_memory": where}."""
    from shardlm.bench.memory_cap import cap_process_memory, load_start_up
    from shardlm.checkpoint.init import init_weights, open_source
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large blocks go back to the system at free
    ctx = ParallelContext.from_process_group(1) if fsdp else ParallelContext.single()  # its groups' buffers: start-up
    load_start_up()  # TorchDynamo, which the trainer's optimizer loads: start-up data too
    if cap_extra is not None:
        cap_process_memory(data_bytes() + cap_extra)
    config = run_config(root, steps=STEPS, **({"quantize": "nf4"} if quantize else {}))
    if fsdp:
        config.train.data_sharding, config.train.micro_batch_size = "full", 2
    stage = "building the trainer"
    try:
        trainer = Trainer(config, ctx, batches())
        stage = "loading the base"
        init_weights(trainer, open_source(root))
        stage = "training"
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        return {"out_of_memory": stage}
    return {"losses": losses, "peak_resident_bytes": peak_resident_bytes()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_base(tmp_path_factory.mktemp("qwen3-120mib"))


def cap_extra(root) -> int:
    return os.path.getsize(root / "model.safetensors") + BUDGET


@pytest.mark.timeout(600)
def test_qlora_starts_and_trains_a_base_larger_than_the_cap(base):
    root, fp32_bytes = base
    assert cap_extra(root) < fp32_bytes  # the base's fp32 projections alone would not fit
    capped = run_workers(1, capped_run, str(root), True, cap_extra(root), init=False)[0]
    assert "losses" in capped, capped
    fsdp = run_workers(2, capped_run, str(root), True, cap_extra(root), True, timeout=600)
    for rank, value in enumerate(fsdp):
        assert "losses" in value, (rank, value)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(value["losses"], capped["losses"])), rank


@pytest.mark.timeout(600)
def test_a_full_precision_base_does_not_fit_the_cap(base):
    """The control: the same run with the base in fp32 (plain LoRA) runs out of memory under the cap."""
    root, _ = base
    control = run_workers(1, capped_run, str(root), False, cap_extra(root), init=False)[0]
    assert control.get("out_of_memory") in ("building the trainer", "loading the base"), control
