"""Preprocessing throughput: documents/s and tokens/s of `preprocess` per worker count.

`benchmark_preprocess` builds a jsonl of the shared public-domain corpora (about 3 MB, one
document per paragraph), tokenizes it with the GPT-2 tokenizer `repeats` times per worker count
and reports the median (and min, max) throughput. It needs the shared data folder
(`shardlm.paths.shared_data_dir()`) and takes well under a minute on two cores.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from shardlm.data.preprocess import PreprocessConfig, preprocess
from shardlm.errors import UserError
from shardlm.paths import shared_data_dir

CORPUS_FILES = ("moby_dick_pg2701.txt", "pride_and_prejudice_pg1342.txt", "tinyshakespeare.txt")


def _write_corpus(workdir: Path, data_dir: Path, files: Sequence[str]) -> Path:
    path = workdir / "bench_corpus.jsonl"
    with open(path, "w", encoding="utf-8") as stream:
        for name in files:
            text = (data_dir / "corpus" / name).read_text(encoding="utf-8")
            for paragraph in text.split("\n\n"):
                if paragraph.strip():
                    stream.write(json.dumps({"text": paragraph}) + "\n")
    return path


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def benchmark_preprocess(
    workdir: str | Path, workers: Sequence[int] = (1, 2), repeats: int = 3, data_dir: str | Path | None = None,
    files: Sequence[str] = CORPUS_FILES,
) -> dict:
    """Throughput of GPT-2 preprocessing of the shared corpora `files`; returns a JSON-serialisable dict.

    Result: `{"input_bytes", "documents", "tokens", "repeats", "by_workers": {"1": {"documents_per_second":
    {"median", "min", "max"}, "tokens_per_second": {...}, "seconds": {...}}, ...}}`.
    """
    data_dir = Path(data_dir) if data_dir is not None else shared_data_dir()
    vocab = data_dir / "vocab" / "gpt2"
    if not (data_dir / "corpus").is_dir():
        raise UserError(f"shared data not found at {data_dir}; set SHARDLM_DATA")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = _write_corpus(workdir, data_dir, files)
    report: dict = {"input_bytes": corpus.stat().st_size, "repeats": repeats, "by_workers": {}}
    for count in workers:
        runs = []
        for _ in range(repeats):
            config = PreprocessConfig(
                input=corpus, output_prefix=workdir / f"bench_w{count}", tokenizer="gpt2",
                vocab_file=vocab / "encoder.json", merges_file=vocab / "vocab.bpe", append_eod=True, workers=count,
            )
            runs.append(preprocess(config, progress=False))
        report["documents"], report["tokens"] = runs[0].documents, runs[0].tokens
        report["by_workers"][str(count)] = {
            "documents_per_second": _summary([r.documents_per_second for r in runs]),
            "tokens_per_second": _summary([r.tokens_per_second for r in runs]),
            "seconds": _summary([r.seconds for r in runs]),
        }
    return report
