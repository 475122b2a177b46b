"""QLoRA's frozen base: weights stored as 4-bit NormalFloat (NF4) with double quantization, dequantized in the
forward (Dettmers et al. 2023, "QLoRA", section 3), in the layout bitsandbytes uses: `quantize` of a whole matrix
gives `bitsandbytes.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)`'s tensors, except
for the rare statistics code where bitsandbytes' C kernel on the CPU does not pick the nearest value of the map
(about one block in 240; here always the nearest, as QLoRA defines it and bitsandbytes' PyTorch kernel does).

- NF4: the 16 values of the paper's Appendix E (quantiles of a standard normal, rescaled to [-1, 1], with an exact
  zero). A weight is flattened and cut into blocks of 64; each block is divided by its absolute maximum and each
  value rounded to the nearest NF4 value (between two, at their midpoint, the lower). Two 4-bit indices a byte,
  the first in the high nibble.
- Double quantization: the blocks' absolute maxima (fp32) less their mean are quantized again in blocks of 256,
  to 8 bits of the signed dynamic map (`dynamic_map`: a sign, a decimal exponent 10^-6..10^0 and the fraction in
  the remaining bits), with one fp32 maximum a block. What a weight costs: 4 + 8 / 64 + 32 / (64 x 256) = 4.127
  bits a value.

One model at every layout: a weight is always quantized whole (the unsplit (out, in) matrix; each MoE expert's
matrix on its own), and a rank keeps the blocks its shard touches (`Shard`): under tensor parallelism the blocks
of its rows or columns, a block that straddles two ranks' shards kept whole by both. So every TP size dequantizes
the same values, and a merged export is the model that was trained. The blocks are stored as rows
((blocks, 32) packed codes, (blocks,) statistics codes), so FSDP's dim-0 sharding never cuts a block.

`NF4Weight` is a parametrization (`torch.nn.utils.parametrize`): a projection's `weight` (or an expert stack's
`gate`, `up`, `down`) becomes its packed codes, statistics codes, second-level maxima and offset (frozen
parameters, `frozen_base`), and reading the attribute dequantizes, so every layer keeps computing
`F.linear(x, module.weight)` unchanged.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

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


DYNAMIC = dynamic_map()


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
    """A whole weight (any shape, fp32/bf16) -> bitsandbytes' tensors: (packed NF4 codes (ceil(n / 2),) uint8,
    absmax codes (blocks,) uint8, their block maxima (ceil(blocks / 256),) fp32, their offset () fp32)."""
    scaled, absmax = _blocks(weight.detach().reshape(-1).float(), BLOCK)
    codes = _nearest(scaled, NF4.to(scaled.device)).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (0, codes.numel() % 2))
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = absmax.mean()
    stats, stats_max = _blocks(absmax - offset, STATS_BLOCK)
    return packed, _nearest(stats, DYNAMIC.to(stats.device)).to(torch.uint8), stats_max, offset


def block_values(packed: torch.Tensor, stats: torch.Tensor, stats_max: torch.Tensor, offset: torch.Tensor,
                 blocks: torch.Tensor) -> torch.Tensor:
    """Dequantized blocks of m matrices: packed (m, k, 32) uint8, stats (m, k) uint8 (the codes of the blocks whose
    global indices are `blocks` (k,)), stats_max (m, S) and offset (m,) of each whole matrix -> (m, k * 64) fp32."""
    absmax = (DYNAMIC.to(packed.device)[stats.long()] * stats_max[:, blocks.to(packed.device) // STATS_BLOCK]
              + offset.unsqueeze(1))
    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).view(*packed.shape[:2], BLOCK).int()
    return (NF4.to(packed.device)[codes] * absmax.unsqueeze(2)).view(packed.shape[0], -1)


def dequantize(packed: torch.Tensor, stats: torch.Tensor, stats_max: torch.Tensor, offset: torch.Tensor,
               shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize` (up to the rounding): the whole weight of `shape`, in `dtype`."""
    n, blocks = shape.numel(), stats.numel()
    rows = torch.nn.functional.pad(packed.reshape(-1), (0, blocks * BLOCK // 2 - packed.numel())).view(1, blocks, -1)
    values = block_values(rows, stats.view(1, -1), stats_max.view(1, -1), offset.view(1), torch.arange(blocks))
    return values.view(-1)[:n].view(shape).to(dtype)


def quantized_bytes(shape: torch.Size) -> int:
    """Bytes of one whole weight of `shape` in NF4 with double quantization (bitsandbytes' tensors)."""
    n = shape.numel()
    blocks = -(-n // BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // STATS_BLOCK) + 4


@dataclass(frozen=True)
class Shard:
    """Where this rank's slice [r0:r1, c0:c1] sits in the whole (rows, cols) matrix, and which of the whole
    matrix's blocks of 64 (row-major) it keeps: every block one of its values lies in."""

    rows: int
    cols: int
    r0: int
    r1: int
    c0: int
    c1: int

    @classmethod
    def of(cls, whole: tuple[int, int], dim: int | None, rank: int, parts: int) -> Shard:
        """Shard `rank` of `parts` equal ones along `dim` (0: rows, 1: columns; None: the whole matrix)."""
        rows, cols = whole
        if dim is None or parts == 1:
            return cls(rows, cols, 0, rows, 0, cols)
        size = whole[dim] // parts
        lo, hi = rank * size, (rank + 1) * size
        return cls(rows, cols, lo, hi, 0, cols) if dim == 0 else cls(rows, cols, 0, rows, lo, hi)

    @property
    def shape(self) -> tuple[int, int]:
        return self.r1 - self.r0, self.c1 - self.c0

    def _contiguous(self) -> bool:
        return self.c0 == 0 and self.c1 == self.cols

    def _aligned(self) -> bool:
        return self.cols % BLOCK == 0 and self.c0 % BLOCK == 0 and self.c1 % BLOCK == 0

    def _flat(self) -> torch.Tensor:
        """Row-major positions in the whole matrix of this slice's values, (r1 - r0, c1 - c0)."""
        return torch.arange(self.r0, self.r1).unsqueeze(1) * self.cols + torch.arange(self.c0, self.c1)

    def blocks(self) -> torch.Tensor:
        """Global indices of the blocks kept, ascending, (k,) int64."""
        if self._contiguous():
            return torch.arange(self.r0 * self.cols // BLOCK, -(-self.r1 * self.cols // BLOCK))
        if self._aligned():
            per_row, first = self.cols // BLOCK, self.c0 // BLOCK
            return (torch.arange(self.r0, self.r1).unsqueeze(1) * per_row + first
                    + torch.arange((self.c1 - self.c0) // BLOCK)).view(-1)
        return torch.unique(self._flat() // BLOCK)

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """values (m, k * 64) of the kept blocks -> this slice of each of the m matrices, (m, r1 - r0, c1 - c0)."""
        m, (rows, cols) = values.shape[0], self.shape
        if self._contiguous():
            start = self.r0 * self.cols % BLOCK  # the first kept block starts this many values before r0
            return values[:, start:start + rows * cols].view(m, rows, cols)
        if self._aligned():
            return values.view(m, rows, cols)
        flat = self._flat()
        kept = self.blocks()
        index = torch.searchsorted(kept, flat // BLOCK) * BLOCK + flat % BLOCK
        return values[:, index.view(-1).to(values.device)].view(m, rows, cols)


def compute_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype a weight of `dtype` is dequantized into: under autocast, an fp32 one straight into the autocast dtype
    (the values autocast's cast would give, bitwise: the dequantized values are fp32 first either way), so that the
    GEMM takes it as it is and `dequantize_again` saves the reference instead of autocast's half copy."""
    if dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


class NF4Weight(nn.Module):
    """The parametrization of a frozen weight stored in NF4 (module docstring): `right_inverse` takes the whole
    weight ((out, in), or an expert stack's (E_l, out, in), each expert's matrix whole) and keeps `shard`'s blocks
    of it; `forward` dequantizes this rank's slice, `shape`, in `dtype`. `marks`: the local weight's layout
    attributes (`tensor_parallel_dim`, `expert_parallel`, ...), which checkpoints and counts read. Under autocast an
    fp32 weight is dequantized in the autocast dtype (`compute_dtype`)."""

    def __init__(self, shard: Shard, shape: torch.Size, dtype: torch.dtype, marks: dict):
        super().__init__()
        self.shard, self.shape, self.dtype, self.marks = shard, torch.Size(shape), dtype, marks
        self.stacked = len(shape) == 3
        self.owner: tuple | None = None  # (module, attribute) it dequantizes, set by `quantize_weight`

    @property
    def whole_shape(self) -> torch.Size:
        return torch.Size((*self.shape[:-2], self.shard.rows, self.shard.cols))

    def forward(self, packed, stats, stats_max, offset) -> torch.Tensor:
        if not self.stacked:
            packed, stats, stats_max, offset = packed[None], stats[None], stats_max[None], offset
        values = block_values(packed, stats, stats_max, offset, self.shard.blocks())
        out = self.shard.take(values).to(compute_dtype(self.dtype, packed.device.type))
        out = out if self.stacked else out[0]
        if self.owner is not None:  # `dequantize_again` recomputes it (and its views) for the backward
            root = out if out._base is None else out._base
            root.nf4_source = self.owner
        return out

    @torch.no_grad()
    def right_inverse(self, whole: torch.Tensor):
        if list(whole.shape) != list(self.whole_shape):
            raise ValueError(f"an NF4 weight quantizes its whole {list(self.whole_shape)} matrix, not "
                             f"{list(whole.shape)}")
        matrices = whole.reshape(-1, self.shard.rows, self.shard.cols)
        kept = self.shard.blocks()
        parts = [quantize(matrix) for matrix in matrices]
        blocks = -(-self.shard.rows * self.shard.cols // BLOCK)
        packed = torch.stack([torch.nn.functional.pad(p, (0, blocks * BLOCK // 2 - p.numel())).view(blocks, -1)
                              for p, _, _, _ in parts])[:, kept.to(whole.device)]
        stats = torch.stack([s for _, s, _, _ in parts])[:, kept.to(whole.device)]
        stats_max = torch.stack([m for _, _, m, _ in parts])
        offset = torch.stack([o for _, _, _, o in parts])
        if not self.stacked:
            return packed[0].contiguous(), stats[0].contiguous(), stats_max[0].contiguous(), offset
        return packed.contiguous(), stats.contiguous(), stats_max.contiguous(), offset


def _pack(tensor: torch.Tensor):
    """Saved-tensor pack hook: a dequantized NF4 weight (or a view of one) is saved as how to dequantize it again,
    anything else as itself."""
    root = tensor if tensor._base is None else tensor._base
    owner = getattr(root, "nf4_source", None)
    if owner is None:
        return tensor
    return owner, tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.dtype


def _unpack(saved):
    if isinstance(saved, torch.Tensor):
        return saved
    (module, name), size, stride, offset, dtype = saved
    with torch.no_grad():
        value = getattr(module(), name)  # (the backward runs outside autocast: fp32, cast as the forward did)
    root = value if value._base is None else value._base
    return root.to(dtype).as_strided(size, stride, offset)


def dequantize_again(layer: nn.Module) -> None:
    """Keep `layer`'s dequantized NF4 weights out of its saved activations: while it computes, autograd saves each
    of them (and their views, e.g. the transpose a linear saves) as a reference, and the backward dequantizes it
    again, as bitsandbytes' 4-bit matmul does. So a QLoRA step holds one projection's full-precision weight at a
    time, not every layer's until the backward. Installed once per layer (forward hooks around its forward)."""
    if getattr(layer, "nf4_hooks", False):
        return
    layer.nf4_hooks = True
    contexts = []

    def enter(module, args):
        contexts.append(torch.autograd.graph.saved_tensors_hooks(_pack, _unpack))
        contexts[-1].__enter__()

    def leave(module, args, output):
        contexts.pop().__exit__(None, None, None)

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave, always_call=True)


MARKS = ("tensor_parallel_dim", "sequence_parallel", "pipeline_tied_copy", "expert_parallel", "first_expert")


def whole_weight(local: torch.Tensor, ctx) -> torch.Tensor:
    """A TP-split weight's whole matrix (its shards gathered over TP, along `tensor_parallel_dim`); a whole one
    as it is. Collective over TP for split weights."""
    dim = getattr(local, "tensor_parallel_dim", None)
    if dim is None or ctx.tp_size == 1:
        return local.detach()
    return torch.cat(ctx.tp.all_gather(local.detach().contiguous()), dim=dim)


def quantize_weight(module: nn.Module, name: str, ctx) -> int:
    """Store `module.<name>` (frozen; `weight`, or an expert stack's `gate`, `up`, `down`, `fc`, `proj`) in NF4 in
    place, quantized whole (its TP shards gathered: collective over TP); returns the bytes this rank keeps."""
    local = getattr(module, name)
    marks = {mark: getattr(local, mark) for mark in MARKS if hasattr(local, mark)}
    dim = marks.get("tensor_parallel_dim")
    whole = whole_weight(local, ctx)
    in_matrix = None if dim is None else dim - (local.dim() - 2)  # 0: rows, 1: columns of each matrix
    shard = Shard.of(tuple(whole.shape[-2:]), in_matrix, ctx.tp_rank, ctx.tp_size)
    setattr(module, name, nn.Parameter(whole, requires_grad=False))
    weight = NF4Weight(shard, local.shape, local.dtype, marks)
    parametrize.register_parametrization(module, name, weight, unsafe=True)
    weight.owner = (weakref.ref(module), name)
    for original in getattr(module.parametrizations, name).parameters():
        original.requires_grad_(False)
        original.frozen_base = True  # FSDP shards it (`shardlm.training.fsdp`)
        for mark in ("expert_parallel", "first_expert"):
            if mark in marks:
                setattr(original, mark, marks[mark])
    return stored_bytes(module, name)


def logical(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """`module.<name>` as shape, dtype and layout marks only (a meta tensor with the weight's `MARKS`), without
    dequantizing an NF4 weight."""
    if parametrize.is_parametrized(module, name):
        weight = getattr(module.parametrizations, name)[0]
        out, marks = torch.empty(weight.shape, dtype=weight.dtype, device="meta"), weight.marks
    else:
        param = getattr(module, name)
        out, marks = param.to("meta"), {mark: getattr(param, mark) for mark in MARKS if hasattr(param, mark)}
    for mark, value in marks.items():
        setattr(out, mark, value)
    return out


def stored_bytes(module: nn.Module, name: str) -> int:
    """Bytes the NF4 tensors of `module.<name>` take on this rank (its FSDP shards' under FSDP)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in getattr(module.parametrizations, name).parameters())


@torch.no_grad()
def assign_whole(module: nn.Module, name: str, whole: torch.Tensor) -> None:
    """Quantize the whole weight `whole` into `module.<name>`'s NF4 tensors (this rank's blocks; an FSDP shard's
    rows of them)."""
    parametrization = getattr(module.parametrizations, name)
    stored = parametrization[0].right_inverse(whole.to(parametrization[0].dtype))
    for original, value in zip(parametrization.parameters(), stored, strict=True):
        if hasattr(original, "to_local"):  # sharded by FSDP
            from shardlm.training.fsdp import copy_to_shard

            copy_to_shard(original, value.to(original.device))
        else:
            original.copy_(value)


def quantized(model: nn.Module) -> dict[str, NF4Weight]:
    """{"X.weight" (or "X.gate", ...): its NF4 parametrization} of every weight of `model` stored in NF4."""
    out = {}
    for prefix, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for name, parametrizations in module.parametrizations.items():
            if isinstance(parametrizations[0], NF4Weight):
                out[f"{prefix}.{name}"] = parametrizations[0]
    return out


def stored_name(name: str) -> str | None:
    """A parameter name as the model's weights are named: an NF4 weight's first stored tensor
    ("X.parametrizations.weight.original0") is "X.weight", its other tensors none; others unchanged."""
    if ".parametrizations." not in name:
        return name
    prefix, rest = name.split(".parametrizations.")
    attribute, original = rest.split(".", 1)
    return f"{prefix}.{attribute}" if original == "original0" else None


def describe_base(model: nn.Module) -> str:
    """One line for a QLoRA run's log: what this rank's NF4 weights take against their full precision."""
    weights = quantized(model)
    values = max(1, sum(w.shape.numel() for w in weights.values()))
    stored = sum(stored_bytes(model.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]) for n in weights)
    full = sum(w.shape.numel() * torch.empty((), dtype=w.dtype).element_size() for w in weights.values())
    return (f"qlora: {len(weights)} weights of this rank in NF4 with double quantization: {stored / 2**20:,.2f} "
            f"MiB instead of {full / 2**20:,.2f} MiB ({8 * stored / values:.3f} bits a weight)")


@torch.no_grad()
def dequantize_all(model: nn.Module) -> None:
    """Replace every NF4 weight of `model` by its dequantized value, a frozen full-precision parameter again (for
    merging adapters into the base)."""
    for name in quantized(model):
        prefix, attribute = name.rsplit(".", 1)
        module = model.get_submodule(prefix)
        marks = getattr(module.parametrizations, attribute)[0].marks
        parametrize.remove_parametrizations(module, attribute, leave_parametrized=True)
        value = getattr(module, attribute)
        delattr(module, attribute)
        param = nn.Parameter(value.detach(), requires_grad=False)
        for mark, mark_value in marks.items():
            setattr(param, mark, mark_value)
        setattr(module, attribute, param)
