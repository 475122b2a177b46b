"""Rotary position embeddings (RoPE) in the "rotate half" layout of Hugging Face's Llama.

Each head's `head_dim` channels are taken as two halves `[x1 | x2]`; channel i of the first half and
channel i of the second half form a pair rotated by the angle `position x theta^(-2i / head_dim)`.
This is the layout `LlamaForCausalLM` checkpoints are stored in (Meta's original checkpoints pair
adjacent channels instead, and Hugging Face permutes their q and k rows once at conversion), so
shardlm reads and writes Hugging Face's q/k weights without any permutation.

Angles are computed from the positions by whoever applies them (every attention layer), so a layer
needs nothing from the embedding or any other layer: a pipeline stage that holds only some layers
rotates exactly as the whole model does, and a KV-cached step passes its offset positions.

YaRN context extension (`rope_inverse_frequencies`, the `rope_yarn_*` keys) blends interpolated and
extrapolated frequencies as transformers computes them and scales cos and sin by its attention factor; MLA
(DeepSeek-V3) and grouped-query attention (gpt-oss) both use it; OLMo 3's long-context checkpoints scale only the
full-attention layers' (`rope_yarn_layers = "full"`). Llama 3.1's scaling (`rope_llama3_*`) divides the low frequencies
by its factor and blends the middle ones.
"""

from __future__ import annotations

import math

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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def llama3_frequencies(cfg, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies (`rope_llama3_*`), as transformers computes them: with wavelength
    w = 2 pi / f and original length L, f / factor where w > L / low_freq_factor, f where w < L / high_freq_factor, and
    between them the blend (1 - s) f / factor + s f, s = (L / w - low) / (high - low)."""
    factor, low, high = cfg.rope_llama3_factor, cfg.rope_llama3_low_freq_factor, cfg.rope_llama3_high_freq_factor
    length = cfg.rope_llama3_original_positions
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > length / low, inv_freq / factor, inv_freq)
    smooth = (length / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= length / high) & (wavelength <= length / low)
    return torch.where(medium, blended, scaled)


def rope_inverse_frequencies(cfg, dim: int, device=None, sliding: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim / 2,) fp32, cos/sin factor) of `dim` rotary channels of the model config `cfg`:
    the default theta^(-2i / dim), or transformers' YaRN blend of interpolated and extrapolated frequencies
    (`rope_yarn_*`; the correction range rounded to whole channels unless `rope_yarn_truncate` is off; the factor
    `rope_yarn_attention_factor` when given), or Llama 3.1's (`rope_llama3_*`, `llama3_frequencies`). A
    `sliding`-window layer keeps the default when YaRN scales the full layers only (`rope_yarn_layers = "full"`,
    OLMo 3)."""
    base = cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if cfg.rope_llama3_factor:
        return llama3_frequencies(cfg, 1.0 / pos_freqs), 1.0
    factor = cfg.rope_yarn_factor
    if not factor or (sliding and cfg.rope_yarn_layers == "full"):
        return 1.0 / pos_freqs, 1.0
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.rope_yarn_original_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_yarn_beta_fast), correction_dim(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low if high != low else 0.001))
    extrapolation = 1 - ramp.clamp(0, 1)
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    if cfg.rope_yarn_attention_factor:
        scale = cfg.rope_yarn_attention_factor
    elif cfg.rope_yarn_mscale and cfg.rope_yarn_mscale_all_dim:
        scale = yarn_mscale(factor, cfg.rope_yarn_mscale) / yarn_mscale(factor, cfg.rope_yarn_mscale_all_dim)
    else:
        scale = yarn_mscale(factor)
    return inv_freq, float(scale)
