"""Shared fixtures: the shared data folder, one thread per process, and each CPU kind in turn."""

from __future__ import annotations

import os

import pytest
import torch

from shardlm.cpu import CPU_KIND_ENV, CPU_KINDS
from shardlm.paths import DATA_ENV, shared_data_dir

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def data_dir():
    """`../shared/data` (or `$SHARDLM_DATA`). Missing data fails under CI and skips elsewhere."""
    path = shared_data_dir()
    if not path.is_dir():
        message = f"shared test data not found at {path}; set {DATA_ENV}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(params=list(CPU_KINDS))
def cpu_kind(request, monkeypatch):
    """Each CPU kind in turn (`shardlm.cpu.CPU_KINDS`): this process and the processes it starts read that kind's
    flags (`SHARDLM_CPU_KIND`), so code that decides by the CPU's flags is tested on every kind from any machine."""
    monkeypatch.setenv(CPU_KIND_ENV, request.param)
    return request.param


QUICK_BENCH_RUNS = {"test_bench": "quick_run", "test_bench_rl": "rl_run", "test_bench_distill": "run",
                    "test_bench_families": "run", "test_bench_qlora": "run", "test_bench_sparse_attention": "run"}
"""Each bench module's fixture that runs `make bench`'s harness on tiny shapes in a subprocess (`--quick`)."""


def pytest_collection_modifyitems(config, items):
    """A test that reads a quick bench run checks the benchmark harness, not training: marked `bench`, run by
    `make test-bench` (and before `make bench`), left out of `make test` for its time (about 220 core-seconds)."""
    for item in items:
        if QUICK_BENCH_RUNS.get(item.module.__name__) in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.bench)


@pytest.fixture(scope="session", autouse=True)
def trainers_skip_the_device_cache_collection():
    """transformers' `Trainer.train` (TRL's oracles) starts with accelerate's `free_memory`: a full `gc.collect()`
    (tenths of a second in a worker holding the suite's modules, at every oracle run) before emptying a device cache
    that a CPU does not have. Skipped: it changes no number."""
    try:
        from accelerate.utils import memory
    except ImportError:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "clear_device_cache", lambda garbage_collection=False: None)
        yield
