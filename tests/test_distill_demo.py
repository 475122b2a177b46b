"""scripts/distill_demo.py (`make demo-distill`) end to end at toy sizes: a teacher, a distilled and an SFT student
of two steps each on 40 Dolly records, both students' validation divergence from the teacher at every step. Not the
learning claim (that needs the full run, docs/distillation.md): that the demo measures what it says it does."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.learning  # the demo script end to end: `make test-learning`, beside the demos

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "distill_demo.py"
KEYS = {"teacher", "student", "steps", "eval_every", "divergence", "held_out", "curves", "cross_entropy",
        "distilled_run_val_loss", "wall_s", "cpu_s", "cpu", "cores", "threads", "distilled_passes_sft_final_at"}


def demo():
    spec = importlib.util.spec_from_file_location("distill_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_demo(data_dir, out: Path, *extra: str, steps: int = 2) -> dict:
    """The demo at toy sizes: 40 records (4 held out), rows of 64 tokens (the logits over the 151,936-token
    vocabulary are most of a step's time), `steps` steps of each run, scored every step."""
    records = out.parent / "records.jsonl"
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines(True)[:40]
    records.write_text("".join(lines))
    sets = [f'sft.data=["{records}"]', "sft.valid_fraction=0.1", "model.seq_length=64", *extra]
    code = demo().main([str(out), "--teacher-steps", str(steps), "--student-steps", str(steps), "--eval-every", "1",
                        *[arg for value in sets for arg in ("--set", value)]])
    assert code == 0
    return json.loads((out / "distill_demo.json").read_text())


@pytest.mark.timeout(120)
def test_the_demo_writes_both_students_curves(data_dir, tmp_path, capsys):
    """The JSON has its keys and a divergence at steps 0, 1 and 2 for each student, equal at step 0 (one init);
    the evaluator's last divergence of the distilled student is the run's own validation loss (the same
    DistillLoss on the same held-out rows); the PNG is written and the figures printed."""
    out = tmp_path / "demo"
    summary = run_demo(data_dir, out)
    assert set(summary) == KEYS, set(summary) ^ KEYS
    curves = summary["curves"]
    assert set(curves) == {"distilled", "sft"} == set(summary["cross_entropy"])
    for name in curves:
        assert [step for step, _ in curves[name]] == [0, 1, 2], curves
        assert all(0 < value < math.log(2) for _, value in curves[name]), curves  # jsd at beta 0.5 is below ln 2
        assert all(5 < value < 13 for _, value in summary["cross_entropy"][name]), summary["cross_entropy"]
    assert curves["distilled"][0] == curves["sft"][0]
    assert curves["distilled"][1:] != curves["sft"][1:], "the two students trained differently"
    assert abs(curves["distilled"][-1][1] - summary["distilled_run_val_loss"]) < 1e-5, summary
    assert summary["steps"] == 2 and summary["teacher"]["steps"] == 2
    assert summary["held_out"].startswith("4 held-out conversations"), summary["held_out"]
    assert (out / "distill_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (out / "sft" / "checkpoints").glob("step_*")] == ["step_00000002"], "pruned"
    printed = capsys.readouterr().out
    assert f"{curves['sft'][-1][1]:.4f}" in printed and "s CPU" in printed, printed


@pytest.mark.timeout(120)
def test_both_students_start_from_the_evaluators_init(data_dir, tmp_path):
    """At a learning rate of 1e-30 (0 is refused) no step moves a weight (Adam's update of about 1e-30 is far
    below an fp32 weight's rounding), so every checkpoint of both CLI runs holds the init they started from: scored
    like the trained ones, each equals the step-0 score of the evaluator's own init. The comparison of the two
    students rests on it (the same random init, the same measure)."""
    summary = run_demo(data_dir, tmp_path / "demo", "train.lr=1e-30", "train.min_lr=0.0", steps=1)
    start = summary["curves"]["distilled"][0][1]
    for name in ("distilled", "sft"):
        assert [value for _, value in summary["curves"][name]] == [start] * 2, summary["curves"]
