"""The staged gloo group's contract, collective by collective (`shardlm.parallel.staged`, SHARDLM_BACKEND=gloo_staged).

tests/test_staged_backend.py trains layouts over the group; here each collective that FSDP2, the MoE dispatch, the
ring and the optimizers call is checked against its definition on known inputs, in a world of 3 (a size no power
of two; uneven all-to-all splits): synchronous and `async_op=True` forms, through `torch.distributed` and through
the method names PyTorch releases before 2.13 call on the group (`_allgather_base`, `_reduce_scatter_base`,
`alltoall_base` and the coalesced pair). A name the group lacked fell through to C++, which asked for a backend of
the tensors' device type: on a GPU FSDP2 and EP failed there with "No backend type associated with device type
cuda" (issue 66). The backend is also registered for the cpu and cuda device types, on the world and on a
subgroup, so `group._get_backend(device)` answers for both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, ReduceScatterOptions

from shardlm.parallel.staged import DEVICE_TYPES, OLD_NAMES, STAGED, StagedGroup

from multiproc import check_result, run_checks, run_workers

pytestmark = pytest.mark.timeout(180)

WORLD = 3
N = 4  # elements per rank


def value(rank: int, n: int = N, offset: float = 0.0) -> torch.Tensor:
    """Rank `rank`'s input: (n,) floats, distinct per rank and position."""
    return torch.arange(n, dtype=torch.float32) + 10.0 * rank + offset


def split(src: int, dst: int) -> int:
    """Elements rank `src` sends rank `dst` in the uneven all-to-all."""
    return src + dst + 1


def finish(work, async_op: bool) -> None:
    if async_op:
        assert work is not None
        work.wait()


def collectives(async_op: bool) -> dict:
    """Each collective through `torch.distributed`, this rank's results."""
    r, out = dist.get_rank(), {}
    t = value(r)
    finish(dist.all_reduce(t, async_op=async_op), async_op)
    out["all_reduce"] = t
    t = value(r)
    finish(dist.broadcast(t, src=1, async_op=async_op), async_op)
    out["broadcast"] = t
    parts = [torch.empty(N) for _ in range(WORLD)]
    finish(dist.all_gather(parts, value(r), async_op=async_op), async_op)
    out["all_gather"] = torch.cat(parts)
    gathered = torch.empty(WORLD * N)
    finish(dist.all_gather_into_tensor(gathered, value(r), async_op=async_op), async_op)
    out["all_gather_into_tensor"] = gathered
    chunk = torch.empty(N)
    finish(dist.reduce_scatter_tensor(chunk, value(r, WORLD * N), async_op=async_op), async_op)
    out["reduce_scatter_tensor"] = chunk
    chunk = torch.empty(N)
    finish(dist.reduce_scatter(chunk, list(value(r, WORLD * N).chunk(WORLD)), async_op=async_op), async_op)
    out["reduce_scatter"] = chunk
    sends = [split(r, j) for j in range(WORLD)]
    receives = [split(j, r) for j in range(WORLD)]
    received = torch.empty(sum(receives))
    finish(dist.all_to_all_single(received, value(r, sum(sends)), receives, sends, async_op=async_op), async_op)
    out["all_to_all_single"] = received
    received = [torch.empty(N) for _ in range(WORLD)]
    finish(dist.all_to_all(received, [value(r, N, 100.0 * j) for j in range(WORLD)], async_op=async_op), async_op)
    out["all_to_all"] = torch.cat(received)
    t = value(r)
    finish(dist.reduce(t, dst=0, async_op=async_op), async_op)
    out["reduce"] = t if r == 0 else None
    parts = [torch.empty(N) for _ in range(WORLD)] if r == 0 else None
    finish(dist.gather(value(r), parts, dst=0, async_op=async_op), async_op)
    out["gather"] = torch.cat(parts) if r == 0 else None
    t = torch.empty(N)
    finish(dist.scatter(t, [value(j, N, 7.0) for j in range(WORLD)] if r == 0 else None, src=0, async_op=async_op),
           async_op)
    out["scatter"] = t
    finish(dist.barrier(async_op=async_op), async_op)
    return out


def old_names() -> dict:
    """The same collectives through the names PyTorch before 2.13 calls on the group, and how many collectives the
    group staged for them (gloo itself would give the same numbers on CPU tensors, but not stage CUDA ones)."""
    group, r, out = dist.group.WORLD, dist.get_rank(), {"staged": 0}
    run = group._run

    def counted(*args):
        out["staged"] += 1
        return run(*args)

    group._run = counted
    gathered = torch.empty(WORLD * N)
    group._allgather_base(gathered, value(r), AllgatherOptions()).wait()
    out["all_gather_into_tensor"] = gathered
    chunk = torch.empty(N)
    group._reduce_scatter_base(chunk, value(r, WORLD * N), ReduceScatterOptions()).wait()
    out["reduce_scatter_tensor"] = chunk
    sends = [split(r, j) for j in range(WORLD)]
    receives = [split(j, r) for j in range(WORLD)]
    received = torch.empty(sum(receives))
    group.alltoall_base(received, value(r, sum(sends)), receives, sends, AllToAllOptions()).wait()
    out["all_to_all_single"] = received
    outputs = [torch.empty(WORLD * N), torch.empty(WORLD * 2)]
    group.allgather_into_tensor_coalesced(outputs, [value(r), value(r, 2, 0.5)], AllgatherOptions()).wait()
    out["all_gather_coalesced"] = outputs
    outputs = [torch.empty(N), torch.empty(2)]
    group.reduce_scatter_tensor_coalesced(outputs, [value(r, WORLD * N), value(r, WORLD * 2, 0.5)],
                                          ReduceScatterOptions()).wait()
    out["reduce_scatter_coalesced"] = outputs
    del group._run
    return out


def registration() -> dict:
    """What the world and a subgroup of ranks 0 and 1 answer about their backend."""
    sub = dist.new_group([0, 1])
    out = {"backend": dist.get_backend(), "capability": list(dist.Backend.backend_capability[STAGED])}
    for name, group in (("world", dist.group.WORLD), ("sub", sub)):
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        out[name] = {"staged": isinstance(group, StagedGroup),
                     "backends": [type(group._get_backend(torch.device(d))).__name__ for d in DEVICE_TYPES]}
    return out


def worker() -> dict:
    return run_checks({"sync": lambda: collectives(False), "async": lambda: collectives(True), "old": old_names,
                       "registration": registration})


@pytest.fixture(scope="module")
def results():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHARDLM_BACKEND", STAGED)
        return run_workers(WORLD, worker, timeout=120)


def expected(name: str, r: int):
    """Rank r's result of collective `name`, from its definition."""
    total = sum(value(j) for j in range(WORLD))
    if name == "all_reduce":
        return total
    if name == "broadcast":
        return value(1)
    if name in ("all_gather", "all_gather_into_tensor"):
        return torch.cat([value(j) for j in range(WORLD)])
    if name in ("reduce_scatter_tensor", "reduce_scatter"):
        return sum(value(j, WORLD * N) for j in range(WORLD)).chunk(WORLD)[r]
    if name == "all_to_all_single":  # rank j's block for r starts after its blocks for ranks before r
        return torch.cat([value(j, sum(split(j, i) for i in range(WORLD)))[sum(split(j, i) for i in range(r)):][
            :split(j, r)] for j in range(WORLD)])
    if name == "all_to_all":
        return torch.cat([value(j, N, 100.0 * r) for j in range(WORLD)])
    if name == "reduce":
        return total if r == 0 else None
    if name == "gather":
        return torch.cat([value(j) for j in range(WORLD)]) if r == 0 else None
    if name == "scatter":
        return value(r, N, 7.0)
    raise KeyError(name)


COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all_single", "all_to_all", "reduce", "gather", "scatter"]


@pytest.mark.parametrize("form", ["sync", "async"])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_each_collective_gives_its_definition(results, form, name):
    for r, out in enumerate(check_result(results, form)):
        want = expected(name, r)
        if want is None:
            assert out[name] is None
        else:
            assert torch.equal(out[name], want), (name, form, r, out[name], want)


def test_the_names_before_torch_2_13_run_the_staged_collectives(results):
    for r, out in enumerate(check_result(results, "old")):
        assert out["staged"] == 3 + 2 + 2, out["staged"]  # one per tensor
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            assert torch.equal(out[name], expected(name, r)), (name, r)
        big, small = out["all_gather_coalesced"]
        assert torch.equal(big, expected("all_gather_into_tensor", r))
        assert torch.equal(small, torch.cat([value(j, 2, 0.5) for j in range(WORLD)]))
        big, small = out["reduce_scatter_coalesced"]
        assert torch.equal(big, expected("reduce_scatter_tensor", r))
        assert torch.equal(small, sum(value(j, WORLD * 2, 0.5) for j in range(WORLD)).chunk(WORLD)[r])


def test_every_old_name_is_the_groups_own_python_method():
    """A name left to the C++ base class would skip the staging; each maps to the method it forwards to."""
    for old, new in OLD_NAMES.items():
        assert old in vars(StagedGroup) and new in vars(StagedGroup), old


def test_the_backend_is_registered_for_cpu_and_cuda(results):
    for r, out in enumerate(check_result(results, "registration")):
        assert out["backend"] == STAGED and out["capability"] == list(DEVICE_TYPES)
        groups = ["world", "sub"] if r < 2 else ["world"]
        for name in groups:
            assert out[name]["staged"], (r, name)
            assert out[name]["backends"] == ["ProcessGroupGloo"] * len(DEVICE_TYPES), (r, name, out[name])
