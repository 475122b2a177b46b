"""Where shardlm finds the shared test and evaluation data."""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "SHARDLM_DATA"


def shared_data_dir() -> Path:
    """The shared data folder: `$SHARDLM_DATA`, else `../shared/data` beside the repository."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data"
