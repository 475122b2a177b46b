"""The tensor-parallel core equals single-process math: operators, layers, cross-entropy, RNG, comms.

Each world size (1, 2, 3, 4) is spawned once; inside it every check builds the parallel computation
and its single-process reference on the same master weights and returns the relative errors, which
the tests below assert (fp32, 1e-5 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from shardlm.parallel.layout import data_parallel_groups, rank_grid, tensor_parallel_groups

from multiproc import check_result as result
from multiproc import run_checks, run_workers

TOL = 1e-5
_CONTEXTS: dict[int, ParallelContext] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def context(tp: int) -> ParallelContext:
    if tp not in _CONTEXTS:  # new_group is collective: every rank reaches here in the same order
        _CONTEXTS[tp] = ParallelContext.from_process_group(tp)
    return _CONTEXTS[tp]


def tp_sizes() -> list[int]:
    world = dist.get_world_size()
    return [world] + ([2] if world == 4 else [])


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def tp_slice(t: torch.Tensor, dim: int, ctx: ParallelContext) -> torch.Tensor:
    return t.chunk(ctx.tp_size, dim=dim)[ctx.tp_rank]


# --------------------------------------------------------------------------------------------------
# checks run inside the workers; each returns {label: relative error} (or other plain values)

def check_operators():
    errors = {}
    for tp in tp_sizes():
        ctx = context(tp)
        x = randn(3, 4, 8 * tp, seed=1).requires_grad_()
        weights = [randn(3, 4, 8 * tp, seed=100 + r) for r in range(tp)]
        # f: identity forward; backward all-reduces, so x.grad is the sum of every rank's upstream grad
        y = copy_to_tensor_parallel(x, ctx.tp)
        (y * weights[ctx.tp_rank]).sum().backward()
        errors[f"f_forward tp={tp}"] = rel(y.detach(), x.detach())
        errors[f"f_backward tp={tp}"] = rel(x.grad, sum(weights))
        # g: all-reduce forward (sum of each rank's input), identity backward
        parts = [randn(3, 4, 5, seed=200 + r) for r in range(tp)]
        xr = parts[ctx.tp_rank].clone().requires_grad_()
        z = reduce_from_tensor_parallel(xr, ctx.tp)
        (z * weights[0][..., :5]).sum().backward()
        errors[f"g_forward tp={tp}"] = rel(z.detach(), sum(parts))
        errors[f"g_backward tp={tp}"] = rel(xr.grad, weights[0][..., :5])
        # scatter / gather along the last dimension: round trip and transposed gradients
        x2 = x.detach().clone().requires_grad_()
        local = scatter_to_tensor_parallel(x2, ctx.tp)
        errors[f"scatter_forward tp={tp}"] = rel(local.detach(), tp_slice(x.detach(), -1, ctx))
        (local * tp_slice(weights[0], -1, ctx)).sum().backward()
        errors[f"scatter_backward tp={tp}"] = rel(x2.grad, weights[0])
        back = gather_from_tensor_parallel(local.detach().requires_grad_(), ctx.tp)
        errors[f"scatter_gather_roundtrip tp={tp}"] = rel(back.detach(), x.detach())
        xl = tp_slice(x.detach(), -1, ctx).clone().requires_grad_()
        (gather_from_tensor_parallel(xl, ctx.tp) * weights[0]).sum().backward()
        errors[f"gather_backward tp={tp}"] = rel(xl.grad, tp_slice(weights[0], -1, ctx))
    return errors


def check_column_linear():
    errors = {}
    for tp in tp_sizes():
        ctx = context(tp)
        for gather in (False, True):
            in_f, out_f = 16, 12 * tp
            layer = ColumnParallelLinear(in_f, out_f, ctx.tp, gather_output=gather, seed=7, std=0.5)
            master = ColumnParallelLinear(in_f, out_f, ParallelContext.single().tp, seed=7, std=0.5)
            with torch.no_grad():
                master.bias.copy_(randn(out_f, seed=8))
                layer.bias.copy_(tp_slice(master.bias, 0, ctx))
            ref = torch.nn.Linear(in_f, out_f)
            ref.load_state_dict({"weight": master.weight.detach(), "bias": master.bias.detach()})
            x = randn(2, 5, in_f, seed=9)
            upstream = randn(2, 5, out_f, seed=10)
            xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            y = layer(xp)
            y_ref = ref(xr)
            (y * (upstream if gather else tp_slice(upstream, -1, ctx))).sum().backward()
            (y_ref * upstream).sum().backward()
            tag = f"tp={tp} gather={gather}"
            expected = y_ref if gather else tp_slice(y_ref, -1, ctx)
            errors[f"output {tag}"] = rel(y.detach(), expected.detach())
            errors[f"input_grad {tag}"] = rel(xp.grad, xr.grad)
            errors[f"weight_grad {tag}"] = rel(layer.weight.grad, tp_slice(ref.weight.grad, 0, ctx))
            errors[f"bias_grad {tag}"] = rel(layer.bias.grad, tp_slice(ref.bias.grad, 0, ctx))
            shards = torch.cat(ctx.tp.all_gather(layer.weight.detach()), dim=0)
            errors[f"shards_concat_exact {tag}"] = float(not torch.equal(shards, master.weight.detach()))
        y, bias = ColumnParallelLinear(16, 12 * tp, ctx.tp, skip_bias_add=True, seed=7)(randn(2, 16, seed=3))
        errors[f"skip_bias_add_returns_bias tp={tp}"] = float(bias.shape != (12,))
    return errors


def check_row_linear():
    errors = {}
    for tp in tp_sizes():
        ctx = context(tp)
        for parallel_input in (True, False):
            in_f, out_f = 12 * tp, 10
            layer = RowParallelLinear(in_f, out_f, ctx.tp, input_is_parallel=parallel_input, seed=5, std=0.5)
            master = RowParallelLinear(in_f, out_f, ParallelContext.single().tp, seed=5, std=0.5)
            bias = randn(out_f, seed=6)
            with torch.no_grad():
                layer.bias.copy_(bias)
            ref = torch.nn.Linear(in_f, out_f)
            ref.load_state_dict({"weight": master.weight.detach(), "bias": bias})
            x = randn(3, 4, in_f, seed=11)
            xr = x.clone().requires_grad_()
            xp = (tp_slice(x, -1, ctx) if parallel_input else x).clone().requires_grad_()
            upstream = randn(3, 4, out_f, seed=12)
            y = layer(xp)
            (y * upstream).sum().backward()
            y_ref = ref(xr)
            (y_ref * upstream).sum().backward()
            tag = f"tp={tp} parallel_input={parallel_input}"
            errors[f"output {tag}"] = rel(y.detach(), y_ref.detach())
            errors[f"input_grad {tag}"] = rel(xp.grad, tp_slice(xr.grad, -1, ctx) if parallel_input else xr.grad)
            errors[f"weight_grad {tag}"] = rel(layer.weight.grad, tp_slice(ref.weight.grad, 1, ctx))
            errors[f"bias_grad {tag}"] = rel(layer.bias.grad, ref.bias.grad)
            shards = torch.cat(ctx.tp.all_gather(layer.weight.detach()), dim=1)
            errors[f"shards_concat_exact {tag}"] = float(not torch.equal(shards, master.weight.detach()))
    return errors


def check_embedding():
    errors = {}
    for tp in tp_sizes():
        ctx = context(tp)
        vocab, padded, dim = 37, 40 * tp, 6  # 37 does not divide by any tp > 1: padded rows exist
        layer = VocabParallelEmbedding(padded, dim, ctx.tp, vocab_size=vocab, seed=3, std=1.0)
        master = VocabParallelEmbedding(40, dim, ParallelContext.single().tp, vocab_size=vocab, seed=3, std=1.0)
        ref = torch.nn.Embedding(vocab, dim)
        ref.weight.data.copy_(master.weight.detach()[:vocab])
        ids = torch.randint(0, vocab, (4, 9), generator=torch.Generator().manual_seed(4))
        ids[0, :3] = torch.tensor([0, vocab - 1, 20])
        upstream = randn(4, 9, dim, seed=5)
        out = layer(ids)
        (out * upstream).sum().backward()
        out_ref = ref(ids)
        (out_ref * upstream).sum().backward()
        full_grad = torch.cat(ctx.tp.all_gather(layer.weight.grad), dim=0)
        full_weight = torch.cat(ctx.tp.all_gather(layer.weight.detach()), dim=0)
        errors[f"output tp={tp}"] = rel(out.detach(), out_ref.detach())
        errors[f"weight_grad tp={tp}"] = rel(full_grad[:vocab], ref.weight.grad)
        errors[f"padding_grad_zero tp={tp}"] = full_grad[vocab:].abs().max().item()
        errors[f"padding_rows_zero tp={tp}"] = full_weight[vocab:].abs().max().item()
        errors[f"real_rows_equal_tp1 tp={tp}"] = float(not torch.equal(full_weight[:vocab], master.weight[:vocab]))
    return errors


def check_cross_entropy():
    errors = {}
    for tp in tp_sizes():
        ctx = context(tp)
        for vocab, smoothing in ((50, 0.0), (50, 0.1), (64 * tp, 0.0), (61, 0.2)):
            padded = 64 * tp
            logits = randn(3, 7, padded, seed=vocab) * 3
            target = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(1))
            target[0, 0], target[1, 3], target[2, 6] = -100, vocab - 1, 0
            local = tp_slice(logits, -1, ctx).clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target, ctx.tp, vocab_size=vocab, label_smoothing=smoothing)
            upstream = randn(3, 7, seed=2)
            (loss * upstream).sum().backward()
            ref_logits = logits.clone().requires_grad_()
            ref = F.cross_entropy(ref_logits[..., :vocab].reshape(-1, vocab), target.view(-1),
                                  reduction="none", ignore_index=-100, label_smoothing=smoothing).view(3, 7)
            (ref * upstream).sum().backward()
            tag = f"tp={tp} vocab={vocab} smoothing={smoothing}"
            errors[f"loss {tag}"] = rel(loss.detach(), ref.detach())
            errors[f"grad {tag}"] = rel(local.grad, tp_slice(ref_logits.grad, -1, ctx))
    return errors


def check_communication():
    """Column -> row pair: one all-reduce forward, one backward; CE comm independent of vocab."""
    out = {}
    for tp in tp_sizes():
        ctx = context(tp)
        column = ColumnParallelLinear(8, 16 * tp, ctx.tp, seed=1)
        row = RowParallelLinear(16 * tp, 8, ctx.tp, seed=2)
        x = randn(2, 3, 8, seed=3).requires_grad_()
        ctx.comm.reset()
        y = row(F.gelu(column(x)))
        forward = ctx.comm.snapshot()
        y.sum().backward()
        out[f"pair tp={tp}"] = {"forward": forward, "total": ctx.comm.snapshot()}
        ce = {}
        for vocab in (64 * tp, 1024 * tp):
            ctx.comm.reset()
            local = randn(2, 5, vocab // tp, seed=4).requires_grad_()
            target = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(5))
            vocab_parallel_cross_entropy(local, target, ctx.tp).sum().backward()
            ce[vocab] = ctx.comm.snapshot()
        out[f"cross_entropy tp={tp}"] = ce
    return out


def check_rng():
    out = {}
    for tp in tp_sizes():
        ctx = context(tp)
        masks = []
        for _ in range(2):  # same seed twice: every mask must repeat exactly
            ctx.seed(1234)
            outside = F.dropout(torch.ones(64), p=0.5)
            with ctx.rng.fork():
                inside = F.dropout(torch.ones(64), p=0.5)
            after_fork = F.dropout(torch.ones(64), p=0.5)
            masks.append((outside, inside, after_fork))
        gathered_in = ctx.tp.all_gather(masks[0][1])
        gathered_out = ctx.tp.all_gather(masks[0][0])
        gathered_after = ctx.tp.all_gather(masks[0][2])
        out[f"tp={tp}"] = {
            "reproducible": all(torch.equal(a, b) for a, b in zip(masks[0], masks[1])),
            "inside_differs": tp == 1 or all(not torch.equal(gathered_in[0], m) for m in gathered_in[1:]),
            "outside_identical": all(torch.equal(gathered_out[0], m) for m in gathered_out),
            "after_fork_identical": all(torch.equal(gathered_after[0], m) for m in gathered_after),
        }
    return out


CHECKS = {f.__name__: f for f in (check_operators, check_column_linear, check_row_linear, check_embedding,
                                  check_cross_entropy, check_communication, check_rng)}


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def results(request):
    return run_workers(request.param, run_checks, CHECKS)


def assert_small(results, name):
    for rank, errors in enumerate(result(results, name)):
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"


@pytest.mark.parametrize("check", ["check_operators", "check_column_linear", "check_row_linear",
                                   "check_embedding", "check_cross_entropy"])
def test_parallel_equals_single_process(results, check):
    assert_small(results, check)


def test_column_row_pair_one_all_reduce_each_way(results):
    for stats in result(results, "check_communication"):
        for key, value in stats.items():
            tp = int(key.split("tp=")[1])
            if not key.startswith("pair"):
                continue
            if tp == 1:
                assert value["total"] == {}, "TP=1 must not communicate"
                continue
            assert value["forward"].keys() == {"all_reduce/tp"}
            assert value["forward"]["all_reduce/tp"]["calls"] == 1
            assert value["forward"]["all_reduce/tp"]["elements"] == 2 * 3 * 8
            assert value["total"].keys() == {"all_reduce/tp"}
            assert value["total"]["all_reduce/tp"]["calls"] == 2
            assert value["total"]["all_reduce/tp"]["elements"] == 2 * (2 * 3 * 8)


def test_cross_entropy_communicates_batch_times_sequence_only(results):
    for stats in result(results, "check_communication"):
        for key, by_vocab in stats.items():
            if not key.startswith("cross_entropy") or key.endswith("tp=1"):
                continue
            small, large = by_vocab.values()
            assert small == large, "communication must not depend on the vocabulary size"
            assert small["all_reduce_max/tp"] == {"calls": 1, "bytes": 40, "elements": 10}
            assert small["all_reduce/tp"]["calls"] == 1
            assert small["all_reduce/tp"]["elements"] == 2 * 10  # target logit and sum(exp) per row


def test_rng_inside_parallel_region_differs_outside_identical(results):
    for stats in result(results, "check_rng"):
        for tp, flags in stats.items():
            assert all(flags.values()), f"{tp}: {flags}"


@pytest.mark.parametrize("world,tp", [(1, 1), (4, 1), (4, 2), (4, 4), (6, 3), (8, 2)])
def test_rank_layout(world, tp):
    grid = rank_grid(world, tp)
    tp_groups, dp_groups = tensor_parallel_groups(grid), data_parallel_groups(grid)
    assert tp_groups == [list(range(i, i + tp)) for i in range(0, world, tp)]
    assert dp_groups == [list(range(j, world, tp)) for j in range(tp)]
    assert sorted(r for g in tp_groups for r in g) == list(range(world))


def test_layout_that_does_not_divide_names_the_numbers():
    from shardlm.errors import UserError
    with pytest.raises(UserError, match="world size 6 is not divisible by tensor x pipeline = 4"):
        rank_grid(6, 4)


def _exit_on_rank_1() -> None:
    """Worker: rank 1 dies without a word (as a worker killed, or one whose function could not be unpickled);
    rank 0 goes on working, as a rank whose collective has not yet timed out does."""
    import os
    import time

    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(90)


@pytest.mark.timeout(120)
def test_a_rank_that_exits_without_a_result_fails_the_call_at_once():
    """run_workers notices a dead worker between polls of its result queue, instead of waiting out its timeout
    (here 100 s; a world of tests that hangs this way blocked the suite for the whole timeout)."""
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3 without a result"):
        run_workers(2, _exit_on_rank_1, timeout=100)
    assert time.monotonic() - start < 30


def _raise_on_rank_0() -> None:
    """Worker: rank 0 raises; rank 1 returns."""
    if dist.get_rank() == 0:
        raise ValueError("the worker's own words")


@pytest.mark.timeout(120)
def test_a_rank_that_raises_is_named_with_its_exception_on_the_first_line():
    """The error's first line says what the worker raised (a section of `make bench` reports only that line), and
    the worker's whole traceback follows."""
    with pytest.raises(RuntimeError) as raised:
        run_workers(2, _raise_on_rank_0, timeout=100)
    lines = str(raised.value).splitlines()
    assert lines[0] == "rank 0 failed: ValueError: the worker's own words"
    assert lines[1].startswith("Traceback")


def _rendezvous_port_and_a_sum() -> tuple[bool, float]:
    """Worker (no group yet): whether the rendezvous port is already bound by someone else before any rank
    initializes, then a world's all-reduce through `init_distributed` on it."""
    import errno
    import os
    import socket

    from shardlm.parallel.layout import init_distributed

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            held = False
        except OSError as exc:
            held = exc.errno == errno.EADDRINUSE
    ctx = init_distributed(tensor_parallel=1, timeout_s=60)
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    return held, total.item()


@pytest.mark.timeout(120)
def test_the_rendezvous_port_is_bound_before_the_workers_start():
    """The caller hosts the store on a port the OS gave it while binding: no window in which another world's store
    or a TCP connection's local end takes a port picked free (a CI run lost a module to EADDRINUSE that way), and
    every rank, rank 0 too, joins it as a client."""
    results = run_workers(3, _rendezvous_port_and_a_sum, init=False, timeout=100)
    assert results == [(True, 6.0)] * 3
