"""The README stays true: its config reference is the one the code documents, its commands exist."""

from __future__ import annotations

import re
from pathlib import Path

from shardlm.config import describe

ROOT = Path(__file__).resolve().parents[1]


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", readme, re.S)
    assert match, "README lost its config reference markers"
    assert match.group(1).strip() == describe().strip(), (
        "README config reference is stale: regenerate it with "
        "python -c 'from shardlm.config import describe; print(describe())'")


def test_readme_quick_start_is_the_ci_command():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
