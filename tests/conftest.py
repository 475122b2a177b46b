"""Shared fixtures: the shared data folder, and one thread per process."""

from __future__ import annotations

import os

import pytest
import torch

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
