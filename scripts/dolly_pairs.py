"""Write preference pairs built from instruction records (the shared Dolly sample has no preference set) that a tiny
model can learn: each record's instruction (and context) as the user's prompt, its own response as the chosen
answer and the same response cut off after half its words as the rejected one, as conversational JSONL records
(`prompt`, `chosen`, `rejected`), one per record but the last (the pairs of `shardlm.preference.dolly`, whose
rejected answer, the next record's response, is replaced).

    python scripts/dolly_pairs.py [INPUT.jsonl] [OUTPUT.jsonl]

Defaults: $SHARDLM_DATA/chat/dolly-15k-first600.jsonl -> runs/dolly-pairs.jsonl (what configs/dpo-tiny-qwen3.toml
reads). Reads the local file only (no network).

Why cut off: with the next record's response as the rejected answer, every response is rejected in one pair and
chosen in the next, so what one step teaches the next undoes and the DPO loss rises. A cut-off answer is chosen
nowhere, and what tells the two apart (an answer that ends mid-sentence) is what a tiny model learns in a few
steps; it learns nothing about matching an answer to its question. A check that preference optimization learns,
not a preference data set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from shardlm.preference.dolly import dolly_pairs


def cut_off(text: str) -> str:
    """The first half of `text`'s words (one space between them); a one-word text reversed letter by letter instead,
    or said twice when it reads the same backwards."""
    words = text.split()
    if len(words) > 1:
        return " ".join(words[:len(words) // 2])
    return text[::-1] if text[::-1] != text else f"{text} {text}"


def learnable_pairs(lines: list[str]) -> list[dict]:
    """The pairs of the JSONL `lines` (one per record but the last): each record's response chosen, `cut_off` of it
    rejected."""
    pairs = dolly_pairs(lines)
    for pair in pairs:
        pair["rejected"] = [{"role": "assistant", "content": cut_off(pair["chosen"][0]["content"])}]
    return pairs


def main(argv: list[str]) -> int:
    data = Path(os.environ.get("SHARDLM_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    source = Path(argv[0]) if argv else data / "chat" / "dolly-15k-first600.jsonl"
    target = Path(argv[1]) if len(argv) > 1 else Path("runs") / "dolly-pairs.jsonl"
    if not source.is_file():
        print(f"dolly_pairs: {source} not found; give the instruction records' JSONL file", file=sys.stderr)
        return 2
    pairs = learnable_pairs(source.read_text(encoding="utf-8").splitlines())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    tmp.replace(target)
    print(f"{len(pairs)} pairs -> {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
