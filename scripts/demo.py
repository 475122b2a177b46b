"""`make demo`: shardlm's main job end to end on a laptop CPU, in a few minutes.

1. corpus: the Python standard library's own source, found on this machine (nothing downloaded);
2. vocabulary: a 4096-entry byte-level BPE trained on it (`shardlm tokenizer train`);
3. training: configs/demo.toml, a 4-layer GPT with 2-way tensor parallelism on 2 local processes
   (`shardlm train --nproc-per-node 2`), with a progress bar, validation loss and perplexity;
4. a sample: `shardlm generate` continues a prompt from the saved checkpoint (KV cache, top-k);
5. outputs: runs/demo/run/metrics.jsonl, loss_curve.png and checkpoints/.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

from shardlm.cli import main as shardlm

ROOT = Path(__file__).resolve().parents[1]
DEMO = Path("runs/demo")
SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}


def build_corpus(out: Path, max_bytes: int) -> None:
    """Concatenate stdlib .py files (sorted, so every machine of one Python version agrees)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not SKIP & set(p.relative_to(stdlib).parts))
    parts, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="ignore")
        parts.append(f"# file: {path.relative_to(stdlib)}\n{text}\n\n")
        size += len(parts[-1])
        if size >= max_bytes:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(parts), encoding="utf-8")
    tmp.replace(out)
    print(f"demo: corpus of {size / 1e6:.1f} MB from {len(parts)} files of {stdlib}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--corpus-mb", type=float, default=3.0)
    args = parser.parse_args()
    corpus, tokenizer = DEMO / "corpus.txt", DEMO / "tokenizer" / "tokenizer.json"
    if not corpus.is_file():
        build_corpus(corpus, int(args.corpus_mb * 1e6))
    if not tokenizer.is_file():
        code = shardlm(["tokenizer", "train", "--input", str(corpus), "--kind", "bpe", "--vocab-size", "4096",
                        "--output", str(tokenizer.parent), "--no-progress"])
        if code:
            return code
    overrides = [f"train.steps={args.steps}"] if args.steps else []
    run = DEMO / "run"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run each time (the corpus and vocabulary are reused)
    code = shardlm(["train", str(ROOT / "configs" / "demo.toml"), "--nproc-per-node", "2", "--run-dir", str(run),
                    *overrides])
    if code:
        return code
    print("demo: a sample from the trained model (shardlm generate, top-k 40, temperature 0.8):")
    code = shardlm(["generate", "--checkpoint", str(run / "checkpoints"), "--prompt", "def ", "--max-new-tokens",
                    "80", "--top-k", "40", "--temperature", "0.8", "--seed", "1"])
    print(f"demo: done. Loss curve: {run / 'loss_curve.png'}; metrics: {run / 'metrics.jsonl'}; "
          f"checkpoint: {run / 'checkpoints'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
