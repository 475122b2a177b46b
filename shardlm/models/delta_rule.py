"""The gated delta rule (Gated DeltaNet, Yang et al. 2024), in plain PyTorch, and the short causal convolution
in front of it: what Qwen3-Next's and Qwen3.5's linear-attention layers compute (`shardlm.models.linear_attention`).

Per value head, a state S (d_k x d_v) runs along the sequence; token t decays it by exp(g_t), removes what it
predicts for the token's key and writes the token's value in its place, with strength beta_t:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

(q and k L2-normalized, q scaled by d_k^-1/2). `chunk_gated_delta_rule` computes it chunk by chunk: inside a
chunk of C tokens the updates are condensed by the WY representation (one triangular solve for the chunk), and
the state passes from chunk to chunk, so the work is linear in T with matmuls of C x C; `recurrent_gated_delta_rule`
is the token-by-token definition it is tested against, and what decoding one token uses.

Two properties make every parallel layout exact:
- The recurrence is linear in (S, v), so a span's end state is P S_in + S_local and its outputs o_local + q~ S_in,
  where S_local and o_local start from a zero state and P (d_k x d_k, the span's transition) and q~ = P_t^T q_t
  come from a second run from an identity state with zero values (`span_summary`). Context-parallel
  ranks each run their spans at once and then combine the small summaries in sequence order (`carry_states`).
- The convolution sees only the last kernel - 1 inputs, so it needs only those from the previous span
  (`causal_conv`, with the earlier tokens and a mask of which of them belong to each token's document).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
"""Tokens per chunk of the chunked rule (transformers' torch path and FLA use 64)."""
DECAY_FLOOR = -40.0
"""Log-decays below this become a decay of exactly 0 (`decay_exp`)."""


class _DecayExp(torch.autograd.Function):
    """exp(x), exactly 0 below DECAY_FLOOR; the gradient is grad x the output (0 below the floor), so autograd
    keeps the output only, as it does for exp."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp().masked_fill_(x < DECAY_FLOOR, 0.0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


def decay_exp(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), exactly 0 below DECAY_FLOOR (exp(-40) = 4e-18, below fp32's resolution next to the chunk's
    undecayed terms). Without the floor, decays of e^-87 to e^-104 are subnormal floats, and every product
    touching them (the chunk's GEMMs and triangular solves, forward and backward) runs 20 times slower on x86
    CPUs, which do not flush subnormals to zero by default; a random Qwen3.5 layer's decays span e^-1 to e^-1300
    inside one chunk of 64 tokens."""
    return _DecayExp.apply(log_decay)


def _flush(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x.abs() < torch.finfo(x.dtype).tiny, 0.0)


class _UnitLowerSolve(torch.autograd.Function):
    """X = (I + strictly_lower(A))^-1 B, batched, with subnormal floats of X and of B's gradient set to 0."""

    @staticmethod
    def forward(ctx, a, b):
        x = _flush(torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True))
        ctx.save_for_backward(a, x)
        return x

    @staticmethod
    def backward(ctx, grad):
        a, x = ctx.saved_tensors
        grad_b = _flush(torch.linalg.solve_triangular(a.transpose(-1, -2), grad, upper=True, unitriangular=True))
        return -(grad_b @ x.transpose(-1, -2)).tril(-1), grad_b


def unit_lower_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)` with the same gradients, except that
    subnormal floats in the solution and in b's gradient become 0, as on a CPU that flushes them. The solve for W
    multiplies decays of down to e^-40 along the chunk (their products are the decays between tokens, which may be
    far smaller), and products below 1e-38 are subnormal: 2-4% of W in a random Qwen3.5 layer, enough to make every
    GEMM that reads W, forward and backward, 20 times slower."""
    return _UnitLowerSolve.apply(a, b)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, earlier: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution and SiLU: x (B, T, C), weight (C, K) -> (B, T, C),
    out_t = silu(sum_j weight[:, j] x_{t-K+1+j}).

    earlier: (B, K-1, C) the K-1 inputs before x (a previous span's or a decoding cache's); zeros when None.
    valid: (B, T, K) bool, whether the input `K-1-j` steps back from token t may be read (it is in t's document);
    None reads every one. The taps are summed one by one, so a document boundary is a mask, not a split."""
    B, T, C = x.shape
    K = weight.shape[1]
    before = x.new_zeros(B, K - 1, C) if earlier is None else earlier.to(x.dtype)
    padded = torch.cat((before, x), dim=1)  # (B, K-1+T, C)
    out = None
    for j in range(K):
        tap = padded[:, j:j + T] * weight[:, j].to(x.dtype)
        if valid is not None:
            tap = tap * valid[:, :, j:j + 1].to(x.dtype)
        out = tap if out is None else out + tap
    return F.silu(out)


def conv_validity(segments: torch.Tensor | None, positions: torch.Tensor, kernel: int) -> torch.Tensor | None:
    """(B, T, K) bool for `causal_conv`: token t may read the input `K-1-j` steps back when that position is >= 0
    and in t's document. positions: (T,) the tokens' positions in the whole row (the zigzag ones under context
    parallelism), segments: (B, T_row) the whole row's document numbers, or None (one document per row, and
    then only positions before the row's start are invalid; None when there are none)."""
    back = torch.arange(kernel - 1, -1, -1, device=positions.device)  # steps back of tap j
    source = positions.unsqueeze(1) - back  # (T, K)
    inside = source >= 0
    if segments is None:
        return None if bool(inside.all()) else inside.unsqueeze(0)
    clamped = source.clamp(min=0)
    same = segments[:, clamped] == segments[:, positions].unsqueeze(-1)  # (B, T, K)
    return same & inside


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, by chunks; fp32 inside.

    q, k: (B, H, T, d_k) normalized (q scaled), already one per value head; v: (B, H, T, d_v);
    g (log decay, <= 0) and beta: (B, H, T); initial_state: (B, H, d_k, d_v) or None (zeros).
    Returns (outputs (B, H, T, d_v), final state (B, H, d_k, d_v)), fp32."""
    B, H, T, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    pad = (-T) % chunk  # zero keys, values and decays at the end leave the state as it is
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = decay_exp((decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(later, float("-inf")))  # i >= j
    k_beta = k * beta.unsqueeze(-1)
    # the WY form: (I + L) U = V beta and (I + L) W = K beta exp(decay), L the strictly lower part of the chunk's
    # beta_i k_i.k_j exp(decay_i - decay_j); the unit diagonal is implied
    system = (k_beta @ k.transpose(-1, -2)) * pair
    u = unit_lower_solve(system, v * beta.unsqueeze(-1))
    w = unit_lower_solve(system, k_beta * decay_exp(decay).unsqueeze(-1))
    inside = (q @ k.transpose(-1, -2)) * pair  # attention within the chunk, decayed
    q_read = q * decay_exp(decay).unsqueeze(-1)  # what each token reads of the state at the chunk's start
    k_write = k * decay_exp(decay[..., -1:] - decay).unsqueeze(-1)  # how each token's write decays to the chunk's end
    end_decay = decay_exp(decay[..., -1])[..., None, None]
    state = q.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    return chunks_carried(u, w, q_read, inside, k_write, end_decay, state, T)


def chunks_carried(u, w, q_read, inside, k_write, end_decay, state: torch.Tensor, T: int):
    """The WY form's pass over the chunks, the state carried from one to the next (the gated delta rule's and KDA's):
    per chunk (dim 2 of each, C tokens) the values minus what the state predicts (u - w S), the output q_read S +
    inside (u - w S), and the state decayed to the chunk's end plus k_write^T (u - w S). u, w, q_read (B, H, n, C,
    .), inside (B, H, n, C, C), k_write (B, H, n, C, d_k), end_decay (B, H, n, ., 1 or d_k broadcasting against S),
    state (B, H, d_k, d_v) -> (out (B, H, T, d_v), end state)."""
    B, H, n, chunk = u.shape[:4]
    outputs = []
    # unbound once: indexing chunk i inside the loop would make each index's backward fill and add a zero tensor
    # of the whole sequence, quadratic in its length
    for u_i, w_i, q_i, inside_i, k_i, decay_i in zip(*(x.unbind(2) for x in (u, w, q_read, inside, k_write,
                                                                             end_decay))):
        new = u_i - w_i @ state  # the values minus what the state already predicts
        outputs.append(q_i @ state + inside_i @ new)
        state = state * decay_i + k_i.transpose(-1, -2) @ new
    out = torch.stack(outputs, dim=2).reshape(B, H, n * chunk, -1)[:, :, :T]
    return out, state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token; same arguments and results as `chunk_gated_delta_rule`."""
    B, H, T, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = q.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(T):
        state = state * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        delta = (v[:, :, t] - (state * kt.unsqueeze(-1)).sum(-2)) * beta[:, :, t].unsqueeze(-1)
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outputs, dim=2), state


def gated_delta_rule(q, k, v, g, beta, initial_state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule, or the recurrent one for a single token (decoding)."""
    rule = recurrent_gated_delta_rule if q.shape[2] == 1 else chunk_gated_delta_rule
    return rule(q, k, v, g, beta, initial_state)


def span_summary(q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A span of a sequence whose incoming state is not known yet: (o_local (B, H, T, d_v), q~ (B, H, T, d_k),
    S_local (B, H, d_k, d_v), P (B, H, d_k, d_k)). With the incoming state S_in the span's outputs are
    o_local + q~ S_in and its end state P S_in + S_local (`carry`).

    o_local and S_local are the rule from a zero state. The state's transition over tokens 1..t is
    P_t = exp(g_1 + ... + g_t) (I - b_t k_t k_t^T) ... (I - b_1 k_1 k_1^T): the decays are scalars, so they come
    out as one factor, and the product of the rest is the rule run from an identity state with zero values and no
    decay (its outputs are that product's transpose times q). Run with the decays inside, the identity columns
    would only shrink, into subnormal floats that slow a CPU several times over on long spans."""
    B, H, T, dk = k.shape
    local, local_state = chunk_gated_delta_rule(q, k, v, g, beta)
    identity = torch.eye(dk, device=q.device).expand(B, H, dk, dk)
    q_hat, p_hat = chunk_gated_delta_rule(q, k, q.new_zeros(B, H, T, dk), torch.zeros_like(g), beta, identity)
    decay = g.float().cumsum(-1)
    return local, q_hat * decay_exp(decay).unsqueeze(-1), local_state, p_hat * decay_exp(decay[..., -1:]).unsqueeze(-1)


def carry(state_in: torch.Tensor, transition: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A span's end state from its incoming one: P S_in + S_local, each (B, H, d_k, .)."""
    return transition @ state_in + local
