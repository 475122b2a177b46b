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

How the pieces run (embed, layers, final norm, output layer, loss, the KV cache) is `DecoderLM`'s
(`shardlm.models.decoder`), shared with Llama. For generation, `hidden_states` and `forward` accept an
optional `KVCache`: every layer keeps the
keys and values of the positions already processed, so a new token costs one forward over one
position (its position embedding is offset by the number of cached positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.data.zigzag import local_positions
from shardlm.models.attention import cached_attention, causal_attention
from shardlm.models.config import ModelConfig, ParallelOptions
from shardlm.models.decoder import (  # noqa: F401  (KVCache, LayerKVCache: re-exported for callers)
    DecoderLM,
    KVCache,
    LayerKVCache,
    PreNormBlock,
    SequenceDropout,
    causal_mask_with_past,
    finished,
    mark_sequence_parallel,
)
from shardlm.models.documents import Documents
from shardlm.models.max_logits import record_max_logits
from shardlm.models.moe import mlp_or_moe
from shardlm.parallel import ColumnParallelLinear, ParallelContext, RowParallelLinear, VocabParallelEmbedding
from shardlm.parallel.init import normal_shard, param_seed
from shardlm.parallel.random import recompute


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over the TP group. x: (B, T, h) -> (B, T, h), or
    (B, T / tp, h) sequence chunks under sequence parallelism."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str,
                 sequence_parallel: bool = False, selective_recompute: bool = False,
                 context_exchange: str = "ring"):
        super().__init__()
        self.ctx = ctx
        self.selective_recompute = selective_recompute
        self.heads = cfg.num_heads // ctx.tp_size
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.dropout = cfg.attention_dropout_p
        self.context_exchange = context_exchange
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, ctx.tp, std=cfg.init_std,
                                        seed=param_seed(seed, f"{prefix}.qkv"), device=ctx.device,
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, ctx.tp, std=out_std,
                                      seed=param_seed(seed, f"{prefix}.proj"), device=ctx.device,
                                      sequence_parallel=sequence_parallel)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: Documents | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal (within each document of packed rows), with attention dropout
        when training. Each (B, heads/tp, T, d). Under context parallelism T is this rank's zigzag part
        (`causal_attention`)."""
        record_max_logits(self, q, k, documents=documents)  # QK-clip's statistic, when tracked
        return causal_attention(q, k, v, self.ctx.cp, exchange=self.context_exchange,
                                dropout_p=self.dropout if self.training else 0.0, rng=self.ctx.rng,
                                documents=documents)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
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
            y = cached_attention(q, k, v, past)
            return self.proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        if cache is not None:
            cache.append(k, v)
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            y = recompute(self.core, q, k, v, documents, rng=self.ctx.rng)
        else:
            y = self.core(q, k, v, documents)
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


class TransformerBlock(PreNormBlock):
    """Pre-LN block: x + Dropout(Attn(LN(x))), then x + Dropout(MLP(LN(x))). (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int,
                 sequence_parallel: bool = False, selective_recompute: bool = False,
                 options: ParallelOptions | None = None):
        options = options or ParallelOptions()
        super().__init__(nn.LayerNorm,
                         ParallelAttention(cfg, ctx, seed, f"layers.{index}.attn", sequence_parallel,
                                           selective_recompute, options.context_exchange),
                         mlp_or_moe(ParallelMLP, cfg, ctx, seed, index, sequence_parallel, gated=False,
                                    dispatcher=options.expert_dispatcher),
                         cfg, ctx, sequence_parallel)


class GPT(DecoderLM):
    """GPT-2 language model over a TP group (`DecoderLM` documents the inputs and outputs).
    `layer_ids` builds only those layers (a pipeline stage's; they keep their indices as names)."""

    # What the first and the last pipeline stage keep besides their layers (`shardlm.parallel.pipeline`).
    FIRST_STAGE = ("wte", "wpe")
    LAST_STAGE = ("ln_f", "wte")

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int = 1234,
                 activation_checkpointing: bool = False, recompute: str | None = None,
                 sequence_parallel: bool = False, layer_ids: list[int] | None = None,
                 options: ParallelOptions | None = None, finish_layer=None):
        super().__init__()
        options = options or ParallelOptions()
        sp = self._init_run(cfg, ctx, seed, activation_checkpointing, recompute, sequence_parallel, options)
        self.wte = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, ctx.tp,
                                          vocab_size=cfg.vocab_size, std=cfg.init_std,
                                          seed=param_seed(seed, "wte"), device=ctx.device, sequence_parallel=sp)
        self.wpe = nn.Parameter(normal_shard((cfg.seq_length, cfg.hidden_size), cfg.init_std,
                                             param_seed(seed, "wpe"), device=ctx.device))
        self.drop = SequenceDropout(cfg.dropout, ctx, sp)
        selective = self.recompute == "selective"
        self.layers = nn.ModuleDict({
            str(i): finished(TransformerBlock(cfg, ctx, seed, i, sp, selective, options), finish_layer)
            for i in (range(cfg.num_layers) if layer_ids is None else layer_ids)})
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        if sp:  # position rows and the final LayerNorm act on sequence chunks
            self.wpe.sequence_parallel = True
            mark_sequence_parallel(self.ln_f)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer is tied to the input embedding."""
        return self.wte.weight

    def embed(self, tokens: torch.Tensor, past: int = 0, documents: Documents | None = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, h): token + position embeddings (positions past .. past + T - 1), dropout.
        Under sequence parallelism: this rank's chunk (B, T / tp, h). Under context parallelism the tokens
        are this CP rank's zigzag part of T x C and take their original positions (`local_positions`).
        With `documents`, each token's position within its document (`documents.positions`, (B, T))."""
        T = tokens.shape[1]
        if past + T * self.ctx.cp_size > self.cfg.seq_length:
            raise ValueError(f"sequence of {past + T * self.ctx.cp_size} tokens is longer than "
                             f"model.seq_length={self.cfg.seq_length}")
        if documents is not None:
            positions = self.wpe[documents.positions]  # (B, T, h)
        elif self.ctx.cp_size == 1:
            positions = self.wpe[past:past + T]
        else:
            positions = self.wpe[local_positions(T, self.ctx.cp, past, tokens.device)]
        if self.sequence_parallel:
            positions = positions.chunk(self.ctx.tp_size, dim=positions.dim() - 2)[self.ctx.tp_rank]
        return self.drop(self.wte(tokens) + positions)
