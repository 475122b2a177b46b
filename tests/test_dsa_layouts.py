"""DeepSeek Sparse Attention trains at every layout as one process does (fp32, within 1e-5: losses with the
indexers' loss in their gradient, gradient norms, the validation loss and every final parameter on every rank, after
2 steps of 4 rows, 8 with LoRA).

The model: `test_sft_layouts`' 4-layer MLA Llama with a lightning indexer per layer (8 heads of 8 channels, the
first 4 rotated) choosing each query's 4 keys, on its packed SFT rows of 32 tokens (documents longer than 4,
crossing the CP chunks and the micro-batches), the indexers trained by their KL loss (coefficient 1).
- world 2: TP=2 with SP (the indexer replicated: the same choice on both ranks, the target's head sums
  all-reduced), CP=2 (the indexer keys and MLA latents of both ranks gathered), PP=2 x 2 virtual stages, DP=2 with
  ZeRO-1, FSDP DP=2, EP=2 (a MoE variant), LoRA at TP=2 with SP (the indexers frozen with the base), GLM-5's
  shared indexers (layers 1 and 3 reuse layers 0 and 2's choice) at TP=2 with SP and at PP=2, and the dense
  warm-up stage (only the indexers train) at TP=2 with SP and CP=2;
- world 4: CP=2 x TP=2 with SP, TP=2 x DP=2 with ZeRO-1, CP=4;
- world 3: CP=3 (rows of 48 tokens, against one process on the same rows);
- chunks of 4 queries (`short chunks`) at TP=2 with SP, CP=2 and CP=2 x TP=2: a row's first chunks then see at
  most 4 x k keys and attend densely with the unchosen keys masked, its later ones gather their k keys (the two
  routes of `sparse_latent_attention`, both counted), against the same one process taking only the gathered route;
- the control: at CP=2, each query choosing among and attending to its own rank's keys only trains and ends far off;
- the planner's per-layer bytes equal what each rank's layers keep at CP=2, TP=2 and TP=2 with SP (fp32, bf16).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
from test_moe_parallel import stage_parameters
from test_sft_layouts import TOL, conversations, sft_config, train_data, valid_data

from shardlm.models import sparse_attention
from shardlm.parallel import ParallelContext
from shardlm.sft.dataset import PackedDataset
from shardlm.sft.packing import PackedRows
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank, assert_trained_but_off
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result

DSA = {"index_topk": 4, "index_heads": 8, "index_head_dim": 8}
SHARED = ["full", "shared", "full", "shared"]
STEPS, BATCH, LORA_BATCH = 2, 4, 8
"""2 steps of 4 rows; the LoRA runs of 8 (their B matrices start at zero: on 4 rows some elements' gradients nearly
cancel, and a layout's rounding turns them into whole AdamW steps)."""


def dsa_config(moe: bool = False, lora: int = 0, shared: bool = False, warmup: bool = False, **kwargs):
    batch = LORA_BATCH if lora else BATCH
    config = sft_config("mla", moe=moe, **{"steps": STEPS, "global_batch_size": batch, **kwargs})
    for key, value in DSA.items():
        setattr(config.model, key, value)
    config.model.index_layer_types = SHARED[:config.model.num_layers] if shared else []
    config.model.index_stage = "warmup" if warmup else "sparse"
    config.lora.rank, config.lora.targets = lora, ["q_b", "kv_b", "o", "gate", "up", "down"]
    return config


def train_layout(ctx: ParallelContext, config) -> dict:
    """Curve (loss, gradient norm) of STEPS steps, the validation loss and every final parameter (all stages)."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, train_data(), valid_data())
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    return {"curve": curve, "valid": trainer.evaluate(), "params": stage_parameters(trainer.model)}


@contextlib.contextmanager
def broken(control: str | None):
    """"own keys": each CP rank's queries see only the keys it holds (`visible_keys` restricted to them)."""
    visible = sparse_attention.visible_keys
    if control == "own keys":
        def own_keys(rows, keys, documents, past=0):
            import torch
            held = torch.zeros(keys, dtype=torch.bool, device=rows.device)
            held[rows] = True
            return visible(rows, keys, documents, past) & held
        sparse_attention.visible_keys = own_keys
    try:
        yield
    finally:
        sparse_attention.visible_keys = visible


SHORT = 4
"""Queries per chunk in the `short chunks` cases: a row of 32 tokens at k = 4 has chunks seeing 4, 8, 12 and 16 keys
(at most DENSE_SPAN x k: dense) before the ones that gather."""


@contextlib.contextmanager
def short_chunks(routes: dict | None):
    """With `routes` (a dict), every chunk of the sparse attention, the choice and the indexers' loss holds SHORT
    queries, and `routes["dense"]` / `routes["gathered"]` count the attention's chunks by route (the backward's
    recomputation counted again)."""
    step, attend = sparse_attention.query_step, sparse_attention._attend
    if routes is not None:
        def counted(*args):
            routes["dense" if args[7] else "gathered"] += 1
            return attend(*args)
        sparse_attention.query_step = lambda *sizes: SHORT
        sparse_attention._attend = counted
    try:
        yield
    finally:
        sparse_attention.query_step, sparse_attention._attend = step, attend


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, short: bool = False,
               **config) -> dict:
    routes = {"dense": 0, "gathered": 0} if short else None
    with broken(control), short_chunks(routes):
        result = train_layout(layout_context(tp, pp, cp, ep), dsa_config(tp=tp, pp=pp, cp=cp, ep=ep, **config))
    return result | ({"routes": routes} if short else {})


SEQ3 = 48
"""Rows for CP=3 (a multiple of 2 x 3)."""


def train_rows_of_48(ctx: ParallelContext, config) -> dict:
    """`train_layout` on rows of SEQ3 tokens packed from the same conversations."""
    config.model.seq_length = SEQ3
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, PackedDataset(PackedRows(conversations(1, 40), SEQ3, "bfd", seed=5)),
                      PackedDataset(PackedRows(conversations(2, 16), SEQ3, "bfd", seed=None), epochs=1))
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    return {"curve": curve, "valid": trainer.evaluate(), "params": stage_parameters(trainer.model)}


def run_rows_of_48(tp: int, pp: int, cp: int, ep: int, **config) -> dict:
    return train_rows_of_48(layout_context(tp, pp, cp, ep), dsa_config(tp=tp, pp=pp, cp=cp, ep=ep, **config))


WORLD2 = {
    "tp2 sp": layout(tp=2, sp=True),
    "cp2": layout(cp=2),
    "pp2 virtual2": layout(pp=2, virtual=2, micro=1),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2 moe": layout(ep=2, moe=True),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
    "tp2 sp shared": layout(tp=2, sp=True, shared=True),
    "pp2 shared": layout(pp=2, micro=1, shared=True),
    "tp2 sp warmup": layout(tp=2, sp=True, warmup=True),
    "cp2 warmup": layout(cp=2, warmup=True),
    "tp2 sp short chunks": layout(tp=2, sp=True, short=True),
    "cp2 short chunks": layout(cp=2, short=True),
}
CONTROLS = {"control cp2 own keys": layout(cp=2, control="own keys")}
WORLD4 = {
    "cp2 tp2 sp": layout(cp=2, tp=2, sp=True),
    "cp2 tp2 sp short chunks": layout(cp=2, tp=2, sp=True, short=True),
    "zero tp2 dp2 sp": layout(tp=2, sp=True, distributed_optimizer=True),
    "cp4": layout(cp=4),
}


WORLD3 = {"cp3": layout(cp=3, micro=BATCH)}


@pytest.fixture(scope="module")
def world3():
    return spawn_layouts(3, run_rows_of_48, WORLD3)


def layer_saves(tp: int, cp: int, sp: bool, precision: str, dense: bool = False) -> dict:
    """One training forward of `dsa_config`'s model on plain rows on this rank, in `precision` ("fp32" or "bf16"
    autocast): "saved", what each layer keeps for the backward, and "planned", `activations.shardlm_memory`'s
    per-layer bytes of the rank (with SP, CP at the rank's tokens). `dense`: dense MLA without the query's low-rank
    path (no indexer, no q_lora_rank: q reads the gathered input under SP)."""
    import dataclasses

    import torch
    from test_plan_linear_attention import saved_by_layer

    from shardlm.data.zigzag import zigzag_split
    from shardlm.models import build_model
    from shardlm.plan.activations import LayerSetting, shardlm_memory
    from shardlm.plan.measure import autocast_context
    from shardlm.plan.memory import numeric_format

    ctx, cfg = layout_context(tp=tp, cp=cp), dsa_config(tp=tp, cp=cp, sp=sp).model
    if dense:
        cfg = dataclasses.replace(cfg, index_topk=0, index_heads=0, index_head_dim=0, q_lora_rank=0)
    model = build_model(cfg, ctx, seed=0, sequence_parallel=sp).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    tokens = zigzag_split(tokens, cp, ctx.cp_rank) if cp > 1 else tokens

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    saved = saved_by_layer(model, forward)
    rank_cfg = dataclasses.replace(cfg, seq_length=cfg.seq_length // cp)
    planned = shardlm_memory(rank_cfg, tp, 2, numeric_format(precision), LayerSetting(sequence_parallel=sp),
                             backend="cpu", context=cp).per_layer
    return {"saved": [saved[i] for i in range(cfg.num_layers)], "planned": planned}


SAVES = {f"saves {name} {precision}": (tp, cp, sp, precision, dense)
         for name, (tp, cp, sp, dense) in {"cp2": (1, 2, False, False), "tp2 sp": (2, 1, True, False),
                                           "tp2": (2, 1, False, False),
                                           "tp2 sp dense mla without q_lora": (2, 1, True, True)}.items()
         for precision in ("fp32", "bf16")}
"""The planner's DSA layer checked on each rank at CP=2 (the whole rows' latents and indexer keys gathered), at
TP=2 with SP (the latent down-projections and the indexer's keys on the rank's chunk) and without SP; and dense MLA
without the query's low-rank path at TP=2 with SP (q reads the gathered input, kv_a the rank's chunk)."""


def world2_more() -> dict:
    return {name: functools.partial(layer_saves, *case) for name, case in SAVES.items()}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS, more=world2_more)


@pytest.mark.parametrize("name", list(SAVES))
def test_each_rank_saves_what_the_planner_counts(world2, name):
    """Every layer (each with its own indexer) keeps on each rank the planner's per-layer bytes (the one-process
    kinds: `test_plan_sparse_attention`)."""
    for rank, run in enumerate(check_result(world2, name)):
        assert run["saved"] == [run["planned"]] * len(run["saved"]), (rank, run)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def reference():
    """One process at one micro-batch a step (the MoE at the layouts' micro-batch 2: its balancing loss is per
    micro-batch)."""
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, dsa_config(micro=BATCH)),
            "moe": train_layout(ctx, dsa_config(moe=True)),
            "lora": train_layout(ctx, dsa_config(micro=LORA_BATCH, lora=4)),
            "shared": train_layout(ctx, dsa_config(micro=BATCH, shared=True)),
            "warmup": train_layout(ctx, dsa_config(micro=BATCH, warmup=True)),
            "rows of 48": train_rows_of_48(ctx, dsa_config(micro=BATCH))}


def kind_of(name: str) -> str:
    return next((kind for kind in ("moe", "lora", "shared", "warmup") if kind in name), "dense")


def assert_routes(values: list, name: str):
    """A `short chunks` case's ranks each attended through both routes."""
    for rank, value in enumerate(values):
        if "short" in name:
            assert value["routes"]["dense"] > 0 and value["routes"]["gathered"] > 0, (name, rank, value["routes"])


@pytest.mark.parametrize("name", list(WORLD2))
def test_sparse_attention_at_two_ranks_equals_one_process(world2, reference, name):
    assert_routes(assert_every_rank(world2, name, reference[kind_of(name)], steps=STEPS, tol=TOL), name)


@pytest.mark.parametrize("name", list(WORLD4))
def test_sparse_attention_at_four_ranks_equals_one_process(world4, reference, name):
    assert_routes(assert_every_rank(world4, name, reference[kind_of(name)], steps=STEPS, tol=TOL), name)


def test_sparse_attention_at_context_parallel_three_equals_one_process(world3, reference):
    assert_every_rank(world3, "cp3", reference["rows of 48"], steps=STEPS, tol=TOL)


def test_top_k_over_one_rank_keys_ends_far_off(world2, reference):
    """Each CP rank choosing among its own keys only: finite losses, far from one process."""
    ref = reference["dense"]
    for value in check_result(world2, "control cp2 own keys"):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], STEPS, ".attn.")
