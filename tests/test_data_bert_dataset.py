"""BERT samples: 15% masked (80/10/10), whole words kept together, balanced and correct SOP labels."""

from __future__ import annotations

import numpy as np
import pytest

from shardlm.data.bert_dataset import BertDataset, build_bert_datasets
from shardlm.data.indexed import IndexedDataset, IndexedDatasetWriter
from shardlm.data.masking import IGNORE_LABEL, MaskingConfig
from shardlm.data.preprocess import PreprocessConfig, preprocess
from shardlm.data.tokenizers import build_tokenizer
from shardlm.errors import UserError

SEQ_LENGTH = 64


@pytest.fixture(scope="module")
def bert(data_dir):
    return build_tokenizer("bert", data_dir / "vocab/bert-base-uncased/vocab.txt")


@pytest.fixture(scope="module")
def novel_prefix(tmp_path_factory, data_dir):
    """Pride and Prejudice, sentence-split with the BERT vocabulary (about 2,500 documents)."""
    prefix = tmp_path_factory.mktemp("bert") / "novel"
    preprocess(PreprocessConfig(
        input=data_dir / "corpus/pride_and_prejudice_pg1342.txt", output_prefix=prefix, tokenizer="bert",
        vocab_file=data_dir / "vocab/bert-base-uncased/vocab.txt", split_sentences=True,
    ), progress=False)
    return prefix


@pytest.fixture(scope="module")
def novel_samples(novel_prefix, bert):
    train, _, _ = build_bert_datasets([str(novel_prefix)], "1", SEQ_LENGTH, seed=11, num_samples=(3000, 0, 0),
                                      tokenizer=bert)
    return [train[i] for i in range(len(train))]


def write_unique_sentences(prefix, num_documents=60, sentences=4, length=6, first=2000) -> None:
    """Documents of sentences whose ids increase through the file (ids >= 2000 are ordinary words)."""
    token = first
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(num_documents):
            doc = []
            for _ in range(sentences):
                doc.append(list(range(token, token + length)))
                token += length
            writer.add_document(doc)


def originals(sample) -> np.ndarray:
    return np.where(sample["labels"] != IGNORE_LABEL, sample["labels"], sample["tokens"])


def test_sample_layout(novel_samples, bert):
    for sample in novel_samples[:200]:
        assert set(sample) == {"tokens", "token_types", "labels", "padding_mask", "is_random"}
        assert all(v.dtype == np.int64 for v in sample.values())
        length = int(sample["padding_mask"].sum())
        assert sample["tokens"].shape == (SEQ_LENGTH,) and sample["padding_mask"][:length].all()
        tokens = originals(sample)
        assert tokens[0] == bert.cls and tokens[length - 1] == bert.sep
        assert (tokens[length:] == bert.pad).all() and (sample["labels"][length:] == IGNORE_LABEL).all()
        seps = np.flatnonzero(tokens[:length] == bert.sep)
        assert len(seps) == 2
        types = sample["token_types"]
        assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1:length] == 1).all()
        assert (sample["labels"][[0, *seps]] == IGNORE_LABEL).all()


def test_masking_statistics(novel_samples, bert):
    labels = np.stack([s["labels"] for s in novel_samples])
    tokens = np.stack([s["tokens"] for s in novel_samples])
    maskable = int(np.stack([s["padding_mask"] for s in novel_samples]).sum()) - 3 * len(novel_samples)
    chosen = labels != IGNORE_LABEL
    assert chosen.sum() / maskable == pytest.approx(0.15, abs=0.01)
    replaced_by_mask = (tokens[chosen] == bert.mask).mean()
    kept = (tokens[chosen] == labels[chosen]).mean()
    assert replaced_by_mask == pytest.approx(0.8, abs=0.02)
    assert kept == pytest.approx(0.1, abs=0.02)
    assert 1 - replaced_by_mask - kept == pytest.approx(0.1, abs=0.02)


def test_whole_words_are_masked_together(novel_samples, bert):
    pieces_checked = 0
    for sample in novel_samples:
        tokens, chosen = originals(sample), sample["labels"] != IGNORE_LABEL
        for position in range(2, int(sample["padding_mask"].sum())):
            after_special = tokens[position - 1] in (bert.cls, bert.sep)  # a truncated word's tail
            if bert.id_to_token(int(tokens[position])).startswith("##") and not after_special:
                assert chosen[position] == chosen[position - 1]
                pieces_checked += 1
    assert pieces_checked > 100


def test_sentence_order_labels_are_balanced_and_true(tmp_path, bert):
    write_unique_sentences(tmp_path / "u")
    source = IndexedDataset(tmp_path / "u")
    dataset = BertDataset(source, (0, 60), 32, seed=4, num_samples=2000, tokenizer=bert)
    labels = [int(dataset[i]["is_random"]) for i in range(len(dataset))]
    assert np.mean(labels) == pytest.approx(0.5, abs=0.04)
    for i in range(200):
        sample = dataset[i]
        tokens = originals(sample)
        real = sample["padding_mask"] == 1
        words = (tokens >= 2000) & real
        a, b = tokens[words & (sample["token_types"] == 0)], tokens[words & (sample["token_types"] == 1)]
        assert len(a) and len(b)
        assert (a.max() < b.min()) == (sample["is_random"] == 0)


def test_next_sentence_prediction_takes_b_from_another_document(tmp_path, bert):
    write_unique_sentences(tmp_path / "u", length=6, sentences=4)
    dataset = BertDataset(IndexedDataset(tmp_path / "u"), (0, 60), 32, seed=4, num_samples=300, tokenizer=bert,
                          next_sentence_prediction=True)
    document_of = lambda token: (token - 2000) // 24
    for i in range(len(dataset)):
        sample = dataset[i]
        tokens, types = originals(sample), sample["token_types"]
        words = (tokens >= 2000) & (sample["padding_mask"] == 1)
        a_docs = {document_of(t) for t in tokens[words & (types == 0)]}
        b_docs = {document_of(t) for t in tokens[words & (types == 1)]}
        assert len(a_docs) == 1
        assert (b_docs != a_docs) == bool(sample["is_random"])


def test_deterministic_for_seed_and_index(novel_prefix, bert, tmp_path):
    build = lambda seed: build_bert_datasets([str(novel_prefix)], "9,1,0", SEQ_LENGTH, seed, (50, 10, 0), bert,
                                             cache_dir=tmp_path)
    first, again, other = build(3)[0], build(3)[0], build(4)[0]
    for i in (0, 17, 49):
        assert all(np.array_equal(first[i][k], again[i][k]) for k in first[i])
    assert any(not np.array_equal(first[i]["tokens"], other[i]["tokens"]) for i in range(10))


def test_single_token_masking_without_whole_words(novel_prefix, bert):
    masking = MaskingConfig(whole_word=False, max_ngram=1)
    train = build_bert_datasets([str(novel_prefix)], "1", SEQ_LENGTH, 0, (300, 0, 0), bert, masking=masking)[0]
    split_words = 0
    for i in range(len(train)):
        sample = train[i]
        tokens, chosen = originals(sample), sample["labels"] != IGNORE_LABEL
        for p in range(2, int(sample["padding_mask"].sum())):
            if bert.id_to_token(int(tokens[p])).startswith("##") and chosen[p] != chosen[p - 1]:
                split_words += 1
    assert split_words > 0  # token-level masking does split words


def test_unsplit_documents_are_rejected(tmp_path, bert):
    with IndexedDatasetWriter(tmp_path / "whole", np.uint16) as writer:
        for k in range(10):
            writer.add_document([list(range(2000 + k, 2050 + k))])
    with pytest.raises(UserError, match="--split-sentences"):
        build_bert_datasets([str(tmp_path / "whole")], "1", 32, 0, (10, 0, 0), bert)


def test_tokenizer_without_bert_specials_is_rejected(tmp_path, data_dir):
    write_unique_sentences(tmp_path / "u")
    gpt2 = build_tokenizer("gpt2", data_dir / "vocab/gpt2/encoder.json", data_dir / "vocab/gpt2/vocab.bpe")
    with pytest.raises(UserError, match=r"\[CLS\]"):
        BertDataset(IndexedDataset(tmp_path / "u"), (0, 60), 32, 0, 10, gpt2)
