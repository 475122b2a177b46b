"""A sequence too long for one process's memory trains under context parallelism (small size, seconds).

The cap is real: a worker that lowers its RLIMIT_DATA gets PyTorch's out-of-memory error for an allocation
past it (a large tensor, which the allocator maps with mmap) and the same allocation succeeds uncapped. At a
Llama of hidden 64 and 8,192 tokens, with every process capped 240 MiB above a fresh worker's start (one
process's step needs about 305 MiB over it, a rank of C = 4 about 180 MiB), one process runs out of memory in
step 1 and 4 processes train 2 steps with the losses and gradient norms of an uncapped process within 1e-5.
A cap that does not hold, or a split that does not split the sequence's activations, fails it.
"""

from __future__ import annotations

import pytest
import torch

from shardlm.bench.context_parallel import CAP_TOLERANCE, CPShape, memory_cap_demo
from shardlm.bench.memory_cap import cap_process_memory, data_bytes, is_out_of_memory, load_start_up
from shardlm.parallel.spawn import run_workers

pytestmark = pytest.mark.timeout(400)

MIB = 2**20
SHAPE = CPShape(hidden_size=64, ffn_hidden_size=128, seq_length=8192)
HEADROOM = 240 * MIB


def allocate_past_the_cap(capped: bool) -> str:
    """In a fresh worker: cap at 64 MiB above its start (or not), then allocate a 128 MiB tensor."""
    if capped:
        load_start_up()  # loaded by `cap_process_memory` anyway: measured before the start
        cap_process_memory(data_bytes() + 64 * MIB)
    try:
        torch.ones(128 * MIB // 4)
    except (RuntimeError, MemoryError) as error:
        return "out of memory" if is_out_of_memory(error) else f"other error: {error}"
    return "allocated"


def test_an_allocation_past_the_cap_is_an_out_of_memory_error_and_fits_without_it():
    assert run_workers(1, allocate_past_the_cap, True, init=False) == ["out of memory"]
    assert run_workers(1, allocate_past_the_cap, False, init=False) == ["allocated"]


def test_a_cap_below_the_process_start_is_refused():
    with pytest.raises(ValueError, match="below this process"):
        cap_process_memory(MIB)


def test_one_process_runs_out_of_memory_and_four_train_under_the_same_cap():
    start = run_workers(1, data_bytes, init=False)[0]
    result = memory_cap_demo(SHAPE, start + HEADROOM, context=4, steps=2)
    one, split, reference = result["one_process"], result["split"], result["reference_uncapped"]
    assert one.get("out_of_memory") == "step 1", one
    assert "can't allocate memory" in one["error"]
    assert len(split.get("losses", [])) == 2, split
    assert len(reference["losses"]) == 2 and len(split["grad_norms"]) == len(reference["grad_norms"]) == 2
    for what in ("losses", "grad_norms"):  # recomputed here from the two curves, not taken from the bench
        for got, want in zip(split[what], reference[what]):
            assert abs(got - want) <= CAP_TOLERANCE * abs(want), (what, got, want)
    assert result["demonstrated"] is True
    assert reference["peak_resident_bytes"][0] > max(split["peak_resident_bytes"])  # each rank held less
