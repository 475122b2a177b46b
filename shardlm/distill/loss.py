"""The trainer's loss of a distillation run: each answer token's divergence from the teacher, summed over the
global batch's answer tokens and divided by their count (TRL's "batchmean" with gradient accumulation:
`num_items_in_batch`), so every layout and micro-batch split computes the same loss."""

from __future__ import annotations

import contextlib

import torch

from shardlm.config import DistillConfig
from shardlm.distill.divergence import generalized_jsd, token_log_probs, token_reverse_kl
from shardlm.distill.iw_opd import Tally, prefix_weights
from shardlm.distill.teacher import pipelined_hidden, release_teacher
from shardlm.distill.top_k import top_k_jsd
from shardlm.models.decoder import enter_parallel_region
from shardlm.parallel import invariant

CHUNK = 1 << 22
"""Logits (rows x this rank's vocabulary slice) a chunk of the divergence computes at once: 16 MiB in fp32."""



class DistillLoss:
    """`loss(forward, batch)` of a packed SFT micro-batch (`shardlm.training.data.packed_parts`: inputs, targets,
    documents and the global batch's answer-token count `divisor`): the teacher's final hidden states (no
    gradient), then the student's forward, which runs both output layers on its own and the divergence
    (`generalized_jsd`) inside its call; the answer tokens' sum over `divisor`. A teacher sharded by FSDP
    (`shardlm.training.frozen.shard_frozen`) runs its forward once per call, as the student does (so in lockstep
    over DP), and its gathered root is freed once the student's forward returns."""

    def __init__(self, cfg: DistillConfig, ctx, student, teacher):
        self.cfg, self.ctx, self.student, self.teacher = cfg, ctx, student, teacher
        self.tally = Tally() if cfg.loss == "iw_opd" else None

    @contextlib.contextmanager
    def teacher_context(self):
        """No gradient; a bf16 teacher (`distill.teacher_dtype`) computes under bf16 autocast."""
        bf16 = self.cfg.teacher_dtype == "bf16"
        with torch.no_grad(), (torch.autocast(self.ctx.device.type, dtype=torch.bfloat16) if bf16
                               else contextlib.nullcontext()):
            yield

    def token_divergence(self, hidden: torch.Tensor, teacher_hidden: torch.Tensor, targets: torch.Tensor,
                         documents=None) -> torch.Tensor:
        """(B, T, h) student and (B, T, h_teacher) teacher final-norm outputs (or their sequence chunks), targets
        (B, T) (-100: not trained) -> (B, T) divergences over the vocabulary-parallel logits there (0 elsewhere:
        prompts and padding cost nothing). Rows run in chunks of about `CHUNK` logits each, each chunk
        computed once in the forward with their gradients (`_Chunked`), never all held at once. IW-OPD first
        takes every answer token's advantage in a pass without gradient, then its documents' weights
        (`documents`: the micro-batch's, None: a document a row)."""
        tp = self.ctx.tp
        student = enter_parallel_region(hidden, tp, self.student.sequence_parallel)
        with self.teacher_context():
            teacher = enter_parallel_region(teacher_hidden, tp, self.teacher.sequence_parallel)
        answer = targets != -100
        kept = answer.reshape(-1).nonzero().squeeze(-1)
        student = student.reshape(-1, student.shape[-1])[kept]
        teacher = teacher.reshape(-1, teacher.shape[-1])[kept]
        targets = targets.reshape(-1)[kept]
        weight = self.student.output_weight
        scales = None if self.tally is None else self._iw_opd_scales(student, teacher, targets, answer, kept, documents)
        if torch.is_grad_enabled():
            values = _Chunked.apply(student, weight, teacher, targets, scales, self)
        else:  # evaluation: the values alone
            values = self._in_chunks(student.shape[0], lambda part: self._chunk(
                student[part], weight, teacher[part], targets[part], None if scales is None else scales[part]))
        out = torch.zeros(answer.numel(), dtype=values.dtype, device=values.device)
        return out.index_copy(0, kept, values).view(answer.shape)

    def _in_chunks(self, total: int, compute) -> torch.Tensor:
        """`compute(rows)` of each chunk of about `CHUNK` logits (rows: a slice of the `total` answer tokens),
        concatenated in fp32."""
        step = max(1, CHUNK // self.student.output_weight.shape[0])
        parts = [compute(slice(i, i + step)) for i in range(0, total, step)]
        return torch.cat(parts).float() if parts else torch.zeros(0, device=self.ctx.device)

    def _iw_opd_scales(self, student, teacher, targets, answer, kept, documents) -> torch.Tensor:
        """IW-OPD's (n,) w a of the answer tokens (`shardlm.distill.iw_opd`), no gradient; tallied in training."""
        vocab, tp, temperature = self.student.cfg.vocab_size, self.ctx.tp, self.cfg.temperature
        with torch.no_grad():
            def advantage(part):
                student_logits = invariant.linear(student[part], self.student.output_weight)
                with self.teacher_context():
                    teacher_logits = invariant.linear(teacher[part], self.teacher.output_weight)
                logp, teacher_logp = token_log_probs(student_logits, teacher_logits, targets[part], tp, vocab,
                                                     temperature)
                return teacher_logp - logp

            a = self._in_chunks(student.shape[0], advantage)
            size = torch.zeros(answer.numel(), dtype=a.dtype, device=a.device).index_copy(0, kept, a.abs())
            weights = prefix_weights(size.view(answer.shape), documents, self.ctx.cp, self.cfg.iw_opd_gamma,
                                     self.cfg.iw_opd_epsilon).reshape(-1)[kept]
        if self.student.training:
            self.tally.add(a, weights)
        return weights * a

    def take_metrics(self) -> dict[str, float]:
        """IW-OPD's step figures (`shardlm.distill.iw_opd.Tally`); nothing for the other losses."""
        return {} if self.tally is None else self.tally.take(self.ctx)

    def _chunk(self, student: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor,
               scales: torch.Tensor | None = None) -> torch.Tensor:
        """(n, h) and (n, h_teacher) rows, the student's output weight and the rows' (n,) target tokens -> (n,)
        losses (`distill.loss`; IW-OPD's with its (n,) w a `scales`)."""
        student_logits = invariant.linear(student, weight)
        vocab = self.student.cfg.vocab_size
        if self.cfg.loss == "iw_opd":  # the teacher's part is in `scales`
            logp, _ = token_log_probs(student_logits, None, targets, self.ctx.tp, vocab, self.cfg.temperature)
            return -scales * logp
        with self.teacher_context():
            teacher_logits = invariant.linear(teacher, self.teacher.output_weight)
        if self.cfg.loss == "token_kl":
            return token_reverse_kl(student_logits, teacher_logits, targets, self.ctx.tp, vocab, self.cfg.temperature)
        if 0 < self.cfg.loss_top_k < vocab:
            return top_k_jsd(student_logits, teacher_logits, targets, self.ctx.tp, vocab, self.cfg.beta,
                             self.cfg.temperature, self.cfg.loss_top_k, self.cfg.loss_add_tail,
                             self.cfg.reverse_kl_top_1_mode)
        return generalized_jsd(student_logits, teacher_logits, self.ctx.tp, vocab, self.cfg.beta, self.cfg.temperature)

    def teacher_pass(self, batches: list[dict]) -> None:
        """Under pipeline stages, before the student's schedule runs `batches`: the teacher's final hidden states of
        each, through its own stages (`pipelined_hidden`), kept in the micro-batch dict on the last stage."""
        with self.teacher_context():
            for batch in batches:
                batch["teacher_hidden"] = pipelined_hidden(self.teacher, batch["inputs"], batch["documents"],
                                                           self.ctx)

    def of_hidden(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        """The last pipeline stage's loss of one micro-batch from the student's final-norm output."""
        total = self.token_divergence(hidden, batch["teacher_hidden"], batch["targets"], batch["documents"]).sum()
        return total / batch["divisor"]

    def __call__(self, forward, batch: dict) -> torch.Tensor:
        with self.teacher_context():  # under FSDP: collective over DP, once per student forward (lockstep)
            teacher_hidden = self.teacher(batch["inputs"], documents=batch["documents"], hidden_only=True)
        try:
            divergence = forward(batch["inputs"], documents=batch["documents"],
                                 then=lambda hidden: self.token_divergence(hidden, teacher_hidden, batch["targets"],
                                                                           batch["documents"]))
        finally:  # the divergence took its gradients in the forward (`_Chunked`): the teacher's output layer is done
            release_teacher(self.teacher)
        total = divergence.sum()
        if batch["divisor"] is not None:
            return total / batch["divisor"]
        return total / (batch["targets"] != -100).sum().clamp(min=1)


class _Chunked(torch.autograd.Function):
    """The divergence of (n, h) student rows in chunks of about `CHUNK` logits: each chunk's logits (both models')
    are computed once, in the forward, with the gradient of its losses with respect to the rows and the output
    weight taken there and then (as `linear_cross_entropy` does), so no chunk runs again in the backward and no
    chunk's logits outlive it. The backward scales those gradients by the upstream gradient, which the loss (a sum
    over tokens over one divisor) makes the same for every row."""

    @staticmethod
    def forward(ctx, student, weight, teacher, targets, scales, loss: DistillLoss):
        rows_grad, weight_grad = torch.zeros_like(student), torch.zeros_like(weight)
        step = max(1, CHUNK // weight.shape[0])
        values = []
        for first in range(0, student.shape[0], step):
            with torch.enable_grad():
                rows = student[first:first + step].detach().requires_grad_()
                w = weight.detach().requires_grad_()
                value = loss._chunk(rows, w, teacher[first:first + step], targets[first:first + step],
                                    None if scales is None else scales[first:first + step])
                grads = torch.autograd.grad(value.sum(), (rows, w))
            rows_grad[first:first + step] = grads[0]
            weight_grad += grads[1]
            values.append(value.detach())
        ctx.save_for_backward(rows_grad, weight_grad)
        return torch.cat(values) if values else student.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows_grad, weight_grad = ctx.saved_tensors
        scale = grad[0] if grad.numel() else grad.new_zeros(())
        return rows_grad * grad.unsqueeze(-1).to(rows_grad.dtype), weight_grad * scale.to(weight_grad.dtype), \
            None, None, None, None
