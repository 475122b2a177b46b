"""The tokenizers reproduce OpenAI's GPT-2 encoding and BERT's WordPiece, and reject bad vocabularies."""

from __future__ import annotations

import json

import pytest
import tiktoken

from shardlm.data.tokenizers import build_tokenizer
from shardlm.errors import UserError

# OpenAI's GPT-2 pre-split pattern (the one tiktoken's r50k_base uses).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

VARIED_TEXTS = [
    "Hello world",
    "",
    " ",
    "  lots   of\n\n\n  spaces\t\there \n",
    "I'm sure it's fine; we'll see, they've said you'd GO. DON'T",
    "naïve café Straße 日本語のテキスト Привет мир",
    "emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "numbers 123456789 3.14159 1,000,000 2024-01-01 0x1F",
    "<|endoftext|> appears as plain text",
    "tabs\tand\r\nwindows line ends\x00\x7f",
    "a" * 300 + " " + "ab" * 100,
    "def f(x):\n    return x ** 2  # code\n",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (from the GPT-2 paper's encoder)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


@pytest.fixture(scope="module")
def gpt2(data_dir):
    return build_tokenizer("gpt2", data_dir / "vocab/gpt2/encoder.json", data_dir / "vocab/gpt2/vocab.bpe")


@pytest.fixture(scope="module")
def bert(data_dir):
    return build_tokenizer("bert", data_dir / "vocab/bert-base-uncased/vocab.txt")


@pytest.fixture(scope="module")
def reference_gpt2(data_dir) -> tiktoken.Encoding:
    """tiktoken built offline from the same encoder.json: an independent BPE implementation."""
    byte_of_char = {char: byte for byte, char in _bytes_to_unicode().items()}
    encoder = json.loads((data_dir / "vocab/gpt2/encoder.json").read_text(encoding="utf-8"))
    ranks = {
        bytes(byte_of_char[c] for c in token): rank
        for token, rank in encoder.items()
        if token != "<|endoftext|>"
    }
    return tiktoken.Encoding(
        name="gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": encoder["<|endoftext|>"]},
    )


def test_gpt2_has_openai_vocabulary(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == 50256
    assert gpt2.decode([gpt2.eod]) == "<|endoftext|>"


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_gpt2_equals_tiktoken_and_round_trips(gpt2, reference_gpt2, text):
    ids = gpt2.encode(text)
    assert ids == reference_gpt2.encode_ordinary(text)
    assert gpt2.decode(ids) == text


def test_gpt2_equals_tiktoken_on_shared_corpora(gpt2, reference_gpt2, data_dir):
    for name in ("moby_dick_pg2701.txt", "tinyshakespeare.txt", "pride_and_prejudice_pg1342.txt"):
        text = (data_dir / "corpus" / name).read_text(encoding="utf-8")[:60_000]
        ids = gpt2.encode(text)
        assert ids == reference_gpt2.encode_ordinary(text), name
        assert gpt2.decode(ids) == text
    wiki = (data_dir / "wikitext/wikitext-103/wiki.valid.tokens").read_text(encoding="utf-8")[:60_000]
    assert gpt2.encode(wiki) == reference_gpt2.encode_ordinary(wiki)


def test_gpt2_batch_equals_single(gpt2):
    assert gpt2.encode_batch(VARIED_TEXTS) == [gpt2.encode(t) for t in VARIED_TEXTS]


def test_gpt2_accepts_hf_file_names(tmp_path, data_dir, gpt2):
    (tmp_path / "vocab.json").write_bytes((data_dir / "vocab/gpt2/encoder.json").read_bytes())
    (tmp_path / "merges.txt").write_bytes((data_dir / "vocab/gpt2/vocab.bpe").read_bytes())
    hf_named = build_tokenizer("gpt2", tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert hf_named.encode(VARIED_TEXTS[4]) == gpt2.encode(VARIED_TEXTS[4])


def test_bert_wordpiece(bert):
    assert bert.vocab_size == 30522
    assert (bert.pad, bert.cls, bert.sep, bert.mask) == (0, 101, 102, 103)
    assert bert.eod == bert.sep
    ids = bert.encode("Hello, World! The Tokenization")
    assert [bert.id_to_token(i) for i in ids] == ["hello", ",", "world", "!", "the", "token", "##ization"]
    assert bert.decode(ids) == "hello, world! the tokenization"
    assert bert.encode_batch(["a b", "c"]) == [bert.encode("a b"), bert.encode("c")]


def test_bert_cased_option_keeps_case(data_dir):
    cased = build_tokenizer("bert", data_dir / "vocab/bert-base-uncased/vocab.txt", lower_case=False)
    # The uncased vocabulary has no "Hello": kept case makes it unknown, which shows no lower-casing happened.
    assert cased.encode("Hello") != build_tokenizer(
        "bert", data_dir / "vocab/bert-base-uncased/vocab.txt").encode("Hello")


def test_missing_vocabulary_names_the_file(tmp_path):
    missing = tmp_path / "nope" / "encoder.json"
    existing = tmp_path / "encoder.json"
    existing.write_text("{}", encoding="utf-8")
    with pytest.raises(UserError, match="encoder.json"):
        build_tokenizer("gpt2", missing, tmp_path / "vocab.bpe")
    with pytest.raises(UserError, match="vocab.txt"):
        build_tokenizer("bert", tmp_path / "vocab.txt")
    with pytest.raises(UserError, match="--merges-file"):
        build_tokenizer("gpt2", existing, None)
    with pytest.raises(UserError, match="unknown tokenizer kind"):
        build_tokenizer("sentencepiece", tmp_path / "x")


def test_unreadable_vocabulary_is_a_user_error(tmp_path, data_dir):
    bad_json = tmp_path / "encoder.json"
    bad_json.write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match="encoder.json") as info:
        build_tokenizer("gpt2", bad_json, data_dir / "vocab/gpt2/vocab.bpe")
    assert "\n" not in str(info.value)
    binary = tmp_path / "vocab.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="vocab.txt"):
        build_tokenizer("bert", binary)
    bad_tokenizer = tmp_path / "tokenizer.json"
    bad_tokenizer.write_text("[]", encoding="utf-8")
    with pytest.raises(UserError, match="tokenizer.json"):
        build_tokenizer("json", bad_tokenizer)


def test_bert_equals_transformers_bert_tokenizer(bert, data_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertTokenizer.from_pretrained(str(data_dir / "vocab/bert-base-uncased"),
                                                           do_lower_case=True)
    texts = VARIED_TEXTS + [
        (data_dir / "corpus/moby_dick_pg2701.txt").read_text(encoding="utf-8")[:30_000],
        (data_dir / "wikitext/wikitext-103/wiki.valid.tokens").read_text(encoding="utf-8")[:30_000],
        "été \u0301 accents ÀÉÎÕÜ",
    ]
    for text in texts:
        assert bert.encode(text) == reference.encode(text, add_special_tokens=False)
