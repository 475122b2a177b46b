"""Nemotron-H's hybrid (Mamba-2, attention without positions, ReLU^2 MLP, one mixer a block) trains on packed SFT rows
at every layout as one process does (fp32, within 1e-5: losses, gradient norms, the validation loss and every final
parameter on every rank; `test_sft_layouts`' data, rows of 32 tokens, documents of 4-24 tokens crossing the
micro-batches and the scan's chunks of 8 tokens).

- world 2: TP=2 with SP (heads, groups and the convolution's channels split), PP=2 x 2 virtual stages, CP=2 (each
  rank's two zigzag chunks scanned at once, their (decay, end state) summaries and the convolution's last inputs
  handed over), DP=2 with the distributed optimizer (ZeRO-1), FSDP, Nemotron 3's MoE layer ("M*ME": ReLU^2
  experts in groups, sigmoid scores, a shared expert) at EP=2 and at FSDP x EP=2 (the expert stacks their own
  FSDP unit over expert-DP), and TP=2 with SP with LoRA adapters (the Mamba and
  attention outputs, v and the MLP) and with Muon (each whole matrix orthogonalized; the convolution's taps,
  A_log, dt_bias, D and the norms go to AdamW);
- controls at CP=2, each of which must train and end off: the state hand-over dropped (each chunk starts from
  zero), and the convolution reset at the chunk edge (its earlier inputs not read);
- world 3: CP=3 on rows of 48 tokens packed from the same conversations (six zigzag chunks of 8, rank r holding
  chunks r and 5 - r; documents cross every inner chunk edge, which a test of the data checks) against one
  process on the same rows, and its control, the hand-over dropped, which must end off;
- world 4: CP=2 x TP=2 with SP, and the MoE ("M*ME") at FSDP x EP=2 over DP=4 (the experts sharded over an
  expert-DP group of 2);
- one process: the packed forward and its gradients equal the documents run one by one, unpacked, and differ
  without the documents (the control); selective and full recomputation give the loss and gradients of none;
- bad settings are one-line errors.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_moe_parallel import stage_parameters
from test_sft_layouts import STEPS, TOL, conversations, sft_config, train_data, train_layout

from shardlm.errors import UserError
from shardlm.models import build_model, mamba
from shardlm.models.documents import Documents
from shardlm.parallel import ParallelContext
from shardlm.sft.dataset import PackedDataset
from shardlm.sft.packing import PackedRows
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank, assert_trained_but_off
from layouts import counting, layout, layout_context, spawn_layouts
from multiproc import check_result

NEMOTRON_H = {"arch": "llama", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 48, "layer_pattern": "M*M-", "mamba_num_heads": 4, "mamba_head_dim": 8,
              "mamba_state_size": 8, "mamba_groups": 2, "mamba_conv_kernel": 4, "mamba_chunk_size": 8,
              "init_std": 0.1}


NEMOTRON_MOE = {"layer_pattern": "M*ME", "moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16,
                "moe_shared_experts": 1, "moe_shared_ffn_hidden_size": 24, "moe_score": "sigmoid",
                "moe_expert_bias": True, "moe_groups": 2, "moe_topk_groups": 1, "moe_routed_scaling": 2.5}
"""Nemotron 3's MoE layer at the tests' size: 4 ReLU^2 experts in 2 groups, sigmoid scores, a shared expert."""


def nemotron_config(lora: int = 0, moe: bool = False, **kwargs):
    config = sft_config("llama", **kwargs)
    config.lora.rank, config.lora.targets = lora, ["v", "o", "out", "up", "down"]
    for key, value in (NEMOTRON_H | (NEMOTRON_MOE if moe else {})).items():
        setattr(config.model, key, value)
    return config


@contextlib.contextmanager
def broken(control: str | None):
    """"hand-over": each CP chunk's outputs and end state ignore the state before it; "conv edge": each chunk's
    convolution reads zeros instead of the previous chunk's last inputs."""
    carry, conv = mamba.carry, mamba.conv_silu
    if control == "hand-over":
        mamba.carry = lambda state, decay, local: torch.zeros_like(local)
    if control == "conv edge":
        mamba.conv_silu = lambda x, weight, bias=None, earlier=None, valid=None: conv(x, weight, bias, None, valid)
    try:
        yield
    finally:
        mamba.carry, mamba.conv_silu = carry, conv


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, **config) -> dict:
    with broken(control):
        return train_layout(layout_context(tp, pp, cp, ep), nemotron_config(tp=tp, pp=pp, cp=cp, ep=ep, **config))


SEQ3 = 48
"""Rows for CP=3: a multiple of 2 x 3, six CP chunks of 8 tokens (each one scan chunk), documents crossing them."""


def rows_of_48(valid: bool = False) -> PackedDataset:
    """The file's conversations packed into rows of SEQ3 tokens (training rows, or the held-out validation rows)."""
    if valid:
        return PackedDataset(PackedRows(conversations(2, 16), SEQ3, "bfd", seed=None), epochs=1)
    return PackedDataset(PackedRows(conversations(1, 40), SEQ3, "bfd", seed=5))


def train_rows_of_48(ctx: ParallelContext, config) -> dict:
    """`train_layout` on rows of SEQ3 tokens packed from the same conversations."""
    config.model.seq_length = SEQ3
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, rows_of_48(), rows_of_48(valid=True))
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    return {"curve": curve, "valid": trainer.evaluate(), "params": stage_parameters(trainer.model)}


def run_rows_of_48(tp: int, pp: int, cp: int, ep: int, control: str | None = None, **config) -> dict:
    with broken(control):
        return train_rows_of_48(layout_context(tp, pp, cp, ep),
                                nemotron_config(tp=tp, pp=pp, cp=cp, ep=ep, **config))


WORLD2 = {
    "tp2 sp": layout(tp=2, sp=True),
    "pp2 virtual2": layout(pp=2, virtual=2, micro=1),
    "cp2": layout(cp=2),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2 moe": layout(ep=2, moe=True),
    "fsdp ep2 moe": layout(ep=2, moe=True, data_sharding="full"),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
    "tp2 sp muon": layout(tp=2, sp=True, optimizer="muon", muon_ns_dtype="fp32"),
}
CONTROLS = {"control cp2 hand-over": layout(cp=2, control="hand-over"),
            "control cp2 conv edge": layout(cp=2, control="conv edge")}
WORLD3 = {"cp3": layout(cp=3, micro=8), "control cp3 hand-over": layout(cp=3, micro=8, control="hand-over")}
WORLD4 = {"cp2 tp2 sp": layout(cp=2, tp=2, sp=True),
          "fsdp ep2 dp4 moe": layout(ep=2, moe=True, data_sharding="full")}


@pytest.fixture(scope="module")
def world3():
    return spawn_layouts(3, run_rows_of_48, WORLD3)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS)


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, nemotron_config(micro=8)),
            "lora": train_layout(ctx, nemotron_config(micro=8, lora=4)),
            "moe": train_layout(ctx, nemotron_config(moe=True)),
            "muon": train_layout(ctx, nemotron_config(micro=8, optimizer="muon", muon_ns_dtype="fp32")),
            "rows of 48": train_rows_of_48(ctx, nemotron_config(micro=8))}


def kind_of(name: str) -> str:
    return next((kind for kind in ("lora", "moe", "muon") if kind in name), "dense")


@pytest.mark.parametrize("name", list(WORLD2))
def test_nemotron_h_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], steps=STEPS, tol=TOL)


@pytest.mark.parametrize("name", list(WORLD4))
def test_nemotron_h_at_four_ranks_equals_one_process(world4, reference, name):
    """CP=2 x TP=2 with SP (each TP rank's heads and groups scanned over both CP chunks); the MoE at FSDP x EP=2
    over DP=4 (2 experts a rank, their stacks sharded over the expert-DP group of 2, the rest over all 4)."""
    assert_every_rank(world4, name, reference[kind_of(name)], steps=STEPS, tol=TOL)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_context_parallel_controls_fail(world2, reference, name):
    """Without the state hand-over, or with the convolution reset at each chunk's edge, CP=2 trains to finite
    losses and ends more than 1e-3 away from one process (the Mamba layers' weights included), its losses more
    than 10 x the tolerance away."""
    ref = reference["dense"]
    for value in check_result(world2, name):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], STEPS, ".mixer.")
        assert max(abs(loss - r) / r for (loss, _), (r, _) in zip(value["curve"], ref["curve"])) > 10 * TOL


def test_rows_of_48_hold_documents_across_the_context_parallel_three_chunk_edges():
    """The CP=3 case's data: each of the 5 inner edges of the 6 chunks of 8 tokens has, in some row, a document
    running across it (the hand-over and the convolution's earlier inputs are read)."""
    positions = np.stack([rows_of_48()[i]["position_ids"] for i in range(8)])
    crossed = [edge for edge in range(8, SEQ3, 8) if (positions[:, edge] != 0).any()]
    assert crossed == list(range(8, SEQ3, 8)), crossed


def test_nemotron_h_at_context_parallel_three_equals_one_process(world3, reference):
    """CP=3 (zigzag chunks 0 and 5, 1 and 4, 2 and 3 on the three ranks; the summaries of six chunks combined in
    sequence order) equals one process on the same rows of 48."""
    assert_every_rank(world3, "cp3", reference["rows of 48"], steps=STEPS, tol=TOL)


def test_context_parallel_three_without_the_hand_over_fails(world3, reference):
    ref = reference["rows of 48"]
    for value in check_result(world3, "control cp3 hand-over"):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], STEPS, ".mixer.")
        assert max(abs(loss - r) / r for (loss, _), (r, _) in zip(value["curve"], ref["curve"])) > 10 * TOL


def packed_and_unpacked(documents: bool = True, recompute: str = "none") -> tuple[dict, dict]:
    """(loss, gradients) of 4 packed SFT rows in one forward, and of their documents one by one unpacked, both the
    sum of trained-token losses over their count."""
    model = build_model(nemotron_config().model, ParallelContext.single(), seed=3, recompute=recompute).train()
    batch = [train_data()[i] for i in range(4)]
    inputs, labels, positions = (torch.from_numpy(np.stack([r[k] for r in batch]))
                                 for k in ("input_ids", "labels", "position_ids"))
    count = (labels != -100).sum()
    packed = model(inputs, labels, documents=Documents.from_positions(positions) if documents else None).sum() / count
    packed_grads = torch.autograd.grad(packed, list(model.parameters()))
    total = 0.0
    for b, offsets in enumerate(Documents.from_positions(positions).offsets):
        for start, end in zip(offsets, offsets[1:]):
            total = total + model(inputs[b:b + 1, start:end], labels[b:b + 1, start:end]).sum()
    unpacked = total / count
    unpacked_grads = torch.autograd.grad(unpacked, list(model.parameters()))
    names = [n for n, _ in model.named_parameters()]
    return ({"loss": packed.item(), **dict(zip(names, packed_grads))},
            {"loss": unpacked.item(), **dict(zip(names, unpacked_grads))})


def test_packed_rows_equal_documents_one_by_one_and_not_without_the_resets():
    packed, unpacked = packed_and_unpacked()
    assert abs(packed["loss"] - unpacked["loss"]) <= TOL * unpacked["loss"]
    for name in packed:
        if name != "loss":
            assert (packed[name] - unpacked[name]).abs().max() <= TOL * max(unpacked[name].abs().max(), 1e-3), name
    across, _ = packed_and_unpacked(documents=False)
    assert abs(across["loss"] - unpacked["loss"]) > 10 * TOL * unpacked["loss"]
    assert (across["layers.0.mixer.conv_x"] - unpacked["layers.0.mixer.conv_x"]).abs().max() > 1e-4


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_loss_and_gradients_of_none(recompute, monkeypatch):
    """Bitwise the loss and gradients of none; the rerun happened: each Mamba-2 core ran twice as often."""
    from shardlm.models.mamba import Mamba2

    calls = {"core": 0}
    monkeypatch.setattr(Mamba2, "core", counting(Mamba2.core, calls, "core"))
    plain, _ = packed_and_unpacked()
    once, calls["core"] = calls["core"], 0
    again, _ = packed_and_unpacked(recompute=recompute)
    assert once > 0 and calls["core"] == 2 * once, (once, calls)
    assert all(torch.equal(torch.as_tensor(plain[k]), torch.as_tensor(again[k])) for k in plain)


@pytest.mark.parametrize("change, message", [
    ({"parallel": {"context": 16}}, "fewer than the convolution's 3 earlier inputs"),
    ({"parallel": {"tensor": 4}}, "mamba_groups=2 must divide by parallel.tensor=4"),
    ({"model": {"layer_pattern": "M*E-"}}, "MoE layers"),
    ({"model": {"layer_pattern": "M*M"}}, "has 3 layers"),
    ({"model": {"mamba_groups": 3}}, "not a multiple"),
])
def test_bad_settings_are_one_line_errors(change, message):
    from shardlm.models.mamba import check_mamba

    cfg = nemotron_config().model
    for key, value in change.get("model", {}).items():
        setattr(cfg, key, value)
    parallel = {"tensor": 1, "context": 1} | change.get("parallel", {})
    problem = check_mamba(cfg, parallel["tensor"], parallel["context"])
    assert problem is not None and message in problem and "\n" not in problem
    if not change.get("parallel"):
        with pytest.raises(UserError, match=message.split("=")[0]):
            build_model(cfg, ParallelContext.single())
