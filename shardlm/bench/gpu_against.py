"""`python -m shardlm.bench.gpu --against REV`: the GPU benchmark of revision REV's tree and of the working tree,
side by side on one machine, so that a change shows as a ratio measured minutes apart. Absolute figures taken weeks
apart hid a 4% slower GPT-2 1.5B step (1.436 s on main against 1.375 s on 46f234c, the same settings).

Each run is its own process: `python -m shardlm.bench.gpu` with the tree as its working directory and first on
PYTHONPATH, so the two trees share no module, compiled graph in memory or allocator state. REV is a git revision
(its `shardlm/` is extracted with `git archive` into a temporary folder, removed afterwards, also on an error,
Ctrl-C or SIGTERM) or a folder that holds a `shardlm` package (as `scripts/gpu_check.sh --prepare` leaves one for a
machine without the git history; a REVISION file in it names it).

Order: ABBA. Round r runs REV first and then the working tree for even r, the other way round for odd r. Separate
processes share no warm state, but the machine drifts over minutes (the GPU's clocks and temperature, other load).
Under ABAB one tree would always run second; under ABBA a drift that is linear in time favours each tree equally
over each pair of rounds, so an even `--rounds` cancels it in the median.

Output, one JSON line each: every run's figures tagged {"tree": "rev" | "work", "round": r}; with `--profile N`,
after the first round, the operators of the profiled step whose call counts differ between the trees (a
{"diff_count"} line, then up to N {"diff": operator} lines, the largest time difference first); at the end one
{"summary": "side_by_side"} line per shape: "ratio" = REV's step time / the working tree's (> 1: the working tree
is faster), the median over rounds, with "ratio_min" and "ratio_max" over the rounds, and each tree's median
step_s, tokens/s, MFU and peak memory. An interrupted or failed comparison still prints the summary of its complete
rounds, marked "complete": false. Each run's lines carry "wall_s", its process's seconds (compilation included).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlm.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
"""The working tree: the repository that holds this module."""
EVERY_OPERATOR = 1_000_000
"""The `--profile` count each tree's profiled run gets: all its operators, for the diff."""
FIGURES = ("step_s", "tokens_per_sec", "mfu", "peak_memory_gb")
NOT_FORWARDED = {"help", "shapes", "against", "rounds", "profile"}


class RunFailed(Exception):
    """One tree's benchmark process failed (not a problem with the options)."""


class Interrupted(Exception):
    """SIGTERM (as `timeout` sends) while comparing."""


def bench_argv(args, parser) -> list[str]:
    """The options of each tree's run: the shapes always, every other option only where it differs from its
    default (so a revision older than an option the user leaves alone still runs)."""
    argv = ["--shapes", *args.shapes]
    for action in parser._actions:
        if not action.option_strings or action.dest in NOT_FORWARDED:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def rev_tree(against: str, into: str) -> tuple[str, Path]:
    """(label, root) of the tree to compare with: a folder that holds a `shardlm` package as it is, else git
    revision `against`'s `shardlm/` extracted into the folder `into`."""
    folder = Path(against)
    if (folder / "shardlm" / "__init__.py").is_file():
        name = folder / "REVISION"
        return (name.read_text().strip() if name.is_file() else str(folder)), folder.resolve()
    git = ["git", "-C", str(ROOT)]
    try:
        found = subprocess.run([*git, "rev-parse", "--verify", "--quiet", f"{against}^{{commit}}"],
                               capture_output=True, text=True)
    except FileNotFoundError:
        found = None
    if found is None or found.returncode != 0:
        raise UserError(f"--against {against}: neither a revision of {ROOT} nor a folder holding a shardlm package")
    sha = found.stdout.strip()
    archive = subprocess.Popen([*git, "archive", sha, "shardlm"], stdout=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", into], stdin=archive.stdout, capture_output=True, text=True)
    archive.stdout.close()
    if archive.wait() != 0 or tar.returncode != 0:
        raise RunFailed(f"could not extract {against}'s shardlm/: {tar.stderr.strip()[-300:]}")
    return sha[:10], Path(into)


def run_tree(root: Path, argv: list[str], label: str) -> list[dict]:
    """The JSON lines that `python -m shardlm.bench.gpu ARGV` prints when run from the tree at `root`, each with
    "wall_s", the process's seconds (start-up and compilation included)."""
    start = time.perf_counter()
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", "shardlm.bench.gpu", *argv], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": path})
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit code {proc.returncode}"
        if proc.returncode == 2 and "usage:" in proc.stderr:
            raise UserError(f"{label}'s bench.gpu refuses these options ({last})")
        print("\n".join(lines[-20:]), file=sys.stderr)
        raise RunFailed(f"{label}'s run failed with exit code {proc.returncode}: {last}")
    wall = round(time.perf_counter() - start, 1)
    return [{**json.loads(line), "wall_s": wall} for line in proc.stdout.splitlines() if line.startswith("{")]


def operator_diff(rev_ops: list[dict], work_ops: list[dict]) -> list[dict]:
    """The operators whose call counts differ between two profiles of one step (rows {"op", "calls", "ms"}), as
    {"diff": op, "calls_rev", "calls_work", "ms_rev", "ms_work", "ms_diff": work - rev}, the largest |ms_diff|
    first. Rows with the same (truncated) name are added together."""
    totals: dict[str, dict] = {}
    for tree, ops in (("rev", rev_ops), ("work", work_ops)):
        for op in ops:
            row = totals.setdefault(op["op"], {"diff": op["op"], "calls_rev": 0, "calls_work": 0,
                                               "ms_rev": 0.0, "ms_work": 0.0})
            row[f"calls_{tree}"] += op["calls"]
            row[f"ms_{tree}"] += op["ms"]
    rows = [{**row, "ms_diff": row["ms_work"] - row["ms_rev"]} for row in totals.values()
            if row["calls_rev"] != row["calls_work"]]
    return sorted(rows, key=lambda row: abs(row["ms_diff"]), reverse=True)


def diff_lines(rev_rows: list[dict], work_rows: list[dict], top: int) -> list[dict]:
    """Per shape: one {"diff_count"} line (how many operators differ in calls, each tree's profiled time), then
    the `top` largest differences of `operator_diff`, each tagged with its shape."""
    lines = []
    for shape in dict.fromkeys(row["shape"] for row in rev_rows + work_rows):
        rev = [row for row in rev_rows if row["shape"] == shape and "op" in row]
        work = [row for row in work_rows if row["shape"] == shape and "op" in row]
        diff = operator_diff(rev, work)
        lines.append({"shape": shape, "diff_count": len(diff), "shown": min(top, len(diff)),
                      "ms_rev": sum(row["ms"] for row in rev), "ms_work": sum(row["ms"] for row in work)})
        lines += [{"shape": shape, **row} for row in diff[:top]]
    return lines


def _median(values: list) -> float | None:
    """The median, or None when a value is missing (MFU and peak memory on the CPU)."""
    return statistics.median(values) if values and None not in values else None


def summaries(runs: list[tuple[str, int, list[dict]]], label: str, complete: bool) -> list[dict]:
    """One {"summary": "side_by_side"} line per shape from the runs (tree, round, rows): the per-round ratios of
    REV's step time to the working tree's, their median, min and max, and each tree's median figures."""
    shapes: dict[str, dict[str, dict[int, dict]]] = {}
    for tree, rnd, rows in runs:
        for row in rows:
            if "op" not in row and "profile" not in row:
                shapes.setdefault(row["shape"], {"rev": {}, "work": {}})[tree][rnd] = row
    lines = []
    for shape, trees in shapes.items():
        rev, work = ({r: row for r, row in trees[t].items() if "step_s" in row} for t in ("rev", "work"))
        ratios = [rev[r]["step_s"] / work[r]["step_s"] for r in sorted(rev) if r in work]
        line = {"shape": shape, "summary": "side_by_side", "against": label, "rounds": len(ratios),
                "complete": complete, "ratio": _median(ratios), "ratio_min": min(ratios, default=None),
                "ratio_max": max(ratios, default=None), "ratios": ratios}
        for tree, rows in (("rev", rev), ("work", work)):
            line[tree] = {key: _median([row.get(key) for row in rows.values()]) for key in FIGURES}
        errors = sorted({row["error"] for t in trees.values() for row in t.values() if "error" in row})
        lines.append({**line, **({"errors": errors} if errors else {})})
    return lines


def _interrupt(signum, frame):
    raise Interrupted


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def compare(args, parser) -> int:
    """Run REV's tree and the working tree in ABBA order for `args.rounds` rounds; print as the module says."""
    if args.rounds < 1:
        raise UserError(f"--rounds {args.rounds}: needs at least 1 round (an even number balances the order)")
    argv = bench_argv(args, parser)
    tmp = tempfile.mkdtemp(prefix="shardlm-against-")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    runs: list[tuple[str, int, list[dict]]] = []
    label, code, complete = args.against, 0, False
    try:
        label, root = rev_tree(args.against, tmp)
        trees = {"rev": (root, f"revision {label}"), "work": (ROOT, "the working tree")}
        for rnd in range(args.rounds):
            profiled = {}
            for tree in ("rev", "work") if rnd % 2 == 0 else ("work", "rev"):
                extra = ["--profile", str(EVERY_OPERATOR)] if args.profile and rnd == 0 else []
                tree_root, name = trees[tree]
                rows = run_tree(tree_root, argv + extra, name)
                runs.append((tree, rnd, rows))
                profiled[tree] = rows
                for row in rows:
                    if "op" not in row:
                        emit({**row, "tree": tree, "round": rnd})
            if args.profile and rnd == 0:
                for line in diff_lines(profiled["rev"], profiled["work"], args.profile):
                    emit(line)
        complete = True
    except (KeyboardInterrupt, Interrupted):
        code = 130
    finally:  # also after a failed run: the summary of the rounds before it
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp, ignore_errors=True)
        for line in summaries(runs, label, complete):
            emit(line)
    return code
