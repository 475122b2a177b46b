"""The generalized JSD on a top-k support (`distill.loss_top_k`, TRL's `loss_top_k` of its IW-OPD trainer's "jsd"
objective) over vocabulary-parallel logits.

Per position, with s and t the student's and the teacher's log-probabilities of logits / temperature over the whole
vocabulary (`divergence.log_softmax`), the support S is:

    beta = 0        the teacher's k most likely tokens
    beta = 1        the student's k most likely tokens (k = 1: the reverse top-1 token, below)
    otherwise       the union of both (the teacher's first, each token once); k = 1: the teacher's top token and the
                    reverse top-1 token
    reverse top-1   `reverse_kl_top_1_mode`: "sampled", the position's own next token (the sampled one on an
                    on-policy step), or "argmax", the student's most likely token

and s, t restricted to S either gain a tail bucket, log(1 - sum_S e^x) (`loss_add_tail`: the mass outside S, so the
divergence does not vanish at k = 1), or are renormalized over S; the divergence of `divergence.generalized_jsd` is
then summed over S (and the tail). k >= the vocabulary is the whole vocabulary (`generalized_jsd`), as in TRL.

Tensor parallelism: each rank ranks its slice (logits / temperature, as TRL ranks them) and the k best of every
slice are gathered over TP, so every rank draws the same k from the same candidates; a token's log-probability is
read by the rank holding it and the slices' reads summed by one all-reduce, whose backward is the identity (every
rank computes the same loss from them), so each read's gradient reaches its holder alone and, through the shared
log-sum-exp, every logit. Ties between equal logits are broken by rank, then by position, which for exactly equal
fp32 logits may pick another of them than one process's `topk` does.
"""

from __future__ import annotations

import torch

from shardlm.distill.divergence import log_softmax, pick
from shardlm.parallel import Communicator
from shardlm.parallel.mappings import reduce_from_tensor_parallel


def global_top_k(scores: torch.Tensor, k: int, tp: Communicator, first: int) -> torch.Tensor:
    """(..., V_real_local) this rank's scores of its slice (vocabulary ids `first`...) -> (..., k) the ids of each
    row's k largest over every rank's slices, in decreasing order, the same on every rank (one all-gather of values
    and one of ids, whatever the leading dimensions)."""
    local = min(k, scores.shape[-1])
    values, ids = scores.topk(local, dim=-1) if local else (scores[..., :0], scores[..., :0].long())
    if local < k:  # a slice narrower than k: never chosen over real entries
        values = torch.cat([values, values.new_full((*values.shape[:-1], k - local), float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_zeros((*ids.shape[:-1], k - local))], dim=-1)
    ids = ids + first
    if tp.size > 1:
        values, ids = (torch.cat(tp.all_gather(x.contiguous()), dim=-1) for x in (values, ids))
    return ids.gather(-1, values.topk(k, dim=-1).indices)


def read(log_probs: torch.Tensor, ids: torch.Tensor, tp: Communicator, first: int) -> torch.Tensor:
    """(..., V_real_local) log-probabilities of this rank's slice, (..., m) vocabulary ids -> (..., m) their values,
    read by the rank holding each id and summed over TP in one all-reduce (backward: the identity)."""
    return reduce_from_tensor_parallel(pick(log_probs, ids, first), tp)


def support(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, tp: Communicator, first: int,
            beta: float, k: int, reverse_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (n, m), kept (n, m) bool: False on a repeat) of each position's support (module docstring), from the
    rows' (n, V_real_local) scaled logits and (n,) next tokens."""
    def reverse():
        return targets.unsqueeze(-1) if reverse_mode == "sampled" else global_top_k(student, 1, tp, first)

    if beta == 0:
        ids = global_top_k(teacher, k, tp, first)
    elif beta == 1:
        ids = reverse() if k == 1 else global_top_k(student, k, tp, first)
    elif k == 1:
        ids = torch.cat([global_top_k(teacher, 1, tp, first), reverse()], dim=-1)
    else:  # both sides' top-k drawn together
        ids = global_top_k(torch.stack([teacher, student]), k, tp, first)
        ids = torch.cat([ids[0], ids[1]], dim=-1)
    kept = torch.ones_like(ids, dtype=torch.bool)
    for i in range(1, ids.shape[-1]):  # each token once: a repeat of an earlier one is dropped
        kept[:, i] = ~(ids[:, i:i + 1] == ids[:, :i]).any(dim=-1)
    return torch.where(kept, ids, 0), kept


def _with_tail(log_probs: torch.Tensor) -> torch.Tensor:
    """(n, m) log-probabilities on a support (-inf off it) -> (n, m + 1) with the mass outside it appended."""
    inside = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(inside))], dim=-1)


def top_k_jsd(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, tp: Communicator,
              vocab_size: int, beta: float, temperature: float, k: int, add_tail: bool = True,
              reverse_mode: str = "sampled") -> torch.Tensor:
    """student (n, V_padded / tp) this rank's logits, teacher the same of the teacher (no gradient), targets (n,)
    each position's next token -> (n,) fp32 divergences on the top-k support (module docstring), the same on every
    TP rank."""
    local = student.shape[-1]
    first = tp.rank * local
    real = max(0, min(local, vocab_size - first))
    s_logits = student[..., :real].float() / temperature
    t_logits = teacher[..., :real].detach().float() / temperature
    ids, kept = support(s_logits.detach(), t_logits, targets, tp, first, beta, k, reverse_mode)
    off = torch.tensor(float("-inf"), device=student.device)
    both = read(torch.stack([log_softmax(s_logits, tp), log_softmax(t_logits, tp)]), ids.expand(2, *ids.shape), tp,
                first)  # the student's values and the teacher's in one all-reduce
    s, t = torch.where(kept, both[0], off), torch.where(kept, both[1], off)
    if add_tail:
        s, t, kept = _with_tail(s), _with_tail(t), torch.cat([kept, kept[:, :1]], dim=-1)
    else:
        s, t = s - torch.logsumexp(s, dim=-1, keepdim=True), t - torch.logsumexp(t, dim=-1, keepdim=True)
    return _masked_jsd(s, t, kept, beta).sum(dim=-1)


def _masked_jsd(s: torch.Tensor, t: torch.Tensor, kept: torch.Tensor, beta: float) -> torch.Tensor:
    """(n, m) terms of the generalized JSD of log-probabilities s, t on the support entries `kept` (0 elsewhere);
    each term 0 where its probabilities are (a token the student or the teacher gives no mass)."""
    zero = torch.zeros((), device=s.device)
    safe_s, safe_t = torch.where(kept, s, zero), torch.where(kept, t, zero)
    p_s, p_t = torch.where(kept, s.exp(), zero), torch.where(kept, t.exp(), zero)
    if beta == 0:
        return torch.nan_to_num(p_t * (safe_t - safe_s), nan=0.0)
    if beta == 1:
        return torch.nan_to_num(p_s * (safe_s - safe_t), nan=0.0)
    mixture = torch.where(kept, torch.log(((1 - beta) * p_s + beta * p_t).clamp_min(torch.finfo(s.dtype).tiny)), zero)
    return (beta * torch.nan_to_num(p_t * (safe_t - mixture), nan=0.0)
            + (1 - beta) * torch.nan_to_num(p_s * (safe_s - mixture), nan=0.0))
