"""What this CPU's instruction set offers: its `/proc/cpuinfo` flags, or those of a simulated CPU kind.

shardlm reads the flags in a few places (`train.precision = "auto"`, the precision warning, the bench's
precisions and speed goals). Each reads them here, so one environment variable makes the process act as if
it ran on another kind of CPU: `SHARDLM_CPU_KIND=avx2` (or `none`, `avx512`, `avx512_bf16`, `amx`). The tests
run the flag-dependent code under every kind from any machine, and a user can see what a run would choose
elsewhere. Only the decisions follow the simulated kind: the kernels PyTorch runs are still this CPU's
(`ATEN_CPU_CAPABILITY` and `MKL_ENABLE_INSTRUCTIONS` choose those).
"""

from __future__ import annotations

import os

CPU_KIND_ENV = "SHARDLM_CPU_KIND"

_BASE = ("fpu", "sse", "sse2")
_AVX2 = _BASE + ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c")
_AVX512 = _AVX2 + ("avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl")
_AVX512_BF16 = _AVX512 + ("avx512_bf16", "avx512_vnni")
CPU_KINDS: dict[str, frozenset[str]] = {
    "none": frozenset(_BASE),  # no vector unit past SSE2 (PyTorch's "DEFAULT" kernels)
    "avx2": frozenset(_AVX2),  # EPYC Zen 2/3, Haswell to Cascade Lake client parts
    "avx512": frozenset(_AVX512),  # Skylake-SP / Cascade Lake Xeons: AVX-512 without BF16
    "avx512_bf16": frozenset(_AVX512_BF16),  # EPYC Zen 4/5, Cooper Lake
    "amx": frozenset(_AVX512_BF16 + ("avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")),  # Sapphire Rapids on
}
"""The flags of each CPU kind shardlm distinguishes, as /proc/cpuinfo spells them (a representative subset)."""


def simulated_kind() -> str | None:
    """The kind `SHARDLM_CPU_KIND` names (None when unset or empty); an unknown name is a ValueError naming the
    kinds, since a misspelt kind would otherwise silently test this CPU instead."""
    kind = os.environ.get(CPU_KIND_ENV, "").strip().lower()
    if not kind:
        return None
    if kind not in CPU_KINDS:
        raise ValueError(f"{CPU_KIND_ENV}={kind!r} is not a CPU kind; use one of {', '.join(CPU_KINDS)}")
    return kind


def parse_cpuinfo(text: str) -> set[str] | None:
    """The `flags` of the first processor in a /proc/cpuinfo text; None where it has no such line (ARM's
    cpuinfo says `Features`, and other systems have no cpuinfo at all)."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """This CPU's flags: the simulated kind's where `SHARDLM_CPU_KIND` is set, else the first processor's flags
    in `cpuinfo`; None where they cannot be read."""
    kind = simulated_kind()
    if kind is not None:
        return set(CPU_KINDS[kind])
    try:
        with open(cpuinfo) as file:
            return parse_cpuinfo(file.read())
    except OSError:
        return None
