"""QK-clip with DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a DSA layer's tracked maximum is each head's
largest logit over the keys each query chose, and the clip brings it to tau.

- One process (plain and packed rows, the indexer keeping 4 of up to 16 keys): each layer's tracked maxima equal a
  direct computation in float64 from the q, the latents and kv_b the sparse core received, in the expanded form
  (per-head keys q_nope . c W_UK^T + q_rope . k_rope, not the core's absorbed product), over each query's chosen
  valid keys only; some head's largest logit over every visible key is larger (the statistic is the sparse one).
  After `clip_qk` the same layer on the same input has each clipped head's maximum at tau and the others unchanged
  (the indexer reads the query latent, which the clip leaves alone, so the choice stays).
- At TP=2 with SP and at CP=2, 4 steps of Muon with QK-clip (tau low enough that heads clip every step) equal one
  process within 1e-5 (losses, gradient norms, every parameter by `agreement.trained_rel` at the run's learning
  rate 1e-2: the indexer's k_norm bias, near zero and trained by AdamW on the indexer's loss alone, ends 1.25e-5 of
  the reach of 3e-3, LR's, off one process on an AVX2-only EPYC; the step maxima within 5e-5).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from test_muon import STEPS, TOL
from test_qk_clip import MAX_LOGIT_TOL, OFFSETS, SEQ, TAU, clip_config, model_config, tokens, train

from shardlm.models import build_model
from shardlm.models import sparse_attention as dsa
from shardlm.models.documents import Documents, block_causal_mask
from shardlm.parallel import ParallelContext
from shardlm.training.qk_clip import attention_layers, clip_qk, track_max_logits

from agreement import CURVE, assert_every_rank
from layouts import layout, layout_context, spawn_layouts

DSA = {"index_topk": 4, "index_heads": 4, "index_head_dim": 8}


def with_dsa(model) -> None:
    for key, value in DSA.items():
        setattr(model, key, value)


def traced_forward(model, x: torch.Tensor, documents: Documents | None) -> dict:
    """One training forward with the maxima tracked; per attention layer its input and what its sparse core got."""
    seen, core, layers = {}, dsa.sparse_latent_attention, attention_layers(model)
    current = [0]

    def traced(q, keys, indices, valid, scale, latent_dim, absorption=None, host_rows=None):
        seen.setdefault(current[0], {})["core"] = (q.detach(), keys.detach(), indices, valid, absorption[0].detach())
        return core(q, keys, indices, valid, scale, latent_dim, absorption, host_rows)

    def entered(index: int, x: torch.Tensor) -> None:
        current[0] = index
        seen.setdefault(index, {})["x"] = x

    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, args, index=index: entered(index, args[0]))
    track_max_logits(model)
    model.train()
    with mock.patch.object(dsa, "sparse_latent_attention", traced):
        model(x, documents=documents)
    return seen


def direct_maxima(layer, q, keys, indices, valid, weight, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(H,) each head's largest logit over its queries' chosen valid keys, and over every visible key, float64."""
    q, keys, weight = q.double(), keys.double(), weight.double()
    r, nope = weight.shape[-1], layer.nope
    c, k_rope = keys[..., :r], keys[..., r:]
    k_nope = torch.einsum("bsr,hnr->bhsn", c, weight[:, :nope])  # each head's keys, expanded
    logits = (q[..., :nope] @ k_nope.transpose(-1, -2) + q[..., nope:] @ k_rope.transpose(-1, -2).unsqueeze(1))
    logits = logits * layer.scale  # (B, H, T, S)
    B, T, S = indices.shape[0], indices.shape[1], keys.shape[1]
    chosen = torch.zeros(B, T, S, dtype=torch.bool).scatter_(-1, indices.long(), valid)
    visible = block_causal_mask(OFFSETS, T)[:, 0] if packed else torch.ones(T, S, dtype=torch.bool).tril()
    visible = visible.expand(B, T, S)
    assert bool((chosen <= visible).all()) and int(chosen.sum()) < int(visible.sum())
    return (logits.masked_fill(~chosen.unsqueeze(1), float("-inf")).amax(dim=(0, 2, 3)),
            logits.masked_fill(~visible.unsqueeze(1), float("-inf")).amax(dim=(0, 2, 3)))


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_sparse_maxima_are_the_chosen_logits_maxima_and_the_clip_brings_them_to_tau(packed):
    ctx = ParallelContext.single()
    cfg = model_config("mla")
    with_dsa(cfg)
    model = build_model(cfg, ctx, seed=3)
    documents = Documents.from_offsets(OFFSETS, SEQ) if packed else None
    seen = traced_forward(model, tokens(), documents)
    layers = attention_layers(model)
    assert len(layers) == 2 and all(layer.indexer is not None for layer in layers)
    before, sparser = [], False
    for index, layer in enumerate(layers):
        chosen, every = direct_maxima(layer, *seen[index]["core"], packed)
        assert torch.allclose(layer.max_logits, chosen.float(), rtol=1e-5, atol=1e-6), (index, layer.max_logits,
                                                                                         chosen)
        sparser = sparser or bool((every > chosen + 1e-3).any())
        before.append(chosen.float())
    assert sparser, "every head's largest logit was among the chosen keys: the check cannot tell sparse from dense"
    tau = float(before[0].median())  # half the first layer's heads clip
    clip_qk(model, ctx, tau)
    for index, layer in enumerate(layers):
        layer(seen[index]["x"], None, documents)  # the same layer on the same input after the clip
        after, old = layer.max_logits, before[index]
        clipped = old > tau
        assert index > 0 or (clipped.any() and not clipped.all())
        assert torch.allclose(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5), (index, after, old)
        assert torch.allclose(after[~clipped], old[~clipped], rtol=1e-5), (index, after, old)


def test_a_padded_choice_does_not_count():
    """A query that sees fewer than k keys has its choice padded with keys marked not valid (`select_top_k`); a padded
    key whose logit is the largest by far is left out of the maximum, which equals a loop over the valid pairs."""
    from shardlm.models.max_logits import max_chosen_logits

    generator = torch.Generator().manual_seed(0)
    q, weight = torch.randn(1, 2, 3, 6, generator=generator), torch.randn(2, 4 + 3, 5, generator=generator)
    keys = torch.randn(1, 3, 5 + 2, generator=generator)
    keys[0, 2] *= 100  # key 2: logits far from the others', the largest for each head once the sign is right
    indices = torch.tensor([[[0, 1, 2], [0, 1, 2], [0, 1, 2]]])
    valid = torch.tensor([[[True, False, False], [True, True, False], [True, True, True]]])

    def logit(h: int, t: int, s: int, sign: float = 1.0) -> float:
        key = weight[h, :4].double() @ keys[0, s, :5].double()
        return 0.5 * sign * float(q[0, h, t, :4].double() @ key + q[0, h, t, 4:].double() @ keys[0, s, 5:].double())

    for h in range(2):  # query 0's logit with key 2 positive and the largest: only the mask keeps it out
        q[0, h, 0] *= 1.0 if logit(h, 0, 2) > 0 else -1.0
    q[0, :, 2] *= 1e-3  # query 2 sees key 2 too: make its logits small
    got = max_chosen_logits(q, weight, 4, keys, indices, valid, 0.5)
    want = [max(logit(h, t, s) for t in range(3) for s in range(3) if valid[0, t, s]) for h in range(2)]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5), (got, want)
    assert all(logit(h, 0, 2) > w for h, w in enumerate(want))  # the padded key would have been the maximum


def dsa_clip_config(tp: int = 1, cp: int = 1, micro: int = 2, sp: bool = False):
    config = clip_config("mla", tp=tp, cp=cp, micro=micro, sp=sp)
    with_dsa(config.model)
    return config


def run_layout(tp: int, pp: int, cp: int, ep: int, sp: bool = False, **keys) -> dict:
    return train(layout_context(tp, pp, cp, ep), dsa_clip_config(tp, cp, sp=sp, **keys))


WORLD2 = {"tp2 sp": layout(tp=2, sp=True), "cp2": layout(cp=2)}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2, timeout=300)


@pytest.fixture(scope="module")
def reference():
    return train(ParallelContext.single(), dsa_clip_config(micro=8))


def test_the_reference_clips_every_step(reference):
    assert all(step[2] > TAU for step in reference["curve"]), reference["curve"]  # a step's maximum, before its clip


@pytest.mark.parametrize("name", list(WORLD2))
def test_sparse_qk_clip_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference, steps=STEPS, tol=TOL, columns=CURVE + ("max logit",),
                      column_tols={"max logit": MAX_LOGIT_TOL}, lr=dsa_clip_config().train.lr)
