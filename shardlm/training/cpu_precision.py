"""Whether this CPU multiplies bf16 / fp16 matrices in hardware, and the one line that says when it does not.

An x86 CPU multiplies bf16 natively with AVX-512-BF16 or AMX-BF16 and fp16 with AVX-512-FP16 or
AMX-FP16. Without them PyTorch converts every block of a half-precision matmul to fp32 and back, so
the matmuls that dominate a training step run many times slower than in fp32: on a 2-core AVX2 Xeon
a 512 x 1024 x 1024 matmul took 0.07 s in fp32 and 3.5 s in bf16 or fp16, and a GPT-2 355M step
326 s in fp16 against 11-16 s in fp32. `precision_warning` says so at the start of a run; it never
changes the precision the user chose. GPUs are not concerned.

`train.precision = "auto"` (the default) chooses instead (`auto_precision`): bf16 where the matmuls are native
(a CUDA GPU that supports bf16, an x86 CPU with AVX-512-BF16 or AMX-BF16), else fp32; `resolve_precision` writes
the choice into the config before anything reads it and returns the line the run starts with. The flags come from
`shardlm.cpu.cpu_flags`, so `SHARDLM_CPU_KIND` shows what another kind of CPU would choose.
"""

from __future__ import annotations

import time

import torch

from shardlm.cpu import cpu_flags

# precision -> (cpuinfo flags, any of which gives native matmuls; how the features are called)
NATIVE_FLAGS = {
    "bf16": (("avx512_bf16", "amx_bf16"), "AVX-512-BF16 or AMX-BF16"),
    "fp16": (("avx512_fp16", "amx_fp16"), "AVX-512-FP16 or AMX-FP16"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def has_native_matmul(precision: str, flags: set[str]) -> bool:
    """Whether a CPU with these flags multiplies `precision` ("fp32", "bf16", "fp16") matrices in hardware."""
    return precision == "fp32" or any(flag in flags for flag in NATIVE_FLAGS[precision][0])


def matmul_slowdown(precision: str, size: int = 128, repeats: int = 3) -> float:
    """How many times longer a size x size x size matmul takes in `precision` than in fp32 on this CPU
    (best of `repeats` each; about 0.1 s where the half precision is emulated)."""

    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        a @ b  # first call: allocation and kernel choice
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    return best(DTYPES[precision]) / max(best(torch.float32), 1e-9)


def auto_precision(device: torch.device, flags: set[str] | None = None,
                   cuda_bf16: bool | None = None) -> tuple[str, str]:
    """(precision, why) that `train.precision = "auto"` picks on `device`: "bf16" where its matmuls multiply bf16
    natively, else "fp32". `flags`: the CPU's (`cpu_flags()` when None); `cuda_bf16`: whether the GPU supports
    bf16 (`torch.cuda.is_bf16_supported()` when None)."""
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        return ("bf16", "this GPU multiplies bf16 natively") if supported else (
            "fp32", "this GPU does not support bf16")
    if device.type != "cpu":
        return "fp32", f"no bf16 rule for {device.type} devices"
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return "fp32", "this CPU's features could not be read from /proc/cpuinfo"
    native = [flag for flag in NATIVE_FLAGS["bf16"][0] if flag in flags]
    if native:
        return "bf16", f"this CPU multiplies bf16 natively ({', '.join(native)})"
    return "fp32", ("this CPU has no AVX-512-BF16 or AMX-BF16, so bf16 matmuls would be emulated, many times slower; "
                    'set train.precision="bf16" to force it')


def resolve_precision(train, device: torch.device, all_ranks: bool = False) -> str | None:
    """Replace `train.precision = "auto"` (a `TrainConfig`) with `auto_precision`'s choice on `device`; the line
    that says which and why, or None when the config named a precision.

    `all_ranks`: a collective over the default process group (every rank must call it) so that the ranks agree:
    bf16 only where every rank multiplies it natively. Ranks of one job on machines of different CPU kinds would
    otherwise train in different precisions and send each other tensors of different dtypes."""
    if train.precision != "auto":
        return None
    train.precision, why = auto_precision(device)
    if all_ranks and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        native = torch.tensor([int(train.precision == "bf16")], device=device)
        torch.distributed.all_reduce(native, op=torch.distributed.ReduceOp.MIN)
        if train.precision == "bf16" and not native.item():
            train.precision, why = "fp32", "another rank's device would emulate bf16 (this one multiplies it natively)"
    return f'train.precision="auto": {train.precision}: {why}'


def precision_warning(precision: str, device: torch.device) -> str | None:
    """One line when `precision` has no native matmuls on this CPU: what is missing, how much slower a
    quick matmul probe ran than fp32, and which precision to use instead. None on GPUs, for fp32, for
    CPUs with the feature, and where the CPU's flags cannot be read."""
    if device.type != "cpu" or precision == "fp32":
        return None
    flags = cpu_flags()
    if flags is None or has_native_matmul(precision, flags):
        return None
    other = "bf16" if precision == "fp16" else "fp16"
    instead = other if has_native_matmul(other, flags) else "fp32"
    return (f'train.precision="{precision}" has no native matrix support on this CPU (no '
            f"{NATIVE_FLAGS[precision][1]}): its matmuls are emulated and ran {matmul_slowdown(precision):.0f}x "
            f"slower than fp32 in a quick probe, so expect much slower steps; train.precision={instead} is faster "
            f"here (keeping {precision} as asked)")
