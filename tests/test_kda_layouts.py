"""The Kimi Linear model (KDA and MLA without positions, `test_kda.KIMI`) trains on packed SFT rows at every layout
as one process does (fp32, within 1e-5: losses, gradient norms and the validation loss; every final parameter on
every rank within `agreement.LINEAR_ATTENTION_PARAMS_TOL`, after 2 steps of 4 rows, 8 with LoRA; `test_sft_layouts`'
data: documents cross the micro-batches, rows hold several documents).

One world of 2: CP=2 (each rank's two zigzag chunks run at once, documents crossing them; their state summaries
P S_in + S_local and convolution inputs handed over), TP=2 with SP (heads, the convolution's channels, A_log and
dt_bias split; f_a, g_a and the gated norm replicated), PP=2 x 2 virtual stages, DP=2 with the distributed optimizer
(ZeRO-1), FSDP, the MoE variant (sigmoid routing, score-correction bias, a shared expert) at EP=2, and TP=2 with SP
with LoRA adapters (o of both kinds of layer, MLA's kv_b, the MLP; `validate` takes an MLA model's projections to
have no k or v) and with Muon (each whole matrix orthogonalized; f_a, g_a, the convolution, A_log and dt_bias on
AdamW). Controls at CP=2, each of which must train and end off: the state hand-over dropped (each chunk
starts from zero), and the convolution reset at the chunk edge (its earlier inputs not read).

One world of 3: CP=3 on rows of 48 tokens packed from the same conversations (six zigzag chunks of 8, rank r
holding chunks r and 5 - r; documents cross every inner chunk edge; six summaries combined in sequence order)
against one process on the same rows, and its control, the hand-over dropped, which must end off.

One world of 4: CP=2 x TP=2 with SP, and the MoE variant at FSDP x EP=2 over DP=4 (the experts sharded over an
expert-DP group of 2; one row a rank, so against one process at micro-batch 1).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_kda import KIMI, KIMI_MOE
from test_mamba_layouts import SEQ3, rows_of_48
from test_moe_parallel import stage_parameters
from test_sft_layouts import TOL, sft_config, train_data, valid_data

from shardlm.models import linear_attention
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import LINEAR_ATTENTION_PARAMS_TOL, assert_every_rank, assert_trained_but_off
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result

STEPS, BATCH, LORA_BATCH = 2, 4, 8
"""2 steps of 4 rows; the LoRA runs of 8: their B matrices start at zero, and after 2 steps on 4 rows (at TP=2 with
SP) one ends 4.5e-5 off one process by `agreement.trained_rel` (elements whose gradients nearly cancel), on 8 rows
5e-6."""


def kimi_sft_config(moe: bool = False, lora: int = 0, **kwargs):
    batch = LORA_BATCH if lora else BATCH
    config = sft_config("llama", moe=moe, **{"steps": STEPS, "global_batch_size": batch, **kwargs})
    config.lora.rank, config.lora.targets = lora, ["o", "kv_b", "gate", "up", "down"]
    config.model.num_kv_heads = 0
    for key, value in (KIMI | (KIMI_MOE if moe else {})).items():
        if key != "num_layers" or not moe:
            setattr(config.model, key, value)
    if moe:  # 2 layers: a dense KDA layer, then an MoE MLA layer
        config.model.layer_types = ["linear_attention", "full_attention"]
    return config


def train_layout(ctx: ParallelContext, config, rows: int = 32) -> dict:
    """Curve (loss, gradient norm) of STEPS steps, the validation loss and every final parameter (all stages), on
    rows of 32 tokens or (`rows` = SEQ3, for CP=3) of 48 packed from the same conversations."""
    config.model.seq_length = rows
    validate(config, ctx.world_size, check_paths=False)
    data = (train_data(), valid_data()) if rows != SEQ3 else (rows_of_48(), rows_of_48(valid=True))
    trainer = Trainer(config, ctx, *data)
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    return {"curve": curve, "valid": trainer.evaluate(), "params": stage_parameters(trainer.model)}


@contextlib.contextmanager
def broken(control: str | None):
    """"hand-over": each CP chunk's outputs and end state ignore the state before it; "conv edge": each chunk's
    convolution reads zeros instead of the previous chunk's last inputs."""
    carry, conv = linear_attention.carry, linear_attention.causal_conv  # the hand-over: linear_attention's
    if control == "hand-over":
        linear_attention.carry = lambda state, transition, local: torch.zeros_like(local)
    if control == "conv edge":
        linear_attention.causal_conv = lambda x, weight, earlier=None, valid=None: conv(x, weight, None, valid)
    try:
        yield
    finally:
        linear_attention.carry, linear_attention.causal_conv = carry, conv


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, rows: int = 32, **config) -> dict:
    with broken(control):
        return train_layout(layout_context(tp, pp, cp, ep), kimi_sft_config(tp=tp, pp=pp, cp=cp, ep=ep, **config),
                            rows)


WORLD2 = {
    "cp2": layout(cp=2),
    "tp2 sp": layout(tp=2, sp=True),
    "pp2 virtual2": layout(pp=2, virtual=2, micro=1),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2 moe": layout(ep=2, moe=True),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
    "tp2 sp muon": layout(tp=2, sp=True, optimizer="muon", muon_ns_dtype="fp32"),
}
CONTROLS = {"control cp2 hand-over": layout(cp=2, control="hand-over"),
            "control cp2 conv edge": layout(cp=2, control="conv edge")}
WORLD3 = {"cp3": layout(cp=3, micro=BATCH, rows=SEQ3),
          "control cp3 hand-over": layout(cp=3, micro=BATCH, rows=SEQ3, control="hand-over")}
WORLD4 = {"cp2 tp2 sp": layout(cp=2, tp=2, sp=True),
          "fsdp ep2 dp4 moe micro1": layout(ep=2, moe=True, micro=1, data_sharding="full")}


@pytest.fixture(scope="module")
def world3():
    return spawn_layouts(3, run_layout, WORLD3)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS)


@pytest.fixture(scope="module")
def reference():
    """One process: the dense model at micro-batch BATCH (with LoRA LORA_BATCH: one per step); the MoE at the
    layouts' micro-batch 2, and at 1 for DP=4 (its load-balancing statistics are per micro-batch)."""
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, kimi_sft_config(micro=BATCH)),
            "moe": train_layout(ctx, kimi_sft_config(moe=True)),
            "moe micro1": train_layout(ctx, kimi_sft_config(moe=True, micro=1)),
            "lora": train_layout(ctx, kimi_sft_config(micro=LORA_BATCH, lora=4)),
            "muon": train_layout(ctx, kimi_sft_config(micro=BATCH, optimizer="muon", muon_ns_dtype="fp32")),
            "rows of 48": train_layout(ctx, kimi_sft_config(micro=BATCH), rows=SEQ3)}


def kind_of(name: str) -> str:
    return next((kind for kind in ("moe micro1", "moe", "lora", "muon") if kind in name), "dense")


@pytest.mark.parametrize("name", list(WORLD2))
def test_kimi_linear_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], steps=STEPS, tol=TOL,
                      params_tol=LINEAR_ATTENTION_PARAMS_TOL)


@pytest.mark.parametrize("name", list(WORLD4))
def test_kimi_linear_at_four_ranks_equals_one_process(world4, reference, name):
    """CP=2 x TP=2 with SP (each TP rank's heads over both CP chunks, their summaries handed over); the MoE at
    FSDP x EP=2 over DP=4 (2 experts a rank, their stacks sharded over the expert-DP group of 2)."""
    assert_every_rank(world4, name, reference[kind_of(name)], steps=STEPS, tol=TOL,
                      params_tol=LINEAR_ATTENTION_PARAMS_TOL)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_context_parallel_controls_fail(world2, reference, name):
    """Without the state hand-over (P S_in + S_local), or with the convolution reset at each chunk's edge, CP=2
    trains to finite losses and ends more than 1e-3 away from one process, its losses more than 10 x the tolerance
    away."""
    ref = reference["dense"]
    for value in check_result(world2, name):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], STEPS, ".attn.")
        assert max(abs(loss - r) / r for (loss, _), (r, _) in zip(value["curve"], ref["curve"])) > 10 * TOL


def test_kimi_linear_at_context_parallel_three_equals_one_process(world3, reference):
    """CP=3 on rows of 48 (six chunks of 8 tokens, documents crossing each inner edge: zigzag chunks 0 and 5, 1 and
    4, 2 and 3 on the three ranks, six summaries combined in sequence order) equals one process on the same rows."""
    assert_every_rank(world3, "cp3", reference["rows of 48"], steps=STEPS, tol=TOL)


def test_context_parallel_three_without_the_hand_over_fails(world3, reference):
    ref = reference["rows of 48"]
    for value in check_result(world3, "control cp3 hand-over"):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], STEPS, ".attn.")
        assert max(abs(loss - r) / r for (loss, _), (r, _) in zip(value["curve"], ref["curve"])) > 10 * TOL
