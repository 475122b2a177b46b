"""Tokenizers for GPT-2 (byte-level BPE), BERT (WordPiece) and saved HF `tokenizer.json` files.

All three are built with the Hugging Face `tokenizers` library and wrapped in one small `Tokenizer`
class, so the rest of shardlm sees the same interface: `vocab_size`, `eod`, `encode`,
`encode_batch`, `decode` and, where the vocabulary has them, the BERT special ids `cls`, `sep`,
`mask`, `pad`.

Special tokens are never parsed out of the input text: a document that happens to contain the
characters `<|endoftext|>` encodes them as ordinary text (as OpenAI's GPT-2 encoder and tiktoken's
`encode_ordinary` do). Document boundaries are added by the caller with the `eod` id.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from shardlm.errors import UserError
from shardlm.paths import shared_data_dir

GPT2_EOD_TOKEN = "<|endoftext|>"
BERT_SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
# Candidates for the end-of-document token of a trained tokenizer, tried in this order.
EOD_CANDIDATES = (GPT2_EOD_TOKEN, "[SEP]", "</s>", "<eos>")
TOKENIZER_KINDS = ("gpt2", "bert", "json")


class Tokenizer:
    """A text <-> token-id mapping with the special ids shardlm needs.

    `eod` is the end-of-document id appended between documents (`<|endoftext|>` for GPT-2,
    `[SEP]` for BERT, the first of `EOD_CANDIDATES` present for a `tokenizer.json`). `cls`, `sep`,
    `mask`, `pad` are the BERT ids, or None when the vocabulary has no such token.
    """

    def __init__(self, backend: HFTokenizer, kind: str, eod_token: str) -> None:
        self.backend = backend
        self.kind = kind
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eod: int = self._require_id(eod_token)
        self.cls: int | None = backend.token_to_id(BERT_SPECIAL_TOKENS["cls"])
        self.sep: int | None = backend.token_to_id(BERT_SPECIAL_TOKENS["sep"])
        self.mask: int | None = backend.token_to_id(BERT_SPECIAL_TOKENS["mask"])
        self.pad: int | None = backend.token_to_id(BERT_SPECIAL_TOKENS["pad"])

    def _require_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise UserError(f"the {self.kind} vocabulary has no {token!r} token; use one that has it")
        return token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (list of lists, one per text), without special tokens."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; special tokens are kept so that text -> ids -> text round trips."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (e.g. `##ing` for a WordPiece continuation)."""
        return self.backend.id_to_token(int(token_id))

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _require_file(path: str | Path | None, what: str, flag: str) -> Path:
    if path is None:
        raise UserError(f"the {what} is required; pass it with {flag}")
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} not found: {path}; check the path given with {flag}")
    return path


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.__class__.__name__
        raise UserError(f"cannot read {what} {path}: {reason}; pass a UTF-8 text file") from exc


def _gpt2_backend(vocab_file: Path, merges_file: Path) -> HFTokenizer:
    """Byte-level BPE with GPT-2's regex pre-split; accepts OpenAI's and HF's file names alike."""
    try:
        vocab = json.loads(_read_text(vocab_file, "GPT-2 vocabulary"))
    except json.JSONDecodeError as exc:
        raise UserError(f"GPT-2 vocabulary {vocab_file} is not valid JSON (line {exc.lineno}); "
                        "pass encoder.json or vocab.json") from exc
    if not isinstance(vocab, dict):
        raise UserError(f"GPT-2 vocabulary {vocab_file} is not a token -> id JSON object; pass encoder.json")
    merges = []
    for line_number, line in enumerate(_read_text(merges_file, "GPT-2 merges").splitlines(), start=1):
        if line.startswith("#version") or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise UserError(f"GPT-2 merges {merges_file} line {line_number} is not 'left right'; "
                            "pass vocab.bpe or merges.txt")
        merges.append((parts[0], parts[1]))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _bert_backend(vocab_file: Path, lower_case: bool) -> HFTokenizer:
    """WordPiece over BERT's basic tokenizer (whitespace, punctuation and CJK split, optional lower case)."""
    tokens = _read_text(vocab_file, "BERT vocabulary").splitlines()
    vocab = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    if BERT_SPECIAL_TOKENS["unk"] not in vocab:
        raise UserError(f"BERT vocabulary {vocab_file} has no [UNK] token; pass a WordPiece vocab.txt")
    backend = HFTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    # Registered as special so that decode keeps them whole; encode never adds them.
    backend.add_special_tokens([t for t in BERT_SPECIAL_TOKENS.values() if t in vocab])
    return backend


def shared_tokenizer(file: Path) -> HFTokenizer:
    """The `tokenizers.Tokenizer` of a tokenizer.json, parsed once per process for each version of the file (a chat
    model's is megabytes, and the SFT data, the RL prompts, a reward model and a teacher of one run each read it).
    Shared by its callers: only encode, decode and look up with it, never configure it."""
    stat = Path(file).stat()
    return _parsed(str(Path(file).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _parsed(file: str, mtime_ns: int, size: int) -> HFTokenizer:
    return HFTokenizer.from_file(file)


def _json_backend(tokenizer_file: Path) -> tuple[HFTokenizer, str]:
    try:
        backend = HFTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the library raises a bare Exception on bad JSON
        raise UserError(f"cannot load tokenizer {tokenizer_file}: {str(exc).splitlines()[0]}; "
                        "pass a tokenizer.json saved by HF tokenizers or `shardlm tokenizer train`") from exc
    vocab = backend.get_vocab(with_added_tokens=True)
    for candidate in EOD_CANDIDATES:
        if candidate in vocab:
            return backend, candidate
    raise UserError(f"tokenizer {tokenizer_file} has none of the end-of-document tokens "
                    f"{list(EOD_CANDIDATES)}; add one as a special token")


def build_tokenizer(
    kind: str,
    vocab_file: str | Path | None = None,
    merges_file: str | Path | None = None,
    lower_case: bool = True,
) -> Tokenizer:
    """Build a tokenizer from local files only (never downloads).

    kind "gpt2": `vocab_file` = `encoder.json` / `vocab.json`, `merges_file` = `vocab.bpe` /
    `merges.txt`. kind "bert": `vocab_file` = WordPiece `vocab.txt`, `lower_case` as the vocabulary
    was built. kind "json": `vocab_file` = a `tokenizer.json`. Missing or unreadable files raise
    `UserError` naming the file.
    """
    if kind == "gpt2":
        vocab_path = _require_file(vocab_file, "GPT-2 vocabulary (encoder.json)", "--vocab-file")
        merges_path = _require_file(merges_file, "GPT-2 merges file (vocab.bpe)", "--merges-file")
        return Tokenizer(_gpt2_backend(vocab_path, merges_path), "gpt2", GPT2_EOD_TOKEN)
    if kind == "bert":
        vocab_path = _require_file(vocab_file, "BERT vocabulary (vocab.txt)", "--vocab-file")
        return Tokenizer(_bert_backend(vocab_path, lower_case), "bert", BERT_SPECIAL_TOKENS["sep"])
    if kind == "json":
        tokenizer_path = _require_file(vocab_file, "tokenizer file (tokenizer.json)", "--vocab-file")
        backend, eod_token = _json_backend(tokenizer_path)
        return Tokenizer(backend, "json", eod_token)
    raise UserError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(TOKENIZER_KINDS)}")


def build_tokenizer_for(data) -> Tokenizer:
    """The tokenizer a data config names (`shardlm.config.DataConfig`: `tokenizer`, `vocab_file`,
    `merges_file`); GPT-2 files default to the shared vocabulary."""
    vocab, merges = data.vocab_file, data.merges_file
    if data.tokenizer == "gpt2":
        vocab = vocab or str(shared_data_dir() / "vocab" / "gpt2" / "encoder.json")
        merges = merges or str(shared_data_dir() / "vocab" / "gpt2" / "vocab.bpe")
    return build_tokenizer(data.tokenizer, vocab_file=vocab or None, merges_file=merges or None)
