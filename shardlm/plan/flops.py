"""Matmul FLOPs of a model configuration: per token of training (`flops_per_token`, the model FLOPs that MFU and the
planner read), per step (`flops_per_step`), and MLA's attention weights (`mla_weights`)."""

from __future__ import annotations

from shardlm.models.config import ModelConfig


def mla_weights(cfg: ModelConfig) -> int:
    """Entries of one MLA layer's matrices: q_a and q_b (or q), kv_a, kv_b and o (norms excluded; a sparse-attention
    layer's indexer is not among them: `shardlm.plan.sparse_attention`)."""
    h, heads, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (h + heads * qk) * cfg.q_lora_rank if cfg.q_lora_rank else h * heads * qk
    kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + kv_b
    return q + kv + heads * cfg.v_head_dim * h


def flops_per_token(cfg: ModelConfig, recompute: bool = False) -> float:
    """Matmul FLOPs of training on one token (forward + backward = 3 x forward) of a GPT.

    Forward per token: 24 l h^2 (QKV, projection and the 4h MLP) + 4 l s h (QK^T and AV over the
    full sequence) + 2 h V (LM head), so training is 72 l h^2 (1 + s/6h + V/12lh). The paper's
    later formula writes V/16lh, which leaves out part of the LM head's backward; we count all of it.
    With activation recomputation the layers' forward runs twice: + 24 l h^2 + 4 l s h (hardware
    FLOPs; throughput figures use the model FLOPs, recompute=False).

    arch="llama" counts its own matrices: q and o (h x a each, a = num_heads x head_dim, which is h unless
    head_dim is set; q is 2a x h with `attention_output_gate`, the gate's rows), k and v (h x num_kv_heads x
    head_dim each, smaller under grouped-query attention) and SwiGLU's three h x f matrices, so a layer's forward
    is 2 (2 h a + 2 h kv + 3 h f) + 4 s a per token (kv = num_kv_heads x head_dim); on a sliding-window layer
    the keys a query sees are min(s, window), so its score and value products count 4 min(s, window) a. With MLA
    (attention = "mla") the attention matrices are `mla_weights` and the score and value products
    2 s H (qk_nope + qk_rope) + 2 s H v_head_dim. With DeepSeek Sparse Attention (`index_topk` > 0) those products
    are the absorbed attention over min(s, index_topk) chosen keys (all s, dense, in the warm-up stage), and a
    layer with its own lightning indexer adds the indexer's matrices, its O(s) scoring per token and its KL pass,
    which do not train at 3x their forward (`shardlm.plan.sparse_attention.sparse_attention_flops` has the
    formulas).

    A linear-attention (Gated DeltaNet) layer (`cfg.is_linear_layer`; n_k, n_v key and value heads of d_k, d_v
    channels) counts its projections q, k (h x n_k d_k each), v, z (h x n_v d_v each), b, a (h x n_v each) and o
    (n_v d_v x h), 2 FLOPs per weight, and instead of attention's 4 s a the chunked gated delta rule
    (`shardlm.models.delta_rule.chunk_gated_delta_rule`, chunks of C = 64 tokens), linear in s: per chunk and
    value head its matmuls are K_beta K^T and Q K^T (2 C^2 d_k each), the two unit-triangular solves for U and W
    (C^2 d_v and C^2 d_k), W S, Q_read S and K_write^T (U - W S) (2 C d_k d_v each) and the chunk's attention
    times U - W S (2 C^2 d_v): per token and value head 5 C d_k + 3 C d_v + 6 d_k d_v (the depthwise
    convolution, the gates and the norms are not matmuls; a last chunk padded to C is not counted).

    A Kimi Delta Attention layer (`linear_attention_rule = "kimi_delta"`, H heads of d channels; Kimi Linear's
    beside MLA) counts its projections q, k, v (h x H d each), b (h x H), the low-rank forget and output gates f_a,
    g_a (h -> d) and f_b, g_b (d -> H d), o (H d x h), 2 FLOPs per weight (`shardlm.plan.recurrent.kda_weights`),
    and its chunked rule (`shardlm.models.kda_rule.chunk_kda_rule`, C = 64): per chunk and head the two C x C
    products of `pairwise` (the system and Q K^T, 2 C^2 d each; the decays inside a sub-block are elementwise),
    the two solves (C^2 d each), W S, Q_read S, K_write^T (U - W S) (2 C d^2 each) and the attention times
    U - W S (2 C^2 d): per token and head 8 C d + 6 d^2.

    Nemotron-H (`layer_pattern`) counts each block's one mixer (`shardlm.plan.recurrent.pattern_layer_flops`):
    Mamba-2 ("M"; H heads of P channels, G groups of N state channels, chunks of L = `mamba_chunk_size`) its
    projections z, x (h x H P each), B, C (h x G N each), dt (h x H) and o (H P x h), 2 FLOPs per weight, and the
    chunked scan (`shardlm.models.ssd.chunk_scan`): per chunk and group C B^T (2 L^2 N), per chunk and head the
    decayed scores times x dt (2 L^2 P), the chunk's state (2 L P N) and what its tokens read of the incoming one
    (2 L N P), so per token 2 L N G + H (2 L P + 4 P N); attention ("*", no positions) 2 (2 h a + 2 h kv) +
    4 s a; the ReLU^2 MLP ("-") 4 h f; an MoE layer ("E") the router 2 h E and its top-k and shared ReLU^2 experts,
    4 h f_e and 4 h f_s each; plus the output head 2 h V. Training is 3 x forward.

    An MoE layer counts what a token activates: its top-k experts' MLPs (2 or 3 h x f_e matrices each, f_e = the
    expert width), the shared experts' (their width, `shared_ffn_size`; with `moe_shared_expert_gate` their h x 1
    gate) and the router's h x E gate, instead of the dense MLP. Each multi-token-prediction depth (`mtp_layers`)
    adds its 2h x h projection, one more layer of its index's kind (full attention in a hybrid model) and the
    output head."""
    if cfg.sandwich_norms:  # Gemma 4: its two kinds of layer, KV sharing, per-layer inputs, experts beside the MLP
        from shardlm.models.gemma_config import gemma_flops_per_token

        return gemma_flops_per_token(cfg, recompute)
    if cfg.hc_mult:  # DeepSeek-V4: shardlm.plan.deepseek_v4 has its formulas
        from shardlm.plan.deepseek_v4 import v4_flops_per_token

        return v4_flops_per_token(cfg, recompute)
    from shardlm.plan import recurrent

    if cfg.layer_pattern:  # Nemotron-H: one mixer a block
        layer_forward = sum(recurrent.pattern_layer_flops(cfg, i) for i in range(cfg.num_layers))
        return 3 * (layer_forward + 2 * cfg.hidden_size * cfg.vocab_size) + (layer_forward if recompute else 0.0)
    kda = 2 * recurrent.kda_weights(cfg) + recurrent.kda_rule_flops_per_token(cfg)  # a KDA layer's mixer
    s, layers, h, v = cfg.seq_length, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    ffn_ratio = cfg.ffn_size / h
    layer_forward = layers * (2 * (3 + 1 + 2 * ffn_ratio) * h * h + 4 * s * h)
    layer_flops = None  # forward FLOPs of layer i (before its MoE change), where the layers differ
    if cfg.arch == "llama" and cfg.attention != "mla":
        a = cfg.num_heads * cfg.attention_head_dim
        kv = cfg.kv_heads * cfg.attention_head_dim
        q = 2 * a if cfg.attention_output_gate else a
        nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        chunk = 64  # shardlm.models.delta_rule.CHUNK
        linear = 2 * h * (2 * nk * dk + 2 * nv * dv + 2 * nv + nv * dv) + nv * (5 * chunk * dk + 3 * chunk * dv
                                                                                 + 6 * dk * dv)
        if cfg.linear_attention_rule == "kimi_delta":
            linear = kda

        def layer_flops(i: int) -> float:
            if cfg.is_linear_layer(i):
                attention = linear
            else:
                keys = min(s, cfg.sliding_window) if cfg.is_sliding_layer(i) else s
                attention = 2 * (h * q + 2 * h * kv + h * a) + 4 * keys * a
            return attention + 2 * 3 * h * cfg.ffn_size

        layer_forward = sum(layer_flops(i) for i in range(layers))
    sparse = None  # DeepSeek Sparse Attention: a layer's attention core and indexer, by index
    if cfg.arch == "llama" and cfg.attention == "mla":
        heads, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        weights = 2 * (mla_weights(cfg) + 3 * h * cfg.ffn_size)
        if cfg.index_topk:
            from shardlm.plan.sparse_attention import sparse_attention_flops as sparse

        def layer_flops(i: int) -> float:
            if recurrent.is_kda_layer(cfg, i):  # Kimi Linear: KDA beside MLA
                return kda + 2 * 3 * h * cfg.ffn_size
            return weights + (sparse(cfg, i).forward if sparse else 2 * s * heads * (qk + cfg.v_head_dim))

        layer_forward = sum(layer_flops(i) for i in range(layers))
    one_layer = layer_forward / layers
    moe_change = 0.0  # what an MoE layer adds to (or saves from) a dense one
    if cfg.moe_num_experts:
        matrices = 3 if cfg.arch == "llama" else 2
        active = cfg.moe_top_k * cfg.moe_ffn_size + (cfg.shared_ffn_size if cfg.moe_shared_experts else 0)
        gate = 1 if cfg.moe_shared_experts and cfg.moe_shared_expert_gate else 0
        moe_change = 2 * h * (matrices * (active - cfg.ffn_size) + cfg.moe_num_experts + gate)
        layer_forward += sum(cfg.is_moe_layer(i) for i in range(layers)) * moe_change
    # multi-token prediction: per depth eh_proj (2h -> h), one more layer of its index's kind, the output head
    mtp = sum(4 * h * h + (layer_flops(layers + k) if layer_flops else one_layer)
              + (moe_change if cfg.is_moe_layer(layers + k) else 0.0) + 2 * h * v for k in range(cfg.mtp_layers))
    forward = layer_forward + 2 * h * v + mtp
    # the indexers train at less than 3x their forward: count their own backward (`sparse_attention_flops`)
    own_backward = sum(sparse(cfg, i).backward - 2 * sparse(cfg, i).forward
                       for i in range(layers + cfg.mtp_layers)) if sparse else 0
    return 3 * forward + own_backward + (layer_forward if recompute else 0.0)


def flops_per_step(cfg: ModelConfig, global_batch: int, recompute: bool = False) -> float:
    """Matmul FLOPs of one optimizer step: `flops_per_token` x global batch x sequence length."""
    return flops_per_token(cfg, recompute) * global_batch * cfg.seq_length
