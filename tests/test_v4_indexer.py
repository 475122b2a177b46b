"""DeepSeek-V4's CSA indexer trains by its own loss (`shardlm.models.compressed_attention`, the module docstring):
per query, KL(target || softmax of the index scores over the query's chosen entries), the target the main
attention's probabilities on those entries summed over the heads and scaled to sum to 1.

- the formula by hand on two queries (one with two chosen entries and an incomplete one, one with none), and its
  gradient (softmax minus target on the chosen entries, 0 elsewhere);
- the layer's recorded divergence equals the same sum computed by hand, query by query, from the attention's
  probabilities by the dense definition (`test_v4_attention_core.dense_attention`) and the indexer's scores of a
  real forward (the wiring: which probabilities, which tokens);
- the model learns from the language-model loss only: with the coefficient its logits and every other parameter's
  gradient equal those with coefficient 0 exactly, and the indexer has a nonzero gradient only with it (with 0 it
  is frozen, as before);
- by chunks of a few queries the choice, the divergence and the indexer's gradients are the whole rows'.
The layouts (TP, SP, CP, PP, DP, FSDP, EP, LoRA, recompute) are `test_deepseek_v4_layouts`'.
"""

from __future__ import annotations

import math

import torch
from test_deepseek_v4_layouts import SEQ, v4_config
from test_training import VOCAB
from test_v4_attention_core import dense_attention

import shardlm.models.compressed_attention as layer
from shardlm.models import build_model
from shardlm.models.compressed_attention import CompressedAttention, entry_target
from shardlm.models.sparse_attention import masked_divergence
from shardlm.parallel import ParallelContext

INF = float("inf")


def kl(target: list[float], logits: list[float]) -> float:
    """KL(target || softmax(logits)) in plain floats, 0 log 0 = 0."""
    top = max(logits)
    log_z = top + math.log(sum(math.exp(v - top) for v in logits))
    return sum(t * (math.log(t) - (v - log_z)) for t, v in zip(target, logits) if t > 0)


def test_the_divergence_by_hand():
    """Query 0 chose entries 2 and 0 and one not complete (-1); query 1 none. Two heads' probabilities on 4 entries
    (the rest of their mass on the window keys and the sink)."""
    probs = torch.tensor([[[[0.10, 0.20, 0.05, 0.00], [0.0] * 4],
                           [[0.30, 0.00, 0.10, 0.00], [0.0] * 4]]])  # (B 1, heads 2, T 2, W 4)
    chosen = torch.tensor([[[2, 0, -1], [-1, -1, -1]]])
    scores = torch.tensor([[[1.0, 3.0, 2.0, -INF], [0.5, -INF, -INF, -INF]]], requires_grad=True)
    mass = probs.sum(1).gather(-1, chosen.clamp_min(0))  # what the attention hands over: (B, T, k)
    target = entry_target(mass, chosen, ParallelContext.single().tp)
    mass = [0.05 + 0.10, 0.10 + 0.30]  # entry 2's and entry 0's, summed over the heads
    by_hand = [mass[0] / sum(mass), mass[1] / sum(mass)]
    torch.testing.assert_close(target, torch.tensor([[[by_hand[0], by_hand[1], 0.0], [0.0, 0.0, 0.0]]]))
    value = masked_divergence(target, scores.gather(-1, chosen.clamp_min(0)), chosen >= 0)  # what each chunk sums
    expected = kl(by_hand, [2.0, 1.0])  # the scores of entries 2 and 0
    assert expected > 0.1 and abs(value.item() - expected) < 1e-6, (value.item(), expected)
    value.backward()
    q = [math.exp(2.0) / (math.exp(2.0) + math.exp(1.0)), math.exp(1.0) / (math.exp(2.0) + math.exp(1.0))]
    grad = torch.zeros(1, 2, 4)
    grad[0, 0, 2], grad[0, 0, 0] = q[0] - by_hand[0], q[1] - by_hand[1]
    torch.testing.assert_close(scores.grad, grad)  # finite everywhere, 0 for query 1 and entries not chosen


def model(coeff: float):
    """The layout tests' V4 model (its CSA layer is layer 1) with `model.index_loss_coeff` = coeff, training."""
    config = v4_config(mtp=False)
    config.model.index_loss_coeff = coeff
    return build_model(config.model, ParallelContext.single(), seed=3).train()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def test_the_recorded_divergence_is_the_hand_computed_sum():
    """One training forward on plain rows: the CSA indexer records sum over queries of the KL from its own scores
    and the attention's probabilities on the entries, over B T tokens; here recomputed query by query in floats."""
    net = model(1.0)
    attention = net.layers["1"].attn
    assert isinstance(attention, CompressedAttention) and attention.indexer is not None
    seen = {}
    indexer = attention.indexer
    indexer.register_forward_hook(lambda module, args, out: seen.update(
        chosen=out[0], scores=indexer.scores(*args).detach()))  # every entry's, from the same inputs
    attend = layer.attend

    def recording_attend(*args):
        if args[8] is not None:  # the CSA layer's call (it passes its choice; one process: one piece of keys)
            (start, keys), = args[1]
            assert start == 0
            seen["probs"] = dense_attention(args[0], keys, *args[2:])[1].detach()  # the definition's, every position
        return attend(*args)

    layer.attend = recording_attend
    try:
        tokens, targets = batch()
        net(tokens, targets).mean().backward()
    finally:
        layer.attend = attend
    chosen, scores = seen["chosen"], seen["scores"].detach()
    entries = seen["probs"][..., SEQ:]  # (B, heads, T, W): after the T window keys
    B, T, _ = chosen.shape
    total, queries = 0.0, 0
    for b in range(B):
        for t in range(T):
            picked = [int(w) for w in chosen[b, t] if w >= 0]
            if not picked:
                continue
            mass = [entries[b, :, t, w].sum().item() for w in picked]
            total += kl([m / sum(mass) for m in mass], [scores[b, t, w].item() for w in picked])
            queries += 1
    assert queries > T and total > 0
    recorded = attention.indexer.recorded[-1].item()
    assert abs(recorded - total / (B * T)) <= 1e-5 * total / (B * T), (recorded, total / (B * T))


def test_the_model_learns_from_the_language_model_loss_only():
    """The same weights with index_loss_coeff 1 and 0: the same logits and the same gradients of every parameter
    but the indexer's, bit for bit; the indexer's gradient nonzero with the coefficient, and frozen without it."""
    runs = {}
    for coeff in (1.0, 0.0):
        net = model(coeff)
        tokens, targets = batch()
        with torch.no_grad():
            logits = net(tokens)
        net(tokens, targets).mean().backward()
        runs[coeff] = logits, dict(net.named_parameters())
    (logits, trained), (plain_logits, plain) = runs[1.0], runs[0.0]
    assert torch.equal(logits, plain_logits)
    indexer = [name for name in trained if ".indexer." in name]
    assert len(indexer) == 6, indexer
    for name in indexer:
        assert trained[name].grad is not None and trained[name].grad.abs().max() > 0, name
        assert not plain[name].requires_grad and plain[name].grad is None, name
    for name, param in trained.items():
        if name not in indexer and param.grad is not None:
            assert torch.equal(param.grad, plain[name].grad), name
    assert sum(param.grad is not None for name, param in trained.items() if name not in indexer) > 20


def test_a_dense_warm_up_stage_is_refused_in_one_line():
    """V4 has no dense warm-up (DeepSeek-V3.2's `index_stage = "warmup"` would freeze all but the indexers)."""
    import dataclasses

    from shardlm.models.deepseek_v4 import check_deepseek_v4

    m = v4_config(mtp=False).model
    assert check_deepseek_v4(m) is None
    message = check_deepseek_v4(dataclasses.replace(m, index_stage="warmup"))
    assert "index_stage" in message and "\n" not in message


def test_the_indexer_by_chunks_of_queries_equals_it_at_once(monkeypatch):
    """The choice and the loss run by chunks of queries (`sparse_attention.query_step`): chunks of a few queries give
    the same choice, the same recorded divergence and the same indexer gradients as the whole rows at once."""
    from shardlm.models import sparse_attention

    runs = []
    for elements in (sparse_attention.CHUNK_ELEMENTS, 64):
        monkeypatch.setattr(sparse_attention, "CHUNK_ELEMENTS", elements)
        net = model(1.0)
        indexer = net.layers["1"].attn.indexer
        seen = []
        indexer.register_forward_hook(lambda module, args, out, seen=seen: seen.append(out[0]))
        tokens, targets = batch()
        net(tokens, targets).mean().backward()
        runs.append((seen[0], indexer.recorded[-1], {n: p.grad for n, p in indexer.named_parameters()}))
    (chosen, kl, grads), (chunked, chunked_kl, chunked_grads) = runs
    assert sparse_attention.query_step(2, chosen.shape[-1], indexer.heads, indexer.dim) < SEQ // 4  # several chunks
    assert torch.equal(chosen, chunked) and (chosen >= 0).any()
    torch.testing.assert_close(chunked_kl, kl, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
