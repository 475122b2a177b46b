"""Context parallelism in the planner: which C to try, and the ring's time (`shardlm.parallel.ring_attention`).

A CP rank holds T / C tokens of every sequence, so everything a layer saves and every per-token cost
(elementwise passes, TP collectives, pipeline transfers) is that of a T / C sequence; the matmul
FLOPs split evenly over the C ranks (the zigzag split balances causal attention). What CP adds is the
ring: per layer and micro-batch, with L = T / 2C, Hkv the KV heads of a TP rank, d the head size (with
multi-head latent attention 2 Hkv d is the H / t local heads' expanded keys and values, H/t (qk + v)),

    forward   C - 1 hops of K and V        2 b Hkv 2L d x (activation bytes) each
    backward  C - 1 hops of K and V, and C - 1 hops of dK and dV (fp32)
    (full recomputation: the forward's hops again)

and each hop overlaps the two full L x L blocks the rank computes meanwhile (4 b H 2L L d FLOPs
forward per block pair for QK^T and PV over its H query heads of the TP rank, twice that backward):
only the part of a transfer longer than its blocks is exposed, plus one latency per hop. A CP group
is C ranks TP apart: on NVLink while TP x C GPUs fit in a server; beyond, the ring crosses servers and
each GPU gets its share of the node's network.

DeepSeek Sparse Attention (`index_topk`) runs no ring: every layer all-gathers the row's latents and shared RoPE
keys, and each layer with its own indexer its indexer keys, so each query chooses among and attends to the whole
row (`shardlm.models.sparse_attention`, `sparse_gather_seconds`).

MoE models: expert parallelism folds over the DP x C ranks (`shardlm.parallel.layout.expert_parallel_groups`,
CP ranks first): E divides DP x C, the expert-DP group is the DP x C / E ranks holding the same experts.
Each CP rank routes only its own T / C tokens, so the MoE layer's saved activations and its all-to-all
are those of a T / C sequence (the planner hands `experts` the shortened model), and the expert gradients
are reduced over expert-DP (`timing.dp_comm_seconds`).
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig

LONG_CONTEXT = 8192
"""Sequences from this length on are searched with C > 1 (shorter ones keep C = 1 unless --context
fixes it): below it, chunks are too short for the ring to hide behind attention."""


def context_options(cfg: ModelConfig, ranks: int, fixed: int | None, implementation: str) -> list[int]:
    """Context-parallel sizes to try with `ranks` = GPUs / (PP x TP) left for DP x CP: the fixed one, else
    C = 1 and, for long sequences of GPT and Llama (dense or MoE; not under SC21's Megatron, whose softmax stores
    the s x s scores), every C dividing `ranks` whose 2C chunks split the sequence."""
    if fixed is not None:
        return [fixed]
    if cfg.seq_length < LONG_CONTEXT or cfg.arch not in ("gpt", "llama") or implementation == "megatron":
        return [1]
    return [c for c in range(1, ranks + 1) if ranks % c == 0 and cfg.seq_length % (2 * c) == 0]


def context_invalid_reason(cfg: ModelConfig, cp: int) -> str | None:
    """Why C = `cp` cannot run this model (the training config's rules), or None."""
    if cp == 1:
        return None
    if cfg.arch not in ("gpt", "llama"):
        return "context parallelism is planned for GPT and Llama only"
    if cfg.seq_length % (2 * cp):
        return f"sequence {cfg.seq_length} is not a multiple of 2 x CP = {2 * cp}"
    return None


def _kv_widths(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(K and V elements per token on a TP rank, q.k plus p.v channels per query head): 2 Hkv d and 2 d; with
    multi-head latent attention the ring moves each local head's expanded key (qk_nope + qk_rope) and value
    (v_head_dim), as `shardlm.models.mla.LatentAttention` hands them to the ring: H/t (qk + v) and qk + v."""
    if cfg.arch == "llama" and cfg.attention == "mla":
        width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
        return cfg.num_heads // tp * width, width
    head_dim = cfg.hidden_size // cfg.num_heads if cfg.arch != "llama" else cfg.attention_head_dim
    kv_heads = cfg.num_heads if cfg.arch != "llama" else cfg.kv_heads
    return 2 * max(1, kv_heads // tp) * head_dim, 2 * head_dim


def ring_seconds(cfg: ModelConfig, cp: int, tp: int, micro_batch: int, activation_bytes: int, recompute_full: bool,
                 bandwidth: float, latency_s: float, flops_per_s: float) -> tuple[float, float]:
    """(exposed, total) seconds of one micro-batch's K/V ring on one rank, per layer (see the module doc);
    `bandwidth` in bytes/s per direction, `flops_per_s` what the rank's attention blocks achieve."""
    if cp == 1:
        return 0.0, 0.0
    kv_width, head_width = _kv_widths(cfg, tp)
    local_heads = cfg.num_heads // tp
    chunk = cfg.seq_length // (2 * cp)  # L
    kv = micro_batch * 2 * chunk * kv_width
    blocks = 2 * micro_batch * local_heads * 2 * chunk * chunk * head_width  # two L x L blocks, QK^T and PV
    hops = cp - 1

    def hop(nbytes: float, flops: float) -> tuple[float, float]:
        transfer = nbytes / bandwidth
        return max(0.0, transfer - flops / flops_per_s) + latency_s, transfer + latency_s

    forward = hop(kv * activation_bytes, blocks)
    backward = hop(kv * activation_bytes + kv * 4, 2 * blocks)  # K/V and the fp32 dK/dV on the same link
    passes = [forward, backward] + ([forward] if recompute_full else [])
    return hops * sum(p[0] for p in passes), hops * sum(p[1] for p in passes)


def allgather_seconds(cfg: ModelConfig, cp: int, tp: int, micro_batch: int, activation_bytes: int,
                      recompute_full: bool, bandwidth: float, latency_s: float) -> float:
    """Seconds of one micro-batch's K/V all-gather on one rank, per layer, all on the critical path (Llama 3's
    context parallelism, section 3.3.2 of its paper: all-gather K and V, then attend with the local queries):
    forward a ring all-gather of the sequence's K and V over the C ranks (2 b T Hkv d x activation bytes, the
    rank's KV heads); backward the same all-gather again, since only the rank's own K and V are saved for it, and
    a reduce-scatter of dK and dV of the same size (Transformer Engine's `AttnFuncWithCPAndKVAllGather`, which
    Megatron-Core runs for this scheme and whose docstring cites the Llama 3 paper, saves the local k and v and
    gathers them again in its backward); the forward's gather again under full recomputation. `bandwidth` in
    bytes/s per direction."""
    if cp == 1:
        return 0.0
    nbytes = micro_batch * cfg.seq_length * _kv_widths(cfg, tp)[0] * activation_bytes
    one = (cp - 1) / cp * nbytes / bandwidth + (cp - 1) * latency_s
    return one * (4 if recompute_full else 3)


def sparse_gather_seconds(cfg: ModelConfig, cp: int, micro_batch: int, activation_bytes: int, recompute_full: bool,
                          bandwidth: float, latency_s: float) -> float:
    """Seconds of one micro-batch's sparse-attention all-gathers on one rank, per layer (averaged over the layers
    with and without an indexer), all on the critical path (`shardlm.parallel.gather_zigzag_rows`): every
    layer gathers the row's latents and rotated shared keys, b T (kv_lora_rank + qk_rope) x activation bytes, and
    reduce-scatters their gradients; a layer with its own indexer gathers its keys, b T index_head_dim x 4 bytes
    (its LayerNorm's fp32 output under autocast), and reduce-scatters their gradients when it trains. In the dense
    warm-up (which runs the ring as well) only a layer whose indexer trains gathers, its keys and, detached, the
    latents for its target. The forward's gathers again under full recomputation. Each collective (C - 1) / C of
    its bytes over `bandwidth` (bytes/s per direction) plus C - 1 latencies."""
    from shardlm.plan.sparse_attention import has_indexer

    if cp == 1:
        return 0.0
    layers = range(cfg.num_layers)
    indexed = sum(has_indexer(cfg, i) for i in layers) / len(layers)
    tokens = micro_batch * cfg.seq_length

    def gather(nbytes: float) -> float:
        return (cp - 1) / cp * nbytes / bandwidth + (cp - 1) * latency_s

    latents = gather(tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * activation_bytes)
    keys = gather(tokens * cfg.index_head_dim * 4)
    trained = cfg.index_loss_coeff > 0
    if cfg.index_stage == "warmup":
        forward, backward = (indexed * (latents + keys), indexed * keys) if trained else (0.0, 0.0)
    else:
        forward, backward = latents + indexed * keys, latents + (indexed * keys if trained else 0.0)
    return forward * (2 if recompute_full else 1) + backward


def compressed_gathers(cfg: ModelConfig, cp: int, index: int) -> tuple[int, int]:
    """(collectives, elements gathered a row) of DeepSeek-V4's layer `index` at CP size `cp` (seq_length the whole
    row's; `shardlm.models.compressed_context`): where a rank's chunks hold whole windows
    (`v4_activations.halo_gathers`), the last `halo` positions' key projections of each of the 2 C chunks
    (`deepseek_v4.key_projection_width` each) and the row's s / m entries (D, and the CSA indexer's D_i); otherwise
    every position's key projections."""
    from shardlm.models.compressed_context import halo_size
    from shardlm.plan.deepseek_v4 import key_projection_width, layer_kinds, layer_ratios
    from shardlm.plan.v4_activations import halo_gathers

    kind, ratio, width = layer_kinds(cfg)[index], layer_ratios(cfg)[index], key_projection_width(cfg, index)
    if not halo_gathers(cfg, index, cfg.seq_length // cp):
        return 1, cfg.seq_length * width
    halo = halo_size(cfg.sliding_window, ratio, kind == "csa")
    entries = cfg.seq_length // ratio * (cfg.head_dim + (cfg.index_head_dim if kind == "csa" else 0)) if ratio else 0
    return 1 + (ratio > 0), 2 * cp * halo * width + entries


def compressed_gather_seconds(cfg: ModelConfig, cp: int, micro_batch: int, activation_bytes: int,
                              recompute_full: bool, bandwidth: float, latency_s: float) -> float:
    """Seconds of one micro-batch's DeepSeek-V4 all-gathers on one rank, per layer (averaged over its layers), all
    on the critical path, in the GEMM dtype (`compressed_gathers`); the backward reduce-scatters their gradients;
    the forward's gathers again under full recomputation. Each collective (C - 1) / C of its bytes over
    `bandwidth` (bytes/s per direction) plus C - 1 latencies."""
    if cp == 1:
        return 0.0
    total = 0.0
    for index in range(cfg.num_layers):
        collectives, elements = compressed_gathers(cfg, cp, index)
        nbytes = micro_batch * elements * activation_bytes
        total += (cp - 1) / cp * nbytes / bandwidth + collectives * (cp - 1) * latency_s
    return total / cfg.num_layers * (3 if recompute_full else 2)
