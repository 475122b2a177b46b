"""The parameters one rank of shardlm's models holds, derived from the code: which weights `shardlm.models.gpt`,
`shardlm.models.llama` and `shardlm.models.mla` split over the TP group (fused QKV and the first MLP GEMM by
columns, with their biases; the residual projections by rows; the vocabulary embedding and the output layer by
rows of the padded vocabulary) and which they replicate (norms, the row-parallel biases, learned positions); MoE
layers' routers, experts (1/EP of them, split over TP) and shared experts (`_mlp_count`); Qwen3-Next's and Qwen3.5's
Gated DeltaNet layers (`_linear_attention_count`, `shardlm.models.linear_attention`) and gated full attention;
Kimi Linear's and Nemotron-H's (`recurrent.recurrent_parameter_count`); one layer of each kind
(`layer_parameter_count`) and the multi-token-prediction depths (`mtp_parameter_count`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.plan.sparse_attention import has_indexer


@dataclass(frozen=True)
class ParameterCount:
    """Parameter elements held by one TP rank."""

    sharded: int
    """Elements of split weights (this rank's shard)."""
    replicated: int
    """Elements of weights every TP rank holds in full."""
    tensors: int
    """Number of parameter tensors (the optimizer keeps one `step` scalar per tensor)."""
    matrix: int
    """Elements of this rank's GEMM weights inside the layers (autocast saves half copies of them)."""
    expert: int = 0
    """Elements of routed-expert weights among `sharded` (split over TP and EP; their gradients are reduced,
    and with the distributed optimizer their state sharded, over expert-DP = DP / EP ranks, not DP)."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    @property
    def dense(self) -> int:
        """Elements of every weight that is not a routed expert's (reduced and sharded over DP)."""
        return self.total - self.expert


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise UserError(f"{what}={size} is not divisible by tensor parallel size {tp}")
    return size // tp


def _mlp_count(cfg: ModelConfig, index: int, tp: int, ep: int, gated: bool) -> ParameterCount:
    """Parameters of layer `index`'s MLP on one rank. Dense: gated (Llama) gate and up (f x h) split by
    rows and down (h x f) by columns, no biases; GPT fc (f x h + f) by rows, proj (h x f) by columns
    with its h bias replicated. MoE (`cfg.is_moe_layer`): the router (E x h, and E expert biases with
    aux-loss-free balancing) replicated; E / ep experts of width f_e, split over TP like a dense MLP
    without biases; shared experts one dense MLP of their width (`cfg.shared_ffn_size`), with
    `moe_shared_expert_gate` its (1, h) sigmoid gate replicated (Qwen3-Next, Qwen3.5)."""
    h = cfg.hidden_size

    def dense(width: int) -> ParameterCount:
        f_local = _split(width, tp, "ffn size")
        if gated:
            return ParameterCount(3 * f_local * h, 0, 3, 3 * f_local * h)
        return ParameterCount(2 * f_local * h + f_local, h, 4, 2 * f_local * h)

    if not cfg.is_moe_layer(index):
        return dense(cfg.ffn_size)
    experts = cfg.moe_num_experts
    if experts % ep:
        raise UserError(f"model.moe_num_experts={experts} is not divisible by parallel.expert={ep}")
    f_local = _split(cfg.moe_ffn_size, tp, "expert ffn size")
    matrices = (3 if gated else 2) * (experts // ep) * f_local * h
    bias = experts if cfg.moe_expert_bias_rate > 0 or cfg.moe_expert_bias else 0  # as `Router` builds it
    bias += experts if cfg.moe_router_bias else 0  # gpt-oss: a bias on the gate logits
    # gpt-oss: per local expert a gate/up bias split with its columns and a down bias of h
    linear_bias = (experts // ep) * ((2 if gated else 1) * f_local + h) if cfg.moe_linear_bias else 0
    tensors = 1 + (cfg.moe_expert_bias_rate > 0 or cfg.moe_expert_bias) + cfg.moe_router_bias \
        + (3 if gated else 2) + 2 * cfg.moe_linear_bias
    count = ParameterCount(matrices + linear_bias, experts * h + bias, tensors, matrices, matrices + linear_bias)
    if cfg.moe_shared_experts:
        count = add_counts(count, dense(cfg.shared_ffn_size))
        if cfg.moe_shared_expert_gate:
            count = add_counts(count, ParameterCount(0, h, 1, 0))
    return count


def add_counts(a: ParameterCount, b: ParameterCount, sign: int = 1) -> ParameterCount:
    """a + sign x b, field by field."""
    return ParameterCount(a.sharded + sign * b.sharded, a.replicated + sign * b.replicated,
                          a.tensors + sign * b.tensors, a.matrix + sign * b.matrix, a.expert + sign * b.expert)


def _mlps(cfg: ModelConfig, tp: int, ep: int, gated: bool) -> ParameterCount:
    """Every layer's MLP (`_mlp_count`) on one rank, summed."""
    total = ParameterCount(0, 0, 0, 0)
    for index in range(cfg.num_layers):
        total = add_counts(total, _mlp_count(cfg, index, tp, ep, gated))
    return total


def parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of `shardlm.models.gpt.GPT` at tensor-parallel size `tp` (and expert-parallel
    size `ep`, which splits the experts of MoE layers).

    Per layer: QKV (3h x h weight + 3h bias) split by columns, the attention output projection (h x h)
    split by rows with its h bias replicated, two LayerNorms (2h each) replicated, and the MLP
    (`_mlp_count`: fc f x h + f by columns, proj h x f by rows with its bias replicated; or an MoE
    layer). Outside: the vocabulary embedding (V_padded x h, V_padded a multiple of 128 x tp) split
    by rows and tied to the LM head, positions (s x h) and the final LayerNorm replicated. arch="bert"
    counts `shardlm.models.bert.BERT`: the same layers and embeddings plus token types (2 x h), pooler
    and LM-head transform (h x h + h each), the LM-head LayerNorm, the sentence head (2 x h + 2) and
    the output bias, split like the vocabulary. Multi-token-prediction depths (`cfg.mtp_layers`) add
    `mtp_parameter_count`.
    """
    if cfg.mtp_layers:
        return add_counts(parameter_count(replace(cfg, mtp_layers=0), tp, ep), mtp_parameter_count(cfg, tp, ep))
    if cfg.arch == "llama":
        return _llama_parameter_count(cfg, tp, ep)
    h, layers = cfg.hidden_size, cfg.num_layers
    h_local = _split(h, tp, "hidden_size")
    vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
    matrix = 3 * h_local * h + h * h_local
    layer_sharded = matrix + 3 * h_local
    layer_replicated = 2 * h + 2 * h + h  # ln_1, ln_2, attention output bias
    sharded = layers * layer_sharded + vocab_local * h
    replicated = layers * layer_replicated + cfg.seq_length * h + 2 * h
    tensors = 8 * layers + 4
    if cfg.arch == "bert":
        sharded += vocab_local  # output-layer bias, split like the vocabulary
        replicated += 2 * h + (h * h + h) + (h * h + h) + 2 * h + (2 * h + 2)
        tensors += 10
    return add_counts(ParameterCount(sharded, replicated, tensors, layers * matrix), _mlps(cfg, tp, ep, gated=False))


def _kv_rows(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(rows of the k (or v) weight a rank holds, rows its GEMM uses) of `shardlm.models.llama`: num_kv_heads x
    head_dim split over TP when TP divides num_kv_heads, else held whole and only the heads of the rank's
    query heads used (rank 0's count)."""
    from shardlm.models.llama import kv_head_range, kv_heads_are_split

    head_dim = cfg.attention_head_dim
    first, last = kv_head_range(cfg.num_heads, cfg.kv_heads, tp, 0)
    used = (last - first) * head_dim
    return (used, used) if kv_heads_are_split(cfg.kv_heads, tp) else (cfg.kv_heads * head_dim, used)


def _mla_count(cfg: ModelConfig, tp: int) -> ParameterCount:
    """One layer's attention and two RMSNorms in `shardlm.models.mla.LatentAttention` on one TP rank (H heads,
    qk = qk_nope + qk_rope): q_a (q_lora_rank x h) with its RMSNorm (q_lora_rank) and kv_a ((kv_lora_rank +
    qk_rope) x h) with its RMSNorm (kv_lora_rank) replicated; q_b (H qk x q_lora_rank; or q, H qk x h, without
    the query's low-rank path) and kv_b (H (qk_nope + v_head_dim) x kv_lora_rank) split by rows over TP, o (h x H
    v_head_dim) by columns; the layer's two RMSNorms (h each) replicated. Its matrices sum to
    `plan.flops.mla_weights` at TP = 1."""
    h, q_rank, kv_rank = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    heads = _split(cfg.num_heads, tp, "num_heads")
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    sharded = heads * qk * (q_rank or h) + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * kv_rank \
        + h * heads * cfg.v_head_dim
    replicated_matrices = (q_rank * h if q_rank else 0) + (kv_rank + cfg.qk_rope_head_dim) * h
    replicated = replicated_matrices + q_rank + kv_rank + 2 * h
    tensors = (3 if q_rank else 1) + 3 + 1 + 2
    return ParameterCount(sharded, replicated, tensors, sharded + replicated_matrices)


def _indexer_count(cfg: ModelConfig) -> ParameterCount:
    """One layer's lightning indexer (DeepSeek Sparse Attention, `shardlm.models.sparse_attention.Indexer`),
    replicated on every TP rank: wq_b (H_i D x q_lora_rank), wk (D x h), k_norm (a LayerNorm of D with its bias)
    and weights_proj (H_i x h); H_i = index_heads, D = index_head_dim."""
    h, heads, dim = cfg.hidden_size, cfg.index_heads, cfg.index_head_dim
    matrices = heads * dim * cfg.q_lora_rank + dim * h + heads * h
    return ParameterCount(0, matrices + 2 * dim, 5, matrices)


def _linear_attention_count(cfg: ModelConfig, tp: int) -> ParameterCount:
    """One Gated DeltaNet layer (`shardlm.models.linear_attention.GatedDeltaNet`) and its two RMSNorms on one TP
    rank (n_k, n_v key and value heads of d_k, d_v channels, both head counts split over TP): q and k (n_k d_k x h
    each), v and z (n_v d_v x h each), b and a (n_v x h each) split by rows, o (h x n_v d_v) by columns; the
    depthwise convolutions of q, k and v ((2 n_k d_k + n_v d_v) x kernel), A_log and dt_bias (n_v each) split with
    their heads; the gated norm's weight (d_v) and the block's two RMSNorms (h each) replicated."""
    h, dk, dv = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    key_heads = _split(cfg.linear_num_key_heads, tp, "linear_num_key_heads")
    value_heads = _split(cfg.linear_num_value_heads, tp, "linear_num_value_heads")
    matrices = (2 * key_heads * dk + 2 * value_heads * dv + 2 * value_heads) * h + h * value_heads * dv
    conv = (2 * key_heads * dk + value_heads * dv) * cfg.linear_conv_kernel
    return ParameterCount(matrices + conv + 2 * value_heads, dv + 2 * h, 7 + 3 + 2 + 1 + 2, matrices)


def _full_attention_count(cfg: ModelConfig, tp: int) -> ParameterCount:
    """One layer's grouped-query attention and two RMSNorms on one TP rank (`_llama_parameter_count`)."""
    h = cfg.hidden_size
    a_local = _split(cfg.num_heads * cfg.attention_head_dim, tp, "attention width")
    q_local = a_local * (2 if cfg.attention_output_gate else 1)  # Qwen3-Next: each head's queries, then its gate
    kv_held, kv_used = _kv_rows(cfg, tp)
    kv_split = kv_held == kv_used and cfg.kv_heads % tp == 0
    sharded = (q_local + a_local) * h + (2 * kv_held * h if kv_split else 0)
    norms = 2 if cfg.qk_norm else 0
    replicated = 2 * h + (0 if kv_split else 2 * kv_held * h)
    if cfg.qk_norm and cfg.qk_norm_scope == "projection":  # OLMo: q's norm split with its heads, k's with its rows
        sharded += a_local + (kv_held if kv_split else 0)
        replicated += 0 if kv_split else cfg.kv_heads * cfg.attention_head_dim
    else:  # one head's channels each, on every rank
        replicated += norms * cfg.attention_head_dim
    biases = 3 if cfg.attention_bias else 0  # q (split with its heads), k and v (split or replicated as their weights)
    if biases:
        sharded += q_local + (2 * kv_held if kv_split else 0)
        replicated += 0 if kv_split else 2 * kv_held
    if cfg.attention_output_bias:  # o's bias, added after the row-parallel reduction: replicated
        replicated += h
        biases += 1
    if cfg.attention_sinks:  # one learned logit per query head, split with the heads
        sharded += _split(cfg.num_heads, tp, "num_heads")
        biases += 1
    return ParameterCount(sharded, replicated, 6 + norms + biases, (q_local + a_local) * h + 2 * kv_used * h)


def _times(count: ParameterCount, n: int) -> ParameterCount:
    """n x count, field by field."""
    return ParameterCount(*(n * getattr(count, f) for f in ("sharded", "replicated", "tensors", "matrix", "expert")))


def _llama_parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of `shardlm.models.llama.Llama`: q (a x h, a = num_heads x head_dim, h unless head_dim
    is set; 2a x h with `attention_output_gate`, each head's queries then its gate) split by rows, o (h x a) by
    columns, k and v (num_kv_heads x head_dim x h each) split or replicated (see `_kv_rows`), two RMSNorm weights
    per layer (and the q and k norms of head_dim each with qk_norm) and the final one replicated, the SwiGLU MLP
    or MoE layer (`_mlp_count`), the embedding and the untied output layer (V_padded x h each) split by
    vocabulary rows; q/k/v biases with `attention_bias` (GLM-4.5), o's bias (replicated) and per-head sinks
    (split) with `attention_output_bias` and `attention_sinks` (gpt-oss). With multi-head latent attention the
    layer's attention is `_mla_count`'s, plus `_indexer_count` on each layer that runs its own indexer under sparse
    attention (`sparse_attention.has_indexer`: not GLM-5's "shared" layers); a linear-attention layer's
    (`cfg.is_linear_layer`) is `_linear_attention_count`'s."""
    if cfg.hc_mult:  # DeepSeek-V4: hyper-connections, compressed attention, hash-routed MoE
        from shardlm.plan.deepseek_v4 import v4_parameter_count

        return v4_parameter_count(cfg, tp, ep)
    if cfg.sandwich_norms:  # Gemma 4's layers
        from shardlm.plan.gemma import gemma_parameter_count

        return gemma_parameter_count(cfg, tp, ep)
    if cfg.layer_pattern or cfg.linear_attention_rule == "kimi_delta":  # Nemotron-H's blocks, Kimi Linear's KDA
        from shardlm.plan.recurrent import recurrent_parameter_count

        return recurrent_parameter_count(cfg, tp, ep)
    h, layers = cfg.hidden_size, cfg.num_layers
    vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
    outputs = 1 if cfg.tie_embeddings else 2
    ends = ParameterCount(outputs * vocab_local * h, h, 1 + outputs, 0)  # embedding, output layer, final norm
    if cfg.attention == "mla":
        attention = _times(_mla_count(cfg, tp), layers)
        indexers = sum(has_indexer(cfg, i) for i in range(layers))
        if indexers:
            attention = add_counts(attention, _times(_indexer_count(cfg), indexers))
    else:
        linear = sum(cfg.is_linear_layer(i) for i in range(layers))
        attention = _times(_full_attention_count(cfg, tp), layers - linear)
        if linear:
            attention = add_counts(attention, _times(_linear_attention_count(cfg, tp), linear))
    return add_counts(add_counts(attention, ends), _mlps(cfg, tp, ep, gated=True))


def layer_parameter_count(cfg: ModelConfig, index: int, tp: int, ep: int = 1) -> ParameterCount:
    """Layer `index`'s parameters on one (TP, EP) rank: dense or MoE (`cfg.is_moe_layer`), linear or full
    attention (`cfg.is_linear_layer`; a multi-token-prediction depth, index >= num_layers, has full attention),
    with or without a sparse-attention indexer (`sparse_attention.has_indexer`). A one-layer model of its kind less
    the model without layers; DeepSeek-V4's: `deepseek_v4.v4_layer_count`."""
    if cfg.hc_mult:
        from shardlm.plan.deepseek_v4 import v4_layer_count

        return v4_layer_count(cfg, index, tp, ep)
    base = replace(cfg, mtp_layers=0)
    kind = replace(base, num_layers=1, layer_types=["linear_attention"] if cfg.is_linear_layer(index) else [],
                   index_layer_types=[], index_topk=cfg.index_topk if has_indexer(cfg, index) else 0,
                   layer_pattern=cfg.layer_pattern[index:index + 1])
    if cfg.is_moe_layer(index):
        kind = replace(kind, moe_first_dense_layers=0, moe_layer_interval=1)
    else:
        kind, ep = replace(kind, moe_num_experts=0), 1
    empty = replace(_with_layers(base, 0), layer_pattern="")
    return add_counts(parameter_count(kind, tp, ep), parameter_count(empty, tp, ep), sign=-1)


def layers_parameter_count(cfg: ModelConfig, indices, tp: int, ep: int = 1) -> ParameterCount:
    """The layers `indices` together on one (TP, EP) rank (`layer_parameter_count`, one per kind)."""
    kinds: dict[tuple, ParameterCount] = {}
    total = ParameterCount(0, 0, 0, 0)
    for index in indices:
        key = parameter_kind(cfg, index)
        if key not in kinds:
            kinds[key] = layer_parameter_count(cfg, index, tp, ep)
        total = add_counts(total, kinds[key])
    return total


def parameter_kind(cfg: ModelConfig, index: int) -> tuple:
    """What sets layer `index`'s parameters apart (layers of one kind hold the same ones): MoE or dense (first),
    linear or full attention, a sparse-attention indexer or none, Nemotron-H's block kind ("M", "*", "-" or "E") and
    DeepSeek-V4's attention and hash routing (`v4_layer_kind`)."""
    return (cfg.is_moe_layer(index), cfg.is_linear_layer(index), has_indexer(cfg, index),
            cfg.layer_pattern[index:index + 1], v4_layer_kind(cfg, index))


def v4_layer_kind(cfg: ModelConfig, index: int) -> tuple | None:
    """What sets a DeepSeek-V4 layer's parameters apart (its compress ratio and attention kind, hash routing);
    None for other models."""
    if not cfg.hc_mult:
        return None
    from shardlm.plan.deepseek_v4 import layer_kinds, layer_ratios

    return layer_ratios(cfg)[index], layer_kinds(cfg)[index], index < cfg.moe_hash_layers


def layer_parameter_counts(cfg: ModelConfig, tp: int, ep: int = 1) -> tuple[ParameterCount, ParameterCount]:
    """(a dense layer's, an MoE layer's) parameters on one (TP, EP) rank, both with full attention (equal for a
    dense model); a given layer's, linear attention included: `layer_parameter_count`."""
    dense = layer_parameter_count(replace(cfg, moe_num_experts=0), cfg.num_layers, tp)
    if not cfg.moe_num_experts:
        return dense, dense
    return dense, layer_parameter_count(replace(cfg, moe_first_dense_layers=0, moe_layer_interval=1), cfg.num_layers,
                                        tp, ep)


def mtp_parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Per-rank parameters of the `cfg.mtp_layers` depths (without the shared embedding and head): per depth the
    layer of index L + k as `layer_parameter_count` counts it (full attention, also in a hybrid model: Qwen3-Next's
    and Qwen3.5's depth is a gated full-attention layer), eh_proj (h x 2h) and three norms of h; DeepSeek-V4's:
    `deepseek_v4.v4_depth_count`."""
    if cfg.hc_mult:  # DeepSeek-V4's depths
        from shardlm.plan.deepseek_v4 import v4_depth_count

        return v4_depth_count(cfg, tp, ep)
    h = cfg.hidden_size
    own = ParameterCount(0, 2 * h * h + 3 * h, 4, 2 * h * h)
    total = ParameterCount(0, 0, 0, 0)
    for k in range(cfg.mtp_layers):
        total = add_counts(total, add_counts(layer_parameter_count(cfg, cfg.num_layers + k, tp, ep), own))
    return total


def _with_layers(cfg: ModelConfig, layers: int) -> ModelConfig:
    return replace(cfg, num_layers=layers)
