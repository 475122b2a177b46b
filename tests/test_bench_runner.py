"""`python -m shardlm.bench`'s runner: every section in its own process, its figures merged back, a failed or
dead section reported while the others run, and a misspelt section refused before anything runs. (The quick run of
tests/test_bench.py checks every section's figures through this runner.)"""

from __future__ import annotations

import os
import pickle

import pytest

from shardlm.bench import __main__ as bench

pytestmark = pytest.mark.timeout(120)


def test_a_misspelt_section_is_refused_in_one_line(capsys, tmp_path):
    for argv in (["--only", "familes"], ["--skip", "rl", "famillies"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main([*argv, "--out", str(tmp_path)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "no section named" in err and argv[-1] in err and "families" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_section_reports_its_figures_and_the_keys_it_set(tmp_path):
    out = tmp_path / "section.pkl"

    def section(results):
        results["mfu"] = {"fraction": 0.5}  # a key beside the section's own, as train_vs_hf sets `mfu`
        return {"pid": os.getpid()}

    assert bench._run_section("train_vs_hf", section, out) == 0
    assert pickle.loads(out.read_bytes()) == {"errors": {}, "train_vs_hf": {"pid": os.getpid()},
                                              "mfu": {"fraction": 0.5}}


def test_a_failing_section_is_an_error_and_still_reports(tmp_path):
    out = tmp_path / "section.pkl"

    def section(results):
        raise ValueError("no vocabulary at /nowhere\nsecond line")

    assert bench._run_section("eval", section, out) == 0
    assert pickle.loads(out.read_bytes()) == {"errors": {"eval": "ValueError: no vocabulary at /nowhere"}}


def test_each_section_runs_in_a_new_process_and_merges(tmp_path):
    results = {"errors": {}, "quick": True}
    # the checkpoint section at its quick size: a real section, run by a child process
    assert bench._in_own_process("checkpoint", ["--quick", "--repeats", "2", "--out", str(tmp_path)], results)
    assert results["errors"] == {} and results["quick"] is True
    assert results["checkpoint"]  # its figures came back


def test_a_section_whose_process_dies_is_an_error(tmp_path):
    results = {"errors": {"before": "kept"}}
    # the child refuses its arguments (exit 2) before running anything: it reports nothing
    assert not bench._in_own_process("eval", ["--repeats", "two", "--out", str(tmp_path)], results)
    assert results["errors"] == {"before": "kept",
                                 "eval": "the section's process exited with code 2 before reporting"}
