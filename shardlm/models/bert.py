"""BERT built from the tensor-parallel layers: masked LM + sentence-order (or next-sentence) prediction.

Embeddings are the sum of a vocabulary-parallel word embedding, learned positions and two token-type
rows (segment A / B). Attention is bidirectional with heads split over the TP group, like GPT's but
with a padding mask instead of the causal one: no query attends to a [PAD] key. The MLP is GPT's
`ParallelMLP`. Two layer orders are selectable with `model.layernorm_order`:

    "post" (original BERT):  x = LN(x + Dropout(Attn(x)));  x = LN(x + Dropout(MLP(x)))
                             with a LayerNorm on the embeddings and none at the end;
    "pre"  (the paper's rearranged order, as GPT-2):
                             x = x + Dropout(Attn(LN(x)));  x = x + Dropout(MLP(LN(x)))
                             with a final LayerNorm, so the residual path is never normalized.

Heads: the masked-LM head (dense h -> h, GeLU, LayerNorm, then the output layer *tied* to the word
embedding, plus a vocabulary-parallel bias) gives this rank's vocabulary slice of the logits, and the
loss goes through `vocab_parallel_cross_entropy` without gathering them. In training only the
predicted positions go through the head (the loss elsewhere is zero anyway), which cuts the
largest GEMM and the cross-entropy's communication by ~7x. The pooler (dense + tanh on
the [CLS] position) feeds a 2-way sentence head (SOP, or NSP with the dataset's option). Pooler and
heads are small replicated layers, initialized from fixed seeds so every TP size starts identical.

Communication per forward: 2 all-reduces per layer, 1 for the embedding, 1 SUM + 1 MAX for the
cross-entropy (of 2 scalars per predicted token); backward: 2 per layer and 1 for the tied output layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.config import ModelConfig
from shardlm.models.gpt import ParallelAttention, ParallelMLP
from shardlm.parallel import (
    ParallelContext,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from shardlm.parallel.init import normal_shard, param_seed
from shardlm.parallel.random import recompute

IGNORE_INDEX = -100
NUM_TOKEN_TYPES = 2


def replicated_linear(in_features: int, out_features: int, std: float, seed: int, device) -> nn.Linear:
    """An `nn.Linear` kept whole on every TP rank, drawn from `seed` (identical at any TP size)."""
    layer = nn.Linear(in_features, out_features, device=device)
    with torch.no_grad():
        layer.weight.copy_(normal_shard((out_features, in_features), std, seed, device=device))
        layer.bias.zero_()
    return layer


def attention_mask_from_padding(padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) with 1 for real tokens, 0 for [PAD] -> (B, 1, 1, T) bool, True where a key may be attended."""
    return padding_mask.bool()[:, None, None, :]


class BertSelfAttention(ParallelAttention):
    """Bidirectional self-attention with heads split over the TP group. x: (B, T, h) -> (B, T, h).

    The same weights, initialization and fused per-head QKV as GPT's `ParallelAttention`; only the
    masking differs. Keys masked out by `attention_mask`
    (B, 1, 1, T) get no weight from any query. Talks to the TP group: `f` on the input (backward),
    `g` on the output projection (forward).
    """

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, heads/tp, T, head_dim)
        if self.training and self.dropout > 0:
            with self.ctx.rng.fork():  # heads differ per rank, so must their dropout masks
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=self.dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))  # (B, T, h)


class BertLayer(nn.Module):
    """One transformer layer in the post-LN (original BERT) or pre-LN (rearranged) order.
    x: (B, T, h), attention_mask: (B, 1, 1, T) bool -> (B, T, h), replicated over the TP group."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int):
        super().__init__()
        self.pre_ln = cfg.layernorm_order == "pre"
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.attn = BertSelfAttention(cfg, ctx, seed, f"layers.{index}.attn")
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.mlp = ParallelMLP(cfg, ctx, seed, f"layers.{index}.mlp")
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.dropout(self.attn(self.ln_1(x), attention_mask))
            return x + self.dropout(self.mlp(self.ln_2(x)))
        x = self.ln_1(x + self.dropout(self.attn(x, attention_mask)))
        return self.ln_2(x + self.dropout(self.mlp(x)))


class BERT(nn.Module):
    """BERT over a TP group (see the module docstring for the layout and the two layer orders).

    Inputs, all (B, T) int64: `tokens`, `token_types` (0 = segment A, 1 = segment B; default 0),
    `padding_mask` (1 real, 0 [PAD]; default all real). `forward` returns `(lm, sentence_logits)`:
    `lm` is this rank's vocabulary slice of the MLM logits (B, T, V_padded / tp), or, given
    `lm_labels` (B, T) with -100 where nothing is predicted, the per-token fp32 losses (B, T) (0 at
    ignored positions); `sentence_logits` (B, 2) are the SOP/NSP scores. `encode` gives the encoder
    output and the pooled [CLS] vector for fine-tuning heads.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int = 1234,
                 activation_checkpointing: bool = False):
        super().__init__()
        if cfg.layernorm_order not in ("pre", "post"):
            raise ValueError(f'model.layernorm_order="{cfg.layernorm_order}" must be "pre" or "post"')
        if ctx.rng is None:
            ctx.seed(seed)
        self.cfg, self.ctx = cfg, ctx
        self.activation_checkpointing = activation_checkpointing
        self.padded_vocab_size = cfg.padded_vocab_size(ctx.tp_size)
        h, std, device = cfg.hidden_size, cfg.init_std, ctx.device
        self.wte = VocabParallelEmbedding(self.padded_vocab_size, h, ctx.tp, vocab_size=cfg.vocab_size, std=std,
                                          seed=param_seed(seed, "wte"), device=device)
        self.wpe = nn.Parameter(normal_shard((cfg.seq_length, h), std, param_seed(seed, "wpe"), device=device))
        self.token_type = nn.Parameter(normal_shard((NUM_TOKEN_TYPES, h), std, param_seed(seed, "token_type"),
                                                    device=device))
        post = cfg.layernorm_order == "post"
        self.ln_embed = nn.LayerNorm(h, eps=cfg.layernorm_epsilon, device=device) if post else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(BertLayer(cfg, ctx, seed, i) for i in range(cfg.num_layers))
        self.ln_f = None if post else nn.LayerNorm(h, eps=cfg.layernorm_epsilon, device=device)
        self.pooler = replicated_linear(h, h, std, param_seed(seed, "pooler"), device)
        # masked-LM head: transform, then the tied output layer plus this rank's slice of the bias
        self.lm_dense = replicated_linear(h, h, std, param_seed(seed, "lm_dense"), device)
        self.lm_ln = nn.LayerNorm(h, eps=cfg.layernorm_epsilon, device=device)
        self.lm_bias = nn.Parameter(torch.zeros(self.padded_vocab_size // ctx.tp_size, device=device))
        self.lm_bias.tensor_parallel_dim = 0
        self.sentence_head = replicated_linear(h, 2, std, param_seed(seed, "sentence_head"), device)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def encode(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
               padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids -> (hidden (B, T, h), pooled (B, h)), both replicated over the TP group."""
        T = tokens.shape[1]
        if T > self.cfg.seq_length:
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_length={self.cfg.seq_length}")
        types = torch.zeros_like(tokens) if token_types is None else token_types
        x = self.wte(tokens) + self.wpe[:T] + F.embedding(types, self.token_type)
        if self.ln_embed is not None:
            x = self.ln_embed(x)
        x = self.drop(x)
        mask = None if padding_mask is None else attention_mask_from_padding(padding_mask)
        for layer in self.layers:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = recompute(layer, x, mask, rng=self.ctx.rng)
            else:
                x = layer(x, mask)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x, torch.tanh(self.pooler(x[:, 0]))

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, V_padded / tp): this rank's slice of the MLM logits (tied output layer)."""
        x = self.lm_ln(F.gelu(self.lm_dense(hidden), approximate=self.approximate))
        return F.linear(copy_to_tensor_parallel(x, self.ctx.tp), self.wte.weight, self.lm_bias)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
                padding_mask: torch.Tensor | None = None, lm_labels: torch.Tensor | None = None):
        hidden, pooled = self.encode(tokens, token_types, padding_mask)
        sentence_logits = self.sentence_head(pooled)
        if lm_labels is None:
            return self.lm_logits(hidden), sentence_logits
        # Only predicted positions (~15%) go through the LM head: the (N, V/tp) logits of N predicted
        # tokens instead of (B, T, V/tp). Every TP rank holds the same labels, so the same N.
        predicted = lm_labels != IGNORE_INDEX
        losses = vocab_parallel_cross_entropy(self.lm_logits(hidden[predicted]), lm_labels[predicted], self.ctx.tp,
                                              vocab_size=self.cfg.vocab_size, ignore_index=IGNORE_INDEX)
        per_token = torch.zeros(lm_labels.shape, dtype=losses.dtype, device=losses.device)
        return per_token.masked_scatter(predicted, losses), sentence_logits

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """(..., V_padded / tp) -> (..., vocab_size): gathered and unpadded (evaluation only)."""
        return gather_from_tensor_parallel(local_logits, self.ctx.tp)[..., : self.cfg.vocab_size]

    def drop_pretraining_heads(self) -> None:
        """Remove the MLM transform and the sentence head (fine-tuning uses only `encode`), so that no
        parameter goes unused under DDP. The word embedding stays: it is the input embedding too."""
        self.lm_dense = self.lm_ln = self.sentence_head = None
        self.lm_bias = None

    def num_parameters(self) -> int:
        """Parameters of the whole model (summing the TP shards of split weights), padding included."""
        sharded = sum(p.numel() for p in self.parameters() if hasattr(p, "tensor_parallel_dim"))
        replicated = sum(p.numel() for p in self.parameters() if not hasattr(p, "tensor_parallel_dim"))
        return sharded * self.ctx.tp_size + replicated


def bert_loss_terms(forward, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked-LM loss, sentence-order loss) of one micro-batch, each a scalar.

    The MLM loss is the mean over predicted positions (`labels` != -100) of this micro-batch, as
    Megatron-LM averages it; the sentence loss is the mean cross-entropy of the 2-way head.
    """
    token_losses, sentence_logits = forward(batch["tokens"], batch["token_types"], batch["padding_mask"],
                                            batch["labels"])
    predicted = (batch["labels"] != IGNORE_INDEX).to(token_losses.dtype)
    mlm = (token_losses * predicted).sum() / predicted.sum().clamp_min(1.0)
    sentence = F.cross_entropy(sentence_logits.float(), batch["is_random"].reshape(-1))
    return mlm, sentence


def bert_loss(forward, batch: dict) -> torch.Tensor:
    """Pretraining loss of one micro-batch: masked LM + sentence order. `forward` is the model or its
    DDP wrapper (called, so DDP's gradient hooks run); `batch` holds (B, T) `tokens`, `token_types`,
    `labels`, `padding_mask` and (B,) `is_random`."""
    mlm, sentence = bert_loss_terms(forward, batch)
    return mlm + sentence
