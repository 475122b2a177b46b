"""`graph_break`: `torch.compiler.disable` for the functions that `torch.compile` must run as they are.

Collectives, the MoE token exchange, ring attention, recomputation under the RNG tracker and QK-clip's logit maxima
are graph breaks under `train.compile`: TorchDynamo calls them eagerly instead of tracing into them.
`torch.compiler.disable` puts a wrapper around every call, compiled run or not, which switches the interpreter's
frame evaluation off and on again (measured: 7 to 24% of the CPU of a two-rank TP or CP training case of the tests'
tiny models, whose steps are mostly such calls), and applied at import time it loads TorchDynamo into every
process (about a second of CPU; `shardlm` commands that build no optimizer, which loads it, are spared it).

Here the decorated function is called directly while nothing is being compiled. `arm()`, which `train.compile`
calls before it compiles the layers, wraps each one with `torch.compiler.disable` once, so that TorchDynamo
finds the disabled function from the first trace on. A function reached by a trace before `arm()` (a
`torch.compile` of shardlm's modules outside `train.compile`) is disabled at that point, as PyTorch's own
lazily disabled functions are: the trace breaks there too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_DISABLED: dict[Callable, Callable] = {}
"""Each decorated function -> its `torch.compiler.disable`d form, once armed."""
_DECORATED: list[Callable] = []


def _disabled(fn: Callable) -> Callable:
    """`fn` under `torch.compiler.disable`, made once."""
    if fn not in _DISABLED:
        _DISABLED[fn] = torch.compiler.disable(fn)
    return _DISABLED[fn]


def graph_break(fn: Callable) -> Callable:
    """Decorator: `fn` runs eagerly under `torch.compile` (a graph break), as with `torch.compiler.disable`,
    without importing TorchDynamo or wrapping the call while nothing compiles (module docstring)."""
    _DECORATED.append(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = _DISABLED.get(fn)
        if disabled is None:
            if not torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            disabled = _disabled(fn)
        return disabled(*args, **kwargs)

    return call


def arm() -> None:
    """Disable every decorated function for TorchDynamo now (it imports TorchDynamo): `train.compile` calls this
    before compiling, so each trace meets the disabled functions and breaks there once."""
    for fn in _DECORATED:
        _disabled(fn)
