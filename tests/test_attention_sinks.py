"""Attention sinks and sliding windows (gpt-oss) equal their definition, on one rank in tiles and over the ring.

The definition (`reference`, fp64): scores q k^T * scale, masked causally, to the last `window` positions
(transformers' `kv_idx > q_idx - sliding_window`) and to the query's document, then one more logit per head,
the sink, joins every row's softmax and its share is dropped. `tiled_attention` (one rank) and
`context_parallel_attention` (C = 2 on ranks 0, 2 and 1, 3, C = 4 on a gloo world of 4, ring and all-gather)
give its output and the gradients of q, k, v and the sinks within 5e-6 (fp32 against fp64; the inputs are scaled
up so the softmax is sharp) (relative to the largest entry), with
grouped-query attention, windows shorter and longer than a chunk, chunks longer than the window's tile (the ring
then runs the blocks the window cuts tile by tile), and packed documents. Without the sink
merge, or with the window left out, the same comparisons fail (so they can). The window's saving is
counted, not assumed: the blocks each rank computes are exactly those with a visible (query, key) pair, and
their number falls with the window.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_context_parallel import cp_group, gather, randn, rel

from shardlm.data.zigzag import zigzag_chunks, zigzag_split
from shardlm.parallel.ring_attention import BlockCounts, context_parallel_attention, window_tile
from shardlm.parallel.tiled_attention import tiled_attention

from multiproc import check_result, run_checks, run_workers

TOL = 5e-6
B, HEADS, KV_HEADS, HEAD_DIM, SCALE = 2, 4, 2, 8, 0.4


def segments_of(T: int) -> torch.Tensor:
    """Two rows of packed documents: row 0 cut at 5 and 13, row 1 at 9."""
    segments = torch.zeros(B, T, dtype=torch.long)
    segments[0, 5:], segments[0, 13:] = 1, 2
    segments[1, 9:] = 1
    return segments


def visible(T: int, window: int, segments: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, 1, T, T) bool: causal, within the window, within the document."""
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    mask = (distance >= 0) & ((distance < window) if window else True)
    mask = mask.view(1, 1, T, T)
    return mask if segments is None else mask & (segments[:, None, :, None] == segments[:, None, None, :])


def reference(q, k, v, sinks, dout, window=0, segments=None):
    """fp64 output and gradients (q, k, v, sinks) of the definition, rounded to fp32."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-2, -1) * SCALE
    scores = scores.masked_fill(~visible(q.shape[2], window, segments), float("-inf"))
    if sinks is not None:
        sinks = sinks.double().requires_grad_()
        leaves.append(sinks)
        scores = torch.cat((scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), dim=-1)
    probs = scores.softmax(-1)
    out = (probs[..., :-1] if sinks is not None else probs) @ v.repeat_interleave(group, 1)
    return [t.float() for t in (out.detach(), *torch.autograd.grad(out, leaves, dout.double()))]


def inputs(T: int, seed: int, with_sinks: bool = True):
    q = randn(B, HEADS, T, HEAD_DIM, seed=seed) * 2
    k, v = randn(B, KV_HEADS, T, HEAD_DIM, seed=seed + 1) * 2, randn(B, KV_HEADS, T, HEAD_DIM, seed=seed + 2)
    sinks = randn(HEADS, seed=seed + 3) * 2 if with_sinks else None
    return q, k, v, sinks, randn(B, HEADS, T, HEAD_DIM, seed=seed + 4)


def worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(rel(a, b) for a, b in zip(got, want))


# --------------------------------------------------------------------------------------------------
# one rank: tiles

CASES = [dict(window=w, docs=d, sinks=s) for w, d, s in itertools.product((0, 3, 7, 40), (False, True), (False, True))
         if w or s]


def tiled(q, k, v, sinks, dout, window, segments, tile=0, counts=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None
                                                                else [])
    out = tiled_attention(*leaves[:3], scale=SCALE, window=window, sinks=leaves[3] if sinks is not None else None,
                          segments=segments, tile=tile, counts=counts)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("tile", [0, 4, 5])
def test_tiles_equal_the_definition(case, tile):
    T = 18
    q, k, v, sinks, dout = inputs(T, seed=3, with_sinks=case["sinks"])
    segments = segments_of(T) if case["docs"] else None
    want = reference(q, k, v, sinks, dout, case["window"], segments)
    assert worst(tiled(q, k, v, sinks, dout, case["window"], segments, tile), want) < TOL


def test_without_the_sink_or_the_window_the_comparison_fails():
    T = 18
    q, k, v, sinks, dout = inputs(T, seed=5)
    want = reference(q, k, v, sinks, dout, window=3)
    assert worst(tiled(q, k, v, None, dout, 3, None), want[:4]) > 1e-2
    assert worst(tiled(q, k, v, sinks, dout, 0, None), want) > 1e-2


def test_tiles_outside_the_window_are_skipped():
    """T = 64 in tiles of 8 with a window of 8: each query tile runs its own tile and the one before (15 blocks
    of 36 in the causal triangle, 21 skipped), with or without documents cutting more."""
    T, window, tile = 64, 8, 8
    q, k, v, sinks, dout = inputs(T, seed=7)
    counts = BlockCounts()
    got = tiled(q, k, v, sinks, dout, window, None, tile, counts)
    assert (counts.computed["forward"], counts.skipped["forward"]) == (15, 21)
    assert counts.computed["backward"] == 15
    assert worst(got, reference(q, k, v, sinks, dout, window)) < TOL


# --------------------------------------------------------------------------------------------------
# the ring, on a world of 4

def ring_case(C: int, window: int, docs: bool, exchange: str, chunk: int = 5):
    cp = cp_group(C)
    T = 2 * C * chunk
    q, k, v, sinks, dout = inputs(T, seed=11 + C + window)
    segments = segments_of(T) if docs else None
    local = [zigzag_split(t, C, cp.rank, dim=2).requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_()
    counts = BlockCounts()
    out = context_parallel_attention(*local, cp, scale=SCALE, exchange=exchange, counts=counts, segments=segments,
                                     window=window, sinks=local_sinks)
    grads = torch.autograd.grad(out, [*local, local_sinks], zigzag_split(dout, C, cp.rank, dim=2))
    dsinks = grads[3].clone()
    torch.distributed.all_reduce(dsinks, group=cp.group)  # each rank's rows' share
    got = [gather(t, cp) for t in (out.detach(), *grads[:3])] + [dsinks]
    error = worst(got, reference(q, k, v, sinks, dout, window, segments))
    # the blocks with a visible pair, from the mask itself
    mask = visible(T, window, segments).any(0)[0]
    expected = sum(bool(mask[qc * chunk:(qc + 1) * chunk, kc * chunk:(kc + 1) * chunk].any())
                   for source in range(C) for qc in zigzag_chunks(C, cp.rank) for kc in zigzag_chunks(C, source))
    return error, counts.computed["forward"], expected


def check_ring():
    out = {}
    for C, window, docs, exchange in itertools.product((2, 4), (0, 3, 7, 100), (False, True), ("ring", "allgather")):
        if cp_group(C) is not None:
            out[(C, window, docs, exchange)] = ring_case(C, window, docs, exchange)
    # chunks of 80 with a window of 20 (tiles of 64): the cut blocks run tile by tile
    assert window_tile(20, 80) == 64
    for C, docs in itertools.product((2, 4), (False, True)):
        if cp_group(C) is not None:
            out[(C, 20, docs, "ring", 80)] = ring_case(C, 20, docs, "ring", chunk=80)
    return out


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, run_checks, {"ring": check_ring}, timeout=300)


def test_ring_with_sinks_and_windows_equals_the_definition(world4):
    for rank_result in check_result(world4, "ring"):
        for case, (error, _, _) in rank_result.items():
            assert error < TOL, f"C, window, documents, exchange = {case}: relative error {error:.2e}"


def test_ring_computes_exactly_the_blocks_with_a_visible_pair(world4):
    for rank_result in check_result(world4, "ring"):
        for case, (_, computed, expected) in rank_result.items():
            assert computed == expected, case
        # a window of 3 in chunks of 5 at C = 4: fewer blocks than the causal ring's 2C + 1
        assert rank_result[(4, 3, False, "ring")][1] < rank_result[(4, 0, False, "ring")][1] == 9
