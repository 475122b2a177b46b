"""Llama-family decoder built from the tensor-parallel layers (Llama, Mistral, Qwen and OLMo share it).

Pre-norm blocks with RMSNorm, rotary position embeddings on q and k (`shardlm.models.rotary`, Hugging
Face's rotate-half layout), a SwiGLU MLP `down(silu(gate(x)) * up(x))`, no biases, grouped-query
attention (`num_kv_heads` key/value heads shared by `num_heads / num_kv_heads` query heads each) and
an output layer that is untied by default (`tie_embeddings`). Qwen3's options: `head_dim` other than
hidden_size / num_heads, and `qk_norm` (an RMSNorm over each head's q and k before RoPE). Qwen3-Next's and
Qwen3.5's: `layer_types` entries "linear_attention" build Gated DeltaNet layers (`shardlm.models.linear_attention`),
`attention_output_gate` a sigmoid gate on each attention head's output, `norm_zero_centered` RMSNorms that scale
by 1 + weight (`ZeroCenteredRMSNorm`). OLMo 2's and 3's: `norm_placement = "post"` (each block's two norms act on
the attention's and the MLP's outputs, before the residual add, instead of on their inputs) and `qk_norm_scope =
"projection"` (q_norm one RMSNorm over all heads' queries, k_norm one over all KV heads' keys; under TP its mean of
squares is all-reduced over the group, `projection_mean_square`).

Tensor parallelism follows GPT's column -> row pairs: q, k, v, gate and up are column-parallel (one
`f` on the block input serves all of them), the attention output and down projections are
row-parallel (`g`), so a layer does 2 all-reduces forward and 2 backward. Query heads are split over
the TP group. Key/value heads are split too when `num_kv_heads` is a multiple of TP; otherwise (TP
larger than the KV head count, or not a multiple of it) the k and v weights are replicated on every
TP rank, each rank computes only the KV heads its query heads read, and the weights' gradients are
summed over TP in the backward (`f` applied to the weight), so the replicas stay equal, are counted
once in the gradient norm and are saved once, like any replicated parameter (checkpoints stay
layout-free). The untied output layer is a column-parallel linear over the padded vocabulary that
feeds the vocabulary-parallel cross-entropy; training never gathers logits.

`DecoderLM` (`shardlm.models.decoder`) runs the pieces, as it runs GPT (`embed`, `run_layers`,
`head`, `output_layer`, `hidden_states`, `loss`, `forward`, `full_logits`, `new_kv_cache`): each
attention layer computes its rotary angles from its own positions (offset by its KV cache), so
pipeline stages need nothing else. Sequence parallelism and selective recomputation work as in GPT:
with `sequence_parallel` the norms, dropouts and residuals act on (B, T / tp, h) chunks, the one `f`
of each block becomes the sequence all-gather `f_sp` (RoPE then sees the whole sequence's
positions), the row-parallel layers reduce-scatter, and the output layer gathers the final norm's
chunks; `recompute="selective"` recomputes only the attention core.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.attention import cached_attention, causal_attention
from shardlm.models.config import ModelConfig, ParallelOptions
from shardlm.models.decoder import (
    DecoderLM,
    LayerKVCache,
    PreNormBlock,
    SequenceDropout,
    autocast_copies,
    enter_parallel_region,
    finished,
    mark_sequence_parallel,
)
from shardlm.models.documents import Documents, token_positions
from shardlm.models.max_logits import record_max_logits
from shardlm.models.moe import mlp_or_moe
from shardlm.models.norms import ZeroCenteredRMSNorm, check_norm_options, norm_class, projection_mean_square, rms_norm
from shardlm.models.rotary import angles_of, apply_rotary, rope_inverse_frequencies
from shardlm.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    invariant,
)
from shardlm.parallel.init import normal_shard, param_seed
from shardlm.parallel.random import recompute


def kv_heads_are_split(num_kv_heads: int, tensor_parallel: int) -> bool:
    """True when each TP rank holds its own num_kv_heads / TP key/value heads; False when replicated."""
    return num_kv_heads % tensor_parallel == 0


def kv_head_range(num_heads: int, num_kv_heads: int, tensor_parallel: int, tp_rank: int) -> tuple[int, int]:
    """[first, last) key/value heads read by the query heads of `tp_rank` (query head i reads KV head
    i // (num_heads / num_kv_heads)); ranges of different ranks are disjoint exactly when the KV heads are split."""
    local, group = num_heads // tensor_parallel, num_heads // num_kv_heads
    first_query = tp_rank * local
    return first_query // group, (first_query + local - 1) // group + 1


class KeyValueProjection(nn.Module):
    """k or v projection h -> (KV heads of this rank) x head_dim, without bias; input already past `f`.

    Split (num_kv_heads a multiple of TP): weight rows of this rank's KV heads, `tensor_parallel_dim` 0.
    Replicated: the full (num_kv_heads x head_dim, h) weight on every rank; the forward uses the rows of
    the heads this rank reads, and its gradient is all-reduced over TP in the backward.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int):
        super().__init__()
        self.tp = ctx.tp
        head_dim = cfg.attention_head_dim
        first, last = kv_head_range(cfg.num_heads, cfg.kv_heads, ctx.tp_size, ctx.tp_rank)
        self.rows = (first * head_dim, last * head_dim)
        self.split = kv_heads_are_split(cfg.kv_heads, ctx.tp_size)
        full = (cfg.kv_heads * head_dim, cfg.hidden_size)
        rows = slice(*self.rows) if self.split else slice(None)
        self.weight = nn.Parameter(normal_shard(full, cfg.init_std, seed, 0, *self.rows, device=ctx.device)
                                   if self.split else normal_shard(full, cfg.init_std, seed, device=ctx.device))
        self.bias = nn.Parameter(torch.zeros(full[0], device=ctx.device)[rows]) if cfg.attention_bias else None
        if self.split:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.tensor_parallel_dim = 0
        self.lora = None  # a low-rank adapter (`shardlm.lora`): "column" when split, "replicated rows" otherwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, h) -> (B, T, local KV heads x head_dim)."""
        if self.split:
            y = invariant.linear(x, self.weight, self.bias)
            return y if self.lora is None else y + self.lora(x)
        weight = copy_to_tensor_parallel(self.weight, self.tp)  # every rank's share of the gradient, summed
        bias = None if self.bias is None else copy_to_tensor_parallel(self.bias, self.tp)[self.rows[0]:self.rows[1]]
        y = invariant.linear(x, weight[self.rows[0]:self.rows[1]], bias)
        return y if self.lora is None else y + self.lora(x, rows=slice(*self.rows))

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated only: every KV head's rows, x (B, T, h) -> (B, T, num_kv_heads x head_dim) (a norm over the
        whole projection needs them all); the weight's gradient all-reduced over TP in the backward, as `forward`'s."""
        weight = copy_to_tensor_parallel(self.weight, self.tp)
        bias = None if self.bias is None else copy_to_tensor_parallel(self.bias, self.tp)
        y = invariant.linear(x, weight, bias)
        return y if self.lora is None else y + self.lora(x)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with RoPE; query heads split over TP. (B, T, h) -> (B, T, h).

    gpt-oss's pieces: `window` > 0 makes this a sliding-window layer; `cfg.attention_sinks` adds a learned
    sink logit per head (split over TP with the heads), `cfg.attention_output_bias` a bias on the output
    projection; YaRN (`cfg.rope_yarn_factor`) changes the rotary frequencies and scales cos and sin.
    Qwen3-Next's `cfg.attention_output_gate`: the q projection gives each head its queries and then as many gate
    channels (rows per head [q, gate], so the TP split keeps them together), and the attention output is
    multiplied by sigmoid(gate) before the output projection."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False, selective_recompute: bool = False,
                 context_exchange: str = "ring", window: int = 0):
        super().__init__()
        self.ctx, self.tp, self.cfg, self.window = ctx, ctx.tp, cfg, window
        self.sequence_parallel, self.selective_recompute = sequence_parallel, selective_recompute
        self.heads = cfg.num_heads // ctx.tp_size
        self.head_dim = cfg.attention_head_dim
        self.dropout = cfg.attention_dropout_p
        self.context_exchange = context_exchange
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        width = cfg.num_heads * self.head_dim  # hidden_size unless head_dim is set
        self.rotary_dim = int(self.head_dim * cfg.rope_fraction)  # the first channels of each head rotate
        self.gated = cfg.attention_output_gate
        self.q = ColumnParallelLinear(cfg.hidden_size, width * (2 if self.gated else 1), ctx.tp,
                                      bias=cfg.attention_bias, std=cfg.init_std,
                                      seed=param_seed(seed, f"{prefix}.q"), device=ctx.device)
        self.k = KeyValueProjection(cfg, ctx, param_seed(seed, f"{prefix}.k"))
        self.v = KeyValueProjection(cfg, ctx, param_seed(seed, f"{prefix}.v"))
        self.o = RowParallelLinear(width, cfg.hidden_size, ctx.tp, bias=cfg.attention_output_bias, std=out_std,
                                   seed=param_seed(seed, f"{prefix}.o"), device=ctx.device,
                                   sequence_parallel=sequence_parallel)
        self.q_norm = self.k_norm = None
        self.projection_norms = cfg.qk_norm and cfg.qk_norm_scope == "projection"
        if self.projection_norms:
            self.build_projection_norms(cfg)
        elif cfg.qk_norm:
            # Qwen3: RMSNorm over each head's channels of q and k, weights (head_dim,) shared by every head and
            # replicated on TP ranks, which hold different heads: their gradients are summed over TP (`f`)
            self.q_norm = norm_class(cfg)(self.head_dim, eps=cfg.layernorm_epsilon, device=ctx.device)
            self.k_norm = norm_class(cfg)(self.head_dim, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.sinks = None
        if cfg.attention_sinks:  # one logit per head, this rank's heads
            start = ctx.tp_rank * self.heads
            sinks = normal_shard((cfg.num_heads, 1), cfg.init_std, param_seed(seed, f"{prefix}.sinks"), 0, start,
                                 start + self.heads, device=ctx.device)
            self.sinks = nn.Parameter(sinks.flatten())
            self.sinks.tensor_parallel_dim = 0
        first, last = kv_head_range(cfg.num_heads, cfg.kv_heads, ctx.tp_size, ctx.tp_rank)
        self.kv_heads = last - first
        group = cfg.num_heads // cfg.kv_heads
        first_query = ctx.tp_rank * self.heads
        reads = [(first_query + j) // group - first for j in range(self.heads)]  # local KV head of each query head
        uniform = self.heads % self.kv_heads == 0 and reads == [j // (self.heads // self.kv_heads)
                                                                for j in range(self.heads)]
        # SDPA's grouped-query mode covers the usual case; otherwise (KV groups straddling ranks unevenly)
        # each query head gets a copy of its KV head. A plain attribute, not a buffer: DDP broadcasts buffers.
        self.kv_index = None if uniform else torch.tensor(reads, device=ctx.device)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """x: (B, T, h) -> (B, T, h). With `cache`, x holds the T positions after the cached ones: they are
        rotated for positions cache.length .. cache.length + T - 1 and attend to the cached keys too.
        With `documents` (packed rows), each token is rotated for its position within its document and
        attends within it.
        The cache holds only this rank's KV heads (B, kv_heads, T, head_dim), never per-query copies."""
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)  # one `f` for q, k and v
        B, T, _ = x.shape
        past = 0 if cache is None else cache.length
        x_q, x_k, x_v = autocast_copies(x, 3)  # under autocast one half copy of x for the three
        q = self.q.local(x_q)
        gate = None
        if self.gated:  # each head's rows: its queries, then its gate channels
            q, gate = q.view(B, T, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        if self.projection_norms:
            q, k = self.normed_projections(x_k, q)
        else:
            q = q.reshape(B, T, self.heads, self.head_dim)
            k = self.k(x_k).view(B, T, self.kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.head_norm(self.q_norm, q), self.head_norm(self.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x_v).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        # the tokens' original positions (this CP rank's zigzag part under context parallelism)
        inv_freq, factor = rope_inverse_frequencies(self.cfg, self.rotary_dim, x.device, sliding=self.window > 0)
        cos, sin = angles_of(token_positions(T, self.ctx.cp, past, documents, x.device), inv_freq, factor)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, kv_heads, past + T, head_dim)
        if self.kv_index is not None:
            k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
        if past > 0 and (self.window or self.sinks is not None):
            y = cached_attention(q, k, v, past, window=self.window, sinks=self.sinks)
        elif past > 0:
            y = cached_attention(q, k, v, past)
        elif self.selective_recompute and self.training and torch.is_grad_enabled():
            y = recompute(self.core, q, k, v, documents, rng=self.ctx.rng)
        else:
            y = self.core(q, k, v, documents)
        y = y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)
        if gate is not None:
            y = y * torch.sigmoid(gate.reshape(B, T, self.heads * self.head_dim))
        return self.o(y)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first `rotary_dim` channels of each head of x (B, heads, T, head_dim); the rest pass."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin)
        return torch.cat((apply_rotary(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]), dim=-1)

    def build_projection_norms(self, cfg: ModelConfig) -> None:
        """OLMo's q_norm over all query heads' channels and k_norm over all KV heads': their weights follow q's and
        k's rows, split over TP with the heads (`tensor_parallel_dim` 0: q's always, k's when its heads are split);
        a replicated k keeps the whole k_norm on every rank, its gradient summed over TP (`normed_projections`)."""
        norm, device = norm_class(cfg), self.ctx.device
        self.q_norm = norm(self.heads * self.head_dim, eps=cfg.layernorm_epsilon, device=device)
        self.q_norm.weight.tensor_parallel_dim = 0
        keys = self.k.rows[1] - self.k.rows[0] if self.k.split else cfg.kv_heads * self.head_dim
        self.k_norm = norm(keys, eps=cfg.layernorm_epsilon, device=device)
        if self.k.split:
            self.k_norm.weight.tensor_parallel_dim = 0

    def normed_projections(self, x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo's QK-norm, x (B, T, h) past `f`, q this rank's queries (B, T, heads, head_dim) or flat ->
        (q (B, T, heads, head_dim), k (B, T, local KV heads, head_dim)), each normalized over its whole projection:
        q's statistic over all ranks' heads; k's too when its heads are split, and when they are replicated every
        rank computes and normalizes all KV heads, then keeps the rows its query heads read."""
        B, T = x.shape[:2]
        q = self.projection_norm(self.q_norm, q.reshape(B, T, self.heads * self.head_dim), split=True)
        if self.k.split:
            k = self.projection_norm(self.k_norm, self.k(x), split=True)
        else:
            k = self.projection_norm(self.k_norm, self.k.full(x), split=False)[..., self.k.rows[0]:self.k.rows[1]]
        return q.view(B, T, self.heads, self.head_dim), k.view(B, T, self.kv_heads, self.head_dim)

    def projection_norm(self, norm: nn.Module, x: torch.Tensor, split: bool) -> torch.Tensor:
        """RMSNorm of x (B, T, n_local) over all channels of its projection, computed in fp32 (as transformers' OLMo):
        `split`, x and the weight are this rank's share, the mean of squares all-reduced over TP; otherwise x and the
        weight are whole on every rank, each rank's share of the weight's gradient summed over TP (`f`)."""
        x32 = x.float()
        weight = norm.weight if split else copy_to_tensor_parallel(norm.weight, self.tp)
        scale = 1.0 + weight.float() if isinstance(norm, ZeroCenteredRMSNorm) else weight.float()
        if split and self.tp.size > 1:
            y = x32 * torch.rsqrt(projection_mean_square(x32, self.tp, split) + norm.eps)
            return (y * scale).type_as(x)
        return rms_norm(x32, scale, norm.eps).type_as(x)  # the whole projection on this rank

    def head_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's channels, x (B, T, local heads, head_dim); the weight's gradient summed over TP."""
        weight = copy_to_tensor_parallel(norm.weight, self.tp)
        if isinstance(norm, ZeroCenteredRMSNorm):
            return rms_norm(x.float(), 1.0 + weight.float(), norm.eps).type_as(x)
        return rms_norm(x, weight, norm.eps)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: Documents | None = None) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v (within each packed document) with attention dropout when
        training; q (B, heads/tp, T, d),
        k and v (B, heads/tp or fewer KV heads, T, d) -> (B, heads/tp, T, d). Under context parallelism T is
        this rank's zigzag part, and only the KV heads travel around the ring (`causal_attention`)."""
        record_max_logits(self, q, k, documents=documents, window=self.window)  # QK-clip's statistic, when tracked
        return causal_attention(q, k, v, self.ctx.cp, exchange=self.context_exchange,
                                dropout_p=self.dropout if self.training else 0.0, rng=self.ctx.rng,
                                documents=documents, window=self.window, sinks=self.sinks)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), (B, T, h) -> (B, T, h): gate and up column-parallel (h -> f/tp),
    down row-parallel (f/tp -> h, all-reduced)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.sequence_parallel = ctx.tp, sequence_parallel
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, ctx.tp, bias=False, std=cfg.init_std,
                                         seed=param_seed(seed, f"{prefix}.gate"), device=ctx.device)
        self.up = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, ctx.tp, bias=False, std=cfg.init_std,
                                       seed=param_seed(seed, f"{prefix}.up"), device=ctx.device)
        self.down = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, ctx.tp, bias=False, std=out_std,
                                      seed=param_seed(seed, f"{prefix}.down"), device=ctx.device,
                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)  # one `f` for gate and up
        x_gate, x_up = autocast_copies(x, 2)  # under autocast one half copy of x for the two
        return self.down(F.silu(self.gate.local(x_gate)) * self.up.local(x_up))


class LlamaBlock(PreNormBlock):
    """x + Dropout(Attn(RMSNorm(x))), then x + Dropout(MLP(RMSNorm(x))), the attention `LlamaAttention` or
    MLA (`shardlm.models.mla`, model.attention = "mla"), the MLP a SwiGLU or an MoE layer. (B, T, h) -> (B, T, h).
    With `norm_placement = "post"` (OLMo 2 and 3) the norms act on the outputs: x + Dropout(RMSNorm(Attn(x))), then
    x + Dropout(RMSNorm(MLP(x))); `ln_1` stays the attention's norm and `ln_2` the MLP's (HF's
    post_attention_layernorm and post_feedforward_layernorm). Under sequence parallelism they act on the
    (B, T / tp, h) chunks the row-parallel projections reduce-scatter, as the pre-norms act on the block's chunks."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int,
                 sequence_parallel: bool = False, selective_recompute: bool = False,
                 options: ParallelOptions | None = None):
        options = options or ParallelOptions()
        args = (cfg, ctx, seed, f"layers.{index}.attn", sequence_parallel, selective_recompute,
                options.context_exchange)
        if cfg.is_linear_layer(index):  # Gated DeltaNet (Qwen3-Next, Qwen3.5) or Kimi Delta Attention (Kimi Linear)
            from shardlm.models.kimi_delta import linear_layer
            attention = linear_layer(*args[:-1])
        elif cfg.attention == "mla":  # DeepSeek-V3's multi-head latent attention (Kimi Linear's: without RoPE)
            from shardlm.models.mla import LatentAttention
            attention = LatentAttention(*args, layer=index)
        else:
            attention = LlamaAttention(*args, window=cfg.sliding_window if cfg.is_sliding_layer(index) else 0)
        super().__init__(norm_class(cfg), attention,
                         mlp_or_moe(SwiGLU, cfg, ctx, seed, index, sequence_parallel, gated=True,
                                    dispatcher=options.expert_dispatcher),
                         cfg, ctx, sequence_parallel)
        self.post_norm = cfg.norm_placement == "post"

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None,
                documents: Documents | None = None, carry: dict | None = None) -> torch.Tensor:
        """(B, T, h) -> (B, T, h) (chunks under sequence parallelism); `carry` as `PreNormBlock.forward`'s."""
        if not self.post_norm:
            return super().forward(x, cache, documents, carry)
        extra = () if carry is None else (carry,)
        x = x + self.dropout(self.ln_1(self.attn(x, cache, documents, *extra)))
        return x + self.dropout(self.ln_2(self.mlp(x)))


class Llama(DecoderLM):
    """Llama-family causal language model over a TP group; `DecoderLM` runs it, as it runs GPT.

    tokens: (B, T) int64. `forward(tokens)` returns this rank's vocabulary slice of the logits,
    (B, T, V_padded / tp); `forward(tokens, targets)` returns per-token fp32 losses (B, T) through the
    vocabulary-parallel cross-entropy. With `cache=model.new_kv_cache()`, tokens continue the cached positions.
    """

    FIRST_STAGE = ("wte",)  # what the first pipeline stage keeps besides its layers

    def __new__(cls, cfg: ModelConfig, *args, **kwargs):
        """Gemma 4's block (`sandwich_norms`) builds `shardlm.models.gemma.Gemma4`, a Llama."""
        if cls is Llama and cfg.sandwich_norms:
            from shardlm.models.gemma import Gemma4
            cls = Gemma4
        if cls is Llama and cfg.hc_mult:  # DeepSeek-V4's hyper-connection streams
            from shardlm.models.deepseek_v4 import DeepseekV4
            cls = DeepseekV4
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int = 1234,
                 activation_checkpointing: bool = False, recompute: str | None = None,
                 sequence_parallel: bool = False, layer_ids: list[int] | None = None,
                 options: ParallelOptions | None = None, finish_layer=None):
        super().__init__()
        options = options or ParallelOptions()
        check_norm_options(cfg)
        sp = self._init_run(cfg, ctx, seed, activation_checkpointing, recompute, sequence_parallel, options)
        self.wte = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, ctx.tp,
                                          vocab_size=cfg.vocab_size, std=cfg.init_std,
                                          seed=param_seed(seed, "wte"), device=ctx.device, sequence_parallel=sp)
        self.drop = SequenceDropout(cfg.dropout, ctx, sp)
        selective = self.recompute == "selective"
        block = LlamaBlock
        if cfg.layer_pattern:  # Nemotron-H: one mixer a block (Mamba-2, attention or MLP)
            from shardlm.models.mamba import HybridBlock as block
        self.layers = nn.ModuleDict({
            str(i): finished(block(cfg, ctx, seed, i, sp, selective, options), finish_layer)
            for i in (range(cfg.num_layers) if layer_ids is None else layer_ids)})
        self.ln_f = norm_class(cfg)(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        if sp:
            mark_sequence_parallel(self.ln_f)
        self.lm_head = None
        if not cfg.tie_embeddings:
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, ctx.tp, bias=False,
                                                std=cfg.init_std, seed=param_seed(seed, "lm_head"), device=ctx.device)
            with torch.no_grad():  # rows of the vocabulary padding start at zero, as the embedding's do
                first_row = ctx.tp_rank * self.lm_head.weight.shape[0]
                self.lm_head.weight[max(0, cfg.vocab_size - first_row):].zero_()
        # what the last pipeline stage keeps besides its layers: with multi-token prediction also the depths
        # and a copy of `wte` for their rolled tokens (summed with the first stage's as a tied embedding)
        last = ("ln_f", "wte" if cfg.tie_embeddings else "lm_head") + (("wte", "mtp") if cfg.mtp_layers else ())
        self.LAST_STAGE = tuple(dict.fromkeys(last))
        self.mtp = None
        if cfg.mtp_layers:  # DeepSeek-V3's multi-token prediction depths (`shardlm.models.mtp`)
            from shardlm.models.mtp import MTPLayer

            self.mtp = nn.ModuleList(
                MTPLayer(cfg, ctx, seed, k, finished(LlamaBlock(cfg, ctx, seed, cfg.num_layers + k, sp, False, options),
                                                     finish_layer), norm_class(cfg), sp) for k in range(cfg.mtp_layers))

    @property
    def output_weight(self) -> torch.Tensor:
        """The column-parallel `lm_head`, or the embedding when tied."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, tokens: torch.Tensor, past: int = 0, documents: Documents | None = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, h) token embeddings and dropout (positions, also packed documents' own, enter
        in the attention, as RoPE); under sequence parallelism this rank's chunk (B, T / tp, h)."""
        T = tokens.shape[1] * self.ctx.cp_size  # under context parallelism, this rank's part of T x C tokens
        if past + T > self.cfg.seq_length:
            raise ValueError(f"sequence of {past + T} tokens is longer than model.seq_length={self.cfg.seq_length}")
        return self.drop(self.wte(tokens))
