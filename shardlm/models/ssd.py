"""Mamba-2's state-space duality (SSD, Dao and Gu 2024) in plain PyTorch, the causal depthwise convolution in
front of it and the gated RMSNorm behind it: what Nemotron-H's Mamba-2 layers compute (`shardlm.models.mamba`).

Per head (P channels) a state S (P x N) runs along the sequence; token t decays it by one scalar per head,
exp(dt_t A) with A = -exp(A_log) < 0 and dt_t = softplus(dt_raw_t + dt_bias), and writes its input there:

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t + D x_t

B and C (N channels) are shared by the heads of a group (`groups` of them, H / groups heads each).
`chunk_scan` computes it chunk by chunk: inside a chunk of L tokens the outputs are a masked, decayed
attention C_i . B_j exp(a_{j+1} + ... + a_i) over the chunk's inputs dt_j x_j; between chunks the state is
carried, so the work is linear in T. `recurrent_scan` is the token-by-token definition, what decoding one token
uses.

Two properties make every parallel layout exact:
- the decay is a scalar per head and token, so a span's end state given the state S_in before it is
  exp(a_1 + ... + a_L) S_in + S_local and its outputs y_local + exp(a_1 + ... + a_t) C_t . S_in: an affine map
  per head (`span_scan` returns its pieces);
- the convolution reads only the last K - 1 inputs (`conv_silu`, with the earlier ones and a mask of which of
  them belong to each token's document).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.models.delta_rule import decay_exp

CHUNK = 128
"""Tokens per chunk of the chunked scan (Nemotron-H's `chunk_size`)."""


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float] = (0.0, float("inf"))
               ) -> torch.Tensor:
    """The step of each head and token: softplus(dt + dt_bias) clamped to `limit`; dt (B, T, H) -> fp32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(limit[0], limit[1])


def conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              earlier: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution with bias, then SiLU: x (B, T, C), weight (C, K), bias (C,) -> (B, T, C),
    out_t = silu(bias + sum_j weight[:, j] x_{t-K+1+j}).

    earlier: (B, K-1, C) the K-1 inputs before x (a previous span's or a decoding cache's); zeros when None.
    valid: (B, T, K) bool (`shardlm.models.delta_rule.conv_validity`), whether tap j of token t may read its
    input (it is in t's document); None reads every one."""
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
    if bias is not None:
        out = out + bias.to(x.dtype)
    return F.silu(out)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """Mamba-2's gated norm: RMSNorm of y * silu(z) over each group of `group_size` channels, times weight.
    y, z (..., C) -> (..., C) in y's dtype; fp32 inside. C a multiple of group_size (a TP rank's share of the
    channels holds whole groups)."""
    h = y.float() * F.silu(z.float())
    grouped = h.view(*h.shape[:-1], h.shape[-1] // group_size, group_size)
    h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    return weight * h.to(y.dtype)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, G, N) per group -> (B, H, T, N) per head, fp32 (each group's heads consecutive)."""
    return x.float().repeat_interleave(heads // x.shape[2], dim=2).transpose(1, 2)


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., L) log decays -> (..., L, L): entry (i, j) is a_{j+1} + ... + a_i for i >= j (0 on the diagonal),
    -inf above it. Summed directly, not as cumsum_i - cumsum_j: the difference of two large cumulative sums
    would lose their low bits (a chunk of 128 tokens sums to e^-300 and beyond)."""
    L = a.shape[-1]
    strictly_lower = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    sums = a.unsqueeze(-1).expand(*a.shape, L).masked_fill(~strictly_lower, 0.0).cumsum(-2)
    return sums.masked_fill(~strictly_lower.logical_or(torch.eye(L, dtype=torch.bool, device=a.device)),
                            float("-inf"))


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
               chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan over a sequence, by chunks; fp32 inside.

    x: (B, T, H, P); dt: (B, T, H) discretized (`discretize`); A: (H,) negative; B, C: (B, T, G, N);
    D: (H,) the skip, or None; initial_state: (B, H, P, N) or None (zeros).
    Returns (y (B, T, H, P), final state (B, H, P, N)), fp32.

    B and C stay per group (r = H / G heads share them): C B^T is one product per group and chunk, and the
    products that meet a state take a group's r heads side by side (r P rows), so neither is repeated to the
    heads, in the forward or in what the backward keeps."""
    batch, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    r = H // G
    xdt = x.float() * dt.float().unsqueeze(-1)  # (B, T, H, P)
    log_decay = dt.float() * A.float()  # (B, T, H), <= 0
    b, c = B.float(), C.float()
    pad = (-T) % chunk  # zero inputs and no decay at the end leave the state as it is
    if pad:
        xdt, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, b, c))
        log_decay = F.pad(log_decay, (0, 0, 0, pad))
    n, L = (T + pad) // chunk, chunk
    b, c = (t.view(batch, n, L, G, N).permute(0, 3, 1, 2, 4).contiguous() for t in (b, c))  # (B, G, n, L, N)
    xdt = xdt.view(batch, n, L, G, r, P).permute(0, 3, 4, 1, 2, 5).contiguous()  # (B, G, r, n, L, P)
    log_decay = log_decay.view(batch, n, L, G, r).permute(0, 3, 4, 1, 2)  # (B, G, r, n, L)
    cum = log_decay.cumsum(-1)  # log decay from the chunk's start to each token
    pair = decay_exp(segment_sums(log_decay))  # (B, G, r, n, L, L): token j's write as token i reads it
    inside = ((c @ b.transpose(-1, -2)).unsqueeze(2) * pair) @ xdt  # (B, G, r, n, L, P): the chunk's own inputs
    # each chunk's end state from its own inputs, a group's heads as rows: sum_j (x dt)_j decay(j -> end) B_j^T
    to_end = decay_exp(cum[..., -1:] - cum).unsqueeze(-1)
    written = (xdt * to_end).permute(0, 1, 3, 2, 5, 4).reshape(batch, G, n, r * P, L) @ b  # (B, G, n, r P, N)
    end_decay = decay_exp(cum[..., -1]).permute(0, 1, 3, 2)[..., None, None]  # (B, G, n, r, 1, 1)
    state = x.new_zeros(batch, G, r, P, N, dtype=torch.float32) if initial_state is None \
        else initial_state.float().reshape(batch, G, r, P, N)
    incoming = []
    # unbound once: indexing chunk i inside the loop would make each index's backward fill a zero tensor of the
    # whole sequence (quadratic in its length)
    for written_i, decay_i in zip(written.unbind(2), end_decay.unbind(2)):
        incoming.append(state)
        state = state * decay_i + written_i.view(batch, G, r, P, N)
    start = torch.stack(incoming, dim=2).view(batch, G, n, r * P, N)  # the state each chunk starts from
    read = (c @ start.transpose(-1, -2)).view(batch, G, n, L, r, P)  # what each token reads of it, undecayed
    read = read * decay_exp(cum).permute(0, 1, 3, 4, 2).unsqueeze(-1)
    y = inside.permute(0, 3, 4, 1, 2, 5) + read.permute(0, 2, 3, 1, 4, 5)  # (B, n, L, G, r, P)
    y = y.reshape(batch, n * L, H, P)[:, :T]
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y, state.reshape(batch, H, P, N)


def recurrent_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token; same arguments and results as `chunk_scan`."""
    batch, T, H, P = x.shape
    b, c = _heads(B, H), _heads(C, H)  # (B, H, T, N)
    state = x.new_zeros(batch, H, P, b.shape[-1], dtype=torch.float32) if initial_state is None \
        else initial_state.float()
    decay = (dt.float() * A.float()).exp()  # (B, T, H)
    xdt = x.float() * dt.float().unsqueeze(-1)
    outputs = []
    for t in range(T):
        state = state * decay[:, t, :, None, None] + xdt[:, t, :, :, None] * b[:, :, t, None, :]
        outputs.append((state * c[:, :, t, None, :]).sum(-1))
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y, state


def scan(x, dt, A, B, C, D=None, initial_state=None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan, or the recurrent one for a single token (decoding)."""
    if x.shape[1] == 1:
        return recurrent_scan(x, dt, A, B, C, D, initial_state)
    return chunk_scan(x, dt, A, B, C, D, initial_state, chunk)


def span_scan(x, dt, A, B, C, D=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A span whose incoming state is not known yet: (y_local (B, T, H, P), C~ (B, T, H, N), S_local
    (B, H, P, N), decay (B, H)). With the incoming state S_in the span's outputs are y_local + (C~ . S_in) per
    head, y_t += S_in C~_t, and its end state decay S_in + S_local (`carry`): the decay is a scalar per head, so
    the incoming state reaches token t scaled by exp(a_1 + ... + a_t), C~_t = that times C_t."""
    H = x.shape[2]
    local, state = chunk_scan(x, dt, A, B, C, D)
    cum = (dt.float() * A.float()).cumsum(1)  # (B, T, H)
    c_tilde = _heads(C, H).transpose(1, 2) * decay_exp(cum).unsqueeze(-1)
    return local, c_tilde, state, decay_exp(cum[:, -1])


def read_state(c_tilde: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
    """What a span's tokens read of the state before it: C~ (B, T, H, N), S_in (B, H, P, N) -> (B, T, H, P)."""
    return torch.einsum("bthn,bhpn->bthp", c_tilde, state_in)


def carry(state_in: torch.Tensor, decay: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A span's end state from its incoming one: decay (B, H) x S_in + S_local, states (B, H, P, N)."""
    return decay[..., None, None] * state_in + local


def document_starts(positions: torch.Tensor) -> list[int]:
    """Indices > 0 of a row's tokens (positions within their documents, (L,)) where a document starts."""
    return (positions[1:] == 0).nonzero().flatten().add(1).tolist()


def scan_documents(x, dt, A, B, C, D, cuts: list[int], chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One row (batch 1) of packed documents cut at `cuts` (where each starts): every document scanned from a zero
    state. Returns (y (1, T, H, P), the last document's end state (1, H, P, N))."""
    bounds = [0, *cuts, x.shape[1]]
    outputs, state = [], None
    for start, end in zip(bounds, bounds[1:]):
        part = [t[:, start:end] for t in (x, dt, B, C)]
        y, state = chunk_scan(part[0], part[1], A, part[2], part[3], D, chunk=chunk)
        outputs.append(y)
    return torch.cat(outputs, dim=1), state
