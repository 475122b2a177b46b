"""The zigzag split of context parallelism: which tokens of each sequence a CP rank holds, and their positions.

A sequence of T tokens is cut into 2C chunks of L = T / 2C tokens, and CP rank r holds chunks r and
2C-1-r (the zigzag split of Megatron-Core's `_get_batch_on_this_cp_rank`): under a causal mask a late
chunk attends to more keys than an early one, and pairing chunk r with its mirror gives every rank the
same work. The data path splits each micro-batch's inputs and targets this way
(`shardlm.training.data.context_parallel_part`); a rank's tokens keep their original positions
(`zigzag_positions`, `local_positions`) for position embeddings and RoPE; the ring attention
(`shardlm.parallel.ring_attention`) reads `zigzag_chunks` to know which blocks the causal mask leaves.
"""

from __future__ import annotations

import torch

from shardlm.errors import UserError


def check_context_parallel(seq_length: int, context_parallel: int, tensor_parallel: int = 1,
                           sequence_parallel: bool = False, attention_dropout: float = 0.0) -> None:
    """Raise a one-line UserError if `seq_length` cannot be split over `context_parallel` ranks (it must be
    a multiple of 2C, times TP under sequence parallelism) or attention dropout is on under CP."""
    if context_parallel < 1:
        raise UserError(f"parallel.context={context_parallel} must be >= 1")
    sp = sequence_parallel and tensor_parallel > 1
    multiple = 2 * context_parallel * (tensor_parallel if sp else 1)
    if context_parallel > 1 and seq_length % multiple:
        what = "2 x parallel.context" + (" x parallel.tensor (sequence parallelism)" if sp else "")
        raise UserError(f"model.seq_length={seq_length} is not a multiple of {what} = {multiple}; "
                        f"use a multiple of {multiple}")
    if context_parallel > 1 and attention_dropout > 0:
        raise UserError(f"model.attention_dropout={attention_dropout} is not supported with parallel.context="
                        f"{context_parallel}; set model.attention_dropout = 0")


def zigzag_chunks(context_parallel: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2C) CP rank r holds: r and 2C-1-r."""
    return cp_rank, 2 * context_parallel - 1 - cp_rank


def _chunk_length(seq_length: int, context_parallel: int) -> int:
    """L = T / 2C; T not a multiple of 2C is a bug here (`check_context_parallel` rejects it up front)."""
    if seq_length % (2 * context_parallel):
        raise ValueError(f"sequence length {seq_length} is not a multiple of 2 x {context_parallel} CP ranks")
    return seq_length // (2 * context_parallel)


def zigzag_positions(seq_length: int, context_parallel: int, cp_rank: int, device=None) -> torch.Tensor:
    """(T/C,) int64: the original positions of the tokens CP rank r holds, in the order it holds them."""
    chunk = _chunk_length(seq_length, context_parallel)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in zigzag_chunks(context_parallel, cp_rank)])


def zigzag_split(x: torch.Tensor, context_parallel: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """x: (..., T, ...) with the sequence along `dim` -> (..., T/C, ...): chunks r and 2C-1-r of 2C."""
    chunks = x.split(_chunk_length(x.shape[dim], context_parallel), dim=dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(context_parallel, cp_rank)], dim=dim)


def zigzag_merge(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of `zigzag_split`: every CP rank's part, in rank order -> the full sequence along `dim`."""
    C = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * C)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * C - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)


def local_positions(length: int, cp, past: int = 0, device=None) -> torch.Tensor:
    """(length,) int64: the original positions of the `length` tokens this rank holds of each sequence:
    past .. past + length - 1 without context parallelism (`cp.size` 1), else the zigzag positions of CP
    rank `cp.rank` in a sequence of length x C tokens (no past: a KV cache does not run under CP). `cp` is
    the CP group's `Communicator`; only its size and rank are read."""
    if cp.size == 1:
        return torch.arange(past, past + length, device=device)
    if past:
        raise ValueError("context parallelism has no key/value cache; generate with parallel.context=1")
    return zigzag_positions(length * cp.size, cp.size, cp.rank, device=device)
