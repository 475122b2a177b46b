"""DeepSeek-V4 trains at every layout it runs as one process does (fp32, within 1e-5: losses, gradient norms, the
validation loss and every final parameter on every rank, 2 steps of 4 of `test_sft_layouts`' packed SFT rows of 32
tokens, whose documents are longer than the compressed windows and than the indexer's k; one case on plain rows).
The one-process references train a third step, for the check that they learn.

The model (`V4`): 4 layers (HCA entries of 8 tokens, CSA entries of 4 with an indexer of 4 heads keeping 3 of them,
a sliding-only layer, another HCA), a window of 5, 4 heads of 16 channels (4 rotary), 2 output groups, 2
hyper-connection streams, 4 experts (top 2) with a shared one and a clip, the first layer hash-routed (a fixed
random table). In one world of 2:
- TP=2 with SP: heads, sinks and output groups split; kv, compressors and indexer replicated (the same
  choice of entries on both ranks, their gradients summed over TP); under SP the streams are sequence chunks and the
  hash layer reads its chunk's tokens;
- PP=2: the (B, T, 2, h) streams handed between the stages (the hash layer on the first);
- CP=2 (and CP=3 on rows of 48, world 3): each rank projects its own tokens and gathers its chunks' halos and its
  entries (on packed rows each document's windows start at its first token, anywhere in a chunk: the windows that
  end in a rank's chunks are its own, the gathered elements counted from the documents); each rank attends its
  zigzag queries;
- DP=2 with ZeRO-1, FSDP DP=2, EP=2, LoRA at TP=2 with SP (adapters on q_b and the SwiGLUs), TP=2 with SP and full
  recomputation (the tokens for the hash layer handed to the recomputed layers too).
In one world of 4: CP=2 inside TP=2 with SP (packed and plain rows) and CP=2 across two pipeline stages.
Every case but LoRA trains the CSA indexer by its KL loss (model.index_loss_coeff): "indexer_kl" logged as one
process logs it and the indexer's parameters moved (and compared with the rest); under LoRA it stays frozen.
The control: at TP=2 with SP, the replicated weights' gradients not summed over TP ends far off.
The one-process checks of a V4 run (refusals, LoRA's grouped o_a, the hash table, the step line, the shipped config,
the banner): `test_deepseek_v4_run.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import pytest
import torch
from test_moe_parallel import stage_parameters
from test_sft_layouts import conversations, train_data, valid_data
from test_training import VOCAB

from shardlm.data.gpt_dataset import TokenArrayDataset
from shardlm.models import compressed_attention
from shardlm.parallel import ParallelContext
from shardlm.sft.dataset import PackedDataset
from shardlm.sft.packing import PackedRows
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank, assert_trained_but_off
from layouts import layout, layout_config, layout_context, spawn_layouts, tiny_model
from multiproc import check_result

SEQ, STEPS, TOL, BATCH = 32, 2, 1e-5, 4
LEARN_STEPS = 3
"""The references' steps for `test_reference_trains` (a loss curve): STEPS, then one more."""
V4 = {"head_dim": 16, "num_kv_heads": 1, "q_lora_rank": 16, "qk_rope_head_dim": 4, "sliding_window": 5,
      "attention_sinks": True, "global_rope_theta": 1000.0, "hc_mult": 2, "compress_ratios": [8, 4, 0, 8],
      "output_groups": 2, "output_rank": 8, "index_topk": 3, "index_heads": 4, "index_head_dim": 8,
      "moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "ffn_hidden_size": 16,
      "moe_shared_experts": 1, "moe_score": "sqrtsoftplus", "moe_expert_bias": True, "moe_routed_scaling": 1.5,
      "moe_hash_layers": 1, "swiglu_clip": 0.5, "init_std": 0.05, "index_loss_coeff": 1.0}

ADAM_EPS = 1e-4
"""AdamW's epsilon (the layout tests' 1e-6 elsewhere), as `test_olmo3_layouts` says why: the hyper-connections'
bases get gradients near 1e-6 in places (the Sinkhorn-normalized comb's), where AdamW's g / (|g| + eps) turns a
layout's other summation order into a whole step; at 1e-6 the bases end 1e-5 to 4e-5 off one process."""


def rows(seed: int, samples: int, seq: int = SEQ) -> TokenArrayDataset:
    """A learnable stream of `test_training.VOCAB` tokens (each a fixed function of the one before, 10% noise) as
    rows of `seq` tokens."""
    rng = np.random.default_rng(seed)
    successor, tokens = rng.permutation(VOCAB), [0]
    for noise, noisy in zip(rng.random(4000), rng.integers(0, VOCAB, 4000)):
        tokens.append(noisy if noise < 0.1 else successor[tokens[-1]])
    return TokenArrayDataset(np.asarray(tokens), seq, seed=3, num_samples=samples)


DEPTH = {"mtp_layers": 1, "compress_ratios": V4["compress_ratios"] + [8]}
"""The packed runs' multi-token prediction: one depth, an HCA layer (a ratio of its own after the layers')."""


def v4_config(micro: int = 2, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False, lora: int = 0,
              mtp: bool = True, **train):
    """The layouts' config; `mtp`: with the multi-token-prediction depth (`DEPTH`)."""
    model = tiny_model("llama", SEQ, **(V4 | DEPTH if mtp else V4))
    config = layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp,
                           **{"steps": LEARN_STEPS, "global_batch_size": BATCH, "eval_iters": 16, "adam_eps": ADAM_EPS,
                              **train})
    config.lora.rank, config.lora.alpha, config.lora.targets = lora, 8.0, ["q_b", "o_a", "o_b", "gate", "up", "down"]
    return config


def with_hash_table(trainer: Trainer) -> None:
    """The hash layer's table: a random choice of 2 experts per token, the same on every rank."""
    generator = torch.Generator().manual_seed(4)
    table = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(VOCAB)]).float()
    for name, param in trainer.model.named_parameters():
        if name.endswith("tid2eid"):
            param.data.copy_(table)


SEQ3 = 48
"""Rows for CP=3 (a multiple of 2 x 3)."""


def packed_rows_of_48() -> tuple:
    """`test_sft_layouts`' conversations packed into rows of SEQ3 tokens (training, validation)."""
    return (PackedDataset(PackedRows(conversations(1, 40), SEQ3, "bfd", seed=5)),
            PackedDataset(PackedRows(conversations(2, 16), SEQ3, "bfd", seed=None), epochs=1))


def train_v4(ctx: ParallelContext, config, packed: bool = True, steps: int = STEPS) -> dict:
    """Curve (loss, gradient norm) of STEPS steps, the validation loss and every parameter (all stages) after them,
    on the packed rows (or the plain ones; rows of 48 when the config's are); with `steps` > STEPS, "losses": the
    losses of all `steps` steps (the later ones trained after the rest was recorded)."""
    data = (train_data(), valid_data()) if packed else (rows(0, LEARN_STEPS * BATCH), rows(1, 16))
    if config.model.seq_length == SEQ3:
        data = packed_rows_of_48() if packed else (rows(0, LEARN_STEPS * BATCH, SEQ3), rows(1, 16, SEQ3))
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, *data)
    with_hash_table(trainer)
    start = {name: p for name, p in stage_parameters(trainer.model).items() if ".indexer." in name}
    metrics = [trainer.train_step() for _ in range(STEPS)]
    curve = [(m["loss"], m["grad_norm"]) for m in metrics]
    run = {"curve": curve, "valid": trainer.evaluate(), "params": stage_parameters(trainer.model)}
    run["indexer_kl"] = [m.get("indexer_kl") for m in metrics]
    run["mtp_loss"] = [m.get("mtp_loss") for m in metrics]
    run["indexer_moved"] = {name: (run["params"][name] - p).abs().max().item() for name, p in start.items()}
    if steps > STEPS:
        run["losses"] = [loss for loss, _ in curve] + [trainer.train_step()["loss"] for _ in range(steps - STEPS)]
    return run


@contextlib.contextmanager
def broken(control: str | None):
    """"unshared": the replicated weights used as they are, their gradients never summed over TP."""
    saved = compressed_attention.CompressedAttention.shared
    if control == "unshared":
        compressed_attention.CompressedAttention.shared = lambda self, param: param
    try:
        yield
    finally:
        compressed_attention.CompressedAttention.shared = saved


def run_layout(tp: int, pp: int, cp: int, ep: int, sp: bool = False, control: str | None = None,
               packed: bool = True, **train) -> dict:
    with broken(control):
        return train_v4(layout_context(tp, pp, cp, ep),
                        v4_config(tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, mtp=packed, **train), packed)


WORLD2 = {
    "tp2 sp": layout(tp=2, sp=True),
    "pp2": layout(pp=2, micro=1),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2": layout(ep=2),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
    "tp2 sp recompute": layout(tp=2, sp=True, recompute="full"),
    "tp2 sp plain": layout(tp=2, sp=True, packed=False),
    "cp2": layout(cp=2),
    "cp2 plain": layout(cp=2, packed=False),
}
CONTROLS = {"control tp2 sp unshared": layout(tp=2, sp=True, control="unshared")}


def run_rows_of_48(tp: int, pp: int, cp: int, ep: int, packed: bool = True, **train) -> dict:
    config = v4_config(tp=tp, pp=pp, cp=cp, ep=ep, micro=BATCH, **train)
    config.model.seq_length = SEQ3
    return train_v4(layout_context(tp, pp, cp, ep), config, packed)


WORLD4 = {"tp2 sp cp2": layout(tp=2, cp=2, sp=True), "tp2 sp cp2 plain": layout(tp=2, cp=2, sp=True, packed=False),
          "pp2 cp2 plain": layout(pp=2, cp=2, micro=1, packed=False)}
"""Four ranks: CP=2 inside TP=2 with SP (each TP rank projects its CP rank's tokens, gathered over SP first), on
packed rows and plain ones (entries and halos), and CP=2 across two pipeline stages."""


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.mark.parametrize("name", list(WORLD4))
def test_deepseek_v4_at_four_ranks_equals_one_process(world4, reference, name):
    assert_every_rank(world4, name, reference[kind_of(name)], steps=STEPS, tol=TOL)


@pytest.fixture(scope="module")
def world3():
    return spawn_layouts(3, run_rows_of_48, {"cp3": layout(cp=3), "cp3 plain": layout(cp=3, packed=False)})


@contextlib.contextmanager
def counting_gathers(model):
    """{layer: [all-gathers, elements they return]} of `compressed_context`'s CP gathers in the block, by the layer
    whose attention ran them."""
    from shardlm.models import compressed_context

    current, gathered = [None], {int(i): [0, 0] for i in model.layers}
    hooks = [layer.attn.register_forward_pre_hook(lambda _m, _a, i=int(i): current.__setitem__(0, i))
             for i, layer in model.layers.items()]
    gather = compressed_context.gather_from_sequence_parallel

    def counted(tensor, group):
        out = gather(tensor, group)
        gathered[current[0]][0] += 1
        gathered[current[0]][1] += out.numel()
        return out

    compressed_context.gather_from_sequence_parallel = counted
    try:
        yield gathered
    finally:
        compressed_context.gather_from_sequence_parallel = gather
        for hook in hooks:
            hook.remove()


def attention_saves(tp: int, cp: int, sp: bool, precision: str, recompute: bool, window: int = 0) -> dict:
    """One training forward of plain rows in `precision` ("fp32" or "bf16" autocast) on this rank: "saved", what each
    layer's attention keeps for the backward beyond its input, and "planned", the planner's `v4_attention_bytes` of
    the rank; "gathered", each layer's CP all-gathers (their count and the elements they return), and "planned
    gathers" (`context.compressed_gathers`, b rows). `recompute`: the core's CHUNK_ELEMENTS lowered so that it
    recomputes its chunks; `window`: the sliding window instead of V4's 5."""
    import types

    from test_plan_linear_attention import saved_by_layer

    from shardlm.data.zigzag import zigzag_split
    from shardlm.models import build_model, compressed_core
    from shardlm.plan.context import compressed_gathers
    from shardlm.plan.measure import autocast_context
    from shardlm.plan.memory import numeric_format
    from shardlm.plan.v4_activations import v4_attention_bytes

    ctx, cfg = layout_context(tp=tp, cp=cp), v4_config(tp=tp, cp=cp, sp=sp, mtp=False).model
    cfg.sliding_window = window or cfg.sliding_window
    model = build_model(cfg, ctx, seed=0, sequence_parallel=sp).train()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    tokens = zigzag_split(tokens, cp, ctx.cp_rank) if cp > 1 else tokens

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    chunk = compressed_core.CHUNK_ELEMENTS
    compressed_core.CHUNK_ELEMENTS = 256 if recompute else chunk
    try:
        with counting_gathers(model) as gathered:
            attention = types.SimpleNamespace(layers={i: layer.attn for i, layer in model.layers.items()},
                                              parameters=model.parameters)
            saved = saved_by_layer(attention, forward)
        rank_cfg, fmt = dataclasses.replace(cfg, seq_length=SEQ // cp), numeric_format(precision)
        layers = range(cfg.num_layers)
        planned = [v4_attention_bytes(rank_cfg, i, tp, 2, fmt, cp, ctx.cp_rank) for i in layers]
    finally:
        compressed_core.CHUNK_ELEMENTS = chunk
    x = 2 * rank_cfg.seq_length * cfg.hidden_size * fmt.matmul_bytes
    return {"saved": [saved[i] - x for i in layers], "planned": planned,
            "gathered": [tuple(gathered[i]) for i in layers],
            "planned gathers": [(n, 2 * elements) if cp > 1 else (0, 0)
                                for n, elements in (compressed_gathers(cfg, cp, i) for i in layers)]}


SAVES = {f"saves {name} {precision}{' recomputed' if recompute else ''}": (tp, cp, sp, precision, recompute, window)
         for name, (tp, cp, sp, window) in {"cp2": (1, 2, False, 0), "tp2 sp": (2, 1, True, 0),
                                            "cp2 window 12": (1, 2, False, 12)}.items()
         for precision in ("fp32", "bf16") for recompute in (False, True)}
"""The planner's attention bytes checked at CP=2 (each rank's zigzag queries; its chunks of 8 positions hold whole
windows, and the halos before them reach back 4 positions: the row's entries and the halos gathered; with a window of
12 they reach further: every position's key projections gathered) and at TP=2 with SP, in fp32 and under bf16
autocast, the core's scores kept and recomputed."""


def packed_gathers() -> dict:
    """One training forward of two packed rows at CP=2 on this rank: "gathered", each layer's CP all-gathers (count,
    elements returned); "expected", what `compressed_context.document_sources` says they are, counted here from the
    rows' documents: each of the 2 C chunks' last `document_halo` positions' key projections, and (compressing
    layers) every rank's entries padded to the largest count (a window's entry belongs to the rank holding its last
    position), D channels and the CSA indexer's D_i; "every position", the elements of the per-position path."""
    from shardlm.data.zigzag import zigzag_split
    from shardlm.models import build_model, compressed_context
    from shardlm.models.compressed_attention import compressed_kinds
    from shardlm.models.documents import Documents
    from shardlm.plan.deepseek_v4 import key_projection_width

    cp = 2
    ctx, cfg = layout_context(cp=cp), v4_config(cp=cp, mtp=False).model
    model = build_model(cfg, ctx, seed=0).train()
    data = train_data()
    positions = torch.from_numpy(np.stack([data[i]["position_ids"] for i in range(2)]))
    tokens = zigzag_split(torch.from_numpy(np.stack([data[i]["input_ids"] for i in range(2)])), cp, ctx.cp_rank)
    documents = Documents.from_positions(positions, cp, ctx.cp_rank)
    with counting_gathers(model) as gathered:
        model(tokens, tokens, documents=documents).mean().backward()
    expected, every = [], []
    for i, kind in enumerate(compressed_kinds(cfg)[:cfg.num_layers]):
        ratio, width = cfg.compress_ratios[i], key_projection_width(cfg, i)
        halo = compressed_context.document_halo(cfg.sliding_window, ratio, kind == "csa")
        count, elements = 1, 2 * 2 * cp * halo * width
        if ratio:
            owners = [[0] * cp for _ in range(2)]  # per row, rank: the entries it pools
            for b, row in enumerate(documents.offsets):
                for start, end in zip(row[:-1], row[1:]):
                    for w in range((end - start) // ratio):
                        chunk = (start + (w + 1) * ratio - 1) // (SEQ // (2 * cp))
                        owners[b][chunk if chunk < cp else 2 * cp - 1 - chunk] += 1
            most = max(1, max(max(row) for row in owners))
            entry = cfg.head_dim + (cfg.index_head_dim if kind == "csa" else 0)
            count, elements = 2, elements + 2 * cp * most * entry
        expected.append((count, elements))
        every.append(2 * SEQ * width)
    return {"gathered": [tuple(gathered[i]) for i in range(cfg.num_layers)], "expected": expected, "every": every}


def world2_more() -> dict:
    return {"packed gathers": packed_gathers} | {name: functools.partial(attention_saves, *case)
                                                 for name, case in SAVES.items()}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS, more=world2_more)


@pytest.mark.parametrize("name", list(SAVES))
def test_each_rank_saves_what_the_planner_counts(world2, name):
    """At CP=2 and at TP=2 with SP, each layer's attention keeps on each rank what `v4_attention_bytes` plans for
    that rank (the one-process kinds are `test_plan_deepseek_v4`'s), and gathers what `compressed_gathers` costs."""
    for rank, run in enumerate(check_result(world2, name)):
        assert run["saved"] == run["planned"], (rank, run)
        assert run["gathered"] == run["planned gathers"], (rank, run)


def test_packed_rows_under_cp_gather_halos_and_entries(world2):
    """At CP=2 on packed rows each layer gathers its chunks' halos and the documents' entries, as counted from the
    documents, a fraction of every position's key projections."""
    for rank, run in enumerate(check_result(world2, "packed gathers")):
        assert run["gathered"] == run["expected"], (rank, run)
        assert all(n < every for (_, n), every in zip(run["gathered"], run["every"])), (rank, run)


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    rows_of_48 = v4_config(micro=BATCH)
    rows_of_48.model.seq_length = SEQ3
    return {"packed": train_v4(ctx, v4_config(), steps=LEARN_STEPS),
            "plain": train_v4(ctx, v4_config(mtp=False), packed=False, steps=LEARN_STEPS),
            "lora": train_v4(ctx, v4_config(lora=4), steps=LEARN_STEPS), "rows of 48": train_v4(ctx, rows_of_48),
            "plain rows of 48": train_v4(ctx, rows_of_48, packed=False)}


def kind_of(name: str) -> str:
    return next((kind for kind in ("lora", "plain") if kind in name), "packed")


@pytest.mark.parametrize("name", list(WORLD2))
def test_deepseek_v4_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], steps=STEPS, tol=TOL)


@pytest.mark.parametrize("name", ["cp3", "cp3 plain"])
def test_deepseek_v4_at_context_parallel_three_equals_one_process(world3, reference, name):
    """CP=3 on rows of 48: each rank's two zigzag chunks of 8 put back in row order among six; the indexer trains
    as one process's does. Packed rows gather every position's key projections; plain rows each rank's entries and
    its chunks' halos (rank 1's chunks 1 and 4 follow chunks held by ranks 0 and 2)."""
    ref = reference["plain rows of 48" if name.endswith("plain") else "rows of 48"]
    for rank, value in enumerate(assert_every_rank(world3, name, ref, steps=STEPS, tol=TOL)):
        assert_indexer_trained(value, ref, f"{name} rank {rank}")


def assert_indexer_trained(run: dict, ref: dict, where: str, lora: bool = False) -> None:
    """The CSA indexer's loss ran: "indexer_kl" logged at every step, within TOL of the reference's, and every
    indexer parameter moved; under LoRA it stays frozen (no loss, nothing moved)."""
    assert run["indexer_moved"], f"{where}: no indexer parameters"
    if lora:
        assert run["indexer_kl"] == [None] * STEPS and max(run["indexer_moved"].values()) == 0, where
        return
    for step, (a, b) in enumerate(zip(run["indexer_kl"], ref["indexer_kl"])):
        assert a is not None and b > 0 and abs(a - b) <= TOL * b, f"{where} step {step + 1}: indexer_kl {a} vs {b}"
    assert min(run["indexer_moved"].values()) > 0, f"{where}: {run['indexer_moved']}"


@pytest.mark.parametrize("name", list(WORLD2))
def test_the_indexer_trains_at_every_layout(world2, reference, name):
    """Every case trains the CSA indexer by its loss as one process does (the logged KL), and its parameters move
    (their values are compared with the rest's); the LoRA case keeps it frozen."""
    for rank, value in enumerate(check_result(world2, name)):
        assert_indexer_trained(value, reference[kind_of(name)], f"{name} rank {rank}", lora="lora" in name)


@pytest.mark.parametrize("name", list(WORLD2))
def test_the_depth_trains_at_every_layout(world2, reference, name):
    """The packed cases train the multi-token-prediction depth: its loss logged at every step within TOL of one
    process's (its parameters are compared with the rest's); the plain ones have none."""
    ref = reference[kind_of(name)]["mtp_loss"]
    for rank, value in enumerate(check_result(world2, name)):
        if "plain" in name:
            assert value["mtp_loss"] == ref == [None] * STEPS
            continue
        assert any(key.startswith("mtp.0.block.") for key in value["params"]), f"{name} rank {rank}"
        for step, (a, b) in enumerate(zip(value["mtp_loss"], ref)):
            assert a is not None and b > 0 and abs(a - b) <= TOL * b, f"{name} rank {rank} step {step + 1}: {a} vs {b}"


@pytest.mark.parametrize("kind", ["packed", "plain", "lora"])
def test_reference_trains(reference, kind):
    """The references learn over LEARN_STEPS steps (so the layouts have a signal to go wrong with; the adapters more
    slowly)."""
    losses = reference[kind]["losses"]
    assert len(losses) == LEARN_STEPS
    assert losses[-1] < losses[0] - (0.02 if kind == "lora" else 0.05), losses


def test_replicated_gradients_not_summed_over_tp_end_far_off(world2, reference):
    for value in check_result(world2, "control tp2 sp unshared"):
        assert_trained_but_off(value["curve"], value["params"], reference["packed"]["params"], STEPS, ".attn.")
