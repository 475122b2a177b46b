"""QLoRA: the frozen base in NF4 with double quantization (`shardlm.lora.nf4`), against bitsandbytes and at layouts.

- bitsandbytes 0.48+ on the CPU (the dev extra) as the oracle: the NF4 table and the 8-bit dynamic map of the
  statistics are its values; the packed codes, the absmax codes, their block maxima and offset are bitwise
  `quantize_4bit(w, quant_type="nf4", compress_statistics=True)`'s for several shapes (rows of 32, 96, 100 and
  128 values: blocks cross rows); the dequantized weight is bitwise its PyTorch reference dequantization's, and
  `dequantize_4bit`'s where bitsandbytes 0.50's CPU kernel agrees with that reference (on 48 x 96, 32 x 96 and
  16 x 32 it does not).
- A base read from a Hugging Face directory is stored as bitsandbytes stores those weights (bitwise); trained and
  merged (`convert --to-peft --merge`), the plain directory's transformers logits equal the QLoRA checkpoint's.
- At TP=2 with SP each rank stores bitsandbytes' quantization of exactly its shard (cut from a one-process
  model's full-precision weight): codes, statistics' maxima and offset bitwise; the 8-bit statistics codes the
  nearest map values, which are bitsandbytes' except where its CPU kernel's search misses the nearest (3 of
  1,728). That run (each rank quantizes its shard) equals one process training LoRA on the weights it
  dequantizes, gathered, within 1e-5 (4 steps' losses, gradient norms, every adapter); at EP=2 (MoE, the
  attention projections in NF4, experts in fp32) it equals one process's QLoRA run.
- The base's bits, counted by hand for every shape (`BITS`: 4 a weight, 8 a block of 64, 32 a block of 256
  statistics, 32 for the offset): 4.127 a weight for a 1024 x 1024 projection, more for the tiny ones; a resume
  is bitwise (the base quantized again from the same weights).
"""

from __future__ import annotations

import pytest
import torch
from test_lora_layouts import lora_config, train_layout
from test_lora_peft import batches, qwen3_directory, run_config
from test_moe_parallel import full_parameters
from test_sft_layouts import train_data

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.checkpoint.init import init_weights, open_source
from shardlm.lora import nf4
from shardlm.lora.apply import adaptable
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from agreement import assert_same_curve, rel
from multiproc import check_result, disturb_generators, import_or_skip, run_checks, run_workers

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
    assert torch.equal(stored[0], theirs.view(-1)) and torch.equal(stored[1], state.absmax)
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


def dequantized_base(model, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Every NF4 weight of `model` as this layout computes it, whole: TP shards gathered."""
    out = {}
    for name, weight in nf4.quantized(model).items():
        value = model.get_submodule(name.rsplit(".", 1)[0]).weight.detach()
        dim = weight.marks.get("tensor_parallel_dim")
        out[name] = value if dim is None else torch.cat(ctx.tp.all_gather(value.contiguous()), dim=dim)
    return out


def stored_tensors(model) -> dict[str, list[torch.Tensor]]:
    """{"X.weight": [packed codes, absmax codes, their block maxima, their offset]} as this rank stores them."""
    return {name: [p.detach().clone() for p in model.get_submodule(name.rsplit(".", 1)[0]).parametrizations.weight
                   .parameters()] for name in nf4.quantized(model)}


def qlora_tp2() -> dict:
    ctx = ParallelContext.from_process_group(2)
    config = lora_config(arch="llama", tp=2, sp=True, lora=QLORA)
    trainer = Trainer(config, ctx, train_data())
    weights = dequantized_base(trainer.model, ctx)
    return {"base": weights, "stored": stored_tensors(trainer.model), **train_layout(ctx, config)}


def qlora_ep2() -> dict:
    ctx = ParallelContext.from_process_group(1, expert_parallel=2)
    return train_layout(ctx, lora_config(arch="llama", moe=True, ep=2, lora=QLORA))


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, run_checks, {"tp2 sp": qlora_tp2, "ep2 moe": qlora_ep2}, timeout=300)


def assert_same(value: dict, ref: dict, where: str) -> None:
    """The curve within TOL relative (`agreement.assert_same_curve`), every adapter element within TOL absolute."""
    assert_same_curve(value["curve"], ref["curve"], where, TOL)
    adapters = [n for n in ref["params"] if ".lora." in n]
    assert adapters and all(torch.allclose(value["params"][n], ref["params"][n], rtol=0, atol=TOL) for n in adapters)


def test_qlora_at_tp2_equals_lora_on_its_dequantized_weights(world2):
    """One process, plain LoRA, its base replaced by the TP=2 run's dequantized weights: the same run."""
    results = check_result(world2, "tp2 sp")
    ctx = ParallelContext.single()
    config = lora_config(arch="llama", micro=8)
    trainer = Trainer(config, ctx, train_data())
    with torch.no_grad():
        for name, value in results[0]["base"].items():
            trainer.model.get_parameter(name).copy_(value)
    ref = {"curve": [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))],
           "params": full_parameters(trainer.model)}
    for rank, value in enumerate(results):
        assert_same(value, ref, f"tp2 rank {rank}")
    plain = train_layout(ctx, lora_config(arch="llama", micro=8))  # the quantization changed the run
    assert abs(plain["curve"][0][0] - ref["curve"][0][0]) > 1e-4


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


def shard(weight: torch.Tensor, name: str, rank: int, tp: int = 2) -> torch.Tensor:
    """Rank `rank`'s shard of a whole projection weight (out, in): o and down split their input columns, the
    others their output rows (Llama's 2 KV heads split over TP=2 too)."""
    dim = 1 if name.rsplit(".", 2)[-2] in ("o", "down") else 0
    return weight.chunk(tp, dim=dim)[rank].contiguous()


def nearest_statistics_codes(weight: torch.Tensor, state) -> torch.Tensor:
    """The 8-bit codes of `weight`'s block maxima less their mean, each the index of the nearest value of
    bitsandbytes' own map (`state.state2.code`) to it, scaled by its block of 256's maximum as bitsandbytes scales
    it; found by exhaustive search, in float64."""
    stats = weight.reshape(-1, 64).abs().amax(dim=1) - state.offset
    scaled = (stats.view(-1, 256) if stats.numel() >= 256 else stats.view(1, -1)) * (1.0 / state.state2.absmax
                                                                                       .view(-1, 1))
    return (scaled.reshape(-1, 1).double() - state.state2.code.double()).abs().argmin(dim=1).to(torch.uint8)


@pytest.mark.timeout(600)
def test_each_tp_rank_stores_bitsandbytes_quantization_of_its_shard(world2):
    """At TP=2 each rank's stored NF4 codes, block maxima of the statistics and offset are bitwise bitsandbytes'
    `quantize_4bit` of exactly that rank's shard of the full-precision weight (cut here from a one-process
    model's), and take the bits counted by hand (`BITS`). The 8-bit statistics codes are bitsandbytes' wherever its
    CPU kernel returns the nearest value of its map, and the nearest (by exhaustive search) everywhere: that kernel's
    search misses the nearest value for a few statistics (3 of the 1,728 here), which shardlm does not copy."""
    whole = dict(Trainer(lora_config(arch="llama", micro=8), ParallelContext.single(), train_data())
                 .model.named_parameters())
    checked, misses = set(), 0
    for rank, value in enumerate(check_result(world2, "tp2 sp")):
        assert set(value["stored"]) == {n for n in whole if n.startswith("layers.") and ".lora." not in n
                                        and n.rsplit(".", 2)[-2] in ("q", "k", "v", "o", "gate", "up", "down")}
        for name, (packed, stats, stats_max, offset) in value["stored"].items():
            mine = shard(whole[name].detach(), name, rank)
            theirs, state = bnb.quantize_4bit(mine, blocksize=64, quant_type="nf4", compress_statistics=True)
            assert torch.equal(packed, theirs.view(-1)) and packed.dtype == torch.uint8, (name, rank)
            assert torch.equal(stats_max, state.state2.absmax) and torch.equal(offset, state.offset), (name, rank)
            nearest = nearest_statistics_codes(mine, state)
            assert stats.dtype == torch.uint8 and torch.equal(stats, nearest), (name, rank)
            theirs_nearest = state.absmax == nearest
            assert torch.equal(stats[theirs_nearest], state.absmax[theirs_nearest]), (name, rank)
            misses += int((~theirs_nearest).sum())
            expected = [theirs, state.absmax, state.state2.absmax, state.offset]
            assert stored_bits([packed, stats, stats_max, offset]) == BITS[mine.numel()] == stored_bits(expected)
            checked.add(mine.shape)
    assert checked == {(16, 32), (8, 32), (32, 16), (128, 32), (32, 128)}
    assert misses <= 8, misses  # bitsandbytes' misses are rare


def test_bits_a_weight_of_a_large_projection():
    """The docs' 4.127 bits a weight, counted by hand (`BITS`), for a 1024 x 1024 projection."""
    torch.manual_seed(0)
    stored = nf4.quantize(torch.randn(1024, 1024) * 0.02)
    assert stored_bits(stored) == BITS[1024 * 1024] == 8 * nf4.quantized_bytes(torch.Size((1024, 1024)))
    assert round(BITS[1024 * 1024] / 1024 ** 2, 3) == 4.127


def test_qlora_at_ep2_equals_one_process(world2):
    ref = train_layout(ParallelContext.single(), lora_config(arch="llama", moe=True, lora=QLORA))
    for rank, value in enumerate(check_result(world2, "ep2 moe")):
        assert_same(value, ref, f"ep2 rank {rank}")


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
