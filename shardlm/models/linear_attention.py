"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5 (three of every four of their layers),
over the tensor- and context-parallel groups; (B, T, h) -> (B, T, h).

    q, k, v = conv_silu([W_q x, W_k x, W_v x]);  q, k L2-normalized;  beta = sigmoid(W_b x)
    g = -exp(A_log) softplus(W_a x + dt_bias);   o = gated delta rule (`shardlm.models.delta_rule`)
    y = W_o (RMSNorm(o) * silu(W_z x))           (the norm per value head, its weight shared by the heads)

with `linear_num_key_heads` query/key heads of `linear_key_head_dim` channels and `linear_num_value_heads` value
heads of `linear_value_head_dim` (each key head serves num_value_heads / num_key_heads consecutive value heads).

Tensor parallelism splits the heads, as attention does: q, k, v, z, b and a are column-parallel (one `f` on
the input), the output row-parallel (`g`); the convolution is depthwise, so each rank keeps the channels of
its heads (`conv_q`, `conv_k`, `conv_v`, split like q, k and v), and `A_log` and `dt_bias` (one per value
head) are split too. The gated norm's weight is replicated and its gradient summed over TP. Both head counts
must divide by TP.

Sequence boundaries the layer keeps exact:
- packed documents: the state and the convolution start again at every document (`Documents`): the rule runs
  per document, and the convolution's taps that reach into an earlier document are masked;
- context parallelism: a rank holds two chunks of the row (the zigzag split the ring attention of the
  full-attention layers needs); each chunk runs at once from a zero state, with its transition summary
  (`span_summary`), the summaries are all-gathered over CP and combined in sequence order, and each chunk's
  outputs take the incoming state's share; the convolution reads the last kernel - 1 inputs of the chunk
  before it (all-gathered too);
- decoding: `LayerStateCache` keeps the state and the convolution's last inputs instead of keys and values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.data.zigzag import zigzag_chunks
from shardlm.models.config import ModelConfig
from shardlm.models.decoder import LayerStateCache, autocast_copies, enter_parallel_region
from shardlm.models.delta_rule import (
    carry,
    causal_conv,
    chunk_gated_delta_rule,
    conv_validity,
    gated_delta_rule,
    l2_normalize,
    span_summary,
)
from shardlm.models.documents import Documents
from shardlm.models.norms import rms_norm
from shardlm.parallel import ColumnParallelLinear, ParallelContext, RowParallelLinear, copy_to_tensor_parallel
from shardlm.parallel.init import normal_shard, param_seed
from shardlm.parallel.mappings import gather_from_sequence_parallel
from shardlm.parallel.random import recompute


def _split_vector(values: torch.Tensor, ctx: ParallelContext, heads: int) -> nn.Parameter:
    """This TP rank's entries of a per-head vector drawn whole (so any TP size gives the same model)."""
    local = heads // ctx.tp_size
    param = nn.Parameter(values[ctx.tp_rank * local:(ctx.tp_rank + 1) * local].to(ctx.device))
    param.tensor_parallel_dim = 0
    return param


def chunks_convolved(mixed: torch.Tensor, kernel: int, documents: Documents | None, cp, conv) -> torch.Tensor:
    """A causal convolution of width `kernel` over this CP rank's two zigzag chunks (B, 2L, channels): each chunk
    reads the last kernel - 1 inputs of the chunk before it in the row (all-gathered over CP; masked where another
    document's). `conv(x (B, L, channels), earlier (B, kernel - 1, channels) or None, valid)` convolves one chunk
    (Gated DeltaNet's and KDA's `causal_conv`, Mamba-2's `conv_silu`). -> (B, 2L, channels)."""
    Bsz, local, channels = mixed.shape
    length, K = local // 2, kernel
    tails = torch.stack([mixed[:, (slot + 1) * length - (K - 1):(slot + 1) * length] for slot in range(2)], dim=1)
    gathered = gather_from_sequence_parallel(tails.contiguous(), cp)  # (B, 2C, K-1, channels), rank order
    segments = None if documents is None else documents.segments
    outputs = []
    for slot, chunk in enumerate(zigzag_chunks(cp.size, cp.rank)):
        earlier = None
        if chunk > 0:
            before = chunk - 1
            rank = before if before < cp.size else 2 * cp.size - 1 - before
            earlier = gathered[:, 2 * rank + (0 if before < cp.size else 1)]
        positions = torch.arange(chunk * length, (chunk + 1) * length, device=mixed.device)
        valid = conv_validity(segments, positions, K)
        outputs.append(conv(mixed[:, slot * length:(slot + 1) * length], earlier, valid))
    return torch.cat(outputs, dim=1)


def handed_over(pieces: list, chunks: list[int], summary: torch.Tensor, zero: torch.Tensor, dk: int,
                cp) -> torch.Tensor:
    """The state hand-over of a context-parallel delta rule (Gated DeltaNet's and KDA's): `summary` (B, 2, H, d_k,
    d_k + d_v) this rank's two zigzag chunks' (transition | local end state), all-gathered over CP and carried in
    sequence order from `zero` (B, H, d_k, d_v) to each chunk's incoming state; each of this rank's `pieces[slot]`
    rows (out (1, H, L, d_v), q_tilde, first, ...) then gets q_tilde @ incoming added to its first `first` tokens
    (those before the row's first document start). -> (B, H, 2L, d_v), this rank's chunks in order."""
    gathered = gather_from_sequence_parallel(summary.contiguous(), cp)  # (B, 2C, ...) every rank's, rank order
    incoming, state = {}, zero
    for chunk in range(2 * cp.size):
        rank = chunk if chunk < cp.size else 2 * cp.size - 1 - chunk
        entry = gathered[:, 2 * rank + (0 if chunk < cp.size else 1)]
        incoming[chunk] = state
        state = carry(state, entry[..., :dk], entry[..., dk:])
    outputs = []
    for slot, chunk in enumerate(chunks):
        rows = []
        for r, (out, q_tilde, first, _, _) in enumerate(pieces[slot]):
            if q_tilde is not None:
                out = torch.cat((out[:, :, :first] + q_tilde @ incoming[chunk][r:r + 1], out[:, :, first:]), dim=2)
            rows.append(out)
        outputs.append(torch.cat(rows))
    return torch.cat(outputs, dim=2)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next / Qwen3.5 linear attention, heads split over TP. (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False, selective_recompute: bool = False):
        super().__init__()
        self.ctx, self.tp, self.cfg = ctx, ctx.tp, cfg
        self.sequence_parallel, self.selective_recompute = sequence_parallel, selective_recompute
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv, self.kernel = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel
        self.key_heads, self.value_heads = nk // ctx.tp_size, nv // ctx.tp_size
        h, std = cfg.hidden_size, cfg.init_std

        def column(name: str, width: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(h, width, ctx.tp, bias=False, std=std,
                                        seed=param_seed(seed, f"{prefix}.{name}"), device=ctx.device)

        self.q, self.k = column("q", nk * self.dk), column("k", nk * self.dk)
        self.v, self.z = column("v", nv * self.dv), column("z", nv * self.dv)
        self.b, self.a = column("b", nv), column("a", nv)
        for name, width in (("conv_q", nk * self.dk), ("conv_k", nk * self.dk), ("conv_v", nv * self.dv)):
            local = width // ctx.tp_size
            weight = normal_shard((width, self.kernel), 1 / math.sqrt(self.kernel),
                                  param_seed(seed, f"{prefix}.{name}"), 0, ctx.tp_rank * local,
                                  (ctx.tp_rank + 1) * local, device=ctx.device)
            setattr(self, name, nn.Parameter(weight))
            getattr(self, name).tensor_parallel_dim = 0
        generator = torch.Generator().manual_seed(param_seed(seed, f"{prefix}.A_log"))
        self.A_log = _split_vector(torch.empty(nv).uniform_(1, 16, generator=generator).log(), ctx, nv)
        dt = torch.empty(nv).uniform_(math.log(1e-3), math.log(0.1), generator=generator).exp()
        self.dt_bias = _split_vector(dt + torch.log(-torch.expm1(-dt)), ctx, nv)  # softplus(dt_bias) = dt
        self.norm = nn.RMSNorm(self.dv, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.o = RowParallelLinear(nv * self.dv, h, ctx.tp, bias=False, std=std / math.sqrt(2 * cfg.num_layers),
                                   seed=param_seed(seed, f"{prefix}.o"), device=ctx.device,
                                   sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, cache: LayerStateCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """x: (B, T, h), or this rank's sequence chunk under sequence parallelism -> the same shape. With `cache`,
        x continues the cached positions; with `documents`, each packed document starts from a zero state."""
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)
        B, T, _ = x.shape
        x_q, x_k, x_v, x_b, x_a, x_z = autocast_copies(x, 6)  # under autocast one half copy of x for the six
        mixed = torch.cat((self.q.local(x_q), self.k.local(x_k), self.v.local(x_v)), dim=-1)  # (B, T, channels / tp)
        gates = (self.b.local(x_b), self.a.local(x_a))
        if self.selective_recompute and cache is None and self.training and torch.is_grad_enabled():
            out = recompute(self.core, mixed, *gates, documents, rng=self.ctx.rng)
        else:
            out = self.core(mixed, *gates, documents, cache)
        z = self.z.local(x_z).view(B, T, self.value_heads, self.dv)
        weight = copy_to_tensor_parallel(self.norm.weight, self.tp)  # replicated: gradient summed over TP
        y = rms_norm(out.float(), None, self.norm.eps).to(x.dtype) * weight
        y = (y.float() * F.silu(z.float())).to(x.dtype)
        return self.o(y.reshape(B, T, self.value_heads * self.dv))

    def core(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, documents: Documents | None = None,
             cache: LayerStateCache | None = None) -> torch.Tensor:
        """The convolution and the recurrence: mixed (B, T, q|k|v channels / tp) before the convolution, b and a
        (B, T, H_v / tp) -> (B, T, H_v / tp, d_v) fp32."""
        weight = torch.cat((self.conv_q, self.conv_k, self.conv_v))
        if cache is not None:
            conv = causal_conv(mixed, weight, cache.conv)
            cache.conv = torch.cat((mixed.new_zeros(mixed.shape[0], self.kernel - 1, mixed.shape[2])
                                    if cache.conv is None else cache.conv, mixed), dim=1)[:, -(self.kernel - 1):]
        elif self.ctx.cp_size > 1:
            conv = self.context_parallel_conv(mixed, weight, documents)
        else:
            valid = None if documents is None else conv_validity(
                documents.segments, torch.arange(mixed.shape[1], device=mixed.device), self.kernel)
            conv = causal_conv(mixed, weight, None, valid)
        q, k, v, g, beta = self.rule_inputs(conv, b, a)
        if cache is not None:
            out, cache.state = gated_delta_rule(q, k, v, g, beta, cache.state)
            cache.length += mixed.shape[1]
        elif self.ctx.cp_size > 1:
            out = self.context_parallel_rule(q, k, v, g, beta, documents)
        elif documents is not None:
            out = torch.cat([self.row_by_documents(*(x[r:r + 1] for x in (q, k, v, g, beta)),
                                                   starts(documents.positions[r]))[0]
                             for r in range(q.shape[0])])
        else:
            out = chunk_gated_delta_rule(q, k, v, g, beta)[0]
        return out.transpose(1, 2)

    def rule_inputs(self, conv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """The convolution's output (B, T, channels / tp) and b, a -> q, k (B, H_v, T, d_k) normalized (q scaled,
        each key head repeated for its value heads), v (B, H_v, T, d_v), g and beta (B, H_v, T)."""
        B, T, _ = conv.shape
        key_width = self.key_heads * self.dk
        q, k, v = conv.split((key_width, key_width, self.value_heads * self.dv), dim=-1)
        repeat = self.value_heads // self.key_heads
        q = l2_normalize(q.float().view(B, T, self.key_heads, self.dk)) * self.dk ** -0.5
        k = l2_normalize(k.float().view(B, T, self.key_heads, self.dk))
        q, k = (x.repeat_interleave(repeat, dim=2) if repeat > 1 else x for x in (q, k))
        v = v.view(B, T, self.value_heads, self.dv)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return (*(x.transpose(1, 2) for x in (q, k, v, g, beta)),)

    def row_by_documents(self, q, k, v, g, beta, cuts: list[int], continues: bool = False):
        """One row's span (q... with B = 1) cut at `cuts` (where documents start): each document runs from a zero
        state, except the first when `continues` (it started before the span: `span_summary`). Returns (outputs
        (1, H, L, d_v), q~ of the first document or None, its length, P (None: the incoming state is dropped),
        the span's end state without the incoming one)."""
        bounds = [0, *cuts, q.shape[2]]
        outputs, q_tilde, transition = [], None, None
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            parts = [x[:, :, start:end] for x in (q, k, v, g, beta)]
            if i == 0 and continues:
                out, q_tilde, state, transition = span_summary(*parts)
            else:
                out, state = chunk_gated_delta_rule(*parts)
            outputs.append(out)
        if len(bounds) > 2:
            transition = None  # a document starts inside the span: its end state owes nothing to the one before
        return torch.cat(outputs, dim=2), q_tilde, bounds[1], transition, state

    def context_parallel_rule(self, q, k, v, g, beta, documents: Documents | None) -> torch.Tensor:
        """This CP rank's two zigzag chunks, each run at once; their summaries all-gathered and combined in
        sequence order give each chunk its incoming state. (B, H, 2L, .) inputs -> (B, H, 2L, d_v)."""
        cp = self.ctx.cp
        B, H, local, dk = k.shape
        length = local // 2
        chunks = zigzag_chunks(cp.size, cp.rank)
        pieces, transitions, locals_ = [], [], []
        for slot, chunk in enumerate(chunks):
            part = [x[:, :, slot * length:(slot + 1) * length] for x in (q, k, v, g, beta)]
            rows = []
            for r in range(B):
                positions = None if documents is None else documents.positions[r, slot * length:(slot + 1) * length]
                cuts = [] if positions is None else starts(positions)
                continues = chunk > 0 and (positions is None or int(positions[0]) != 0)
                rows.append(self.row_by_documents(*(x[r:r + 1] for x in part), cuts, continues))
            pieces.append(rows)
            zero = q.new_zeros(1, H, dk, dk, dtype=torch.float32)
            transitions.append(torch.cat([row[3] if row[3] is not None else zero for row in rows]))
            locals_.append(torch.cat([row[4] for row in rows]))
        # (B, 2, H, d_k, d_k + d_v) summaries of this rank's chunks -> (B, 2C, ...) of every rank's, rank order
        summary = torch.stack([torch.cat((p, s), dim=-1) for p, s in zip(transitions, locals_)], dim=1)
        return handed_over(pieces, chunks, summary, torch.zeros_like(locals_[0]), dk, cp)

    def context_parallel_conv(self, mixed: torch.Tensor, weight: torch.Tensor,
                              documents: Documents | None) -> torch.Tensor:
        """The convolution of this CP rank's two chunks (B, 2L, channels / tp), each reading the last kernel - 1
        inputs of the chunk before it in the row (all-gathered over CP; masked where another document's)."""
        cp, K = self.ctx.cp, self.kernel
        B, local, channels = mixed.shape
        length = local // 2
        if length < K - 1:
            raise ValueError(f"context-parallel chunks of {length} tokens are shorter than the convolution's "
                             f"{K - 1} earlier inputs")
        return chunks_convolved(mixed, K, documents, cp,
                                lambda x, earlier, valid: causal_conv(x, weight, earlier, valid))


def check_linear_attention(cfg: ModelConfig, tensor: int, context: int) -> str | None:
    """A one-line problem with a model's linear-attention settings at this TP and CP size, or None (what the two
    rules share; `shardlm.models.kimi_delta.check_kimi_delta` checks Kimi Delta Attention's own, first)."""
    if not any(cfg.is_linear_layer(i) for i in range(cfg.num_layers)):
        return None
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    chunk = cfg.seq_length // (2 * context)
    checks = [
        (cfg.arch == "llama" and (cfg.attention == "mha" or cfg.linear_attention_rule == "kimi_delta"),
         'linear_attention layers need model.arch="llama" with model.attention="mha" (or "mla" beside KDA layers)'),
        (min(nk, nv, cfg.linear_key_head_dim, cfg.linear_value_head_dim) > 0,
         "linear_attention layers need model.linear_num_key_heads, linear_num_value_heads, linear_key_head_dim "
         "and linear_value_head_dim > 0"),
        (nk > 0 and nv % nk == 0, f"model.linear_num_value_heads={nv} is not a multiple of "
         f"model.linear_num_key_heads={nk}"),
        (nk % tensor == 0 and nv % tensor == 0, f"model.linear_num_key_heads={nk} and linear_num_value_heads={nv} "
         f"must both divide by parallel.tensor={tensor}; use a tensor-parallel size that divides them"),
        (cfg.linear_conv_kernel >= 1, f"model.linear_conv_kernel={cfg.linear_conv_kernel} must be at least 1"),
        (context == 1 or chunk >= cfg.linear_conv_kernel - 1,
         f"model.seq_length={cfg.seq_length} leaves context-parallel chunks of {chunk} tokens, fewer than the "
         f"convolution's {cfg.linear_conv_kernel - 1} earlier inputs; use a longer sequence or a smaller "
         "parallel.context"),
        (cfg.hf_linear_projections in ("separate", "grouped"),
         f'model.hf_linear_projections="{cfg.hf_linear_projections}" must be "separate" or "grouped"'),
    ]
    return next((message for ok, message in checks if not ok), None)


def starts(positions: torch.Tensor) -> list[int]:
    """Indices > 0 of a row's tokens (positions within their documents, (L,)) where a document starts."""
    return (positions[1:] == 0).nonzero().flatten().add(1).tolist()
