"""Corpus cleaning and tokenizer training through the CLI: filter, dedup, overlap, tokenizer train."""

from __future__ import annotations

import json
import random

import pytest

from shardlm.cli import main
from shardlm.data.corpus import deduplicate
from shardlm.data.indexed import IndexedDataset
from shardlm.data.overlap import overlap_report
from shardlm.data.tokenizers import build_tokenizer


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_jsonl(path, texts) -> None:
    path.write_text("".join(json.dumps({"text": t, "n": k}) + "\n" for k, t in enumerate(texts)), encoding="utf-8")


@pytest.fixture(scope="module")
def paragraphs(data_dir) -> list[str]:
    """Distinct long paragraphs of Moby Dick (each at least 80 words)."""
    text = (data_dir / "corpus/moby_dick_pg2701.txt").read_text(encoding="utf-8")
    chosen, seen = [], set()
    for paragraph in text.split("\n\n"):
        words = paragraph.split()
        if len(words) >= 80 and paragraph not in seen:
            seen.add(paragraph)
            chosen.append(" ".join(words))
    return chosen[:40]


def near_copy(text: str, changes: int, rng: random.Random) -> str:
    words = text.split()
    for position in rng.sample(range(len(words)), changes):
        words[position] = "zzz" + words[position]
    return " ".join(words)


def test_dedup_removes_planted_near_duplicates_and_keeps_distinct(tmp_path, paragraphs, capsys):
    rng = random.Random(0)
    documents = list(paragraphs)
    planted = {}  # index of the planted copy -> index of its original
    for original in (3, 10, 25):
        planted[len(documents)] = original
        documents.append(near_copy(paragraphs[original], 2, rng))  # Jaccard of 5-shingles ~0.85
    planted[len(documents)] = 7
    documents.append(paragraphs[7])  # exact copy
    documents.append(near_copy(paragraphs[12], 40, rng))  # half the words changed: not a duplicate
    write_jsonl(tmp_path / "in.jsonl", documents)
    result = deduplicate(tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    assert dict(result.duplicate_of) == planted
    kept = read_jsonl(tmp_path / "out.jsonl")
    assert [record["n"] for record in kept] == [k for k in range(len(documents)) if k not in planted]
    assert main(["corpus", "dedup", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "cli.jsonl"),
                 "--no-progress"]) == 0
    assert "removed 4 near-duplicates" in capsys.readouterr().out
    assert (tmp_path / "cli.jsonl").read_bytes() == (tmp_path / "out.jsonl").read_bytes()


def test_filter_drops_short_documents(tmp_path, data_dir, capsys):
    texts = ["one two three", "a " * 127 + "end", "short", "x " * 300]
    write_jsonl(tmp_path / "in.jsonl", texts)
    assert main(["corpus", "filter", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                 "--no-progress"]) == 0
    assert [r["n"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1, 3]  # 128 and 300 words
    assert "dropped 2 under 128 tokens" in capsys.readouterr().out
    gpt2_flags = ["--tokenizer", "gpt2", "--vocab-file", str(data_dir / "vocab/gpt2/encoder.json"),
                  "--merges-file", str(data_dir / "vocab/gpt2/vocab.bpe")]
    assert main(["corpus", "filter", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "bpe.jsonl"),
                 "--min-tokens", "200", *gpt2_flags, "--no-progress"]) == 0
    assert [r["n"] for r in read_jsonl(tmp_path / "bpe.jsonl")] == [3]  # "x x ... x" is 300 BPE tokens


def test_overlap_on_a_hand_made_case(tmp_path, capsys):
    # Eval: 12 words -> 5 eight-grams; another doc of 9 words -> 2 eight-grams (n-grams never cross documents).
    (tmp_path / "eval.txt").write_text("a b c d e f g h i j k l\n\nm n o p q r s t u\n", encoding="utf-8")
    # Train holds "c d e f g h i j" (3rd eval 8-gram) and "m n o p q r s t" (6th); "h i j k l" is too short.
    write_jsonl(tmp_path / "train.jsonl", ["x y C D E F G H I J z", "m n o p q r s t", "h i j k l"])
    report = overlap_report(tmp_path / "eval.txt", [tmp_path / "train.jsonl"], ngram=8, progress=False)
    assert (report.eval_ngrams, report.overlapping_ngrams) == (7, 2)
    assert report.percent == pytest.approx(100 * 2 / 7)
    assert main(["corpus", "overlap", "--eval", str(tmp_path / "eval.txt"), "--train", str(tmp_path / "train.jsonl"),
                 "--output", str(tmp_path / "report.json"), "--no-progress"]) == 0
    assert "28.57% of 7 8-grams" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["overlapping_ngrams"] == 2
    report4 = overlap_report(tmp_path / "eval.txt", [tmp_path / "train.jsonl"], ngram=4, progress=False)
    # 4-grams: eval 9 + 6 = 15; in train: c..j gives 5 (cdef..ghij), "h i j k l" adds hijk, ijkl; m..t gives 5.
    assert (report4.eval_ngrams, report4.overlapping_ngrams) == (15, 12)


def test_overlap_counts_repeated_eval_ngrams(tmp_path):
    (tmp_path / "eval.txt").write_text("a b c\n\na b c\n\nd e f\n", encoding="utf-8")
    (tmp_path / "train.txt").write_text("a b c\n", encoding="utf-8")
    report = overlap_report(tmp_path / "eval.txt", [tmp_path / "train.txt"], ngram=3, progress=False)
    assert report.percent == pytest.approx(200 / 3) and report.percent_unique == pytest.approx(50.0)


def test_tokenizer_train_rejects_a_tiny_vocabulary(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text\n", encoding="utf-8")
    assert main(["tokenizer", "train", "--input", str(tmp_path / "a.txt"), "--kind", "bpe", "--vocab-size", "100",
                 "--output", str(tmp_path / "tok"), "--no-progress"]) == 2
    assert "at least 257" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()


def test_corpus_errors_exit_2(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    assert main(["corpus", "dedup", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                 "--threshold", "1.5"]) == 2
    assert main(["corpus", "overlap", "--eval", str(tmp_path / "missing.txt"), "--train",
                 str(tmp_path / "in.jsonl")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and "--threshold" in errors[0] and "not found" in errors[1]
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("kind, size, eod", [("bpe", 600, "<|endoftext|>"), ("wordpiece", 800, "[SEP]")])
def test_tokenizer_train_then_preprocess_with_it(tmp_path, data_dir, kind, size, eod):
    source = tmp_path / "shakespeare.txt"
    source.write_text((data_dir / "corpus/tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000])
    assert main(["tokenizer", "train", "--input", str(source), "--kind", kind, "--vocab-size", str(size),
                 "--output", str(tmp_path / "tok"), "--no-progress"]) == 0
    tokenizer = build_tokenizer("json", tmp_path / "tok" / "tokenizer.json")
    assert tokenizer.vocab_size <= size and tokenizer.id_to_token(tokenizer.eod) == eod
    text = "First Citizen: before we proceed any further, hear me speak."
    decoded = tokenizer.decode(tokenizer.encode(text))
    if kind == "bpe":
        assert decoded == text  # byte-level BPE is lossless
    else:  # WordPiece loses case and the spacing around punctuation
        assert decoded.replace(" ", "") == text.lower().replace(" ", "")
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "data"), "--tokenizer",
                 "json", "--vocab-file", str(tmp_path / "tok" / "tokenizer.json"), "--append-eod",
                 "--no-progress"]) == 0
    assert IndexedDataset(tmp_path / "data").document(0)[-1] == tokenizer.eod
