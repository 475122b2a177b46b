"""The divergence on a top-k support (`distill.loss_top_k`) against TRL's own functions, and split over TP ranks.

TRL's `IWOPDTrainer` (its "jsd" objective) computes it with `generalized_jsd_loss` (the teacher's, the student's or
both top-k) and, for k = 1 with beta > 0, `_compute_local_sparse_top_1_divergence_loss` (the teacher's top token and
the reverse top-1 token: the sampled one or the student's argmax). On random logits of 12 positions over 50 tokens
(temperature 2, the teacher's sharper), for beta 0, 0.5 and 1, k 1 and 5, with and without the tail bucket, each
reverse mode: shardlm's `top_k_jsd` at one rank, averaged over the positions, equals TRL's loss within 1e-6
relative, and its gradient with respect to the student's logits TRL's within 1e-5; each differs from the whole
vocabulary's divergence.

Split over TP: the same logits as slices of 2 and 3 ranks (50 tokens padded to 52 and 75: at TP=3 the last slice is
padding alone, fewer real tokens than k = 20) give each position's divergence and each slice's gradient of the
one-process values within 1e-6, and so do the whole vocabulary's JSD and the sampled tokens' log-probabilities
(`divergence.token_log_probs`) on those slices; the control, each rank's support drawn from its own slice, does not.
"""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch

from shardlm.distill import divergence, top_k
from shardlm.parallel import ParallelContext

from multiproc import check_result, import_or_skip, run_checks, run_workers

N, VOCAB, TEMPERATURE = 12, 50, 2.0


def logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student (N, VOCAB), teacher (N, VOCAB), next tokens (N,)): random logits, the teacher's sharper."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(N, VOCAB, generator=g)
    teacher = 3.0 * torch.randn(N, VOCAB, generator=g)
    return student, teacher, torch.randint(0, VOCAB, (N,), generator=g)


def ours(student, teacher, targets, beta, k, tail, mode, tp=None) -> torch.Tensor:
    tp = tp or ParallelContext.single().tp
    return top_k.top_k_jsd(student, teacher, targets, tp, VOCAB, beta, TEMPERATURE, k, tail, mode)


def trls(student, teacher, targets, beta, k, tail, mode) -> torch.Tensor:
    """TRL's loss of the positions (their mean) as `IWOPDTrainer.compute_loss` picks it for a local teacher."""
    iw_opd = import_or_skip("trl.experimental.iw_opd.iw_opd_trainer")
    trainer = iw_opd.IWOPDTrainer
    labels = targets.unsqueeze(0)
    if beta > 0 and k == 1:
        fake = SimpleNamespace(temperature=TEMPERATURE, beta=beta, loss_add_tail=tail, reverse_kl_top_1_mode=mode,
                               _reduce_divergence_loss=trainer._reduce_divergence_loss)
        fake._get_reverse_kl_top_1_tokens = lambda scores, tokens: trainer._get_reverse_kl_top_1_tokens(
            fake, scores, tokens)
        fake._compute_sparse_top_1_divergence_loss = lambda **kw: trainer._compute_sparse_top_1_divergence_loss(
            fake, **kw)
        return trainer._compute_local_sparse_top_1_divergence_loss(fake, student.unsqueeze(0), teacher.unsqueeze(0),
                                                                   labels, labels)
    return trainer.generalized_jsd_loss(student.unsqueeze(0), teacher.unsqueeze(0), labels=labels, beta=beta,
                                        temperature=TEMPERATURE, top_k=k, add_tail=tail)


CASES = [(beta, k, tail, mode) for beta, k, tail in itertools.product((0.0, 0.5, 1.0), (1, 5), (True, False))
         for mode in (("sampled", "argmax") if beta > 0 and k == 1 else ("sampled",))]


@pytest.mark.parametrize("beta, k, tail, mode", CASES, ids=[f"beta {b} k {k} {'tail' if t else 'renormalized'} {m}"
                                                           for b, k, t, m in CASES])
def test_top_k_divergence_equals_trls(beta, k, tail, mode):
    student, teacher, targets = logits()
    mine = student.clone().requires_grad_()
    value = ours(mine, teacher, targets, beta, k, tail, mode).mean()
    (grad,) = torch.autograd.grad(value, mine)
    theirs = student.clone().requires_grad_()
    reference = trls(theirs, teacher, targets, beta, k, tail, mode)
    (reference_grad,) = torch.autograd.grad(reference, theirs)
    assert abs(value.item() - reference.item()) <= 1e-6 * abs(reference.item()), (value.item(), reference.item())
    assert (grad - reference_grad).abs().max() <= 1e-5 * reference_grad.abs().max()
    whole = divergence.generalized_jsd(student, teacher, ParallelContext.single().tp, VOCAB, beta, TEMPERATURE).mean()
    assert abs(whole.item() - value.item()) > 1e-3 * abs(value.item())


def own_top_k(scores, k, tp, first):
    """The control's bug: each TP rank's support drawn from its own slice alone (padded to k as the real one, so
    every rank's collectives keep their shapes)."""
    return GLOBAL_TOP_K(scores, k, ParallelContext.single().tp, first)


GLOBAL_TOP_K = top_k.global_top_k


@contextlib.contextmanager
def own_supports(on: bool = True):
    """The control's bug (`own_top_k`) in place while the block runs, when `on` (also `tests/test_distill_layouts.py`'s
    control)."""
    if on:
        top_k.global_top_k = own_top_k
    try:
        yield
    finally:
        top_k.global_top_k = GLOBAL_TOP_K


LOCAL = {2: 26, 3: 25}
"""Each TP rank's slice: at TP=2 26 and 24 real tokens, at TP=3 25, 25 and none (the last slice padding alone)."""


def split_case(ctx, beta: float, k: int, own_support: bool = False) -> dict:
    """This TP rank's divergences and its slice's gradient of the module's logits, the vocabulary padded to
    `LOCAL` entries a rank."""
    student, teacher, targets = logits()
    local = LOCAL[ctx.tp_size]
    pad = local * ctx.tp_size - VOCAB
    part = slice(ctx.tp_rank * local, (ctx.tp_rank + 1) * local)
    mine = torch.nn.functional.pad(student, (0, pad))[:, part].clone().requires_grad_()
    with own_supports(own_support):
        values = ours(mine, torch.nn.functional.pad(teacher, (0, pad))[:, part], targets, beta, k, True, "sampled",
                      tp=ctx.tp)
    (grad,) = torch.autograd.grad(values.sum(), mine)
    return {"values": values.detach(), "grad": grad[:, :max(0, min(local, VOCAB - part.start))]}


SPLITS = {"beta 0.5 k 20": (0.5, 20), "beta 0 k 20": (0.0, 20), "beta 1 k 1": (1.0, 1), "beta 0.5 k 1": (0.5, 1)}


def whole_vocabulary(student, teacher, targets, tp=None) -> torch.Tensor:
    """The whole vocabulary's JSD (beta 0.5) plus the student's log-probability of each next token, per position."""
    tp = tp or ParallelContext.single().tp
    logp, _ = divergence.token_log_probs(student, teacher, targets, tp, VOCAB, TEMPERATURE)
    return divergence.generalized_jsd(student, teacher, tp, VOCAB, 0.5, TEMPERATURE) + logp


def split_whole(ctx) -> dict:
    """`split_case` of `whole_vocabulary`."""
    student, teacher, targets = logits()
    local = LOCAL[ctx.tp_size]
    pad, part = local * ctx.tp_size - VOCAB, slice(ctx.tp_rank * local, (ctx.tp_rank + 1) * local)
    mine = torch.nn.functional.pad(student, (0, pad))[:, part].clone().requires_grad_()
    values = whole_vocabulary(mine, torch.nn.functional.pad(teacher, (0, pad))[:, part], targets, tp=ctx.tp)
    (grad,) = torch.autograd.grad(values.sum(), mine)
    return {"values": values.detach(), "grad": grad[:, :max(0, min(local, VOCAB - part.start))]}


def world_body(world_size: int) -> dict:
    ctx = ParallelContext.from_process_group(world_size)
    checks = {name: (lambda b=beta, k=k: split_case(ctx, b, k)) for name, (beta, k) in SPLITS.items()}
    checks["control"] = lambda: split_case(ctx, 0.5, 20, own_support=True)
    checks["whole vocabulary"] = lambda: split_whole(ctx)
    return run_checks(checks)


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def world(request):
    return run_workers(request.param, world_body, request.param, timeout=120)


@pytest.mark.parametrize("name", list(SPLITS))
def test_tp_slices_give_one_process_values(world, name):
    beta, k = SPLITS[name]
    student, teacher, targets = logits()
    whole = student.clone().requires_grad_()
    values = ours(whole, teacher, targets, beta, k, True, "sampled")
    (grad,) = torch.autograd.grad(values.sum(), whole)
    ranks = check_result(world, name)
    for value in ranks:
        assert (value["values"] - values.detach()).abs().max() <= 1e-6 * values.abs().max()
    assert (torch.cat([r["grad"] for r in ranks], dim=-1) - grad).abs().max() <= 1e-6 * grad.abs().max()


def test_the_whole_vocabulary_on_tp_slices_gives_one_process_values(world):
    student, teacher, targets = logits()
    whole = student.clone().requires_grad_()
    values = whole_vocabulary(whole, teacher, targets)
    (grad,) = torch.autograd.grad(values.sum(), whole)
    ranks = check_result(world, "whole vocabulary")
    for value in ranks:
        assert (value["values"] - values.detach()).abs().max() <= 1e-6 * values.abs().max()
    assert (torch.cat([r["grad"] for r in ranks], dim=-1) - grad).abs().max() <= 1e-6 * grad.abs().max()


def test_each_ranks_own_support_is_another_divergence(world):
    student, teacher, targets = logits()
    values = ours(student, teacher, targets, 0.5, 20, True, "sampled")
    assert max((r["values"] - values).abs().max().item() for r in check_result(world, "control")) > 1e-3
