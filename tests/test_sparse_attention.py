"""DeepSeek Sparse Attention's pieces in one process (`shardlm.models.sparse_attention`), against definitions written
here: the choice of keys (ties, short rows, packed documents, chunks), the indexer's loss by hand, the separation of
the indexer's and the model's gradients, cached decoding, and sparse attention over every key equal to dense MLA."""

from __future__ import annotations

import math

import pytest
import torch
from test_mla_parallel import cached_and_full, mla_config
from test_training import VOCAB

from shardlm.errors import UserError
from shardlm.models import build_model, sparse_attention
from shardlm.models.documents import Documents
from shardlm.parallel import ParallelContext
from shardlm.validation import validate

DSA = {"q_lora_rank": 16, "index_topk": 3, "index_heads": 8, "index_head_dim": 8}


def dsa_model(seed: int = 3, **keys):
    cfg = mla_config(**(DSA | keys)).model
    cfg.vocab_size = VOCAB
    return build_model(cfg, ParallelContext.single(), seed=seed)


def test_ties_go_to_the_earlier_key_whatever_the_chunk():
    """Equal scores at the k-th place: the earlier keys are kept, in every chunking of the queries (torch.topk's order
    among equals is not defined); scores above the tie are always kept."""
    scores = torch.tensor([[[0.0, 2.0, 1.0, 1.0, 1.0, 1.0]] * 3])  # (1, 3, 6)
    visible = torch.ones(1, 3, 6, dtype=torch.bool)
    indices, valid = sparse_attention.select_top_k(scores, visible, 3)
    assert indices.tolist() == [[[1, 2, 3]] * 3] and bool(valid.all())
    one, _ = sparse_attention.select_top_k(scores[:, :1], visible[:, :1], 3)
    assert torch.equal(one, indices[:, :1])
    randn = torch.randn(2, 40, 50, generator=torch.Generator().manual_seed(0)).relu()  # about half tie at 0
    vis = torch.rand(2, 40, 50, generator=torch.Generator().manual_seed(1)) < 0.7
    whole = sparse_attention.select_top_k(randn, vis, 16)
    parts = [sparse_attention.select_top_k(randn[:, i:i + 7], vis[:, i:i + 7], 16) for i in range(0, 40, 7)]
    assert torch.equal(whole[0], torch.cat([p[0] for p in parts], 1))
    # the reference choice: sort by (score descending, key ascending) over the visible keys
    for b in range(2):
        for q in range(40):
            keys = [s for s in range(50) if vis[b, q, s]]
            best = sorted(keys, key=lambda s: (-float(randn[b, q, s]), s))[:16]
            chosen = [int(s) for s, ok in zip(whole[0][b, q], whole[1][b, q]) if ok]
            assert chosen == sorted(best)


def test_a_query_with_fewer_keys_keeps_them_all_and_documents_stay_apart():
    """Packed rows: every valid chosen key is at or before its query and in its document; a query with fewer than k
    visible keys keeps exactly those."""
    documents = Documents.from_offsets([[0, 5, 12], [0, 12]], 12)
    rows = torch.arange(12)
    visible = sparse_attention.visible_keys(rows, 12, documents)
    scores = torch.randn(2, 12, 12, generator=torch.Generator().manual_seed(2))
    indices, valid = sparse_attention.select_top_k(scores, visible, 4)
    segments = documents.segments
    for b in range(2):
        for q in range(12):
            keys = indices[b, q][valid[b, q]].tolist()
            own = [s for s in range(q + 1) if segments[b, s] == segments[b, q]]
            assert set(keys) <= set(own) and len(keys) == min(4, len(own))


def test_indexer_divergence_by_hand():
    """KL(p || softmax(I)) over each query's chosen keys, summed over queries, with
    I = sum_h w_h ReLU(q_h . k / sqrt(D)) (the weights already carry H^-1/2), against plain Python loops."""
    g = torch.Generator().manual_seed(4)
    B, T, H, D, k = 1, 3, 2, 4, 2
    q, w = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, generator=g)
    keys = torch.randn(B, T, D, generator=g)
    indices = torch.tensor([[[0, 0], [0, 1], [1, 2]]])
    valid = torch.tensor([[[True, False], [True, True], [True, True]]])
    target = torch.tensor([[[1.0, 0.0], [0.3, 0.7], [0.6, 0.4]]])
    got = sparse_attention.indexer_divergence(q, w, keys, lambda p: (indices[:, p], valid[:, p]),
                                              lambda p: target[:, p], k)
    expected = 0.0
    for t in range(T):
        kept = [j for j in range(k) if valid[0, t, j]]
        logit = {j: sum(float(w[0, t, h]) * max(0.0, float(q[0, t, h] @ keys[0, indices[0, t, j]]) / math.sqrt(D))
                        for h in range(H)) for j in kept}
        norm = math.log(sum(math.exp(v) for v in logit.values()))
        expected += sum(float(target[0, t, j]) * (math.log(float(target[0, t, j])) - (logit[j] - norm))
                        for j in kept if target[0, t, j] > 0)
    assert abs(float(got) - expected) < 1e-5 and expected > 0.05
    # the gradients taken chunk by chunk in the forward equal autograd's through the plain formula
    inputs = [t.clone().requires_grad_() for t in (q, w, keys)]
    chunked = torch.autograd.grad(sparse_attention.indexer_divergence(
        *inputs, lambda p: (indices[:, p], valid[:, p]), lambda p: target[:, p], k) * 3.0, inputs)
    plain = torch.autograd.grad(sparse_attention._divergence(*inputs, indices, valid, target) * 3.0, inputs)
    for a, b in zip(chunked, plain):
        assert torch.allclose(a, b, atol=1e-6) and b.abs().sum() > 0


def gradients(model, tokens) -> dict:
    model.zero_grad(set_to_none=True)
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_the_indexer_learns_from_its_loss_only_and_the_model_from_the_lm_loss_only():
    """With the indexer's loss on, the model's gradients equal those without it (no leak into the model), and without
    it the indexers get no gradient (the LM loss does not reach them); with it they do."""
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(5))
    with_loss = gradients(dsa_model().train(), tokens)
    without = gradients(dsa_model(index_loss_coeff=0.0).train(), tokens)
    indexer = [n for n in with_loss if ".indexer." in n]
    assert indexer and all(with_loss[n] is not None and with_loss[n].abs().sum() > 0 for n in indexer)
    assert all(without[n] is None for n in indexer)
    for name, grad in without.items():
        if ".indexer." not in name and grad is not None:
            assert torch.allclose(with_loss[name], grad, atol=1e-7, rtol=1e-6), name


def test_the_dense_warm_up_equals_the_sparse_stage_choosing_every_key():
    """With k >= T every visible key is chosen, so the sparse stage's divergence (its target from the sparse
    attention's probabilities) must equal the warm-up's (from the dense attention, chunk by chunk), and so must the
    indexers' gradients; the warm-up's is above 0 and its model output is dense MLA's."""
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(8))
    runs = {}
    for stage in ("sparse", "warmup"):
        model = dsa_model(index_topk=16, index_stage=stage).train()
        grads = gradients(model, tokens)
        kl = [float(layer.attn.indexer.recorded[-1]) for layer in model.layers.values()]
        runs[stage] = (kl, {n: g for n, g in grads.items() if ".indexer." in n})
    assert min(runs["warmup"][0]) > 1e-6  # (random weights: both distributions near uniform, the KL small)
    assert max(abs(a - b) / b for a, b in zip(runs["sparse"][0], runs["warmup"][0])) < 1e-4
    for name, grad in runs["warmup"][1].items():
        assert torch.allclose(runs["sparse"][1][name], grad, atol=1e-6, rtol=1e-4), name


def test_cached_decoding_equals_the_full_forward():
    """Prompt then token-by-token decoding through the cache (indexer keys cached beside MLA's latents) gives the
    full forward's logits within 1e-5; k = 3 of up to 12 keys, so the choice matters at every step."""
    model = dsa_model().eval()
    cached, full, cache = cached_and_full(model)
    assert (cached - full).abs().max() < 1e-5
    assert cache.layers[0].extras["index_keys"].shape[-1] == DSA["index_head_dim"]


def test_every_key_chosen_is_dense_mla_and_fewer_keys_differ():
    """index_topk >= T gives the model without an indexer (dense MLA, same weights) within 1e-5; k = 3 is far off."""
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    dense = dsa_model(index_topk=0, index_heads=0, index_head_dim=0).eval()
    state = {n: p for n, p in dense.state_dict().items()}
    outputs = {}
    for k in (16, 3):
        sparse = dsa_model(index_topk=k).eval()
        sparse.load_state_dict(state, strict=False)
        with torch.no_grad():
            outputs[k] = sparse.full_logits(sparse(tokens))
    with torch.no_grad():
        reference = dense.full_logits(dense(tokens))
    assert (outputs[16] - reference).abs().max() < 1e-5
    assert (outputs[3] - reference).abs().max() > 1e-2


def test_chunks_give_the_whole_computation(monkeypatch):
    """Queries in chunks of one (CHUNK_ELEMENTS tiny) give the same loss and gradients as one chunk."""
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))
    whole = gradients(dsa_model().train(), tokens)
    monkeypatch.setattr(sparse_attention, "CHUNK_ELEMENTS", 1)
    chunked = gradients(dsa_model().train(), tokens)
    for name, grad in whole.items():
        if grad is not None:
            assert torch.allclose(chunked[name], grad, atol=1e-6, rtol=1e-5), name


def test_a_chunk_bounds_its_gathered_keys_as_well_as_its_scores(monkeypatch):
    """MLA's chosen latents are wider (r + rope channels) than its heads: each chunk's gathered keys (B, Q, k, r + rope)
    stay within CHUNK_ELEMENTS, not only its scores (B, H, Q, k), and the chunks still give the whole computation."""
    B, H, T, k, width = 2, 2, 24, 3, 40
    generator = torch.Generator().manual_seed(5)
    query, keys = torch.randn(B, H, T, width, generator=generator), torch.randn(B, T, width, generator=generator)
    indices = torch.randint(0, T, (B, T, k), generator=generator)
    valid = torch.ones(B, T, k, dtype=torch.bool)
    whole = sparse_attention.sparse_latent_attention(query, keys, indices, valid, 0.1, 32)
    gathered = []
    original = sparse_attention.gather_keys
    monkeypatch.setattr(sparse_attention, "gather_keys", lambda *a: gathered.append(original(*a)) or gathered[-1])
    monkeypatch.setattr(sparse_attention, "CHUNK_ELEMENTS", B * k * width * 4)  # 4 queries' gathered keys
    chunked = sparse_attention.sparse_latent_attention(query, keys, indices, valid, 0.1, 32)
    assert len(gathered) == T // 4 and max(g.numel() for g in gathered) <= sparse_attention.CHUNK_ELEMENTS
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, chunked))


def _chosen_attention_inputs(B=2, H=3, T=40, k=5, nope=8, rope=4, r=12, v=6, seed=11):
    """MLA's rotated query, the row's latents and shared keys, kv_b's weight per head, and the indexer's choice over
    two packed documents (the second document's first queries see fewer than k keys: padding marked not valid)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H, T, nope + rope, generator=generator, requires_grad=True)
    keys = torch.randn(B, T, r + rope, generator=generator, requires_grad=True)
    weight = torch.randn(H, nope + v, r, generator=generator, requires_grad=True)
    documents = Documents.from_offsets([[0, 17, T], [0, T]], T)
    rows = torch.arange(T)
    scores = torch.randn(B, T, T, generator=generator)
    indices, valid = sparse_attention.select_top_k(scores, sparse_attention.visible_keys(rows, T, documents), k)
    assert not valid.all()
    return query, keys, weight, nope, indices.int(), valid, rows


def _attention_and_grads(query, keys, weight, nope, indices, valid, rows):
    out, mass = sparse_attention.sparse_latent_attention(query, keys, indices, valid, 0.3, keys.shape[-1] - 4,
                                                         absorption=(weight, nope), host_rows=rows)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    return out.detach(), mass, torch.autograd.grad(loss, (query, keys, weight))


def test_dense_chunks_attend_as_the_gathered_ones(monkeypatch):
    """A chunk that scores all its visible keys and masks the unchosen ones (`DENSE_SPAN`) gives the gathered route's
    output, heads' probabilities on the chosen keys (0 on padding) and gradients within 1e-5; with small chunks and a
    small span the row's early chunks go dense and its late ones gather, and the mixture agrees too."""
    inputs = _chosen_attention_inputs()
    routes = []
    original = sparse_attention._attend
    monkeypatch.setattr(sparse_attention, "_attend", lambda *a: routes.append(a[-1]) or original(*a))
    gathered = _attention_and_grads(*inputs[:-1], None)
    assert set(routes) == {False}  # (each chunk runs again in the backward)
    monkeypatch.setattr(sparse_attention, "DENSE_SPAN", 100)
    routes.clear()
    dense = _attention_and_grads(*inputs)
    assert set(routes) == {True}
    monkeypatch.setattr(sparse_attention, "DENSE_SPAN", 2)
    monkeypatch.setattr(sparse_attention, "CHUNK_ELEMENTS", 2 * 5 * 16 * 4)  # 4 queries' gathered keys
    routes.clear()
    mixed = _attention_and_grads(*inputs)
    assert True in routes and False in routes
    for got in (dense, mixed):
        assert torch.allclose(got[0], gathered[0], atol=1e-5)
        assert torch.allclose(got[1], gathered[1], atol=1e-6) and (got[1][~inputs[5]] == 0).all()
        for a, b in zip(got[2], gathered[2]):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys,message", [
    ({"attention": "mha", "index_topk": 4, "index_heads": 4, "index_head_dim": 8}, 'needs model.attention = "mla"'),
    ({**DSA, "index_layer_types": ["shared", "full"]}, "index_layer_types"),
    ({**DSA, "index_head_dim": 2}, "index_head_dim"),
    ({**DSA, "index_stage": "dense"}, "index_stage"),
    ({**DSA, "index_topk": 17}, "larger than the row"),
])
def test_bad_sparse_attention_keys_are_refused_in_one_line(keys, message):
    config = mla_config(**keys)
    if keys.get("attention") == "mha":
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            setattr(config.model, key, 0)
    with pytest.raises(UserError, match=message) as error:
        validate(config, 1, check_paths=False)
    assert "\n" not in str(error.value)


def test_the_shipped_config_is_valid():
    """configs/tiny-deepseek-v3.2.toml: DSA on the tiny DeepSeek-V3, valid at one process."""
    from pathlib import Path

    from shardlm.config import load_config

    config = load_config(Path(__file__).parent.parent / "configs" / "tiny-deepseek-v3.2.toml")
    assert config.model.index_topk == 16 and validate(config, 1, check_paths=False) == 2


def test_a_pipeline_stage_starting_on_a_shared_layer_is_refused():
    """GLM-5's shared layers reuse an earlier layer's choice, which must be on the same pipeline stage."""
    config = mla_config(pp=2, **DSA, num_layers=4, index_layer_types=["full", "full", "shared", "full"])
    with pytest.raises(UserError, match="layer 2 would reuse layer 1") as error:
        validate(config, 2, check_paths=False)
    assert "\n" not in str(error.value)
    config.model.index_layer_types = ["full", "shared", "full", "shared"]
    validate(config, 2, check_paths=False)
