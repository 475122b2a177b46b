"""Task heads on the pretrained BERT encoder: multiple choice (RACE) and classification (MNLI, QQP).

Both read the pooled [CLS] vector (B, h), replicated over the TP group, so the heads are small
replicated linear layers (drawn from fixed seeds, identical on every rank). The encoder keeps its
tensor-parallel layers; its pretraining heads are dropped so DDP sees no unused parameters.
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
