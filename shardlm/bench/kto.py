"""KTO in the `preference` section of `make bench`: shardlm's KTO against TRL's `KTOTrainer` as shipped.

The model and the Dolly pairs are the DPO comparison's (`shardlm.bench.preference`). The examples: the pairs
unpaired one answer each, alternating, so every step holds both labels and no prompt meets its own other answer:
example 2k is pair 2k's prompt with its chosen answer (desirable), example 2k + 1 pair 2k + 1's prompt with its
rejected answer (undesirable). KTO, beta 0.1, AdamW at a constant 1e-4, clipping at 1.0, in order on both sides.

- TRL as shipped: `KTOTrainer` with its defaults: the reference a frozen copy of the starting weights run in every
  step (on the examples and on their KL sequences), the KL sequences run forward by the policy in the step,
  `2 x pairs_per_step` examples a step padded to the longest (`train_sampling_strategy="sequential"`, which its KL
  pairing needs).
- shardlm: `train` with `[sft]` and `[preference] loss = "kto"`: the examples packed best-fit-decreasing into rows
  (each row's KL sequences in rows of their own), the reference precomputed once before the first step, the KL
  sequences one forward pass without gradient before each step (`shardlm.preference.kto`).

tokens/s counts the examples' real tokens (prompt + completion) a step trains on, on both sides: the KL sequences
are work both do on top. The ratios and the reference's share as the DPO comparison's.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.bench.common import median_cell
from shardlm.bench.preference_runs import BETA, shardlm_steps, side_by_side, timed_reference, trl_run


def unpaired_examples(records: list[dict]) -> list[dict]:
    """The module docstring's examples of conversational pair records: chosen and rejected answers alternating."""
    return [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
            for i, r in enumerate(records)]


def kto_bench(shape, model_dir: Path, records: list[dict], folder: Path, threads: int) -> dict:
    """The KTO figures of the `preference` section on `records` (the DPO comparison's pairs) and `model_dir`."""
    from shardlm.preference.unpaired import to_example, tokenize_example
    from shardlm.sft.template import ChatTemplate

    m = shape.model
    examples = unpaired_examples(records)
    template = ChatTemplate.from_dir(model_dir)
    tokens = [sum(len(ids) for ids in tokenize_example(template, to_example(e, f"example {i}"), None))
              for i, e in enumerate(examples)]
    path = folder / "examples.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    ours = shardlm_steps(m, model_dir, path, folder / "shardlm-kto", threads, "kto")
    theirs = trl_run(m.steps, m.warmup_steps, model_dir, examples, tokens, 2 * shape.pairs_per_step,
                     folder / "trl-kto", threads, after_step=ours.step, kto=True)
    figures, _ = side_by_side(ours, theirs, m.warmup_steps, timed_reference(ours.trainer, threads))
    data = ours.trainer.train_data
    return {
        "config": f"{len(examples)} examples (the pairs unpaired, labels alternating), KTO beta {BETA:g}; TRL "
                  f"{2 * shape.pairs_per_step} examples a step, shardlm {m.rows_per_step} bfd row(s) a step "
                  f"({data.num_pairs / len(data.rows.plan(0)):.1f} examples a row)",
        **figures,
    }


def markdown_lines(r: dict) -> list[str]:
    """The KTO part of the `preference` section of BENCHMARKS.md."""
    return [f"KTO: {r['config']}; {r['pairs']} pairs of steps after the warm-up; tokens/s counts the examples' real "
            "tokens (their KL sequences are work on top, on both sides).", "",
            "| trainer | real tokens/s | step ms |", "|---|---|---|",
            f"| shardlm (`loss = \"kto\"`, reference precomputed, z0 over the global batch) | "
            f"{median_cell(r['shardlm_tokens_per_sec'], digits=0)} | {median_cell(r['shardlm_step_ms'], digits=0)} |",
            f"| TRL `KTOTrainer` as shipped (reference run each step) | "
            f"{median_cell(r['trl_tokens_per_sec'], digits=0)} | {median_cell(r['trl_step_ms'], digits=0)} |",
            "", f"**shardlm / TRL KTO tokens/s (`preference.kto.ratio`, per pair of steps): {median_cell(r['ratio'])}**"
            f"; against TRL's step without its reference forwards: {median_cell(r['ratio_without_trl_reference'])} "
            f"(TRL's reference forwards are {median_cell(r['trl_reference_share'])} of its step; shardlm's reference "
            f"pass took {r['shardlm_reference_s']:.1f} s before training).", ""]
