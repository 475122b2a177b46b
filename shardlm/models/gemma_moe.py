"""Gemma 4's MoE block (the 26B-A4B's `enable_moe_block`): experts beside each layer's dense MLP.

    y = post_dense(mlp(ln_2(x))) + post_experts(sum_j w_j expert_{i_j}(ln_experts(x)))

The router reads the block's input x itself (not ln_2(x)): RMSNorm without weight, times a learned per-channel
`scale` and 1 / sqrt(h), then the (E, h) gate; softmax scores in fp32, the top-k renormalized to sum 1 and each
multiplied by its expert's `per_expert_scale`. The experts are gated MLPs with the tanh GeLU. Everything else (the
dispatch over expert-parallel ranks, TP splits of the experts, the balance losses when their coefficients are set,
the routing statistics) is `shardlm.models.moe`'s `MoELayer`, whose subclass `GemmaMoE` is: the training side and
FSDP find it and its `experts` as they find every MoE layer's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.config import ModelConfig
from shardlm.models.moe import (
    PAD_ROWS,
    AttachLoss,
    GroupedExperts,
    MoELayer,
    balance_losses,
    expert_matmul,
    grouped_mm_applies,
    pad_expert_rows,
)
from shardlm.models.norms import FP32RMSNorm, rms_norm
from shardlm.parallel import (
    ParallelContext,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    invariant,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)
from shardlm.parallel.experts import build_dispatcher
from shardlm.parallel.init import normal_shard, param_seed


class GemmaRouter(nn.Module):
    """Gemma 4's router, replicated on every rank (gradients summed over TP under SP): `weight` (E, h), `scale` (h,),
    `per_expert_scale` (E,). x (N, h) -> (indices (N, k), weights (N, k) fp32, scores (N, E), logits (N, E))."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(normal_shard((cfg.moe_num_experts, cfg.hidden_size), cfg.init_std,
                                                param_seed(seed, f"{prefix}.weight"), device=ctx.device))
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size, device=ctx.device))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.moe_num_experts, device=ctx.device))
        self.expert_bias = None  # what the training side's bias update looks for: Gemma 4 balances without one
        if sequence_parallel:
            for param in (self.weight, self.scale, self.per_expert_scale):
                param.sequence_parallel = True

    def forward(self, x: torch.Tensor):
        cfg = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            normed = rms_norm(x.float(), None, cfg.layernorm_epsilon)
            logits = invariant.linear(normed * self.scale.float() * cfg.hidden_size ** -0.5, self.weight.float())
        scores = logits.softmax(-1)
        top, indices = scores.topk(cfg.moe_top_k, dim=-1)
        weights = top / top.sum(-1, keepdim=True) * self.per_expert_scale.float()[indices]
        return indices, weights, scores, logits


class GemmaExperts(GroupedExperts):
    """`GroupedExperts` (gated, split over TP and EP alike) whose activation is the tanh GeLU:
    down(gelu_tanh(gate x) * up x). forward(x (M, h) grouped by expert, counts (E_l,)) -> (M, h) partial sums."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str):
        super().__init__(cfg, ctx, seed, prefix, gated=True)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = [self.gate, self.up, self.down]
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        else:
            x = x.to(weights[0].dtype)
        counts = counts.tolist()
        grouped = self.grouped and grouped_mm_applies(x, *weights)
        keep = None
        if grouped and self.pad_rows > 1 and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            x, counts, keep = pad_expert_rows(x, counts, self.pad_rows or PAD_ROWS)
        gate, up, down = weights
        g, u = expert_matmul(x, gate, counts, grouped), expert_matmul(x, up, counts, grouped)
        if self.lora is not None:
            dg, du = self.lora.inputs(x, counts, grouped)
            g, u = g + dg, u + du
        hidden = F.gelu(g, approximate="tanh") * u
        out = expert_matmul(hidden, down, counts, grouped)
        if self.lora is not None:
            out = out + self.lora.outputs(hidden, counts, grouped)
        return out if keep is None else out.index_select(0, keep)


class GemmaMoE(MoELayer):
    """The dense MLP and the experts of one Gemma 4 layer (module docstring): forward(ln_2(x), x) -> (B, T, h), or
    (B, T / tp, h) chunks under SP. Parameters: `dense` (the GeGLU), `ln_dense_post`, `router`, `ln_experts`,
    `experts`, `ln_experts_post` (transformers' mlp, post_feedforward_layernorm_1, router,
    pre_feedforward_layernorm_2, experts, post_feedforward_layernorm_2)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool,
                 dense: nn.Module, dispatcher: str = "all_to_all"):
        nn.Module.__init__(self)
        self.cfg, self.ctx = cfg, ctx
        self.sequence_parallel = sequence_parallel and ctx.tp_size > 1
        self.dense = dense
        self.router = GemmaRouter(cfg, ctx, seed, f"{prefix}.router", self.sequence_parallel)
        self.experts = GemmaExperts(cfg, ctx, seed, prefix)
        self.shared = self.shared_gate = None
        self.ln_dense_post, self.ln_experts, self.ln_experts_post = (
            FP32RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ctx.device) for _ in range(3))
        if self.sequence_parallel:
            for norm in (self.ln_dense_post, self.ln_experts, self.ln_experts_post):
                norm.weight.sequence_parallel = True
        self.dispatcher = build_dispatcher(cfg.moe_num_experts, ctx.ep, dispatcher)
        self.token_groups = tuple(group for group, holds_chunks in ((ctx.tp, self.sequence_parallel),
                                                                    (ctx.cp, ctx.cp_size > 1)) if holds_chunks)
        self.loss_scale = 1.0
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, normed: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """normed = ln_2(x), x the block's stream, each (B, T, h) -> (B, T, h)."""
        B, T, h = x.shape
        tp, k = self.ctx.tp, self.cfg.moe_top_k
        dense = self.ln_dense_post(self.dense(normed))
        indices, weights, scores, logits = self.router(x.reshape(-1, h))
        loss = None
        if self.training and torch.is_grad_enabled():
            loss = balance_losses(logits, scores, indices, self.cfg.moe_aux_loss_coeff, self.cfg.moe_z_loss_coeff,
                                  self.token_groups)
            if torch._C._current_graph_task_id() == -1:  # not a recomputation inside the backward
                self.recorded.append((torch.bincount(indices.reshape(-1), minlength=scores.shape[1]), loss.detach()))
        inputs = self.ln_experts(x)
        if self.sequence_parallel:  # every TP rank runs the experts on the whole sequence
            tokens = gather_from_sequence_parallel(inputs, tp).reshape(-1, h)
            weights = gather_from_sequence_parallel(weights.view(B, T, k), tp).reshape(-1, k)
            indices = torch.cat(tp.all_gather(indices.view(B, T, k)), dim=1).reshape(-1, k)
        else:
            tokens = copy_to_tensor_parallel(inputs.reshape(-1, h), tp)
            weights = copy_to_tensor_parallel(weights, tp)
        expert_tokens, counts, plan = self.dispatcher.dispatch(tokens, indices)
        out = self.dispatcher.combine(self.experts(expert_tokens, counts), plan)
        y = (out.view(-1, k, h) * weights.unsqueeze(-1).to(out.dtype)).sum(1).view(B, -1, h)
        y = reduce_scatter_to_sequence_parallel(y, tp) if self.sequence_parallel else reduce_from_tensor_parallel(y, tp)
        y = dense + self.ln_experts_post(y)
        return y if loss is None else AttachLoss.apply(y, loss, self.loss_scale)
