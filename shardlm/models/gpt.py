"""GPT-2 built from the tensor-parallel layers.

Pre-LayerNorm blocks, exact-erf GeLU MLP of width 4h, learned positions, a final LayerNorm, and an
output layer tied to the vocabulary-parallel input embedding. Attention heads are split over the TP
group: each rank runs SDPA on its heads with one fused QKV GEMM. The full (TP=1) QKV weight is laid
out head by head, `(heads, 3, head_dim)` rows, so that a contiguous split over ranks gives each rank
the q, k and v of its own heads.

The model receives the `ParallelContext`; it never builds groups or reads globals. Communication per
transformer layer: 2 all-reduces forward (attention and MLP outputs, `g`) and 2 backward (their
inputs, `f`). Outside the layers: the embedding's all-reduce forward, the LM head's all-reduce
backward, and the cross-entropy's MAX and SUM all-reduces forward.

With sequence parallelism (`sequence_parallel=True`, TP > 1), the activations between the column ->
row pairs are (B, T / tp, h) sequence chunks: the embedding reduce-scatters, each column layer
all-gathers its input and each row layer reduce-scatters its output, and the output layer gathers
the final LayerNorm's chunks. Dropout on chunks draws from the model-parallel generator (each rank
holds other tokens). `recompute="selective"` recomputes only the attention core softmax(QK^T)V in
the backward (the part that grows with T^2); `"full"` recomputes whole layers.

For generation, `hidden_states` and `forward` accept an optional `KVCache`: every layer keeps the
keys and values of the positions already processed, so a new token costs one forward over one
position (its position embedding is offset by the number of cached positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardlm.models.config import ModelConfig
from shardlm.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from shardlm.parallel.cross_entropy import linear_cross_entropy
from shardlm.parallel.init import normal_shard, param_seed


class LayerKVCache:
    """One layer's keys and values of the positions processed so far, each (B, heads/tp, T_past, head_dim).

    Storage is allocated on the first `append` for `capacity` positions, so appending a token copies
    only that token's keys and values.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, heads/tp, T_new, head_dim); return all cached keys and values, T_past + T_new."""
        B, H, T, D = k.shape
        if self.keys is None:
            self.keys = k.new_empty(B, H, self.capacity, D)
            self.values = v.new_empty(B, H, self.capacity, D)
        if self.length + T > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {self.length} + {T}")
        self.keys[:, :, self.length:self.length + T] = k
        self.values[:, :, self.length:self.length + T] = v
        self.length += T
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]


class KVCache:
    """Keys and values of every layer for incremental decoding (`GPT.new_kv_cache()` makes one).

    `length` is the number of positions already processed; the next tokens given to the model take
    positions `length, length + 1, ...`. Each TP rank caches only its own heads.
    """

    def __init__(self, num_layers: int, capacity: int):
        self.layers = [LayerKVCache(capacity) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


def causal_mask_with_past(past: int, new: int, device) -> torch.Tensor:
    """(new, past + new) bool mask: query i (at position past + i) sees keys 0 .. past + i."""
    keys = torch.arange(past + new, device=device)
    queries = torch.arange(past, past + new, device=device)
    return keys.unsqueeze(0) <= queries.unsqueeze(1)


def mark_sequence_parallel(module: nn.Module) -> None:
    """Mark the parameters of a module applied to sequence chunks (a LayerNorm): their gradients are
    partial sums over the TP group, which the trainer adds up (`sum_sequence_parallel_gradients`)."""
    for param in module.parameters():
        param.sequence_parallel = True


class SequenceDropout(nn.Dropout):
    """Dropout that draws from the model-parallel generator when activations are sequence chunks (each
    TP rank holds other tokens, so their masks must differ); the default generator otherwise."""

    def __init__(self, p: float, ctx: ParallelContext, sequence_parallel: bool):
        super().__init__(p)
        self.ctx, self.sequence_parallel = ctx, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.training and self.p > 0:
            with self.ctx.rng.fork():
                return super().forward(x)
        return super().forward(x)


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over the TP group. x: (B, T, h) -> (B, T, h), or
    (B, T / tp, h) sequence chunks under sequence parallelism."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False, selective_recompute: bool = False):
        super().__init__()
        self.ctx = ctx
        self.selective_recompute = selective_recompute
        self.heads = cfg.num_heads // ctx.tp_size
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.dropout = cfg.attention_dropout_p
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, ctx.tp, std=cfg.init_std,
                                        seed=param_seed(seed, f"{prefix}.qkv"), device=ctx.device,
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, ctx.tp, std=out_std,
                                      seed=param_seed(seed, f"{prefix}.proj"), device=ctx.device,
                                      sequence_parallel=sequence_parallel)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal, with attention dropout when training. Each (B, heads/tp, T, d)."""
        if self.training and self.dropout > 0:
            with self.ctx.rng.fork():  # heads differ per rank, so must their dropout masks
                return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        """x: (B, T, h) -> (B, T, h). With `cache`, x holds the T positions after the cached ones,
        which attend to the cached keys and values as well (and are appended to the cache)."""
        qkv = self.qkv(x)  # (B, T, 3h/tp): under sequence parallelism the chunks are gathered here
        B, T, _ = qkv.shape
        qkv = qkv.view(B, T, self.heads, 3, self.head_dim)
        # each (B, heads/tp, T, head_dim); split's backward writes the three gradients into one
        # contiguous (B, T, heads/tp, 3, head_dim) tensor (unbind's would stack them, then copy again)
        q, k, v = (part.squeeze(3).transpose(1, 2) for part in qkv.split(1, dim=3))
        if cache is not None and cache.length > 0:
            past = cache.length
            k, v = cache.append(k, v)  # (B, heads/tp, past + T, head_dim)
            mask = None if T == 1 else causal_mask_with_past(past, T, x.device)  # one query sees all
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        if cache is not None:
            cache.append(k, v)
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, use_reentrant=False, context_fn=self.ctx.rng.checkpoint_context_fn)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)  # (B, T, h/tp)
        return self.proj(y)


class ParallelMLP(nn.Module):
    """h -> 4h (column-parallel) -> GeLU -> h (row-parallel). x: (B, T, h) -> (B, T, h) (or chunks)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.fc = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, ctx.tp, std=cfg.init_std,
                                       seed=param_seed(seed, f"{prefix}.fc"), device=ctx.device,
                                       sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, ctx.tp, std=out_std,
                                      seed=param_seed(seed, f"{prefix}.proj"), device=ctx.device,
                                      sequence_parallel=sequence_parallel)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class TransformerBlock(nn.Module):
    """Pre-LN block: x + Dropout(Attn(LN(x))), then x + Dropout(MLP(LN(x))). (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int,
                 sequence_parallel: bool = False, selective_recompute: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.attn = ParallelAttention(cfg, ctx, seed, f"layers.{index}.attn", sequence_parallel, selective_recompute)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.mlp = ParallelMLP(cfg, ctx, seed, f"layers.{index}.mlp", sequence_parallel)
        self.dropout = SequenceDropout(cfg.dropout, ctx, sequence_parallel)
        if sequence_parallel:
            mark_sequence_parallel(self.ln_1)
            mark_sequence_parallel(self.ln_2)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x), cache))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """GPT-2 language model over a TP group.

    tokens: (B, T) int64. `forward(tokens)` returns this rank's vocabulary slice of the logits,
    (B, T, V_padded / tp); `forward(tokens, targets)` returns per-token fp32 losses (B, T) through
    the vocabulary-parallel cross-entropy (targets equal to `ignore_index` give 0; at TP=1 the output
    layer and the loss are one function, `linear_cross_entropy`, that never copies the logits). With
    `cache=model.new_kv_cache()`, tokens continue the cached positions (incremental decoding).
    `layer_ids` builds only those layers (a pipeline stage's; they keep their indices as names).
    """

    # What the first and the last pipeline stage keep besides their layers (`shardlm.parallel.pipeline`).
    FIRST_STAGE = ("wte", "wpe")
    LAST_STAGE = ("ln_f", "wte")

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int = 1234,
                 activation_checkpointing: bool = False, recompute: str | None = None,
                 sequence_parallel: bool = False, layer_ids: list[int] | None = None):
        super().__init__()
        if ctx.rng is None:
            ctx.seed(seed)
        self.cfg, self.ctx = cfg, ctx
        self.recompute = recompute or ("full" if activation_checkpointing else "none")
        self.activation_checkpointing = self.recompute == "full"
        self.sequence_parallel = sp = sequence_parallel and ctx.tp_size > 1
        self.padded_vocab_size = cfg.padded_vocab_size(ctx.tp_size)
        self.wte = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, ctx.tp,
                                          vocab_size=cfg.vocab_size, std=cfg.init_std,
                                          seed=param_seed(seed, "wte"), device=ctx.device, sequence_parallel=sp)
        self.wpe = nn.Parameter(normal_shard((cfg.seq_length, cfg.hidden_size), cfg.init_std,
                                             param_seed(seed, "wpe"), device=ctx.device))
        self.drop = SequenceDropout(cfg.dropout, ctx, sp)
        # A dict keyed "0".."l-1" (parameter names as a ModuleList gives them), so that a pipeline stage can
        # drop the layers it does not own and keep the names of the unsplit model.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, ctx, seed, i, sp, self.recompute == "selective")
                                     for i in (range(cfg.num_layers) if layer_ids is None else layer_ids)})
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        if sp:  # position rows and the final LayerNorm act on sequence chunks
            self.wpe.sequence_parallel = True
            mark_sequence_parallel(self.ln_f)

    def new_kv_cache(self, capacity: int | None = None) -> KVCache:
        """An empty key/value cache for up to `capacity` positions (default model.seq_length)."""
        return KVCache(self.cfg.num_layers, capacity or self.cfg.seq_length)

    def embed(self, tokens: torch.Tensor, past: int = 0) -> torch.Tensor:
        """(B, T) ids -> (B, T, h): token + position embeddings (positions past .. past + T - 1), dropout.
        Under sequence parallelism: this rank's chunk (B, T / tp, h)."""
        T = tokens.shape[1]
        if past + T > self.cfg.seq_length:
            raise ValueError(f"sequence of {past + T} tokens is longer than model.seq_length={self.cfg.seq_length}")
        positions = self.wpe[past:past + T]
        if self.sequence_parallel:
            positions = positions.chunk(self.ctx.tp_size)[self.ctx.tp_rank]
        return self.drop(self.wte(tokens) + positions)

    def run_layers(self, x: torch.Tensor, layers) -> torch.Tensor:
        """(B, T, h) -> (B, T, h) through `layers` in order, each checkpointed when activation
        checkpointing is on (and gradients are being recorded)."""
        for layer in layers:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False, context_fn=self.ctx.rng.checkpoint_context_fn)
            else:
                x = layer(x)
        return x

    def output_layer(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, h) final-LayerNorm output -> (B, T, V_padded / tp) this rank's logits, through the output
        layer tied to the embedding (its input gradient is all-reduced over TP, `f`; sequence chunks are
        all-gathered first under sequence parallelism, `f_sp`)."""
        if self.sequence_parallel:
            return F.linear(gather_from_sequence_parallel(h, self.ctx.tp), self.wte.weight)
        return F.linear(copy_to_tensor_parallel(h, self.ctx.tp), self.wte.weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) last layer output -> (B, T, V_padded / tp) logits: final LayerNorm and output layer."""
        return self.output_layer(self.ln_f(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Per-token fp32 losses (B, T) of vocabulary-parallel logits; `ignore_index` targets give 0."""
        return vocab_parallel_cross_entropy(logits, targets, self.ctx.tp, vocab_size=self.cfg.vocab_size,
                                            ignore_index=ignore_index)

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, h) final-LayerNorm output, replicated over the TP group.
        With `cache`, the tokens take positions cache.length .. cache.length + T - 1 and are cached."""
        if cache is not None and self.sequence_parallel:
            raise ValueError("the KV cache works without sequence parallelism; build the model for generation "
                             "with sequence_parallel=False")
        x = self.embed(tokens, 0 if cache is None else cache.length)
        if cache is None:
            return self.ln_f(self.run_layers(x, self.layers.values()))
        for layer, layer_cache in zip(self.layers.values(), cache.layers):
            x = layer(x, layer_cache)
        return self.ln_f(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                ignore_index: int = -100, cache: KVCache | None = None) -> torch.Tensor:
        hidden = self.hidden_states(tokens, cache)
        if targets is not None and self.ctx.tp_size == 1:  # the whole vocabulary here: the fused head and loss
            return linear_cross_entropy(hidden, self.wte.weight, targets, self.cfg.vocab_size, ignore_index)
        logits = self.output_layer(hidden)
        return logits if targets is None else self.loss(logits, targets, ignore_index)

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """(..., V_padded / tp) -> (..., vocab_size): gather the slices and drop the padding.
        For evaluation and generation only; training never gathers logits."""
        return gather_from_tensor_parallel(local_logits, self.ctx.tp)[..., : self.cfg.vocab_size]

    def num_parameters(self) -> int:
        """Parameters of the whole model (summing the TP shards of split weights), padding included."""
        sharded = sum(p.numel() for p in self.parameters() if hasattr(p, "tensor_parallel_dim"))
        replicated = sum(p.numel() for p in self.parameters() if not hasattr(p, "tensor_parallel_dim"))
        return sharded * self.ctx.tp_size + replicated
