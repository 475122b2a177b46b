"""LAMBADA: accuracy of predicting the last word of a passage, greedily and with teacher forcing.

Each line of the OpenAI-form `lambada_test.jsonl` is `{"text": ...}`. Strict mode (the paper's
metric) takes the last word `w = text.split()[-1]`, tokenizes the text before it (stripped) and
`" " + w` separately, and counts an example correct only when the argmax prediction of every BPE
token of `w` is right, each predicted from the true preceding tokens. Non-strict mode tokenizes the
whole text and scores only its last BPE token. A context longer than the model's sequence length
keeps its last tokens (the reference implementation never needs to: its context is 1024).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shardlm.errors import UserError
from shardlm.eval.continuation import pack_continuations
from shardlm.eval.head import logits_at
from shardlm.eval.vocab_parallel import vocab_parallel_argmax


@dataclass
class LambadaResult:
    """What `shardlm eval lambada` reports (all ranks get the same values)."""

    accuracy: float
    """correct / examples."""
    correct: int
    examples: int
    strict: bool
    """True: every token of the last word must be right; False: only the last BPE token."""
    truncated: int
    """Examples whose context was cut to fit the model's sequence length."""

    def to_dict(self) -> dict:
        return asdict(self)


def read_lambada(path: str | Path, limit: int | None = None) -> list[str]:
    """The `text` of every line of a LAMBADA jsonl file (the first `limit` lines when given)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"LAMBADA data not found: {path}; pass lambada_test.jsonl with --data")
    texts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(texts) >= limit:
                break
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f'{path} line {number} is not {{"text": ...}} JSON; pass lambada_test.jsonl') from None
    if not texts:
        raise UserError(f"{path} holds no examples; pass lambada_test.jsonl")
    return texts


def lambada_example(tokenizer, text: str, strict: bool) -> tuple[list[int], list[int]]:
    """(context ids, target ids) of one passage; the targets are what must be predicted."""
    if not strict:
        ids = tokenizer.encode(text)
        return ids[:-1], ids[-1:]
    last_word = text.split()[-1]
    context = text[:text.rfind(last_word)].strip()
    return tokenizer.encode(context), tokenizer.encode(" " + last_word)


@torch.no_grad()
def evaluate_lambada(model, tokenizer, texts: list[str], *, strict: bool = True, batch_size: int = 8,
                     progress: bool = False) -> LambadaResult:
    """Last-word accuracy of `model` on `texts` (see the module docstring).

    model: a `GPT` sharded for its `ctx`; examples are dealt round-robin over DP ranks, predictions
    use a vocabulary-parallel argmax over the TP group, and the counts are all-reduced over DP.
    """
    ctx = model.ctx
    limit = model.cfg.seq_length + 1
    examples = [lambada_example(tokenizer, text, strict) for text in texts]
    if any(not target for _, target in examples) or any(len(target) >= limit for _, target in examples):
        raise UserError("a LAMBADA target word is empty or longer than the model's sequence length")
    mine = examples[ctx.dp_rank::ctx.dp_size]
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # correct, examples, truncated
    bar = None
    if progress and ctx.is_main:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), desc="lambada", unit="example", dynamic_ncols=True)
    for first in range(0, len(mine), batch_size):
        batch = mine[first:first + batch_size]
        counts[2] += sum(len(c) + len(t) > limit for c, t in batch)
        inputs, labels, scored = pack_continuations(batch, limit, ctx.device)
        logits = logits_at(model, inputs, scored)  # (M, V_padded / tp): target positions only
        wrong = vocab_parallel_argmax(logits, ctx.tp, model.cfg.vocab_size) != labels[scored]  # (M,)
        rows = scored.nonzero()[:, 0]  # the example each scored position belongs to
        wrong_per_row = torch.zeros(len(batch), device=ctx.device).index_add_(0, rows, wrong.float())
        counts[0] += (wrong_per_row == 0).sum()
        counts[1] += len(batch)
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    model.train(was_training)
    ctx.dp.all_reduce(counts)
    correct, total, truncated = (int(v) for v in counts.tolist())
    return LambadaResult(correct / max(1, total), correct, total, strict, truncated)
