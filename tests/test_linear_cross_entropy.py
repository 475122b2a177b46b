"""The fused output layer + cross-entropy (`linear_cross_entropy`) equals the unfused computation.

Reference at TP=1: `F.linear` over the padded weight, the padding sliced off, `F.cross_entropy` in
fp32. Checked: per-token losses and the gradients of the hidden states and of the weight (padding
rows included), with ignored targets, a loss gradient that differs per token, chunk boundaries
inside the batch, fp32, bf16 autocast and bf16 parameters, and the GEMM width a GPU or half precision
rounds up to (forced on the CPU in fp32, padding rows that are not zero); a GPT trains through it to the
same losses and gradients as through the unfused head. Gemma's soft cap s tanh(z / cap) inside it (and in the
entropy RL logs and its bonus differentiates, and WPO's log sum p^2) equals the unfused loss over the capped logits,
alone, at TP 2 and 4, and in Gemma 4's head; so do the entropy's gradients.
At TP=2 and TP=4 (gloo workers): each rank's
losses and gradients equal the unfused vocabulary-parallel path's (`F.linear` on this rank's rows,
then `vocab_parallel_cross_entropy`), shards holding padding and shards of padding only included,
with the same collectives (one all-reduce MAX and one SUM of O(tokens) values, never the logits; the fused one
leaves the ignored tokens out of both).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import shardlm.parallel.linear_cross_entropy as fused_module
from shardlm.parallel import ParallelContext
from shardlm.parallel.linear_cross_entropy import linear_cross_entropy

from multiproc import run_checks, run_workers

V, V_PADDED, H = 300, 384, 32


def _inputs(rows: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, H, generator=g)
    weight = torch.randn(V_PADDED, H, generator=g) * 0.3
    weight[V:] = 0.0  # padding rows are zero, as VocabParallelEmbedding initializes them
    target = torch.randint(0, V, (rows,), generator=g)
    target[3] = target[17] = -100
    upstream = torch.rand(rows, generator=g) + 0.5  # a different loss gradient per token
    return hidden, weight, target, upstream


SOFTCAP = (1.5, 1.5 / 0.7)
"""A soft cap (cap, s) as Gemma's with an RL temperature of 0.7: s tanh(z / 1.5), small enough that the inputs'
logits (std about 1.7) saturate it."""


def capped(logits: torch.Tensor, softcap) -> torch.Tensor:
    """The unfused soft cap, as Gemma's output layer applies it."""
    return logits if softcap is None else torch.tanh(logits / softcap[0]) * softcap[1]


def _run(fused: bool, hidden, weight, target, upstream, precision: str, softcap=None):
    """Losses, hidden and weight gradients of one pass, on the inputs' device (the CPU, or a GPU in test_cuda)."""
    device = hidden.device
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        if fused:
            losses = linear_cross_entropy(hidden, weight, target, ParallelContext.single(device).tp, V,
                                          softcap=softcap)
        else:
            logits = capped(F.linear(hidden, weight)[..., :V].float(), softcap)
            losses = F.cross_entropy(logits, target, reduction="none")
    (losses * upstream).sum().backward()
    return losses.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 1000])
def test_fp32_equals_unfused(monkeypatch, rows_per_chunk):
    monkeypatch.setattr(fused_module, "_rows_per_chunk", lambda vocab, device: rows_per_chunk)
    inputs = _inputs()
    fused, reference = _run(True, *inputs, "fp32"), _run(False, *inputs, "fp32")
    for name, a, b in zip(("losses", "hidden grad", "weight grad"), fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert fused[0][3] == 0.0 and fused[0][17] == 0.0
    assert fused[2][V:].abs().max() == 0.0  # padding rows: zero gradient
    assert fused[1][3].abs().max() == 0.0  # an ignored token sends no gradient back


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 1000])
def test_soft_cap_equals_the_unfused_capped_logits(monkeypatch, rows_per_chunk):
    """Gemma's soft cap inside the fused loss: losses and gradients equal the unfused loss over s tanh(z / cap), in
    fp32 and bf16 autocast; without the cap's slope (1 - tanh^2) in the gradient, or with the cap left out of the
    softmax, they would not (the cap saturates these logits)."""
    monkeypatch.setattr(fused_module, "_rows_per_chunk", lambda vocab, device: rows_per_chunk)
    inputs = _inputs()
    fused, reference = _run(True, *inputs, "fp32", SOFTCAP), _run(False, *inputs, "fp32", SOFTCAP)
    for name, a, b in zip(("losses", "hidden grad", "weight grad"), fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    uncapped = _run(False, *inputs, "fp32")
    assert (fused[0] - uncapped[0]).abs().max() > 0.1  # the cap matters here
    assert fused[0][3] == 0.0 and fused[2][V:].abs().max() == 0.0
    fused, reference = _run(True, *inputs, "bf16", SOFTCAP), _run(False, *inputs, "bf16", SOFTCAP)
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(fused[1:], reference[1:]):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


@pytest.mark.parametrize("rows_per_chunk", [5, 1000])
def test_entropy_of_soft_capped_logits_and_its_gradient(monkeypatch, rows_per_chunk):
    """`vocab_parallel_entropy` with and without the soft cap: the entropy of softmax(s tanh(z / cap)) over the real
    vocabulary, and with a gradient (an RL run's entropy bonus) autograd's through the unfused computation, for the
    hidden states and the weight (padding rows: 0), in chunks of rows and whole."""
    import shardlm.parallel.entropy as entropy_module

    monkeypatch.setattr(entropy_module, "_chunk_rows", lambda real: rows_per_chunk)
    hidden, weight, _, upstream = _inputs()
    weight = weight.clone()
    weight[V:] = 1.0  # padding rows that are not zero: one taking part in the softmax would change every entropy
    tp = ParallelContext.single().tp
    for softcap in (None, SOFTCAP):
        log_p = capped(F.linear(hidden, weight)[..., :V], softcap).log_softmax(-1)
        expected = -(log_p.exp() * log_p).sum(-1)
        torch.testing.assert_close(entropy_module.vocab_parallel_entropy(hidden, weight, tp, V, softcap), expected,
                                   rtol=1e-5, atol=1e-6)
        grads = []
        for fused in (True, False):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            if fused:
                got = entropy_module.vocab_parallel_entropy(h, w, tp, V, softcap)
            else:
                log_p = capped(F.linear(h, w)[..., :V], softcap).log_softmax(-1)
                got = -(log_p.exp() * log_p).sum(-1)
            (got * upstream).sum().backward()
            grads.append((h.grad, w.grad))
        (h_grad, w_grad), (h_ref, w_ref) = grads
        torch.testing.assert_close(h_grad, h_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w_grad, w_ref, rtol=1e-5, atol=1e-6)
        assert w_grad[V:].abs().max() == 0.0 and w_grad[:V].abs().max() > 0


@pytest.mark.parametrize("rows_per_chunk", [5, 1000])
def test_rounded_gemm_width_keeps_padding_out_of_the_softmax(monkeypatch, rows_per_chunk):
    """The width `_gemm_width` gives on a GPU or in half precision (the 300 real rows rounded up to 320 of the
    384), forced in fp32 on the CPU, with padding rows that are not zero, so that a padding logit taking part
    in the softmax would change every loss: losses and gradients equal the unfused ones (which slice the
    padding off before the softmax), and every padding row, inside the GEMM's width or past it, gets zero
    gradient."""
    widths = []

    def gpu_width(real, local, dtype, device):
        widths.append(gemm_width(real, local, dtype, torch.device("cuda")))
        return widths[-1]

    gemm_width = fused_module._gemm_width
    monkeypatch.setattr(fused_module, "_gemm_width", gpu_width)
    monkeypatch.setattr(fused_module, "_rows_per_chunk", lambda vocab, device: rows_per_chunk)
    hidden, weight, target, upstream = _inputs()
    weight[V:] = torch.randn(V_PADDED - V, H, generator=torch.Generator().manual_seed(1))
    fused, reference = _run(True, hidden, weight, target, upstream, "fp32"), _run(False, hidden, weight, target,
                                                                                   upstream, "fp32")
    assert widths == [320]
    for name, a, b in zip(("losses", "hidden grad", "weight grad"), fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert fused[2][V:].abs().max() == 0.0


def test_bf16_autocast_matches_unfused_within_bf16_rounding():
    inputs = _inputs(rows=64)
    fused, reference = _run(True, *inputs, "bf16"), _run(False, *inputs, "bf16")
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    assert fused[2].dtype == torch.float32
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-5, atol=1e-5)  # same bf16 logits, fp32 softmax
    for a, b in zip(fused[1:], reference[1:]):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()  # bf16 GEMMs on both sides, rounded differently
    exact = _run(False, *inputs, "fp32")
    assert (fused[0] - exact[0]).abs().max() < 0.05  # and both are close to fp32


def test_bf16_parameters_without_autocast():
    hidden, weight, target, upstream = _inputs()
    fused = _run(True, hidden.bfloat16(), weight.bfloat16(), target, upstream, "fp32")
    reference = _run(False, hidden.bfloat16(), weight.bfloat16(), target, upstream, "fp32")
    assert fused[1].dtype == torch.bfloat16 and fused[2].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(fused[1:], reference[1:]):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


def test_gpt_at_tp1_trains_like_the_unfused_head():
    from shardlm.models.config import ModelConfig
    from shardlm.models.gpt import GPT

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=V, dropout=0.0)
    tokens = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (True, False):
        model = GPT(cfg, ParallelContext.single(), seed=5)
        assert model.padded_vocab_size > V
        if fused:
            losses = model(tokens[:, :-1], tokens[:, 1:])
        else:
            losses = model.loss(model.output_layer(model.hidden_states(tokens[:, :-1])), tokens[:, 1:])
        losses.mean().backward()
        results.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (fused_losses, fused_grads), (losses, grads) = results
    torch.testing.assert_close(fused_losses, losses, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gemma_soft_capped_head_trains_like_the_unfused_one():
    """Gemma 4's output loss (fused, soft-capped, at an RL run's temperature 0.7, recording entropies) equals the
    cross-entropy of its own capped logits / 0.7 (`loss(output_layer(h) / 0.7)`), losses, entropies and every
    parameter's gradient."""
    from shardlm.models import build_model
    from shardlm.models.config import ModelConfig

    sliding, full = "sliding_attention", "full_attention"
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                      ffn_hidden_size=48, seq_length=16, vocab_size=V, dropout=0.0, sandwich_norms=True, qk_norm=True,
                      value_norm=True, attention_scale=1.0, embedding_scale=True, activation="gelu_tanh",
                      global_head_dim=16, global_kv_heads=1, attention_k_eq_v=True, sliding_window=5,
                      layer_types=[sliding, full], final_logit_softcap=3.0, tie_embeddings=True, init_std=0.2)
    tokens = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(1))
    targets = tokens[:, 1:].clone()
    targets[0, :4] = -100
    results = []
    for fused in (True, False):
        model = build_model(cfg, ParallelContext.single(), seed=5)
        model.logit_temperature, model.entropies = 0.7, []
        h = model.hidden_states(tokens[:, :-1])
        if fused:
            losses = model.output_loss(h, targets)
            entropies = model.entropies.pop()
        else:
            logits = model.output_layer(h) / 0.7
            losses = model.loss(logits, targets)
            log_p = logits[..., :V].float().log_softmax(-1)
            entropies = -(log_p.exp() * log_p).sum(-1) * (targets != -100)
        losses.mean().backward()
        results.append((losses.detach(), entropies, {n: p.grad for n, p in model.named_parameters()}))
    (fused_losses, fused_entropies, fused_grads), (losses, entropies, grads) = results
    assert type(model).__name__ == "Gemma4"
    torch.testing.assert_close(fused_losses, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_entropies, entropies, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _tensor_parallel_checks():
    """Per TP rank: fused vs unfused losses, input and weight gradients (relative errors), and the
    collectives each made, for vocabularies without padding, with padding in the last shard, and with
    shards of padding only (V=100 at TP=4: 512 rows padded, ranks 1-3 hold none of the real ones)."""
    import torch.distributed as dist

    from shardlm.parallel import copy_to_tensor_parallel, vocab_parallel_cross_entropy

    ctx = ParallelContext.from_process_group(dist.get_world_size())
    out = {}
    for vocab in (128 * ctx.tp_size, 300, 100):
        padded = -(-vocab // (128 * ctx.tp_size)) * 128 * ctx.tp_size
        hidden, weight, target, upstream = _inputs(seed=vocab)
        weight = torch.randn(padded, H, generator=torch.Generator().manual_seed(7)) * 0.3
        weight[vocab:] = 0.0
        target = target % vocab
        target[3] = -100
        shard = weight.chunk(ctx.tp_size)[ctx.tp_rank]
        for precision, softcap in (("fp32", None), ("bf16", None)) + ((("fp32", SOFTCAP), ("bf16", SOFTCAP))
                                                                        if vocab == 300 else ()):
            grads, losses, comm = [], [], []
            for use_fused in (True, False):
                h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
                ctx.comm.reset()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    x = copy_to_tensor_parallel(h, ctx.tp)
                    if use_fused:
                        loss = linear_cross_entropy(x, w, target, ctx.tp, vocab, softcap=softcap)
                    else:
                        loss = vocab_parallel_cross_entropy(capped(F.linear(x, w), softcap), target, ctx.tp,
                                                            vocab_size=vocab)
                comm.append(ctx.comm.snapshot())
                (loss * upstream).sum().backward()
                losses.append(loss.detach())
                grads.append((h.grad, w.grad))
            rel = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
                   for a, b in zip((losses[0], *grads[0]), (losses[1], *grads[1]))]
            fused, unfused = comm
            same = fused.keys() == unfused.keys() and all(
                fused[k]["calls"] == unfused[k]["calls"] and fused[k]["elements"] == unfused[k]["elements"] - 1 *
                (1 if "max" in k else 2) for k in fused)  # the one ignored token's values are not sent
            out[(vocab, precision, softcap is not None)] = {"errors": rel, "same_comm": same, "comm": comm}
        for softcap in (None, SOFTCAP):  # the entropy: each rank's sums rescaled to the row's max, and its gradient
            from shardlm.parallel.entropy import vocab_parallel_entropy, vocab_parallel_log_sum_sq_probs

            full_h, full_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            log_p = capped(F.linear(full_h, full_w)[..., :vocab], softcap).log_softmax(-1)
            expected = -(log_p.exp() * log_p).sum(-1)
            (expected * upstream).sum().backward()
            h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
            got = vocab_parallel_entropy(copy_to_tensor_parallel(h, ctx.tp), w, ctx.tp, vocab, softcap)
            (got * upstream).sum().backward()
            expected_w = full_w.grad.chunk(ctx.tp_size)[ctx.tp_rank]
            squares = vocab_parallel_log_sum_sq_probs(hidden, shard, ctx.tp, vocab, softcap)
            expected_squares = torch.logsumexp(2 * log_p.detach(), dim=-1)  # WPO's log sum p^2
            out[("entropy", vocab, softcap is not None)] = max(  # a shard of padding only: both gradients 0
                ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                for a, b in ((got, expected), (h.grad, full_h.grad), (w.grad, expected_w),
                             (squares, expected_squares)))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"tp{w}")
def tensor_parallel(request):
    return run_workers(request.param, run_checks, {"fused": _tensor_parallel_checks})


@pytest.mark.slow
def test_tensor_parallel_equals_unfused_vocab_parallel_path(tensor_parallel):
    for rank, per_rank in enumerate(tensor_parallel):
        status, cases = per_rank["fused"]
        assert status == "ok", f"rank {rank}: {cases}"
        entropies = {key: cases.pop(key) for key in list(cases) if key[0] == "entropy"}
        assert len(entropies) == 6 and all(e <= 1e-5 for e in entropies.values()), (rank, entropies)  # NaN fails
        assert len(cases) == 8, cases.keys()  # three vocabularies in fp32 and bf16, one also soft-capped
        for (vocab, precision, _), case in cases.items():
            tolerance = 1e-5 if precision == "fp32" else 2e-2
            assert max(case["errors"]) <= tolerance, (rank, vocab, precision, case["errors"])
            assert case["same_comm"], (rank, vocab, precision, case["comm"])


def test_entropy_gradient_under_bf16_autocast():
    """The entropy's GEMMs run in the autocast dtype (bf16), the same in the forward and the recomputing backward: its
    value and gradients equal the unfused computation under the same autocast (bf16 logits, an fp32 softmax) within
    bf16's rounding, in the inputs' own dtypes."""
    from shardlm.parallel.entropy import vocab_parallel_entropy

    hidden, weight, _, upstream = _inputs()
    tp = ParallelContext.single().tp
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                got = vocab_parallel_entropy(h, w, tp, V)
            else:
                log_p = F.linear(h, w)[..., :V].float().log_softmax(-1)
                got = -(log_p.exp() * log_p).sum(-1)
        (got * upstream).sum().backward()
        results.append((got.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).abs().max() <= 2e-2 * b.abs().max(), (a - b).abs().max()


def test_the_fp32_head_under_bf16_autocast():
    """`train.cast_lm_head_to_fp32` (TRL's name): under bf16 autocast the output layer runs in fp32 from fp32 copies
    of the hidden states and the weight: the sampler's logits, the fused loss, the entropies and the weight's gradient
    equal the unfused fp32 computation on the (bf16) hidden states, to fp32 rounding; without it the logits are bf16
    and the losses move by bf16's rounding (the control). The trainer builds its model with it from the config."""
    from shardlm.models.config import ModelConfig, ParallelOptions
    from shardlm.models.gpt import GPT

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_heads=4, seq_length=16, vocab_size=V, dropout=0.0)
    hidden = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    targets = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(3))
    weight = GPT(cfg, ParallelContext.single(), seed=5).output_weight.detach().clone().requires_grad_()
    logits = F.linear(hidden.float(), weight)[..., :V]
    want = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="none").view(3, 16)
    want.sum().backward()
    log_p = logits.detach().log_softmax(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    got = {}
    for fp32 in (True, False):  # (the same seed: the same weights)
        model = GPT(cfg, ParallelContext.single(), seed=5, options=ParallelOptions(lm_head_fp32=fp32))
        model.entropies = []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sampled = model.output_layer(hidden)[..., :V]
            losses = model.output_loss(hidden, targets)
        losses.sum().backward()
        got[fp32] = (sampled, losses.detach(), model.entropies[0], model.output_weight.grad)
    sampled, losses, entropies, grad = got[True]
    assert sampled.dtype == torch.float32 and got[False][0].dtype == torch.bfloat16
    torch.testing.assert_close(sampled, logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropies, entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, weight.grad, rtol=1e-4, atol=1e-6)
    assert (got[False][1] - want).abs().max() > 1e-4  # the bf16 head's losses: the option changes the numbers

    from shardlm.config import from_dict
    from shardlm.training.trainer import Trainer

    config = from_dict({"model": {"num_layers": 1, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                                  "vocab_size": V}, "train": {"precision": "bf16", "cast_lm_head_to_fp32": True,
                                                              "micro_batch_size": 1, "global_batch_size": 1}})
    assert Trainer(config, ParallelContext.single(), None).model.lm_head_fp32
