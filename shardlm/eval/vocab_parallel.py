"""Greedy prediction over vocabulary-parallel logits, without gathering them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.parallel import Communicator


def vocab_parallel_argmax(logits: torch.Tensor, tp: Communicator, vocab_size: int) -> torch.Tensor:
    """Global argmax of vocabulary-parallel logits: (..., V_padded / tp) -> (...) int64 token ids.

    Padding entries (ids >= vocab_size) are never chosen. Ties resolve to the smallest id, as
    `torch.argmax` on the gathered real logits does. Talks to the TP group: one all-reduce MAX of the
    row maxima and one of the (negated) candidate ids, O(rows) values each.
    """
    local_vocab = logits.shape[-1]
    start = tp.rank * local_vocab
    logits = logits.float()
    if start + local_vocab > vocab_size:
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, float("-inf"))
    local_max, local_index = logits.max(dim=-1)  # max() returns the first maximal index
    if tp.size == 1:
        return local_index
    global_max = tp.all_reduce(local_max.clone(), op=dist.ReduceOp.MAX)
    # Ranks holding the maximum offer their id; MAX over negated ids picks the smallest one.
    candidate = torch.where(local_max == global_max, -(local_index + start), torch.full_like(local_index, -2**62))
    return -tp.all_reduce(candidate, op=dist.ReduceOp.MAX)
