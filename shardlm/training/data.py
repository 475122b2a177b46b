"""Training data for the trainer: datasets of fixed-length samples and the batch each rank reads.

A dataset here is anything with `__len__` and `__getitem__(i) -> int64 array of seq_length + 1`
tokens, already shuffled and long enough for the run (`shardlm.data.gpt_dataset`). The trainer reads
the global batch of step `k` as samples `[k * G, (k + 1) * G)` (G = global batch size); DP rank d
takes the d-th contiguous
slice of it, cut into micro-batches; TP ranks of one group read the same samples, and so do the CP
ranks of one DP replica, each keeping its zigzag part of every sequence (`context_parallel_part`).
The position in the data is therefore a pure function of the step, so a resumed run reads the exact
next sample.

Packed rows (SFT conversations, `shardlm.sft.dataset`, or pretraining documents with
`data.document_mask`) are dict samples of `input_ids`, `labels` (already shifted, -100 where nothing is
trained) and `position_ids` (restarting at every document), each (T,). `packed_parts` turns a step's
micro-batches of them into what the loss reads: this rank's inputs and targets, the `Documents` every
attention layer gets, and the divisor that makes the step's loss the sum over every trained token of the
global batch divided by their count (not a mean of per-micro-batch or per-rank means).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardlm.config import DataConfig
from shardlm.data.zigzag import zigzag_split
from shardlm.errors import UserError
from shardlm.models.documents import Documents
from shardlm.models.mtp import rolled_targets

IGNORE_INDEX = -100


def text_file_datasets(data: DataConfig, tokenizer, seq_length: int, seed: int, train_samples: int):
    """Tokenize a text file in memory; its first part (by data.split's train:valid weights) trains,
    the rest validates (None when too short for one sample)."""
    from shardlm.data.gpt_dataset import TokenArrayDataset

    text = Path(data.text_file).read_text(encoding="utf-8", errors="replace")
    tokens = np.asarray(tokenizer.encode(text) + [tokenizer.eod], dtype=np.int64)
    weights = [float(w) for w in data.split.split(",")]
    train_fraction = weights[0] / max(1e-12, weights[0] + (weights[1] if len(weights) > 1 else 0.0))
    cut = int(len(tokens) * train_fraction)
    if cut < seq_length + 1:
        raise UserError(f"data.text_file has {cut} training tokens, fewer than model.seq_length + 1; "
                        "use more text or a shorter sequence")
    train = TokenArrayDataset(tokens[:cut], seq_length, seed=seed, num_samples=train_samples)
    valid = TokenArrayDataset(tokens[cut:], seq_length, seed=seed) if len(tokens) - cut > seq_length else None
    return train, valid


class DocumentSamples:
    """Pretraining samples as packed rows (`data.document_mask`): sample i of `dataset`, (T + 1,) tokens ->
    `input_ids` and `labels` (T,) (every next token trained) and `position_ids` (T,) that restart after
    each end-of-document token `eod`, so each document attends only to itself (the eod closes its own)."""

    def __init__(self, dataset, eod: int):
        self.dataset, self.eod = dataset, eod

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = np.asarray(self.dataset[index], dtype=np.int64)
        inputs = tokens[:-1]
        starts = np.zeros(len(inputs), dtype=bool)
        starts[0] = True
        starts[1:] = inputs[:-1] == self.eod
        start_of = np.maximum.accumulate(np.where(starts, np.arange(len(inputs)), 0))
        return {"input_ids": inputs, "labels": tokens[1:], "position_ids": np.arange(len(inputs)) - start_of}


def build_datasets(data: DataConfig, tokenizer, seq_length: int, seed: int, train_samples: int,
                   valid_samples: int, arch: str = "gpt"):
    """(train, valid) datasets for a run; valid may be None when the split leaves no validation data.
    BERT reads sentence-split indexed datasets (`shardlm preprocess --split-sentences`). With
    `data.document_mask`, GPT and Llama samples become packed rows (`DocumentSamples`)."""
    train, valid = _token_datasets(data, tokenizer, seq_length, seed, train_samples, valid_samples, arch)
    if data.document_mask:
        train = DocumentSamples(train, tokenizer.eod)
        valid = None if valid is None else DocumentSamples(valid, tokenizer.eod)
    return train, valid


def _token_datasets(data: DataConfig, tokenizer, seq_length: int, seed: int, train_samples: int,
                    valid_samples: int, arch: str):
    if arch == "bert":
        if data.text_file:
            raise UserError("model.arch=\"bert\" reads data.prefixes made by `shardlm preprocess --split-sentences`, "
                            "not data.text_file")
        from shardlm.data.bert_dataset import build_bert_datasets
        from shardlm.data.masking import MaskingConfig

        masking = MaskingConfig(whole_word=data.whole_word_masking,
                                max_ngram=3 if data.whole_word_masking else 1)
        train, valid, _ = build_bert_datasets(list(data.prefixes), data.split, seq_length, seed,
                                              (train_samples, valid_samples, 0), tokenizer,
                                              cache_dir=data.cache_dir or None, masking=masking,
                                              next_sentence_prediction=data.next_sentence_prediction)
        return train, valid
    if data.text_file:
        return text_file_datasets(data, tokenizer, seq_length, seed, train_samples)
    from shardlm.data.gpt_dataset import build_gpt_datasets

    train, valid, _ = build_gpt_datasets(list(data.prefixes), data.split, seq_length, seed,
                                         (train_samples, valid_samples, 0), cache_dir=data.cache_dir or None)
    return train, valid


def micro_batches(dataset, first_sample: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                  device: torch.device) -> list[torch.Tensor]:
    """This DP rank's micro-batches of the global batch that starts at sample `first_sample`: each
    (micro_batch, seq_length + 1) int64, or a dict of such stacked fields for dict samples."""
    per_rank = global_batch // dp_size
    first = first_sample + dp_rank * per_rank
    samples = [dataset[first + j] for j in range(per_rank)]
    if isinstance(samples[0], dict):  # e.g. BERT: one tensor per field
        fields = {k: torch.from_numpy(np.stack([s[k] for s in samples])).to(device) for k in samples[0]}
        return [{k: v[i:i + micro_batch] for k, v in fields.items()} for i in range(0, per_rank, micro_batch)]
    tensor = torch.from_numpy(np.stack(samples)).to(device)
    return list(tensor.split(micro_batch))


def context_parallel_part(batch: torch.Tensor, cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (b, T + 1) token micro-batch -> context-parallel rank r's (inputs, targets), each (b, T / C): the
    next-token pairs of chunks r and 2C-1-r of 2C (`shardlm.data.zigzag.zigzag_split`). Positions are
    the model's business (`zigzag_positions`)."""
    return zigzag_split(batch[:, :-1], cp_size, cp_rank), zigzag_split(batch[:, 1:], cp_size, cp_rank)


def is_packed(batch) -> bool:
    """Whether a micro-batch is packed rows (a dict with `position_ids`, see the module docstring)."""
    return isinstance(batch, dict) and "position_ids" in batch


def packed_parts(batches: list[dict], ctx, dft: bool = False) -> list[dict]:
    """This rank's micro-batches of packed rows (dicts of (b, T) `input_ids`, `labels`, `position_ids`) ->
    dicts of `inputs` and `targets` (b, T / C), `documents` (`Documents`) and `divisor` (with `dft`, also `dft`:
    the token losses weighted by Dynamic Fine-Tuning, `shardlm.models.dynamic_fine_tuning`).

    The divisor is N / (M x DP x C), N the trained tokens of the global batch (one all-reduce over DP;
    the CP ranks of a replica read the same rows), M the micro-batches per rank: the trainer divides each
    micro-batch's loss by M and averages over DP x CP, so `sum of token losses / divisor` makes the step's
    loss exactly the sum over all trained tokens divided by N. Raises a one-line UserError when N is 0
    (the mean over no token is NaN)."""
    count = torch.tensor(float(sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)),
                         dtype=torch.float64, device=ctx.device)
    ctx.dp.all_reduce(count)
    if count.item() == 0:
        raise UserError("a global batch has no token to train on (every label is -100): check the records' "
                        "assistant turns and the chat template's loss mask")
    divisor = count.item() / (len(batches) * ctx.dp_size * ctx.cp_size)
    parts = []
    for batch in batches:
        inputs, targets = batch["input_ids"], batch["labels"]
        if ctx.cp_size > 1:
            inputs, targets = (zigzag_split(x, ctx.cp_size, ctx.cp_rank) for x in (inputs, targets))
        documents = Documents.from_positions(batch["position_ids"], ctx.cp_size, ctx.cp_rank)
        parts.append({"inputs": inputs, "targets": targets, "documents": documents, "divisor": divisor}
                     | ({"dft": True} if dft else {}))
    return parts


def token_parts(batches: list, ctx) -> list[dict]:
    """Plain token micro-batches ((b, T + 1), or a CP rank's (inputs, targets) pair) as the dict packed rows
    use, with no documents and a mean loss (divisor None): the form multi-token prediction adds to."""
    parts = []
    for batch in batches:
        inputs, targets = batch if isinstance(batch, tuple) else (batch[:, :-1], batch[:, 1:])
        parts.append({"inputs": inputs, "targets": targets, "documents": None, "divisor": None})
    return parts


def add_multi_token_targets(raw: list, parts: list[dict], ctx, depths: int, weight: float) -> list[dict]:
    """Give each part (`packed_parts` / `token_parts` of the whole-row micro-batches `raw`) its multi-token-
    prediction inputs and targets, `mtp` = (inputs, targets) each (D, b, T / C), rolled on the whole rows
    before the context-parallel split and within documents (`shardlm.models.mtp.rolled_targets`), the
    per-depth divisors (the global count of valid targets / (M x DP x C), one all-reduce of D counts over
    DP) and the loss weight."""
    rolled, counts = [], torch.zeros(depths, dtype=torch.float64, device=ctx.device)
    for batch, part in zip(raw, parts):
        if is_packed(batch):  # the documents of the whole rows, as `packed_parts` read them
            ids, labels, segments = batch["input_ids"], batch["labels"], part["documents"].segments
        else:
            ids, labels, segments = batch[:, :-1], batch[:, 1:], None
        per_depth = [rolled_targets(ids, labels, k + 1, segments) for k in range(depths)]
        counts += torch.tensor([float((t != IGNORE_INDEX).sum()) for _, t in per_depth], dtype=torch.float64,
                               device=ctx.device)
        rolled.append(per_depth)
    ctx.dp.all_reduce(counts)
    divisors = (counts.clamp(min=1) / (len(raw) * ctx.dp_size * ctx.cp_size)).tolist()
    for part, per_depth in zip(parts, rolled):
        inputs, targets = (torch.stack([x if ctx.cp_size == 1 else zigzag_split(x, ctx.cp_size, ctx.cp_rank)
                                        for x in column]) for column in zip(*per_depth))
        part.update(mtp=(inputs, targets), mtp_divisors=divisors, mtp_weight=weight)
    return parts
