"""Shared-memory collectives give what gloo gives, on every rank, and fail instead of hanging.

Worlds of 2, 3 and 4 processes on this machine (3 and 4 share 2 cores, so ranks also wait on
descheduled peers). Each check compares a `Communicator` whose collectives go through shared memory
with gloo's own collective on the same process group: bit for bit at world 2 (a + b is one rounding
either way), within one rounding of the summation order at 3 and 4, and always bit for bit across
ranks (each element is reduced by exactly one rank).
"""

from __future__ import annotations

import os
import platform
import time

import pytest
import torch
import torch.distributed as dist

from shardlm.parallel.comm import CommStats, Communicator
from shardlm.parallel.shm import SLOT_BYTES

from multiproc import check_result as result
from multiproc import run_checks, run_workers

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="shared-memory collectives are x86-64 only")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int64": torch.int64}
SIZES = (1, 7, 1 << 20, SLOT_BYTES // 4 * 2 + 5)  # one element ... more than two slots of fp32


def communicator(timeout_s: float | None = None) -> Communicator:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    return Communicator("tp", group, world, rank, CommStats(), shared_memory=True, timeout_s=timeout_s)


def tensor(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)


def gathered(comm: Communicator, t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(comm.size)]
    dist.all_gather(out, t.contiguous(), group=comm.group)
    return out


def check_all_reduce():
    comm, rank = communicator(), dist.get_rank()
    out = {"shared_memory": comm.shm is not None}
    for name, dtype in DTYPES.items():
        for n in SIZES:
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                mine = tensor(n, dtype, seed=1000 * rank + n)
                reference = mine.clone()
                comm.all_reduce(mine, op)
                dist.all_reduce(reference, op=op, group=comm.group)
                scale = reference.float().abs().max().clamp_min(1)
                label = f"{name} n={n} {'max' if op == dist.ReduceOp.MAX else 'sum'}"
                out[label] = {
                    "error": ((mine.float() - reference.float()).abs().max() / scale).item(),
                    "exact": torch.equal(mine, reference),
                    "same_on_every_rank": all(torch.equal(mine, t) for t in gathered(comm, mine)),
                }
    # a non-contiguous tensor is reduced in place like a contiguous one
    strided = tensor(64, torch.float32, seed=rank).view(8, 8).t()
    expected = strided.contiguous()
    dist.all_reduce(expected, group=comm.group)
    out["strided_exact_or_close"] = torch.allclose(comm.all_reduce(strided), expected, rtol=1e-6, atol=1e-4)
    return out


def check_gather_and_scatter():
    comm, rank = communicator(), dist.get_rank()
    out = {}
    x = tensor(3 * 5, torch.float32, seed=rank).view(3, 5)
    out["all_gather"] = all(torch.equal(a, b) for a, b in zip(comm.all_gather(x), gathered(comm, x)))
    for dim in (0, 1):
        y = tensor(4 * comm.size * 6, torch.float32, seed=10 + rank).view(4 * comm.size, 6)
        if dim == 1:
            y = tensor(4 * 6 * comm.size, torch.float32, seed=10 + rank).view(4, 6 * comm.size)
        reference = y.clone()
        dist.all_reduce(reference, group=comm.group)
        expected = reference.chunk(comm.size, dim=dim)[rank]
        got = comm.reduce_scatter(y, dim=dim)
        out[f"reduce_scatter dim={dim}"] = ((got - expected).abs().max() / expected.abs().max()).item()
    big = tensor(SLOT_BYTES // 4 + 1, torch.float32, seed=rank)  # more than a slot: gloo does it
    out["all_gather_too_big_for_a_slot"] = all(torch.equal(a, b) for a, b in zip(comm.all_gather(big),
                                                                                  gathered(comm, big)))
    return out


def check_no_file_left_behind():
    """This group's segment file, if it is still there (not a glob of /dev/shm: other test worlds running beside
    this one have segments of their own between creating and unlinking them)."""
    comm = communicator()
    comm.all_reduce(torch.ones(4))
    dist.barrier()
    path = comm.shm.path
    return {"path": path, "exists": os.path.exists(path)}


def check_disabled_by_environment():
    import os

    os.environ["SHARDLM_SHM_COLLECTIVES"] = "0"
    try:
        from shardlm.parallel.layout import ParallelContext

        ctx = ParallelContext.from_process_group(dist.get_world_size())
        return ctx.tp.shm is None
    finally:
        del os.environ["SHARDLM_SHM_COLLECTIVES"]


def all_reduce_alone(comm: Communicator) -> dict | None:
    """Rank 0 calls an all-reduce that no other rank joins (they wait at a gloo barrier): what it raised
    and after how long. None on the other ranks."""
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1))
        message = None
    except RuntimeError as exc:
        message = str(exc)
    elapsed = time.monotonic() - start
    dist.barrier()
    return {"message": message, "seconds": elapsed}


def check_missing_peer_raises():
    """A peer that never joins: rank 0 must raise within the timeout."""
    comm = communicator(timeout_s=1.0)
    comm.all_reduce(torch.ones(1))  # sets the segment up on every rank
    return all_reduce_alone(comm)


def check_exited_peer_raises_at_once():
    """A peer whose process has exited (its header names a process that ran and was reaped) ends the
    wait within a second, long before the timeout."""
    import subprocess

    comm = communicator(timeout_s=60.0)
    comm.all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        gone = subprocess.Popen(["true"])
        gone.wait()
        comm.shm.pids[1] = gone.pid  # what rank 0 would see had this process died
    dist.barrier()
    return all_reduce_alone(comm)


CHECKS = {f.__name__: f for f in (check_all_reduce, check_gather_and_scatter, check_no_file_left_behind,
                                  check_disabled_by_environment, check_missing_peer_raises,
                                  check_exited_peer_raises_at_once)}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def results(request):
    return run_workers(request.param, run_checks, CHECKS, timeout=240)


def test_all_reduce_equals_gloo_on_every_rank(results):
    world = len(results)
    for rank, checks in enumerate(result(results, "check_all_reduce")):
        assert checks.pop("shared_memory"), "the group is on one machine: its collectives must use shared memory"
        assert checks.pop("strided_exact_or_close")
        for label, figures in checks.items():
            assert figures["same_on_every_rank"], f"rank {rank} {label}: ranks disagree"
            if world == 2 or "max" in label or "int64" in label:
                assert figures["exact"], f"rank {rank} {label}: differs from gloo ({figures['error']})"
            else:  # summation order differs from gloo's ring: one rounding per term
                tolerance = 1e-6 if label.startswith("fp32") else 2e-2
                assert figures["error"] <= tolerance, f"rank {rank} {label}: {figures['error']}"


def test_all_gather_and_reduce_scatter_equal_gloo(results):
    for rank, checks in enumerate(result(results, "check_gather_and_scatter")):
        assert checks["all_gather"] and checks["all_gather_too_big_for_a_slot"], f"rank {rank}"
        for dim in (0, 1):
            assert checks[f"reduce_scatter dim={dim}"] <= 1e-6, f"rank {rank}: {checks}"


def test_segment_file_is_removed_once_mapped(results):
    for segment in result(results, "check_no_file_left_behind"):
        assert segment["path"].startswith("/dev/shm/shardlm-") and not segment["exists"], segment


def test_environment_switches_to_gloo(results):
    assert all(result(results, "check_disabled_by_environment"))


def test_missing_peer_fails_within_timeout_instead_of_hanging(results):
    outcome = result(results, "check_missing_peer_raises")[0]
    assert outcome["message"] is not None and "timed out after 1 s" in outcome["message"], outcome
    from shardlm.training.cli import is_timeout

    assert is_timeout(RuntimeError(outcome["message"]))  # so `shardlm train` reports it in one line
    assert outcome["seconds"] < 10, outcome


def test_exited_peer_fails_at_once(results):
    outcome = result(results, "check_exited_peer_raises_at_once")[0]
    assert outcome["message"] is not None and "rank 1" in outcome["message"] and "exited" in outcome["message"], outcome
    assert outcome["seconds"] < 5, outcome
    from shardlm.training.cli import peer_exited

    assert peer_exited(RuntimeError(outcome["message"]))
