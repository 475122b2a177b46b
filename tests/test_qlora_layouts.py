"""QLoRA is one model at every layout: the NF4 base is the whole matrices' quantization wherever it is split.

Model and data as `test_lora_layouts` (4-layer Llama on packed SFT rows, adapters of rank 4 on every projection;
the MoE: 2 layers of 4 experts top-2 with adapters on the experts too), with `lora.quantize = "nf4"`: every
attention and MLP projection and every expert matrix in NF4. Each layout against one process's QLoRA run:
- the dequantized base, gathered whole (over TP, EP and FSDP's shards), bitwise one process's, before and after
  training (a layout that changed the base, as per-shard quantization did, fails here);
- 4 steps' (`test_lora_layouts.STEPS`) losses and gradient norms, the validation loss and every adapter within 1e-5;
- under FSDP, every NF4 tensor an FSDP shard.
Layouts: world 2: TP=2 with SP, EP=2 (experts in NF4), TP=2 with SP of the MoE (each expert's rows split), FSDP
DP=2, MLA at TP=2 with SP (q_a and kv_a whole on both ranks, their adapters' gradients partial over TP), PP=2 x 2
virtual stages, CP=2; world 4:
FSDP DP=4, hybrid FSDP (shards of 2), FSDP x TP=2 with SP, FSDP x EP=2, EP=2 x TP=2 with SP.
The tiny shapes cover the three ways a rank keeps its blocks (`shardlm.lora.nf4.Shard`): column shards (contiguous
rows), o's 16-column halves of a 32-column matrix (blocks of 64 straddle both ranks, kept whole by both) and down's
64-column halves (aligned).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_lora_layouts import STEPS, lora_config
from test_moe_parallel import stage_parameters
from test_sft_layouts import train_data, valid_data

from shardlm.checkpoint import load_checkpoint, load_model, save_checkpoint
from shardlm.checkpoint.peft import read_peft, stacked, write_merged
from shardlm.cli import main
from shardlm.lora import count_parameters, nf4
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_same_curve
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result, merge_copies

TOL = 1e-5
QLORA = {"quantize": "nf4"}


def qlora_config(**spec):
    return lora_config(arch="llama", lora=QLORA, **spec)


def dequantized_base(model, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Every NF4 weight of `model` dequantized and gathered whole: FSDP shards of its stored tensors gathered
    first, then TP shards along the weight's split dim, expert stacks over EP; every pipeline stage's."""
    out = {}
    for name, weight in sorted(nf4.quantized(model).items()):
        prefix, attribute = name.rsplit(".", 1)
        stored = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                  for p in getattr(model.get_submodule(prefix).parametrizations, attribute).parameters()]
        value = weight(*stored)
        dim = weight.marks.get("tensor_parallel_dim")
        if dim is not None and ctx.tp_size > 1:
            value = torch.cat(ctx.tp.all_gather(value.contiguous()), dim=dim)
        if weight.marks.get("expert_parallel") and ctx.ep_size > 1:
            value = torch.cat(ctx.ep.all_gather(value.contiguous()))
        out[name] = value
    return merge_copies(ctx.world.all_gather_object(out)) if ctx.pp_size > 1 else out  # every stage's layers


def run_qlora(tp: int, pp: int, cp: int, ep: int, save: str | None = None, **spec) -> dict:
    """STEPS steps of a QLoRA config at a layout (one process outside a world): the curve, the validation loss, every
    parameter but the NF4 tensors (`stage_parameters`), what it counts, and the whole dequantized base before and
    after training; then a checkpoint in `save` when given."""
    ctx = layout_context(tp, pp, cp, ep) if dist.is_initialized() else ParallelContext.single()
    config = qlora_config(tp=tp, pp=pp, cp=cp, ep=ep, **spec)
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, train_data(), valid_data())
    base = dequantized_base(trainer.model, ctx)
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    params = {n: p for n, p in stage_parameters(trainer.model).items() if ".parametrizations." not in n}
    if save:
        save_checkpoint(trainer, save)
    stored = {n: (p.to_local().shape[0], p.shape[0]) if hasattr(p, "to_local") else None
              for n, p in trainer.model.named_parameters() if ".parametrizations." in n}
    return {"curve": curve, "valid": trainer.evaluate(), "params": params, "base": base, "stored": stored,
            "base after": dequantized_base(trainer.model, ctx), "count": count_parameters(trainer.model, ctx)}


WORLD2 = {
    "tp2 sp": ("llama", layout(tp=2, sp=True)),
    "ep2 moe": ("moe", layout(ep=2, moe=True)),
    "tp2 sp moe": ("moe", layout(tp=2, sp=True, moe=True)),
    "fsdp dp2": ("llama", layout(data_sharding="full")),
    "tp2 sp mla": ("mla", layout(tp=2, sp=True, mla=True)),
    "pp2 virtual2": ("llama", layout(pp=2, virtual=2, micro=1)),
    "cp2": ("llama", layout(cp=2)),
}
WORLD4 = {
    "fsdp dp4": ("llama", layout(micro=2, data_sharding="full")),
    "hybrid fsdp dp4 shard2": ("llama", layout(micro=2, data_sharding="full", fsdp_shard_size=2)),
    "fsdp tp2 dp2 sp": ("llama", layout(tp=2, sp=True, data_sharding="full")),
    "fsdp ep2 dp4 moe": ("moe", layout(ep=2, moe=True, data_sharding="full")),
    "ep2 tp2 sp moe": ("moe", layout(ep=2, tp=2, sp=True, moe=True)),
}
REFERENCES = {"llama": {"micro": 8}, "moe": {"micro": 2, "moe": True}, "mla": {"micro": 8, "mla": True}}


SAVED = ("tp2 sp", "fsdp dp2", "ep2 moe")
"""Cases whose trained run is saved, resumed at one process and exported merged (`test_a_checkpoint_*`)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora-checkpoints")
    return {name: root / name.replace(" ", "-") for name in SAVED}


@pytest.fixture(scope="module")
def world2(saved):
    cases = {name: (ref, {**spec, "save": str(saved[name])} if name in saved else spec)
             for name, (ref, spec) in WORLD2.items()}
    return spawn_layouts(2, run_qlora, cases)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_qlora, WORLD4)


@pytest.fixture(scope="module")
def reference():
    return {kind: run_qlora(1, 1, 1, 1, **spec) for kind, spec in REFERENCES.items()}


def assert_same_qlora(value: dict, ref: dict, where: str) -> None:
    """The base bitwise one process's (as built and after training), the curve, validation loss and every adapter
    within TOL."""
    assert value["base"].keys() == ref["base"].keys() and ref["base"], where
    for name, weight in ref["base"].items():
        assert torch.equal(value["base"][name], weight), f"{where}: {name} is another base than one process's"
        assert torch.equal(value["base after"][name], weight), f"{where}: {name} moved"
    assert_same_curve(value["curve"], ref["curve"], where, TOL)
    assert abs(value["valid"] - ref["valid"]) <= TOL * abs(ref["valid"]), where
    adapters = [n for n in ref["params"] if ".lora." in n]
    assert adapters and value["params"].keys() == ref["params"].keys(), where
    for name in adapters:
        assert torch.allclose(value["params"][name], ref["params"][name], rtol=0, atol=TOL), f"{where}: {name}"
    assert (value["count"].trainable, value["count"].total) == (ref["count"].trainable, ref["count"].total), where


def assert_sharded(value: dict, name: str, dp: int) -> None:
    """Under FSDP every NF4 tensor (packed codes and statistics codes by blocks, their maxima, the offset) is an FSDP
    shard holding at most ceil(rows / dp) of its rows on this rank."""
    if "fsdp" not in name:
        assert not any(value["stored"].values()), name
        return
    assert value["stored"] and all(value["stored"].values()), f"{name}: an NF4 tensor is not sharded by FSDP"
    for tensor, (local, rows) in value["stored"].items():
        assert local <= -(-rows // dp), (name, tensor, local, rows)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(WORLD2))
def test_qlora_at_two_ranks_is_one_process(world2, reference, name):
    for rank, value in enumerate(check_result(world2, name)):
        assert_same_qlora(value, reference[WORLD2[name][0]], f"{name} rank {rank}")
        assert_sharded(value, name, 2)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(WORLD4))
def test_qlora_at_four_ranks_is_one_process(world4, reference, name):
    for rank, value in enumerate(check_result(world4, name)):
        assert_same_qlora(value, reference[WORLD4[name][0]], f"{name} rank {rank}")
        assert_sharded(value, name, {"hybrid fsdp dp4 shard2": 2, "fsdp tp2 dp2 sp": 2}.get(name, 4))


def test_the_reference_trains_an_nf4_base(reference):
    """The references quantize every projection and expert matrix, and their adapters move."""
    llama, moe = reference["llama"]["base"], reference["moe"]["base"]
    assert len(llama) == 4 * 7 and all(n.endswith(".weight") for n in llama)
    assert {n.rsplit(".", 1)[1] for n in moe if ".experts." in n} == {"gate", "up", "down"}
    assert moe["layers.0.mlp.experts.gate"].shape == (4, 32, 32)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SAVED)
def test_a_checkpoint_resumes_at_one_process_and_merges_to_the_trained_model(world2, reference, saved, tmp_path, name):
    """A QLoRA checkpoint saved at TP=2, FSDP DP=2 or EP=2, resumed at one process: the base quantized again is the
    one-process base bitwise, the adapters are the run's, and its validation loss is the run's within 1e-5.
    `convert --to-peft` of it holds exactly the run's adapters. `convert --to-peft --merge`: a plain transformers
    model (Llama; Mixtral for the MoE, its expert adapters folded into the experts) with the resumed model's logits
    within 1e-5 of their largest. The control: the MoE's expert adapters count (without them the logits move by
    more than 1e-4)."""
    from transformers import AutoModelForCausalLM

    run = check_result(world2, name)[0]
    ref = reference[WORLD2[name][0]]
    config = qlora_config(**REFERENCES[WORLD2[name][0]])
    ctx = ParallelContext.single()
    resumed = Trainer(config, ctx, train_data(), valid_data())
    load_checkpoint(resumed, saved[name])
    base = dequantized_base(resumed.model, ctx)
    assert base.keys() == ref["base"].keys() and all(torch.equal(base[n], w) for n, w in ref["base"].items())
    params = dict(resumed.model.named_parameters())
    adapters = [n for n in run["params"] if ".lora." in n]
    assert adapters and all(torch.equal(params[n].detach(), run["params"][n]) for n in adapters), name
    assert abs(resumed.evaluate() - run["valid"]) <= TOL * abs(run["valid"]), name
    assert main(["convert", "--to-peft", str(tmp_path / "peft"), "--checkpoint", str(saved[name])]) == 0
    exported = stacked(read_peft(tmp_path / "peft", config.model)[1])
    assert sorted(exported) == sorted(adapters), name
    assert all(torch.equal(exported[n], run["params"][n]) for n in adapters), name

    tokens = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    model, _ = load_model(saved[name], ctx)
    with torch.no_grad():
        ours = model(tokens)[..., :config.model.vocab_size]  # the padded vocabulary's rows left out
    write_merged(saved[name], tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged).__name__ == ("MixtralForCausalLM" if "moe" in name else "LlamaForCausalLM")
    with torch.no_grad():
        theirs = merged(tokens).logits
    scale = ours.abs().max()
    assert (theirs - ours).abs().max() <= TOL * scale, name
    if "moe" in name:
        for module in model.modules():
            if getattr(module, "lora", None) is not None and hasattr(module.lora, "A_in"):
                module.lora = None
        with torch.no_grad():
            assert (model(tokens)[..., :config.model.vocab_size] - ours).abs().max() > 1e-4 * scale
