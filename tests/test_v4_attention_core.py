"""DeepSeek-V4's attention core by chunks of queries (`shardlm.models.compressed_core.attend`) against its dense
definition (`dense_attention`: every position's score, those a query may not see at -inf, as transformers'
DeepseekV4Attention computes it): a sliding layer, an HCA layer and a CSA layer (each query's chosen entries, some
-1; scored densely or gathered), at contiguous positions and at a context-parallel rank's two zigzag runs, with
chunks cut small (recomputed in the backward), or of the window's length (kept). Outputs,
the entries' probability mass handed to the indexer, and the gradients of q, the keys, the entries and the sinks
agree within 2e-6 (fp32; the same softmax over fewer exactly-0 terms). The backward of several chunks keeps only
the core's inputs (the dense definition's scores grow with the square of the length), and under autocast the core
runs as the definition does within bf16's rounding. The whole model against transformers is
`test_hf_deepseek_v4`'s; every layout `test_deepseek_v4_layouts`'.
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_plan_deepseek_v4 import _saved

from shardlm.models import compressed_core
from shardlm.models.compressed_core import attend, query_runs

B, H, D, WINDOW, RATIO, TOPK = 2, 4, 16, 8, 4, 3


def dense_attention(q, kv, positions, sinks, window, scale, entries=None, ratio=0, chosen=None):
    """The definition over every key position and entry: (y (B, H, T, D), probabilities (B, H, T, S + W))."""
    S = kv.shape[1]
    distance = positions.view(-1, 1) - torch.arange(S).view(1, -1)
    hidden = (distance < 0) | (distance >= window)
    keys = kv
    if entries is not None:
        W = entries.shape[1]
        if chosen is None:
            unseen = torch.arange(W).view(1, -1) >= ((positions + 1) // ratio).view(-1, 1)
            unseen = unseen.expand(kv.shape[0], -1, -1)
        else:
            seen = torch.zeros(kv.shape[0], len(positions), W + 1, dtype=torch.bool).scatter_(
                -1, torch.where(chosen >= 0, chosen, W), True)[..., :W]
            unseen = ~seen
        hidden = torch.cat((hidden.expand(kv.shape[0], -1, -1), unseen), dim=-1)
        keys = torch.cat((kv, entries), dim=1)
    scores = torch.matmul(q, keys.unsqueeze(1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(hidden.unsqueeze(1) if hidden.dim() == 3 else hidden, float("-inf"))
    logits = torch.cat((scores, sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)), dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.matmul(probs, keys.unsqueeze(1)), probs


def inputs(S: int, kind: str, positions: torch.Tensor, seed: int = 0) -> dict:
    """Random q (B, H, T, D), keys (B, S, D), sinks, and for "hca" / "csa" entries (B, S / RATIO, D) (with "csa" each
    query's TOPK chosen complete entries, -1 where fewer are complete); every float requires grad."""
    g = torch.Generator().manual_seed(seed)
    T = len(positions)
    args = {"q": torch.randn(B, H, T, D, generator=g), "kv": torch.randn(B, S, D, generator=g),
            "sinks": torch.randn(H, generator=g)}
    if kind != "sliding":
        args["entries"] = torch.randn(B, S // RATIO, D, generator=g)
    for value in args.values():
        value.requires_grad_()
    args |= {"positions": positions, "ratio": RATIO if kind != "sliding" else 0, "chosen": None}
    if kind == "csa":
        complete = (positions + 1) // RATIO  # entries complete for each query
        ranked = torch.rand(B, T, S // RATIO, generator=g).argsort(-1)[..., :TOPK]
        args["chosen"] = torch.where(ranked < complete.view(1, -1, 1), ranked, -1)
    return args


def run(fn, args: dict):
    return fn(args["q"], args["kv"], args["positions"], args["sinks"], WINDOW, D ** -0.5, args.get("entries"),
              args["ratio"], args["chosen"])


def zigzag(S: int) -> torch.Tensor:
    """A CP rank's query positions at CP 2 (chunks 0 and 3 of four): two runs."""
    quarter = S // 4
    return torch.cat((torch.arange(quarter), torch.arange(3 * quarter, S)))


@pytest.mark.parametrize("kind", ["hca", "csa gathered"])
def test_groups_of_one_query_chunks_equal_the_dense_definition(kind, monkeypatch):
    """One row, chunks of a single query run two to a product (a layer whose heads and entries leave room for one
    query a chunk, as an HCA layer over millions of tokens): the group's queries are then a strided view of q, not a
    copy, which the entries' product reshapes (a view of it failed)."""
    monkeypatch.setattr(sys.modules[__name__], "B", 1)
    S, gathered = 24, kind == "csa gathered"
    others = TOPK if gathered else S // RATIO
    monkeypatch.setattr(compressed_core, "MIN_CHUNK", 1)
    monkeypatch.setattr(compressed_core, "GROUP_FROM", 1)
    monkeypatch.setattr(compressed_core, "CHUNK_ELEMENTS", 2 * H * (WINDOW + others))  # step 1, 2 a group
    if gathered:
        monkeypatch.setattr(compressed_core, "DENSE_SPAN", 0)
    args = inputs(S, kind.split()[0], torch.arange(S))
    y, _ = run(attend, args)
    ref, _ = run(dense_attention, args)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    names = [name for name in ("q", "kv", "sinks", "entries") if name in args]
    for name, a, b in zip(names, torch.autograd.grad(y.sum(), [args[n] for n in names]),
                          torch.autograd.grad(ref.sum(), [args[n] for n in names])):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa", "csa gathered"])
@pytest.mark.parametrize("where", ["row", "zigzag", "kept", "groups", "zigzag groups"])
def test_chunked_core_equals_the_dense_definition(kind, where, monkeypatch):
    """Chunks of 1 to 3 queries, recomputed in the backward (the first sees no entry yet), chunks of the window's
    length in one product a run, whose scores the layer keeps ("kept"), or in products of 3 chunks, recomputed
    ("groups"), forward and backward; a CSA chunk scores its few complete entries
    densely, the unchosen masked, or gathers each query's chosen ones ("csa gathered": `DENSE_SPAN` 0)."""
    S = 48
    positions = zigzag(S) if where.startswith("zigzag") else torch.arange(S)
    seen = WINDOW + (0 if kind == "sliding" else TOPK if kind.startswith("csa") else S // RATIO)
    if where == "kept":  # chunks of the window's 8 queries, all of a run in one product
        monkeypatch.setattr(compressed_core, "MIN_CHUNK", 1)
        monkeypatch.setattr(compressed_core, "GROUP_FROM", 1)
    elif where.endswith("groups"):  # chunks of 8 in products of 3 chunks, recomputed (a run's remainder apart)
        monkeypatch.setattr(compressed_core, "MIN_CHUNK", 1)
        monkeypatch.setattr(compressed_core, "GROUP_FROM", 1)
        monkeypatch.setattr(compressed_core, "CHUNK_ELEMENTS", B * H * WINDOW * (WINDOW + seen) * 3)
        groups = compressed_core.chunk_groups(positions, WINDOW, 3)
        if where == "groups":
            assert any(end - start == 3 * WINDOW for start, end, _ in groups)
        else:  # runs of 12: a chunk of 8 and a remainder of 4 each
            assert [size for _, _, size in groups] == [8, 4, 8, 4]
    else:
        monkeypatch.setattr(compressed_core, "CHUNK_ELEMENTS", B * H * seen * 3)  # the first sees no entry
        assert len(query_runs(positions, 3)) >= 8
    if kind == "csa gathered":
        monkeypatch.setattr(compressed_core, "DENSE_SPAN", 0)
    kind = kind.split()[0]
    args = inputs(S, kind, positions)
    y, mass = run(attend, args)
    ref, probs = run(dense_attention, args)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    if kind == "csa":
        chosen = args["chosen"]
        on_chosen = probs[..., S:].sum(1).gather(-1, chosen.clamp_min(0))
        assert (chosen >= 0).any() and (chosen < 0).any()
        torch.testing.assert_close(mass, on_chosen.masked_fill(chosen < 0, 0), rtol=0, atol=1e-6)
    else:
        assert mass is None
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    names = [name for name in ("q", "kv", "sinks", "entries") if name in args]
    mine = torch.autograd.grad((y * g).sum(), [args[n] for n in names])
    theirs = torch.autograd.grad((ref * g).sum(), [args[n] for n in names])
    for name, a, b in zip(names, mine, theirs):
        assert b.abs().max() > 1e-3, name  # every input takes part
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)


def saved_bytes(fn, args: dict) -> int:
    """Bytes autograd keeps for the backward of `fn` (each storage once, the inputs' not:
    `test_plan_deepseek_v4._saved`)."""
    return _saved(lambda: run(fn, args), [t for t in args.values() if isinstance(t, torch.Tensor)])


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_the_backward_keeps_only_the_inputs(kind, monkeypatch):
    """A layer of several chunks recomputes each in the backward: the chunked core keeps nothing but references to
    its inputs (q, the keys, the entries, the sinks, the choice), at 256 positions as at 512, where the dense
    definition keeps its (T, S + W) scores and probabilities, about 4 times as many bytes at twice the length. A
    layer of fewer scores than `CHUNK_ELEMENTS` keeps them: fewer bytes than the definition's."""
    dense = {S: saved_bytes(dense_attention, inputs(S, kind, torch.arange(S))) for S in (256, 512)}
    assert dense[512] > 3.5 * dense[256] > 0
    kept = saved_bytes(attend, inputs(256, kind, torch.arange(256)))
    assert 0 < kept < dense[256] / 2
    monkeypatch.setattr(compressed_core, "CHUNK_ELEMENTS", 1 << 12)  # chunks of 6 to 32 queries
    for S in (256, 512):
        assert saved_bytes(attend, inputs(S, kind, torch.arange(S))) == 0


def test_under_autocast_it_runs_as_the_definition():
    """bf16 autocast (the CPU's): the chunked core's output within bf16's rounding of the definition's."""
    S = 64
    args = inputs(S, "csa", torch.arange(S))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = run(attend, args)
        ref, _ = run(dense_attention, args)
    torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=3e-2)
