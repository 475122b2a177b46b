"""Multi-token prediction (DeepSeek-V3): D extra depths, depth k predicting the token k + 1 places ahead.

Depth k (1..D) at position i combines the previous depth's output h^{k-1}_i (h^0: the main model's final-norm
output, as transformers' `MtpModel` takes it) with the embedding of token t_{i+k}:

    h^k_i = post_norm(block_k(eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])))

and the shared output head turns it into a prediction of t_{i+k+1}. `block_k` is one more transformer
layer of the model's kind (MLA, MoE or dense by its index), the embedding and output head are the main
model's. Weights (HF DeepSeek-V3 layer `num_hidden_layers + k - 1`): `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` (our `post_norm`) and the layer's own attention and MLP.

The loss is main + weight x mean over depths of each depth's mean over its valid targets, where a target at
position i of depth k is valid when i + k is still in the row and in i's document (packed rows) and
`labels[i + k]` is trained. `rolled_targets` builds depth k's inputs and targets from the whole row before any
context-parallel split, so a rank's zigzag part rolls across chunk boundaries correctly; the trainer
divides each depth's token losses by the global count of its valid targets (`shardlm.training.data`), and
`add_mtp_gradient` weighs their mean into the gradient only, so the logged loss stays the next-token loss.

Under pipeline parallelism the depths live on the last stage (as Megatron-Core places them by default),
after the final norm: that stage also keeps a copy of the word embedding `wte` for the rolled tokens, the
same tied copy GPT's output layer uses, whose gradient the embedding group sums with the first stage's
(`shardlm.parallel.pipeline.sum_tied_gradients`); the runner hands the last stage each micro-batch's rolled
tokens beside its documents (`ShardlmStage`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.config import ModelConfig
from shardlm.models.decoder import mark_sequence_parallel
from shardlm.models.documents import Documents
from shardlm.parallel.init import normal_shard, param_seed

IGNORE_INDEX = -100


def rolled_targets(input_ids: torch.Tensor, labels: torch.Tensor, depth: int,
                   segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth `depth`'s (inputs, targets), each (B, T), from whole rows: input_ids (B, T), labels (B, T) already
    shifted (labels[i] = t_{i+1} or -100), segments (B, T) document numbers or None (one document per row).
    inputs[i] = input_ids[i + depth] and targets[i] = labels[i + depth] where i + depth < T is in i's document;
    elsewhere inputs 0 and targets -100."""
    length = input_ids.shape[1]
    inputs = F.pad(input_ids[:, depth:], (0, depth), value=0)
    targets = F.pad(labels[:, depth:], (0, depth), value=IGNORE_INDEX)
    valid = torch.arange(length, device=labels.device) < length - depth
    if segments is not None:
        valid = valid & (F.pad(segments[:, depth:], (0, depth), value=-1) == segments)
    return torch.where(valid, inputs, 0), torch.where(valid, targets, IGNORE_INDEX)


def add_mtp_gradient(loss: torch.Tensor, depth_losses: torch.Tensor, divisors: list[float],
                     weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next-token `loss` with `weight` x the depths' mean loss added to its gradient only, that mean
    detached). `depth_losses` (D, B, T): per-token losses of the D depths (`DecoderLM.mtp_losses`), depth k's
    summed over `divisors[k]` (its global valid-target count / (micro-batches x DP x C)). The value stays
    `loss`, as Megatron-Core's MTPLossAutoScaler keeps the LM loss while the MTP term enters the backward."""
    mtp_loss = torch.stack([depth_losses[k].sum() / d for k, d in enumerate(divisors)]).mean()
    return loss + weight * (mtp_loss - mtp_loss.detach()), mtp_loss.detach()


class MTPLayer(nn.Module):
    """One depth: (embedding of the rolled tokens, previous depth's output), each (B, T, h) or sequence chunks
    (B, T / tp, h) -> (B, T, h) normalized for the shared output head. `block` is a layer of the model's kind."""

    def __init__(self, cfg: ModelConfig, ctx, seed: int, depth: int, block: nn.Module, norm: type[nn.Module],
                 sequence_parallel: bool):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = norm(h, eps=cfg.layernorm_epsilon, device=ctx.device)
        self.hnorm = norm(h, eps=cfg.layernorm_epsilon, device=ctx.device)
        # replicated on every TP rank: its input and output are the replicated (or sequence-chunked) residual
        self.eh_proj = nn.Parameter(normal_shard((h, 2 * h), cfg.init_std, param_seed(seed, f"mtp.{depth}.eh_proj"),
                                                 device=ctx.device))
        self.block = block
        self.post_norm = norm(h, eps=cfg.layernorm_epsilon, device=ctx.device)
        if sequence_parallel:
            for module in (self.enorm, self.hnorm, self.post_norm):
                mark_sequence_parallel(module)
            self.eh_proj.sequence_parallel = True

    def forward(self, embedded: torch.Tensor, previous: torch.Tensor, documents: Documents | None = None):
        x = F.linear(torch.cat((self.enorm(embedded), self.hnorm(previous)), dim=-1), self.eh_proj)
        return self.post_norm(self.block(x, None, documents))
