"""Several ranks on one GPU (`shardlm.parallel.staged`, `SHARDLM_BACKEND=gloo_staged`): the layouts run every
collective and transfer through the staged gloo group and still equal one process within 1e-5 (fp32: losses,
gradient norms, validation loss and every final parameter, on every rank).

On this machine the tensors live on the CPU and the group copies them anyway, so a result it failed to copy back
into the caller's tensor fails here. On a GPU machine the same checks run on CUDA tensors, the ranks sharing
GPU 0 (`scripts/gpu_check.sh`), against one process on the GPU.

Layouts (`test_sft_layouts`'s packed SFT rows and models), chosen so that every kind of communication goes
through the group: world 2: TP=2 with SP (all-reduce, all-gather, reduce-scatter), PP=2 x 2 virtual stages
(PyTorch's pipeline sends and receives), CP=2 on MLA with two MTP depths (the ring's batched sends; DDP over the
CP ranks: its parameter check and broadcast issued from C++, its all-reduce hook), FSDP DP=2 (FSDP2's
all-gathers and reduce-scatters), gpt-oss's attention at CP=2; world 4: TP=2 x DP=2 with SP and the distributed
optimizer, PP=2 x DP=2, EP=2 over DP=4 (all-to-all, DDP).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_sft_layouts import STEPS, TOL, WORLD2, WORLD4, kind_of, sft_config, train_layout

from shardlm.parallel import ParallelContext
from shardlm.parallel.comm import Communicator
from shardlm.parallel.staged import STAGED, StagedGroup

from agreement import assert_same_run
from layouts import layout_context, spawn_layouts
from multiproc import check_result

pytestmark = pytest.mark.timeout(600)

CASES2 = ["tp2 sp llama", "pp2 virtual2 gpt", "cp2 mla mtp", "fsdp dp2 llama", "cp2 oss"]
CASES4 = ["zero tp2 dp2 sp llama", "pp2 dp2 gpt", "ep2 dp4 moe"]
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"


def staged_layout(**spec) -> dict:
    """One layout's results, and whether the world and every group of the layout are the staged gloo group."""
    ctx = layout_context(spec["tp"], spec["pp"], spec["cp"], spec["ep"])
    result = train_layout(ctx, sft_config(**spec))
    communicators = [c for c in vars(ctx).values() if isinstance(c, Communicator)]
    groups = [dist.group.WORLD] + [c.group for c in communicators if c.group is not None]
    result["staged"] = dist.get_backend() == STAGED and all(isinstance(g, StagedGroup) for g in groups)
    return result


def run_staged(world: int, names: list[str], cases: dict) -> dict:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHARDLM_BACKEND", STAGED)
        env.setenv("SHARDLM_SHM_COLLECTIVES", "0")  # CPU groups would take the shared-memory path instead
        return spawn_layouts(world, staged_layout, {name: cases[name] for name in names}, timeout=300)


@pytest.fixture(scope="module")
def world2():
    return run_staged(2, CASES2, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_staged(4, CASES4, WORLD4)


@pytest.fixture(scope="module")
def reference():
    """One process on the device the workers use."""
    ctx = ParallelContext.single(DEVICE)
    return {kind: train_layout(ctx, sft_config(arch, micro=micro, moe=moe, mtp=mtp)) for kind, (arch, micro, moe, mtp)
            in {"gpt": ("gpt", 8, False, False), "llama": ("llama", 8, False, False), "oss": ("oss", 8, False, False),
                "mtp": ("mla", 8, False, True), "moe": ("gpt", 2, True, False)}.items()}


@pytest.mark.parametrize("name", CASES2)
def test_two_ranks_on_the_staged_group_equal_one_process(world2, reference, name):
    for rank, value in enumerate(check_result(world2, name)):
        assert value.pop("staged"), f"{name} rank {rank} did not run on {STAGED}"
        assert_same_run(value, reference[kind_of(name)], f"{name} rank {rank}", steps=STEPS, tol=TOL)


@pytest.mark.parametrize("name", CASES4)
def test_four_ranks_on_the_staged_group_equal_one_process(world4, reference, name):
    for rank, value in enumerate(check_result(world4, name)):
        assert value.pop("staged"), f"{name} rank {rank} did not run on {STAGED}"
        assert_same_run(value, reference[kind_of(name)], f"{name} rank {rank}", steps=STEPS, tol=TOL)


def test_an_unknown_backend_is_one_line_naming_the_choices(monkeypatch):
    from shardlm.errors import UserError
    from shardlm.parallel.staged import backend_name

    monkeypatch.setenv("SHARDLM_BACKEND", "mpi")
    with pytest.raises(UserError, match="SHARDLM_BACKEND=mpi: the only choice is gloo_staged .several ranks on one "
                                        "GPU.; leave it unset for NCCL on GPUs and gloo on CPUs"):
        backend_name()
    monkeypatch.setenv("SHARDLM_BACKEND", STAGED)
    assert backend_name() == STAGED
