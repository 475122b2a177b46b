"""The hybrid linear-attention model (Gated DeltaNet and gated full attention, `test_linear_attention.HYBRID`) trains
on packed SFT rows at every layout as one process does (fp32, within 1e-5: losses, gradient norms, the validation
loss and every final parameter on every rank; `test_sft_layouts`' data, documents crossing the CP chunks and the
micro-batches).

- world 2: TP=2 with SP (heads and the convolution's channels split), PP=2 x 2 virtual stages, CP=2 (each
  rank's two zigzag chunks run at once; their state summaries and convolution inputs are handed over), DP=2 with
  the distributed optimizer (ZeRO-1), FSDP, the MoE variant (gated shared expert) at EP=2, and TP=2 with SP
  with LoRA adapters (v, o and the MLP of both kinds of layer) and with Muon (each whole matrix orthogonalized);
- world 4: CP=4, CP=2 x TP=2 with SP, CP=2 x EP=2 (MoE), TP=2 x DP=2 with ZeRO-1;
- controls at CP=2, each of which must train and end off: the state hand-over dropped (each chunk starts from
  zero), and the convolution reset at the chunk edge (its earlier inputs not read).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_linear_attention import HYBRID, HYBRID_MOE
from test_sft_layouts import TOL, sft_config, train_layout

from shardlm.models import linear_attention
from shardlm.parallel import ParallelContext

from agreement import assert_every_rank, assert_trained_but_off
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result

TRAINED = 2
"""The steps each run trains: the first 2 of `sft_config`'s 4-step schedule (AdamW's second step reads the moments
the first left; every bound holds with the AVX-512 and the AVX2 kernels)."""


def hybrid_sft_config(moe: bool = False, lora: int = 0, **kwargs):
    config = sft_config("llama", moe=moe, **kwargs)
    # adapters on v and o of both kinds of layer and on the MLP (q and k feed L2 or RMS norms, which cancel part of
    # their adapters' gradients to rounding noise: 1e-5 would then measure the kernels' summation order)
    config.lora.rank, config.lora.targets = lora, ["v", "o", "gate", "up", "down"]
    for key, value in (HYBRID | (HYBRID_MOE if moe else {})).items():
        if key != "num_layers" or not moe:
            setattr(config.model, key, value)
    if moe:  # 2 layers: one of each kind
        config.model.layer_types = ["linear_attention", "full_attention"]
    return config


@contextlib.contextmanager
def broken(control: str | None):
    """"hand-over": each CP chunk's outputs and end state ignore the state before it; "conv edge": each chunk's
    convolution reads zeros instead of the previous chunk's last inputs."""
    carry, conv = linear_attention.carry, linear_attention.causal_conv
    if control == "hand-over":  # every chunk's incoming state zero
        linear_attention.carry = lambda state, transition, local: torch.zeros_like(local)
    if control == "conv edge":
        linear_attention.causal_conv = lambda x, weight, earlier=None, valid=None: conv(x, weight, None, valid)
    try:
        yield
    finally:
        linear_attention.carry, linear_attention.causal_conv = carry, conv


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, **config) -> dict:
    with broken(control):
        return train_layout(layout_context(tp, pp, cp, ep), hybrid_sft_config(tp=tp, pp=pp, cp=cp, ep=ep, **config),
                            TRAINED)


WORLD2 = {
    "tp2 sp": layout(tp=2, sp=True),
    "pp2 virtual2": layout(pp=2, virtual=2, micro=1),
    "cp2": layout(cp=2),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2 moe": layout(ep=2, moe=True),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
    "tp2 sp muon": layout(tp=2, sp=True, optimizer="muon", muon_ns_dtype="fp32"),
}
CONTROLS = {"control cp2 hand-over": layout(cp=2, control="hand-over"),
            "control cp2 conv edge": layout(cp=2, control="conv edge")}
WORLD4 = {
    "cp4": layout(cp=4),
    "cp2 tp2 sp": layout(cp=2, tp=2, sp=True),
    "cp2 ep2 moe": layout(cp=2, ep=2, moe=True),
    "zero tp2 dp2 sp": layout(tp=2, sp=True, distributed_optimizer=True),
}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def reference():
    """One process: the dense hybrid at micro-batch 8; the MoE at the layouts' micro-batch 2 (its load-balancing
    loss is a function of each micro-batch's routing)."""
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, hybrid_sft_config(micro=8), TRAINED),
            "moe": train_layout(ctx, hybrid_sft_config(moe=True), TRAINED),
            "lora": train_layout(ctx, hybrid_sft_config(micro=8, lora=4), TRAINED),
            "muon": train_layout(ctx, hybrid_sft_config(micro=8, optimizer="muon", muon_ns_dtype="fp32"), TRAINED)}


def kind_of(name: str) -> str:
    return next((kind for kind in ("moe", "lora", "muon") if kind in name), "dense")


@pytest.mark.parametrize("name", list(WORLD2))
def test_hybrid_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], steps=TRAINED, tol=TOL)


@pytest.mark.parametrize("name", list(WORLD4))
def test_hybrid_at_four_ranks_equals_one_process(world4, reference, name):
    assert_every_rank(world4, name, reference[kind_of(name)], steps=TRAINED, tol=TOL)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_context_parallel_controls_fail(world2, reference, name):
    """Without the state hand-over, or with the convolution reset at each chunk's edge, CP=2 trains to finite
    losses and ends more than 1e-3 away from one process (the linear layers' weights included), its losses more
    than 10 x the tolerance away (only the documents that cross the chunk boundary are hit)."""
    ref = reference["dense"]
    for value in check_result(world2, name):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], TRAINED, ".attn.")
        assert max(abs(loss - r) / r for (loss, _), (r, _) in zip(value["curve"], ref["curve"])) > 10 * TOL
