"""Multi-head latent attention (MLA, DeepSeek-V2/V3), as transformers' `DeepseekV3Attention` computes it.

    q      = q_b(RMSNorm(q_a(x)))             or q(x) when q_lora_rank is 0    (B, T, H, nope + rope)
    (the latents' RMSNorms use epsilon 1e-6 whatever model.layernorm_epsilon is, as transformers does)
    c, k_r = split(kv_a(x), [kv_lora_rank, rope])                              latent and shared RoPE key
    k_n, v = split(kv_b(RMSNorm(c)), [nope, v_head_dim])  per head             (B, T, H, nope), (B, T, H, v)
    k      = [k_n | RoPE(k_r) repeated over the heads],  q = [q_n | RoPE(q_r)]
    y      = o(softmax(q k^T x scale) v),  scale = (nope + rope)^-1/2 (x YaRN's mscale(factor, mscale_all_dim)^2)

Rotary embeddings use the rotate-half layout of `shardlm.models.rotary` on the last `qk_rope_head_dim`
channels of q and of the shared key; DeepSeek's checkpoints store those channels interleaved
(`rope_interleave`), which the converter permutes once (`shardlm.checkpoint.hf_deepseek`), exactly as
transformers' interleaved rotation equals rotate-half on the de-interleaved channels. With YaRN
(`rope_yarn_factor`) the frequencies are transformers' yarn ones and cos/sin carry its attention factor.

Tensor parallelism splits the heads: q_b (or q) and kv_b are column-parallel by heads, o row-parallel
(`g`). The down-projections q_a and kv_a and their RMSNorms are replicated on every TP rank; their
outputs (the query latent, the key/value latent and the shared RoPE key) are the inputs of the split
heads, so each rank's backward brings only its own heads' share of their gradient. Those latents pass
through `f` (all-reduce in the backward) on the way into the heads, so the replicated weights and the
block input receive the full gradient on every rank. Under sequence parallelism the down-projections
run on this rank's sequence chunk, `f` is the sequence all-gather `f_sp` of the latents (fewer channels
than the hidden size), and their weights' partial gradients are summed by the trainer (`sequence_parallel`).
Under context parallelism the expanded keys and values go around the ring (`causal_attention`); values
narrower than the keys are zero-padded to the keys' size for the ring, which changes no output channel.
Packed documents (SFT) work as in GPT and Llama: positions restart per document, attention stays inside.

Decoding caches the latent, not the expanded keys and values: per token the normed latent c and the rotated
shared RoPE key, kv_lora_rank + rope channels (576 for DeepSeek-V3, against 128 heads x (192 + 128) = 40,960
expanded), whole on every TP rank. A cached step absorbs kv_b into the query and the output (DeepSeek-V2's
decoding): per head, q_n . k_n = (q_n W_UK) . c and p v = (p c) W_UV^T, so the scores are
[q_n W_UK | RoPE(q_r)] . [c | RoPE(k_r)] against one shared key head and the output (p c) W_UV^T: the same
function, no per-head keys or values built. The prompt (the first call with a cache) runs the expanded path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models import sparse_attention as dsa
from shardlm.models.attention import causal_attention
from shardlm.models.config import ModelConfig
from shardlm.models.decoder import (
    LayerKVCache,
    autocast_copies,
    causal_mask_with_past,
    enter_parallel_region,
    mark_sequence_parallel,
)
from shardlm.models.documents import Documents, token_positions
from shardlm.models.max_logits import record_chosen_max_logits, record_max_logits
from shardlm.models.norms import RMSNorm
from shardlm.models.rotary import angles_of, apply_rotary, rope_inverse_frequencies, yarn_mscale
from shardlm.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    ReplicatedLinear,
    RowParallelLinear,
    gather_zigzag_rows,
)
from shardlm.parallel.init import param_seed
from shardlm.parallel.random import recompute

LATENT_NORM_EPS = 1e-6
"""Epsilon of the RMSNorms of the query and key/value latents: fixed, not model.layernorm_epsilon, in
transformers' DeepseekV3Attention (and DeepSeek's reference code)."""


def check_latent_attention(m: ModelConfig, context: int) -> str | None:
    """One line saying what is wrong with the MLA keys of `m` at context-parallel size `context`, or None."""
    if m.attention not in ("mha", "mla"):
        return f'model.attention="{m.attention}" must be "mha" or "mla"'
    if m.rope_yarn_factor and (m.rope_yarn_factor < 1 or m.rope_yarn_original_positions < 1):
        return "model.rope_yarn_factor must be >= 1 with model.rope_yarn_original_positions >= 1 (0 turns YaRN off)"
    if m.rope_llama3_factor and (m.rope_yarn_factor or m.rope_llama3_factor < 1 or m.rope_llama3_original_positions < 1
                                 or not 0 < m.rope_llama3_low_freq_factor < m.rope_llama3_high_freq_factor):
        return ("model.rope_llama3_factor needs factor >= 1, original positions >= 1, 0 < low_freq_factor < "
                "high_freq_factor, and no YaRN (one rope scaling at a time)")
    if m.rope_yarn_layers not in ("all", "full") or m.rope_yarn_attention_factor < 0:
        return (f'model.rope_yarn_layers="{m.rope_yarn_layers}" must be "all" or "full" and '
                f"model.rope_yarn_attention_factor={m.rope_yarn_attention_factor} at least 0 (0 derives it)")
    if m.hc_mult:  # DeepSeek-V4 (its indexer is over compressed entries, without MLA): `check_deepseek_v4`
        return None
    if (problem := dsa.check_sparse_attention(m)) is not None:
        return problem
    if m.query_scale_beta and (m.attention != "mla" or m.query_scale_positions < 1):
        return "model.query_scale_beta needs model.attention=\"mla\" and model.query_scale_positions >= 1"
    if m.attention == "mha":
        return 'model.mla_nope needs model.attention="mla"' if m.mla_nope else None
    if m.arch != "llama":
        return 'model.attention="mla" needs model.arch="llama"'
    sizes = {"kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
             "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}
    for key, value in sizes.items():
        if value < 1:
            return f'model.{key}={value} must be at least 1 with model.attention="mla"'
    if m.q_lora_rank < 0 or m.qk_rope_head_dim % 2:
        return "model.q_lora_rank must be >= 0 and model.qk_rope_head_dim even"
    if m.num_kv_heads or m.head_dim or m.qk_norm:
        return 'model.num_kv_heads, head_dim and qk_norm do not apply to model.attention="mla" (remove them)'
    if m.v_head_dim > m.qk_nope_head_dim + m.qk_rope_head_dim and context > 1:
        return ("model.v_head_dim larger than qk_nope_head_dim + qk_rope_head_dim is not supported with "
                "parallel.context > 1; use parallel.context=1")
    return None


def query_scale(positions: torch.Tensor, beta: float, step: int) -> torch.Tensor:
    """Llama 4's query scale 1 + beta x log(1 + floor(position / step)) of positions (T,) or (B, T), shaped to
    multiply queries (B, H, T, d): (T, 1) or (B, 1, T, 1)."""
    scale = 1 + beta * torch.log1p(torch.floor(positions.float() / step))
    return scale.unsqueeze(-1) if positions.dim() == 1 else scale[:, None, :, None]


def softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim)^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_yarn_factor and cfg.rope_yarn_mscale_all_dim:
        scale = scale * yarn_mscale(cfg.rope_yarn_factor, cfg.rope_yarn_mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; heads split over TP. (B, T, h) -> (B, T, h), or (B, T / tp, h)
    chunks under sequence parallelism. Parameters: `q_a`, `q_a_norm`, `q_b` (or `q`), `kv_a`, `kv_a_norm`,
    `kv_b`, `o` (the names of `DeepseekV3Attention`'s projections without `_proj`)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False, selective_recompute: bool = False,
                 context_exchange: str = "ring", layer: int = 0):
        super().__init__()
        self.cfg, self.ctx, self.tp = cfg, ctx, ctx.tp
        self.sequence_parallel, self.selective_recompute = sequence_parallel, selective_recompute
        self.context_exchange = context_exchange
        self.heads = cfg.num_heads // ctx.tp_size
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.dropout = cfg.attention_dropout_p
        self.scale = softmax_scale(cfg)
        h, std, dev, sp = cfg.hidden_size, cfg.init_std, ctx.device, sequence_parallel
        qk = self.nope + self.rope

        def column(name: str, rows_per_head: int, width: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(width, cfg.num_heads * rows_per_head, ctx.tp, bias=False, std=std,
                                        seed=param_seed(seed, f"{prefix}.{name}"), device=dev)

        def norm(width: int) -> RMSNorm:
            layer = RMSNorm(width, eps=LATENT_NORM_EPS, device=dev)
            if sp:
                mark_sequence_parallel(layer)
            return layer

        self.q_a = self.q_a_norm = self.q_b = self.q = None
        if cfg.q_lora_rank:
            self.q_a = ReplicatedLinear((cfg.q_lora_rank, h), std, param_seed(seed, f"{prefix}.q_a"), dev, sp)
            self.q_a_norm = norm(cfg.q_lora_rank)
            self.q_b = column("q_b", qk, cfg.q_lora_rank)
        else:
            self.q = column("q", qk, h)
        self.kv_a = ReplicatedLinear((cfg.kv_lora_rank + self.rope, h), std, param_seed(seed, f"{prefix}.kv_a"),
                                     dev, sp)
        self.kv_a_norm = norm(cfg.kv_lora_rank)
        self.kv_b = column("kv_b", self.nope + self.v_dim, cfg.kv_lora_rank)
        self.o = RowParallelLinear(cfg.num_heads * self.v_dim, h, ctx.tp, bias=False,
                                   std=std / math.sqrt(2 * cfg.num_layers), seed=param_seed(seed, f"{prefix}.o"),
                                   device=dev, sequence_parallel=sp)
        self.layer, self.source = layer, cfg.index_source(layer)
        self.indexer = None  # DeepSeek Sparse Attention's lightning indexer (`shardlm.models.sparse_attention`)
        if self.source == layer:
            self.indexer = dsa.Indexer(cfg, ctx, seed, f"{prefix}.indexer", sp)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """`f` (or `f_sp`) in front of the split heads: the backward all-reduces (reduce-scatters) each rank's
        heads' share of the gradient, so everything before it (replicated) sees the full gradient."""
        return enter_parallel_region(x, self.tp, self.sequence_parallel)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None,
                documents: Documents | None = None, carry: dict | None = None) -> torch.Tensor:
        """x: (B, T, h) -> (B, T, h). With `cache`, x holds the T positions after the cached ones; the cache
        holds the normed latents (B, 1, T, kv_lora_rank) and rotated shared RoPE keys (B, 1, T, rope), and steps
        after the first attend through `absorbed`.
        `documents`: packed rows' documents (positions restart, attention stays inside each).
        With sparse attention (`model.index_topk`) every path attends through `sparse`; `carry` hands the
        chosen keys from a layer's indexer to the "shared" layers after it."""
        cfg = self.cfg
        q_latent = None
        if self.q is not None:
            q = self.q.local(self.enter(x))
            latents = self.enter(torch.cat(self.kv_latent(x), dim=-1))
        else:
            x_q, x_kv = autocast_copies(x, 2)  # under autocast one half copy of x for q_a and kv_a
            q_latent = self.q_a_norm(self.q_a(x_q))
            latents = self.enter(torch.cat((q_latent, *self.kv_latent(x_kv)), dim=-1))
            q_latent, latents = latents.split([cfg.q_lora_rank, latents.shape[-1] - cfg.q_lora_rank], dim=-1)
            q = self.q_b.local(q_latent)
        c, k_rope = latents.split([cfg.kv_lora_rank, self.rope], dim=-1)
        B, T = q.shape[:2]
        past = 0 if cache is None else cache.length
        q = q.view(B, T, self.heads, self.nope + self.rope).transpose(1, 2)
        positions = token_positions(T, self.ctx.cp, past, documents, x.device)
        cos, sin = self.angles(positions)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, apply_rotary(q_rope, cos, sin)), dim=-1)
        if cfg.query_scale_beta:  # Llama 4's long-context query scaling (Mistral 4)
            q = q * query_scale(positions, cfg.query_scale_beta, cfg.query_scale_positions).to(q.dtype)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin)  # (B, 1, T, rope): one key head shared by all
        if cache is not None:  # the latent and the rotated shared key, (B, 1, past + T, kv_lora_rank / rope)
            latent, shared_key = cache.append(c.unsqueeze(1), k_rope)
        if self.source is not None and cfg.index_stage == "sparse":
            keys = torch.cat((latent, shared_key), dim=-1).squeeze(1) if cache is not None else None
            y = self.sparse(x, q, q_latent, c, k_rope, (cos, sin), keys, documents, cache, carry)
            return self.o(y.transpose(1, 2).reshape(B, T, self.heads * self.v_dim))
        if past > 0:
            y = self.absorbed(q, latent, shared_key, past)
            return self.o(y.transpose(1, 2).reshape(B, T, self.heads * self.v_dim))
        kv = self.kv_b.local(c).view(B, T, self.heads, self.nope + self.v_dim).transpose(1, 2)  # keys and values
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # per head (the cached and sparse paths absorb kv_b)
        k = torch.cat((k_nope, k_rope.expand(B, self.heads, T, self.rope)), dim=-1)
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            y = recompute(self.core, q, k, v, documents, rng=self.ctx.rng)
        else:
            y = self.core(q, k, v, documents)
        if self.indexer is not None and cache is None:  # sparse attention's dense warm-up: the indexer learns
            y = self.warmup(y, x, q, q_latent, torch.cat((c, k_rope.squeeze(1)), dim=-1), (cos, sin), documents)
        return self.o(y.transpose(1, 2).reshape(B, T, self.heads * self.v_dim))

    def absorption(self) -> torch.Tensor:
        """kv_b's weight (LoRA included) per head, (H/tp, nope + v, kv_lora_rank): W_UK then W_UV."""
        weight = self.kv_b.weight if self.kv_b.lora is None else self.kv_b.weight + self.kv_b.lora.delta_weight()
        return weight.view(self.heads, self.nope + self.v_dim, -1)

    def absorbed_query(self, q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """q (B, H/tp, T, nope + rope) rotated -> [q_nope W_UK | q_rope] (B, H/tp, T, kv_lora_rank + rope)."""
        return dsa.absorb_query(q, weight, self.nope)

    def sparse(self, x, q, q_latent, c, k_rope, angles, keys, documents, cache, carry) -> torch.Tensor:
        """DeepSeek Sparse Attention: q (B, H/tp, T, nope + rope) rotated, q_latent (B, T, q_lora_rank), c (B, T, r),
        k_rope (B, 1, T, rope) rotated, `angles` the (cos, sin) of the T positions, `keys` (B, S, r + rope) the
        cached latents and keys with a cache (else None) -> (B, H/tp, T, v_head_dim): MLA over each query's chosen
        keys (`shardlm.models.sparse_attention`), the indexer's loss attached when it trains."""
        weight = self.absorption()
        if keys is None:
            keys = gather_zigzag_rows(torch.cat((c, k_rope.squeeze(1)), dim=-1), self.ctx.cp)
        B, T, S = q.shape[0], q.shape[2], keys.shape[1]
        # the queries' row positions, made on the host (the choice's chunks read their bounds there) and copied over
        host_rows = dsa.query_rows(T, self.ctx.cp, torch.device("cpu")) + (0 if cache is None else cache.length - T)
        rows = host_rows.to(x.device)
        scored = None
        if self.indexer is None:  # GLM-5's shared layer: the keys its full layer chose
            if carry is None or self.source not in carry:
                raise ValueError(f"layer {self.layer} reuses layer {self.source}'s sparse-attention choice, which is "
                                 "not in this pipeline stage; put both layers in one stage")
            indices, valid = carry[self.source]
        else:
            scored = self.indexer_inputs(x, q_latent, angles, cache)
            indices, valid = self.top_k(*scored, rows, documents, host_rows)
            if carry is not None:
                carry[self.layer] = (indices, valid)
        record_chosen_max_logits(self, q, weight, keys, indices, valid)  # QK-clip's statistic, when tracked
        y, mass = dsa.sparse_latent_attention(q, keys, indices, valid, self.scale, self.cfg.kv_lora_rank,
                                              absorption=(weight, self.nope), host_rows=host_rows)
        if scored is not None and self.indexer_trains():
            target = dsa.normalized(mass, self.ctx.tp)
            divergence = dsa.indexer_divergence(*scored, lambda p: (indices[:, p], valid[:, p]),
                                                lambda p: target[:, p], indices.shape[-1])
            y = dsa.attach_indexer_loss(y, self.indexer, divergence, B * S)
        return y

    def warmup(self, y, x, q, q_latent, latents, angles, documents) -> torch.Tensor:
        """The dense warm-up stage (`model.index_stage = "warmup"`): `y` (B, H/tp, T, v_head_dim), the dense
        attention's output, with the indexer's loss against the dense attention attached (KL over every visible
        key, chunk by chunk); `latents` (B, T, r + rope) this rank's latents and rotated shared keys."""
        if not self.indexer_trains():
            return y
        queries, weights, keys = self.indexer_inputs(x, q_latent, angles, None)
        query = self.absorbed_query(q.detach(), self.absorption().detach())
        latents = gather_zigzag_rows(latents.detach(), self.ctx.cp)
        B, S = q.shape[0], latents.shape[1]
        rows = dsa.query_rows(q.shape[2], self.ctx.cp, x.device)

        def every_key(part):
            return None, dsa.visible_keys(rows[part], S, documents)

        def target_of(part):
            return dsa.dense_target(query[:, :, part], latents, every_key(part)[1], self.scale, self.ctx.tp)

        divergence = dsa.indexer_divergence(queries, weights, keys, every_key, target_of, S)
        return dsa.attach_indexer_loss(y, self.indexer, divergence, B * S)

    def indexer_trains(self) -> bool:
        """Whether this forward computes the indexer's loss (`sparse_attention.indexer_trains`)."""
        return dsa.indexer_trains(self.indexer)

    def indexer_inputs(self, x, q_latent, angles, cache):
        """The indexer's (queries (B, T, H_i, D), weights (B, T, H_i), keys (B, S, D)), rotated, keys of the whole row
        (gathered over CP, or the cache's), from the detached block input x and query latent; with gradients when
        its loss is computed."""
        with torch.set_grad_enabled(self.indexer_trains()):
            keys, weights = self.indexer.keys_and_weights(x.detach())
            queries = dsa.rotate_first(self.indexer.queries(q_latent.detach()), self.rope, *angles)
            keys = dsa.rotate_first(keys, self.rope, *angles)
        if cache is not None:
            return queries, weights, cache.append_extra("index_keys", keys)
        return queries, weights, gather_zigzag_rows(keys, self.ctx.cp)

    @torch.no_grad()
    def top_k(self, queries, weights, keys, rows, documents, host_rows):
        """The indexer's choice for queries at row positions `rows` (T,) (`host_rows`: the same on the host, for the
        chunks' bounds without a device sync), in chunks: (indices int32, valid), each (B, T, min(index_topk, S));
        int32 halves what the backward keeps of the choice (k a query)."""
        B, T, heads, _ = queries.shape
        S, k = keys.shape[1], self.cfg.index_topk
        step = dsa.query_step(B, S, heads)
        chosen = []
        for i in range(0, T, step):
            part = slice(i, i + step)
            # the chunk's queries see no key past its last one: score only the keys before it (half the work of a
            # causal row on average), at least min(k, S) of them so that every chunk returns as many choices
            seen = dsa.keys_seen(host_rows, part, S, k)
            chosen.append(dsa.select_top_k(dsa.index_scores(queries[:, part], weights[:, part], keys[:, :seen]),
                                           dsa.visible_keys(rows[part], seen, documents), k))
        return torch.cat([a.int() for a, _ in chosen], dim=1), torch.cat([b for _, b in chosen], dim=1)

    def absorbed(self, q: torch.Tensor, latent: torch.Tensor, shared_key: torch.Tensor, past: int) -> torch.Tensor:
        """A cached step: q (B, H/tp, T, nope + rope) with RoPE applied, the cached latents (B, 1, S, kv_lora_rank)
        and rotated shared keys (B, 1, S, rope), S = past + T -> (B, H/tp, T, v_head_dim), kv_b absorbed into
        the query and the output (the module docstring)."""
        weight = self.absorption()  # (H/tp, nope + v, kv_lora_rank)
        query = self.absorbed_query(q, weight)
        key = torch.cat((latent, shared_key), dim=-1)
        T = q.shape[2]
        mask = None if T == 1 else causal_mask_with_past(past, T, q.device)
        mixed = F.scaled_dot_product_attention(query, key, latent, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return torch.einsum("bhtr,hvr->bhtv", mixed, weight[:, self.nope:])

    def kv_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, h) -> (normed latent (B, T, kv_lora_rank), shared RoPE key before rotation (B, T, rope))."""
        c, k_rope = self.kv_a(x).split([self.cfg.kv_lora_rank, self.rope], dim=-1)
        return self.kv_a_norm(c), k_rope

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> (cos, sin), each (T, rope) fp32, scaled by YaRN's attention factor; (B, T) ->
        (B, 1, T, rope)."""
        inv_freq, factor = rope_inverse_frequencies(self.cfg, self.cfg.qk_rope_head_dim, positions.device)
        cos, sin = angles_of(positions, inv_freq, factor)
        if self.cfg.mla_nope:  # Kimi Linear: cos 1 and sin 0 rotate by nothing, exactly
            return torch.ones_like(cos), torch.zeros_like(sin)
        return cos, sin

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: Documents | None = None) -> torch.Tensor:
        """Causal softmax(q k^T x scale) v (within each packed document) with attention dropout when training:
        q, k (B, H/tp, T, nope + rope), v (B, H/tp, T, v_head_dim) -> (B, H/tp, T, v_head_dim)."""
        record_max_logits(self, q, k, scale=self.scale, documents=documents)  # QK-clip's statistic, when tracked
        return causal_attention(q, k, v, self.ctx.cp, exchange=self.context_exchange,
                                dropout_p=self.dropout if self.training else 0.0, rng=self.ctx.rng, scale=self.scale,
                                documents=documents)
