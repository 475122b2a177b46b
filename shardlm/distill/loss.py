"""The trainer's loss of a distillation run: each answer token's divergence from the teacher, summed over the
global batch's answer tokens and divided by their count (TRL's "batchmean" with gradient accumulation:
`num_items_in_batch`), so every layout and micro-batch split computes the same loss."""

from __future__ import annotations

import contextlib

import torch

from shardlm.config import DistillConfig
from shardlm.distill.divergence import generalized_jsd


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

    def token_divergence(self, hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, h) student and (B, T, h_teacher) teacher final-norm outputs (or their sequence chunks) -> (B, T)
        divergences over the vocabulary-parallel logits."""
        with self.teacher_context():
            teacher_logits = self.teacher.output_layer(teacher_hidden)
        return generalized_jsd(self.student.output_layer(hidden), teacher_logits, self.ctx.tp,
                               self.student.cfg.vocab_size, self.cfg.beta, self.cfg.temperature)

    def __call__(self, forward, batch: dict) -> torch.Tensor:
        with self.teacher_context():
            teacher_hidden = self.teacher(batch["inputs"], documents=batch["documents"], hidden_only=True)
        divergence = forward(batch["inputs"], documents=batch["documents"],
                             then=lambda hidden: self.token_divergence(hidden, teacher_hidden))
        answer = batch["targets"] != -100
        total = (divergence * answer).sum()
        return total / batch["divisor"] if batch["divisor"] is not None else total / answer.sum().clamp(min=1)
