"""What GPT and Llama share: a decoder-only language model run as embed -> layers -> final norm ->
output layer -> loss, plus the key/value cache and the sequence-parallel helpers of their blocks.

`DecoderLM` holds the run of the pieces; a model class builds `wte` (the vocabulary-parallel
embedding), `layers` (a ModuleDict keyed "0".."l-1", so a pipeline stage keeps only its layers under
the unsplit names), `ln_f`, and defines `embed(tokens, past)` and `output_weight` (the tied embedding
or an untied output layer). Every method talks only to the tensor-parallel group of `ctx`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardlm.models.config import ModelConfig, ParallelOptions
from shardlm.models.documents import Documents
from shardlm.parallel import (
    ParallelContext,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    invariant,
    vocab_parallel_cross_entropy,
)
from shardlm.parallel.entropy import vocab_parallel_entropy, vocab_parallel_log_sum_sq_probs
from shardlm.parallel.linear_cross_entropy import linear_cross_entropy
from shardlm.parallel.random import recompute


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
        self.extras: dict[str, torch.Tensor] = {}

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, heads/tp, T_new, head_dim); return all cached keys and values, T_past + T_new."""
        B, H, T, D = k.shape
        if self.keys is None:  # values may have their own head size (MLA's v_head_dim)
            self.keys = k.new_empty(B, H, self.capacity, D)
            self.values = v.new_empty(B, H, self.capacity, v.shape[-1])
        if self.length + T > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {self.length} + {T}")
        self.keys[:, :, self.length:self.length + T] = k
        self.values[:, :, self.length:self.length + T] = v
        self.length += T
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    def append_extra(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """After `append`: store x (B, T_new, n), the same positions' entry of another stream (sparse attention's
        indexer keys); return the stream's cached (B, T_past + T_new, n)."""
        if name not in self.extras:
            self.extras[name] = x.new_empty(x.shape[0], self.capacity, x.shape[-1])
        self.extras[name][:, self.length - x.shape[1]:self.length] = x
        return self.extras[name][:, :self.length]


class LayerStateCache:
    """What decoding keeps of one linear-attention layer: the recurrent state (B, H_v / tp, d_k, d_v), the
    convolution's last kernel - 1 inputs (B, K - 1, channels / tp), and how many positions it has seen."""

    def __init__(self):
        self.length = 0
        self.state: torch.Tensor | None = None
        self.conv: torch.Tensor | None = None


class KVCache:
    """Keys and values of every layer for incremental decoding (`GPT.new_kv_cache()` makes one); a
    linear-attention layer's (`linear`: their indices) recurrent state instead.

    `length` is the number of positions already processed; the next tokens given to the model take
    positions `length, length + 1, ...`. Each TP rank caches only its own heads.
    """

    def __init__(self, num_layers: int, capacity: int, linear: tuple[int, ...] = ()):
        self.layers = [LayerStateCache() if i in linear else LayerKVCache(capacity) for i in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


def causal_mask_with_past(past: int, new: int, device) -> torch.Tensor:
    """(new, past + new) bool mask: query i (at position past + i) sees keys 0 .. past + i."""
    keys = torch.arange(past + new, device=device)
    queries = torch.arange(past, past + new, device=device)
    return keys.unsqueeze(0) <= queries.unsqueeze(1)


def finished(layer: nn.Module, finish_layer=None) -> nn.Module:
    """`layer`, after `finish_layer(layer)` when given (`shardlm.models.build_model`'s per-layer step)."""
    if finish_layer is not None:
        finish_layer(layer)
    return layer


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


def enter_parallel_region(x: torch.Tensor, tp, sequence_parallel: bool) -> torch.Tensor:
    """The one `f` in front of column-parallel layers: identity forward and all-reduce backward, or under
    sequence parallelism `f_sp`, (B, T / tp, h) chunks all-gathered to (B, T, h) (reduce-scattered back)."""
    return gather_from_sequence_parallel(x, tp) if sequence_parallel else copy_to_tensor_parallel(x, tp)


class _SharedCast(torch.autograd.Function):
    """One GEMM's input: the autocast copy `autocast_copies` made once (a view of it), its gradient cast back to the
    input's dtype, as autocast's own cast of the input for that GEMM would give it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def autocast_copies(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """x as the input of n GEMMs (q, k and v; gate and up): under autocast one copy of it in the autocast dtype,
    made once and handed to each GEMM through a node of its own, whose backward casts that GEMM's input gradient
    back to x's dtype, where the n are summed: the forward and backward of autocast casting x for each GEMM, with
    one copy kept for the backward instead of n. Without autocast, or for an x already in its dtype, x n times."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or x.dtype == torch.get_autocast_dtype(device):
        return [x] * n
    copy = x.detach().to(torch.get_autocast_dtype(device))
    if not (torch.is_grad_enabled() and x.requires_grad):
        return [copy] * n
    return [_SharedCast.apply(x, copy) for _ in range(n)]


class PreNormBlock(nn.Module):
    """x + Dropout(attn(ln_1(x))), then x + Dropout(mlp(ln_2(x))). (B, T, h) -> (B, T, h), or (B, T / tp, h)
    chunks under sequence parallelism (the norms are then marked `sequence_parallel`). A model's block
    class passes its norm type and its attention and MLP modules."""

    def __init__(self, norm: type[nn.Module], attn: nn.Module, mlp: nn.Module, cfg: ModelConfig,
                 ctx: ParallelContext, sequence_parallel: bool):
        super().__init__()
        self.ln_1 = norm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.attn = attn
        self.ln_2 = norm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.mlp = mlp
        self.dropout = SequenceDropout(cfg.dropout, ctx, sequence_parallel)
        if sequence_parallel:
            mark_sequence_parallel(self.ln_1)
            mark_sequence_parallel(self.ln_2)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None,
                documents: Documents | None = None, carry: dict | None = None) -> torch.Tensor:
        """`carry`: what a forward's layers hand on to later ones (sparse attention's shared choice)."""
        extra = () if carry is None else (carry,)
        x = x + self.dropout(self.attn(self.ln_1(x), cache, documents, *extra))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class DecoderLM(nn.Module):
    """A causal LM over a TP group. tokens: (B, T) int64. `forward(tokens)` returns this rank's vocabulary
    slice of the logits, (B, T, V_padded / tp); `forward(tokens, targets)` returns per-token fp32 losses
    (B, T) through the vocabulary-parallel cross-entropy (targets equal to `ignore_index` give 0; the
    output layer and the loss are one function, `linear_cross_entropy`, that never copies or gathers the
    logits). With `cache=model.new_kv_cache()`, tokens continue the cached positions."""

    def _init_run(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, activation_checkpointing: bool,
                  recompute: str | None, sequence_parallel: bool, options: ParallelOptions) -> bool:
        """Seed `ctx` when it has no generators yet and record the run settings; returns whether sequence
        parallelism is on (it needs TP > 1)."""
        if ctx.rng is None:
            ctx.seed(seed)
        self.cfg, self.ctx = cfg, ctx
        self.recompute = recompute or ("full" if activation_checkpointing else "none")
        self.activation_checkpointing = self.recompute == "full"
        self.sequence_parallel = sequence_parallel and ctx.tp_size > 1
        self.padded_vocab_size = cfg.padded_vocab_size(ctx.tp_size)
        self.logit_temperature = 1.0  # an RL run's log-probabilities are those of logits / temperature, as TRL's
        self.entropies: list | None = None  # when a list, `output_loss` appends each call's token entropies
        self.entropy_gradient = False  # whether those entropies carry a gradient (an RL run's entropy bonus)
        self.log_sum_sq: list | None = None  # when a list, `output_loss` appends each call's log sum p^2 (WPO)
        self.lm_head_fp32 = options.lm_head_fp32  # the output layer in fp32 under autocast (`fp32_head`)
        return self.sequence_parallel

    @property
    def output_weight(self) -> torch.Tensor:
        """(V_padded / tp, h) weight of the output layer."""
        raise NotImplementedError

    def new_kv_cache(self, capacity: int | None = None) -> KVCache:
        """An empty key/value cache for up to `capacity` positions (default model.seq_length)."""
        linear = tuple(i for i in range(self.cfg.num_layers) if self.cfg.is_linear_layer(i))
        return KVCache(self.cfg.num_layers, capacity or self.cfg.seq_length, linear)

    def layer_carry(self):
        """What one forward's layers hand on to later ones, each layer's argument after its documents (None: no
        argument): sparse attention's shared choice (GLM-5), a dict; Gemma 4 overrides it (shared keys and values)."""
        return {} if self.cfg.index_layer_types else None

    def stage_carry(self, handed: tuple, later_layer_ids: list[int], tokens: torch.Tensor | None = None,
                    x: torch.Tensor | None = None):
        """What a pipeline stage's layers start from beside the hidden state (`run_layers`' carry, its fourth
        argument; None: none is passed): on the first stage from its (B, T) ids and their (B, T, h) embeddings, on a
        later one from `handed`, the tensors the previous stage's `stage_handoff` sent for `later_layer_ids` (this
        stage's layers and every later stage's). DecoderLM: None (its layers hand nothing across stages)."""
        return None

    def stage_handoff(self, carry, later_layer_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """The tensors a non-last pipeline stage sends on beside its (B, T, h) output, out of its layers' `carry`
        (`stage_carry`), for the layers `later_layer_ids` of the stages after it; their number is fixed per stage
        (the schedule learns the shapes once) and their gradients come back. DecoderLM: none."""
        return ()

    def run_layers(self, x: torch.Tensor, layers, documents: Documents | None = None) -> torch.Tensor:
        """(B, T, h) -> (B, T, h) through `layers` in order, each checkpointed when activation
        checkpointing is on (and gradients are being recorded); `documents`: packed rows' documents."""
        carry = self.layer_carry()
        extra = () if carry is None else (carry,)
        for layer in layers:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = recompute(layer, x, None, documents, *extra, rng=self.ctx.rng)
            else:
                x = layer(x, None, documents, *extra)
        return x

    def fp32_head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, contextlib.AbstractContextManager]:
        """(h, the output weight, a context) for the output layer: under `lm_head_fp32` (train.cast_lm_head_to_fp32)
        with autocast on, both cast to fp32 and autocast off, so the logits' GEMMs run in fp32 (TRL's
        `cast_lm_head_to_fp32`, ScaleRL's fp32 head); else as they are, with a null context."""
        device = h.device.type
        if not (self.lm_head_fp32 and torch.is_autocast_enabled(device)):
            return h, self.output_weight, contextlib.nullcontext()
        return h.float(), self.output_weight.float(), torch.autocast(device, enabled=False)

    def output_layer(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, h) final-norm output -> (B, T, V_padded / tp) this rank's logits (the input gradient is
        all-reduced over TP, `f`; sequence chunks are all-gathered first under sequence parallelism, `f_sp`)."""
        h, weight, precision = self.fp32_head(h)
        with precision:
            return invariant.linear(enter_parallel_region(h, self.ctx.tp, self.sequence_parallel), weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) last layer output -> (B, T, V_padded / tp) logits: final norm and output layer."""
        return self.output_layer(self.ln_f(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Per-token fp32 losses (B, T) of vocabulary-parallel logits; `ignore_index` targets give 0."""
        return vocab_parallel_cross_entropy(logits, targets, self.ctx.tp, vocab_size=self.cfg.vocab_size,
                                            ignore_index=ignore_index)

    def output_loss(self, h: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """(B, T, h) final-norm output (or its sequence chunks) -> per-token fp32 losses (B, T): the output
        layer and the vocabulary-parallel loss as one function, `linear_cross_entropy` (this rank's logits
        become their own gradient; never gathered, never copied). Training's path; `loss(output_layer(h))`
        computes the same. An RL run's `logit_temperature` divides the logits (as h / temperature), and its
        `entropies` list receives the (B, T) entropies of the same distributions (0 where there is no target; with
        a gradient under `entropy_gradient`); a preference run's `log_sum_sq` list the (B, T) log sum p^2 (no
        gradient)."""
        h, weight, precision = self.fp32_head(h)
        with precision:
            return self._output_loss(h, weight, targets, ignore_index)

    def _output_loss(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int
                     ) -> torch.Tensor:
        h = enter_parallel_region(h, self.ctx.tp, self.sequence_parallel)
        softcap = self.output_softcap()
        if softcap is None and self.logit_temperature != 1.0:
            h = h / self.logit_temperature
        if self.entropies is not None or self.log_sum_sq is not None:  # where there is a target
            kept = (targets.reshape(-1) != ignore_index).nonzero().squeeze(-1)
            rows = h.reshape(-1, h.shape[-1])[kept]

            def per_token(values: torch.Tensor) -> torch.Tensor:
                return torch.zeros(targets.numel(), device=h.device).index_put_((kept,), values).view(targets.shape)

            if self.entropies is not None:
                args = (rows, weight) if self.entropy_gradient else (rows.detach(), weight.detach())
                self.entropies.append(per_token(vocab_parallel_entropy(*args, self.ctx.tp, self.cfg.vocab_size,
                                                                       softcap)))
            if self.log_sum_sq is not None:
                self.log_sum_sq.append(per_token(vocab_parallel_log_sum_sq_probs(
                    rows.detach(), weight.detach(), self.ctx.tp, self.cfg.vocab_size, softcap)))
        return linear_cross_entropy(h, weight, targets, self.ctx.tp, self.cfg.vocab_size, ignore_index, softcap)

    def output_softcap(self) -> tuple[float, float] | None:
        """The logits' soft cap (cap, s) the fused loss applies, s tanh(z / cap) with the temperature inside s
        (`linear_cross_entropy`'s `softcap`); None: no cap (the temperature then divides h)."""
        return None

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache | None = None,
                      documents: Documents | None = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, h) final-norm output, replicated over the TP group.
        With `cache`, the tokens take positions cache.length .. cache.length + T - 1 and are cached.
        With `documents` (packed rows, `shardlm.models.documents`), positions restart at every document
        and attention stays inside each."""
        if cache is not None and self.sequence_parallel:
            raise ValueError("the KV cache works without sequence parallelism; build the model for generation "
                             "with sequence_parallel=False")
        if cache is not None and self.ctx.cp_size > 1:
            raise ValueError("the KV cache works without context parallelism; generate with parallel.context=1")
        if cache is not None and documents is not None:
            raise ValueError("packed documents are for training and evaluation; generate without them")
        if cache is None:
            return self.ln_f(self.layer_output(tokens, documents))
        x = self.embed(tokens, cache.length, documents)
        carry = self.layer_carry()
        extra = () if carry is None else (carry,)
        for layer, layer_cache in zip(self.layers.values(), cache.layers):
            x = layer(x, layer_cache, None, *extra)
        return self.ln_f(x)

    def layer_output(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """(B, T) ids -> the last layer's output, before the final norm (no cache)."""
        return self.run_layers(self.embed(tokens, 0, documents), self.layers.values(), documents)

    def mtp_input(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """What the first multi-token-prediction depth reads of the main model: the final norm's output `hidden`
        (DeepSeek-V3); `x` is the last layer's output before that norm."""
        return hidden

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                ignore_index: int = -100, cache: KVCache | None = None,
                documents: Documents | None = None, mtp: tuple | None = None, hidden_only: bool = False,
                then=None) -> torch.Tensor:
        """`mtp` = (inputs, targets), each (D, B, T), the rolled tokens of the model's D multi-token-prediction
        depths (`shardlm.models.mtp.rolled_targets`): the result is then (1 + D, B, T) per-token losses, the
        next-token loss first. `hidden_only`: the (B, T, h) final-norm output (`hidden_states`), through the
        module's own call, so that a wrapper's hooks run (FSDP gathers the root's weights), for generation.
        `then`: a function of that output computed inside the call (distillation's divergence, which runs the
        output layer on it), whose result is returned."""
        if targets is not None and mtp is not None:
            x = self.layer_output(tokens, documents)
            hidden = self.ln_f(x)
            main = self.output_loss(hidden, targets, ignore_index)
            depths = self.mtp_losses(self.mtp_input(x, hidden), mtp, documents, ignore_index)
            return torch.cat((main.unsqueeze(0), depths))
        hidden = self.hidden_states(tokens, cache, documents)
        if hidden_only:
            return hidden
        if then is not None:
            return then(hidden)
        if targets is not None:
            return self.output_loss(hidden, targets, ignore_index)
        logits = self.output_layer(hidden)
        return logits if targets is None else self.loss(logits, targets, ignore_index)

    def mtp_losses(self, hidden: torch.Tensor, mtp: tuple, documents: Documents | None = None,
                   ignore_index: int = -100) -> torch.Tensor:
        """Per-token fp32 losses (D, B, T) of the D multi-token-prediction depths (`shardlm.models.mtp`): depth k
        takes depth k-1's output (depth 1: `hidden`, the (B, T, h) final-norm output or its sequence chunks, as
        `mtp_input` gives it)
        and the embedding of its rolled tokens; `mtp` = (inputs, targets), each (D, B, T). Runs `embed` (so
        `wte`), `self.mtp` and the output layer: what the last pipeline stage keeps when the model has depths."""
        losses = []
        for layer, inputs, targets in zip(self.mtp, *mtp):
            hidden = layer(self.embed(inputs, 0, documents), hidden, documents)
            losses.append(self.output_loss(hidden, targets, ignore_index))
        return torch.stack(losses)

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """(..., V_padded / tp) -> (..., vocab_size): gather the slices and drop the padding.
        For evaluation and generation only; training never gathers logits."""
        return gather_from_tensor_parallel(local_logits, self.ctx.tp)[..., : self.cfg.vocab_size]

    def num_parameters(self) -> int:
        """Parameters of the whole model (summing the TP shards of split weights and the experts of every
        expert-parallel rank), padding included."""
        sharded = sum(p.numel() for p in self.parameters() if hasattr(p, "tensor_parallel_dim"))
        replicated = sum(p.numel() for p in self.parameters() if not hasattr(p, "tensor_parallel_dim"))
        experts = sum(p.numel() for p in self.parameters() if getattr(p, "expert_parallel", False))
        return (sharded + experts * (self.ctx.ep_size - 1)) * self.ctx.tp_size + replicated
