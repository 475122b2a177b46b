"""The trainer's loss of a distillation run: each answer token's divergence from the teacher, summed over the
global batch's answer tokens and divided by their count (TRL's "batchmean" with gradient accumulation:
`num_items_in_batch`), so every layout and micro-batch split computes the same loss."""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from shardlm.config import DistillConfig
from shardlm.distill.divergence import generalized_jsd, token_reverse_kl
from shardlm.distill.teacher import pipelined_hidden
from shardlm.models.decoder import enter_parallel_region
from shardlm.parallel import invariant

CHUNK = 1 << 22
"""Logits (rows x this rank's vocabulary slice) a chunk of the divergence computes at once: 16 MiB in fp32."""


class DistillLoss:
    """`loss(forward, batch)` of a packed SFT micro-batch (`shardlm.training.data.packed_parts`: inputs, targets,
    documents and the global batch's answer-token count `divisor`): the teacher's final hidden states (no
    gradient), then the student's forward, which runs both output layers on its own and the divergence
    (`generalized_jsd`) inside its call; the answer tokens' sum over `divisor`."""

    def __init__(self, cfg: DistillConfig, ctx, student, teacher):
        self.cfg, self.ctx, self.student, self.teacher = cfg, ctx, student, teacher

    @contextlib.contextmanager
    def teacher_context(self):
        """No gradient; a bf16 teacher (`distill.teacher_dtype`) computes under bf16 autocast."""
        bf16 = self.cfg.teacher_dtype == "bf16"
        with torch.no_grad(), (torch.autocast(self.ctx.device.type, dtype=torch.bfloat16) if bf16
                               else contextlib.nullcontext()):
            yield

    def token_divergence(self, hidden: torch.Tensor, teacher_hidden: torch.Tensor, targets: torch.Tensor
                         ) -> torch.Tensor:
        """(B, T, h) student and (B, T, h_teacher) teacher final-norm outputs (or their sequence chunks), targets
        (B, T) (-100: not trained) -> (B, T) divergences over the vocabulary-parallel logits there (0 elsewhere:
        prompts and padding cost nothing). Rows run in chunks of about `CHUNK` logits each, each chunk
        checkpointed: its logits (both models') are computed again in the backward, never all held at once."""
        tp = self.ctx.tp
        student = enter_parallel_region(hidden, tp, self.student.sequence_parallel)
        with self.teacher_context():
            teacher = enter_parallel_region(teacher_hidden, tp, self.teacher.sequence_parallel)
        answer = targets != -100
        kept = answer.reshape(-1).nonzero().squeeze(-1)
        student = student.reshape(-1, student.shape[-1])[kept]
        teacher = teacher.reshape(-1, teacher.shape[-1])[kept]
        targets = targets.reshape(-1)[kept]
        rows = max(1, CHUNK // self.student.output_weight.shape[0])
        parts = [checkpoint(self._chunk, student[first:first + rows], teacher[first:first + rows],
                            targets[first:first + rows], use_reentrant=False)
                 for first in range(0, student.shape[0], rows)]
        values = torch.cat(parts) if parts else student.new_zeros(0, dtype=torch.float32)
        out = torch.zeros(answer.numel(), dtype=values.dtype, device=values.device)
        return out.index_copy(0, kept, values).view(answer.shape)

    def _chunk(self, student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(n, h) and (n, h_teacher) rows and their (n,) target tokens -> (n,) losses (`distill.loss`)."""
        with self.teacher_context():
            teacher_logits = invariant.linear(teacher, self.teacher.output_weight)
        student_logits = invariant.linear(student, self.student.output_weight)
        vocab = self.student.cfg.vocab_size
        if self.cfg.loss == "token_kl":
            return token_reverse_kl(student_logits, teacher_logits, targets, self.ctx.tp, vocab, self.cfg.temperature)
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
        total = self.token_divergence(hidden, batch["teacher_hidden"], batch["targets"]).sum()
        return total / batch["divisor"]

    def __call__(self, forward, batch: dict) -> torch.Tensor:
        with self.teacher_context():
            teacher_hidden = self.teacher(batch["inputs"], documents=batch["documents"], hidden_only=True)
        divergence = forward(batch["inputs"], documents=batch["documents"],
                             then=lambda hidden: self.token_divergence(hidden, teacher_hidden, batch["targets"]))
        total = divergence.sum()
        if batch["divisor"] is not None:
            return total / batch["divisor"]
        return total / (batch["targets"] != -100).sum().clamp(min=1)
