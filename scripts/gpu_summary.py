"""Gather a `scripts/gpu_check.sh` run's logs into OUT_DIR/summary.json: `python scripts/gpu_summary.py OUT_DIR`.

It reads OUT_DIR/steps.tsv (step, exit code, seconds, limit; one line per step, in the order they ran) and each
step's OUT_DIR/<step>.log, and writes one JSON object:
- "env": the GPU, the versions and the measured bf16 GEMM rate (the env step's JSON line);
- "steps": per step, in order: its exit code, seconds and limit, and what its log says: a pytest step's counts
  ("passed", "failed", "skipped", "errors"), a training step's last loss, tokens/s, final validation loss and
  whether it saved a checkpoint, a benchmark step's number of figure lines;
- "bench": every benchmark figure line outside the side-by-side runs (shape, step_s, tokens/s, TFLOP/s, MFU, peak
  memory);
- "side_by_side": the `--against` summary lines (the ratio, its spread, each tree's median figures), and
  "side_by_side_runs", the per-run lines (with each process's seconds, "wall_s");
- "operator_diff": the `--against --profile` lines, operators whose call counts differ;
- "seconds": the steps' total.
A log it cannot read (a step killed mid-line, say) leaves that part out; the summary is always written.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PYTEST = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")
PYTEST_END = re.compile(r"\b(passed|failed|skipped|errors?|no tests ran)\b.* in [\d.]+s")
TRAIN_STEP = re.compile(r"^step\s+(\d+)/(\d+) \| loss ([\d.]+).*\| ([\d.]+) tokens/s")
FINAL_VAL = re.compile(r"^final validation loss ([\d.]+)")
FIGURE_KEYS = ("shape", "micro_batch", "global_batch", "param_dtype", "compile", "step_s", "tokens_per_sec", "tflops",
               "mfu", "peak_memory_gb", "error")


def json_lines(text: str) -> list[dict]:
    """The lines of `text` that are JSON objects."""
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def pytest_counts(text: str) -> dict | None:
    """A pytest log's final counts, e.g. {"passed": 8, "failed": 1, "skipped": 0, "errors": 0}; None if it has no
    final line (not a pytest log, or killed before the end)."""
    ends = [line for line in text.splitlines() if PYTEST_END.search(line)]
    if not ends:
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for number, kind in PYTEST.findall(ends[-1]):
        kind = "errors" if kind.startswith("error") else kind
        counts[kind] = counts.get(kind, 0) + int(number)
    return counts


def train_figures(text: str) -> dict | None:
    """A `shardlm train` log's last step, loss and tokens/s, final validation loss and whether it saved a
    checkpoint; None if it logged no step."""
    steps = [m for m in map(TRAIN_STEP.match, text.splitlines()) if m]
    if not steps:
        return None
    last = steps[-1]
    finals = [m for m in map(FINAL_VAL.match, text.splitlines()) if m]
    return {"last_step": int(last[1]), "steps": int(last[2]), "last_loss": float(last[3]),
            "tokens_per_sec": float(last[4]), "final_val_loss": float(finals[-1][1]) if finals else None,
            "checkpoint_saved": "saved checkpoint" in text}


def read_steps(out: Path) -> list[dict]:
    """steps.tsv's rows as {"step", "exit", "seconds", "limit"} ("exit": "skipped" for a skipped step)."""
    rows = []
    path = out / "steps.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        fields = line.split("\t")
        if len(fields) == 4:
            name, rc, seconds, limit = fields
            rows.append({"step": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc,
                         "seconds": int(seconds), "limit": int(limit)})
    return rows


def summarize(out: Path) -> dict:
    """The summary object of the check whose logs are in `out` (see the module's docstring)."""
    summary = {"env": None, "steps": [], "bench": [], "side_by_side": [], "side_by_side_runs": [],
               "operator_diff": [], "seconds": 0}
    for row in read_steps(out):
        log = out / f"{row['step']}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        rows = json_lines(text)
        for line in rows:
            if line.get("env"):
                summary["env"] = {k: v for k, v in line.items() if k != "env"}
            elif line.get("summary") == "side_by_side":
                summary["side_by_side"].append({"step": row["step"], **line})
            elif "diff" in line or "diff_count" in line:
                summary["operator_diff"].append(line)
            elif "tree" in line and "step_s" in line:
                summary["side_by_side_runs"].append({k: line.get(k) for k in (*FIGURE_KEYS, "tree", "round", "wall_s")})
            elif "step_s" in line or "error" in line:
                summary["bench"].append({"step": row["step"], **{k: line[k] for k in FIGURE_KEYS if k in line}})
        figures = sum("step_s" in line for line in rows)
        found = {"tests": pytest_counts(text), "train": train_figures(text), "figures": figures or None}
        summary["steps"].append({**row, **{k: v for k, v in found.items() if v is not None}})
        summary["seconds"] += row["seconds"]
    return summary


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/gpu_summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
