"""The speed goals of one `make bench` run, met or not, and why not: BENCHMARKS.md's first section.

`speed_goals(results)` reads only the run's own figures (benchmarks.json), so the section can be written again from
a saved run. The goals:

- each MoE family (Mixtral-style, DeepSeek-V3, gpt-oss, Qwen3.5-MoE, DeepSeek-V3.2 with sparse attention) and each
  newer family of the `families` section (Mistral Small 4, OLMo 3, MiniMax-M2, Gemma 4, Kimi Linear, Nemotron-H)
  at >= 1.2x transformers as shipped, in every precision the CPU ran (fp32, and bf16 where it multiplies bf16
  natively; the DeepSeek-V3.2 step runs in fp32 only);
- the dense bf16 step at >= 75% of the best bf16 GEMM rate probed in the same rounds;
- on a CPU with AMX, the dense bf16 step at >= 60% of the AMX GEMM rate (the MoE bf16 rows above are the other AMX
  goal, with the expert rows padded); on any other CPU a row that says AMX was not measured;
- knowledge distillation (`distill`) at >= 1.5x TRL's GKDTrainer as shipped, in real tokens/s.

A missed goal carries its reason, from the run's figures: for a family, the profiled step of both programs by kind
of operator (`shardlm.bench.breakdown`); for the dense bf16 step, the rate of the step's own GEMMs timed alone; for
distillation, both steps per 1,000 real tokens split into the teacher's time and the rest.
"""

from __future__ import annotations

import statistics

from shardlm.bench.breakdown import why_not_faster

FAMILY_GOAL, DENSE_BF16_GOAL, AMX_DENSE_GOAL, DISTILL_GOAL = 1.2, 0.75, 0.60, 1.5
FAMILIES = (("Mixtral-style MoE", ("moe", "single_process")), ("DeepSeek-V3", ("deepseek",)), ("gpt-oss", ("gpt_oss",)),
            ("Qwen3.5-MoE (Gated DeltaNet)", ("linear_attention", "train_vs_hf")),
            ("DeepSeek-V3.2 (sparse attention)", ("sparse_attention", "train_vs_hf")),
            ("DeepSeek-V4 (compressed attention)", ("sparse_attention", "v4_train_vs_hf")),
            ("Mistral Small 4", ("families", "mistral4")), ("OLMo 3", ("families", "olmo3")),
            ("MiniMax-M2", ("families", "minimax_m2")), ("Gemma 4", ("families", "gemma4")),
            ("Kimi Linear (KDA)", ("families", "kimi_linear")), ("Nemotron-H (Mamba-2)", ("families", "nemotron_h")))
"""(name, path of the family's single-process figures in the results)."""


def _at(results: dict, path: tuple[str, ...]) -> dict | None:
    for part in path:
        results = results.get(part) if isinstance(results, dict) else None
    return results or None


def _row(goal: str, key: str, value: float, target: float, why: str, percent: bool = False) -> dict:
    met = value >= target
    return {"goal": goal, "key": key, "value": value, "target": target, "percent": percent, "met": met,
            "why": None if met else why}


def family_rows(results: dict) -> list[dict]:
    rows = []
    for name, path in FAMILIES:
        d = _at(results, path)
        if d is None:
            continue
        for precision in d["precisions"]:
            f = d[precision]
            timed = [f[f"{name}_step_ms"]["median"] if f"{name}_step_ms" in f else None for name in ("shardlm", "hf")]
            why = ("no profile in this run" if "breakdown" not in f else
                   why_not_faster(f["breakdown"]["shardlm"], f["breakdown"]["hf"], FAMILY_GOAL, *timed))
            rows.append(_row(f"{name}, {precision}: shardlm / transformers as shipped",
                             f"{'.'.join(path)}.{precision}.ratio", f["ratio"]["median"], FAMILY_GOAL, why))
    return rows


def dense_rows(results: dict) -> list[dict]:
    mfu = results.get("mfu", {}).get("by_vocabulary", {})
    amx = cpu_features(results).get("amx")
    rows = []
    for vocab, programs in mfu.items():
        row = programs.get("bf16")
        if row is None:
            continue
        if "step_gemm_gflops" in row:
            own = row["step_gemm_of_best"]
            why = (f"the step's own GEMMs, timed alone at its shapes, ran at {row['step_gemm_gflops']:.0f} GFLOP/s, "
                   f"{own:.0%} of the best square GEMM's rate (median of per-round ratios), so "
                   + (f"even a step of nothing but GEMMs would miss {DENSE_BF16_GOAL:.0%} at these shapes"
                      if own < DENSE_BF16_GOAL else "GEMMs alone would reach the goal")
                   + f"; the step ran at {row['fraction_of_step_gemms']:.0%} of its own GEMMs' rate")
            if "breakdown" in row:
                b = row["breakdown"]
                why += (f", and of a profiled {b['total']:.0f} ms step (profiler included) GEMMs took "
                        f"{b['gemm']:.0f} ms, attention {b['attention']:.0f}, the optimizer and clipping "
                        f"{b['optimizer']:.0f}, and the rest {b['other']:.0f} (autocast's casts, LayerNorm, GeLU, the "
                        "loss; see 'What was tried' under train_vs_hf)")
        else:
            why = "this run did not time the step's own GEMMs"
        key = f"mfu.by_vocabulary.{vocab}.bf16.fraction_of_best"
        rows.append(_row(f"dense bf16 step at V={vocab}: share of the best bf16 GEMM rate", key,
                         row["fraction_of_best"], DENSE_BF16_GOAL, why, percent=True))
        if amx:
            rows.append(_row(f"AMX: dense bf16 step at V={vocab}: share of the AMX GEMM rate", key,
                             row["fraction_of_best"], AMX_DENSE_GOAL, why, percent=True))
    return rows


def distill_rows(results: dict) -> list[dict]:
    """The distillation goal's row (none when the run has no `distill` figures): `distill.ratio` >= 1.5."""
    d = results.get("distill")
    if not d or "ratio" not in d:
        return []

    def per_thousand(name: str, figure: str) -> float:
        """Median over the steps of `name`'s `figure` ms per 1,000 of its real tokens."""
        tokens = d[f"{name}_real_tokens_per_step"]["values"]
        return statistics.median(ms * 1e3 / n for ms, n in zip(d[f"{name}_{figure}_ms"]["values"], tokens))

    (ours, our_teacher), (theirs, their_teacher) = ((per_thousand(name, "step"), per_thousand(name, "teacher"))
                                                    for name in ("shardlm", "trl"))
    why = (f"per 1,000 real tokens shardlm's step took {ours:.0f} ms (the teacher {our_teacher:.0f}, the rest "
           f"{ours - our_teacher:.0f}: the student's forward and backward, the divergence, AdamW) and TRL's "
           f"{theirs:.0f} ms (its teacher {their_teacher:.0f}, the rest {theirs - their_teacher:.0f}); "
           f"{DISTILL_GOAL}x would need shardlm at {theirs / DISTILL_GOAL:.0f} ms")
    return [_row("distillation: shardlm / TRL GKDTrainer as shipped (offline), real tokens/s", "distill.ratio",
                 d["ratio"]["median"], DISTILL_GOAL, why)]


def cpu_features(results: dict) -> dict:
    """The CPU's matrix features as the first section that measured them recorded them."""
    for path in [("train_vs_hf",), *(path for _, path in FAMILIES)]:
        d = _at(results, path)
        if d and d.get("cpu_features"):
            return d["cpu_features"]
    return {}


def speed_goals(results: dict) -> dict:
    """{"rows": [{goal, key, value, target, percent, met, why}], "amx": measured on AMX or not, "missed": count}."""
    rows = family_rows(results) + dense_rows(results) + distill_rows(results)
    features = cpu_features(results)
    return {"rows": rows, "amx": bool(features.get("amx")), "cpu_matrix": features.get("matrix"),
            "missed": sum(not row["met"] for row in rows)}


def markdown_lines(goals: dict) -> list[str]:
    lines = ["## Speed goals of this run (`goals`)", "",
             "Each goal against this run's own figures (medians; the sections below give their spread). A missed "
             "goal says why, from this run's measurements.", ""]
    if not goals["amx"]:
        lines += [f"AMX was not measured: this CPU's matrix unit is {goals['cpu_matrix'] or 'unknown'}, so the AMX "
                  "goals wait for a run on a Xeon with AMX.", ""]
    lines += ["| goal | key | measured | goal | met | why not |", "|---|---|---|---|---|---|"]
    for row in goals["rows"]:
        if row["percent"]:
            value, target = f"{row['value']:.0%}", f">= {row['target']:.0%}"
        else:  # a ratio that rounds to its goal without meeting it shows its third decimal
            digits = 3 if f"{row['value']:.2f}" == f"{row['target']:.2f}" and not row["met"] else 2
            value, target = f"{row['value']:.{digits}f}", f">= {row['target']:.1f}"
        lines.append(f"| {row['goal']} | `{row['key']}` | {value} | {target} | {'yes' if row['met'] else '**no**'} | "
                     f"{row['why'] or ''} |")
    return lines + ["", f"**`goals.missed` = {goals['missed']}** of {len(goals['rows'])}.", ""]
