"""Context parallelism's attention equals one process's causal attention: the zigzag split and the ring.

The split tests run in this process. The attention tests spawn one gloo world of 4 once and build CP
groups inside it: C = 4 (ranks 0-3), C = 3 (ranks 1-3: group ranks differ from global ranks) and
C = 2 (ranks 0, 2 and 1, 3: strided, as CP groups are when TP > 1). Every rank draws the same full
(B, heads, T, d) q, k, v and output gradient, takes its zigzag part, runs the ring, gathers the
results back in sequence order and compares them with `F.scaled_dot_product_attention` on the full
tensors (fp32 inputs; the reference computed in fp64; relative error of the largest entry).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.data.zigzag import check_context_parallel, zigzag_merge, zigzag_positions, zigzag_split
from shardlm.errors import UserError
from shardlm.parallel import invariant
from shardlm.parallel.comm import CommStats, Communicator
from shardlm.parallel.ring_attention import BlockCounts, context_parallel_attention

from multiproc import check_result as result
from multiproc import run_checks, run_workers

TOL = 1e-6
B, HEADS, CHUNK, HEAD_DIM = 2, 4, 3, 8
GROUPS = {4: [[0, 1, 2, 3]], 3: [[1, 2, 3]], 2: [[0, 2], [1, 3]]}
_CP: dict[int, Communicator | None] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cp_group(C: int) -> Communicator | None:
    """This rank's CP communicator of size C (None if it is in no such group); built once per world."""
    if not _CP:  # new_group is collective: every rank builds every group, in the same order
        for size, groups in GROUPS.items():
            _CP[size] = None
            for ranks in groups:
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    _CP[size] = Communicator("cp", group, size, ranks.index(dist.get_rank()), CommStats())
    return _CP[C]


def gather(local: torch.Tensor, cp: Communicator) -> torch.Tensor:
    """Every CP rank's zigzag part of a (B, heads, 2L, d) tensor -> the full (B, heads, T, d) tensor
    (not recorded in the communication statistics)."""
    parts = [torch.empty_like(local) for _ in range(cp.size)]
    dist.all_gather(parts, local.contiguous(), group=cp.group)
    return zigzag_merge(parts, dim=2)


def full_inputs(C: int, kv_heads: int, seed: int):
    T = 2 * C * CHUNK
    q = randn(B, HEADS, T, HEAD_DIM, seed=seed)
    k, v = randn(B, kv_heads, T, HEAD_DIM, seed=seed + 1), randn(B, kv_heads, T, HEAD_DIM, seed=seed + 2)
    return q, k, v, randn(B, HEADS, T, HEAD_DIM, seed=seed + 3)


def reference(q, k, v, dout):
    """One process: full causal attention of the same fp32 inputs and the gradients of q, k, v, computed
    in fp64 and rounded to fp32. (An fp32 reference has rounding errors of the ring's size, up to 6e-7
    of the largest gradient here, so the two could differ by more than either differs from the truth.)"""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return [t.float() for t in (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))]


def run_cp(cp: Communicator, q, k, v, dout, **kwargs):
    """This rank's zigzag part through `context_parallel_attention`, gathered back: (out, dq, dk, dv)."""
    C, r = cp.size, cp.rank
    local = [zigzag_split(t, C, r, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp, **kwargs)
    grads = torch.autograd.grad(out, local, zigzag_split(dout, C, r, dim=2))
    return [gather(t, cp) for t in (out.detach(), *grads)]


# --------------------------------------------------------------------------------------------------
# checks run inside the workers

def check_attention():
    """{label: relative error} of ring (and all-gather) attention against one process, per C, KV heads, kernel."""
    errors = {}
    for C in GROUPS:
        if (cp := cp_group(C)) is None:
            continue
        for kv_heads in (HEADS, 2):
            inputs = full_inputs(C, kv_heads, seed=10 * C + kv_heads)
            expected = reference(*inputs)
            for kernel in ("auto", "math"):
                ring = run_cp(cp, *inputs, kernel=kernel)
                gathered = run_cp(cp, *inputs, kernel=kernel, exchange="allgather")
                for name, a, b, want in zip(("out", "dq", "dk", "dv"), ring, gathered, expected):
                    errors[f"C={C} kv_heads={kv_heads} {kernel} ring {name}"] = rel(a, want)
                    errors[f"C={C} kv_heads={kv_heads} {kernel} allgather-vs-ring {name}"] = rel(b, a)
    return errors


def check_blocks():
    """{C: (CP rank, computed, skipped, computed pairs)} of one forward and backward, per pass."""
    out = {}
    for C in GROUPS:
        if (cp := cp_group(C)) is None:
            continue
        counts = BlockCounts()
        run_cp(cp, *full_inputs(C, 2, seed=1), counts=counts)
        out[C] = (cp.rank, dict(counts.computed), dict(counts.skipped), dict(counts.pairs))
    return out


def check_comm_bytes():
    """{(C, exchange, phase): (recorded {kind: (calls, bytes)}, the formula's)} on the CP group."""
    out = {}
    for C in GROUPS:
        if (cp := cp_group(C)) is None:
            continue
        q, k, v, dout = (zigzag_split(t, C, cp.rank, dim=2) for t in full_inputs(C, 2, seed=2))
        kv = 2 * k.numel() * 4  # this rank's K and V (2 KV heads, not the 4 query heads), fp32 bytes
        formulas = {
            "ring": ({"ring_kv": (C - 1, (C - 1) * kv)},  # forward: C-1 hops of this rank's K/V
                     {"ring_kv": (2 * (C - 1), 2 * (C - 1) * kv), "ring_dkv": (C - 1, (C - 1) * kv)}),
            "allgather": ({"all_gather": (1, kv)},
                          {"all_gather": (2, 2 * kv), "reduce_scatter": (1, C * kv)}),
        }
        for exchange, (forward, both) in formulas.items():
            for phase, want in (("forward", forward), ("forward+backward", both)):
                cp.stats.reset()
                local = [t.clone().requires_grad_() for t in (q, k, v)]
                y = context_parallel_attention(*local, cp, exchange=exchange)
                if phase != "forward":
                    y.backward(dout)
                got = {kind: (cp.stats.calls[(kind, "cp")], cp.stats.bytes[(kind, "cp")])
                       for (kind, group) in cp.stats.calls}
                out[(C, exchange, phase)] = (got, want)
    return out


def check_invariant():
    """{(C, documents): (output bitwise equal, relative error of dq, dk, dv)} of batch-invariant attention under CP
    against `invariant.attention` on the whole rows (2 KV heads; rows of 40 C tokens, more than two key tiles a
    chunk; documents: rows cut at positions that fall inside chunks and tiles, a one-token document among them)."""
    out = {}
    for C in GROUPS:
        if (cp := cp_group(C)) is None:
            continue
        T = 40 * C
        q, k, v, dout = (randn(B, h, T, HEAD_DIM, seed=7 * C + i) for i, h in enumerate((HEADS, 2, 2, HEADS)))
        for documents in (None, [[0, 37, 38, T - 5, T], [0, 17, T]]):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            want = invariant.attention(*full, scale=0.3, offsets=documents)
            want_grads = torch.autograd.grad(want, full, dout)
            local = [zigzag_split(t, C, cp.rank, dim=2).requires_grad_() for t in (q, k, v)]
            got = invariant.context_parallel_attention(*local, cp, scale=0.3, offsets=documents)
            grads = torch.autograd.grad(got, local, zigzag_split(dout, C, cp.rank, dim=2))
            got, *grads = (gather(t, cp) for t in (got.detach(), *grads))
            out[(C, documents is not None)] = (torch.equal(got, want.detach()),
                                               [rel(a, b) for a, b in zip(grads, want_grads)])
    return out


CHECKS = {"attention": check_attention, "blocks": check_blocks, "comm_bytes": check_comm_bytes,
          "invariant": check_invariant}


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, run_checks, CHECKS, timeout=240)


# --------------------------------------------------------------------------------------------------
# the split, in this process

@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_zigzag_split_holds_chunks_r_and_mirror_and_merge_inverts_it(C):
    """Rank r holds chunks r and 2C-1-r with their original positions; merging every rank's part gives
    back the sequence; every position is held by exactly one rank; a length not a multiple of 2C is refused."""
    T = 2 * C * 3
    x = torch.arange(2 * T).view(2, T) * 10  # (B, T)
    parts = [zigzag_split(x, C, r, dim=1) for r in range(C)]
    for r, part in enumerate(parts):
        positions = zigzag_positions(T, C, r)
        want = list(range(3 * r, 3 * r + 3)) + list(range(3 * (2 * C - 1 - r), 3 * (2 * C - r)))
        assert positions.tolist() == want
        assert torch.equal(part, x[:, positions])
    assert torch.equal(zigzag_merge(parts, dim=1), x)
    assert sorted(torch.cat([zigzag_positions(T, C, r) for r in range(C)]).tolist()) == list(range(T))
    with pytest.raises(ValueError, match="not a multiple"):
        zigzag_split(x[:, :-1], C, 0, dim=1)


def test_zigzag_split_balances_causal_work_and_a_contiguous_split_does_not():
    """Causal attention work of a rank (keys its queries see: the sum of position + 1) is equal on every
    rank under the zigzag split, and unequal when each rank takes one contiguous slice."""
    T, C = 48, 4
    zigzag = {int((zigzag_positions(T, C, r) + 1).sum()) for r in range(C)}
    contiguous = {int((torch.arange(T).chunk(C)[r] + 1).sum()) for r in range(C)}
    assert len(zigzag) == 1 and len(contiguous) == C


def test_split_errors_are_one_line_and_name_the_key():
    """A sequence length that is not a multiple of 2C (x TP under SP), or attention dropout under CP, is
    a one-line UserError naming the key; valid settings pass."""
    check_context_parallel(64, 4)
    check_context_parallel(64, 2, tensor_parallel=4, sequence_parallel=True)
    check_context_parallel(7, 1, attention_dropout=0.1)
    for kwargs, key in (({"seq_length": 60, "context_parallel": 4}, "model.seq_length=60"),
                        ({"seq_length": 24, "context_parallel": 2, "tensor_parallel": 4, "sequence_parallel": True},
                         "model.seq_length=24"),
                        ({"seq_length": 64, "context_parallel": 2, "attention_dropout": 0.1},
                         "model.attention_dropout=0.1")):
        with pytest.raises(UserError, match=key) as err:
            check_context_parallel(**kwargs)
        assert "\n" not in str(err.value)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(UserError, match="model.attention_dropout"):
        context_parallel_attention(q, q, q, Communicator("cp", None, 1, 0, CommStats()), dropout_p=0.1)


@pytest.mark.parametrize("kernel", ["auto", "math"])
def test_one_rank_equals_causal_attention(kernel):
    """C = 1 (no process group): outputs and gradients equal full causal attention, with GQA."""
    q, k, v, dout = full_inputs(1, 2, seed=5)
    cp = Communicator("cp", None, 1, 0, CommStats())
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp, kernel=kernel)
    got = (out.detach(), *torch.autograd.grad(out, local, dout))
    for a, b in zip(got, reference(q, k, v, dout)):
        assert rel(a, b) < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["auto", "math"])
def test_half_precision_is_within_a_few_roundings(kernel, dtype):
    """C = 1 with bf16 or fp16 inputs (GQA, T = 32, the second chunk merging two blocks): outputs and
    gradients keep the input dtype and are within 4 units of its rounding (eps) of fp64 attention of
    the same inputs, relative to the largest entry."""
    q, k, v, dout = (randn(2, heads, 32, HEAD_DIM, seed=20 + i).to(dtype) for i, heads in enumerate((4, 2, 2, 4)))
    cp = Communicator("cp", None, 1, 0, CommStats())
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp, kernel=kernel)
    got = (out.detach(), *torch.autograd.grad(out, local, dout))
    assert all(t.dtype == dtype for t in got)
    for a, b in zip(got, reference(*(t.float() for t in (q, k, v, dout)))):
        assert rel(a.float(), b) < 4 * torch.finfo(dtype).eps


# --------------------------------------------------------------------------------------------------
# the ring, in a world of 4

def test_ring_attention_equals_one_process(world4):
    """Ring attention at C = 2, 3, 4 (with 4 and with 2 KV heads, flash and math kernels): outputs and the
    gradients of q, k, v equal one process's full causal attention within 1e-6."""
    for rank_errors in result(world4, "attention"):
        ring = {label: e for label, e in rank_errors.items() if " ring " in label}
        assert len(ring) in (2 * 2 * 4 * 2, 2 * 2 * 4 * 3)  # rank 0 is in no C = 3 group
        bad = {label: e for label, e in ring.items() if not e < TOL}
        assert not bad, bad


def test_allgather_exchange_equals_ring(world4):
    """The all-gather exchange gives the ring's outputs bitwise (same blocks, same merge order) and its
    gradients within 1e-6 (dK/dV summed in another order)."""
    for rank_errors in result(world4, "attention"):
        gathered = {label: e for label, e in rank_errors.items() if "allgather-vs-ring" in label}
        assert len(gathered) in (2 * 2 * 4 * 2, 2 * 2 * 4 * 3)
        bad = {label: e for label, e in gathered.items() if not e < TOL or (label.endswith(" out") and e != 0)}
        assert not bad, bad


def test_fully_masked_blocks_are_not_computed(world4):
    """Per pass, each CP rank computes 2C+1 blocks and skips 2C-1; over the group the computed
    (query chunk, key chunk) pairs are exactly the causal lower triangle, each once."""
    per_rank = result(world4, "blocks")
    for C, groups in GROUPS.items():
        for ranks in groups:
            for phase in ("forward", "backward"):
                pairs = []
                for global_rank in ranks:
                    cp_rank, computed, skipped, computed_pairs = per_rank[global_rank][C]
                    assert cp_rank == ranks.index(global_rank)
                    assert (computed[phase], skipped[phase]) == (2 * C + 1, 2 * C - 1)
                    pairs += computed_pairs[phase]
                assert sorted(pairs) == [(i, j) for i in range(2 * C) for j in range(i + 1)]


def test_batch_invariant_attention_under_cp_is_one_process_bitwise(world4):
    """Under batch-invariant numerics (an RL run's `rl.batch_invariant`) CP attention gathers the keys and runs the
    whole row's tiles: at C = 2, 3, 4, with and without packed documents, the output equals one process's
    `invariant.attention` bit for bit, the gradients within 1e-6 (dK and dV summed over the ranks)."""
    for rank_values in result(world4, "invariant"):
        assert len(rank_values) in (4, 6)  # rank 0 is in no C = 3 group
        for key, (same, errors) in rank_values.items():
            assert same and max(errors) < TOL, (key, same, errors)


def test_kv_bytes_sent_equal_the_formula(world4):
    """Per call on the CP group: the ring sends this rank's K and V (KV heads only) C-1 times forward, and
    C-1 times again plus C-1 fp32 dK/dV backward; the all-gather exchange gathers them once per pass
    and reduce-scatters dK/dV. Nothing else is recorded."""
    for rank_values in result(world4, "comm_bytes"):
        assert rank_values
        for key, (got, want) in rank_values.items():
            assert got == want, key
