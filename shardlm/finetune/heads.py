"""Task heads on the pretrained BERT encoder: multiple choice (RACE), classification (MNLI, QQP)
and answer spans (SQuAD).

The first two read the pooled [CLS] vector (B, h), the span head every position's hidden state
(B, L, h); both are replicated over the TP group, so the heads are small replicated linear layers
(drawn from fixed seeds, identical on every rank). The encoder keeps its tensor-parallel layers; its
pretraining heads are dropped so DDP sees no unused parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.bert import BERT, BertSelfAttention, replicated_linear
from shardlm.parallel.init import param_seed


class MultipleChoiceModel(nn.Module):
    """Scores C options per question. Inputs (B, C, L) -> scores (B, C): every option row goes through
    the encoder, then dropout and a linear h -> 1 head on its pooled vector."""

    def __init__(self, bert: BERT, seed: int):
        super().__init__()
        bert.drop_pretraining_heads()
        self.bert = bert
        self.dropout = nn.Dropout(bert.cfg.dropout)
        self.score = replicated_linear(bert.cfg.hidden_size, 1, bert.cfg.init_std, param_seed(seed, "choice_head"),
                                       bert.ctx.device)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        B, C, L = tokens.shape
        _, pooled = self.bert.encode(tokens.reshape(B * C, L), token_types.reshape(B * C, L),
                                     padding_mask.reshape(B * C, L))
        return self.score(self.dropout(pooled)).view(B, C)


class ClassificationModel(nn.Module):
    """K-way sentence-pair classifier. Inputs (B, L) -> logits (B, K): dropout and a linear h -> K head
    on the pooled vector."""

    def __init__(self, bert: BERT, num_classes: int, seed: int):
        super().__init__()
        bert.drop_pretraining_heads()
        self.bert = bert
        self.dropout = nn.Dropout(bert.cfg.dropout)
        self.classify = replicated_linear(bert.cfg.hidden_size, num_classes, bert.cfg.init_std,
                                          param_seed(seed, "classification_head"), bert.ctx.device)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        _, pooled = self.bert.encode(tokens, token_types, padding_mask)
        return self.classify(self.dropout(pooled))


class SpanModel(nn.Module):
    """Extractive question answering. Inputs (B, L) -> logits (B, L, 2): a linear h -> 2 on every
    position's final hidden state gives the score of the answer starting ([..., 0]) and ending
    ([..., 1]) there; position 0 ([CLS]) stands for "no answer". The pooler is not used, so it is
    frozen (DDP would otherwise wait for its gradient); it stays in the model and in saved files."""

    def __init__(self, bert: BERT, seed: int):
        super().__init__()
        bert.drop_pretraining_heads()
        bert.pooler.requires_grad_(False)
        self.bert = bert
        self.span = replicated_linear(bert.cfg.hidden_size, 2, bert.cfg.init_std, param_seed(seed, "span_head"),
                                      bert.ctx.device)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.bert.encode(tokens, token_types, padding_mask)
        return self.span(hidden)


def span_loss(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Mean of the start and end cross-entropies: (B, L, 2) logits over the L positions against (B, 2)
    right start and end positions (0 when the answer is not in the window)."""
    logits = logits.float()
    return (F.cross_entropy(logits[..., 0], positions[:, 0]) + F.cross_entropy(logits[..., 1], positions[:, 1])) / 2


def choice_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy of (B, C) scores (options or classes) against (B,) right indices."""
    return F.cross_entropy(scores.float(), labels)


def set_dropout(model: nn.Module, p: float) -> None:
    """Use dropout probability `p` everywhere in `model` (hidden, attention and head dropout)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
        elif isinstance(module, BertSelfAttention):
            module.dropout = p
