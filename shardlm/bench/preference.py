"""Preference optimization on one CPU (`make bench` section `preference`): shardlm's DPO against TRL's
`DPOTrainer` as shipped (and its KTO against TRL's `KTOTrainer`: `shardlm.bench.kto`).

Model: the `sft` section's tiny Qwen3 (the real 151,936-token vocabulary, tied embeddings, random init, fp32).
Data: pairs built from the shared Dolly records (`shardlm.preference.dolly`: a record's own response chosen, the
next record's rejected, conversational, under the Qwen3 chat template), the first `PAIRS` whose two sequences fit
a row, in order on both sides. Sigmoid DPO, beta 0.1, AdamW at a constant 1e-4, clipping at 1.0.

- TRL as shipped: `DPOTrainer` with its defaults: the reference a frozen copy of the starting weights run in every
  step (`precompute_ref_log_probs=False`), `pairs_per_step` pairs a step padded to the longest sequence
  (padding-free DPO is disabled in this TRL), its chunked LM head.
- shardlm: `train` with `[sft]` and `[preference]`, the pairs packed best-fit-decreasing into rows of
  `seq_length` tokens (`rows_per_step` a step), the reference precomputed once by the starting weights before the
  first step (`preference.reference = "precomputed"`, the default without LoRA).

The two take turns, one optimizer step each (a shardlm step right after each TRL step, outside TRL's clock); the
first `warmup_steps` are not counted. tokens/s counts real tokens: both sequences of each pair the step trains on,
prompt included on both sides (what both forwards run; TRL's padding and shardlm's row tails are not counted).
The reference's share: TRL's, the seconds in its reference model's forward over its step time; shardlm's, its
one pass over the pairs before training (timed again after the run, the same work), per pair, against the
training step's seconds per pair. `ratio`: shardlm's tokens/s over TRL's per pair of steps (goal 1.2);
`ratio_without_trl_reference`: against TRL's step with its reference forward taken out, so the comparison of the
training work alone.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from shardlm.bench.common import median_cell
from shardlm.bench.kto import kto_bench
from shardlm.bench.kto import markdown_lines as kto_lines
from shardlm.bench.preference_runs import BETA, shardlm_steps, side_by_side, timed_reference, trl_run
from shardlm.bench.sft import SFT_BENCH, SFT_QUICK, SFTShape, chat_data, make_model_dir


@dataclass(frozen=True)
class PreferenceShape:
    """The model (an `SFTShape`), the pairs and the steps of both trainers."""

    model: SFTShape
    pairs: int
    pairs_per_step: int


PREFERENCE_BENCH = PreferenceShape(replace(SFT_BENCH, steps=5, warmup_steps=1), pairs=40, pairs_per_step=4)
PREFERENCE_QUICK = PreferenceShape(replace(SFT_QUICK, seq_length=512, rows_per_step=1, steps=2), pairs=6,
                                   pairs_per_step=1)


def load_pairs(shape: PreferenceShape, records_file: Path, tokenizer_dir: Path):
    """The first `shape.pairs` Dolly pairs whose two sequences fit a row, as records and tokenized."""
    from shardlm.preference.dolly import dolly_pairs
    from shardlm.preference.pairs import PreferencePair, tokenize_pair
    from shardlm.sft.template import ChatTemplate

    template = ChatTemplate.from_dir(tokenizer_dir)
    eos = template.special_tokens.get("eos_token") or template.end_of_turn
    records, tokenized = [], []
    for i, record in enumerate(dolly_pairs(records_file.read_text(encoding="utf-8").splitlines())):
        pair = tokenize_pair(template, PreferencePair(record["prompt"], record["chosen"], record["rejected"],
                                                      f"pair {i}"), eos)
        if 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected) <= shape.model.seq_length:
            records.append(record)
            tokenized.append(pair)
        if len(records) == shape.pairs:
            break
    return records, tokenized


def pair_tokens(pair) -> int:
    """Real tokens of a pair's two sequences (prompt + chosen, prompt + rejected)."""
    return 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected)


def preference_bench(quick: bool, data_dir: Path | None = None, threads: int = 2) -> dict:
    """The `preference` section of `make bench`."""

    shape = PREFERENCE_QUICK if quick else PREFERENCE_BENCH
    m = shape.model
    records_file, tokenizer_dir = chat_data(data_dir)
    records, tokenized = load_pairs(shape, records_file, tokenizer_dir)
    with tempfile.TemporaryDirectory(prefix="shardlm-preference-bench-") as folder:
        folder = Path(folder)
        model_dir, vocab = make_model_dir(m, tokenizer_dir, folder / "model")
        pairs_file = folder / "pairs.jsonl"
        pairs_file.write_text("".join(json.dumps(r) + "\n" for r in records))
        ours = shardlm_steps(m, model_dir, pairs_file, folder / "shardlm", threads, "sigmoid")
        theirs = trl_run(m.steps, m.warmup_steps, model_dir, records, [pair_tokens(p) for p in tokenized],
                         shape.pairs_per_step, folder / "trl", threads, after_step=ours.step)
        reference_s = timed_reference(ours.trainer, threads)
        kto = kto_bench(shape, model_dir, records, folder, threads)
    figures, step_s = side_by_side(ours, theirs, m.warmup_steps, reference_s)
    data = ours.trainer.train_data
    pairs_per_row = data.num_pairs / len(data.rows.plan(0))
    train_s_per_pair = sum(step_s) / (len(step_s) * m.rows_per_step * pairs_per_row)
    reference_s_per_pair = reference_s / data.num_pairs
    return {
        "config": f"{m.describe(vocab)}; {len(records)} Dolly pairs, sigmoid DPO beta {BETA:g}, {threads} threads; "
                  f"TRL {shape.pairs_per_step} pairs a step, shardlm {m.rows_per_step} bfd row(s) of "
                  f"{m.seq_length} tokens a step ({pairs_per_row:.1f} pairs a row)",
        **figures,
        "shardlm_reference_share": reference_s_per_pair / (reference_s_per_pair + train_s_per_pair),
        "kto": kto,
    }


def markdown_lines(r: dict) -> list[str]:
    """The `preference` section of BENCHMARKS.md."""
    lines = ["## Preference optimization (`preference`)", "",
             f"{r['config']}. The two trainers take turns, one optimizer step each; {r['pairs']} pairs of steps "
             "after the warm-up; tokens/s counts the real tokens of both sequences of each pair.", "",
             "| trainer | real tokens/s | step ms |", "|---|---|---|",
             f"| shardlm (`[preference]`, reference precomputed) | "
             f"{median_cell(r['shardlm_tokens_per_sec'], digits=0)} | {median_cell(r['shardlm_step_ms'], digits=0)} |",
             f"| TRL `DPOTrainer` as shipped (reference run each step) | "
             f"{median_cell(r['trl_tokens_per_sec'], digits=0)} | {median_cell(r['trl_step_ms'], digits=0)} |",
             "", f"**shardlm / TRL tokens/s (`preference.ratio`, per pair of steps): {median_cell(r['ratio'])}** "
             f"(goal 1.2); against TRL's step without its reference forward: "
             f"{median_cell(r['ratio_without_trl_reference'])}.", "",
             f"The reference's share: TRL's reference forward is {median_cell(r['trl_reference_share'])} of its "
             f"step; shardlm's one pass over the pairs before training took {r['shardlm_reference_s']:.1f} s, "
             f"{r['shardlm_reference_share']:.0%} of the time per pair of one epoch (reference + training).", ""]
    if r.get("kto"):
        lines += kto_lines(r["kto"])
    return lines
