"""Kimi Delta Attention (KDA): the linear-attention layer of Kimi Linear (three of every four of its layers), over
the tensor-parallel group; (B, T, h) -> (B, T, h).

    q, k, v = conv_silu([W_q x, W_k x, W_v x]);   q, k L2-normalized per head;   beta = sigmoid(W_b x)
    g       = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)     one decay per head and key channel (low-rank gate)
    o       = KDA rule (`shardlm.models.kda_rule`)
    y       = W_o (RMSNorm(o) * sigmoid(g_b(g_a(x))))          the output gate low-rank too

with `linear_num_value_heads` heads (as many query/key heads: `linear_num_key_heads` equal) of
`linear_key_head_dim` channels (`linear_value_head_dim` equal); f_a and g_a project to that many channels
(h -> d, transformers' f_a_proj and g_a_proj), f_b and g_b back to every head's (d -> H d); A_log is one per head,
dt_bias one per head and channel. `model.linear_attention_rule = "kimi_delta"` builds these layers where
`layer_types` says "linear_attention" (Gated DeltaNet otherwise, `shardlm.models.linear_attention`).

Tensor parallelism splits the heads, as Gated DeltaNet does: q, k, v, b, f_b and g_b are column-parallel (one `f`
on the input), o row-parallel (`g`); the depthwise convolution keeps each rank's heads' channels (`conv_q`,
`conv_k`, `conv_v`), and A_log and dt_bias split with the heads. f_a, g_a and the gated norm's weight are
replicated: each rank's backward brings its own heads' share of their gradient, summed over TP (`f` on the
weight). Nothing else talks over TP.

Packed documents (`Documents`): the rule runs per document from a zero state and the convolution's taps that
reach into an earlier document are masked. Decoding keeps the state (B, H / tp, d, d) and the convolution's last
kernel - 1 inputs (`LayerStateCache`).

Context parallelism keeps the zigzag split the MLA layers' ring needs, as Gated DeltaNet does, and runs every chunk
at once: the rule is linear in the state, so a chunk's end state is P S_in + S_local and its outputs
o_local + q~ S_in, a per-channel affine hand-over (`kda_span_summary`). The decays stay inside P (d_k x d_k): per
channel they do not come out as the one scalar factor Gated DeltaNet's summary pulls out, so P is the rule run from
an identity state with zero values and the decays (floored at e^-40, `decay_exp`, so its shrinking columns never
become subnormal floats). The summaries (B x 2C x H x d x 2d floats a layer) are all-gathered over CP and combined in
sequence order; the convolution reads the last kernel - 1 inputs of the chunk before (`GatedDeltaNet`'s).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.data.zigzag import zigzag_chunks
from shardlm.models.config import ModelConfig
from shardlm.models.decoder import LayerStateCache, autocast_copies, enter_parallel_region
from shardlm.models.delta_rule import causal_conv, conv_validity
from shardlm.models.documents import Documents
from shardlm.models.kda_rule import chunk_kda_rule, kda_rule, kda_span_summary, l2norm, packed_kda_rule
from shardlm.models.linear_attention import handed_over, starts
from shardlm.models.norms import rms_norm
from shardlm.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    copy_to_tensor_parallel,
    invariant,
)
from shardlm.parallel.init import normal_shard, param_seed
from shardlm.parallel.random import recompute

RULES = ("gated_delta", "kimi_delta")
"""`model.linear_attention_rule`: Gated DeltaNet (Qwen3-Next, Qwen3.5) or Kimi Delta Attention (Kimi Linear)."""


def linear_layer(cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool = False,
                 selective_recompute: bool = False) -> nn.Module:
    """The linear-attention layer `model.linear_attention_rule` names."""
    if cfg.linear_attention_rule == "kimi_delta":
        return KimiDeltaAttention(cfg, ctx, seed, prefix, sequence_parallel, selective_recompute)
    from shardlm.models.linear_attention import GatedDeltaNet
    return GatedDeltaNet(cfg, ctx, seed, prefix, sequence_parallel, selective_recompute)


def _split(values: torch.Tensor, ctx: ParallelContext) -> nn.Parameter:
    """This TP rank's contiguous share of a vector drawn whole (any TP size gives the same model)."""
    local = values.shape[0] // ctx.tp_size
    param = nn.Parameter(values[ctx.tp_rank * local:(ctx.tp_rank + 1) * local].to(ctx.device))
    param.tensor_parallel_dim = 0
    return param


class KimiDeltaAttention(nn.Module):
    """Kimi Linear's KDA layer, heads split over TP. (B, T, h) -> (B, T, h), or (B, T / tp, h) chunks under
    sequence parallelism."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False, selective_recompute: bool = False):
        super().__init__()
        self.ctx, self.tp, self.cfg = ctx, ctx.tp, cfg
        self.sequence_parallel, self.selective_recompute = sequence_parallel, selective_recompute
        heads, d = cfg.linear_num_value_heads, cfg.linear_key_head_dim
        self.heads, self.d, self.kernel = heads // ctx.tp_size, d, cfg.linear_conv_kernel
        h, std = cfg.hidden_size, cfg.init_std

        def column(name: str, width: int, inputs: int = h) -> ColumnParallelLinear:
            return ColumnParallelLinear(inputs, width, ctx.tp, bias=False, std=std,
                                        seed=param_seed(seed, f"{prefix}.{name}"), device=ctx.device)

        self.q, self.k, self.v = (column(name, heads * d) for name in "qkv")
        self.b = column("b", heads)
        self.f_b, self.g_b = column("f_b", heads * d, d), column("g_b", heads * d, d)
        self.f_a, self.g_a = (nn.Parameter(normal_shard((d, h), std, param_seed(seed, f"{prefix}.{name}"),
                                                        device=ctx.device)) for name in ("f_a", "g_a"))
        for name in ("conv_q", "conv_k", "conv_v"):
            local = heads * d // ctx.tp_size
            weight = normal_shard((heads * d, self.kernel), 1 / math.sqrt(self.kernel),
                                  param_seed(seed, f"{prefix}.{name}"), 0, ctx.tp_rank * local,
                                  (ctx.tp_rank + 1) * local, device=ctx.device)
            setattr(self, name, nn.Parameter(weight))
            getattr(self, name).tensor_parallel_dim = 0
        generator = torch.Generator().manual_seed(param_seed(seed, f"{prefix}.A_log"))
        self.A_log = _split(torch.empty(heads).uniform_(1, 16, generator=generator).log(), ctx)
        dt = torch.empty(heads * d).uniform_(math.log(1e-3), math.log(0.1), generator=generator).exp()
        self.dt_bias = _split(dt + torch.log(-torch.expm1(-dt)), ctx)  # softplus(dt_bias) = dt
        self.norm = nn.RMSNorm(d, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.o = RowParallelLinear(heads * d, h, ctx.tp, bias=False, std=std / math.sqrt(2 * cfg.num_layers),
                                   seed=param_seed(seed, f"{prefix}.o"), device=ctx.device,
                                   sequence_parallel=sequence_parallel)

    def low_rank(self, x: torch.Tensor, down: nn.Parameter, up: ColumnParallelLinear) -> torch.Tensor:
        """up(down(x)), x (B, T, h) past `f` -> (B, T, H / tp x d): down replicated (its gradient summed over TP)."""
        return up.local(invariant.linear(x, copy_to_tensor_parallel(down, self.tp)))

    def forward(self, x: torch.Tensor, cache: LayerStateCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """x: (B, T, h), or this rank's sequence chunk under sequence parallelism -> the same shape. With `cache`,
        x continues the cached positions; with `documents`, each packed document starts from a zero state."""
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)
        B, T, _ = x.shape
        x_q, x_k, x_v, x_b, x_f, x_g = autocast_copies(x, 6)  # under autocast one half copy of x for the six
        mixed = torch.cat((self.q.local(x_q), self.k.local(x_k), self.v.local(x_v)), dim=-1)  # (B, T, 3 H d / tp)
        gates = (self.b.local(x_b), self.low_rank(x_f, self.f_a, self.f_b))
        if self.selective_recompute and cache is None and self.training and torch.is_grad_enabled():
            out = recompute(self.core, mixed, *gates, documents, rng=self.ctx.rng)
        else:
            out = self.core(mixed, *gates, documents, cache)
        gate = self.low_rank(x_g, self.g_a, self.g_b).view(B, T, self.heads, self.d)
        weight = copy_to_tensor_parallel(self.norm.weight, self.tp)  # replicated: gradient summed over TP
        y = rms_norm(out.float(), weight.float(), self.norm.eps)
        y = (y * torch.sigmoid(gate.float())).to(x.dtype)
        return self.o(y.reshape(B, T, self.heads * self.d))

    def core(self, mixed: torch.Tensor, b: torch.Tensor, f: torch.Tensor, documents: Documents | None = None,
             cache: LayerStateCache | None = None) -> torch.Tensor:
        """The convolution and the rule: mixed (B, T, 3 H d / tp) before the convolution, b (B, T, H / tp) and the
        forget gate's f_b output f (B, T, H d / tp) -> (B, T, H / tp, d) fp32."""
        weight = torch.cat((self.conv_q, self.conv_k, self.conv_v))
        if cache is not None:
            conv = causal_conv(mixed, weight, cache.conv)
            earlier = mixed.new_zeros(mixed.shape[0], self.kernel - 1, mixed.shape[2]) if cache.conv is None \
                else cache.conv
            cache.conv = torch.cat((earlier, mixed), dim=1)[:, -(self.kernel - 1):] if self.kernel > 1 else earlier
        elif self.ctx.cp_size > 1:  # the chunk before each of this rank's two reads its last inputs
            from shardlm.models.linear_attention import GatedDeltaNet
            conv = GatedDeltaNet.context_parallel_conv(self, mixed, weight, documents)
        else:
            valid = None if documents is None else conv_validity(
                documents.segments, torch.arange(mixed.shape[1], device=mixed.device), self.kernel)
            conv = causal_conv(mixed, weight, None, valid)
        q, k, v, g, beta = self.rule_inputs(conv, b, f)
        if cache is not None:
            out, cache.state = kda_rule(q, k, v, g, beta, cache.state)
            cache.length += mixed.shape[1]
        elif self.ctx.cp_size > 1:
            out = self.context_parallel_rule(q, k, v, g, beta, documents)
        elif documents is not None:
            out = packed_kda_rule(q, k, v, g, beta, documents.offsets)
        else:
            out = chunk_kda_rule(q, k, v, g, beta)[0]
        return out.transpose(1, 2)

    def rule_inputs(self, conv: torch.Tensor, b: torch.Tensor, f: torch.Tensor):
        """The convolution's output (B, T, 3 H d / tp), b and f -> q, k (B, H / tp, T, d) normalized (q scaled),
        v (B, H / tp, T, d), g (B, H / tp, T, d) and beta (B, H / tp, T), fp32 but v."""
        B, T, _ = conv.shape
        q, k, v = (x.reshape(B, T, self.heads, self.d) for x in conv.split(self.heads * self.d, dim=-1))
        q = l2norm(q.float()) * self.d ** -0.5
        k = l2norm(k.float())
        beta = torch.sigmoid(b.float())
        decay_rate = self.A_log.float().exp().unsqueeze(-1)  # (H / tp, 1)
        g = -decay_rate * F.softplus(f.float().view(B, T, self.heads, self.d) + self.dt_bias.float().view(-1, self.d))
        return (*(x.transpose(1, 2) for x in (q, k, v, g, beta)),)

    def context_parallel_rule(self, q, k, v, g, beta, documents: Documents | None) -> torch.Tensor:
        """This CP rank's two zigzag chunks (B, H, 2L, .), each run at once from a zero state with its span summary
        (`kda_span_summary`: the chunk's first document, when it began before the chunk, owes its outputs q~ S_in
        and its end state P S_in to the incoming state); the summaries (P, S_local) of every chunk all-gathered
        over CP and combined in sequence order give each chunk its incoming state. -> (B, H, 2L, d_v) fp32."""
        cp = self.ctx.cp
        B, H, local, dk = k.shape
        length = local // 2
        chunks = zigzag_chunks(cp.size, cp.rank)
        pieces, summaries = [], []
        for slot, chunk in enumerate(chunks):
            part = [x[:, :, slot * length:(slot + 1) * length] for x in (q, k, v, g, beta)]
            rows = [self.row_span(*(x[r:r + 1] for x in part), chunk, None if documents is None
                                  else documents.positions[r, slot * length:(slot + 1) * length]) for r in range(B)]
            pieces.append(rows)
            summaries.append(torch.cat([torch.cat((p, s), dim=-1) for _, _, _, p, s in rows]))
        zero = q.new_zeros(B, H, dk, v.shape[-1], dtype=torch.float32)
        return handed_over(pieces, chunks, torch.stack(summaries, dim=1), zero, dk, cp)

    def row_span(self, q, k, v, g, beta, chunk: int, positions: torch.Tensor | None):
        """One row's span of zigzag chunk `chunk` (inputs with B = 1; positions within their documents, or None):
        (outputs (1, H, L, d_v), q~ of its first document (None when that starts in the span), the first
        document's length, P (zeros when a document starts inside the span: its end owes nothing to the state
        before), the end state from a zero incoming state)."""
        cuts = [] if positions is None else starts(positions)
        continues = chunk > 0 and (positions is None or int(positions[0]) != 0)
        bounds = [0, *cuts, q.shape[2]]
        outputs, q_tilde, transition = [], None, None
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            parts = [x[:, :, start:end] for x in (q, k, v, g, beta)]
            if i == 0 and continues:
                out, q_tilde, state, transition = kda_span_summary(*parts)
            else:
                out, state = chunk_kda_rule(*parts)
            outputs.append(out)
        dk = q.shape[-1]
        if transition is None or len(bounds) > 2:
            transition = q.new_zeros(1, q.shape[1], dk, dk, dtype=torch.float32)
        return torch.cat(outputs, dim=2), q_tilde, bounds[1], transition, state


def check_kimi_delta(cfg: ModelConfig, tensor: int, context: int) -> str | None:
    """A one-line problem with a model's KDA settings, or None (`check_linear_attention` checks what the two rules
    share: head counts against TP, CP chunks against the convolution)."""
    if cfg.linear_attention_rule not in RULES:
        return f'model.linear_attention_rule="{cfg.linear_attention_rule}" must be "gated_delta" or "kimi_delta"'
    if cfg.linear_attention_rule != "kimi_delta" or not any(cfg.is_linear_layer(i) for i in range(cfg.num_layers)):
        return None
    if cfg.linear_num_key_heads != cfg.linear_num_value_heads or cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        return ('model.linear_attention_rule="kimi_delta" needs as many key as value heads '
                "(linear_num_key_heads = linear_num_value_heads) of as many channels (linear_key_head_dim = "
                "linear_value_head_dim)")
    return None
