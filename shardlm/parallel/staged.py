"""Several ranks on one GPU: a process group that runs gloo on CPU copies of every tensor it is handed.

NCCL refuses two ranks on one GPU, and gloo takes CUDA tensors for all-reduce and broadcast only, so a
multi-rank layout (TP, SP, CP, EP, PP, FSDP, the distributed optimizer) cannot otherwise run its CUDA code on a
one-GPU machine. `SHARDLM_BACKEND=gloo_staged` makes `init_distributed` (and `spawn.run_workers`) use
`StagedGroup` (`backend_for`): each collective and point-to-point transfer copies its tensors to the CPU, runs
gloo on the copies and copies the results back into the caller's tensors; the ranks then share the GPUs
(`LOCAL_RANK` modulo their count). It is for checking multi-rank code paths on CUDA tensors, and for trying a
layout on a workstation, not for speed: every byte crosses PCIe and loopback TCP. CPU tensors are copied too, so
the CPU tests run the same staging (a result not copied back fails them).

Collectives block until gloo is done (every rank issues them in the same order); sends and receives return
a pending work that finishes them on `wait()`, since a ring posts its send and its receive before waiting.
The Python names of `torch.distributed.ProcessGroup`'s methods differ from gloo's in places
(`all_gather_single` is gloo's `_allgather_base`, `all_to_all_single` its `alltoall_base`, ...): `_GLOO` maps them.
PyTorch releases before 2.13 call the older names from `torch.distributed` (`dist.all_gather_into_tensor` calls
`_allgather_base`, `dist.all_to_all_single` calls `alltoall_base`, ...): the group answers to both (`OLD_NAMES`),
since a name it lacks falls through to C++, which looks for a backend of the tensors' device type.

The group is a `ProcessGroup` subclass, which PyTorch registers no per-device backend for; `_create` registers its
gloo backend for the CPU and CUDA device types, so that `group._get_backend(device)` (FSDP2 asks it whether the
backend allocates its buffers) answers on CUDA tensors too. A C++ caller of a method that this class does not
override would reach gloo directly: correct on CPU tensors, and an error of gloo's on CUDA ones, never a silent
result.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from shardlm.errors import UserError

STAGED = "gloo_staged"
"""The backend's name, for `SHARDLM_BACKEND` and `init_process_group`."""

_GLOO = {"allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced", "allgather": "allgather",
         "allgather_coalesced": "allgather_coalesced", "all_gather_single": "_allgather_base",
         "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "_reduce_scatter_base", "alltoall": "alltoall",
         "all_to_all_single": "alltoall_base", "broadcast": "broadcast", "reduce": "reduce", "gather": "gather",
         "scatter": "scatter"}
"""ProcessGroup method -> the gloo backend's method of the same collective. The first argument of each holds
its results (in place for all-reduce, broadcast and reduce)."""

OLD_NAMES = {"_allgather_base": "all_gather_single", "_reduce_scatter_base": "reduce_scatter_single",
             "alltoall_base": "all_to_all_single", "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
             "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced"}
"""A method name of PyTorch before 2.13 -> the name `StagedGroup` implements it under."""

DEVICE_TYPES = ("cpu", "cuda")
"""The device types the backend is registered for, and whose tensors it stages."""


def backend_name() -> str:
    """The process-group backend `SHARDLM_BACKEND` asks for: "gloo_staged", or "" when unset (NCCL on GPUs,
    gloo on CPUs)."""
    name = os.environ.get("SHARDLM_BACKEND", "")
    if name not in ("", STAGED):
        raise UserError(f"SHARDLM_BACKEND={name}: the only choice is {STAGED} (several ranks on one GPU); leave it "
                        "unset for NCCL on GPUs and gloo on CPUs")
    return name


def backend_for(device: torch.device) -> str:
    """The backend `init_process_group` gets for ranks on `device`: `SHARDLM_BACKEND`'s (registered here), else
    NCCL for CUDA and gloo for the CPU."""
    name = backend_name() or ("nccl" if device.type == "cuda" else "gloo")
    if name == STAGED and not hasattr(dist.Backend, STAGED.upper()):
        dist.Backend.register_backend(STAGED, _create, devices=list(DEVICE_TYPES))
    return name


def _to_cpu(value):
    """`value` with every tensor in it (nested lists) replaced by a CPU copy of its own."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return [_to_cpu(v) for v in value]
    return value


def _copy_back(original, staged) -> None:
    """Write the staged results into the caller's tensors."""
    if isinstance(original, torch.Tensor):
        with torch.no_grad():
            original.copy_(staged)
    elif isinstance(original, (list, tuple)):
        for o, s in zip(original, staged):
            _copy_back(o, s)


def _done(result) -> dist.Work:
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _Pending(dist.Work):
    """A point-to-point transfer in flight: `wait()` waits for gloo, then copies a receive back. It holds the
    CPU copy gloo reads or writes until then."""

    def __init__(self, work, staged, finish=None):
        super().__init__()
        self._work, self._staged, self._finish = work, staged, finish

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._work.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True


class StagedGroup(dist.ProcessGroup):
    """A process group whose collectives run on gloo (`gloo`, a gloo backend of the same ranks) on CPU copies."""

    def __init__(self, gloo, rank: int, size: int):
        super().__init__(rank, size)
        self.gloo = gloo
        self._name = self._desc = ""

    def getBackendName(self) -> str:  # noqa: N802 - torch's names, called from C++
        return STAGED

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _run(self, name: str, *args):
        staged = [_to_cpu(a) for a in args]
        getattr(self.gloo, _GLOO[name])(*staged).wait()
        _copy_back(args[0], staged[0])
        return _done(args[0])

    def _each(self, name: str, outputs, inputs, opts):
        """A coalesced call: the one-tensor collective `name` on each (output, input) pair in turn."""
        for output, input in zip(outputs, inputs):
            self._run(name, output, input, opts)
        return _done(outputs)

    def allreduce(self, tensors, opts):
        return self._run("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        return self._run("allreduce_coalesced", tensors, opts)

    def allgather(self, outputs, inputs, opts):
        return self._run("allgather", outputs, inputs, opts)

    def allgather_coalesced(self, outputs, inputs, opts):
        return self._run("allgather_coalesced", outputs, inputs, opts)

    def all_gather_single(self, output, input, opts):
        return self._run("all_gather_single", output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return self._each("all_gather_single", outputs, inputs, opts)

    def reduce_scatter(self, outputs, inputs, opts):
        return self._run("reduce_scatter", outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts):
        return self._run("reduce_scatter_single", output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self._each("reduce_scatter_single", outputs, inputs, opts)

    def alltoall(self, outputs, inputs, opts):
        return self._run("alltoall", outputs, inputs, opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        return self._run("all_to_all_single", output, input, output_splits, input_splits, opts)

    def broadcast(self, tensors, opts):
        return self._run("broadcast", tensors, opts)

    def reduce(self, tensors, opts):
        return self._run("reduce", tensors, opts)

    def gather(self, outputs, inputs, opts):
        return self._run("gather", outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        return self._run("scatter", outputs, inputs, opts)

    # The names PyTorch before 2.13 calls from `torch.distributed` (see the module docstring).
    def _allgather_base(self, output, input, opts):
        return self.all_gather_single(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts):
        return self.reduce_scatter_single(output, input, opts)

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        return self.all_to_all_single(output, input, output_splits, input_splits, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def barrier(self, opts):
        self.gloo.barrier(opts).wait()
        return _done(None)

    def send(self, tensors, dst: int, tag: int):
        staged = _to_cpu(tensors)
        return _Pending(self.gloo.send(staged, dst, tag), staged)

    def recv(self, tensors, src: int, tag: int):
        staged = [torch.empty_like(t, device="cpu") for t in tensors]  # gloo writes them: nothing to copy in
        return _Pending(self.gloo.recv(staged, src, tag), staged, lambda: _copy_back(tensors, staged))


def _create(store, rank: int, size: int, timeout: timedelta) -> StagedGroup:
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
    group = StagedGroup(gloo, rank, size)
    for device_type in DEVICE_TYPES:
        group._register_backend(torch.device(device_type), dist.ProcessGroup.BackendType.CUSTOM, gloo)
    return group

