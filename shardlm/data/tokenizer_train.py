"""`shardlm tokenizer train`: a new vocabulary from text files, saved as HF `tokenizer.json`.

Two recipes, matching the two model families:

- "bpe": byte-level BPE as GPT-2's (same regex pre-split, all 256 bytes in the base alphabet, so no
  text is ever unknown). Special token `<|endoftext|>` (id 0) is the end-of-document token.
- "wordpiece": BERT's basic tokenizer (optional lower case) + WordPiece with `##` continuations.
  Special tokens `[PAD] [UNK] [CLS] [SEP] [MASK]` get ids 0-4; `[SEP]` ends documents.

Load the result with `build_tokenizer("json", DIR / "tokenizer.json")`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from shardlm.data.documents import iter_documents
from shardlm.errors import UserError

TRAIN_KINDS = ("bpe", "wordpiece")
BPE_SPECIAL_TOKENS = ["<|endoftext|>"]
WORDPIECE_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _texts(inputs: Sequence[Path], json_key: str, txt_mode: str) -> Iterator[str]:
    for path in inputs:
        for document in iter_documents(path, json_key=json_key, txt_mode=txt_mode):
            yield document.text


def train_tokenizer(
    inputs: Sequence[str | Path],
    kind: str,
    vocab_size: int,
    output_dir: str | Path,
    lower_case: bool = True,
    min_frequency: int = 2,
    json_key: str = "text",
    txt_mode: str = "paragraph",
    show_progress: bool = True,
) -> Path:
    """Train a `kind` tokenizer of at most `vocab_size` entries; returns `output_dir/tokenizer.json`.

    The file is written under a temporary name and renamed, so it is either complete or absent.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind not in TRAIN_KINDS:
        raise UserError(f"unknown tokenizer kind {kind!r} to train; choose one of {', '.join(TRAIN_KINDS)}")
    smallest = 257 if kind == "bpe" else len(WORDPIECE_SPECIAL_TOKENS) + 1  # bytes + <|endoftext|>
    if vocab_size < smallest:
        raise UserError(f"--vocab-size {vocab_size} is too small for {kind}; use at least {smallest}")
    inputs = [Path(p) for p in inputs]
    for path in inputs:
        if not path.is_file():
            raise UserError(f"input file not found: {path}; check --input")
    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=BPE_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress,
        )
    else:
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=None)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=WORDPIECE_SPECIAL_TOKENS,
            continuing_subword_prefix="##", show_progress=show_progress,
        )
    tokenizer.train_from_iterator(_texts(inputs, json_key, txt_mode), trainer=trainer)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / "tokenizer.json"
    temporary = output_dir / f"tokenizer.json.tmp-{os.getpid()}"
    tokenizer.save(str(temporary))
    os.replace(temporary, final)
    return final
