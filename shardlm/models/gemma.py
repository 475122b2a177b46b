"""Gemma 4's text model (transformers' `gemma4`) in shardlm's tensor-parallel layers: `Gemma4`, a `Llama` whose
config has `sandwich_norms = true` (`Llama` builds this class for it).

What differs from the Llama block (docs/gemma4.md):
- the word embedding is multiplied by sqrt(hidden_size) (`embedding_scale`; the tied output layer uses the table);
- sandwich norms: x + post_attn_norm(attn(ln_1(x))), then x + post_mlp_norm(mlp(ln_2(x))), then Gemma's per-layer
  input (below), then the whole layer output times a fixed `layer_scalar` (a parameter without gradient). The norms
  scale by their weight (plain RMSNorm, initialized at 1: not Gemma 2/3's 1 + w);
- attention: q and k RMS-normalized per head (`qk_norm`), values too without a weight (`value_norm`), a softmax
  scale of 1 (`attention_scale`); sliding layers (`sliding_window`, `layer_types`) rotate with `rope_theta` over
  `head_dim`, full layers have their own head size, KV heads and base (`global_head_dim`, `global_kv_heads`,
  `global_rope_theta`) and Gemma 4's proportional RoPE (`global_rope_fraction`: the first fraction of the head's
  frequencies theta^(-2i / head_dim) rotate, the rest are 0); with `attention_k_eq_v` the full layers' values are
  the k projection's output (before k_norm and RoPE) and they have no v projection;
- KV sharing (`kv_shared_layers`): the last k layers compute no keys or values and attend to those of the last
  earlier layer of their kind (`kv_source`), handed on through the forward's `SharedKV` (KV-cached: the
  producer's whole cache); a pipeline stage hands the keys and values of its producers whose consumers run on later
  stages on to the next stage beside the hidden state (`stage_handoff`, `stage_carry`), their gradients coming back;
- per-layer inputs (`per_layer_input_size` d): a second vocabulary-parallel table (L x d wide, x sqrt(d)) plus
  RMSNorm(W_p embeddings / sqrt(h)) per layer, the two summed and divided by sqrt(2), computed with the embedding;
  layer i adds ple_norm(ple_proj(gelu(ple_gate(x)) * inputs_i)) to its output. The small gate and projection are
  replicated over TP (`ReplicatedLinear`, on the sequence chunks under SP). The first pipeline stage makes them
  with the embedding and hands the later layers' slice on from stage to stage (`stage_handoff`);
- the MLP is gated with the tanh GeLU (`activation = "gelu_tanh"`), twice as wide on KV-sharing layers with
  `kv_shared_double_mlp`; with `moe_beside_mlp` an MoE block runs beside it (`shardlm.models.gemma_moe`);
- the logits are soft-capped (`final_logit_softcap`), in the loss too: training's fused output layer and
  vocabulary-parallel cross-entropy caps each chunk of logits as it goes (`linear_cross_entropy`'s `softcap`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.errors import UserError
from shardlm.models import norms
from shardlm.models.attention import cached_attention, causal_attention
from shardlm.models.config import ModelConfig, ParallelOptions
from shardlm.models.decoder import LayerKVCache, SequenceDropout, enter_parallel_region, mark_sequence_parallel
from shardlm.models.documents import Documents, token_positions
from shardlm.models.gemma_config import FULL, SLIDING, check_gemma, kv_producers, kv_source, layer_kind, layer_shape
from shardlm.models.llama import KeyValueProjection, Llama, SwiGLU, kv_head_range
from shardlm.models.rotary import angles_of, apply_rotary
from shardlm.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
)
from shardlm.parallel.init import param_seed
from shardlm.parallel.random import recompute


def rope_frequencies(cfg: ModelConfig, index: int, device=None) -> torch.Tensor:
    """Layer `index`'s inverse frequencies (head_dim / 2,) fp32: theta^(-2i / head_dim) for the first
    fraction x head_dim / 2 of them, 0 (no rotation) for the rest; sliding layers rotate the whole head with
    rope_theta, full ones with global_rope_theta and global_rope_fraction (Gemma 4's "proportional" RoPE)."""
    full = layer_kind(cfg, index) == FULL
    head_dim = layer_shape(cfg, index).attention_head_dim
    theta = (cfg.global_rope_theta or cfg.rope_theta) if full else cfg.rope_theta
    angles = int((cfg.global_rope_fraction if full else 1.0) * head_dim // 2)
    rotated = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / head_dim)
    return torch.cat((rotated, torch.zeros(head_dim // 2 - angles, device=device)))


class SharedKV:
    """One forward's keys and values of the KV-producing layers, {layer kind: (keys, values)}, each (B, local KV
    heads, T_past + T, head_dim), and its per-layer inputs (B, T, L', d) of layers `first_layer` on (or None). An
    object, not a dict: FSDP rebuilds the containers of a layer's inputs (a dict written inside the layer would not
    reach the next one)."""

    def __init__(self, per_layer: torch.Tensor | None = None, first_layer: int = 0):
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.per_layer, self.first_layer = per_layer, first_layer

    def layer_inputs(self, index: int) -> torch.Tensor | None:
        """Layer `index`'s (B, T, d) per-layer inputs, or None without them."""
        return None if self.per_layer is None else self.per_layer[:, :, index - self.first_layer]


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)), (B, T, h) -> (B, T, h), split over TP as `SwiGLU`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)
        return self.down(F.gelu(self.gate.local(x), approximate="tanh") * self.up.local(x))


class Gemma4Attention(nn.Module):
    """Gemma 4's attention of layer `index`: (B, T, h) -> (B, T, h) (chunks under SP). Parameters `q`, `q_norm`,
    `o`, and unless the layer shares another's keys and values (`kv_source`) `k`, `k_norm` and `v` (none on a full
    layer with `attention_k_eq_v`). Query heads split over TP, KV heads split or replicated as in `LlamaAttention`."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int, sequence_parallel: bool,
                 selective_recompute: bool, context_exchange: str):
        super().__init__()
        prefix = f"layers.{index}.attn"
        shape = layer_shape(cfg, index)
        self.cfg, self.ctx, self.tp, self.index = cfg, ctx, ctx.tp, index
        self.sequence_parallel, self.selective_recompute = sequence_parallel, selective_recompute
        self.context_exchange = context_exchange
        self.kind = layer_kind(cfg, index)
        self.window = cfg.sliding_window if self.kind == SLIDING else 0
        self.source, self.stores = kv_source(cfg, index), index in kv_producers(cfg)
        self.heads, self.head_dim = cfg.num_heads // ctx.tp_size, shape.attention_head_dim
        self.scale = cfg.attention_scale or None
        self.dropout = cfg.attention_dropout_p
        width, eps = cfg.num_heads * self.head_dim, cfg.layernorm_epsilon
        self.q = ColumnParallelLinear(cfg.hidden_size, width, ctx.tp, bias=cfg.attention_bias, std=cfg.init_std,
                                      seed=param_seed(seed, f"{prefix}.q"), device=ctx.device)
        self.q_norm = norms.FP32RMSNorm(self.head_dim, eps=eps, device=ctx.device)
        self.o = RowParallelLinear(width, cfg.hidden_size, ctx.tp, bias=cfg.attention_bias,
                                   std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
                                   seed=param_seed(seed, f"{prefix}.o"), device=ctx.device,
                                   sequence_parallel=sequence_parallel)
        if self.source is None:
            self.k = KeyValueProjection(shape, ctx, param_seed(seed, f"{prefix}.k"))
            self.k_norm = norms.FP32RMSNorm(self.head_dim, eps=eps, device=ctx.device)
            shares = cfg.attention_k_eq_v and self.kind == FULL
            self.v = None if shares else KeyValueProjection(shape, ctx, param_seed(seed, f"{prefix}.v"))
        first, last = kv_head_range(cfg.num_heads, shape.kv_heads, ctx.tp_size, ctx.tp_rank)
        self.kv_heads, group = last - first, cfg.num_heads // shape.kv_heads
        reads = [(ctx.tp_rank * self.heads + j) // group - first for j in range(self.heads)]
        uniform = self.heads % self.kv_heads == 0 and reads == [j // (self.heads // self.kv_heads)
                                                                for j in range(self.heads)]
        self.kv_index = None if uniform else torch.tensor(reads, device=ctx.device)  # as LlamaAttention's

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None, documents: Documents | None = None,
                carry: SharedKV | None = None) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h); `carry`: the forward's keys and values of the KV producers by layer kind, each
        (B, local KV heads, T_past + T, head_dim), written by a producer and read by the layers that share them."""
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)
        B, T, _ = x.shape
        q = self.head_norm(self.q_norm, self.q.local(x).view(B, T, self.heads, self.head_dim)).transpose(1, 2)
        if self.source is None:
            past = 0 if cache is None else cache.length
            cos, sin = self.angles(T, past, documents, x.device)
            k, v = self.keys_values(x, cos, sin, cache)
            if self.stores:
                carry.states[self.kind] = (k, v)
        else:
            if self.kind not in carry.states:
                raise UserError(f"Gemma 4's layer {self.index} shares the keys and values of layer {self.source}, "
                                "which this forward neither ran nor received: outside training and evaluation's "
                                "pipeline schedule (RL rollouts, a distillation teacher) the stages hand on the "
                                "hidden state only; keep the two in one stage (parallel.first_stage_layers)")
            k, v = carry.states[self.kind]
            past = 0 if cache is None else k.shape[2] - T
            cos, sin = self.angles(T, past, documents, x.device)
        q = apply_rotary(q, cos, sin)
        if self.kv_index is not None:
            k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
        if past > 0:
            y = cached_attention(q, k, v, past, window=self.window, scale=self.scale)
        elif self.selective_recompute and self.training and torch.is_grad_enabled():
            y = recompute(self.core, q, k, v, documents, rng=self.ctx.rng)
        else:
            y = self.core(q, k, v, documents)
        return self.o(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))

    def angles(self, T: int, past: int, documents: Documents | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of this rank's T tokens (after `past` cached ones, or per packed document)."""
        return angles_of(token_positions(T, self.ctx.cp, past, documents, device),
                         rope_frequencies(self.cfg, self.index, device))

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cache: LayerKVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, h) past `f` -> keys (normalized, rotated) and values (normalized), each (B, local KV heads,
        T_past + T, head_dim) with the cache's earlier positions."""
        B, T, _ = x.shape
        raw = self.k(x).view(B, T, self.kv_heads, self.head_dim)
        v = raw if self.v is None else self.v(x).view(B, T, self.kv_heads, self.head_dim)
        k = apply_rotary(self.head_norm(self.k_norm, raw).transpose(1, 2), cos, sin)
        if self.cfg.value_norm:
            v = norms.rms_norm_fp32(v, None, self.cfg.layernorm_epsilon)
        v = v.transpose(1, 2)
        return (k, v) if cache is None else cache.append(k, v)

    def head_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Each head's RMSNorm, x (B, T, local heads, head_dim); the weight's gradient summed over TP (the ranks hold
        other heads)."""
        weight = copy_to_tensor_parallel(norm.weight, self.tp)
        return norms.rms_norm_fp32(x, weight, norm.eps)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: Documents | None = None) -> torch.Tensor:
        """softmax(scale q k^T) v, causal within documents and the window: q (B, heads, T, d), k and v (B, KV heads,
        T, d) -> (B, heads, T, d); the CP ring under context parallelism."""
        return causal_attention(q, k, v, self.ctx.cp, exchange=self.context_exchange, scale=self.scale,
                                dropout_p=self.dropout if self.training else 0.0, rng=self.ctx.rng,
                                documents=documents, window=self.window)


class Gemma4Block(nn.Module):
    """One Gemma 4 layer: (B, T, h) -> (B, T, h), or (B, T / tp, h) chunks under SP (module docstring)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int, sequence_parallel: bool,
                 selective_recompute: bool, options: ParallelOptions):
        super().__init__()
        self.index = index

        def norm(size: int = cfg.hidden_size) -> nn.Module:
            return norms.FP32RMSNorm(size, eps=cfg.layernorm_epsilon, device=ctx.device)

        self.ln_1, self.ln_1_post, self.ln_2, self.ln_2_post = norm(), norm(), norm(), norm()
        self.attn = Gemma4Attention(cfg, ctx, seed, index, sequence_parallel, selective_recompute,
                                    options.context_exchange)
        wide = cfg.kv_shared_double_mlp and kv_source(cfg, index) is not None
        dense = replace(cfg, ffn_hidden_size=cfg.ffn_size * (2 if wide else 1))
        self.experts_beside = cfg.moe_beside_mlp
        if cfg.moe_beside_mlp:
            from shardlm.models.gemma_moe import GemmaMoE

            self.mlp = GemmaMoE(cfg, ctx, seed, f"layers.{index}.mlp", sequence_parallel,
                                GeGLU(dense, ctx, seed, f"layers.{index}.mlp.dense", sequence_parallel),
                                options.expert_dispatcher)
        else:
            self.mlp = GeGLU(dense, ctx, seed, f"layers.{index}.mlp", sequence_parallel)
        self.ple_gate = self.ple_proj = self.ple_norm = None
        if cfg.per_layer_input_size:
            d, out_std, sp = cfg.per_layer_input_size, cfg.init_std / math.sqrt(2 * cfg.num_layers), sequence_parallel
            self.ple_gate = ReplicatedLinear((d, cfg.hidden_size), cfg.init_std,
                                             param_seed(seed, f"layers.{index}.ple_gate"), ctx.device, sp)
            self.ple_proj = ReplicatedLinear((cfg.hidden_size, d), out_std,
                                             param_seed(seed, f"layers.{index}.ple_proj"), ctx.device, sp)
            self.ple_norm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1, device=ctx.device), requires_grad=False)
        self.dropout = SequenceDropout(cfg.dropout, ctx, sequence_parallel)
        if sequence_parallel:
            for module in (self.ln_1, self.ln_1_post, self.ln_2, self.ln_2_post, self.ple_norm):
                if module is not None:
                    mark_sequence_parallel(module)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None, documents: Documents | None = None,
                carry: SharedKV | None = None, per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h); `carry` as `Gemma4Attention.forward`'s, `per_layer` this layer's (B, T, d)
        per-layer inputs (or None)."""
        carry = SharedKV() if carry is None else carry
        if self.ple_gate is not None and per_layer is None:
            raise UserError("Gemma 4's per-layer inputs reach a layer only through a whole-model forward or training "
                            "and evaluation's pipeline schedule, not a pipeline forward of RL rollouts or a "
                            "distillation teacher: run those with parallel.pipeline = 1")
        x = x + self.dropout(self.ln_1_post(self.attn(self.ln_1(x), cache, documents, carry)))
        y = self.mlp(self.ln_2(x), x) if self.experts_beside else self.mlp(self.ln_2(x))
        x = x + self.dropout(self.ln_2_post(y))
        if self.ple_gate is not None:
            x = x + self.ple_norm(self.ple_proj(F.gelu(self.ple_gate(x), approximate="tanh") * per_layer))
        return x * self.layer_scalar


class Gemma4(Llama):
    """Gemma 4's text model over a TP group (module docstring); `DecoderLM` runs it as it runs Llama. Extra
    parameters: `ple_wte` (vocabulary-parallel, vocab x L d), `ple_projection` (L d x h, replicated) and `ple_norm`
    with per-layer inputs."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int = 1234, activation_checkpointing: bool = False,
                 recompute: str | None = None, sequence_parallel: bool = False, layer_ids: list[int] | None = None,
                 options: ParallelOptions | None = None, finish_layer=None):
        check_gemma(cfg, ctx.tp_size)
        nn.Module.__init__(self)
        options = options or ParallelOptions()
        sp = self._init_run(cfg, ctx, seed, activation_checkpointing, recompute, sequence_parallel, options)
        self.wte = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, ctx.tp, vocab_size=cfg.vocab_size,
                                          std=cfg.init_std, seed=param_seed(seed, "wte"), device=ctx.device,
                                          sequence_parallel=sp)
        self.drop = SequenceDropout(cfg.dropout, ctx, sp)
        self.ple_wte = self.ple_projection = self.ple_norm = None
        if cfg.per_layer_input_size:
            width = cfg.num_layers * cfg.per_layer_input_size
            self.ple_wte = VocabParallelEmbedding(cfg.per_layer_vocab_size or cfg.vocab_size, width, ctx.tp,
                                                  std=cfg.init_std, seed=param_seed(seed, "ple_wte"),
                                                  device=ctx.device, sequence_parallel=sp)
            self.ple_projection = ReplicatedLinear((width, cfg.hidden_size), cfg.init_std,
                                                   param_seed(seed, "ple_projection"), ctx.device, sp)
            self.ple_norm = norms.FP32RMSNorm(cfg.per_layer_input_size, eps=cfg.layernorm_epsilon, device=ctx.device)
            if sp:
                mark_sequence_parallel(self.ple_norm)
        selective = self.recompute == "selective"
        from shardlm.models.decoder import finished

        self.layers = nn.ModuleDict({
            str(i): finished(Gemma4Block(cfg, ctx, seed, i, sp, selective, options), finish_layer)
            for i in (range(cfg.num_layers) if layer_ids is None else layer_ids)})
        self.ln_f = norms.FP32RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        if sp:
            mark_sequence_parallel(self.ln_f)
        self.lm_head = None
        if not cfg.tie_embeddings:
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, ctx.tp, bias=False,
                                                std=cfg.init_std, seed=param_seed(seed, "lm_head"), device=ctx.device)
            with torch.no_grad():
                first_row = ctx.tp_rank * self.lm_head.weight.shape[0]
                self.lm_head.weight[max(0, cfg.vocab_size - first_row):].zero_()
        self.FIRST_STAGE = ("wte",) + (("ple_wte", "ple_projection", "ple_norm") if cfg.per_layer_input_size else ())
        self.LAST_STAGE = ("ln_f", "wte" if cfg.tie_embeddings else "lm_head")
        self.mtp = None

    def embed(self, tokens: torch.Tensor, past: int = 0, documents: Documents | None = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, h) embeddings x sqrt(h) (`embedding_scale`), dropout; chunks under SP."""
        T = tokens.shape[1] * self.ctx.cp_size
        if past + T > self.cfg.seq_length:
            raise ValueError(f"sequence of {past + T} tokens is longer than model.seq_length={self.cfg.seq_length}")
        x = self.wte(tokens)
        if self.cfg.embedding_scale:
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        return self.drop(x)

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """(B, T) ids and their (B, T, h) embeddings (chunks under SP, as x) -> (B, T, L, d) per-layer inputs:
        (RMSNorm(ple_projection(x) / sqrt(h)) + ple_wte(tokens) x sqrt(d)) / sqrt(2); None without them."""
        if self.ple_wte is None:
            return None
        d = self.cfg.per_layer_input_size
        table = self.ple_wte(tokens)
        table = (table * torch.tensor(d ** 0.5, dtype=table.dtype)).unflatten(-1, (-1, d))
        projected = (self.ple_projection(x) * self.cfg.hidden_size ** -0.5).unflatten(-1, (-1, d))
        return (self.ple_norm(projected) + table) * 2.0 ** -0.5

    def layer_carry(self) -> SharedKV:
        """One forward's `SharedKV`: the keys and values KV-sharing layers read."""
        return SharedKV()

    def handed_kinds(self, later_layer_ids: list[int]) -> list[str]:
        """The layer kinds whose keys and values cross the stage boundary before `later_layer_ids` (the layers of
        the stages after it): those a layer there shares with a producer before it, in name order."""
        start = min(later_layer_ids, default=self.cfg.num_layers)
        sources = (kv_source(self.cfg, i) for i in later_layer_ids)
        return sorted({layer_kind(self.cfg, s) for s in sources if s is not None and s < start})

    def stage_carry(self, handed: tuple, later_layer_ids: list[int], tokens: torch.Tensor | None = None,
                    x: torch.Tensor | None = None) -> SharedKV:
        """A pipeline stage's `SharedKV` (`DecoderLM.stage_carry`): on the first stage the per-layer inputs of the
        (B, T) ids and their (B, T, h) embeddings; on a later one what the previous stage handed (`stage_handoff`):
        per kind (`handed_kinds`) keys and values, then the per-layer inputs of `later_layer_ids` (B, T, L', d)."""
        if tokens is not None:
            return SharedKV(self.per_layer_inputs(tokens, x))
        carry, handed = SharedKV(), list(handed)
        for kind in self.handed_kinds(later_layer_ids):
            carry.states[kind] = (handed.pop(0), handed.pop(0))
        if self.cfg.per_layer_input_size:
            carry.per_layer, carry.first_layer = handed.pop(0), min(later_layer_ids)
        return carry

    def stage_handoff(self, carry: SharedKV, later_layer_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """What a non-last stage sends on beside its hidden state (`DecoderLM.stage_handoff`): for each kind of
        `handed_kinds` its producer's keys and values (B, local KV heads, T, head_dim) (this stage's, or handed to
        it and passed on), then the per-layer inputs of `later_layer_ids` (B, T, L', d). Each a contiguous copy:
        PyTorch detaches a stage's outputs in place after their backward, which neither a view nor a tensor that
        the stage's own layers read (or its input) may be."""
        handed = [t for kind in self.handed_kinds(later_layer_ids) for t in carry.states[kind]]
        if carry.per_layer is not None and later_layer_ids:
            handed.append(carry.per_layer[:, :, min(later_layer_ids) - carry.first_layer:])
        return tuple(t.clone(memory_format=torch.contiguous_format) for t in handed)

    def run_layers(self, x: torch.Tensor, layers, documents: Documents | None = None,
                   carry: SharedKV | None = None) -> torch.Tensor:
        """(B, T, h) -> (B, T, h) through `layers` with one `SharedKV` (`carry`, a new one when None: the keys and
        values of KV sharing, the per-layer inputs); each layer recomputed in the backward under activation
        checkpointing."""
        carry = self.layer_carry() if carry is None else carry
        for layer in layers:
            own = carry.layer_inputs(layer.index)
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = recompute(layer, x, None, documents, carry, own, rng=self.ctx.rng)
            else:
                x = layer(x, None, documents, carry, own)
        return x

    def hidden_states(self, tokens: torch.Tensor, cache=None, documents: Documents | None = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, h) final-norm output, as `DecoderLM.hidden_states` (with a KV cache: the tokens
        continue the cached positions, the KV-sharing layers reading their producers' whole caches)."""
        if cache is not None and (self.sequence_parallel or self.ctx.cp_size > 1 or documents is not None):
            raise ValueError("the KV cache works without sequence or context parallelism and packed documents")
        x = self.embed(tokens, 0 if cache is None else cache.length, documents)
        carry = SharedKV(self.per_layer_inputs(tokens, x))
        if cache is None:
            return self.ln_f(self.run_layers(x, self.layers.values(), documents, carry))
        for layer, layer_cache in zip(self.layers.values(), cache.layers):
            x = layer(x, layer_cache, None, carry, carry.layer_inputs(layer.index))
        return self.ln_f(x)

    def output_layer(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, V_padded / tp) logits, soft-capped: cap x tanh(logits / cap)."""
        logits = super().output_layer(h)
        cap = self.cfg.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def output_softcap(self) -> tuple[float, float] | None:
        """The soft cap inside the fused output layer and loss: s tanh(z / cap) with s = cap / an RL run's
        `logit_temperature`, so the capped (B, T, V) logits and their gradients are never written whole."""
        cap = self.cfg.final_logit_softcap
        return (cap, cap / self.logit_temperature) if cap else None
