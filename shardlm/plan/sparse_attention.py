"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) in the planner: what a layer's lightning indexer and its
top-k attention cost (`sparse_attention_flops`), which layers hold an indexer (`has_indexer`), and the per-token
comparison with dense MLA of docs/plan-sparse-attention.md (`attention_comparison`).

The count keeps the planner's square convention (`windows`): a dense layer counts each query against all s keys.
A DSA layer counts each query against min(s, index_topk) keys, and that is also what shardlm executes
(`shardlm.models.sparse_attention`): every query gathers min(k, S) keys, a query with fewer visible keys padded
with masked ones, and the indexer scores every query against all s keys of its row (masked, not skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.config import ModelConfig


def has_indexer(cfg: ModelConfig, index: int) -> bool:
    """Whether layer `index` (a multi-token-prediction depth's too, index >= num_layers) runs its own lightning
    indexer: sparse attention is on and the layer is "full" (GLM-5's "shared" layers reuse an earlier choice)."""
    return bool(cfg.index_topk) and cfg.index_source(index) == index


@dataclass(frozen=True)
class SparseAttentionFlops:
    """Matmul FLOPs per token of one DSA layer's attention core and lightning indexer (`sparse_attention_flops`)."""

    keys: int
    """Keys each query attends to: min(s, index_topk); s in the dense warm-up."""
    per_key: int
    """Forward FLOPs of one query against one key: MLA absorbed, 2 H (r + rope) + 2 H r; in the warm-up dense
    MLA's 2 H (qk_nope + qk_rope + v)."""
    indexer_weights: int
    """Entries of the indexer's matrices that run: wq_b, wk and weights_proj (0 on a shared layer, and in the
    warm-up when the indexer does not train)."""
    scoring: int
    """Forward FLOPs of the indexer's choice: every query against all s keys, 2 H_i (D + 1) s (no backward)."""
    target: int
    """Forward FLOPs of the warm-up's target, the absorbed scores against all s keys (no backward)."""
    divergence: int
    """Forward FLOPs of the indexer's KL pass over its keys, 2 H_i (D + 1) keys (0 when it does not train)."""

    @property
    def attention(self) -> int:
        """Forward FLOPs of the attention core over its keys."""
        return self.keys * self.per_key

    @property
    def forward(self) -> int:
        return self.attention + 2 * self.indexer_weights + self.scoring + self.target + self.divergence

    @property
    def backward(self) -> int:
        """The core's 2x; a trained indexer's weight gradients (its inputs are detached) and its KL pass's 2x."""
        trained = 2 * self.indexer_weights + 2 * self.divergence if self.divergence else 0
        return 2 * self.attention + trained

    @property
    def training(self) -> int:
        return self.forward + self.backward


def sparse_attention_flops(cfg: ModelConfig, index: int) -> SparseAttentionFlops | None:
    """Layer `index`'s sparse-attention FLOPs per token (what replaces dense MLA's 2 s H (qk_nope + qk_rope + v)
    score and value products), or None without sparse attention (`index_topk` = 0). H heads, r = kv_lora_rank,
    rope = qk_rope_head_dim, s = seq_length, k = index_topk, H_i = index_heads, D = index_head_dim:

    - attention: each query against K = min(s, k) chosen keys, absorbed: scores over the latent and the shared RoPE
      key, 2 H (r + rope), and the output p c, 2 H r, per key; 3x in training. (The absorption itself, q_nope W_UK
      and (p c) W_UV^T, is kv_b's 2 H r (qk_nope + v) per token, which `mla_weights` counts already.)
    - indexer, on a layer that runs one (`has_indexer`): its matrices wq_b (q_lora_rank x H_i D), wk (h x D) and
      weights_proj (h x H_i), 2 FLOPs per entry forward, and when it trains (`index_loss_coeff` > 0) their weight
      gradients, 2 per entry (its inputs are detached, so no input gradients); the choice, each query against all
      s keys, 2 H_i D s for q . k and 2 H_i s for the head weights, forward only (no gradient flows through
      top-k); when it trains, the KL pass scores the K chosen keys again, 2 H_i (D + 1) K, and 2x that backward.
    - the dense warm-up (`index_stage` = "warmup"): dense MLA's attention over all s keys, and on a layer with an
      indexer, when it trains, its matrices, no choice, the target (the absorbed query, 2 H qk_nope r, and its
      scores against all s latents, 2 H (r + rope) s, forward only) and the KL pass over all s keys.

    A "shared" layer (GLM-5) has the attention term only. Not counted: the chunks' recomputation in the backward
    (hardware FLOPs, as a flash kernel's), softmax, ReLU, RoPE and the norms; the warm-up's frozen weights are
    counted as if they trained (3x)."""
    if not cfg.index_topk:
        return None
    s, heads, r, rope = cfg.seq_length, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    warmup = cfg.index_stage == "warmup"
    keys = s if warmup else min(s, cfg.index_topk)
    per_key = 2 * heads * (cfg.qk_nope_head_dim + rope + cfg.v_head_dim) if warmup else 2 * heads * (2 * r + rope)
    trains = cfg.index_loss_coeff > 0
    if not has_indexer(cfg, index) or (warmup and not trains):
        return SparseAttentionFlops(keys, per_key, 0, 0, 0, 0)
    index_heads, dim, h = cfg.index_heads, cfg.index_head_dim, cfg.hidden_size
    weights = cfg.q_lora_rank * index_heads * dim + h * dim + h * index_heads
    scoring = 0 if warmup else 2 * index_heads * (dim + 1) * s
    target = 2 * heads * cfg.qk_nope_head_dim * r + 2 * heads * (r + rope) * s if warmup else 0
    divergence = 2 * index_heads * (dim + 1) * keys if trains else 0
    return SparseAttentionFlops(keys, per_key, weights, scoring, target, divergence)


@dataclass(frozen=True)
class AttentionComparison:
    """Training FLOPs per token of the whole model's attention cores and indexers: dense MLA against DSA."""

    dense_attention: int
    """Dense MLA over all s keys: 3 x 2 s H (qk_nope + qk_rope + v) per layer."""
    sparse_attention: int
    """DSA's core over the chosen keys, 3x its forward, every layer."""
    indexer_scoring: int
    """The indexers' choice over all s keys (forward only): the O(s^2) part per sequence."""
    indexer_rest: int
    """The indexers' matrices and KL pass (and the warm-up's target), forward and backward."""
    model_dense: float
    """`flops_per_token` of the model with index_topk = 0 (dense MLA)."""
    model_sparse: float
    """`flops_per_token` of the model as given."""

    @property
    def sparse_total(self) -> int:
        return self.sparse_attention + self.indexer_scoring + self.indexer_rest

    @property
    def indexer_share(self) -> float:
        """The indexers' part of DSA's attention-and-indexer FLOPs."""
        return (self.indexer_scoring + self.indexer_rest) / self.sparse_total


def attention_comparison(cfg: ModelConfig) -> AttentionComparison:
    """Dense MLA against DSA for `cfg` (a model with `index_topk` set), over its layers and MTP depths, per token
    of training (no recomputation)."""
    from dataclasses import replace

    from shardlm.plan.flops import flops_per_token

    layers = range(cfg.num_layers + cfg.mtp_layers)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    dense = 3 * len(layers) * 2 * cfg.seq_length * cfg.num_heads * (qk + cfg.v_head_dim)
    parts = [sparse_attention_flops(cfg, i) for i in layers]
    sparse = sum(3 * p.attention for p in parts)
    scoring = sum(p.scoring for p in parts)
    rest = sum(p.training for p in parts) - sparse - scoring
    return AttentionComparison(dense, sparse, scoring, rest, flops_per_token(replace(cfg, index_topk=0)),
                               flops_per_token(cfg))
