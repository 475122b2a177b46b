"""Write preference pairs built from instruction records (the shared Dolly sample has no preference set): each
record's instruction (and context) as the user's prompt, its own response as the chosen answer and the next
record's response as the rejected one, as conversational JSONL records (`prompt`, `chosen`, `rejected`).

    python scripts/dolly_pairs.py [INPUT.jsonl] [OUTPUT.jsonl]

Defaults: $SHARDLM_DATA/chat/dolly-15k-first600.jsonl -> runs/dolly-pairs.jsonl (what configs/dpo-tiny-qwen3.toml
reads). The pairs only teach a model to prefer an answer to its own question over another's: a check of the
pipeline, not a preference data set."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from shardlm.preference.dolly import dolly_pairs


def main(argv: list[str]) -> int:
    data = Path(os.environ.get("SHARDLM_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    source = Path(argv[0]) if argv else data / "chat" / "dolly-15k-first600.jsonl"
    target = Path(argv[1]) if len(argv) > 1 else Path("runs") / "dolly-pairs.jsonl"
    if not source.is_file():
        print(f"dolly_pairs: {source} not found; give the instruction records' JSONL file", file=sys.stderr)
        return 2
    pairs = dolly_pairs(source.read_text(encoding="utf-8").splitlines())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    tmp.replace(target)
    print(f"{len(pairs)} pairs -> {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
