"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): a lightning indexer picks each query's keys, and MLA
attends to those only.

The indexer, as transformers' `DeepseekV32Indexer` computes it (per query t and earlier key s):

    q_i = wq_b(q latent)  (B, T, H_i, D)       k_i = LayerNorm(wk(x))  (B, T, D)   (RoPE on the first `rope` channels)
    w   = weights_proj(x) (B, T, H_i)
    I[t, s] = sum_h  w[t, h] H_i^-1/2 . ReLU(q_i[t, h] . k_i[s] D^-1/2)

Each query keeps the `index_topk` keys of highest I among the keys it may see (causal, inside its packed
document), ties broken towards the earlier key, so the choice does not depend on the tensor shapes it was
computed in; a query with fewer keys keeps them all. MLA then attends to the chosen keys in its absorbed
form (`shardlm.models.mla`): the scores are [q_n W_UK | RoPE(q_r)] . [c | RoPE(k_r)] against the chosen
latents, the output (p c) W_UV^T, so per query only k latents of kv_lora_rank + rope channels are read,
never T expanded keys per head. Queries run in chunks, each recomputed in the backward, so memory grows
with T x k, not T^2. A chunk whose queries see at most `DENSE_SPAN` x k keys (a row's first positions; a whole
4K row at top-2048) scores those keys densely and masks the unchosen ones: the same attention in two GEMMs
shared by the chunk's queries instead of a small product per query (the planner still counts k keys a query).

The indexer's loss (DeepSeek-V3.2's report, Megatron-Core's `compute_dsa_indexer_loss`): per query, the KL
divergence from the main attention's distribution over the chosen keys, summed over all heads and
normalized, to softmax(I) over the same keys, summed over the micro-batch's queries and divided by its
tokens, times `index_loss_coeff`; layers add. The indexer reads its inputs (the block input and the query
latent) detached, and the target is detached, so the indexer learns from this loss only and the model
from the language-model loss only. The loss joins the backward at the attention's output (as the MoE
balancing loss does) with the micro-batch loss's factor (`shardlm.training.indexer`); each chunk's gradients
are taken in the forward. In the dense warm-up stage (`index_stage = "warmup"`) the attention is dense MLA, the
loss is the KL over every visible key (its target built chunk by chunk, `dense_target`), and the training side
freezes all but the indexers.

Layouts. The indexer is replicated on every tensor-parallel rank and computes the same scores there, so
every rank chooses the same keys; the target's head sums are all-reduced over TP (each rank holds its
heads). Under sequence parallelism its key and weight projections run on the rank's chunk and are
gathered (their weights marked `sequence_parallel`). Under context parallelism the small indexer keys
(index_head_dim channels per token) and MLA's latents (kv_lora_rank + rope) of every CP rank are all-gathered,
in the row's order, so each query chooses among, and attends to, the keys of the whole row; their
gradients are reduce-scattered back. Gathering was chosen over merging per-rank top-k lists: the keys are
narrow, the tie rule needs the whole row's scores in one place, and the attention then needs the chosen
latents anyway. GLM-5's "shared" layers reuse the last full layer's choice, handed on within the forward
(`carry`); a pipeline stage must hold that layer too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardlm.data.zigzag import zigzag_positions
from shardlm.models.config import ModelConfig
from shardlm.models.documents import Documents
from shardlm.models.routing import AttachLoss
from shardlm.parallel import ParallelContext, ReplicatedLinear
from shardlm.parallel.init import param_seed

CHUNK_ELEMENTS = 1 << 23
"""Queries run in chunks of about this many elements in their largest intermediate: the scores (batch x queries x
heads x keys) or the gathered keys (batch x queries x keys x channels), whichever is wider."""


DENSE_SPAN = 4
"""A chunk of queries that sees at most this many times k keys attends to them densely, the unchosen ones masked
(`sparse_latent_attention`)."""


def query_step(batch: int, keys_per_query: int, *widths: int) -> int:
    """Queries per chunk: CHUNK_ELEMENTS over batch x keys_per_query x the widest per-key dimension (heads of the
    scores, channels of the gathered keys: MLA's r + rope = 576 channels outnumber its heads per TP rank)."""
    return max(1, CHUNK_ELEMENTS // max(1, batch * keys_per_query * max(widths)))


def keys_seen(host_rows: torch.Tensor, part: slice, keys: int, k: int) -> int:
    """How many of a row's first `keys` keys the queries at host positions `host_rows[part]` choose among and attend
    to: up to the last query (causal), at least min(k, keys) so that every chunk returns as many choices. Every index
    `select_top_k` returns for these queries is below it (the padding of a query seeing fewer than k keys is the
    earliest keys it may not see, all below k)."""
    return min(keys, max(int(host_rows[part].max()) + 1, min(k, keys)))


def check_sparse_attention(m: ModelConfig) -> str | None:
    """One line saying what is wrong with the sparse-attention keys of `m`, or None."""
    if not m.index_topk and not m.index_heads and not m.index_layer_types:
        return None
    if m.attention != "mla":
        return 'model.index_topk (DeepSeek Sparse Attention) needs model.attention = "mla"'
    if m.index_topk < 1 or m.index_heads < 1 or m.q_lora_rank < 1:
        return ("model.index_topk, model.index_heads and model.q_lora_rank must be >= 1 for DeepSeek Sparse "
                "Attention (its indexer reads the query latent)")
    if m.index_topk > m.seq_length:
        return (f"model.index_topk={m.index_topk} is larger than the row (model.seq_length={m.seq_length}): every "
                "query would attend to every key; choose index_topk below seq_length")
    if m.index_head_dim < m.qk_rope_head_dim:
        return f"model.index_head_dim={m.index_head_dim} must be at least model.qk_rope_head_dim={m.qk_rope_head_dim}"
    if m.index_stage not in ("sparse", "warmup"):
        return f'model.index_stage="{m.index_stage}" must be "sparse" or "warmup"'
    kinds = m.index_layer_types
    if kinds and (len(kinds) != m.num_layers or set(kinds) - {"full", "shared"} or kinds[0] != "full"):
        return ('model.index_layer_types needs one "full" or "shared" per layer, the first "full" '
                f"(got {len(kinds)} entries for {m.num_layers} layers)")
    if m.attention_dropout_p:
        return "model.attention_dropout (or model.dropout, which it follows) must be 0 with DeepSeek Sparse Attention"
    return None


class _GatherReplicated(torch.autograd.Function):
    """(B, T / tp, n) chunks -> (B, T, n) on every rank, for work every rank then repeats alike: the backward
    keeps this rank's chunk of the gradient (the weights before it are marked `sequence_parallel`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return torch.cat(group.all_gather(x.contiguous()), dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size, dim=1)[ctx.group.rank].contiguous(), None


def query_rows(length: int, cp, device) -> torch.Tensor:
    """(T_local,) int64: the positions in the whole row of this rank's `length` queries."""
    if cp.size == 1:
        return torch.arange(length, device=device)
    return zigzag_positions(length * cp.size, cp.size, cp.rank, device)


def visible_keys(rows: torch.Tensor, keys: int, documents: Documents | None, past: int = 0) -> torch.Tensor:
    """(B or 1, Q, S) bool, S = `keys`: query at row position `rows` (Q,) (offset by `past` cached positions) may see
    key s < S: s <= its position, in its own packed document (the row's first S keys)."""
    positions = torch.arange(keys, device=rows.device)
    seen = (positions[None, :] <= rows[:, None] + past).unsqueeze(0)
    if documents is not None:
        segments = documents.segments
        seen = seen & (segments[:, rows, None] == segments[:, None, :keys])
    return seen


def select_top_k(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (B, Q, S) fp32, visible (B, Q, S) bool -> (indices (B, Q, k') int64 ascending, valid (B, Q, k')
    bool), k' = min(k, S): each query's k highest-scoring visible keys, ties broken towards the earlier key
    (the same choice whatever the shapes, unlike `torch.topk`'s order among equals). A query seeing fewer
    than k' keys keeps all of them, padded with invisible keys marked not valid."""
    B, Q, S = scores.shape
    k = min(k, S)
    masked = scores.nan_to_num(nan=float("-inf")).masked_fill(~visible, float("-inf"))  # (NaN: a pipeline's
    # stand-in inputs, whose outputs are only shapes; every row still gets exactly k)
    kth = masked.topk(k, dim=-1).values[..., -1:]
    above = masked > kth
    tied = masked == kth
    need = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(-1) <= need))
    indices = chosen.nonzero()[:, -1].view(B, Q, k)
    return indices, visible.expand(B, Q, S).gather(-1, indices)


def gather_keys(keys: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """keys (B, S, n), indices (B, Q, k) -> (B, Q, k, n) the chosen keys of each query."""
    B, S, n = keys.shape
    offsets = (torch.arange(B, device=keys.device) * S).view(B, 1, 1)
    return keys.reshape(B * S, n).index_select(0, (indices + offsets).reshape(-1)).view(*indices.shape, n)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The indexer's scores: q (B, Q, H_i, D), weights (B, Q, H_i) already scaled by H_i^-1/2, keys (B, Q, k, D)
    chosen per query or (B, S, D) shared -> (B, Q, k or S) fp32 (also under autocast, as transformers scores)."""
    scale = q.shape[-1] ** -0.5
    with torch.autocast(q.device.type, enabled=False):
        q = q.float() * scale  # on the queries, not on the (B, Q, H_i, keys) products
        if keys.dim() == 3:
            per_head = torch.einsum("bqhd,bsd->bqhs", q, keys.float())
        else:
            per_head = torch.einsum("bqhd,bqkd->bqhk", q, keys.float())
        return torch.einsum("bqhk,bqh->bqk", per_head.relu_(), weights.float())  # in place: one pass over them


def absorb_query(q: torch.Tensor, weight: torch.Tensor, nope: int) -> torch.Tensor:
    """q (B, H/tp, T, nope + rope) rotated, weight (H/tp, nope + v, r) kv_b's per head -> [q_nope W_UK | q_rope]
    (B, H/tp, T, r + rope): MLA's query against the latents."""
    q_nope, q_rope = q.split([nope, q.shape[-1] - nope], dim=-1)
    return torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, weight[:, :nope]), q_rope), dim=-1)


def _attend(query: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, scale: float,
            latent_dim: int, absorption: tuple[torch.Tensor, int] | None = None,
            dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of queries: query (B, H, Q, r + rope) absorbed, keys (B, S, r + rope) latents and shared RoPE
    keys, indices and valid (B, Q, k) -> (p c: (B, H, Q, r), the heads' summed probabilities (B, Q, k), detached).
    With `absorption` = (kv_b's weight (H, nope + v, r), nope) the query is MLA's own (B, H, Q, nope + rope), absorbed
    here, and the output is (p c) W_UV^T (B, H, Q, v): neither r-wide tensor outlives the chunk.

    `dense`: score all S keys (every index must be below S) and mask all but the chosen valid ones, instead of
    gathering each query's k keys. The same attention: the masked keys get probability 0 exactly. Two GEMMs over
    keys shared by the chunk's queries, where the gathered route makes a small product per query; cheaper while S
    is a few times k (`DENSE_SPAN`)."""
    if absorption is not None:
        query = absorb_query(query, *absorption)
    if dense:
        B, Q, S = *indices.shape[:2], keys.shape[1]
        # 0 on the chosen valid keys, -inf elsewhere, added to the scores: no mask to apply again in the backward
        bias = torch.full((B, Q, S), float("-inf"), dtype=query.dtype, device=keys.device)
        bias.scatter_(-1, indices.long(), torch.zeros_like(bias[..., :1]).expand(valid.shape).masked_fill(
            ~valid, float("-inf")))
        scores = torch.einsum("bhqn,bsn->bhqs", query, keys).mul_(scale).add_(bias.unsqueeze(1))
        probs = torch.softmax(scores.float(), dim=-1)
        mixed = torch.einsum("bhqs,bsr->bhqr", probs.to(query.dtype), keys[..., :latent_dim])
        mass = probs.detach().sum(1).gather(-1, indices.long())
    else:
        chosen = gather_keys(keys, indices)  # (B, Q, k, r + rope)
        scores = torch.einsum("bhqn,bqkn->bhqk", query, chosen) * scale
        probs = torch.softmax(scores.masked_fill(~valid.unsqueeze(1), float("-inf")).float(), dim=-1)
        mixed = torch.einsum("bhqk,bqkr->bhqr", probs.to(query.dtype), chosen[..., :latent_dim])
        mass = probs.detach().sum(1)
    if absorption is not None:
        weight, nope = absorption
        mixed = torch.einsum("bhtr,hvr->bhtv", mixed, weight[:, nope:])
    return mixed, mass


def sparse_latent_attention(query: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor,
                            scale: float, latent_dim: int, absorption: tuple[torch.Tensor, int] | None = None,
                            host_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA restricted to the chosen keys, absorbed: query (B, H/tp, T, r + rope), keys (B, S, r + rope) (the whole
    row's latents c and rotated shared keys), indices and valid (B, T, k) -> (p c (B, H/tp, T, r), the heads'
    summed attention probabilities (B, T, k), no gradient). Chunks of queries are recomputed in the backward.

    With `absorption` = (kv_b's weight per head (H/tp, nope + v, r), nope), `query` is the rotated (B, H/tp, T,
    nope + rope) and the result (B, H/tp, T, v_head_dim): the absorption and the output's W_UV run inside each chunk,
    so what the backward keeps is the query and the output at their head widths, not r + rope channels per head
    (kv_lora_rank 512 against 192 and 128 in DeepSeek-V3.2).

    `host_rows` (T,) on the host, the queries' positions in the row (`select_top_k`'s callers choose among the keys
    up to a chunk's last query, at least min(k, S)): a chunk whose queries see at most DENSE_SPAN x k keys then
    attends densely to those keys with the others masked (`_attend`'s `dense`), e.g. a row's first keys, or a
    whole row of 4K keys at top-2048. Without it every chunk gathers."""
    B, H, T, _ = query.shape
    S, k = keys.shape[1], indices.shape[-1]
    width = max(query.shape[-1], keys.shape[-1])
    grads = torch.is_grad_enabled() and (query.requires_grad or keys.requires_grad
                                         or (absorption is not None and absorption[0].requires_grad))
    mixed, mass = [], []
    start = 0
    while start < T:
        step, dense = query_step(B, k, H, width), False
        if host_rows is not None:  # the keys a gathered chunk's queries see: few enough, and its queries go dense
            span = keys_seen(host_rows, slice(start, start + step), S, k)
            if span <= DENSE_SPAN * k:
                dense, step = True, query_step(B, span, H, width)  # as many queries as fit at that span
                span = keys_seen(host_rows, slice(start, start + step), S, k)  # the chunk's own, as cut
        part = slice(start, start + step)
        args = (query[:, :, part], keys[:, :span] if dense else keys, indices[:, part], valid[:, part], scale,
                latent_dim, absorption, dense)
        if grads:
            out, heads = checkpoint(_attend, *args, use_reentrant=False)
        else:
            out, heads = _attend(*args)
        mixed.append(out)
        mass.append(heads)
        start += step
    return torch.cat(mixed, dim=2), torch.cat(mass, dim=1)


def masked_divergence(target: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over rows of KL(target || softmax of `logits` over the row's `valid` entries): target (..., n) rows summing
    to 1 (or 0), logits (..., n), valid (..., n) bool (broadcast) -> fp32 scalar. Entries not valid weigh 0; a row
    without a valid entry adds 0 (its target is 0). The indexers' loss, DSA's and DeepSeek-V4's."""
    with torch.autocast(logits.device.type, enabled=False):  # fp32, so that the divergence is never below 0
        logits = logits.float().masked_fill(~valid, float("-inf"))
        logits = logits.masked_fill(~valid.any(-1, keepdim=True), 0.0)  # no valid entry: finite, target 0
        log_q = torch.log_softmax(logits, dim=-1).masked_fill(~valid, 0.0)
        return (torch.xlogy(target, target) - target * log_q).sum()


def _divergence(q, weights, keys, indices, valid, target) -> torch.Tensor:
    """One chunk's summed KL(target || softmax(I)) over the chosen keys, or over every key when `indices` is None
    (the dense warm-up; `valid` is then (B, Q, S)); see `indexer_divergence`."""
    chosen = keys if indices is None else gather_keys(keys, indices)
    return masked_divergence(target, index_scores(q, weights, chosen), valid)


class _Divergence(torch.autograd.Function):
    """`indexer_divergence`: each chunk's value and its gradients with respect to q, weights and keys taken in the
    forward (as `linear_cross_entropy` does), so that no chunk's scores or targets are kept for the backward, which
    only scales the sums by the incoming gradient."""

    @staticmethod
    def forward(ctx, q, weights, keys, setup):
        chunks, choice, target_of = setup
        grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, weights, keys)]
        total = torch.zeros((), dtype=torch.float32, device=q.device)
        for part in chunks:
            indices, valid = choice(part)
            target = target_of(part)
            with torch.enable_grad():
                inputs = [q[:, part].detach().requires_grad_(), weights[:, part].detach().requires_grad_(),
                          keys.detach().requires_grad_()]
                value = _divergence(*inputs, indices, valid, target)
                dq, dw, dk = torch.autograd.grad(value, inputs)
            grads[0][:, part] += dq
            grads[1][:, part] += dw
            grads[2] += dk
            total += value.detach()
        ctx.save_for_backward(*grads)
        ctx.dtypes = (q.dtype, weights.dtype, keys.dtype)
        return total

    @staticmethod
    def backward(ctx, grad):
        return (*(g.mul(grad).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)), None)


def indexer_divergence(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, choice, target_of,
                       keys_per_query: int) -> torch.Tensor:
    """sum over queries of KL(target || softmax(I)) over each query's chosen keys: q (B, T, H_i, D), weights
    (B, T, H_i), keys (B, S, D) -> fp32 scalar, in chunks of queries. `choice(part)` gives a chunk's (indices
    (B, Q, k) or None for every key, valid (B, Q, k or S)), `target_of(part)` its target (B, Q, k or S), each row
    summing to 1, computed when the chunk runs (the dense warm-up's never exists whole)."""
    B, T, heads, dim = q.shape
    step = query_step(B, keys_per_query, heads, dim)
    chunks = [slice(start, start + step) for start in range(0, T, step)]
    if not torch.is_grad_enabled() or not (q.requires_grad or weights.requires_grad or keys.requires_grad):
        return sum(_divergence(q[:, p], weights[:, p], keys, *choice(p), target_of(p)) for p in chunks)
    return _Divergence.apply(q, weights, keys, (chunks, choice, target_of))


@torch.no_grad()
def dense_target(query: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float, tp) -> torch.Tensor:
    """The dense warm-up's target for a chunk of queries: query (B, H/tp, Q, r + rope) absorbed, keys (B, S, r + rope),
    visible (B or 1, Q, S) -> (B, Q, S), the main attention's probabilities summed over all heads (TP's included)
    and scaled to sum to 1 per query."""
    scores = torch.einsum("bhqn,bsn->bhqs", query, keys).float() * scale
    probs = torch.softmax(scores.masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1)
    return normalized(probs.sum(1), tp)


class Indexer(nn.Module):
    """The lightning indexer of one layer, replicated on every TP rank (`wq_b`, `wk`, `k_norm`, `weights_proj`, as
    transformers names them). Its loss is attached to the attention output with gradient `loss_scale` (set
    by the training side); each training forward appends its loss sum (detached) to `recorded`."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool):
        super().__init__()
        h, heads, dim, dev = cfg.hidden_size, cfg.index_heads, cfg.index_head_dim, ctx.device
        self.cfg, self.ctx, self.heads, self.dim = cfg, ctx, heads, dim
        self.sequence_parallel = sequence_parallel
        self.wq_b = ReplicatedLinear((heads * dim, cfg.q_lora_rank), cfg.init_std,
                                     param_seed(seed, f"{prefix}.wq_b"), dev, False)
        self.wk = ReplicatedLinear((dim, h), cfg.init_std, param_seed(seed, f"{prefix}.wk"), dev, sequence_parallel)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6, device=dev)
        self.weights_proj = ReplicatedLinear((heads, h), cfg.init_std, param_seed(seed, f"{prefix}.weights_proj"),
                                             dev, sequence_parallel)
        if sequence_parallel:
            for param in self.k_norm.parameters():
                param.sequence_parallel = True
        self.loss_scale = 1.0
        self.recorded: list[torch.Tensor] = []

    def keys_and_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T', h) the block input (sequence chunks under SP), detached -> (keys before RoPE (B, T, D), head
        weights (B, T, H_i) x H_i^-1/2), whole sequences on every TP rank."""
        keys, weights = self.k_norm(self.wk(x)), self.weights_proj(x) * self.heads ** -0.5
        if self.sequence_parallel:
            tp = self.ctx.tp
            keys, weights = _GatherReplicated.apply(keys, tp), _GatherReplicated.apply(weights, tp)
        return keys, weights

    def queries(self, q_latent: torch.Tensor) -> torch.Tensor:
        """(B, T, q_lora_rank) the query latent, detached -> (B, T, H_i, D) before RoPE."""
        return self.wq_b(q_latent).unflatten(-1, (self.heads, self.dim))


def rotate_first(x: torch.Tensor, rope: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first `rope` channels of x (B, T, H, D) or (B, T, D) (the indexer's layout), cos/sin (T, rope)
    or (B, 1, T, rope)."""
    from shardlm.models.rotary import apply_rotary

    heads = x.dim() == 4
    y = x if heads else x.unsqueeze(2)
    rotated = apply_rotary(y[..., :rope].transpose(1, 2), cos, sin).transpose(1, 2)
    y = torch.cat((rotated, y[..., rope:]), dim=-1)
    return y if heads else y.squeeze(2)


def attach_indexer_loss(y: torch.Tensor, indexer: Indexer, divergence: torch.Tensor, tokens: int) -> torch.Tensor:
    """`y` unchanged; its backward gives the indexer's loss coeff x `divergence` / `tokens` the gradient
    `indexer.loss_scale`. Records the per-token divergence (detached, without the coefficient) for the step's
    metrics, except in a recomputation."""
    if torch._C._current_graph_task_id() == -1:
        indexer.recorded.append(divergence.detach() / tokens)
    if not divergence.requires_grad:
        return y
    return AttachLoss.apply(y, divergence * (indexer.cfg.index_loss_coeff / tokens), indexer.loss_scale)


def normalized(mass: torch.Tensor, tp) -> torch.Tensor:
    """(B, T, k) this rank's heads' summed probabilities -> the target: summed over TP's heads, each row scaled
    to sum to 1 (a row of zeros, a query with nothing chosen, stays 0)."""
    mass = mass.contiguous().clone()
    tp.all_reduce(mass)
    total = mass.sum(-1, keepdim=True)
    return torch.where(total > 0, mass / total.clamp_min(torch.finfo(mass.dtype).tiny), 0.0)


def indexer_trains(indexer: nn.Module) -> bool:
    """Whether this forward computes `indexer`'s loss (DSA's or DeepSeek-V4's): training with gradients, a
    coefficient (`indexer.cfg.index_loss_coeff`), and the indexer not frozen (a LoRA run freezes it with the base)."""
    return (indexer.training and torch.is_grad_enabled() and indexer.cfg.index_loss_coeff > 0
            and any(p.requires_grad for p in indexer.parameters()))
