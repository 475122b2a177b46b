"""Rotary position embeddings (RoPE) in the "rotate half" layout of Hugging Face's Llama.

Each head's `head_dim` channels are taken as two halves `[x1 | x2]`; channel i of the first half and
channel i of the second half form a pair rotated by the angle `position x theta^(-2i / head_dim)`.
This is the layout `LlamaForCausalLM` checkpoints are stored in (Meta's original checkpoints pair
adjacent channels instead, and Hugging Face permutes their q and k rows once at conversion), so
shardlm reads and writes Hugging Face's q/k weights without any permutation.

Angles are computed from the positions by whoever applies them (every attention layer), so a layer
needs nothing from the embedding or any other layer: a pipeline stage that holds only some layers
rotates exactly as the whole model does, and a KV-cached step passes its offset positions.
"""

from __future__ import annotations

import torch


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (T,) int64 -> (cos, sin), each (T, head_dim) fp32, the halves repeated ([f | f]); per-row
    positions (B, T) (packed documents) -> each (B, 1, T, head_dim), to broadcast over the heads."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    return angles_of(positions, inv_freq)


def angles_of(positions: torch.Tensor, inv_freq: torch.Tensor,
              factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) x `factor` of positions (T,) -> (T, 2 len(inv_freq)), or (B, T) -> (B, 1, T, 2 len(inv_freq))."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (..., T, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)
    if positions.dim() == 2:
        angles = angles.unsqueeze(1)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] -> [-x2 | x1] along the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim) queries or keys; cos, sin: (T, head_dim) or (B, 1, T, head_dim) -> x rotated,
    in x's dtype."""
    return (x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)).to(x.dtype)
