"""Training under a hard per-process memory cap: a sequence too long for one process trains split over C.

Each worker of a world of C processes lowers its own `RLIMIT_DATA` to the cap before it builds anything.
On Linux >= 4.7 that limit counts every private writable mapping (the heap, and the anonymous mmaps that
glibc and PyTorch's CPU allocator use for large tensors), so an allocation past the cap fails with ENOMEM and
PyTorch raises `DefaultCPUAllocator: can't allocate memory` in the worker, which reports it as an
out-of-memory result; the kernel's OOM killer is never involved. (`RLIMIT_AS` would also count the address
space reserved for shared libraries and thread stacks that nothing writes, so its cap says less about the
memory a step needs.) The cap is on the whole process, PyTorch's own start-up data included.
"""

from __future__ import annotations

import resource

import torch


def _status_bytes(key: str) -> int:
    """A `kB` field of /proc/self/status (VmData, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def data_bytes() -> int:
    """This process's private writable memory now (VmData: what `RLIMIT_DATA` limits)."""
    return _status_bytes("VmData")


def peak_resident_bytes() -> int:
    """The most physical memory this process has held (VmHWM)."""
    return _status_bytes("VmHWM")


def load_start_up() -> None:
    """Load what every training process loads on its way to the first step: TorchDynamo, which PyTorch's optimizers
    load as they are built (`Optimizer.add_param_group`), tens of MiB of data. Called before measuring a start, so
    that a cap set relative to it leaves the run the whole of its budget."""
    import torch._dynamo  # noqa: F401


def cap_process_memory(cap_bytes: int) -> None:
    """Lower this process's soft and hard `RLIMIT_DATA` to `cap_bytes` (it cannot raise them again unprivileged).
    Raises ValueError if the process already holds more than that. What every training process loads is loaded
    first (`load_start_up`): start-up data, not the run's."""
    load_start_up()
    now = data_bytes()
    if now >= cap_bytes:
        raise ValueError(f"memory cap {cap_bytes / 2**30:.2f} GiB is below this process's {now / 2**30:.2f} GiB "
                         "at start; raise the cap")
    resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, cap_bytes))


def is_out_of_memory(error: BaseException) -> bool:
    """True for the errors a failed allocation raises: PyTorch's CPU allocator's, a file mapping's ENOMEM (reading
    safetensors), CUDA's, Python's MemoryError."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in ("can't allocate memory",
                                                                             "Cannot allocate memory"))


def capped_training(config, dataset, cap_bytes: int | None, steps: int) -> dict | None:
    """In each rank of a world of `config.parallel.context` processes (DP = TP = PP = 1): cap this process's
    memory at `cap_bytes` (None: no cap), build a `Trainer` and run `steps` steps. Returns, on rank 0,
    {"losses", "grad_norms", "peak_resident_bytes" (per rank), "start_data_bytes"} or, if an allocation
    failed, {"out_of_memory": "building the trainer" or "step N", "error": the allocator's message}."""
    import torch.distributed as dist

    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    load_start_up()
    start = data_bytes()
    if cap_bytes is not None:
        cap_process_memory(cap_bytes)
    ctx = ParallelContext.from_process_group(1, context_parallel=config.parallel.context)
    stage, losses, grad_norms = "building the trainer", [], []
    try:
        trainer = Trainer(config, ctx, dataset)
        for step in range(1, steps + 1):
            stage = f"step {step}"
            metrics = trainer.train_step()
            losses.append(metrics["loss"])
            grad_norms.append(metrics["grad_norm"])
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        # A rank out of memory leaves its peers waiting in a collective: only one-process runs return here.
        message = next((line for line in str(error).splitlines() if "allocate" in line), str(error))
        message = message[message.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in message else message
        return {"out_of_memory": stage, "error": message.strip()[:300], "start_data_bytes": start}
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_resident_bytes())
    if dist.get_rank() != 0:
        return None
    return {"losses": losses, "grad_norms": grad_norms, "peak_resident_bytes": peaks, "start_data_bytes": start}
