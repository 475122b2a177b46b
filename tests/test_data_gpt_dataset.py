"""GPT samples tile the document stream, split by documents, blend in exact proportion, and are deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from shardlm.data.blending import build_blending_index
from shardlm.data.gpt_dataset import TokenArrayDataset, build_gpt_datasets
from shardlm.data.indexed import IndexedDatasetWriter
from shardlm.data.splits import parse_split, split_document_ranges
from shardlm.errors import UserError


def write_unique_tokens(prefix, document_lengths, first_token=0) -> list[np.ndarray]:
    """Documents whose tokens are consecutive unique ids, so a token names its position."""
    documents, position = [], first_token
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for length in document_lengths:
            doc = np.arange(position, position + length)
            writer.add_document([doc])
            documents.append(doc)
            position += length
    return documents


def all_items(dataset) -> list[np.ndarray]:
    return [dataset[i] for i in range(len(dataset))]


def test_one_epoch_covers_every_token_exactly_once():
    lengths = [7, 1, 30, 0, 12, 5, 19]
    boundaries = np.cumsum(lengths)[:-1]
    tokens = np.arange(sum(lengths))
    seq_length = 8
    dataset = TokenArrayDataset(tokens, seq_length, seed=3, boundaries=boundaries)
    assert len(dataset) == (len(tokens) - 1) // seq_length
    inputs = np.concatenate([item[:-1] for item in all_items(dataset)])
    # Every input token is distinct, and only the last < seq_length + 1 tokens of the stream are unused.
    assert len(np.unique(inputs)) == len(inputs) == len(dataset) * seq_length
    assert len(tokens) - len(inputs) <= seq_length
    for item in all_items(dataset):
        assert item.dtype == np.int64 and item.shape == (seq_length + 1,)


def test_samples_cross_documents_in_stream_order_and_share_one_token():
    dataset = TokenArrayDataset(np.arange(100), seq_length=10, seed=0, boundaries=[40, 70])
    stream = np.concatenate([dataset.sample(s)[:-1] for s in range(len(dataset))])
    # Samples follow the document order, so the stream is the documents in that order.
    order = [int(k) for k in dataset.document_order[:3]]
    expected = np.concatenate([np.split(np.arange(100), [40, 70])[k] for k in order])
    assert np.array_equal(stream, expected[: len(stream)])
    for s in range(len(dataset) - 1):
        assert dataset.sample(s)[-1] == dataset.sample(s + 1)[0]


def test_several_epochs_each_cover_every_token_once(tmp_path):
    documents = write_unique_tokens(tmp_path / "d", [13, 29, 8, 21])
    total = sum(len(d) for d in documents)  # 71 tokens
    seq_length, epochs = 5, 3
    num_samples = (epochs * total) // seq_length - 1
    train, valid, test = build_gpt_datasets([str(tmp_path / "d")], "1", seq_length, seed=7,
                                            num_samples=(num_samples, 0, 0))
    assert valid is None and test is None
    assert train.num_epochs == epochs
    counts = np.bincount(np.concatenate([item[:-1] for item in all_items(train)]), minlength=total)
    # Two full epochs plus most of the third: every token at least twice, never more than three times.
    assert counts.min() >= epochs - 1 and counts.max() <= epochs
    first_two_epochs = train.document_order[: 2 * len(documents)]
    assert sorted(first_two_epochs[:4].tolist()) == sorted(first_two_epochs[4:].tolist()) == [0, 1, 2, 3]


def test_split_by_document_weights(tmp_path):
    documents = write_unique_tokens(tmp_path / "d", [10] * 100)
    train, valid, test = build_gpt_datasets([str(tmp_path / "d")], "80,15,5", 4, seed=1, num_samples=(50, 20, 10))
    assert (len(train), len(valid), len(test)) == (50, 20, 10)
    for dataset, (start, end) in zip((train, valid, test), [(0, 80), (80, 95), (95, 100)]):
        tokens = np.concatenate(all_items(dataset))
        assert tokens.min() >= documents[start][0] and tokens.max() <= documents[end - 1][-1]
    assert parse_split("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert split_document_ranges(1000, parse_split("949,50,1")) == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges(10, parse_split("1,0,0")) == [(0, 10), (10, 10), (10, 10)]


def test_deterministic_for_a_seed_and_cached(tmp_path):
    write_unique_tokens(tmp_path / "d", [17, 3, 40, 22, 9])
    build = lambda seed, cache: build_gpt_datasets([str(tmp_path / "d")], "1", 6, seed, (30, 0, 0), cache)[0]
    first = build(5, tmp_path / "cache")
    cached_files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(cached_files) == 4  # three .npy indices + the description
    again = build(5, tmp_path / "cache")  # loaded from the cache
    uncached = build(5, None)  # default cache dir beside the data
    assert (tmp_path / "index-cache").is_dir()
    assert all(np.array_equal(a, b) for a, b in zip(all_items(first), all_items(again)))
    assert all(np.array_equal(a, b) for a, b in zip(all_items(first), all_items(uncached)))
    other = build(6, tmp_path / "cache")
    assert not all(np.array_equal(a, b) for a, b in zip(all_items(first), all_items(other)))
    assert len(list((tmp_path / "cache").iterdir())) == 8  # a new seed hashes to new file names


def test_item_is_computed_directly_for_resumption():
    dataset = TokenArrayDataset(np.arange(500), seq_length=16, seed=2, num_samples=60)
    items = all_items(dataset)
    for i in (59, 0, 31, 7):
        assert np.array_equal(dataset[i], items[i])
    with pytest.raises(IndexError):
        dataset[60]


def test_blending_index_is_exact_at_every_prefix():
    weights = [0.5, 0.3, 0.2]
    dataset_index, sample_index = build_blending_index(weights, 1000)
    counts = np.zeros(3)
    for n, d in enumerate(dataset_index, start=1):
        assert sample_index[n - 1] == counts[d]
        counts[d] += 1
        assert np.all(np.abs(counts - np.asarray(weights) * n) <= 1.0)
    assert counts.tolist() == [500, 300, 200]


def test_splits_without_documents_are_none_with_a_warning(tmp_path):
    write_unique_tokens(tmp_path / "small", [10] * 5)
    write_unique_tokens(tmp_path / "large", [10] * 100, first_token=1000)
    with pytest.warns(UserWarning) as record:
        train, valid, test = build_gpt_datasets([str(tmp_path / "small")], "949,50,1", 4, 0, (10, 10, 10))
    messages = [str(w.message) for w in record]
    assert len(messages) == 2 and all("small gets 0 of 5 documents" in m for m in messages)
    assert len(train) == 10 and valid is None and test is None
    with pytest.warns(UserWarning, match="left out"):
        _, valid, _ = build_gpt_datasets(["1", str(tmp_path / "small"), "1", str(tmp_path / "large")], "95,5,0",
                                         4, 0, (10, 20, 0))
    assert len(valid) == 20 and all(valid[i].min() >= 1000 for i in range(20))  # only the large file


def test_blended_datasets_draw_in_proportion(tmp_path):
    write_unique_tokens(tmp_path / "a", [20] * 30, first_token=0)
    write_unique_tokens(tmp_path / "b", [20] * 30, first_token=10_000)
    train, valid, _ = build_gpt_datasets(["3", str(tmp_path / "a"), "1", str(tmp_path / "b")], "9,1,0",
                                         seq_length=4, seed=0, num_samples=(400, 0, 0), cache_dir=tmp_path / "c")
    from_a = sum(int(item[0] < 10_000) for item in all_items(train))
    assert len(train) == 400 and from_a == 300
    assert len(valid) > 0  # 0 requested = one epoch of each file's valid documents


def test_bad_dataset_settings_are_user_errors(tmp_path):
    write_unique_tokens(tmp_path / "d", [10] * 5)
    with pytest.raises(UserError, match="train split of .* gets 0 of 5 documents"):
        build_gpt_datasets([str(tmp_path / "d")], "1,100,100", 4, 0, (10, 10, 10))
    with pytest.raises(UserError, match="data.split"):
        build_gpt_datasets([str(tmp_path / "d")], "a,b", 4, 0, (10, 0, 0))
    with pytest.raises(UserError, match="weight"):
        build_gpt_datasets(["x", str(tmp_path / "d"), "1"], "1", 4, 0, (10, 0, 0))
    with pytest.raises(UserError, match="not found"):
        build_gpt_datasets([str(tmp_path / "missing")], "1", 4, 0, (10, 0, 0))


def test_end_to_end_from_preprocessed_text(tmp_path, data_dir):
    from shardlm.cli import main
    from shardlm.data.tokenizers import build_tokenizer

    gpt2 = build_tokenizer("gpt2", data_dir / "vocab/gpt2/encoder.json", data_dir / "vocab/gpt2/vocab.bpe")
    assert main(["preprocess", "--input", str(data_dir / "corpus/tinyshakespeare.txt"), "--output-prefix",
                 str(tmp_path / "shakespeare"), "--tokenizer", "gpt2", "--vocab-file",
                 str(data_dir / "vocab/gpt2/encoder.json"), "--merges-file", str(data_dir / "vocab/gpt2/vocab.bpe"),
                 "--append-eod", "--no-progress"]) == 0
    train, valid, test = build_gpt_datasets([str(tmp_path / "shakespeare")], "949,50,1", 128, 1234,
                                            (1000, 0, 0))
    assert len(train) == 1000 and len(valid) > 0 and len(test) > 0
    text = gpt2.decode(train[0])
    assert len(text) > 100 and train[0].max() <= gpt2.eod
    eods = sum(int((train[i] == gpt2.eod).sum()) for i in range(len(train)))
    assert eods > 0  # samples cross document boundaries
