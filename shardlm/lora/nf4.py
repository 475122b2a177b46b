"""QLoRA's frozen base: weights stored as 4-bit NormalFloat (NF4) with double quantization, dequantized in the
forward (Dettmers et al. 2023, "QLoRA", section 3), in the layout bitsandbytes uses, so its values equal
`bitsandbytes.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)`'s on the CPU, except the
rare statistics code where that kernel's search misses the nearest value of the map (here always the nearest).

- NF4: the 16 values of the paper's Appendix E (quantiles of a standard normal, rescaled to [-1, 1], with an exact
  zero). A weight is flattened and cut into blocks of 64; each block is divided by its absolute maximum and each
  value rounded to the nearest NF4 value (between two, at their midpoint, the lower). Two 4-bit indices a byte,
  the first in the high nibble.
- Double quantization: the blocks' absolute maxima (fp32) less their mean are quantized again in blocks of 256,
  to 8 bits of the signed dynamic map (`dynamic_map`: a sign, a decimal exponent 10^-6..10^0 and the fraction in
  the remaining bits), with one fp32 maximum a block. What a weight costs: 4 + 8 / 64 + 32 / (64 x 256) = 4.127
  bits a value.

`NF4Weight` is a parametrization (`torch.nn.utils.parametrize`): a projection's `weight` becomes its packed
codes, absmax codes, second-level maxima and offset (frozen parameters), and reading `module.weight`
dequantizes, so every layer keeps computing `F.linear(x, module.weight)` unchanged. Under tensor parallelism each
rank quantizes its own shard (as a per-rank bitsandbytes would): a run's base is the same at every layout with
the same TP size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
"""The NF4 values (QLoRA, Appendix E), ascending."""
BLOCK, STATS_BLOCK = 64, 256


def dynamic_map() -> torch.Tensor:
    """The 256 values of the signed 8-bit dynamic map the absmax statistics are quantized to, ascending: for each
    decimal exponent e = -6..0, 2^(e + 6) (2^-1 .. 2^6 - 1 steps) evenly spaced fractions of [0.1, 1] taken at their
    midpoints, times 10^e, with both signs; then 0 and 1."""
    values = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        values += (10 ** (i - 6) * mids).tolist() + (-(10 ** (i - 6)) * mids).tolist()  # products in fp32
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nearest(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest `table` value (ascending) to each of `scaled`; at a midpoint, the lower."""
    return torch.bucketize(scaled, (table[:-1] + table[1:]) / 2)


def _blocks(values: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values (n,) -> (each value divided by its block's absolute maximum, clamped to [-1, 1]; the maxima)."""
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, -n % size))
    absmax = padded.view(-1, size).abs().amax(dim=1)
    scaled = (padded.view(-1, size) * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1).reshape(-1)[:n]
    return scaled, absmax


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (any shape, fp32/bf16) -> (packed NF4 codes (ceil(n / 2),) uint8, absmax codes (blocks,) uint8,
    their block maxima (ceil(blocks / 256),) fp32, their offset () fp32)."""
    scaled, absmax = _blocks(weight.detach().reshape(-1).float(), BLOCK)
    codes = _nearest(scaled, NF4.to(scaled.device)).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (0, codes.numel() % 2))
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = absmax.mean()
    stats, stats_max = _blocks(absmax - offset, STATS_BLOCK)
    return packed, _nearest(stats, dynamic_map().to(stats.device)).to(torch.uint8), stats_max, offset


def dequantize(packed: torch.Tensor, stats: torch.Tensor, stats_max: torch.Tensor, offset: torch.Tensor,
               shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize` (up to the rounding): the weight of `shape`, in `dtype`."""
    n = shape.numel()
    table = dynamic_map().to(packed.device)
    absmax = (table[stats.long()].view(-1)[:stats.numel()] * stats_max.repeat_interleave(STATS_BLOCK)[:stats.numel()]
              + offset)
    codes = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1)[:n].long()
    values = NF4.to(packed.device)[codes]
    values = torch.nn.functional.pad(values, (0, -n % BLOCK)).view(-1, BLOCK) * absmax.unsqueeze(1)
    return values.reshape(-1)[:n].view(shape).to(dtype)


def quantized_bytes(shape: torch.Size) -> int:
    """Bytes of one weight of `shape` in NF4 with double quantization."""
    n = shape.numel()
    blocks = -(-n // BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // STATS_BLOCK) + 4


class NF4Weight(nn.Module):
    """The parametrization of a frozen weight stored in NF4 (module docstring): `right_inverse` quantizes,
    `forward` dequantizes to the weight's shape and dtype. `marks`: the weight's layout attributes
    (`tensor_parallel_dim`, ...), which checkpoints and counts read."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, marks: dict):
        super().__init__()
        self.shape, self.dtype, self.marks = shape, dtype, marks

    def forward(self, packed, stats, stats_max, offset) -> torch.Tensor:
        return dequantize(packed, stats, stats_max, offset, self.shape, self.dtype)

    def right_inverse(self, weight: torch.Tensor):
        return quantize(weight)


MARKS = ("tensor_parallel_dim", "sequence_parallel", "pipeline_tied_copy")


def quantize_weight(module: nn.Module) -> int:
    """Store `module.weight` (frozen) in NF4 in place; returns the bytes it takes now."""
    weight = module.weight
    marks = {name: getattr(weight, name) for name in MARKS if hasattr(weight, name)}
    parametrize.register_parametrization(module, "weight", NF4Weight(weight.shape, weight.dtype, marks), unsafe=True)
    for original in module.parametrizations.weight.parameters():
        original.requires_grad_(False)
    return quantized_bytes(weight.shape)


def quantized(model: nn.Module) -> dict[str, NF4Weight]:
    """{"X.weight": its NF4 parametrization} of every weight of `model` stored in NF4."""
    return {f"{name}.weight": module.parametrizations.weight[0] for name, module in model.named_modules()
            if parametrize.is_parametrized(module, "weight") and isinstance(module.parametrizations.weight[0],
                                                                             NF4Weight)}


def stored_name(name: str) -> str | None:
    """A parameter name as the model's weights are named: an NF4 weight's first stored tensor
    ("X.parametrizations.weight.original0") is "X.weight", its other tensors none; others unchanged."""
    if ".parametrizations.weight.original" not in name:
        return name
    return name.split(".parametrizations.")[0] + ".weight" if name.endswith("original0") else None


def describe_base(model: nn.Module) -> str:
    """One line for a QLoRA run's log: what this rank's NF4 weights take against their full precision."""
    weights = quantized(model).values()
    values = max(1, sum(w.shape.numel() for w in weights))
    stored = sum(quantized_bytes(w.shape) for w in weights)
    full = sum(w.shape.numel() * torch.empty((), dtype=w.dtype).element_size() for w in weights)
    return (f"qlora: {len(weights)} projections of this rank in NF4 with double quantization: {stored / 2**20:,.2f} "
            f"MiB instead of {full / 2**20:,.2f} MiB ({8 * stored / values:.3f} bits a weight)")
