"""DeepSeek-V4 (`model.hc_mult` > 0, `shardlm.models.deepseek_v4`) in the planner: parameters, FLOPs and the
hyper-connections' activations (`hyper_connection_bytes`; the layer's others: `shardlm.plan.v4_activations`).

Parameters (`v4_parameter_count`), as the model builds them on one TP rank (h hidden, n = hc_mult streams, H heads
of D = head_dim channels, r_q = q_lora_rank, g = output_groups of r_o = output_rank, E experts):
    per layer   two hyper-connections, each fn ((2 + n) n x n h), base ((2 + n) n), scale (3); ln_1, ln_2 (h each)
                attention: q_a (r_q x h) and q_a_norm (r_q), kv (D x h) and kv_norm (D) replicated; q_b (H D x r_q)
                split by rows, o_a (g r_o x H D / g: one block per group) split by rows with its groups, o_b
                (h x g r_o) by columns, sinks (H) split with the heads
                a compressing layer of ratio m: its compressor kv and gate ((1 + o) D x h each, o = 1 on CSA's
                overlapping windows), position_bias (m x (1 + o) D), kv_norm (D), replicated
                a CSA layer: the indexer's compressor at index_head_dim D_i (overlapping), q_b (H_i D_i x r_q) and
                weights_proj (H_i x h), replicated (trained by its own loss, from detached inputs)
                MoE (`parameters._mlp_count`): router (E x h) and expert bias (E), E / ep SwiGLU experts and the
                shared expert; a hash-routed layer (`moe_hash_layers`) holds its token -> experts table tid2eid
                (V x top_k, frozen; transformers' buffer) instead of the bias
    ends        embedding and untied output layer (V_padded x h each) split by vocabulary rows; the head's collapse
                (`HyperHead`) fn (n x n h), base (n), scale (1) and its norm (h), replicated
    each depth  (model.mtp_layers, `V4Depth`) a layer of index L + k as above, e_proj and h_proj (h x h each),
                enorm and hnorm (h each) and a head of its own, replicated (`v4_depth_count`)

FLOPs per token of the forward (`v4_layer_flops`; s = seq_length): the hyper-connections 2 (2 + n) n^2 h each and
their stream mixing comb^T streams 2 n^2 h each; the attention's matrices 2 (h r_q + r_q H D + h D + H D r_o +
g r_o h); each compressor's kv and gate 4 (1 + o) D h; the CSA indexer its compressor 8 D_i h, its queries 2 r_q H_i
D_i, its weights 2 h H_i and its O(s) choice 2 H_i (D_i + 1) s / m against every compressed entry at its small width
(and when it trains its loss pass over the chosen entries, 2 H_i (D_i + 1) min(index_topk, s / m), 3 x in training);
attention's score and value products 4 H D per key, the keys being the window min(s, sliding_window) plus on HCA
layers all s / m entries and on CSA layers min(index_topk, s / m) chosen ones (4:1 compression and top-k: O(s k)
instead of O(s^2)); the MoE its router 2 h E, top-k experts and the shared one 6 h f each; the head 2 n^2 h and the
output layer 2 h V; each depth its layer, e_proj 2 h^2, h_proj on each stream 2 n h^2, its head and the output layer.
Training is 3 x forward except the indexers, whose backward is shorter (`v4_flops_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardlm.models.config import ModelConfig
from shardlm.plan.parameters import ParameterCount, _mlp_count, _split, add_counts


def layer_ratios(cfg: ModelConfig) -> list[int]:
    """The compress ratio of each layer, then of each multi-token-prediction depth (0: the sliding window only)."""
    ratios = list(cfg.compress_ratios) or [0] * cfg.num_layers
    return ratios + [0] * (cfg.num_layers + cfg.mtp_layers - len(ratios))


def layer_kinds(cfg: ModelConfig) -> list[str]:
    """Per layer (then depth) "sliding", "csa" or "hca", as `shardlm.models.compressed_attention.compressed_kinds`
    (no torch)."""
    return list(_kinds(tuple(layer_ratios(cfg)), bool(cfg.index_topk)))


@lru_cache(maxsize=64)
def _kinds(ratios: tuple[int, ...], indexed: bool) -> tuple[str, ...]:
    smallest = min([r for r in ratios if r] or [0])
    return tuple("sliding" if not r else "csa" if r == smallest and indexed else "hca" for r in ratios)


def key_projection_width(cfg: ModelConfig, index: int) -> int:
    """Channels a token's keys and entries are computed from in layer `index` (`CompressedAttention.key_inputs`,
    what a context-parallel rank all-gathers): kv's D, a compressor's kv and gate (1 + o) D each, a CSA layer's
    indexer compressor's 2 D_i each."""
    kind, D = layer_kinds(cfg)[index], cfg.head_dim
    width = (2 if kind == "csa" else 1) * D
    return D + (2 * width if kind != "sliding" else 0) + (4 * cfg.index_head_dim if kind == "csa" else 0)


def _compressor(cfg: ModelConfig, dim: int, ratio: int, overlap: bool) -> int:
    """Elements of one `Compressor`: kv and gate ((1 + overlap) dim x h each), position_bias, kv_norm (dim)."""
    width = (2 if overlap else 1) * dim
    return 2 * width * cfg.hidden_size + ratio * width + dim


def _attention_count(cfg: ModelConfig, index: int, tp: int) -> ParameterCount:
    """Layer `index`'s `CompressedAttention`, its two hyper-connections and two RMSNorms on one TP rank."""
    h, n, dim, q_rank = cfg.hidden_size, cfg.hc_mult, cfg.head_dim, cfg.q_lora_rank
    heads = _split(cfg.num_heads, tp, "num_heads")
    groups = _split(cfg.output_groups, tp, "output_groups")
    per_group = cfg.num_heads * dim // cfg.output_groups
    matrices = heads * dim * q_rank + groups * cfg.output_rank * per_group + h * groups * cfg.output_rank
    replicated_matrices = q_rank * h + dim * h
    hyper = 2 * ((2 + n) * n * n * h + (2 + n) * n + 3)
    replicated = replicated_matrices + q_rank + dim + hyper + 2 * h
    tensors = 8 + 6 + 2
    kind, ratio = layer_kinds(cfg)[index], layer_ratios(cfg)[index]
    if kind != "sliding":
        own = _compressor(cfg, dim, ratio, kind == "csa")
        replicated += own
        replicated_matrices += own - ratio * (2 if kind == "csa" else 1) * dim - dim
        tensors += 4
    if kind == "csa":
        heads_i, dim_i = cfg.index_heads, cfg.index_head_dim
        indexer_matrices = heads_i * dim_i * q_rank + heads_i * h
        replicated += _compressor(cfg, dim_i, ratio, True) + indexer_matrices
        replicated_matrices += indexer_matrices + 4 * dim_i * h
        tensors += 4 + 2
    return ParameterCount(matrices + heads, replicated, tensors, matrices + replicated_matrices)


def v4_layer_count(cfg: ModelConfig, index: int, tp: int, ep: int = 1) -> ParameterCount:
    """Layer `index` of DeepSeek-V4 on one (TP, EP) rank: `_attention_count` and the MoE (`parameters._mlp_count`;
    a hash-routed layer holds tid2eid, vocabulary x top_k, instead of the expert bias)."""
    mlp = _mlp_count(cfg, index, tp, ep, gated=True)
    if index < cfg.moe_hash_layers:
        table = cfg.vocab_size * cfg.moe_top_k - cfg.moe_num_experts
        mlp = add_counts(mlp, ParameterCount(0, table, 0, 0))
    return add_counts(_attention_count(cfg, index, tp), mlp)


def v4_parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of `shardlm.models.deepseek_v4.DeepseekV4` (the module docstring)."""
    h, n = cfg.hidden_size, cfg.hc_mult
    vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
    outputs = 1 if cfg.tie_embeddings else 2
    total = ParameterCount(outputs * vocab_local * h, n * n * h + n + 1 + h, outputs + 4, 0)
    for index in range(cfg.num_layers):
        total = add_counts(total, v4_layer_count(cfg, index, tp, ep))
    return total


def v4_depth_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of the model.mtp_layers depths (without the shared embedding and output layer)."""
    h, n = cfg.hidden_size, cfg.hc_mult
    own = ParameterCount(0, 2 * h * h + 2 * h + n * n * h + n + 1 + h, 8, 2 * h * h)
    total = ParameterCount(0, 0, 0, 0)
    for k in range(cfg.mtp_layers):
        total = add_counts(total, add_counts(v4_layer_count(cfg, cfg.num_layers + k, tp, ep), own))
    return total


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one DeepSeek-V4 layer."""

    trained: float
    """Everything that trains at 3 x its forward: hyper-connections, attention, compressor, MoE."""
    indexer: float
    """The CSA layer's lightning indexer's forward (its choice carries no gradient; its own loss trains it); 0
    elsewhere."""
    keys: int
    """Keys each query attends to: the window plus the layer's compressed entries (HCA all, CSA its top-k)."""
    choice: float = 0.0
    """Of `indexer`: the CSA indexer's scoring of every complete entry, which chooses (no gradient)."""
    divergence: float = 0.0
    """The CSA indexer's loss pass when it trains: the chosen entries scored again, 2 H_i (D_i + 1) per entry
    (`sparse_attention.indexer_divergence`, its gradient taken as it runs: 3 x this in training)."""


def v4_layer_flops(cfg: ModelConfig, index: int) -> LayerFlops:
    """Layer `index`'s forward FLOPs per token (the module docstring) at cfg.seq_length."""
    h, n, dim, q_rank, s = cfg.hidden_size, cfg.hc_mult, cfg.head_dim, cfg.q_lora_rank, cfg.seq_length
    heads = cfg.num_heads
    hyper = 2 * (2 * (2 + n) * n * n * h + 2 * n * n * h)
    attention = 2 * (h * q_rank + q_rank * heads * dim + h * dim + heads * dim * cfg.output_rank
                     + cfg.output_groups * cfg.output_rank * h)
    kind = layer_kinds(cfg)[index]
    keys, indexer, choice, divergence = min(s, cfg.sliding_window), 0, 0, 0
    if kind != "sliding":
        ratio = cfg.compress_ratios[index]
        entries = s // ratio
        attention += 4 * (2 if kind == "csa" else 1) * dim * h
        keys += entries if kind == "hca" else min(cfg.index_topk, entries)
        if kind == "csa":
            heads_i, dim_i = cfg.index_heads, cfg.index_head_dim
            choice = 2 * heads_i * (dim_i + 1) * entries
            indexer = 8 * dim_i * h + 2 * q_rank * heads_i * dim_i + 2 * h * heads_i + choice
            divergence = 2 * heads_i * (dim_i + 1) * min(cfg.index_topk, entries)
    experts = cfg.moe_top_k * cfg.moe_ffn_size + cfg.shared_ffn_size
    moe = 2 * h * cfg.moe_num_experts + 6 * h * experts
    return LayerFlops(hyper + attention + 4 * heads * dim * keys + moe, indexer, keys, choice, divergence)


def v4_forward_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the whole model: the layers, the head's collapse and the output layer."""
    h, n = cfg.hidden_size, cfg.hc_mult
    layers = sum(f.trained + f.indexer for f in map(lambda i: v4_layer_flops(cfg, i),
                                                    range(cfg.num_layers + cfg.mtp_layers)))
    head = 2 * n * n * h + 2 * h * cfg.vocab_size
    return layers + (1 + cfg.mtp_layers) * head + cfg.mtp_layers * 2 * (1 + n) * h * h


def v4_flops_per_token(cfg: ModelConfig, recompute: bool = False) -> float:
    """Training FLOPs per token: 3 x the forward, less the backward the indexers do not run; with recomputation the
    layers' forward once more (not the multi-token-prediction depths', which are not recomputed).

    Frozen indexers (model.index_loss_coeff = 0) run forward only: 2 x their forward is not run. A trained one reads
    its inputs detached, so its matrices get weight gradients only (1 x their forward); its choice (every entry
    scored) has no backward; its loss pass scores the chosen entries again and takes their gradient (3 x
    `divergence`).
    Not counted: the attention cores' chunks run again in the backward when a layer has several
    (`shardlm.models.compressed_core`; hardware FLOPs, as a flash kernel's)."""
    per_layer = [v4_layer_flops(cfg, i) for i in range(cfg.num_layers + cfg.mtp_layers)]
    indexers = sum(f.indexer for f in per_layer)
    if cfg.index_loss_coeff > 0:
        skipped = sum(f.indexer + f.choice - 3 * f.divergence for f in per_layer)
    else:
        skipped = 2 * indexers
    layers = sum(f.trained + f.indexer for f in per_layer[:cfg.num_layers])  # full recomputation: not the depths'
    return 3 * v4_forward_flops(cfg) - skipped + (layers if recompute else 0.0)


def hyper_connection_bytes(cfg: ModelConfig, tokens: int, residual_bytes: int) -> int:
    """Bytes one hyper-connection branch (`HyperConnection` and its `expand`) saves for the backward over `tokens`
    tokens (this rank's: b s, or b s / tp under sequence parallelism): the streams (n h) and the branch's output (h)
    in the residual dtype, the RMS-normalized flattened streams (n h) and the mixing weights in fp32, and the
    Sinkhorn-Knopp rounds' matrices and sums (2 iters - 1 divisions of n^2 by n each), with the sigmoid and softmax
    outputs 3 n^2 + 6 n + 1 fp32 values a token."""
    n, h, iters = cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters
    fp32 = n * h + (2 * iters - 1) * (n * n + n) + 3 * n * n + 6 * n + 1
    return tokens * ((n * h + h) * residual_bytes + 4 * fp32)
