"""`graph_break`: a decorated function is a graph break under `torch.compile` (it runs eagerly, outside the trace, and
the compiled caller gives the eager answer), whether `train.compile` armed the boundaries first or a trace meets
the function before that; while nothing compiles it is called directly, without loading TorchDynamo.
The compiled layers with the real boundaries (collectives, QK-clip's maxima) are `test_compile.py`'s and
`test_compile_graphs.py`'s; these use TorchDynamo's eager backend (no C++ compiler needed)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch._dynamo.utils import counters

from shardlm.parallel import graph_break

SEEN: list[bool] = []


@graph_break.graph_break
def boundary(x: torch.Tensor) -> torch.Tensor:
    """Records whether it runs inside a trace; an operation a trace would otherwise fold into its graph."""
    SEEN.append(torch.compiler.is_compiling())
    return x * 3


def caller(x: torch.Tensor) -> torch.Tensor:
    return boundary(x.sin()).cos()


def compiled_run(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """caller compiled afresh: its output and the number of graphs TorchDynamo made of it."""
    torch._dynamo.reset()
    counters.clear()
    SEEN.clear()
    out = torch.compile(caller, backend="eager")(x)
    return out, counters["stats"]["unique_graphs"]


def test_a_boundary_is_a_graph_break_before_and_after_arming():
    x = torch.randn(4, 3)
    for when in ("traced before arming", "armed"):
        if when == "armed":
            graph_break.arm()
        out, graphs = compiled_run(x)
        assert torch.equal(out, caller(x)), when
        assert graphs == 2, f"{when}: {graphs} graphs (the code before the boundary and after it)"
        assert SEEN[0] is False, f"{when}: the boundary ran inside the trace"


def test_without_compiling_a_boundary_is_a_plain_call_and_loads_no_dynamo():
    """In a fresh process: a collective's wrapper (a group of one) runs and TorchDynamo stays unloaded."""
    code = ("import sys, torch\n"
            "from shardlm.parallel import ParallelContext\n"
            "ctx = ParallelContext.single()\n"
            "assert torch.equal(ctx.tp.all_reduce(torch.ones(2)), torch.ones(2))\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", done.stdout
