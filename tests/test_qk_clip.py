"""QK-clip (`train.qk_clip`, Kimi K2's MuonClip): the tracked maxima are the logits' maxima, the clip brings each
head's logits to tau, and every layout equals one process.

- The tracked per-head maximum equals a direct computation: the full (B, H, T, T) logits of the q and k the
  attention core received, masked causally (and by packed document, and by sliding window), in float64. GPT
  (multi-head), Llama with grouped-query attention and sliding-window layers, multi-query Llama, gated attention,
  and MLA; plain and packed rows.
- After `clip_qk`, the same attention layer on the same input has each clipped head's largest logit equal to tau
  and every other head's unchanged (within 1e-5), layer by layer: the rule is exact for multi-head (GPT's qkv bias
  given random values, so that it must be scaled with the weight), grouped and latent attention.
- Under context parallelism (CP=2, zigzag parts, packed rows, a sliding window) the maxima over the CP ranks equal
  one process's.
- Under FSDP (DP=2, fp32 parameters, and bf16 gathered copies as train.param_dtype = "half" makes them) each rank
  clips its own rows of every weight: the parameters gathered after the clip are bitwise those of the same model
  clipped whole (GPT, Llama with grouped-query attention, MLA).
- With bf16 parameters and fp32 master weights (replicated and ZeRO-1 at DP=2) the master weights after the clip are
  bitwise an fp32 model's holding the same values clipped whole, and the parameters their casts; bf16 runs of
  train.param_dtype = "half" (FSDP, replicated, ZeRO-1) follow the clipped fp32 one-process run within bf16's
  rounding, far nearer it than the unclipped run.
- Training with Muon and QK-clip (tau low enough that heads clip every step, checked on the reference): TP=2 with SP
  (split key heads), TP=2 with one key head for four query heads (replicated), TP=2 MLA, CP=2, PP=2, DP=2, ZeRO-1
  and FSDP (Llama, MLA) at DP=2, FSDP at DP=2 x TP=2 (Llama with SP, MLA) and hybrid sharding (DP=4 sharded in
  pairs) equal one process within 1e-5 (4 steps' losses and gradient norms, every parameter; the step maxima within
  5e-5). The PP run starts with every head's maximum planted at 1e6, as a
  forward that must not count (the schedule's shape inference) could leave it: the stages count from the first
  micro-batch.
- Controls: the reference with the clip off, and DP=2 and CP=2 with each rank clipping by its own maxima (no
  all-reduce over DP x CP), train and end more than 1e-3 off the clipped one-process run.
- One-line errors: tau < 0, QK-norm, LoRA.
"""

from __future__ import annotations

import contextlib
import copy
import json
from unittest import mock

import pytest
import torch
from test_moe_parallel import stage_parameters
from test_muon import MLA, STEPS, TOL, batches, muon_config
from test_training import VOCAB

from shardlm.config import from_dict
from shardlm.data.zigzag import zigzag_split
from shardlm.errors import UserError
from shardlm.models import build_model
from shardlm.models.documents import Documents, block_causal_mask
from shardlm.parallel import ParallelContext
from shardlm.parallel.comm import Communicator
from shardlm.training.logging import RunLogger
from shardlm.training.qk_clip import attention_layers, clip_qk, track_max_logits
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import CURVE, assert_every_rank, assert_trained_but_off
from layouts import layout, layout_context, selected_cases, spawn_layouts
from multiproc import check_result

SEQ, TAU = 16, 4.0
MAX_LOGIT_TOL = 5e-5
"""The step maxima's bound: a logit of about 5 is a sum of products several times larger, so the layouts' 1e-6
rounding of q and k reaches it magnified (8e-6 seen at CP=2 on the AVX2 kernels); losses and parameters keep 1e-5."""
KINDS = {
    "gpt": {"arch": "gpt"},
    "llama gqa window": {"num_kv_heads": 2, "sliding_window": 6, "layer_types": ["sliding_attention",
                                                                                  "full_attention"]},
    "llama mqa": {"num_kv_heads": 1},
    "llama gated": {"num_kv_heads": 2, "attention_output_gate": True},
    "mla": MLA,
}
OFFSETS = [[0, 5, 16], [0, 9, 11, 16]]


def model_config(kind: str):
    model = {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": SEQ,
             "vocab_size": VOCAB, "dropout": 0.0, "init_std": 0.3, **KINDS[kind]}
    return from_dict({"model": model, "data": {"text_file": "unused"}}).model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def traced_forward(model, x: torch.Tensor, documents: Documents | None) -> dict:
    """One training forward with the maxima tracked; per attention layer its input and the q and k its core got."""
    seen = {}
    for index, layer in enumerate(attention_layers(model)):
        core = layer.core

        def traced(q, k, v, docs=None, core=core, index=index):
            seen.setdefault(index, {})["qk"] = (q.detach(), k.detach())
            return core(q, k, v, docs)

        layer.core = traced
        layer.register_forward_pre_hook(lambda m, args, index=index: seen.setdefault(index, {}).update(x=args[0]))
    track_max_logits(model)
    model.train()
    model(x, documents=documents)
    return seen


def direct_maxima(layer, q: torch.Tensor, k: torch.Tensor, packed: bool) -> torch.Tensor:
    """(H,) the largest entry of the full masked logits, float64."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = getattr(layer, "scale", None) or q.shape[-1] ** -0.5
    logits = q @ k.transpose(-1, -2) * scale  # (B, H, T, T)
    T = q.shape[2]
    visible = block_causal_mask(OFFSETS, T) if packed else torch.ones(T, T, dtype=torch.bool).tril()
    window = getattr(layer, "window", 0)
    if window:
        visible = visible & (torch.arange(T)[:, None] - torch.arange(T)[None, :] < window)
    return logits.masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_tracked_maxima_are_the_logits_maxima_and_the_clip_brings_them_to_tau(kind, packed):
    ctx = ParallelContext.single()
    model = build_model(model_config(kind), ctx, seed=3)
    with torch.no_grad():  # GPT's qkv bias starts at zero: random values, so that the clip must scale it too
        for name, param in model.named_parameters():
            if ".attn." in name and name.endswith("bias"):
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(4))
    assert kind != "gpt" or all(layer.qkv.bias.abs().min() > 0 for layer in attention_layers(model))
    documents = Documents.from_offsets(OFFSETS, SEQ) if packed else None
    seen = traced_forward(model, tokens(), documents)
    layers = attention_layers(model)
    assert len(layers) == 2 and (kind != "llama gqa window" or layers[0].window == 6)
    before = []
    for index, layer in enumerate(layers):
        expected = direct_maxima(layer, *seen[index]["qk"], packed).float()
        assert torch.allclose(layer.max_logits, expected, rtol=1e-5, atol=1e-6), (index, layer.max_logits, expected)
        before.append(expected)
    tau = float(before[0].median())  # half the first layer's heads clip
    clip_qk(model, ctx, tau)
    for index, layer in enumerate(layers):
        assert torch.isinf(layer.max_logits).all()  # reset for the next step
        layer(seen[index]["x"], None, documents)  # the same layer on the same input after the clip
        after, old = layer.max_logits, before[index]
        clipped = old > tau
        assert index > 0 or (clipped.any() and not clipped.all())  # the first layer has both kinds of head
        assert torch.allclose(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5), (index, after, old)
        assert torch.allclose(after[~clipped], old[~clipped], rtol=1e-5), (index, after, old)


def context_parallel_maxima(kind: str) -> dict:
    """CP=2 (zigzag parts, packed rows): this layout's maxima, taken over the CP ranks, and one process's."""
    x, positions = tokens(), Documents.from_offsets(OFFSETS, SEQ).positions.clone()
    single = build_model(model_config(kind), ParallelContext.single(), seed=3)
    traced_forward(single, x, Documents.from_positions(positions))
    ctx = ParallelContext.from_process_group(1, context_parallel=2)
    model = build_model(model_config(kind), ctx, seed=3)
    traced_forward(model, zigzag_split(x, 2, ctx.cp_rank), Documents.from_positions(positions, 2, ctx.cp_rank))
    out = {}
    for index, (mine, one) in enumerate(zip(attention_layers(model), attention_layers(single))):
        maxima = ctx.cp.all_reduce(mine.max_logits.clone(), op=torch.distributed.ReduceOp.MAX)
        out[index] = (maxima, one.max_logits)
    return out


def train(ctx: ParallelContext, config, stale_maxima: bool = False) -> dict:
    """4 steps; `stale_maxima`: every head's maximum set to 1e6 before the first step, as a forward that must not
    count (the pipeline schedule's shape inference on stand-in inputs) could leave it."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, batches())
    if stale_maxima:
        for layer in attention_layers(trainer.model):
            layer.max_logits.fill_(1e6)
    curve = [(m["loss"], m["grad_norm"], m.get("max_logit", float("nan")))
             for m in (trainer.train_step() for _ in range(STEPS))]
    return {"curve": curve, "params": stage_parameters(trainer.model)}


def plant_maxima(model) -> None:
    """Every head's maximum set, each a gamma of its own (1/2 to 1 over a layer's heads, other values each layer)."""
    track_max_logits(model)
    for index, layer in enumerate(attention_layers(model)):
        layer.max_logits.copy_(torch.linspace(2 * TAU, TAU / 2, layer.heads) * (1 + index / 8))


def master_clip(shard: bool) -> dict:
    """bf16 parameters with fp32 master weights at DP=2, ZeRO-1 (`shard`) or replicated: the maxima planted,
    `clip_qk` with the trainer's master optimizer. Returns the master weights before and after (gathered), the
    parameters after, and an fp32 model holding the master weights before, clipped whole the same way."""
    ctx = layout_context()
    config = clip_config(precision="bf16", param_dtype="half", data_sharding="optimizer" if shard else "none")
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, batches())
    before = {name: state["model"] for name, state in trainer.master.full_state().items()}
    plant_maxima(trainer.model)
    clip_qk(trainer.model, ctx, TAU, trainer.master)
    whole = build_model(config.model, ctx)
    with torch.no_grad():
        for name, param in whole.named_parameters():
            param.copy_(before[name])
    plant_maxima(whole)
    clip_qk(whole, ctx, TAU)
    return {"before": before, "after": {name: state["model"] for name, state in trainer.master.full_state().items()},
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "whole": {n: p.detach().clone() for n, p in whole.named_parameters()}}


def sharded_clip(kind: str, param_dtype: str | None) -> dict:
    """FSDP at DP=2 (`param_dtype`: "bf16" gathers bf16 copies of the fp32 shards, as train.param_dtype = "half"
    does): the same model sharded and whole, the same maxima planted in both (a gamma of its own for every head,
    1/2 to 1), `clip_qk` on each. Returns the whole model's parameters and the sharded one's, gathered."""
    from shardlm.training.fsdp import shard_model

    ctx = layout_context()
    whole, sharded = (build_model(model_config(kind), ctx, seed=3) for _ in range(2))
    shard_model(sharded, ctx, param_dtype=torch.bfloat16 if param_dtype == "bf16" else None)
    for model in (whole, sharded):
        plant_maxima(model)
        clip_qk(model, ctx, TAU)
    return {"whole": {n: p.detach().clone() for n, p in whole.named_parameters()},
            "sharded": {n: p.full_tensor() for n, p in sharded.named_parameters()},
            "before": {n: p.detach().clone() for n, p in build_model(model_config(kind), ctx, seed=3)
                       .named_parameters()}}


def clip_unreduced(model, ctx: ParallelContext, tau: float, master=None) -> float:
    """A control's bug: the clip without the maxima's all-reduce over DP x CP (each rank clips by its own rows)."""
    alone = copy.copy(ctx)
    alone.dp_cp = Communicator("alone", None, 1, 0, ctx.comm)
    return clip_qk(model, alone, tau, master)


def clip_config(kind: str = "llama", tp: int = 1, pp: int = 1, cp: int = 1, micro: int = 2, sp: bool = False,
                **train_keys):
    config = muon_config(tp=tp, pp=pp, cp=cp, micro=micro, sp=sp, mla=kind == "mla", muon_ns_dtype="fp32",
                         **{"qk_clip": TAU, **train_keys})
    config.model.init_std = 0.3  # logits of a few units: tau clips some heads, and attention is far from uniform
    # at init 0.3, Muon's 2e-2 amplifies the layouts' rounding (a TP sum of a replicated key head's gradient, AVX2's
    # kernels under CP) past 1e-5 in 4 steps, with or without the clip
    config.train.lr = 1e-2
    if kind == "mqa":  # one key head for four query heads: at TP=2 it is replicated, its gradient summed over TP
        config.model.num_kv_heads = 1
    return config


def run_layout(tp: int, pp: int, cp: int, ep: int, kind: str = "llama", unreduced: bool = False, **keys) -> dict:
    """4 steps of the layout (under PP with stale maxima planted: the stages start each step's maxima from its
    first micro-batch); `unreduced`: the control's bug, patched in this worker process for this run only."""
    assert ep == 1, "QK-clip's layouts have no experts"
    with mock.patch("shardlm.training.trainer.clip_qk", clip_unreduced) if unreduced else contextlib.nullcontext():
        return train(layout_context(tp, pp, cp, ep), clip_config(kind, tp, pp, cp, **keys), stale_maxima=pp > 1)


WORLD2 = {  # name: (reference kind, layout)
    "tp2 sp llama": ("llama", layout(tp=2, sp=True)),
    "tp2 sp mqa": ("mqa", layout(kind="mqa", tp=2, sp=True)),
    "tp2 mla": ("mla", layout(kind="mla", tp=2)),
    "cp2 llama": ("llama", layout(cp=2)),
    "pp2 llama": ("llama", layout(pp=2, micro=1)),
    "dp2 llama": ("llama", layout()),
    "dp2 zero1 llama": ("llama", layout(data_sharding="optimizer")),
    "dp2 fsdp llama": ("llama", layout(data_sharding="full")),
    "dp2 fsdp mla": ("mla", layout(kind="mla", data_sharding="full")),
    "control dp2 llama maxima unreduced": ("llama", layout(unreduced=True)),
    "control cp2 llama maxima unreduced": ("llama", layout(cp=2, unreduced=True)),
}
WORLD4 = {  # FSDP with TP (each rank clips its rows of its heads) and hybrid sharding (rows over the shard pairs)
    "fsdp dp2 x tp2 sp llama": ("llama", layout(tp=2, sp=True, data_sharding="full")),
    "fsdp dp2 x tp2 mla": ("mla", layout(kind="mla", tp=2, data_sharding="full")),
    "hsdp dp4 shard2 llama": ("llama", layout(data_sharding="full", fsdp_shard_size=2)),
}


HALF_RUNS = {"fsdp": "full", "zero1": "optimizer", "replicated": "none"}
"""bf16 runs with train.param_dtype = "half" at DP=2, by data sharding: FSDP's fp32 shards or the master weights."""
SHARDED_CLIPS = [("llama gqa window", None), ("llama gqa window", "bf16"), ("gpt", None), ("mla", None)]


def maxima_checks() -> dict:
    """Checked in the same world: the CP=2 maxima of every attention kind (`context_parallel_maxima`), FSDP's clip of
    every rank's rows (`sharded_clip`), the clip of fp32 master weights (`master_clip`) and 4 steps of each
    half-precision run (`HALF_RUNS`)."""
    return {**{f"cp2 maxima {kind}": (lambda kind=kind: context_parallel_maxima(kind)) for kind in KINDS},
            **{f"fsdp clip {kind} {dtype}": (lambda kind=kind, dtype=dtype: sharded_clip(kind, dtype))
               for kind, dtype in SHARDED_CLIPS},
            **{f"master clip {name}": (lambda shard=shard: master_clip(shard))
               for name, shard in (("zero1", True), ("replicated", False))},
            **{f"{name} half run": (lambda sharding=sharding: train(layout_context(), clip_config(
                precision="bf16", param_dtype="half", data_sharding=sharding)))
               for name, sharding in HALF_RUNS.items()}}


@pytest.fixture(scope="module")
def world2(request):
    """Every case and check; only the named layouts when only they are selected (the AVX2 rerun of
    tests/test_cpu_kinds.py)."""
    cases = selected_cases(request, WORLD2)
    return spawn_layouts(2, run_layout, cases, timeout=300, more=maxima_checks if cases == WORLD2 else None)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4, timeout=300)


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {kind: train(ctx, clip_config(kind, micro=8)) for kind in ("llama", "mqa", "mla")}


@pytest.fixture(scope="module")
def unclipped():
    """The llama reference's run with the clip off."""
    return train(ParallelContext.single(), clip_config(micro=8, qk_clip=0.0))


@pytest.mark.parametrize("kind", list(KINDS))
def test_context_parallel_maxima_equal_one_process(world2, kind):
    for rank, value in enumerate(check_result(world2, f"cp2 maxima {kind}")):
        for index, (maxima, one) in value.items():
            assert torch.allclose(maxima, one, rtol=1e-5, atol=1e-6), (kind, rank, index, maxima, one)


@pytest.mark.parametrize("kind,dtype", SHARDED_CLIPS, ids=[f"{k} {d}" for k, d in SHARDED_CLIPS])
def test_fsdp_clips_each_ranks_rows_as_the_whole_weight_is_clipped(world2, kind, dtype):
    """Every parameter gathered from the FSDP shards after the clip is bitwise the whole model's after its clip; the
    clip changed the query weights (each DP rank holds other heads' rows, so rows scaled with another head's factor
    would show)."""
    for rank, value in enumerate(check_result(world2, f"fsdp clip {kind} {dtype}")):
        assert value["sharded"].keys() == value["whole"].keys()
        for name, whole in value["whole"].items():
            assert torch.equal(value["sharded"][name], whole), (rank, name)
        query = [n for n in value["whole"] if n.endswith((".attn.q.weight", ".attn.qkv.weight", ".attn.q_b.weight"))]
        assert query and all(not torch.equal(value["whole"][n], value["before"][n]) for n in query), query


@pytest.mark.parametrize("name", ["zero1", "replicated"])
def test_the_clip_scales_the_master_weights_and_casts_the_parameters_again(world2, name):
    """bf16 parameters: the fp32 master weights after the clip (ZeRO-1: each rank's range, gathered) are bitwise
    those of an fp32 model holding the same values clipped whole, and the parameters are their bf16 casts (on a
    step that clipped they are made from the master again, not scaled in bf16)."""
    for rank, value in enumerate(check_result(world2, f"master clip {name}")):
        assert value["after"].keys() == value["whole"].keys()
        for key, whole in value["whole"].items():
            assert torch.equal(value["after"][key], whole), (rank, key)
            assert torch.equal(value["params"][key], whole.to(torch.bfloat16)), (rank, key)
        query = [n for n in value["whole"] if n.endswith(".attn.q.weight")]
        assert query and all(not torch.equal(value["whole"][n], value["before"][n]) for n in query), query


@pytest.mark.parametrize("name", list(HALF_RUNS))
def test_a_half_precision_run_clips_and_follows_the_fp32_run(world2, reference, name):
    """train.param_dtype = "half" (bf16 compute; FSDP's fp32 shards, or fp32 master weights replicated or ZeRO-1)
    follows the clipped fp32 one-process run within bf16's rounding: losses within 0.2% (measured 0.08% under FSDP;
    the unclipped run is 3.5% off by step 2), query weights within 0.05 (measured 0.018; the unclipped run's are
    0.40 to 0.46 off)."""
    ref = reference["llama"]
    for value in check_result(world2, f"{name} half run"):
        for (loss, _, peak), (ref_loss, _, _) in zip(value["curve"], ref["curve"], strict=True):
            assert peak > TAU and abs(loss - ref_loss) < 2e-3 * ref_loss, (value["curve"], ref["curve"])
        query = [n for n in ref["params"] if ".attn.q." in n]
        assert query and all((value["params"][n] - ref["params"][n]).abs().max() < 0.05 for n in query)


def test_the_reference_clips_every_step(reference):
    for kind, ref in reference.items():
        assert all(peak > TAU for _, _, peak in ref["curve"]), (kind, ref["curve"])


def test_the_clip_acts_a_run_without_it_ends_off(reference, unclipped):
    """Control: the same one-process run with the clip off trains and ends more than 1e-3 off the clipped run
    (its query weights), so the layouts' agreement below is an agreement of clipped runs."""
    assert_trained_but_off(unclipped["curve"], unclipped["params"], reference["llama"]["params"], STEPS, ".attn.q.")


def test_the_step_line_and_metrics_show_the_largest_logit(tmp_path, capsys):
    trainer = Trainer(clip_config(micro=8, steps=1), ParallelContext.single(), batches())
    metrics = trainer.train_step()
    logger = RunLogger(tmp_path, 1, enabled=True, progress=False, tensorboard=False)
    logger.step(metrics, 1)
    logger.close(plot=False)
    assert f"max logit {metrics['max_logit']:.3g}" in capsys.readouterr().out and metrics["max_logit"] > TAU
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["max_logit"] == metrics["max_logit"]


@pytest.mark.parametrize("name", [n for n in WORLD2 if not n.startswith("control")])
def test_qk_clip_at_two_ranks_equals_one_process(world2, reference, name):
    """Losses, gradient norms and parameters within TOL, the step maxima within MAX_LOGIT_TOL, relative."""
    assert_every_rank(world2, name, reference[WORLD2[name][0]], steps=STEPS, tol=TOL, columns=CURVE + ("max logit",),
                      column_tols={"max logit": MAX_LOGIT_TOL})


@pytest.mark.parametrize("name", list(WORLD4))
def test_qk_clip_under_fsdp_with_tensor_parallelism_and_hybrid_sharding_equals_one_process(world4, reference, name):
    """As at two ranks: FSDP at DP=2 x TP=2 (Llama with SP, MLA) and hybrid sharding at DP=4 in pairs."""
    assert_every_rank(world4, name, reference[WORLD4[name][0]], steps=STEPS, tol=TOL, columns=CURVE + ("max logit",),
                      column_tols={"max logit": MAX_LOGIT_TOL})


@pytest.mark.parametrize("name", [n for n in WORLD2 if n.startswith("control")])
def test_the_controls_bugs_end_off_one_process(world2, reference, name):
    """Controls: at DP=2 and CP=2 each rank clipping by its own maxima (no all-reduce over DP x CP) trains and ends
    more than 1e-3 off one process (its query weights)."""
    for value in check_result(world2, name):
        assert_trained_but_off(value["curve"], value["params"], reference["llama"]["params"], STEPS, ".attn.q.")


@pytest.mark.parametrize("keys,message", [
    ({"qk_clip": -1.0}, "train.qk_clip=-1.0 must be > 0"),
    ({"qk_norm": True}, "cannot run with model.qk_norm"),
    ({"lora": True}, r"cannot run with \[lora\]"),
])
def test_what_qk_clip_cannot_run_with_is_one_line(keys, message):
    keys = dict(keys)
    qk_norm, lora = keys.pop("qk_norm", False), keys.pop("lora", False)
    config = muon_config(lora=lora, **{"qk_clip": 10.0, **keys})
    config.model.qk_norm = qk_norm
    with pytest.raises(UserError, match=message):
        validate(config, 2, check_paths=False)
