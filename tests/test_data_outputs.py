"""The data tools' guarantees about the world outside: no network, and outputs that appear only when complete.

With every socket connection and name lookup made to fail, `shardlm tokenizer train`, `preprocess`
(GPT-2's files and the trained tokenizer, one and two workers), `corpus filter` / `dedup` / `overlap` and
building a GPT dataset's index cache all succeed. A corpus command, a tokenizer training or an
index-cache build interrupted part way leaves no output and no temporary file (the first two also leave
an earlier output in its place untouched). Several processes building the same index cache at once each
end with complete arrays, and a reader polling the cache files meanwhile only ever loads complete ones.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from shardlm.cli import main
from shardlm.data.corpus import AtomicJsonlWriter
from shardlm.data.documents import Document
from shardlm.data.gpt_dataset import build_gpt_datasets
from shardlm.data.index_cache import cached_arrays
from shardlm.data.indexed import IndexedDataset

TEXTS = ["First document, with a few words in it.", "Second document: naïve café, 日本語.", "first document, with "
         "a few words in it!", "A third, longer document " * 20]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture
def no_network(monkeypatch):
    """Every connection (TCP, UDP, Unix sockets alike) and every name lookup raises."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("network access")

    for name in ("connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_data_commands_run_without_the_network(no_network, tmp_path, data_dir):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    with pytest.raises(AssertionError, match="network access"):  # the guard holds
        socket.create_connection(("127.0.0.1", 9))
    assert main(["tokenizer", "train", "--input", str(source), "--kind", "bpe", "--vocab-size", "300",
                 "--output", str(tmp_path / "tok"), "--no-progress"]) == 0
    gpt2 = ["--tokenizer", "gpt2", "--vocab-file", str(data_dir / "vocab/gpt2/encoder.json"),
            "--merges-file", str(data_dir / "vocab/gpt2/vocab.bpe")]
    trained = ["--tokenizer", "json", "--vocab-file", str(tmp_path / "tok" / "tokenizer.json")]
    for name, flags in (("gpt2", gpt2), ("trained", trained), ("workers", [*gpt2, "--workers", "2"])):
        assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / name), "--append-eod",
                     *flags, "--no-progress"]) == 0  # the workers are forked: they inherit the refusal
        assert IndexedDataset(tmp_path / name).num_documents == len(TEXTS)
    assert main(["corpus", "filter", "--input", str(source), "--output", str(tmp_path / "filtered.jsonl"),
                 "--min-tokens", "8", "--no-progress"]) == 0
    assert main(["corpus", "dedup", "--input", str(source), "--output", str(tmp_path / "dedup.jsonl"),
                 "--no-progress"]) == 0
    assert main(["corpus", "overlap", "--eval", str(source), "--train", str(tmp_path / "dedup.jsonl")]) == 0
    train, _, _ = build_gpt_datasets([str(tmp_path / "gpt2")], "1", 8, seed=1, num_samples=(10, 0, 0),
                                     cache_dir=tmp_path / "cache")
    assert len(train) == 10 and any((tmp_path / "cache").iterdir())


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_an_interrupted_corpus_output_leaves_the_earlier_one(tmp_path):
    """A corpus command's writer stopped part way (an exception inside it): no new output, no temporary file; a
    previous output under the same name is left as it was."""
    out = tmp_path / "out.jsonl"
    with AtomicJsonlWriter(tmp_path / "fresh.jsonl") as writer:
        writer.write(Document(line_number=1, text="kept"))
    out.write_text('{"text": "earlier"}\n')
    with pytest.raises(KeyboardInterrupt), AtomicJsonlWriter(out) as writer:
        writer.write(Document(line_number=1, text="new"))
        writer.write(Document(line_number=1, text="more"))
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt), AtomicJsonlWriter(tmp_path / "never.jsonl") as writer:
        writer.write(Document(line_number=1, text="new"))
        raise KeyboardInterrupt
    assert out.read_text() == '{"text": "earlier"}\n'
    assert (tmp_path / "fresh.jsonl").read_text() == '{"text": "kept"}\n'
    assert not (tmp_path / "never.jsonl").exists() and leftovers(tmp_path) == []


def test_an_interrupted_tokenizer_training_leaves_no_file(tmp_path, monkeypatch):
    """`tokenizer train` stopped while it reads its input: no tokenizer.json, no temporary file; a previous
    tokenizer.json in the output folder is left as it was."""
    import shardlm.data.tokenizer_train as tokenizer_train

    texts = tokenizer_train._texts

    def interrupted(*args):
        for k, text in enumerate(texts(*args)):
            if k == 2:
                raise KeyboardInterrupt
            yield text

    monkeypatch.setattr(tokenizer_train, "_texts", interrupted)
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    for folder, earlier in ((tmp_path / "new", None), (tmp_path / "old", '{"earlier": true}')):
        if earlier:
            folder.mkdir()
            (folder / "tokenizer.json").write_text(earlier)
        with pytest.raises(KeyboardInterrupt):
            tokenizer_train.train_tokenizer([source], "bpe", 300, folder, show_progress=False)
        assert (folder / "tokenizer.json").read_text() == earlier if earlier else not folder.exists()
        assert not folder.exists() or leftovers(folder) == []


def test_an_interrupted_index_cache_build_leaves_nothing(tmp_path):
    """A cache build that fails part way writes no file, so the next run builds again instead of loading it."""
    def failing():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_arrays(tmp_path / "cache", "gpt", {"seed": 1}, ("a",), failing)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []
    built = cached_arrays(tmp_path / "cache", "gpt", {"seed": 1}, ("a",), lambda: {"a": np.arange(5)})
    assert np.array_equal(built["a"], np.arange(5))


ELEMENTS = 2_000_000  # 16 MB per array: a write takes long enough for a reader to catch a half-written file


def expected_arrays() -> dict[str, np.ndarray]:
    return {"a": np.arange(ELEMENTS, dtype=np.int64), "b": np.arange(ELEMENTS, dtype=np.int64)[::-1].copy()}


def build_at_once(cache_dir: str, start: float, results) -> None:
    """A builder process: build at `start` (together with the others), save, then load the cache back."""
    def build():
        time.sleep(max(0.0, start - time.time()))
        return expected_arrays()

    def unreachable():
        raise AssertionError("built twice")

    try:
        cached_arrays(Path(cache_dir), "gpt", {"seed": 1}, ("a", "b"), build)
        loaded = cached_arrays(Path(cache_dir), "gpt", {"seed": 1}, ("a", "b"), unreachable)
        results.put(all(np.array_equal(loaded[n], v) for n, v in expected_arrays().items()))
    except Exception as error:  # noqa: BLE001 - reported to the test, which fails on it
        results.put(repr(error))


def poll_cache(cache_dir: str, builders_done, results) -> None:
    """A reader process: load every cache file that exists, as often as it can, until the builders are done
    and it has loaded both arrays (or for 60 s); the count of loads and whether every loaded array was
    complete and right."""
    expected, loads, right, deadline = expected_arrays(), 0, True, time.time() + 60
    while time.time() < deadline and not (builders_done.is_set() and loads >= 2):
        for path in Path(cache_dir).glob("gpt_*_*.npy"):
            try:
                value = np.load(path)
            except FileNotFoundError:
                continue
            except Exception:  # noqa: BLE001 - a half-written .npy file
                right = False
                continue
            loads += 1
            right &= np.array_equal(value, expected[path.stem.rsplit("_", 1)[1]])
    results.put((loads, right))


def test_concurrent_builders_of_one_index_cache_write_only_complete_files(tmp_path):
    """Three processes build the same cache at the same moment and save it, as the ranks of a run do; a fourth
    reads the cache files while they write. Every builder loads back complete, right arrays, the reader never
    loads a half-written one, and no temporary file stays behind."""
    context = multiprocessing.get_context("fork")
    results, polled, builders_done = context.Queue(), context.Queue(), context.Event()
    start = time.time() + 0.5
    cache = str(tmp_path / "cache")
    reader = context.Process(target=poll_cache, args=(cache, builders_done, polled))
    builders = [context.Process(target=build_at_once, args=(cache, start, results)) for _ in range(3)]
    for process in (reader, *builders):
        process.start()
    for process in builders:
        process.join(timeout=60)
    builders_done.set()
    reader.join(timeout=90)
    # a builder that mapped a half-written file dies of SIGBUS on reading past its end: exit code -7
    assert [process.exitcode for process in (reader, *builders)] == [0, 0, 0, 0]
    outcomes = [results.get(timeout=10) for _ in builders]
    loads, right = polled.get(timeout=10)
    assert outcomes == [True, True, True]
    assert loads > 0 and right
    assert leftovers(tmp_path / "cache") == []
