"""DeepSeek-V4's attention as transformers' DeepseekV4Attention computes it: one shared key = value head (MQA) over a
sliding window, beside compressed entries of the whole past, with a learned sink per head and a grouped output.

    q_res = RMSNorm(q_a x);  q = RMSNorm_unweighted(q_b q_res) per head;  kv = RMSNorm(kv x)      (B, T, D)
    q and kv rotated on their last qk_rope_head_dim channels (interleaved pairs), at theta rope_theta on
    sliding-only layers and global_rope_theta (compress_rope_theta, with YaRN if set) on compressing ones
    keys/values: kv of the last sliding_window positions (itself included), then the layer's compressed entries
    softmax over [q k / sqrt(D), sink]; the sink's share dropped (by chunks of queries, `compressed_core`: no
        (T, S) matrix); the output's rotary channels rotated back (-sin)
    grouped output: heads in output_groups groups, each (H / g) D -> output_rank (o_a), then g r -> h (o_b)

Compressors (`Compressor`): every `ratio` tokens give one entry, sum_j softmax_j(gate_j + position_bias_j) kv_j over
the window, RMS-normalized and rotated at the window's first position. A CSA layer (the smallest ratio of
`model.compress_ratios`) overlaps windows: entry w pools window w's second half-channels with window w-1's first
ones (2 ratio slots, the first window's missing half weighted 0), and a lightning indexer (`Indexer`, the same
compressor at index_head_dim plus index_heads query heads from q_res) keeps each query's index_topk best entries
among those complete before it. An HCA layer pools plain windows, and each query sees every complete entry.
Entry w is complete for the query at position t when w < (t + 1) / ratio.

Tensor parallelism: query heads, sinks and output groups are split over TP (output_groups divisible by it); the
shared kv, the compressors and the indexer are replicated, computed from the gathered input on every rank, so
each rank's choice of entries is the same; their weights enter through `f` (copy_to_tensor_parallel), which sums
each rank's partial gradient. The indexer's choice carries no gradient (as in transformers).

The indexer's loss (as DeepSeek Sparse Attention's, `shardlm.models.sparse_attention`), when model.index_loss_coeff
> 0 and it trains (not frozen by a LoRA run): per query, KL(target || softmax of the indexer's scores over the
query's chosen complete entries), the target the main attention's probabilities on those entries (of its softmax
over [window keys, entries, sink]) summed over all heads (all-reduced over TP) and scaled to sum to 1, detached; a
query without a chosen entry adds 0. Summed over the micro-batch's queries over its tokens, times the coefficient,
attached to the attention's output (`attach_indexer_loss`, the factor `shardlm.training.indexer` sets). The indexer
reads its inputs detached, so it learns from this loss only and the rest from the language-model loss only. Its
weights are used as they are, without `f`: each TP rank computes the same loss from the same gathered input, so
every rank's gradient is already the whole one (summing would count it tp times). With model.index_loss_coeff 0 its
parameters are frozen.

Decoding keeps the layer's inputs and recomputes the compressors over them (exact, O(T) per token). Packed rows:
each document is attended alone, its windows and entries starting at its first token. Context parallelism: each
rank projects its own tokens (B, T / C, h) into what the keys and entries are computed from (`key_inputs`: kv's
projection and the compressors' kv and gate); on plain rows whose chunks hold whole windows, and on packed rows
whose chunks hold their halos, it pools the windows that end in its chunks and all-gathers their entries and each
chunk's halo, otherwise every position's projections (`shardlm.models.compressed_context`; gradients
reduce-scattered back), and attends its own zigzag queries; its
indexer loss covers its own queries over the whole micro-batch's tokens (hence the C in its factor). Under
autocast its GEMMs that read the input share one half copy of it (`decoder.autocast_copies`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.data.zigzag import local_positions
from shardlm.models.compressed_context import document_sources, gathered_keys, halo_sources
from shardlm.models.compressed_core import attend
from shardlm.models.config import ModelConfig
from shardlm.models.decoder import autocast_copies, enter_parallel_region
from shardlm.models.hyper_connections import unweighted_rms_norm
from shardlm.models.norms import rms_norm_fp32 as rms_norm
from shardlm.models.rotary import rope_inverse_frequencies
from shardlm.models.sparse_attention import (
    attach_indexer_loss,
    index_scores,
    indexer_divergence,
    indexer_trains,
    normalized,
    query_step,
)
from shardlm.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    copy_to_tensor_parallel,
)
from shardlm.parallel.init import normal_shard, param_seed


def inverse_frequencies(cfg: ModelConfig, compressed: bool, device=None) -> torch.Tensor:
    """(qk_rope_head_dim / 2,) fp32: theta^(-2i / rope) at rope_theta on sliding-only layers, at global_rope_theta on
    compressing ones and their compressors, there with YaRN when model.rope_yarn_factor is set (transformers' V4
    scales only those, and leaves cos and sin unscaled: attention_factor 1)."""
    if compressed and cfg.rope_yarn_factor:
        return rope_inverse_frequencies(replace(cfg, rope_theta=cfg.global_rope_theta), cfg.qk_rope_head_dim,
                                        device)[0]
    rope, theta = cfg.qk_rope_head_dim, cfg.global_rope_theta if compressed else cfg.rope_theta
    return 1.0 / (theta ** (torch.arange(0, rope, 2, dtype=torch.float, device=device) / rope))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (T,) -> (cos, sin), each (T, rope_dim / 2) fp32: one angle per interleaved pair."""
    freqs = positions[:, None].float() * inv_freq
    return freqs.cos(), freqs.sin()


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, d): its last 2 cos.shape[-1] channels rotated in interleaved pairs (x0, x1) -> (x0 c - x1 s,
    x1 c + x0 s) at (T, rope / 2) angles; the others pass."""
    rope = 2 * cos.shape[-1]
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    tail = x[..., -rope:]
    turned = torch.stack((-tail[..., 1::2], tail[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope], (tail.float() * cos + turned.float() * sin).to(x.dtype)), dim=-1)


def compressed_kinds(cfg: ModelConfig) -> list[str]:
    """Per layer "sliding", "csa" (with model.index_topk, the smallest nonzero ratio of model.compress_ratios) or
    "hca": the num_layers layers, then the model.mtp_layers depths (sliding when the ratios stop at the layers)."""
    ratios = list(cfg.compress_ratios) or [0] * cfg.num_layers
    ratios += [0] * (cfg.num_layers + cfg.mtp_layers - len(ratios))
    smallest = min([r for r in ratios if r] or [0])
    return ["sliding" if not r else "csa" if r == smallest and cfg.index_topk else "hca" for r in ratios]


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one entry of `dim` channels; `overlap` (CSA): windows of 2 ratio slots.
    Parameters (transformers' names less _proj): kv, gate ((1 or 2) dim, h), position_bias (ratio, (1 or 2) dim),
    kv_norm (dim,). `project(x (B, S, h), weight wrapper)` -> its kv and gate projections (B, S, (1 or 2) dim) each;
    forward(kv, gate, weight wrapper, first window's index) -> (B, S // ratio, dim), rotated at each window's
    start."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, dim: int, ratio: int,
                 overlap: bool):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.eps, self.inv_freq = cfg.layernorm_epsilon, inverse_frequencies(cfg, True, ctx.device)
        width = (2 if overlap else 1) * dim
        for name in ("kv", "gate"):
            setattr(self, name, nn.Parameter(normal_shard((width, cfg.hidden_size), cfg.init_std,
                                                          param_seed(seed, f"{prefix}.{name}"), device=ctx.device)))
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, device=ctx.device))
        self.kv_norm = nn.Parameter(torch.ones(dim, device=ctx.device))

    def project(self, x: torch.Tensor, shared, x_gate: torch.Tensor | None = None) -> list[torch.Tensor]:
        """x (B, S, h) -> [kv, gate] (B, S, (1 or 2) dim): per token, so that a context-parallel rank projects only
        its own tokens (`x_gate`: the gate's own view of x, `decoder.autocast_copies`)."""
        return [F.linear(x, shared(self.kv)), F.linear(x if x_gate is None else x_gate, shared(self.gate))]

    def forward(self, kv: torch.Tensor, gate: torch.Tensor, shared, first: int = 0) -> torch.Tensor:
        B, S, width = kv.shape
        W, m, d = S // self.ratio, self.ratio, self.dim
        kv = kv[:, :W * m].view(B, W, m, width)
        gate = gate[:, :W * m].view(B, W, m, width) + shared(self.position_bias)
        if self.overlap:  # slots [window w-1's first halves | window w's second halves]
            before_kv = torch.cat((kv.new_zeros(B, min(W, 1), m, d), kv[:, :-1, :, :d]), dim=1)
            before_gate = torch.cat((gate.new_full((B, min(W, 1), m, d), float("-inf")), gate[:, :-1, :, :d]), dim=1)
            kv, gate = torch.cat((before_kv, kv[..., d:]), dim=2), torch.cat((before_gate, gate[..., d:]), dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        pooled = rms_norm(pooled, shared(self.kv_norm), self.eps)
        cos, sin = rope_angles((torch.arange(W, device=kv.device) + first) * m, self.inv_freq)
        return rotate_tail(pooled, cos, sin)


class Indexer(nn.Module):
    """CSA's lightning indexer over compressed entries: `compressor` (index_head_dim), q_b (heads dim, q_lora_rank),
    weights_proj (heads, h). forward -> each query's chosen entries (B, T, min(k, entries)), -1 where not complete,
    and what its loss scores them from (`divergence`). Trained by its loss (the module docstring) with gradient
    `loss_scale` (set by `shardlm.training.indexer`); each training forward appends its per-token divergence to
    `recorded`."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, ratio: int):
        super().__init__()
        self.cfg, self.tp = cfg, ctx.tp
        self.heads, self.dim, self.topk, self.ratio = cfg.index_heads, cfg.index_head_dim, cfg.index_topk, ratio
        self.compressor = Compressor(cfg, ctx, seed, f"{prefix}.compressor", self.dim, ratio, overlap=True)
        self.q_b = nn.Parameter(normal_shard((self.heads * self.dim, cfg.q_lora_rank), cfg.init_std,
                                             param_seed(seed, f"{prefix}.q_b"), device=ctx.device))
        self.weights_proj = nn.Parameter(normal_shard((self.heads, cfg.hidden_size), cfg.init_std,
                                                      param_seed(seed, f"{prefix}.weights_proj"), device=ctx.device))
        for param in self.parameters():  # without a loss nothing trains it (the top-k choice carries no gradient)
            param.requires_grad_(cfg.index_loss_coeff > 0)
        self.loss_scale = 1.0
        self.recorded: list[torch.Tensor] = []

    def trains(self) -> bool:
        """Whether this forward computes the indexer's loss (`sparse_attention.indexer_trains`)."""
        return indexer_trains(self)

    def forward(self, entries: torch.Tensor, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
                cos, sin) -> tuple[torch.Tensor, tuple | None]:
        """entries (B, W, dim) its compressor's entries of the row (`entries`); x (B, T, h), q_res (B, T, q_lora_rank)
        and positions (T,) the queries' -> (chosen (B, T, k'), when it trains its (queries, weights, entries) with
        their parameters' gradient for `divergence`, else None). The inputs are read detached: the model gets no
        gradient from here. The choice runs by chunks of queries, each scoring every entry (B, c, heads, W) without
        a gradient."""
        trains = self.trains()
        with torch.set_grad_enabled(trains):
            parts = self.inputs(entries, x.detach(), q_res.detach(), cos, sin)
        B, T = x.shape[:2]
        W = parts[2].shape[1]
        step = query_step(B, W, self.heads, self.dim)
        chosen = []
        with torch.no_grad():
            for start in range(0, T, step):
                part = slice(start, start + step)
                top = self.ranked(parts, positions, part).topk(min(self.topk, W), dim=-1).indices
                valid = top < ((positions[part] + 1) // self.ratio).view(1, -1, 1)
                chosen.append(torch.where(valid, top, torch.full_like(top, -1)))
        return torch.cat(chosen, dim=1), parts if trains else None

    def divergence(self, parts: tuple, chosen: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """The loss's sum over queries (fp32 scalar): `parts` from `forward`, chosen (B, T, k), mass (B, T, k) this
        rank's heads' summed attention probabilities on the chosen entries (`compressed_core.attend`, detached). By
        chunks of queries, each scoring its chosen entries only, the gradient taken as it runs
        (`sparse_attention.indexer_divergence`): no (T, W) scores are kept."""
        target = entry_target(mass, chosen, self.tp)
        q, weights, entries = parts
        return indexer_divergence(q, weights, entries, lambda p: (chosen[:, p].clamp_min(0), chosen[:, p] >= 0),
                                  lambda p: target[:, p], chosen.shape[-1])

    def project(self, x_all: torch.Tensor) -> list[torch.Tensor]:
        """Its compressor's [kv, gate] projections of x_all (B, S, h), read detached (with a gradient for its weights
        when it trains)."""
        with torch.set_grad_enabled(self.trains()):
            return self.compressor.project(x_all.detach(), lambda p: p)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Its compressor's entries (B, W, dim) of `project`'s kv and gate, from window `first` on."""
        with torch.set_grad_enabled(self.trains()):
            return self.compressor(kv, gate, lambda p: p, first)

    def inputs(self, entries: torch.Tensor, x: torch.Tensor, q_res: torch.Tensor, cos,
               sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries (B, T, heads, dim) rotated, weights (B, T, heads) fp32 times heads^-1/2, entries (B, W, dim)) of
        the queries' inputs x, q_res and the row's `entries`."""
        B, T = q_res.shape[:2]
        q = rotate_tail(F.linear(q_res, self.q_b).view(B, T, self.heads, self.dim).transpose(1, 2), cos, sin)
        weights = F.linear(x, self.weights_proj).float() * self.heads ** -0.5
        return q.transpose(1, 2), weights, entries

    def ranked(self, parts: tuple, positions: torch.Tensor, part: slice) -> torch.Tensor:
        """The index scores (B, c, W) fp32 of the queries `part` of `parts` (`inputs`), sum_h w_h ReLU(q_h . e /
        sqrt(dim)), -inf for entries not complete yet."""
        q, weights, entries = parts
        scores = index_scores(q[:, part], weights[:, part], entries)
        return scores.masked_fill(~complete_entries(positions[part], entries.shape[1], self.ratio), float("-inf"))

    def scores(self, entries: torch.Tensor, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
               cos, sin) -> torch.Tensor:
        """The index scores (B, T, W) fp32 of `forward`'s arguments, -inf for entries not complete yet (all at once:
        what `forward` chooses by, chunk by chunk)."""
        return self.ranked(self.inputs(entries, x, q_res, cos, sin), positions, slice(None))


def entry_target(mass: torch.Tensor, chosen: torch.Tensor, tp) -> torch.Tensor:
    """The indexer's target (B, T, k), no gradient: mass (B, T, k) this rank's heads' summed attention probabilities
    on the chosen (B, T, k) entries (-1: none), summed over all heads (all-reduced over TP), each row scaled to sum
    to 1; rows without a chosen entry 0."""
    with torch.no_grad():
        return normalized(mass.masked_fill(chosen < 0, 0.0).float(), tp)


def complete_entries(positions: torch.Tensor, entries: int, ratio: int) -> torch.Tensor:
    """(T, W) bool: entry w is complete (all its tokens at or before the query) for the query at each position."""
    return torch.arange(entries, device=positions.device).view(1, -1) < ((positions + 1) // ratio).view(-1, 1)


class CompressedAttention(nn.Module):
    """DeepSeek-V4's attention of layer `layer` (the module docstring). (B, T, h) -> (B, T, h), or (B, T / tp, h)
    chunks under sequence parallelism. Parameters: q_a, q_a_norm, q_b, kv, kv_norm, o_a, o_b, sinks, and on
    compressing layers `compressor` (and on CSA layers `indexer`)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool,
                 layer: int):
        super().__init__()
        self.ctx, self.tp, self.sequence_parallel = ctx, ctx.tp, sequence_parallel
        self.heads, self.dim, self.window = cfg.num_heads // ctx.tp_size, cfg.head_dim, cfg.sliding_window
        self.groups = cfg.output_groups // ctx.tp_size
        self.eps = cfg.layernorm_epsilon
        kind = compressed_kinds(cfg)[layer]
        self.inv_freq = inverse_frequencies(cfg, kind != "sliding", ctx.device)  # not a buffer: DDP broadcasts those
        h, std, dev = cfg.hidden_size, cfg.init_std, ctx.device

        def replicated(name: str, shape: tuple[int, int]) -> nn.Parameter:
            return nn.Parameter(normal_shard(shape, std, param_seed(seed, f"{prefix}.{name}"), device=dev))

        self.q_a, self.kv = replicated("q_a", (cfg.q_lora_rank, h)), replicated("kv", (self.dim, h))
        self.q_a_norm = nn.Parameter(torch.ones(cfg.q_lora_rank, device=dev))
        self.kv_norm = nn.Parameter(torch.ones(self.dim, device=dev))
        self.q_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_heads * self.dim, ctx.tp, bias=False, std=std,
                                        seed=param_seed(seed, f"{prefix}.q_b"), device=dev)
        width = cfg.num_heads * self.dim // cfg.output_groups
        self.o_a = ColumnParallelLinear(width, cfg.output_groups * cfg.output_rank, ctx.tp, bias=False, std=std,
                                        seed=param_seed(seed, f"{prefix}.o_a"), device=dev)
        self.o_b = RowParallelLinear(cfg.output_groups * cfg.output_rank, h, ctx.tp, bias=False,
                                     std=std / math.sqrt(2 * cfg.num_layers), seed=param_seed(seed, f"{prefix}.o_b"),
                                     device=dev, sequence_parallel=sequence_parallel)
        self.sinks = nn.Parameter(torch.zeros(self.heads, device=dev))
        self.sinks.tensor_parallel_dim = 0
        self.compressor = self.indexer = None
        if kind != "sliding":
            ratio = cfg.compress_ratios[layer]
            self.compressor = Compressor(cfg, ctx, seed, f"{prefix}.compressor", self.dim, ratio, kind == "csa")
            if kind == "csa":
                self.indexer = Indexer(cfg, ctx, seed, f"{prefix}.indexer", ratio)

    def shared(self, param: torch.Tensor) -> torch.Tensor:
        """A replicated parameter as this rank uses it: its gradient summed over TP in the backward (`f`)."""
        return copy_to_tensor_parallel(param, self.tp) if self.tp.size > 1 else param

    def forward(self, x: torch.Tensor, cache=None, documents=None, carry: dict | None = None) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h). With `cache` (a `LayerKVCache`) x holds the positions after the cached ones:
        the layer's inputs are kept in it and the keys and entries recomputed over all of them. With `documents`
        (packed rows), each document is attended as a row of its own (its windows, entries and positions)."""
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)  # (B, T, h), gathered under SP
        if cache is not None:
            past = cache.length
            stored = cache.extras.get("inputs")
            x_all = x if stored is None else torch.cat((stored, x), dim=1)
            cache.extras["inputs"], cache.length = x_all, past + x.shape[1]
            positions = torch.arange(past, past + x.shape[1], device=x.device)
            return self.o_b(self.grouped(x, positions, *self.sources(self.key_inputs(autocast_copies(x_all, 3))))[0])
        cp = self.ctx.cp
        index = local_positions(x.shape[1], cp, device=x.device)  # each token's place in the whole row
        tokens = x.shape[0] * x.shape[1] * cp.size  # the micro-batch's, every CP rank's
        x, *inputs = autocast_copies(x, 4)  # under autocast one half copy for q_a, kv and the compressor's kv, gate
        if documents is None:
            sources = halo_sources(self, inputs, cp) if cp.size > 1 else None
            sources = sources or self.sources(self.key_inputs(inputs) if cp.size == 1 else
                                              gathered_keys(self, inputs, cp))
            return self.o_b(self.attach(*self.grouped(x, index, *sources), tokens))
        held = document_sources(self, inputs, cp, documents.offsets) if cp.size > 1 else None
        if held is None:
            keys = self.key_inputs(inputs) if cp.size == 1 else gathered_keys(self, inputs, cp)
        rows, divergences = [], []
        for b, offsets in enumerate(documents.offsets):
            pieces, places = [], []
            for d, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
                inside = ((index >= start) & (index < end)).nonzero().squeeze(-1)  # this rank's queries of it
                if inside.numel():
                    sources = (held[b][d] if held is not None else
                               self.sources([part[b:b + 1, start:end] for part in keys]))
                    out, divergence = self.grouped(x[b:b + 1, inside], index[inside] - start, *sources)
                    pieces.append(out)
                    places.append(inside)
                    divergences += [] if divergence is None else [divergence]
            rows.append(torch.cat(pieces, dim=1)[:, torch.argsort(torch.cat(places))])
        divergence = torch.stack(divergences).sum() if divergences else None
        return self.o_b(self.attach(torch.cat(rows), divergence, tokens))

    def attach(self, y: torch.Tensor, divergence: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """y (B, T, n) unchanged; with the indexer's summed `divergence` (when it trains), its loss attached over the
        micro-batch's `tokens` (the whole rows', every CP rank's included)."""
        if divergence is None:
            return y
        return attach_indexer_loss(y, self.indexer, divergence, tokens)

    def key_inputs(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The input x (B, S, h) as kv, the compressor's kv and its gate read it (three views of one autocast copy,
        `decoder.autocast_copies`) -> what its positions' keys and entries are computed from, per token: kv's
        projection (B, S, D) and on a compressing layer its compressor's kv and gate projections, and on a CSA layer
        the indexer's (from the detached x: `Indexer.project`)."""
        parts = [F.linear(inputs[0], self.shared(self.kv))]
        if self.compressor is not None:
            parts += self.compressor.project(inputs[1], self.shared, inputs[2])
            if self.indexer is not None:
                parts += self.indexer.project(inputs[0])
        return parts

    def sources(self, keys: list[torch.Tensor], first: int = 0) -> tuple:
        """`key_inputs` (B, S, .) of a row's positions (from window `first` on) -> (kv's projection (B, S, D), the
        compressor's entries (B, S / ratio, D) or None, the indexer's (B, S / ratio, D_i) or None)."""
        entries = index_entries = None
        if self.compressor is not None:
            entries = self.compressor(*keys[1:3], self.shared, first)
            if self.indexer is not None:
                index_entries = self.indexer.entries(*keys[3:5], first)
        return keys[0], entries, index_entries

    def grouped(self, x: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None,
                index_entries: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention up to the output projection o_b: x (B, T, h) the queries' inputs at `positions` (T,) of a
        row of S positions, kv their kv projections (`sources`: (B, S, D), or pieces [(first position, (B, n, D))]
        holding the queries' windows), the row's compressed entries and the indexer's ->
        ((B, T, output_groups / tp x output_rank), the indexer's summed divergence when it trains, else None)."""
        B, T, _ = x.shape
        cos, sin = rope_angles(positions, self.inv_freq)
        q_res = rms_norm(F.linear(x, self.shared(self.q_a)), self.shared(self.q_a_norm), self.eps)
        q = unweighted_rms_norm(self.q_b.local(q_res).view(B, T, self.heads, self.dim).transpose(1, 2), self.eps)
        q = rotate_tail(q, cos, sin)  # (B, heads, T, D)
        keys = []  # (first position, (B, n, D)) normalized and rotated
        for start, piece in [(0, kv)] if isinstance(kv, torch.Tensor) else kv:
            angles = rope_angles(torch.arange(start, start + piece.shape[1], device=x.device), self.inv_freq)
            keys.append((start, rotate_tail(rms_norm(piece, self.shared(self.kv_norm), self.eps), *angles)))
        ratio, chosen, parts = 0, None, None
        if self.compressor is not None:
            ratio = self.compressor.ratio
            if self.indexer is not None:
                chosen, parts = self.indexer(index_entries, x, q_res, positions, cos, sin)
        y, mass = attend(q, keys, positions, self.sinks, self.window, self.dim ** -0.5, entries, ratio, chosen)
        divergence = None
        if parts is not None:
            divergence = self.indexer.divergence(parts, chosen, mass)
        y = rotate_tail(y, cos, -sin).transpose(1, 2).reshape(B, T, self.groups, -1)
        rank_weight = self.o_a.weight.view(self.groups, -1, y.shape[-1])  # (groups, rank, (H / g) D)
        out = torch.einsum("btgi,gri->btgr", y, rank_weight)
        if self.o_a.lora is not None:
            out = out + self.grouped_lora(y)
        return out.reshape(B, T, -1), divergence

    def grouped_lora(self, y: torch.Tensor) -> torch.Tensor:
        """LoRA on the grouped o_a: y (B, T, groups / tp, (H / g) D) -> (B, T, groups / tp, output_rank), the update
        scale (y_g A^T) B_g^T of each group g, B_g its rows of B, so that merging scale B A into o_a's weight gives
        the same layer (the grouped weight's block view, as transformers' `DeepseekV4GroupedLinear` applies it). A is
        shared by the groups; B's rows split over TP with the groups (a column adapter). Dropout draws from the
        model-parallel generator: each TP rank holds other heads."""
        lora = self.o_a.lora
        if lora.training and lora.dropout > 0:
            with self.ctx.rng.fork():
                y = F.dropout(y, lora.dropout, True)
        low = torch.einsum("btgi,ki->btgk", y, lora.A)  # (B, T, groups / tp, lora rank)
        return torch.einsum("btgk,grk->btgr", low, lora.B.view(self.groups, -1, lora.rank_r)) * lora.scale
