"""DeepSeek-V4 (transformers' DeepseekV4ForCausalLM): a Llama-family decoder whose residual is `hc_mult` streams.

    streams = n copies of the embedding                                               (B, T, n, h)
    each layer: post, comb, x = attn_hc(streams); streams = post (x) attn(ln_1(x)) + comb^T streams
                post, comb, x = mlp_hc(streams);  streams = post (x) moe(ln_2(x)) + comb^T streams
    ln_f: the streams collapsed (`HyperHead`) and RMS-normalized, then the untied output layer

The pieces: `shardlm.models.hyper_connections` (the streams), `shardlm.models.compressed_attention` (sliding
window + HCA / CSA compressed entries, the indexer, sinks, the grouped output projection), and here the MoE of
every layer: sqrt(softplus) router scores (model.moe_score = "sqrtsoftplus"), the top-k of scores + expert bias in
all but the first `moe_hash_layers` layers, which take each token's experts from a fixed table (`tid2eid`, a frozen
(vocabulary, k) parameter, transformers' buffer; from scratch, k distinct experts a token drawn at random); the
chosen scores divided by their sum and times routed_scaling; SwiGLU experts and one shared expert with DeepSeek-V4's
clip (`swiglu_clip`). Under sequence
parallelism the hash layers read the tokens of their rank's chunk; under pipeline parallelism the streams travel
between stages as the activations (B, T, n, h), and the hash layers must be on the first stage (which embeds the
tokens); packed rows attend document by document; under context parallelism each layer gathers its input over the
CP group; YaRN (`rope_yarn_*`) scales the compressed layers' rotary only. Refused in one line (`check_deepseek_v4`):
dropout.

Multi-token prediction (`model.mtp_layers`, DeepSeek's `mtp.k`): depth k reads the previous depth's streams (depth 1:
the last layer's, before the final collapse) and the embedding of the tokens k places ahead (`shardlm.models.mtp`):

    streams = e_proj(enorm(Emb(t_{i+k}))) on every stream + h_proj(hnorm(streams)), per stream
    streams = block_k(streams)          one more V4 layer, index num_layers + k - 1 (its ratio: the k-th after the
                                        layers' in model.compress_ratios, else 0, the sliding window only)
    logits  = lm_head(head_k(streams))  head_k: the depth's own collapse and RMSNorm (`HyperHead`)
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.errors import UserError
from shardlm.models.compressed_attention import CompressedAttention
from shardlm.models.config import ModelConfig, ParallelOptions
from shardlm.models.decoder import SequenceDropout, enter_parallel_region, finished, mark_sequence_parallel
from shardlm.models.hyper_connections import HyperConnection, HyperHead, expand
from shardlm.models.llama import Llama, SwiGLU
from shardlm.models.moe import MoELayer, Router, route
from shardlm.models.norms import RMSNorm
from shardlm.parallel import ColumnParallelLinear, ParallelContext, VocabParallelEmbedding, invariant
from shardlm.parallel.init import normal_shard, param_seed
from shardlm.parallel.random import recompute


def check_deepseek_v4(m: ModelConfig, context: int = 1) -> str | None:
    """One line saying what is wrong with the DeepSeek-V4 keys of `m` (hc_mult > 0), or None."""
    ratios = [r for r in m.compress_ratios if r]
    checks = [
        (m.arch == "llama" and m.attention == "mha", 'model.hc_mult (DeepSeek-V4) needs model.arch="llama" with '
         'model.attention="mha"'),
        (m.hc_mult >= 1 and m.hc_sinkhorn_iters >= 1 and m.hc_eps > 0,
         "model.hc_mult and hc_sinkhorn_iters must be >= 1 and model.hc_eps > 0"),
        (m.head_dim > 0 and m.q_lora_rank > 0 and 0 < m.qk_rope_head_dim <= m.head_dim and m.qk_rope_head_dim % 2 == 0,
         "DeepSeek-V4 needs model.head_dim, q_lora_rank and an even qk_rope_head_dim <= head_dim"),
        (m.sliding_window > 0, "DeepSeek-V4 needs model.sliding_window > 0 (every layer attends to its window)"),
        (m.output_groups > 0 and m.output_rank > 0 and m.num_heads % m.output_groups == 0,
         "DeepSeek-V4 needs model.output_groups dividing num_heads and model.output_rank > 0"),
        (len(m.compress_ratios) in (0, m.num_layers, m.num_layers + m.mtp_layers) and all(r >= 0 for r in
                                                                                          m.compress_ratios),
         f"model.compress_ratios must list {m.num_layers} ratios >= 0 (0: the sliding window only), or "
         f"{m.num_layers + m.mtp_layers} with the multi-token-prediction layers'"),
        (not ratios or m.global_rope_theta > 0, "model.compress_ratios needs model.global_rope_theta (the "
         "compressed layers' rotary base, compress_rope_theta)"),
        (not m.index_topk or m.index_topk > 0 and m.index_heads > 0 and m.index_head_dim >= m.qk_rope_head_dim,
         "DeepSeek-V4's CSA layers (the smallest ratio) need model.index_heads and index_head_dim >= qk_rope_head_dim"),
        (m.moe_num_experts > 0 and m.moe_first_dense_layers == 0 and m.moe_layer_interval == 1
         and m.moe_score == "sqrtsoftplus", 'DeepSeek-V4 needs MoE in every layer and model.moe_score="sqrtsoftplus"'),
        (0 <= m.moe_hash_layers <= m.num_layers and m.swiglu_limit == 0 and m.swiglu_clip >= 0,
         "model.moe_hash_layers must be in 0..num_layers; DeepSeek-V4 clips with swiglu_clip (not swiglu_limit)"),
        (not m.rope_llama3_factor, "DeepSeek-V4 scales its compressed layers' rotary by YaRN, not llama3's scaling"),
        (m.index_stage == "sparse", 'DeepSeek-V4 has no dense warm-up stage (its CSA indexer trains beside the '
         'model by its own loss): set model.index_stage = "sparse"'),
        (m.dropout == 0 and m.attention_dropout_p == 0, "DeepSeek-V4 has no dropout; set model.dropout = 0"),
    ]
    return next((message for ok, message in checks if not ok), None)


class ClippedSwiGLU(SwiGLU):
    """SwiGLU with DeepSeek-V4's clip: down(silu(min(gate, c)) x clamp(up, -c, c)) (its shared expert)."""

    def __init__(self, cfg: ModelConfig, ctx, seed: int, prefix: str, sequence_parallel: bool = False):
        super().__init__(cfg, ctx, seed, prefix, sequence_parallel)
        self.clip = cfg.swiglu_clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)
        gate, up = self.gate.local(x), self.up.local(x)
        if self.clip > 0:
            gate, up = gate.clamp(max=self.clip), up.clamp(-self.clip, self.clip)
        return self.down(F.silu(gate) * up)


def hash_table(cfg: ModelConfig, seed: int) -> torch.Tensor:
    """A from-scratch hash layer's table (vocabulary, top_k): each token's top_k distinct experts drawn uniformly, the
    same on every rank (`seed`); a checkpoint's table replaces it."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(cfg.vocab_size, cfg.moe_num_experts, generator=generator)
    return draws.topk(cfg.moe_top_k, dim=-1).indices.float()


class V4Router(Router):
    """DeepSeek-V4's router: fp32 logits, sqrt(softplus) scores; hash layers take the experts of `tid2eid` at the
    tokens in `self.tokens` (set by the block before each call, (N,) int64), the others the top-k of scores +
    expert bias. x (N, h) -> (indices (N, k), weights (N, k), scores (N, E), logits (N, E))."""

    def __init__(self, cfg: ModelConfig, ctx, seed: int, prefix: str, sequence_parallel: bool, hashed: bool):
        super().__init__(cfg, ctx, seed, prefix, sequence_parallel)
        self.tokens = None
        self.tid2eid = None
        if hashed:  # frozen; float so that it travels with the other parameters (expert ids are exact in fp32)
            self.tid2eid = nn.Parameter(hash_table(cfg, param_seed(seed, f"{prefix}.tid2eid")).to(ctx.device),
                                        requires_grad=False)
            self.expert_bias = None

    def forward(self, x: torch.Tensor):
        cfg = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            logits = invariant.linear(x.float(), self.weight.float())
        scores = F.softplus(logits).sqrt()
        if self.tid2eid is None:
            bias = None if self.expert_bias is None else self.expert_bias.float()
            indices, weights = route(scores, cfg.moe_top_k, bias, norm_topk_prob=True, scaling=cfg.moe_routed_scaling)
            return indices, weights, scores, logits
        indices = self.tid2eid[self.tokens.reshape(-1)].long()
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return indices, weights * cfg.moe_routed_scaling, scores, logits


class V4Block(nn.Module):
    """One DeepSeek-V4 layer over the streams (B, T, n, h) (chunks (B, T / tp, n, h) under sequence parallelism):
    attn_hc, ln_1, attn (`CompressedAttention`), mlp_hc, ln_2, mlp (an `MoELayer` with a `V4Router`)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int, sequence_parallel: bool,
                 options: ParallelOptions):
        super().__init__()
        self.ctx, self.sequence_parallel = ctx, sequence_parallel
        prefix = f"layers.{index}"
        self.attn_hc = HyperConnection(cfg, ctx, seed, f"{prefix}.attn_hc", sequence_parallel)
        self.mlp_hc = HyperConnection(cfg, ctx, seed, f"{prefix}.mlp_hc", sequence_parallel)
        self.ln_1 = RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.ln_2 = RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        if sequence_parallel:
            mark_sequence_parallel(self.ln_1)
            mark_sequence_parallel(self.ln_2)
        self.attn = CompressedAttention(cfg, ctx, seed, f"{prefix}.attn", sequence_parallel, index)
        shared = ClippedSwiGLU(replace(cfg, ffn_hidden_size=cfg.shared_ffn_size), ctx, seed, f"{prefix}.mlp.shared",
                               sequence_parallel)
        self.mlp = MoELayer(cfg, ctx, seed, f"{prefix}.mlp", sequence_parallel, gated=True, shared=shared,
                            dispatcher=options.expert_dispatcher)
        self.mlp.router = V4Router(cfg, ctx, seed, f"{prefix}.mlp.router", self.mlp.sequence_parallel,
                                   hashed=index < cfg.moe_hash_layers)

    def forward(self, streams: torch.Tensor, cache=None, documents=None, carry: dict | None = None) -> torch.Tensor:
        """`carry["tokens"]`: the (B, T) token ids of the whole rows (hash routing reads this rank's chunk)."""
        post, comb, x = self.attn_hc(streams)
        streams = expand(self.attn(self.ln_1(x), cache, documents), post, comb, streams)
        post, comb, x = self.mlp_hc(streams)
        if self.mlp.router.tid2eid is not None:
            tokens = carry["tokens"]
            if tokens is None:
                raise UserError("a hash-routed layer (model.moe_hash_layers) runs on a pipeline stage without the "
                                "tokens: keep those layers on the first stage")
            if self.sequence_parallel:
                chunk = tokens.shape[1] // self.ctx.tp_size
                tokens = tokens[:, self.ctx.tp_rank * chunk:(self.ctx.tp_rank + 1) * chunk]
            self.mlp.router.tokens = tokens
        return expand(self.mlp(self.ln_2(x)), post, comb, streams)


class V4Depth(nn.Module):
    """Multi-token-prediction depth k (DeepSeek's `mtp.k`): (embedding (B, T, h) of the tokens k + 1 places ahead,
    previous streams (B, T, n, h)) -> streams (B, T, n, h); sequence chunks (T / tp) under sequence parallelism.
    Parameters: enorm, hnorm (h,), e_proj, h_proj (h, h) (replicated), block (a `V4Block`, index num_layers + k),
    head (its `HyperHead`). `finish_layer`: `build_model`'s per-layer step, run on the block as on the layers'."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, depth: int, sequence_parallel: bool,
                 options: ParallelOptions, finish_layer=None):
        super().__init__()
        h, prefix = cfg.hidden_size, f"mtp.{depth}"
        self.enorm = RMSNorm(h, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.hnorm = RMSNorm(h, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.e_proj, self.h_proj = (nn.Parameter(normal_shard((h, h), cfg.init_std,
                                                              param_seed(seed, f"{prefix}.{name}"), device=ctx.device))
                                    for name in ("e_proj", "h_proj"))
        if sequence_parallel:  # their inputs are this rank's chunk: gradients summed over TP
            for module in (self.enorm, self.hnorm):
                mark_sequence_parallel(module)
            self.e_proj.sequence_parallel = self.h_proj.sequence_parallel = True
        self.block = finished(V4Block(cfg, ctx, seed, cfg.num_layers + depth, sequence_parallel, options), finish_layer)
        self.head = HyperHead(cfg, ctx, seed, sequence_parallel, prefix=f"{prefix}.head")

    def forward(self, embedded: torch.Tensor, streams: torch.Tensor, documents=None) -> torch.Tensor:
        x = F.linear(self.enorm(embedded), self.e_proj).unsqueeze(2) + F.linear(self.hnorm(streams), self.h_proj)
        return self.block(x, None, documents, None)


class DeepseekV4(Llama):
    """DeepSeek-V4's causal LM (`Llama` builds it when model.hc_mult > 0); `DecoderLM` runs it, the streams
    travelling between the layers. Parameters: wte, layers.i.*, ln_f (`HyperHead`: fn, base, scale, weight),
    lm_head."""

    FIRST_STAGE = ("wte",)

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int = 1234,
                 activation_checkpointing: bool = False, recompute: str | None = None,
                 sequence_parallel: bool = False, layer_ids: list[int] | None = None,
                 options: ParallelOptions | None = None, finish_layer=None):
        nn.Module.__init__(self)
        options = options or ParallelOptions()
        if (problem := check_deepseek_v4(cfg, ctx.cp_size)) is not None:
            raise UserError(problem)
        for size, name in ((cfg.num_heads, "model.num_heads"), (cfg.output_groups, "model.output_groups")):
            if size % ctx.tp_size:
                raise UserError(f"{name}={size} is not divisible by parallel.tensor={ctx.tp_size}")
        sp = self._init_run(cfg, ctx, seed, activation_checkpointing, recompute, sequence_parallel, options)
        self.wte = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, ctx.tp, vocab_size=cfg.vocab_size,
                                          std=cfg.init_std, seed=param_seed(seed, "wte"), device=ctx.device,
                                          sequence_parallel=sp)
        self.drop = SequenceDropout(cfg.dropout, ctx, sp)
        self.layers = nn.ModuleDict({str(i): finished(V4Block(cfg, ctx, seed, i, sp, options), finish_layer)
                                     for i in (range(cfg.num_layers) if layer_ids is None else layer_ids)})
        self.ln_f = HyperHead(cfg, ctx, seed, sp)
        self.lm_head = None
        if not cfg.tie_embeddings:
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, ctx.tp, bias=False,
                                                std=cfg.init_std, seed=param_seed(seed, "lm_head"), device=ctx.device)
            with torch.no_grad():
                first_row = ctx.tp_rank * self.lm_head.weight.shape[0]
                self.lm_head.weight[max(0, cfg.vocab_size - first_row):].zero_()
        # with multi-token prediction the last pipeline stage keeps the depths and a copy of `wte` for their tokens
        last = ("ln_f", "wte" if cfg.tie_embeddings else "lm_head") + (("wte", "mtp") if cfg.mtp_layers else ())
        self.LAST_STAGE = tuple(dict.fromkeys(last))
        self.mtp = None
        if cfg.mtp_layers:
            self.mtp = nn.ModuleList(V4Depth(cfg, ctx, seed, k, sp, options, finish_layer)
                                     for k in range(cfg.mtp_layers))
        self.tokens = None

    def mtp_input(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The first depth reads the last layer's streams `x` (B, T, n, h), not the final collapse `hidden`."""
        return x

    def mtp_losses(self, streams: torch.Tensor, mtp: tuple, documents=None, ignore_index: int = -100) -> torch.Tensor:
        """Per-token fp32 losses (D, B, T) of the D depths (`V4Depth`): depth k takes depth k-1's streams (depth 1:
        `streams`, the last layer's) and the embedding of its rolled tokens; `mtp` = (inputs, targets), each
        (D, B, T); each depth's own head collapses its streams for the shared output layer."""
        losses = []
        for depth, inputs, targets in zip(self.mtp, *mtp):
            streams = depth(super().embed(inputs, 0, documents), streams, documents)
            losses.append(self.output_loss(depth.head(streams), targets, ignore_index))
        return torch.stack(losses)

    def embed(self, tokens: torch.Tensor, past: int = 0, documents=None) -> torch.Tensor:
        """(B, T) ids -> (B, T, n, h): the embedding copied to every stream (this rank's chunk under sequence
        parallelism); the tokens are kept for the hash-routed layers."""
        self.tokens = tokens
        x = super().embed(tokens, past, documents)
        return x.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def run_layers(self, x: torch.Tensor, layers, documents=None) -> torch.Tensor:
        """The streams through `layers`, each checkpointed under full recomputation; the hash layers read the
        tokens `embed` kept."""
        carry, self.tokens = {"tokens": self.tokens}, None  # this micro-batch's, from the `embed` just before
        for layer in layers:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = recompute(layer, x, None, documents, carry, rng=self.ctx.rng)
            else:
                x = layer(x, None, documents, carry)
        return x

    def hidden_states(self, tokens: torch.Tensor, cache=None, documents=None) -> torch.Tensor:
        """As `DecoderLM.hidden_states`, the layers handed the tokens; with `cache`, each layer's inputs kept."""
        if cache is None:
            return super().hidden_states(tokens, None, documents)
        if self.sequence_parallel or self.ctx.cp_size > 1 or documents is not None:
            raise ValueError("DeepSeek-V4 decodes without sequence or context parallelism and packed documents")
        x = self.embed(tokens, cache.length, None)
        carry = {"tokens": tokens}
        for layer, layer_cache in zip(self.layers.values(), cache.layers):
            x = layer(x, layer_cache, None, carry)
        return self.ln_f(x)
