"""`shardlm preprocess`: text documents -> token ids -> `PREFIX.bin` / `PREFIX.idx` (Megatron format).

The input streams through in batches of documents; with `workers > 1` a process pool tokenizes the
batches while the main process reads and writes. Results are taken in input order (the output does
not depend on the worker count) and at most 4 x workers batches are in flight (memory stays
bounded however large the input). Each document becomes one sequence, or one sequence per sentence
with `split_sentences` (for BERT). With `append_eod` the tokenizer's end-of-document id ends each
document's last sequence. Documents with no tokens are skipped and counted.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardlm.data.documents import ReadStats, input_format, iter_documents
from shardlm.data.indexed import IndexedDatasetWriter, token_dtype_for_vocab
from shardlm.data.sentences import split_sentences
from shardlm.data.tokenizers import Tokenizer, build_tokenizer
from shardlm.errors import UserError

DOCUMENTS_PER_BATCH = 256


@dataclass
class PreprocessConfig:
    """Everything `preprocess` needs; mirrors the command-line flags."""

    input: Path  # .jsonl, .txt, or either with .gz
    output_prefix: Path  # writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx
    tokenizer: str  # "gpt2", "bert" or "json" (see build_tokenizer)
    vocab_file: Path | None = None  # encoder.json / vocab.txt / tokenizer.json
    merges_file: Path | None = None  # vocab.bpe (gpt2 only)
    lower_case: bool = True  # bert only
    json_key: str = "text"  # key of the document text in each .jsonl record
    txt_mode: str = "paragraph"  # .txt documents: "paragraph" (blank-line separated) or "line"
    append_eod: bool = False  # end each document with the tokenizer's end-of-document id
    split_sentences: bool = False  # one index sequence per sentence (BERT)
    workers: int = 1  # tokenizer processes
    skip_bad_lines: bool = False  # skip malformed .jsonl lines instead of failing


@dataclass
class PreprocessResult:
    """What one run wrote and how fast."""

    documents: int
    sequences: int
    tokens: int
    empty_documents: int
    bad_lines: int
    bytes_read: int
    seconds: float
    bad_line_numbers: list[int] = field(default_factory=list)  # the first 20 skipped lines

    @property
    def documents_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


# One tokenized document: its sequences (sentences, or the whole text) as int64 arrays.
TokenizedDocument = list[np.ndarray]

_worker_tokenizer: Tokenizer | None = None
_worker_options: tuple[bool, bool] = (False, False)


def _init_worker(config: PreprocessConfig) -> None:
    global _worker_tokenizer, _worker_options
    # A forked worker inherits the command's SIGTERM / Ctrl-C handlers (`shardlm.signals`), under which
    # `pool.terminate()`'s SIGTERM raised inside the pool's own loop instead of ending the worker, and
    # the join could hang. Workers die on SIGTERM and leave Ctrl-C to the parent, which stops the pool.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker_tokenizer = _build(config)
    _worker_options = (config.split_sentences, config.append_eod)


def _worker_tokenize(texts: list[str]) -> list[TokenizedDocument]:
    assert _worker_tokenizer is not None
    return tokenize_documents(_worker_tokenizer, texts, *_worker_options)


def _build(config: PreprocessConfig) -> Tokenizer:
    return build_tokenizer(config.tokenizer, config.vocab_file, config.merges_file, config.lower_case)


def tokenize_documents(
    tokenizer: Tokenizer, texts: list[str], split_sentences_: bool, append_eod: bool
) -> list[TokenizedDocument]:
    """Tokenize a batch of documents; each becomes a list of sequences (one per sentence if split)."""
    if split_sentences_:
        pieces = [split_sentences(text) for text in texts]
    else:
        pieces = [[text] if text else [] for text in texts]
    flat = [sentence for sentences in pieces for sentence in sentences]
    encoded = tokenizer.encode_batch(flat) if flat else []
    documents: list[TokenizedDocument] = []
    position = 0
    for sentences in pieces:
        ids = [np.asarray(e, dtype=np.int64) for e in encoded[position:position + len(sentences)]]
        position += len(sentences)
        ids = [sequence for sequence in ids if sequence.size]
        if ids and append_eod:
            ids[-1] = np.append(ids[-1], tokenizer.eod)
        documents.append(ids)
    return documents


def _batches(config: PreprocessConfig, stats: ReadStats) -> Iterator[list[str]]:
    batch: list[str] = []
    for document in iter_documents(config.input, config.json_key, config.txt_mode, config.skip_bad_lines, stats):
        batch.append(document.text)
        if len(batch) == DOCUMENTS_PER_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def preprocess(config: PreprocessConfig, progress: bool = True) -> PreprocessResult:
    """Tokenize `config.input` into `config.output_prefix`.{bin,idx}; returns counts and timing."""
    if config.workers < 1:
        raise UserError(f"--workers {config.workers} must be at least 1")
    if not Path(config.input).is_file():
        raise UserError(f"input file not found: {config.input}; check --input")
    input_format(config.input)  # fails early on an unknown extension
    tokenizer = _build(config)  # also validates the vocabulary before any worker starts
    stats = ReadStats()
    start = time.perf_counter()
    empty = 0
    bar = _progress_bar(config.input, progress)
    pool = None
    try:
        with IndexedDatasetWriter(config.output_prefix, token_dtype_for_vocab(tokenizer.vocab_size)) as writer:
            if config.workers == 1:
                results = (tokenize_documents(tokenizer, batch, config.split_sentences, config.append_eod)
                           for batch in _batches(config, stats))
            else:
                pool = _start_pool(config)
                results = _ordered_bounded_map(pool, _batches(config, stats), 4 * config.workers)
            for documents in results:
                for sequences in documents:
                    if sequences:
                        writer.add_document(sequences)
                    else:
                        empty += 1
                _update_bar(bar, len(documents), stats.bytes_read, start)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
    return PreprocessResult(
        documents=writer.num_documents, sequences=len(writer.sequence_lengths), tokens=writer.num_tokens,
        empty_documents=empty, bad_lines=stats.bad_lines, bytes_read=stats.bytes_read,
        seconds=time.perf_counter() - start, bad_line_numbers=stats.bad_line_numbers,
    )


def _ordered_bounded_map(pool, batches: Iterator[list[str]], max_in_flight: int) -> Iterator:
    """`pool.imap` in input order, but reading at most `max_in_flight` batches ahead (bounded memory)."""
    in_flight: deque = deque()
    for batch in batches:
        in_flight.append(pool.apply_async(_worker_tokenize, (batch,)))
        if len(in_flight) >= max_in_flight:
            yield in_flight.popleft().get()
    while in_flight:
        yield in_flight.popleft().get()


def _start_pool(config: PreprocessConfig):
    """A pool of tokenizer processes; fork where the platform has it (no re-import of __main__)."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # Children inherit the variable: one tokenizer thread each, and no fork-after-threads warning.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Forked workers must die on SIGTERM from their first instruction: a `pool.terminate()` that reaches a
    # worker before its initializer resets the handler would otherwise run the command's inherited Python
    # handler there, and the pool's join would wait for it forever. So they are forked with the default one.
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main_thread else None
    try:
        return multiprocessing.get_context(method).Pool(
            config.workers, initializer=_init_worker, initargs=(config,))
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, handler)
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _progress_bar(path: Path, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc=f"preprocess {Path(path).name}", unit=" docs", dynamic_ncols=True)


def _update_bar(bar, documents: int, bytes_read: int, start: float) -> None:
    if bar is None:
        return
    bar.update(documents)
    elapsed = max(time.perf_counter() - start, 1e-9)
    bar.set_postfix_str(f"{bytes_read / elapsed / 1e6:.2f} MB/s", refresh=False)
