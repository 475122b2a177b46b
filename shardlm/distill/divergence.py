"""The generalized Jensen-Shannon divergence between a student's and a teacher's next-token distributions, and the
per-token reverse KL of on-policy distillation (`token_reverse_kl`), over vocabulary-parallel logits: no rank ever
holds the whole vocabulary.

Per position, with s and t the student's and teacher's log-probabilities of logits / temperature and
m = log((1 - beta) e^s + beta e^t) their mixture's, as TRL's `generalized_jsd_loss` defines it:

    beta = 0    KL(teacher || student)  = sum_v e^t (t - s)
    beta = 1    KL(student || teacher)  = sum_v e^s (s - t)
    otherwise   beta KL(teacher || mixture) + (1 - beta) KL(student || mixture)
                = sum_v beta e^t (t - m) + (1 - beta) e^s (s - m)

Each TP rank holds a slice of the vocabulary (rows past `vocab_size` are padding and take no part). The ranks agree
on each position's maximum (an all-reduce MAX, no gradient) and sum of exponentials (an all-reduce SUM) for the
log-sum-exp, then each sums its slice's terms and one all-reduce SUM adds the slices. Gradients: the final sum's
backward is the identity on each rank (every rank computes the same loss from it, as the cross-entropy's does);
the student's sum of exponentials feeds every rank's terms, so its backward sums the ranks' gradients
(`_SharedSum`), which gives each logit exactly its log-softmax gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlm.parallel import Communicator
from shardlm.parallel.mappings import reduce_from_tensor_parallel


class _SharedSum(torch.autograd.Function):
    """All-reduce (sum) over TP whose result every rank then uses in its own terms: the backward sums the ranks'
    gradients too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Communicator) -> torch.Tensor:
        ctx.tp = tp
        return tp.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.all_reduce(grad.clone()), None


def log_softmax(logits: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """(..., V_local) this rank's slice of the real vocabulary's logits -> their log-probabilities under the softmax
    over every rank's slices (differentiable when `logits` is)."""
    peak = logits.detach().amax(dim=-1, keepdim=True) if logits.shape[-1] else \
        logits.new_full((*logits.shape[:-1], 1), float("-inf"))
    tp.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = (logits - peak).exp().sum(dim=-1, keepdim=True)
    total = _SharedSum.apply(total, tp) if logits.requires_grad and tp.size > 1 else tp.all_reduce(total)
    return logits - peak - total.log()


def pick(log_probs: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """(..., V_real_local) log-probabilities of this rank's slice (vocabulary ids `first`...), (..., m) ids -> (..., m)
    the values of the ids this slice holds, 0 for the others (a slice of padding alone holds none)."""
    mine = (ids >= first) & (ids < first + log_probs.shape[-1])
    if not log_probs.shape[-1]:
        return log_probs.sum(dim=-1, keepdim=True).expand(ids.shape) * 0  # (kept in the graph: a zero gradient)
    return log_probs.gather(-1, torch.where(mine, ids - first, 0)) * mine


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, tp: Communicator, vocab_size: int, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """student (..., V_padded / tp) this rank's logits, teacher (..., V_padded / tp) its teacher's (no gradient;
    the same slice of the same vocabulary) -> (...) fp32 per-position divergence (module docstring), the same on
    every TP rank."""
    local = student.shape[-1]
    real = max(0, min(local, vocab_size - tp.rank * local))
    s = log_softmax(student[..., :real].float() / temperature, tp)
    t = log_softmax(teacher[..., :real].detach().float() / temperature, tp)
    if beta == 0:
        terms = t.exp() * (t - s)
    elif beta == 1:
        terms = s.exp() * (s - t)
    else:
        mixture = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        terms = beta * t.exp() * (t - mixture) + (1 - beta) * s.exp() * (s - mixture)
    return reduce_from_tensor_parallel(terms.sum(dim=-1), tp)


def token_log_probs(student: torch.Tensor, teacher: torch.Tensor | None, targets: torch.Tensor, tp: Communicator,
                    vocab_size: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The student's and the teacher's log-probabilities (each (n,) fp32, the student's differentiable) of the tokens
    `targets` (n,) under logits / temperature: student, teacher (n, V_padded / tp) this rank's logits (teacher
    None: the student's alone, None for the teacher's). Each rank picks the targets in its slice of the vocabulary;
    one all-reduce adds them."""
    local = student.shape[-1]
    first = tp.rank * local
    real = max(0, min(local, vocab_size - first))
    sides = [student] if teacher is None else [student, teacher.detach()]
    picked = torch.stack([pick(log_softmax(x[..., :real].float() / temperature, tp), targets.unsqueeze(-1),
                               first).squeeze(-1) for x in sides])
    picked = reduce_from_tensor_parallel(picked, tp)
    return picked[0], (picked[1] if teacher is not None else None)


def token_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, tp: Communicator,
                     vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """On-policy distillation's per-token reverse KL of the tokens `targets` (n,): student, teacher (n, V_padded /
    tp) this rank's logits -> (n,) fp32 losses whose values are log p_s(x) - log p_t(x) (a one-sample estimate of
    KL(student || teacher) at each token) and whose gradient is (log p_s(x) - log p_t(x)) grad log p_s(x): the
    teacher's score as a per-token advantage, the REINFORCE form of the reverse KL's gradient when x is sampled
    from the student."""
    logp, teacher_logp = token_log_probs(student, teacher, targets, tp, vocab_size, temperature)
    advantage = (logp - teacher_logp).detach()
    return advantage + advantage * (logp - logp.detach())
