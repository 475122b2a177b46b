"""`shardlm preprocess` end to end: formats, EOD, sentences, workers, bad lines, atomic output."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from shardlm.cli import main
from shardlm.data.documents import iter_documents
from shardlm.data.indexed import IndexedDataset
from shardlm.data.sentences import split_sentences
from shardlm.data.tokenizers import build_tokenizer

TEXTS = [
    "The first document. It has two sentences!",
    "Second one: naïve café, 日本語, emoji 🤖.\nA new line. Mr. Smith went to Washington.",
    "Third.",
]


@pytest.fixture(scope="module")
def gpt2_flags(data_dir) -> list[str]:
    return ["--tokenizer", "gpt2", "--vocab-file", str(data_dir / "vocab/gpt2/encoder.json"),
            "--merges-file", str(data_dir / "vocab/gpt2/vocab.bpe"), "--no-progress"]


@pytest.fixture(scope="module")
def gpt2(data_dir):
    return build_tokenizer("gpt2", data_dir / "vocab/gpt2/encoder.json", data_dir / "vocab/gpt2/vocab.bpe")


def write_jsonl(path, texts, extra_lines=()):
    lines = [json.dumps({"text": t, "id": k}) for k, t in enumerate(texts)] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def documents_of(prefix) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset.document(k).tolist() for k in range(dataset.num_documents)]


def test_jsonl_with_eod_matches_the_tokenizer(tmp_path, gpt2_flags, gpt2, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "out"),
                 "--append-eod", *gpt2_flags]) == 0
    assert documents_of(tmp_path / "out") == [gpt2.encode(t) + [gpt2.eod] for t in TEXTS]
    assert IndexedDataset(tmp_path / "out").dtype == np.uint16
    assert "3 documents" in capsys.readouterr().out


def test_txt_paragraph_and_line_modes_and_gzip(tmp_path, gpt2_flags, gpt2):
    text = "para one line a\npara one line b\n\n\npara two\n"
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "in.txt.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    for name in ("in.txt", "in.txt.gz"):
        assert main(["preprocess", "--input", str(tmp_path / name), "--output-prefix", str(tmp_path / name),
                     *gpt2_flags]) == 0
        assert documents_of(tmp_path / name) == [gpt2.encode("para one line a\npara one line b"),
                                                 gpt2.encode("para two")]
    assert main(["preprocess", "--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "lines"),
                 "--txt-mode", "line", *gpt2_flags]) == 0
    assert len(documents_of(tmp_path / "lines")) == 3


def test_split_sentences_gives_one_sequence_per_sentence(tmp_path, data_dir):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    bert = build_tokenizer("bert", data_dir / "vocab/bert-base-uncased/vocab.txt")
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "bert"),
                 "--tokenizer", "bert", "--vocab-file", str(data_dir / "vocab/bert-base-uncased/vocab.txt"),
                 "--split-sentences", "--append-eod", "--no-progress"]) == 0
    dataset = IndexedDataset(tmp_path / "bert")
    for k, text in enumerate(TEXTS):
        sentences = [s.tolist() for s in dataset.document_sentences(k)]
        expected = [bert.encode(s) for s in split_sentences(text)]
        expected[-1].append(bert.sep)
        assert sentences == expected
    assert [len(dataset.document_sentences(k)) for k in range(3)] == [2, 3, 1]


def test_workers_give_identical_files(tmp_path, gpt2_flags, data_dir):
    source = data_dir / "corpus/tinyshakespeare.txt"
    for workers in ("1", "2"):
        assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / workers),
                     "--workers", workers, "--append-eod", *gpt2_flags]) == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"1{suffix}").read_bytes() == (tmp_path / f"2{suffix}").read_bytes()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_json_line_fails_with_its_number_and_leaves_nothing(tmp_path, gpt2_flags, capsys, workers):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS, extra_lines=['{"text": "ok"}', "{broken", '{"id": 3}'])
    code = main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "out"),
                 "--workers", workers, *gpt2_flags])
    error = capsys.readouterr().err
    assert code == 2 and "line 5" in error and error.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no .bin/.idx, no temporaries
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "out"),
                 "--skip-bad-lines", *gpt2_flags]) == 0
    assert "2 bad lines (lines 5, 6)" in capsys.readouterr().out
    assert len(documents_of(tmp_path / "out")) == 4


@pytest.mark.parametrize("flags, message", [
    (["--vocab-file", "/nonexistent/encoder.json", "--merges-file", "/x/vocab.bpe"], "encoder.json"),
    (["--vocab-file", "VOCAB", "--workers", "0"], "--workers"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, flags, message, capsys, data_dir):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    flags = [str(data_dir / "vocab/gpt2/encoder.json") if f == "VOCAB" else f for f in flags]
    code = main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"),
                 "--tokenizer", "gpt2", *flags, "--no-progress"])
    error = capsys.readouterr().err
    assert code == 2 and message in error and error.count("\n") == 1


def test_missing_input_and_unknown_extension(tmp_path, gpt2_flags, capsys):
    assert main(["preprocess", "--input", str(tmp_path / "none.jsonl"), "--output-prefix", "o", *gpt2_flags]) == 2
    (tmp_path / "data.csv").write_text("a,b\n")
    assert main(["preprocess", "--input", str(tmp_path / "data.csv"), "--output-prefix", "o", *gpt2_flags]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert "not found" in errors[0] and ".jsonl, .txt" in errors[1]


def test_documents_keep_line_numbers(tmp_path):
    (tmp_path / "a.txt").write_text("\n\nfirst\nstill first\n\nsecond\n", encoding="utf-8")
    documents = list(iter_documents(tmp_path / "a.txt"))
    assert [(d.text, d.line_number) for d in documents] == [("first\nstill first", 3), ("second", 6)]


def test_sentence_splitter_rules():
    text = 'Mr. Smith met Dr. J. R. Tolkien at 3 p.m. yesterday. "Really?" she asked. Yes! 42 came.\n\nNew para'
    assert split_sentences(text) == [
        "Mr. Smith met Dr. J. R. Tolkien at 3 p.m. yesterday.", '"Really?" she asked.', "Yes!", "42 came.",
        "New para",
    ]
    assert split_sentences("") == []


def test_benchmark_reports_medians(tmp_path, data_dir):
    from shardlm.data.bench import benchmark_preprocess

    report = benchmark_preprocess(tmp_path, workers=(1,), repeats=1, data_dir=data_dir)
    stats = report["by_workers"]["1"]
    assert report["documents"] > 10_000 and report["tokens"] > 500_000
    assert stats["documents_per_second"]["min"] <= stats["documents_per_second"]["median"] > 0
    assert stats["tokens_per_second"]["median"] > stats["documents_per_second"]["median"]


def test_unreadable_inputs_are_user_errors(tmp_path, gpt2_flags, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with gzip.open(tmp_path / "cut.jsonl.gz", "wb") as f:
        f.write(("".join(json.dumps({"text": f"doc {k} " * 50}) + "\n" for k in range(2000))).encode())
    data = (tmp_path / "cut.jsonl.gz").read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    for name, message in (("latin1.txt", "not valid UTF-8"), ("cut.jsonl.gz", "check the file is complete")):
        assert main(["preprocess", "--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "out"),
                     *gpt2_flags]) == 2
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()


def test_rerun_replaces_previous_output(tmp_path, gpt2_flags, gpt2):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    for texts in (TEXTS, TEXTS[:1]):
        write_jsonl(source, texts)
        assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "out"),
                     *gpt2_flags]) == 0
    assert documents_of(tmp_path / "out") == [gpt2.encode(TEXTS[0])]
