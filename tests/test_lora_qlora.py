"""QLoRA: the frozen base in NF4 with double quantization (`shardlm.lora.nf4`), against bitsandbytes and at layouts.

- bitsandbytes 0.48+ on the CPU (the dev extra) as the oracle: the NF4 table and the 8-bit dynamic map of the
  statistics are its values; the packed codes, the absmax codes, their block maxima and offset are bitwise
  `quantize_4bit(w, quant_type="nf4", compress_statistics=True)`'s for several shapes (rows of 32, 96, 100 and
  128 values: blocks cross rows); the dequantized weight is bitwise its PyTorch reference dequantization's, and
  `dequantize_4bit`'s where bitsandbytes 0.50's CPU kernel agrees with that reference (on 48 x 96, 32 x 96 and
  16 x 32 it does not).
- A base read from a Hugging Face directory is stored as bitsandbytes stores those weights (bitwise); trained and
  merged (`convert --to-peft --merge`), the plain directory's transformers logits equal the QLoRA checkpoint's.
- A weight split over TP keeps the whole matrix's blocks (`nf4.Shard`): for row shards, aligned column shards and
  column shards whose blocks of 64 straddle two ranks (kept whole by both), and stacks of experts (each expert's
  matrix quantized on its own), a rank's packed codes, statistics' maxima and offset are bitwise those of
  `quantize_4bit` of the whole matrix at the blocks its slice touches; its statistics codes the nearest map values
  (bitsandbytes' wherever its CPU kernel's search finds the nearest); and its dequantized slice is bitwise that slice
  of bitsandbytes' PyTorch reference dequantization of the whole matrix (blocks of a missed statistics code aside).
  The layouts themselves are in `test_qlora_layouts.py`.
- The base's bits, counted by hand for every shape (`BITS`: 4 a weight, 8 a block of 64, 32 a block of 256
  statistics, 32 for the offset): 4.127 a weight for a 1024 x 1024 projection, more for the tiny ones; a resume
  is bitwise (the base quantized again from the same weights).
"""

from __future__ import annotations

import pytest
import torch
from test_lora_layouts import lora_config
from test_lora_peft import batches, qwen3_directory, run_config
from test_sft_layouts import train_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.checkpoint.init import init_weights, open_source
from shardlm.lora import nf4
from shardlm.lora.apply import adaptable
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from agreement import rel
from multiproc import disturb_generators, import_or_skip

bnb = import_or_skip("bitsandbytes.functional", "bitsandbytes is the NF4 oracle (the dev extra installs it)")

STEPS, TOL = 4, 1e-5
QLORA = {"quantize": "nf4"}


@pytest.mark.parametrize("shape", [(64, 128), (48, 96), (3, 100), (32, 96), (16, 32)])
def test_quantization_is_bitsandbytes(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.05
    theirs, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    packed, codes, stats_max, offset = nf4.quantize(weight)
    assert torch.equal(packed, theirs.view(-1)) and torch.equal(codes, state.absmax)
    assert torch.equal(stats_max, state.state2.absmax) and torch.equal(offset, state.offset)
    ours = nf4.dequantize(packed, codes, stats_max, offset, weight.shape, weight.dtype)
    assert (ours - weight).abs().max() <= 0.6 * weight.abs().max() / 2  # within the widest NF4 gap of a block
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute as reference

    absmax = bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset
    assert torch.equal(ours, reference(theirs.view(-1), absmax, state.code, 64, weight.shape, torch.float32))
    if shape in ((64, 128), (3, 100)):  # where the CPU kernel agrees with that reference
        assert torch.equal(ours, bnb.dequantize_4bit(theirs, state))


def test_tables_are_bitsandbytes():
    assert torch.equal(nf4.NF4, bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(nf4.dynamic_map(), bnb.create_dynamic_map(signed=True))


def test_a_hugging_face_base_is_stored_as_bitsandbytes_stores_it(tmp_path):
    from safetensors import safe_open

    base = qwen3_directory(tmp_path / "qwen3")
    trainer = Trainer(run_config(base, **QLORA), ParallelContext.single(), batches(5))
    init_weights(trainer, open_source(base))
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        hf = f.get_tensor("model.layers.1.self_attn.q_proj.weight").float()
    module = trainer.model.get_submodule("layers.1.attn.q")
    theirs, state = bnb.quantize_4bit(hf, blocksize=64, quant_type="nf4", compress_statistics=True)
    stored = list(module.parametrizations.weight.parameters())
    assert torch.equal(stored[0].view(-1), theirs.view(-1)) and torch.equal(stored[1], state.absmax)
    assert not any(p.requires_grad for p in stored)

    # trained, saved and merged: the plain HF directory holds dequantized base + scale B A
    from transformers import AutoModelForCausalLM

    from shardlm.checkpoint import load_model
    from shardlm.cli import main

    for _ in range(2):
        trainer.train_step()
    save_checkpoint(trainer, tmp_path / "run")
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_model(tmp_path / "run", ParallelContext.single())[0](tokens)[..., :96]
    assert main(["convert", "--to-peft", str(tmp_path / "merged"), "--checkpoint", str(tmp_path / "run"),
                 "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert rel(merged(tokens).logits, ours) <= TOL


# Bits a weight of n values costs, counted by hand: 4 n for the codes (two a byte), 8 for each block of 64 (its
# absmax as an 8-bit code), 32 for each 256 of those codes (their fp32 maximum) and 32 for the one fp32 offset.
# Keeping the absmax in fp32 instead (no double quantization) would cost 4 n + 32 n / 64: 4.5 bits a weight.
BITS = {
    256: 1024 + 4 * 8 + 32 + 32,  # 4.375 a weight: k, v shards at TP=2
    512: 2048 + 8 * 8 + 32 + 32,  # 4.25: q, o shards at TP=2; k, v whole
    1024: 4096 + 16 * 8 + 32 + 32,  # 4.1875: q, o whole
    4096: 16384 + 64 * 8 + 32 + 32,  # 4.140625: gate, up, down shards at TP=2
    8192: 32768 + 128 * 8 + 32 + 32,  # 4.1328125: gate, up, down whole
    1024 * 1024: 4194304 + 16384 * 8 + 64 * 32 + 32,  # 4.126984: a large projection (the docs' 4.127)
}


def stored_bits(tensors: list[torch.Tensor]) -> int:
    return sum(8 * t.numel() * t.element_size() for t in tensors)


def nearest_statistics_codes(weight: torch.Tensor, state) -> torch.Tensor:
    """The 8-bit codes of `weight`'s block maxima less their mean, each the index of the nearest value of
    bitsandbytes' own map (`state.state2.code`) to it, scaled by its block of 256's maximum as bitsandbytes scales
    it; found by exhaustive search, in float64."""
    absmax = torch.nn.functional.pad(weight.reshape(-1), (0, -weight.numel() % 64)).view(-1, 64).abs().amax(dim=1)
    stats = absmax - state.offset
    scale = state.state2.absmax.repeat_interleave(256)[:stats.numel()]
    return ((stats / scale).reshape(-1, 1).double() - state.state2.code.double()).abs().argmin(dim=1).to(torch.uint8)


def bitsandbytes_blocks(whole: torch.Tensor) -> dict:
    """bitsandbytes' quantization of one whole matrix: its packed codes by block (blocks, 32), the nearest
    statistics codes and its own, the statistics' maxima and offset, and its PyTorch reference dequantization,
    flat by block (blocks, 64)."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute as reference

    theirs, state = bnb.quantize_4bit(whole, blocksize=64, quant_type="nf4", compress_statistics=True)
    blocks = -(-whole.numel() // 64)
    absmax = bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset
    values = reference(theirs.view(-1), absmax, state.code, 64, whole.shape, torch.float32).reshape(-1)
    return {"packed": torch.nn.functional.pad(theirs.view(-1), (0, blocks * 32 - theirs.numel())).view(blocks, 32),
            "nearest": nearest_statistics_codes(whole, state), "codes": state.absmax, "max": state.state2.absmax,
            "offset": state.offset, "values": torch.nn.functional.pad(values, (0, blocks * 64 - values.numel()))
            .view(blocks, 64)}


SHARDS = {  # (whole shape, split dim in the matrix, parts): how the tiny layouts and real models cut weights
    "rows, blocks straddling ranks": ((6, 100), 0, 2),
    "rows": ((128, 32), 0, 2),
    "columns, aligned": ((32, 128), 1, 2),
    "columns of 16, blocks straddling ranks": ((32, 32), 1, 2),
    "columns of 50 over rows of 100": ((4, 100), 1, 2),
    "four column shards": ((16, 256), 1, 4),
    "whole": ((48, 96), None, 1),
}


@pytest.mark.parametrize("case", list(SHARDS))
@pytest.mark.parametrize("experts", [None, 3])
def test_each_shard_keeps_bitsandbytes_blocks_of_the_whole_matrix(case, experts):
    """Per rank: the stored packed codes, statistics' maxima and offset are bitwise bitsandbytes' of the whole matrix
    (each expert's own) at the blocks the rank's slice touches (every one of them, and only those); the statistics
    codes are the nearest; the dequantized slice is bitwise bitsandbytes' reference dequantization of the whole
    matrix, cut to the slice, wherever bitsandbytes' statistics code is the nearest."""
    (rows, cols), dim, parts = SHARDS[case]
    torch.manual_seed(0)
    matrices = torch.randn(experts or 1, rows, cols) * 0.05
    whole = matrices if experts else matrices[0]
    oracle = [bitsandbytes_blocks(m) for m in matrices]
    misses = 0
    for rank in range(parts):
        shard = nf4.Shard.of((rows, cols), dim, rank, parts)
        local = (*(() if experts is None else (experts,)), *shard.shape)
        weight = nf4.NF4Weight(shard, local, torch.float32, {})
        packed, codes, stats_max, offset = (t if experts else t.unsqueeze(0) for t in weight.right_inverse(whole))
        offset = offset.view(-1)
        value = weight(*weight.right_inverse(whole)).reshape(-1, *shard.shape)
        flat = torch.arange(rows * cols).view(rows, cols)[shard.r0:shard.r1, shard.c0:shard.c1]
        touched = torch.unique(flat // 64)
        assert torch.equal(shard.blocks(), touched), (case, rank)
        for e, theirs in enumerate(oracle):
            assert torch.equal(packed[e], theirs["packed"][touched]) and packed.dtype == torch.uint8, (case, rank, e)
            assert torch.equal(stats_max[e], theirs["max"]) and torch.equal(offset[e], theirs["offset"]), (case, e)
            assert torch.equal(codes[e], theirs["nearest"][touched]), (case, rank, e)
            agree = theirs["codes"] == theirs["nearest"]
            assert torch.equal(codes[e][agree[touched]], theirs["codes"][touched][agree[touched]])
            good = agree.repeat_interleave(64)[:rows * cols].view(rows, cols)[shard.r0:shard.r1, shard.c0:shard.c1]
            expected = theirs["values"].view(-1)[:rows * cols].view(rows, cols)[shard.r0:shard.r1, shard.c0:shard.c1]
            assert torch.equal(value[e][good], expected[good]), (case, rank, e)
            misses += int((~good).sum())
    assert misses <= 64 * (experts or 1) * parts  # bitsandbytes' misses are rare: at most a block a matrix here


def test_bits_a_weight_of_a_large_projection():
    """The docs' 4.127 bits a weight, counted by hand (`BITS`), for a 1024 x 1024 projection."""
    torch.manual_seed(0)
    stored = nf4.quantize(torch.randn(1024, 1024) * 0.02)
    assert stored_bits(stored) == BITS[1024 * 1024] == 8 * nf4.quantized_bytes(torch.Size((1024, 1024)))
    assert round(BITS[1024 * 1024] / 1024 ** 2, 3) == 4.127


def test_base_bytes_and_bitwise_resume(tmp_path):
    ctx = ParallelContext.single()
    config = lora_config(arch="llama", micro=4, lora={**QLORA, "dropout": 0.1}, steps=6)
    config.model.dropout = 0.1
    trainer = Trainer(config, ctx, train_data())
    weights = nf4.quantized(trainer.model)
    assert set(weights) == {f"{name}.weight" for name in adaptable(trainer.model)}
    stored = sum(p.numel() * p.element_size() for name, p in trainer.model.named_parameters()
                 if ".parametrizations.weight." in name)
    assert stored == sum(nf4.quantized_bytes(w.shape) for w in weights.values())
    per_weight = [(stored_bits(list(trainer.model.get_submodule(n.rsplit(".", 1)[0]).parametrizations.weight
                                    .parameters())), w.shape.numel()) for n, w in weights.items()]
    assert all(bits == BITS[n] for bits, n in per_weight), per_weight  # small weights pay their offsets
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(trainer, tmp_path)
    straight = [trainer.train_step()["loss"] for _ in range(3)]
    ctx.rng = None
    resumed = Trainer(config, ctx, train_data())
    disturb_generators(ctx)
    load_checkpoint(resumed, tmp_path)
    assert [resumed.train_step()["loss"] for _ in range(3)] == straight
