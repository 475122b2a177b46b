"""Preference pairs built from instruction records, for checks and benchmarks (the shared Dolly sample has no
preference set): each record's instruction (and context) as the user's prompt, its own response as the chosen
answer and the next record's response as the rejected one, as conversational records (`prompt`, `chosen`,
`rejected`). They only teach a model to prefer an answer to its own question over another's: a check of the
pipeline, not a preference data set. `scripts/dolly_pairs.py` writes them as JSONL with each rejected answer
replaced by the chosen one cut off, which a tiny model can learn."""

from __future__ import annotations

import json


def dolly_pairs(lines: list[str]) -> list[dict]:
    """One pair per record of the JSONL `lines` but the last: its own response chosen, the next record's rejected."""
    records = [json.loads(line) for line in lines if line.strip()]
    pairs = []
    for record, other in zip(records, records[1:]):
        prompt = record["instruction"] + (f"\n\n{record['context']}" if record.get("context") else "")
        pairs.append({"prompt": [{"role": "user", "content": prompt}],
                      "chosen": [{"role": "assistant", "content": record["response"]}],
                      "rejected": [{"role": "assistant", "content": other["response"]}]})
    return pairs
