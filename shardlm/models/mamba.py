"""Nemotron-H's blocks: a Mamba-2 layer (`Mamba2`), attention without positions, a ReLU^2 MLP and an MoE layer of
ReLU^2 experts (Nemotron 3), one mixer a block (`HybridBlock`, chosen per layer by `model.layer_pattern`); built by
shardlm's Llama (`shardlm.models.llama`).

The Mamba-2 layer, (B, T, h) -> (B, T, h), with H heads of P channels, G groups of an N-channel state, a
convolution of width K:

    z, x, B, C, dt = W_z u, W_x u, W_B u, W_C u, W_dt u       (Hugging Face's in_proj, rows [z | x | B | C | dt])
    x, B, C        = silu(conv([x, B, C]) + conv_bias)         depthwise causal convolution
    y              = SSD(x, softplus(dt + dt_bias), A = -exp(A_log), B, C) + D x     (`shardlm.models.ssd`)
    out            = W_o (GroupRMSNorm(y * silu(z)) * norm.weight)        the norm over each group's H / G heads

Tensor parallelism splits the heads and the groups together (G and H divisible by TP, each group's heads on its
rank): z, x, B, C and dt are column-parallel (one `f` on the input, the sequence all-gather under SP), the output
row-parallel (`g`); the convolution is depthwise and the norm per group, so each rank keeps its channels' taps,
biases and norm weights, and `A_log`, `dt_bias` and `D` (one per head) split with the heads. Nothing else talks
over TP.

Sequence boundaries the layer keeps exact:
- packed documents: the scan runs per document from a zero state, and the convolution's taps that reach into an
  earlier document are masked;
- context parallelism: a rank holds two chunks of the row (the zigzag split the attention layers' ring needs);
  each chunk is scanned at once from a zero state; the decay is a scalar per head, so the state before a chunk
  reaches its end as decay x S_in (decay = exp of the chunk's summed log decays, 0 past a document start) and
  its tokens as C~_t . S_in: the chunks' (decay, end state) summaries are all-gathered over CP and combined in
  sequence order, and each chunk's first document adds what it reads of its incoming state; the convolution
  reads the last K - 1 inputs of the chunk before it (all-gathered too);
- decoding: the layer's cache entry keeps the SSM state (B, H / tp, P, N) and the convolution's last K - 1
  inputs instead of keys and values.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.data.zigzag import zigzag_chunks
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig, ParallelOptions
from shardlm.models.decoder import SequenceDropout, autocast_copies, enter_parallel_region, mark_sequence_parallel
from shardlm.models.delta_rule import conv_validity
from shardlm.models.documents import Documents
from shardlm.models.linear_attention import chunks_convolved
from shardlm.models.moe import GroupedExperts, MoELayer, expert_matmul, grouped_mm_applies, pad_expert_rows
from shardlm.models.norms import RMSNorm
from shardlm.models.ssd import (
    carry,
    chunk_scan,
    conv_silu,
    discretize,
    document_starts,
    gated_rms_norm,
    read_state,
    scan,
    scan_documents,
    span_scan,
)
from shardlm.parallel import ColumnParallelLinear, ParallelContext, RowParallelLinear
from shardlm.parallel.init import normal_shard, param_seed
from shardlm.parallel.mappings import gather_from_sequence_parallel
from shardlm.parallel.random import recompute

KINDS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}
"""The layer kinds of `model.layer_pattern` shardlm builds (Nemotron-H's hybrid_override_pattern characters)."""


def _split(values: torch.Tensor, ctx: ParallelContext) -> nn.Parameter:
    """This TP rank's rows of a tensor drawn whole (so any TP size gives the same model), `tensor_parallel_dim` 0."""
    local = values.shape[0] // ctx.tp_size
    param = nn.Parameter(values[ctx.tp_rank * local:(ctx.tp_rank + 1) * local].to(ctx.device))
    param.tensor_parallel_dim = 0
    return param


class Mamba2(nn.Module):
    """Nemotron-H's Mamba-2 mixer, heads and groups split over TP. (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False, selective_recompute: bool = False):
        super().__init__()
        self.ctx, self.tp, self.cfg = ctx, ctx.tp, cfg
        self.sequence_parallel, self.selective_recompute = sequence_parallel, selective_recompute
        H, G = cfg.mamba_num_heads, cfg.mamba_groups
        self.P, self.N, self.kernel = cfg.mamba_head_dim, cfg.mamba_state_size, cfg.mamba_conv_kernel
        self.heads, self.groups = H // ctx.tp_size, G // ctx.tp_size
        self.group_size = H * self.P // G  # the gated norm's channels per group
        h, std = cfg.hidden_size, cfg.init_std

        def column(name: str, width: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(h, width, ctx.tp, bias=False, std=std,
                                        seed=param_seed(seed, f"{prefix}.{name}"), device=ctx.device)

        self.z, self.x = column("z", H * self.P), column("x", H * self.P)
        self.B, self.C, self.dt = column("B", G * self.N), column("C", G * self.N), column("dt", H)
        for name, width in (("conv_x", H * self.P), ("conv_B", G * self.N), ("conv_C", G * self.N)):
            local = width // ctx.tp_size
            weight = normal_shard((width, self.kernel), 1 / math.sqrt(self.kernel),
                                  param_seed(seed, f"{prefix}.{name}"), 0, ctx.tp_rank * local,
                                  (ctx.tp_rank + 1) * local, device=ctx.device)
            setattr(self, name, nn.Parameter(weight))
            getattr(self, name).tensor_parallel_dim = 0
            setattr(self, f"{name}_bias", _split(torch.zeros(width), ctx) if cfg.mamba_conv_bias else None)
        generator = torch.Generator().manual_seed(param_seed(seed, f"{prefix}.dt_bias"))
        self.A_log = _split(torch.arange(1, H + 1, dtype=torch.float32).log(), ctx)  # A = -1 .. -H (S4D real)
        dt = torch.empty(H).uniform_(math.log(1e-3), math.log(0.1), generator=generator).exp().clamp(min=1e-4)
        self.dt_bias = _split(dt + torch.log(-torch.expm1(-dt)), ctx)  # softplus(dt_bias) = dt
        self.D = _split(torch.ones(H), ctx)
        self.norm = nn.Module()
        self.norm.weight = _split(torch.ones(H * self.P), ctx)
        self.o = RowParallelLinear(H * self.P, h, ctx.tp, bias=False, std=std / math.sqrt(2 * cfg.num_layers),
                                   seed=param_seed(seed, f"{prefix}.o"), device=ctx.device,
                                   sequence_parallel=sequence_parallel)
        self.o.lora_target = "out"  # lora.targets' "out_proj" (transformers' name), apart from attention's o_proj

    def forward(self, u: torch.Tensor, cache=None, documents: Documents | None = None) -> torch.Tensor:
        """u: (B, T, h), or this rank's sequence chunk under sequence parallelism -> the same shape. With `cache`
        (a layer's entry of `KVCache`), u continues the cached positions; with `documents`, each packed document
        starts from a zero state."""
        u = enter_parallel_region(u, self.tp, self.sequence_parallel)
        B, T, _ = u.shape
        u_x, u_B, u_C, u_dt, u_z = autocast_copies(u, 5)  # under autocast one half copy of u for the five
        mixed = torch.cat((self.x.local(u_x), self.B.local(u_B), self.C.local(u_C)), dim=-1)  # (B, T, channels / tp)
        dt = self.dt.local(u_dt)
        if self.selective_recompute and cache is None and self.training and torch.is_grad_enabled():
            y = recompute(self.core, mixed, dt, documents, rng=self.ctx.rng)
        else:
            y = self.core(mixed, dt, documents, cache)
        y = gated_rms_norm(y.reshape(B, T, self.heads * self.P), self.z.local(u_z), self.norm.weight, self.group_size,
                           self.cfg.layernorm_epsilon)
        return self.o(y.to(u.dtype))

    def conv_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's (C, K) convolution taps over [x | B | C] and their biases (C,), or None without biases."""
        weight = torch.cat((self.conv_x, self.conv_B, self.conv_C))
        if self.conv_x_bias is None:
            return weight, None
        return weight, torch.cat((self.conv_x_bias, self.conv_B_bias, self.conv_C_bias))

    def core(self, mixed: torch.Tensor, dt: torch.Tensor, documents: Documents | None = None,
             cache=None) -> torch.Tensor:
        """The convolution and the scan: mixed (B, T, [x | B | C] channels / tp) before the convolution, dt
        (B, T, H / tp) raw -> (B, T, H / tp, P) fp32."""
        weight, bias = self.conv_weights()
        Bsz, T, channels = mixed.shape
        if cache is not None:
            earlier = getattr(cache, "conv", None)
            conv = conv_silu(mixed, weight, bias, earlier)
            window = mixed.new_zeros(Bsz, self.kernel - 1, channels) if earlier is None else earlier
            cache.conv = torch.cat((window, mixed), dim=1)[:, -(self.kernel - 1):] if self.kernel > 1 else window
        elif self.ctx.cp_size > 1:
            conv = self.context_parallel_conv(mixed, weight, bias, documents)
        else:
            valid = None if documents is None else conv_validity(
                documents.segments, torch.arange(T, device=mixed.device), self.kernel)
            conv = conv_silu(mixed, weight, bias, None, valid)
        width = self.heads * self.P
        x, b, c = conv.split((width, self.groups * self.N, self.groups * self.N), dim=-1)
        x = x.reshape(Bsz, T, self.heads, self.P)
        b, c = b.reshape(Bsz, T, self.groups, self.N), c.reshape(Bsz, T, self.groups, self.N)
        step, A = discretize(dt, self.dt_bias), -self.A_log.float().exp()
        if cache is not None:
            y, cache.state = scan(x, step, A, b, c, self.D, getattr(cache, "state", None), self.cfg.mamba_chunk_size)
            cache.length += T
            return y
        if self.ctx.cp_size > 1:
            return self.context_parallel_scan(x, step, A, b, c, documents)
        if documents is None:
            return chunk_scan(x, step, A, b, c, self.D, chunk=self.cfg.mamba_chunk_size)[0]
        chunk = self.cfg.mamba_chunk_size
        rows = [scan_documents(x[r:r + 1], step[r:r + 1], A, b[r:r + 1], c[r:r + 1], self.D,
                               document_starts(documents.positions[r]), chunk)[0] for r in range(Bsz)]
        return torch.cat(rows)

    def span(self, x, dt, A, b, c, positions: torch.Tensor | None, continues: bool):
        """One row's span (batch 1) of a CP chunk, cut where documents start (`positions`, (L,), or None: one
        document): each document scanned from a zero state, except the first when `continues` (it started in an
        earlier chunk: `span_scan`). Returns (outputs (1, L, H, P), C~ of the first document or None, its length,
        the incoming state's decay to the span's end (1, H; 0 when a document starts inside), the span's end state
        without the incoming one (1, H, P, N))."""
        cuts = [] if positions is None else document_starts(positions)
        bounds = [0, *cuts, x.shape[1]]
        chunk = self.cfg.mamba_chunk_size
        outputs, c_tilde, decay = [], None, None
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            part = [t[:, start:end] for t in (x, dt, b, c)]
            if i == 0 and continues:
                out, c_tilde, state, decay = span_scan(part[0], part[1], A, part[2], part[3], self.D)
            else:
                out, state = chunk_scan(part[0], part[1], A, part[2], part[3], self.D, chunk=chunk)
            outputs.append(out)
        if decay is None or len(bounds) > 2:  # no earlier state reaches the span's end
            decay = x.new_zeros(1, x.shape[2], dtype=torch.float32)
        return torch.cat(outputs, dim=1), c_tilde, bounds[1], decay, state

    def context_parallel_scan(self, x, dt, A, b, c, documents: Documents | None) -> torch.Tensor:
        """This CP rank's two zigzag chunks, each scanned at once; their (decay, end state) summaries all-gathered
        over CP and combined in sequence order give each chunk its incoming state, which its first document's
        tokens then read (C~ S_in). (B, 2L, H, .) inputs -> (B, 2L, H, P)."""
        cp = self.ctx.cp
        Bsz, local, H, P = x.shape
        length = local // 2
        pieces, summaries = [], []
        for slot, chunk in enumerate(zigzag_chunks(cp.size, cp.rank)):
            part = [t[:, slot * length:(slot + 1) * length] for t in (x, dt, b, c)]
            rows = []
            for r in range(Bsz):
                positions = None if documents is None else documents.positions[r, slot * length:(slot + 1) * length]
                continues = chunk > 0 and (positions is None or int(positions[0]) != 0)
                rows.append(self.span(*(t[r:r + 1] for t in part[:2]), A, *(t[r:r + 1] for t in part[2:]),
                                      positions, continues))
            pieces.append(rows)
            decay = torch.cat([row[3] for row in rows])  # (B, H)
            state = torch.cat([row[4] for row in rows])  # (B, H, P, N)
            summaries.append(torch.cat((decay.unsqueeze(-1), state.flatten(2)), dim=-1))
        # (B, 2, H, 1 + P N) of this rank's chunks -> (B, 2C, ...) of every rank's, in rank order
        gathered = gather_from_sequence_parallel(torch.stack(summaries, dim=1).contiguous(), cp)
        incoming, state = {}, x.new_zeros(Bsz, H, P, self.N, dtype=torch.float32)
        for chunk in range(2 * cp.size):
            rank = chunk if chunk < cp.size else 2 * cp.size - 1 - chunk
            entry = gathered[:, 2 * rank + (0 if chunk < cp.size else 1)]
            incoming[chunk] = state
            state = carry(state, entry[..., 0], entry[..., 1:].view(Bsz, H, P, self.N))
        outputs = []
        for slot, chunk in enumerate(zigzag_chunks(cp.size, cp.rank)):
            rows = []
            for r, (out, c_tilde, first, _, _) in enumerate(pieces[slot]):
                if c_tilde is not None:
                    head = out[:, :first] + read_state(c_tilde, incoming[chunk][r:r + 1])
                    out = torch.cat((head, out[:, first:]), dim=1)
                rows.append(out)
            outputs.append(torch.cat(rows))
        return torch.cat(outputs, dim=1)

    def context_parallel_conv(self, mixed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              documents: Documents | None) -> torch.Tensor:
        """The convolution of this CP rank's two chunks (B, 2L, channels / tp), each reading the last K - 1 inputs
        of the chunk before it in the row (all-gathered over CP; masked where another document's)."""
        return chunks_convolved(mixed, self.kernel, documents, self.ctx.cp,
                                lambda x, earlier, valid: conv_silu(x, weight, bias, earlier, valid))


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP, down(relu(up x)^2), (B, T, h) -> (B, T, h): up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.sequence_parallel = ctx.tp, sequence_parallel
        self.up = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, ctx.tp, bias=False, std=cfg.init_std,
                                       seed=param_seed(seed, f"{prefix}.up"), device=ctx.device)
        self.down = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, ctx.tp, bias=False,
                                      std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
                                      seed=param_seed(seed, f"{prefix}.down"), device=ctx.device,
                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)
        return self.down(F.relu(self.up.local(x)).square())


class ReluSquaredExperts(GroupedExperts):
    """Nemotron-H's routed experts: `fc` (E_l, f / tp, h) and `proj` (E_l, h, f / tp) as GPT's non-gated experts,
    y = proj(relu(fc x)^2). forward(x (M, h) grouped by expert, counts (E_l,)) -> (M, h) partial sums over TP."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = [self.fc, self.proj]
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        else:
            x = x.to(weights[0].dtype)
        counts = counts.tolist()
        grouped = self.grouped and grouped_mm_applies(x, *weights)
        keep = None
        if grouped and self.pad_rows > 1 and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            x, counts, keep = pad_expert_rows(x, counts, self.pad_rows)  # padded rows are dropped at the end
        pre = expert_matmul(x, weights[0], counts, grouped)
        if self.lora is not None:
            pre = pre + self.lora.inputs(x, counts, grouped)[0]
        hidden = F.relu(pre).square()
        out = expert_matmul(hidden, weights[1], counts, grouped)
        if self.lora is not None:
            out = out + self.lora.outputs(hidden, counts, grouped)
        return out if keep is None else out.index_select(0, keep)


def relu_squared_moe(cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool,
                     dispatcher: str) -> MoELayer:
    """Nemotron-H's MoE mixer: the router (sigmoid scores, the score-correction bias in the choice, groups), ReLU^2
    experts and a ReLU^2 shared expert of `moe_shared_ffn_hidden_size`. (B, T, h) -> (B, T, h)."""
    shared = None
    if cfg.moe_shared_experts:
        shared = ReluSquaredMLP(replace(cfg, ffn_hidden_size=cfg.shared_ffn_size), ctx, seed, f"{prefix}.shared",
                                sequence_parallel)
    layer = MoELayer(cfg, ctx, seed, prefix, sequence_parallel, gated=False, shared=shared, dispatcher=dispatcher)
    layer.experts.__class__ = ReluSquaredExperts  # the same stacks, drawn as GPT's; only the activation differs
    return layer


def no_position_attention(cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool,
                          selective_recompute: bool, context_exchange: str) -> nn.Module:
    """Nemotron-H's attention: Llama's grouped-query attention without RoPE (the Mamba-2 layers carry the order)."""
    from shardlm.models.llama import LlamaAttention

    class NoPositionAttention(LlamaAttention):
        def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return x

    return NoPositionAttention(cfg, ctx, seed, prefix, sequence_parallel, selective_recompute, context_exchange)


class HybridBlock(nn.Module):
    """One Nemotron-H block: x + Dropout(mixer(RMSNorm(x))), the mixer the layer's kind in `model.layer_pattern`
    (Mamba-2, attention or MLP). (B, T, h) -> (B, T, h), or (B, T / tp, h) chunks under sequence parallelism."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int,
                 sequence_parallel: bool = False, selective_recompute: bool = False,
                 options: ParallelOptions | None = None):
        super().__init__()
        if (problem := check_mamba(cfg, ctx.tp_size, ctx.cp_size)) is not None:
            raise UserError(problem)
        options = options or ParallelOptions()
        self.kind = cfg.layer_pattern[index]
        prefix = f"layers.{index}.mixer"
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        if self.kind == "M":
            self.mixer = Mamba2(cfg, ctx, seed, prefix, sequence_parallel, selective_recompute)
        elif self.kind == "*":
            self.mixer = no_position_attention(cfg, ctx, seed, prefix, sequence_parallel, selective_recompute,
                                               options.context_exchange)
        elif self.kind == "E":
            self.mixer = relu_squared_moe(cfg, ctx, seed, prefix, sequence_parallel, options.expert_dispatcher)
        else:
            self.mixer = ReluSquaredMLP(cfg, ctx, seed, prefix, sequence_parallel)
        self.dropout = SequenceDropout(cfg.dropout, ctx, sequence_parallel)
        if sequence_parallel:
            mark_sequence_parallel(self.norm)

    def forward(self, x: torch.Tensor, cache=None, documents: Documents | None = None,
                carry: dict | None = None) -> torch.Tensor:
        """`cache`: this layer's entry of the model's `KVCache` (an MLP or MoE layer only counts the positions)."""
        h = self.norm(x)
        if self.kind in "-E":
            y = self.mixer(h)
            if cache is not None:
                cache.length += h.shape[1]
        else:
            y = self.mixer(h, cache, documents)
        return x + self.dropout(y)


def check_mamba(cfg: ModelConfig, tensor: int, context: int) -> str | None:
    """A one-line problem with a model's `layer_pattern` and Mamba-2 settings at this TP and CP size, or None."""
    pattern = cfg.layer_pattern
    if not pattern:
        return None
    H, G = cfg.mamba_num_heads, cfg.mamba_groups
    mamba = "M" in pattern
    checks = [
        (len(pattern) == cfg.num_layers, f'model.layer_pattern="{pattern}" has {len(pattern)} layers, not '
         f"model.num_layers={cfg.num_layers}"),
        (set(pattern) <= set(KINDS), f'model.layer_pattern="{pattern}" may hold only "M" (Mamba-2), "*" '
         '(attention), "-" (MLP) and "E" (MoE)'),
        (("E" in pattern) == (cfg.moe_num_experts > 0), 'model.layer_pattern\'s MoE layers ("E") need '
         "model.moe_num_experts > 0, and experts need MoE layers in the pattern"),
        (cfg.moe_first_dense_layers == 0 and cfg.moe_layer_interval == 1, "model.layer_pattern places the MoE "
         "layers; remove moe_first_dense_layers and moe_layer_interval"),
        (cfg.arch == "llama" and cfg.attention == "mha", 'model.layer_pattern needs model.arch="llama" with '
         'model.attention="mha"'),
        (not (cfg.layer_types or cfg.mtp_layers or cfg.sliding_window or cfg.index_topk),
         "model.layer_pattern chooses every layer's kind; remove layer_types, mtp_layers, sliding_window and "
         "index_topk"),
        (not mamba or min(H, G, cfg.mamba_head_dim, cfg.mamba_state_size, cfg.mamba_conv_kernel,
                          cfg.mamba_chunk_size) > 0,
         "Mamba-2 layers need model.mamba_num_heads, mamba_head_dim, mamba_state_size, mamba_groups, "
         "mamba_conv_kernel and mamba_chunk_size > 0"),
        (not mamba or H % max(G, 1) == 0, f"model.mamba_num_heads={H} is not a multiple of model.mamba_groups={G}"),
        (not mamba or G % tensor == 0, f"model.mamba_groups={G} must divide by parallel.tensor={tensor} (each "
         "rank keeps whole groups and their heads); use a tensor-parallel size that divides it"),
        (not mamba or context == 1 or cfg.seq_length // (2 * context) >= cfg.mamba_conv_kernel - 1,
         f"model.seq_length={cfg.seq_length} leaves context-parallel chunks of {cfg.seq_length // (2 * context)} "
         f"tokens, fewer than the convolution's {cfg.mamba_conv_kernel - 1} earlier inputs; use a longer sequence "
         "or a smaller parallel.context"),
    ]
    return next((message for ok, message in checks if not ok), None)
