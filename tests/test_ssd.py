"""Mamba-2's SSD in plain PyTorch (`shardlm.models.ssd`) against transformers' Nemotron-H PyTorch path: the chunked
scan within 1e-6 and the token-by-token recurrence within 1e-5 of `mamba2_chunk_scan` (outputs, end state and the
gradients of every input), the recurrence against transformers' `mamba2_selective_state_update` step by step, the
convolution against transformers' `causal_conv1d_fn`, the gated norm against `NemotronHRMSNormGated`; packed
documents against each document run alone (and the reset removed as the control); two spans joined by the affine
hand-over against the whole sequence."""

from __future__ import annotations

import torch

from shardlm.models.delta_rule import conv_validity
from shardlm.models.ssd import (
    carry,
    chunk_scan,
    conv_silu,
    discretize,
    document_starts,
    gated_rms_norm,
    read_state,
    recurrent_scan,
    scan_documents,
    span_scan,
)

BATCH, T, HEADS, P, GROUPS, N = 2, 300, 4, 8, 2, 16  # 300 tokens: three chunks of 128, the last padded


def inputs(seed: int = 0, length: int = T) -> dict:
    """Random scan inputs, each requiring grad: x (B, T, H, P), raw dt (B, T, H), dt_bias, A_log, D (H,), B and C
    (B, T, G, N) scaled by N^-1/2 (outputs of order 1); steps softplus(dt + dt_bias) mostly 0.05 to 2, decays
    exp(dt A) of e^-0.01 to e^-5 a token."""
    g = torch.Generator().manual_seed(seed)
    raw = {"x": torch.randn(BATCH, length, HEADS, P, generator=g), "dt": torch.randn(BATCH, length, HEADS, generator=g),
           "dt_bias": torch.randn(HEADS, generator=g) - 1, "A_log": torch.randn(HEADS, generator=g) * 0.5,
           "D": torch.randn(HEADS, generator=g), "B": torch.randn(BATCH, length, GROUPS, N, generator=g) * N ** -0.5,
           "C": torch.randn(BATCH, length, GROUPS, N, generator=g) * N ** -0.5}
    return {k: v.requires_grad_() for k, v in raw.items()}


def ours(rule, t: dict, **kwargs):
    dt = discretize(t["dt"], t["dt_bias"])
    return rule(t["x"], dt, -t["A_log"].exp(), t["B"], t["C"], t["D"], **kwargs)


def theirs(t: dict):
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    return mamba2_chunk_scan(t["x"], t["dt"], -t["A_log"].exp(), t["B"], t["C"], chunk_size=128, D=t["D"],
                             dt_bias=t["dt_bias"], dt_softplus=True, return_final_states=True)


def gradients(outputs: tuple, t: dict) -> list[torch.Tensor]:
    """Gradients of every input of a fixed random projection of (y, final state)."""
    y, state = outputs
    g = torch.Generator().manual_seed(9)
    loss = (y * torch.randn(y.shape, generator=g)).sum() + (state * torch.randn(state.shape, generator=g)).sum()
    return list(torch.autograd.grad(loss, list(t.values())))


def max_diff(a: list, b: list) -> float:
    """The largest difference over tensor pairs, each relative to its reference's largest entry when above 1 (the
    gradients of A_log and dt_bias sum over every token and head: entries of 20 and more, whose last bits depend
    on the order of that sum)."""
    return max(float((x - y).detach().abs().max() / max(1.0, float(y.detach().abs().max()))) for x, y in zip(a, b))


def test_chunked_scan_equals_transformers_within_1e_6():
    """Outputs and end state within 1e-6 of transformers'; the gradients within 2e-6 of transformers' and of the
    same scan in fp64: shardlm sums a group's heads inside one product where transformers repeats B and C to every
    head, so the gradients that sum over every token and head (A_log's) round about 10 ulps apart; transformers'
    own B gradient is 1.8e-6 from fp64's."""
    t = inputs()
    mine, ref = ours(chunk_scan, t), theirs(t)
    assert max_diff(mine, ref) < 1e-6
    exact = {k: v.detach().double().requires_grad_() for k, v in t.items()}
    fp64 = [g.float() for g in gradients(theirs(exact), exact)]
    grads = gradients(mine, t)
    assert max_diff(grads, gradients(ref, t)) < 2e-6 and max_diff(grads, fp64) < 2e-6
    assert float(ref[0].detach().abs().max()) > 1.0 and float(ref[1].detach().abs().max()) > 1.0  # not vanishing


def test_recurrence_equals_transformers_within_1e_5():
    t = inputs(1)
    mine, ref = ours(recurrent_scan, t), theirs(t)
    assert max_diff(mine, ref) < 1e-5
    assert max_diff(gradients(mine, t), gradients(ref, t)) < 1e-5


def test_recurrence_equals_transformers_decoding_step():
    """transformers' decoding step (`mamba2_selective_state_update`, its state updated in place) token by token
    from a random state gives our recurrence's outputs and end state."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_selective_state_update

    t = {k: v.detach() for k, v in inputs(2, length=6).items()}
    start = torch.randn(BATCH, HEADS, P, N, generator=torch.Generator().manual_seed(3))
    y, state = ours(recurrent_scan, t, initial_state=start)
    theirs_state, outs = start.clone(), []
    A = (-t["A_log"].exp())[:, None, None].expand(-1, P, N)
    for i in range(6):
        outs.append(mamba2_selective_state_update(
            theirs_state, t["x"][:, i], t["dt"][:, i, :, None].expand(-1, -1, P), A, t["B"][:, i], t["C"][:, i],
            t["D"][:, None].expand(-1, P), dt_bias=t["dt_bias"][:, None].expand(-1, P), dt_softplus=True))
    assert (torch.stack(outs, 1) - y).abs().max() < 1e-5 and (theirs_state - state).abs().max() < 1e-5
    chunked, chunked_state = ours(chunk_scan, t, initial_state=start)
    assert (chunked - y).abs().max() < 1e-5 and (chunked_state - state).abs().max() < 1e-5


def test_two_spans_joined_by_the_affine_hand_over_equal_the_whole():
    """The second half scanned from zero, plus its tokens' reading of the first half's end state (C~ S_in) and its
    end state decay S_in + S_local, equals the whole sequence scanned at once."""
    t = {k: v.detach() for k, v in inputs(4).items()}
    dt, A = discretize(t["dt"], t["dt_bias"]), -t["A_log"].exp()
    whole, whole_state = chunk_scan(t["x"], dt, A, t["B"], t["C"], t["D"])
    cut = 170
    first, first_state = chunk_scan(t["x"][:, :cut], dt[:, :cut], A, t["B"][:, :cut], t["C"][:, :cut], t["D"])
    local, c_tilde, local_state, decay = span_scan(t["x"][:, cut:], dt[:, cut:], A, t["B"][:, cut:],
                                                   t["C"][:, cut:], t["D"])
    second = local + read_state(c_tilde, first_state)
    assert (torch.cat((first, second), 1) - whole).abs().max() < 1e-5
    assert (carry(first_state, decay, local_state) - whole_state).abs().max() < 1e-5
    assert (torch.cat((first, local), 1) - whole).abs().max() > 1e-2  # the hand-over matters


def test_convolution_equals_transformers_conv1d():
    from transformers.models.nemotron_h.modeling_nemotron_h import causal_conv1d_fn

    g = torch.Generator().manual_seed(5)
    x, weight, bias = torch.randn(2, 20, 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    ref = causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
    assert (conv_silu(x, weight, bias) - ref).abs().max() < 1e-6
    earlier = torch.randn(2, 3, 12, generator=g)  # a previous span's last inputs
    ref = causal_conv1d_fn(torch.cat((earlier, x), 1).transpose(1, 2), weight, bias, activation="silu")
    assert (conv_silu(x, weight, bias, earlier) - ref.transpose(1, 2)[:, 3:]).abs().max() < 1e-6


def test_gated_norm_equals_transformers():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    g = torch.Generator().manual_seed(6)
    y, z = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    norm = NemotronHRMSNormGated(32, group_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
        ref = norm(y, z)
    assert (gated_rms_norm(y, z, norm.weight.detach(), 8, 1e-5) - ref).abs().max() < 1e-6
    # one group over all channels is another function: the grouping is seen
    assert (gated_rms_norm(y, z, norm.weight.detach(), 32, 1e-5) - ref).abs().max() > 1e-2


def test_packed_documents_equal_each_document_alone():
    """A row of three documents (cut at 90 and 230: one crosses the first chunk edge, one the second): the scan and
    the masked convolution equal each document run alone, outputs and gradients; without the resets they do not."""
    t = inputs(7, length=T)
    row = {k: (v[:1] if v.dim() > 1 else v) for k, v in t.items()}
    positions = torch.cat([torch.arange(90), torch.arange(140), torch.arange(70)])
    cuts = document_starts(positions)
    assert cuts == [90, 230]
    dt, A = discretize(row["dt"], row["dt_bias"]), -row["A_log"].exp()
    packed, _ = scan_documents(row["x"], dt, A, row["B"], row["C"], row["D"], cuts)
    bounds = [0, *cuts, T]
    alone = torch.cat([chunk_scan(row["x"][:, a:b], dt[:, a:b], A, row["B"][:, a:b], row["C"][:, a:b], row["D"])[0]
                       for a, b in zip(bounds, bounds[1:])], 1)
    assert (packed - alone).abs().max() < 1e-5
    g = torch.Generator().manual_seed(8)
    w = torch.randn(packed.shape, generator=g)
    grads = [torch.autograd.grad((y * w).sum(), list(t.values()), allow_unused=True, retain_graph=True)
             for y in (packed, alone)]
    assert max(float((a - b).abs().max()) for a, b in zip(*grads) if a is not None) < 1e-5
    unreset, _ = chunk_scan(row["x"], dt, A, row["B"], row["C"], row["D"])
    assert (unreset - alone).abs().max() > 1e-2
    # the convolution: masked taps equal each document convolved alone
    x, weight, bias = torch.randn(1, T, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    segments = torch.repeat_interleave(torch.arange(3), torch.tensor([90, 140, 70])).unsqueeze(0)
    valid = conv_validity(segments, torch.arange(T), 4)
    alone = torch.cat([conv_silu(x[:, a:b], weight, bias) for a, b in zip(bounds, bounds[1:])], 1)
    assert (conv_silu(x, weight, bias, None, valid) - alone).abs().max() < 1e-6
    assert (conv_silu(x, weight, bias) - alone).abs().max() > 1e-2
