"""Kimi Delta Attention (KDA, Kimi Linear), in plain PyTorch: the gated delta rule with a decay per key channel
instead of one per head (`shardlm.models.kimi_delta` is the layer around it).

Per head, a state S (d_k x d_v) runs along the sequence; token t decays each key channel c of it by exp(g_t,c),
removes what it predicts for the token's key and writes the token's value in its place, with strength beta_t:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

(q and k L2-normalized, q scaled by d_k^-1/2). `chunk_kda_rule` computes it chunk by chunk, as
`shardlm.models.delta_rule.chunk_gated_delta_rule` does for a scalar decay: inside a chunk of C tokens the
updates are condensed by the WY representation (one unit-triangular solve), between chunks the state is carried.
What changes is the chunk's pairwise decay: with G_t = g_1 + ... + g_t (per channel, inside the chunk), token i
reads token j through sum_c a_i,c b_j,c exp(G_i,c - G_j,c), no longer a scalar mask times a matmul. `pairwise`
computes it by sub-blocks of 16 tokens: between sub-blocks through a reference point r (the last token of the
earlier sub-block), exp(G_i - G_j) = exp(G_i - r) exp(r - G_j) with both factors <= 1 (a matmul; no factor can
overflow, as exp(-G_j) alone would on fast decays), inside a sub-block elementwise. Every decay below e^-40
becomes exactly 0 (`decay_exp`) and the solves flush subnormal floats (`unit_lower_solve`), so no GEMM reads a
subnormal (which x86 CPUs multiply about 20 times slower).

`recurrent_kda_rule` is the token-by-token definition it is tested against, and what decoding one token uses;
`packed_kda_rule` runs each packed document from a zero state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.models.delta_rule import CHUNK, _flush, chunks_carried, decay_exp, unit_lower_solve

BLOCK = 16
"""Tokens per sub-block of `pairwise` (FLA's KDA kernels use sub-chunks of 16 too)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (transformers' and FLA's l2norm for KDA)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def pairwise(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, strict: bool,
             block: int = BLOCK) -> torch.Tensor:
    """M[i, j] = sum_c a[i, c] b[j, c] exp(decay[i, c] - decay[j, c]) for j < i (and j = i unless `strict`), 0 for
    the rest: a, b, decay (..., C, d) with decay non-increasing along C -> (..., C, C) fp32, subnormals flushed.

    Between sub-blocks I > J the decay passes through r_J, the decay at J's last token: a_i exp(decay_i - r_J) and
    b_j exp(r_J - decay_j) are each at most 1 in size (one matmul for every row against block J); inside a
    sub-block the products are elementwise ((..., C / block, block, block, d))."""
    C, d = a.shape[-2:]
    nb = C // block
    lead = a.shape[:-2]
    blocks = [x.unflatten(-2, (nb, block)) for x in (a, b, decay)]  # (..., nb, block, d)
    a_blocks, b_blocks, d_blocks = blocks
    ref = d_blocks[..., -1:, :]  # (..., nb, 1, d): each block's last token
    right = b_blocks * decay_exp(ref - d_blocks)  # (..., nb, block, d)
    row_block = torch.arange(C, device=a.device) // block
    later = row_block.unsqueeze(0) > torch.arange(nb, device=a.device).unsqueeze(1)  # (nb, C): row i after block J
    exponent = (decay.unsqueeze(-3) - ref).masked_fill(~later.unsqueeze(-1), float("-inf"))  # (..., nb, C, d)
    left = a.unsqueeze(-3) * decay_exp(exponent)
    off = left @ right.transpose(-1, -2)  # (..., nb_J, C, block): M[i, J * block + s]
    off = off.movedim(-3, -2).reshape(*lead, C, C)
    ahead = torch.ones(block, block, dtype=torch.bool, device=a.device).triu(1 if not strict else 0)
    diff = (d_blocks.unsqueeze(-2) - d_blocks.unsqueeze(-3)).masked_fill(ahead.unsqueeze(-1), float("-inf"))
    inside = (a_blocks.unsqueeze(-2) * b_blocks.unsqueeze(-3) * decay_exp(diff)).sum(-1)  # (..., nb, block, block)
    eye = torch.eye(nb, dtype=inside.dtype, device=a.device).view(nb, 1, nb, 1)
    placed = (inside.unsqueeze(-2) * eye).reshape(*lead, C, C)  # block I of the diagonal is inside[..., I, :, :]
    return _flush(off + placed)


def chunk_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor | None = None,
                   chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over a sequence, by chunks; fp32 inside.

    q, k: (B, H, T, d_k) normalized (q scaled); v: (B, H, T, d_v); g: (B, H, T, d_k) log decay per key channel
    (<= 0); beta: (B, H, T); initial_state: (B, H, d_k, d_v) or None (zeros).
    Returns (outputs (B, H, T, d_v), final state (B, H, d_k, d_v)), fp32."""
    B, H, T, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    pad = (-T) % chunk  # zero keys, values and decays at the end leave the state as it is
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v, g = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, chunk, 1)
    decay = g.cumsum(-2)  # (B, H, n, C, d_k): log of the decay from the chunk's start to each token, per channel
    k_beta = k * beta
    # the WY form: (I + L) U = V beta and (I + L) W = K beta exp(decay), L the strictly lower part of the chunk's
    # beta_i sum_c k_i,c k_j,c exp(decay_i,c - decay_j,c); the unit diagonal is implied
    system = pairwise(k_beta, k, decay, strict=True)
    u = unit_lower_solve(system, v * beta)
    w = unit_lower_solve(system, k_beta * decay_exp(decay))
    inside = pairwise(q, k, decay, strict=False)  # attention within the chunk, decayed per channel
    q_read = q * decay_exp(decay)  # what each token reads of the state at the chunk's start
    k_write = k * decay_exp(decay[..., -1:, :] - decay)  # how each token's write decays to the chunk's end
    end_decay = decay_exp(decay[..., -1, :]).unsqueeze(-1)  # (B, H, n, d_k, 1): the state's rows at the chunk's end
    state = q.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    return chunks_carried(u, w, q_read, inside, k_write, end_decay, state, T)


def recurrent_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token; same arguments and results as `chunk_kda_rule`."""
    B, H, T, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = q.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(T):
        state = state * g[:, :, t].exp().unsqueeze(-1)
        kt = k[:, :, t]
        delta = (v[:, :, t] - (state * kt.unsqueeze(-1)).sum(-2)) * beta[:, :, t].unsqueeze(-1)
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outputs, dim=2), state


def kda_rule(q, k, v, g, beta, initial_state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule, or the recurrent one for a single token (decoding)."""
    rule = recurrent_kda_rule if q.shape[2] == 1 else chunk_kda_rule
    return rule(q, k, v, g, beta, initial_state)


def packed_kda_rule(q, k, v, g, beta, offsets: list[list[int]]) -> torch.Tensor:
    """Packed rows: each document from a zero state. Inputs as `chunk_kda_rule`'s, offsets per row the documents'
    starts and the row's end ([0, ..., T], `Documents.offsets`) -> outputs (B, H, T, d_v) fp32."""
    rows = []
    for r, bounds in enumerate(offsets):
        parts = [chunk_kda_rule(*(x[r:r + 1, :, start:end] for x in (q, k, v, g, beta)))[0]
                 for start, end in zip(bounds, bounds[1:]) if end > start]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows)


def kda_span_summary(q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A span whose incoming state is not known yet: (o_local (B, H, T, d_v), q~ (B, H, T, d_k), S_local
    (B, H, d_k, d_v), P (B, H, d_k, d_k)); with the incoming state S_in the span's outputs are o_local + q~ S_in
    and its end state P S_in + S_local (the rule is linear in (S, v)).

    o_local and S_local are the rule from a zero state. The transition over tokens 1..t,
    P_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) ... (I - b_1 k_1 k_1^T) Diag(exp(g_1)), is the rule run from an identity
    state with zero values (its outputs are q_t^T P_t). The decays stay inside that run: per channel, they do not
    come out as one factor as Gated DeltaNet's scalar ones do; the floor keeps the shrinking identity columns from
    becoming subnormal floats."""
    B, H, T, dk = k.shape
    local, local_state = chunk_kda_rule(q, k, v, g, beta)
    identity = torch.eye(dk, device=q.device).expand(B, H, dk, dk)
    q_tilde, transition = chunk_kda_rule(q, k, q.new_zeros(B, H, T, dk), g, beta, identity)
    return local, q_tilde, local_state, transition
