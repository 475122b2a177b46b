"""What shardlm actually allocates on this machine, to check the planner's memory model against.

- `state_bytes`: bytes of a trainer's parameters, gradients (unique storages, so DDP's bucket views
  count once) and optimizer state tensors;
- `saved_activation_bytes`: bytes of the tensors autograd saves for backward during one forward
  pass, through `torch.autograd.graph.saved_tensors_hooks`. Each storage counts once (views such as
  q, k, v of the fused QKV output share one), parameters are excluded, and every saved tensor is
  attributed to the transformer layer that was running when it was saved. Exact and deterministic.
- `SavedPeak`: the most bytes saved for backward alive at once (the in-flight micro-batches of a
  pipeline schedule);
- `PeakMemory`: live bytes of the tensors created while it is active, and their peak, tracked per
  storage through a dispatch mode (so it works on the CPU, where PyTorch keeps no allocator stats);
- `measure_trainer_memory`: all of the above for a real `Trainer` after an optimizer step;
- `measure_cpu_hardware`: GEMM FLOP/s, streaming bandwidth and all-reduce bandwidth/latency of one
  process, to describe this CPU to the time model as if it were a GPU;
- `time_steps`: wall time of training steps (for the CPU step-time comparison).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

OUTSIDE = "outside"


@dataclass
class SavedBytes:
    """Bytes saved for backward in one forward pass, by where they were saved."""

    by_layer: dict[int, int] = field(default_factory=dict)
    """Transformer layer index -> bytes its forward saved."""
    outside_layers: int = 0
    """Embedding, final LayerNorm, LM head, loss."""

    @property
    def total(self) -> int:
        return sum(self.by_layer.values()) + self.outside_layers


def saved_activation_bytes(model: nn.Module, forward, layers: list[nn.Module]) -> SavedBytes:
    """Run `forward()` (which calls `model`, and may run the backward too) and sum the bytes of every
    tensor saved for backward while it runs. `layers` are the transformer blocks to attribute saved
    tensors to; anything saved outside them counts as `outside_layers`. `forward`'s result is dropped.
    """
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    result = SavedBytes()
    current: list[int | None] = [None]

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameter_storages and pointer not in seen and storage.nbytes() > 0:
            seen.add(pointer)
            if current[0] is None:
                result.outside_layers += storage.nbytes()
            else:
                result.by_layer[current[0]] = result.by_layer.get(current[0], 0) + storage.nbytes()
        return tensor

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=index: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = forward()
    finally:
        for handle in handles:
            handle.remove()
    del output
    return result


class SavedPeak:
    """`with SavedPeak(model) as m:` tracks the storages autograd saves for backward inside the block (each
    storage once, parameters excluded) for as long as they stay alive: `m.live` bytes now, `m.peak` the
    most at once. Under a pipeline schedule that is the activations of the micro-batches in flight."""

    def __init__(self, model: nn.Module):
        self._parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _free(self, pointer: int) -> None:
        self.live -= self._sizes.pop(pointer)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._parameters and pointer not in self._sizes and storage.nbytes() > 0:
            self._sizes[pointer] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, pointer)
        return tensor

    def __enter__(self) -> SavedPeak:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class PeakMemory(TorchDispatchMode):
    """`with PeakMemory() as m:` tracks every tensor storage an operator creates inside the block:
    `m.live` is the bytes of those still alive, `m.peak` the most alive at once. Tensors that existed
    before (parameters, optimizer state) are not counted, nor their views; views and in-place results
    of new tensors share their storage and count once. Autograd's backward runs inside the same
    context, so a forward + backward gives the peak of activations, temporaries and newly created
    gradients together."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, pointer: int) -> None:
        self.live -= self._sizes.pop(pointer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                pointer = storage.data_ptr()
                # a view or in-place result of an input allocates nothing (e.g. a slice of a parameter, or
                # of the shared-memory segment the collectives write into)
                if storage.nbytes() and pointer not in self._sizes and pointer not in inputs:
                    self._sizes[pointer] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, pointer)
        return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped): views of one buffer count once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def state_bytes(params: list[torch.Tensor], optimizer) -> dict[str, int]:
    """Bytes of the storages behind parameters, their gradients (DDP bucket views, or the master-weight
    optimizer's fp32 `main_grad` buffer, count once) and the optimizer's state (with
    `training.master_weights`: its fp32 master range where it is not the parameters themselves, and the
    AdamW moments and steps of its segments)."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in params}
    grads = [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in params]
    masters = [segment for segment in getattr(optimizer, "segments", [])
               if segment.untyped_storage().data_ptr() not in parameter_storages]
    state = [value for per_param in optimizer.state.values() for value in per_param.values()
             if isinstance(value, torch.Tensor)]
    return {"parameters": _storage_bytes(params), "gradients": _storage_bytes(grads),
            "optimizer": _storage_bytes(masters) + _storage_bytes(state)}


def autocast_context(precision: str, device: torch.device):
    """The autocast the trainer uses for `precision` ("fp32": none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


def time_steps(step, repeats: int = 5, warmup: int = 1, statistic=statistics.median) -> float:
    """`statistic` (median, or min on a shared machine) of the seconds of `repeats` calls of `step()`
    after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistic(times)


def measure_trainer_memory(trainer, tokens: torch.Tensor, targets: torch.Tensor) -> dict:
    """What a `shardlm.training.trainer.Trainer` allocates on this rank, beside what it saves.

    Takes one optimizer step (so AdamW has created its state), then one forward pass on
    `tokens`/`targets` (B, T) with the saved-tensor hooks, and its backward (so gradients exist, as
    DDP bucket views when DP > 1); then, gradients cleared, the same forward + backward under
    `PeakMemory`. Returns parameter elements, state bytes, saved bytes and `peak_step`: the most bytes
    alive at once during that forward + backward beyond parameters and optimizer state (activations,
    temporaries such as the logits, and the gradients as they appear).
    """
    trainer.train_step()
    model = trainer.model
    forward_module = trainer.ddp or model

    def forward():
        with autocast_context(trainer.config.train.precision, trainer.ctx.device):
            loss = forward_module(tokens, targets).mean()
        loss.backward()
        return loss

    saved = saved_activation_bytes(model, forward, list(model.layers.values()))
    state = state_bytes(trainer.params, trainer.optimizer)
    trainer.optimizer.zero_grad(set_to_none=True)  # gradients are created again inside the peak pass
    with PeakMemory() as memory:
        forward()
    return {"parameter_elements": sum(p.numel() for p in model.parameters()), **state,
            "saved_by_layer": saved.by_layer, "saved_outside": saved.outside_layers, "saved_total": saved.total,
            "peak_step": memory.peak}


def cpu_as_gpu(hardware: CPUHardware, gpus_per_node: int = 2):
    """This CPU described as a GPU preset: one process = one device, `gpus_per_node` of them per "node",
    the gloo all-reduce bandwidth as both the intra- and the inter-node link."""
    from shardlm.plan.hardware import GPUSpec

    return GPUSpec(name="cpu", memory_gb=1e3, peak_tflops=hardware.matmul_flops / 1e12,
                   hbm_gbps=hardware.memory_bytes_per_s / 1e9, gpus_per_node=gpus_per_node,
                   intra_node_gbps=2 * hardware.allreduce_bytes_per_s / 1e9,
                   inter_node_gbps=hardware.allreduce_bytes_per_s / 1e9)


@dataclass(frozen=True)
class CPUHardware:
    """This machine's speeds as seen by one process of a world (all processes busy at once)."""

    matmul_flops: float
    """fp32 GEMM FLOP/s of one process."""
    memory_bytes_per_s: float
    """Streaming bandwidth of one process (read + write bytes of an in-place add)."""
    allreduce_bytes_per_s: float
    """Per-direction bandwidth of a ring all-reduce over the given communicator (0 if it has one rank)."""
    allreduce_latency_s: float
    """Per ring step, from a one-element all-reduce."""


def measure_cpu_hardware(comm=None, size: int = 512, stream_elements: int = 1 << 22,
                         message_elements: int = 1 << 20) -> CPUHardware:
    """Micro-benchmarks behind the CPU "GPU preset": a square GEMM, an in-place add, and (with a
    communicator of p > 1 ranks) a large and a tiny all-reduce, converted with the ring formula."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    gemm = time_steps(lambda: torch.mm(a, b), repeats=7)
    x, y = torch.randn(stream_elements), torch.randn(stream_elements)
    stream = time_steps(lambda: x.add_(y), repeats=7)
    bandwidth = latency = 0.0
    if comm is not None and comm.size > 1:
        p = comm.size
        message = torch.ones(message_elements)
        big = time_steps(lambda: comm.all_reduce(message), repeats=5)
        tiny = torch.ones(1)
        small = time_steps(lambda: comm.all_reduce(tiny), repeats=20, warmup=3)
        latency = small / (2 * (p - 1))
        bandwidth = 2 * (p - 1) / p * message.numel() * 4 / max(big - small, 1e-9)
    return CPUHardware(matmul_flops=2 * size**3 / gemm, memory_bytes_per_s=3 * x.numel() * 4 / stream,
                       allreduce_bytes_per_s=bandwidth, allreduce_latency_s=latency)
