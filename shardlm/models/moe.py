"""Mixture-of-Experts: a router picks k of E expert MLPs per token; the MLP of chosen layers becomes this.

    y = sum_j w_j expert_{i_j}(x)  (+ shared(x))      i_1..i_k = top-k experts of x, w their weights

Routing (`Router`, `route`): fp32 gate logits `x W_g^T` (even under autocast or half parameters), scores
softmax or sigmoid, top-k over the scores plus an optional expert bias that only steers the selection
(DeepSeek-V3's aux-loss-free balancing: after each optimizer step the bias moves by `rate` towards the
under-loaded experts, from the step's token counts over every rank), optionally limited to the best
`topk_groups` of `groups` expert groups; the chosen weights are the scores without the bias, divided by
their sum when `norm_topk_prob`, times `routed_scaling`. Dropless: every token reaches its k experts.

Losses (`balance_losses`), over each micro-batch's whole token set (summed over the TP ranks that hold
its sequence chunks under sequence parallelism and over the CP ranks that hold its zigzag parts under
context parallelism, so they do not depend on the layout):
  aux = coeff x E x sum_e f_e P_e,  f_e = tokens routed to e / (N k),  P_e = mean over tokens of p_e
  (p = the softmax scores, or the sigmoid scores divided by their sum), equal to coeff at uniform routing;
  z = coeff x mean over tokens of logsumexp(logits)^2.
With `moe_aux_loss_type = "sequence"` the aux term is DeepSeek-V3's sequence-wise loss instead
(`sequence_balance_loss`: the same product per sequence, counts from the top-k of the unbiased scores).
Expert groups are ranked by the sum of their two best biased scores with sigmoid scores (DeepSeek-V3,
GLM-4.5) and by their best score with softmax scores (DeepSeek-V2, `route`'s `group_rule`).
They enter the objective through `AttachLoss`: the layer's output carries them, and their gradient
(`loss_scale`, which the training side sets: `shardlm.training.moe.set_aux_loss_scale`) starts when the
output's does, so they work under pipeline stages and activation recomputation without the model
returning them. Each training forward also records what it saw (routed-slot counts per expert, its
detached loss) in `recorded`; summing those over ranks and steps and moving the expert biases is the
training side's (`shardlm.training.moe.finish_step`).

Experts (`GroupedExperts`): the E / ep experts of this expert-parallel rank as stacked weights, an MLP
like the family's dense one (GPT: fc -> GeLU -> proj; Llama: SwiGLU), without biases unless
`moe_linear_bias` (gpt-oss, whose experts also clamp their SwiGLU: `swiglu_limit`). Expert tensor
parallelism equals TP: every expert's first matrices are column-split and its last row-split over the
TP group exactly like the dense MLP, so TP ranks run the same tokens and the partial sums are reduced
once per layer (`g`). Compute is `torch._grouped_mm` (one GEMM over all experts) when the shapes allow
it, else a plain loop over experts (`grouped=False`); both give the same result. On the CPU in bf16
each expert's rows are first padded with zero rows to a multiple of `PAD_ROWS`, so that oneDNN sees
few GEMM shapes (`pad_rows`; outputs and gradients unchanged, bitwise).

Token movement over expert-parallel ranks is `shardlm.parallel.experts`; which group reduces expert
gradients is `shardlm.training.gradients.reduce_expert_gradients`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.config import ModelConfig
from shardlm.models.routing import AttachLoss, balance_losses, group_rule, route, sequence_balance_loss
from shardlm.parallel import (
    ParallelContext,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    invariant,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)
from shardlm.parallel.experts import build_dispatcher
from shardlm.parallel.graph_break import graph_break
from shardlm.parallel.init import normal_shard, param_seed


class Router(nn.Module):
    """Gate (E, h) in fp32, replicated on every rank (its gradient summed over TP under sequence
    parallelism). x: (N, h) -> (indices (N, k), weights (N, k) fp32, scores (N, E), logits (N, E)).
    `expert_bias` (E,) is a parameter without gradient (saved in checkpoints, never in the optimizer); `bias`
    (E,), with `moe_router_bias`, is a trained bias of the logits (gpt-oss: its softmax over the top-k logits
    is the softmax scores' top-k divided by their sum, `moe_norm_topk_prob`)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(normal_shard((cfg.moe_num_experts, cfg.hidden_size), cfg.init_std,
                                                param_seed(seed, f"{prefix}.weight"), device=ctx.device))
        self.bias = None
        if cfg.moe_router_bias:
            self.bias = nn.Parameter(torch.zeros(cfg.moe_num_experts, device=ctx.device))
        if sequence_parallel:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.sequence_parallel = True
        self.expert_bias = None
        if cfg.moe_expert_bias_rate > 0 or cfg.moe_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(cfg.moe_num_experts, device=ctx.device), requires_grad=False)

    def forward(self, x: torch.Tensor):
        cfg = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            logits = invariant.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        scores = logits.softmax(-1) if cfg.moe_score == "softmax" else logits.sigmoid() if cfg.moe_score != \
            "sqrtsoftplus" else F.softplus(logits).sqrt()  # DeepSeek-V4's
        bias = None if self.expert_bias is None else self.expert_bias.float()
        indices, weights = route(scores, cfg.moe_top_k, bias, cfg.moe_groups, cfg.moe_topk_groups,
                                 cfg.moe_norm_topk_prob, cfg.moe_routed_scaling,
                                 group_rule(cfg))
        return indices, weights, scores, logits


# ------------------------------------------------------------------------------------------- experts


def grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """`torch._grouped_mm` needs matching dtypes and 16-byte aligned rows (row lengths a multiple of
    16 / element size); on CUDA only bf16 kernels are assumed."""
    if any(w.dtype != x.dtype for w in weights) or (x.is_cuda and x.dtype != torch.bfloat16):
        return False
    elements = 16 // x.element_size()
    return all(d % elements == 0 for w in weights for d in w.shape[1:])


@graph_break
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(x, weight^T)`, run eagerly under `train.compile` (in torch 2.13 its fake-tensor
    kernel accepts only bf16, while the CPU kernel also runs fp32)."""
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)


PAD_ROWS = 64
"""On the CPU in bf16, each expert's row block is padded with zero rows to a multiple of this
before the grouped GEMMs (`GroupedExperts.pad_rows`; 0 or 1 turns it off). The CPU `_grouped_mm` runs one
oneDNN GEMM per expert, and oneDNN builds and caches a kernel per shape: routing changes every expert's
row count every step, so without padding nearly every expert GEMM pays a new kernel (docs/moe.md,
"Padding expert rows", has the measurements behind 64). Zero rows add zero to every sum, so outputs and
gradients are unchanged."""


def pad_expert_rows(x: torch.Tensor, counts: list[int], multiple: int
                    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """x (M, in) grouped by expert with `counts` rows each -> (x with each expert's block followed by zero
    rows up to a multiple of `multiple`, the padded counts, the real rows' positions in it (None when
    nothing was padded)). Differentiable: x's gradient is the padded gradient's real rows."""
    padded = [-(-c // multiple) * multiple for c in counts]
    if padded == counts:
        return x, counts, None
    shifts, shift = [], 0
    for c, p in zip(counts, padded):
        shifts.append(shift)
        shift += p - c
    keep = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(
        torch.tensor(shifts, device=x.device), torch.tensor(counts, device=x.device), output_size=x.shape[0])
    return x.new_zeros(sum(padded), x.shape[1]).index_copy(0, keep, x), padded, keep


class _ExpertRows(torch.autograd.Function):
    """Each expert's row of a (E_l, n) per-expert tensor repeated over its block of rows: (M, n), M = sum(counts).
    The backward sums each block's rows (one reduction per expert), where indexing by the rows' expert ids would
    scatter the gradient with a sorted, accumulating `index_put_` (the slowest operator of gpt-oss's bias adds on
    the CPU)."""

    @staticmethod
    def forward(ctx, values, counts, total):
        ctx.counts = counts
        repeats = torch.tensor(counts, device=values.device)
        return torch.repeat_interleave(values, repeats, dim=0, output_size=total)

    @staticmethod
    def backward(ctx, grad):
        return torch.stack([block.sum(0) for block in grad.split(ctx.counts)]), None, None


def expert_rows(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """values (E_l, n) -> (sum(counts), n): expert e's row repeated counts[e] times, in expert order (`_ExpertRows`)."""
    return _ExpertRows.apply(values, counts, sum(counts))


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows of each expert times that expert's weight transposed: x (M, in), weight (E_l, out, in),
    counts rows per expert (summing to M) -> (M, out)."""
    if invariant.enabled():  # each row's product on its own (`shardlm.parallel.invariant`)
        return torch.cat([invariant.matmul(rows, w.t()) for rows, w in zip(x.split(counts), weight)])
    if grouped:
        return grouped_mm(x, weight, torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32))
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(counts), weight)])


class GroupedExperts(nn.Module):
    """This rank's E / ep experts, each split over TP like the dense MLP (no biases).

    gated (Llama): `gate`, `up` (E_l, f / tp, h) column-split, `down` (E_l, h, f / tp) row-split,
    y = down(silu(gate x) * up x). Else (GPT): `fc` (E_l, f / tp, h), `proj` (E_l, h, f / tp),
    y = proj(gelu(fc x)). Expert e's weights are drawn from seeds of its global index, so they do not
    depend on the layout. forward(x (M, h) grouped by expert, counts (E_l,)) -> (M, h) partial sums over TP.
    Weights carry `expert_parallel` and `first_expert` (global index of row 0 of the stack).

    gpt-oss (`moe_linear_bias`, `swiglu_limit`): biases `gate_bias`, `up_bias` (E_l, f / tp), split with their
    weights, and `down_bias` (E_l, h), added by TP rank 0 only (its gradient summed over TP, like a
    sequence-parallel parameter's); the SwiGLU clamps gate <= limit and |up| <= limit and computes
    (up + 1) x gate x sigmoid(alpha x gate)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, gated: bool):
        super().__init__()
        self.gated = gated
        self.limit, self.alpha, self.clip = cfg.swiglu_limit, cfg.swiglu_alpha, cfg.swiglu_clip
        self.first_tp_rank = ctx.tp_rank == 0
        self.grouped = True
        self.pad_rows = PAD_ROWS
        """Grouped GEMMs on the CPU in bf16 pad each expert's rows to a multiple of this (`PAD_ROWS`); 0 or 1:
        no padding. fp32 and fp16 (whose CPU grouped GEMM does not build kernels per shape), CUDA and the
        per-expert loop never pad."""
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        local = cfg.moe_num_experts // ctx.ep_size
        first = ctx.ep_rank * local
        width = cfg.moe_ffn_size // ctx.tp_size
        lo, hi = ctx.tp_rank * width, (ctx.tp_rank + 1) * width
        h, f = cfg.hidden_size, cfg.moe_ffn_size
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

        def stack(name: str, shape: tuple[int, int], dim: int, std: float) -> nn.Parameter:
            weight = nn.Parameter(torch.stack([
                normal_shard(shape, std, param_seed(seed, f"{prefix}.experts.{e}.{name}"), dim, lo, hi,
                             device=ctx.device) for e in range(first, first + local)]))
            weight.tensor_parallel_dim = dim + 1
            weight.expert_parallel, weight.first_expert = True, first
            return weight

        names = ("gate", "up", "down") if gated else ("fc", "proj")
        for name in names[:-1]:
            setattr(self, name, stack(name, (f, h), 0, cfg.init_std))
        setattr(self, names[-1], stack(names[-1], (h, f), 1, out_std))
        self.gate_bias = self.up_bias = self.down_bias = None
        if cfg.moe_linear_bias:
            for name, size, split in (("gate_bias", width, True), ("up_bias", width, True), ("down_bias", h, False)):
                bias = nn.Parameter(torch.zeros(local, size, device=ctx.device))
                bias.expert_parallel, bias.first_expert = True, first
                if split:
                    bias.tensor_parallel_dim = 1
                else:
                    bias.sequence_parallel = True  # partial over TP: only rank 0 adds it
                setattr(self, name, bias)
        self.lora = None  # the experts' low-rank adapters (`shardlm.lora.experts`), when a LoRA run targets them

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = [self.gate, self.up, self.down] if self.gated else [self.fc, self.proj]
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        else:
            x = x.to(weights[0].dtype)
        counts = counts.tolist()
        grouped = self.grouped and grouped_mm_applies(x, *weights)
        keep = None
        if grouped and self.pad_rows > 1 and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            x, counts, keep = pad_expert_rows(x, counts, self.pad_rows)  # padded rows are dropped at the end
        if self.gated:
            gate, up, down = weights
            g, u = expert_matmul(x, gate, counts, grouped), expert_matmul(x, up, counts, grouped)
            if self.lora is not None:
                dg, du = self.lora.inputs(x, counts, grouped)
                g, u = g + dg, u + du
            if self.gate_bias is not None:
                # gpt-oss's biases: each row gets its expert's
                g = g + expert_rows(self.gate_bias, counts).to(g.dtype)
                u = u + expert_rows(self.up_bias, counts).to(u.dtype)
            if self.clip > 0:  # DeepSeek-V4's clip, then the plain SwiGLU
                g, u = g.clamp(max=self.clip), u.clamp(-self.clip, self.clip)
            if self.limit > 0:  # gpt-oss's clamped SwiGLU
                g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
                hidden = (u + 1) * g * torch.sigmoid(self.alpha * g)
            else:
                hidden = F.silu(g) * u
        else:
            fc, down = weights
            pre = expert_matmul(x, fc, counts, grouped)
            if self.lora is not None:
                pre = pre + self.lora.inputs(x, counts, grouped)[0]
            hidden = F.gelu(pre, approximate=self.approximate)
        out = expert_matmul(hidden, down, counts, grouped)
        if self.lora is not None:
            out = out + self.lora.outputs(hidden, counts, grouped)
        if self.down_bias is not None:  # once over the TP partial sums: rank 0 adds it, the others add 0 x it
            out = out + expert_rows(self.down_bias, counts).to(out.dtype) * (1.0 if self.first_tp_rank else 0.0)
        return out if keep is None else out.index_select(0, keep)


# ------------------------------------------------------------------------------------------- the layer


class MoELayer(nn.Module):
    """Router + routed experts (+ shared experts): (B, T, h) -> (B, T, h), or (B, T / tp, h) chunks
    under sequence parallelism. `shared`: the block's dense MLP of the shared experts' width, or None; with
    `moe_shared_expert_gate` its output is scaled by a per-token sigmoid gate (`shared_gate`, (1, h) replicated).

    Per layer: TP sees one `f` (tokens and their routing weights enter the TP region; the chunks are
    all-gathered under sequence parallelism) and one `g` on the combined expert output; the dispatcher
    talks to the expert-parallel group; in training, the routing statistics are summed over `token_groups`
    (TP under sequence parallelism, CP: small all-reduces). Each training forward appends its routed-slot
    counts per expert and its aux + z loss (detached) to `recorded`, for the training side's bias update and
    metrics (`shardlm.training.moe.finish_step`), except a recomputation in the backward."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, prefix: str, sequence_parallel: bool,
                 gated: bool, shared: nn.Module | None = None, dispatcher: str = "all_to_all"):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.sequence_parallel = sequence_parallel and ctx.tp_size > 1
        self.router = Router(cfg, ctx, seed, f"{prefix}.router", self.sequence_parallel)
        self.experts = GroupedExperts(cfg, ctx, seed, prefix, gated)
        self.shared = shared
        self.shared_gate = None
        if shared is not None and cfg.moe_shared_expert_gate:  # Qwen3-Next: sigmoid(w . x) scales shared(x)
            self.shared_gate = nn.Parameter(normal_shard((1, cfg.hidden_size), cfg.init_std,
                                                         param_seed(seed, f"{prefix}.shared_gate"), device=ctx.device))
            if self.sequence_parallel:  # applied to sequence chunks: its gradient is a partial sum over TP
                self.shared_gate.sequence_parallel = True
        self.dispatcher = build_dispatcher(cfg.moe_num_experts, ctx.ep, dispatcher)
        self.token_groups = tuple(group for group, holds_chunks in ((ctx.tp, self.sequence_parallel),
                                                                    (ctx.cp, ctx.cp_size > 1)) if holds_chunks)
        """The groups over which the routing statistics are summed: their ranks hold the micro-batch's other tokens."""
        self.loss_scale = 1.0
        """The gradient the attached aux + z loss receives in the backward (set by the training side,
        `shardlm.training.moe.set_aux_loss_scale`)."""
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        tp, k = self.ctx.tp, self.cfg.moe_top_k
        indices, weights, scores, logits = self.router(x.reshape(-1, h))
        loss = None
        if self.training and torch.is_grad_enabled():
            probs = scores if self.cfg.moe_score == "softmax" else scores / scores.sum(-1, keepdim=True)
            per_sequence = self.cfg.moe_aux_loss_type == "sequence"
            loss = balance_losses(logits, probs, indices, 0.0 if per_sequence else self.cfg.moe_aux_loss_coeff,
                                  self.cfg.moe_z_loss_coeff, self.token_groups)
            if per_sequence:
                loss = loss + sequence_balance_loss(probs, B, k, self.cfg.moe_aux_loss_coeff, self.token_groups)
            if torch._C._current_graph_task_id() == -1:  # not a recomputation inside the backward
                self.recorded.append((torch.bincount(indices.reshape(-1), minlength=scores.shape[1]), loss.detach()))
        if self.sequence_parallel:  # every TP rank runs the experts on the whole sequence
            tokens = gather_from_sequence_parallel(x, tp).reshape(-1, h)
            weights = gather_from_sequence_parallel(weights.view(B, T, k), tp).reshape(-1, k)
            indices = torch.cat(tp.all_gather(indices.view(B, T, k)), dim=1).reshape(-1, k)
        else:
            tokens, weights = copy_to_tensor_parallel(x.reshape(-1, h), tp), copy_to_tensor_parallel(weights, tp)
        expert_tokens, counts, plan = self.dispatcher.dispatch(tokens, indices)
        out = self.dispatcher.combine(self.experts(expert_tokens, counts), plan)  # (N k, h) per slot
        y = (out.view(-1, k, h) * weights.unsqueeze(-1).to(out.dtype)).sum(1).view(B, -1, h)
        y = reduce_scatter_to_sequence_parallel(y, tp) if self.sequence_parallel else reduce_from_tensor_parallel(y, tp)
        if self.shared_gate is not None:
            y = y + torch.sigmoid(invariant.linear(x, self.shared_gate)) * self.shared(x)
        elif self.shared is not None:
            y = y + self.shared(x)
        return y if loss is None else AttachLoss.apply(y, loss, self.loss_scale)


def mlp_or_moe(dense_mlp, cfg: ModelConfig, ctx: ParallelContext, seed: int, index: int,
               sequence_parallel: bool, gated: bool, dispatcher: str = "all_to_all") -> nn.Module:
    """Layer `index`'s MLP: the family's dense `dense_mlp(cfg, ctx, seed, prefix, sequence_parallel)` (GPT's
    `ParallelMLP`, Llama's `SwiGLU`), or where `cfg.is_moe_layer(index)` an `MoELayer` of experts of that
    kind (`gated`: SwiGLU), its shared experts one dense MLP of their total width, its tokens moved over the
    expert-parallel group by `dispatcher` ("all_to_all" or "all_gather")."""
    prefix = f"layers.{index}.mlp"
    if not cfg.is_moe_layer(index):
        return dense_mlp(cfg, ctx, seed, prefix, sequence_parallel)
    shared = None
    if cfg.moe_shared_experts:
        shared = dense_mlp(replace(cfg, ffn_hidden_size=cfg.shared_ffn_size), ctx, seed, f"{prefix}.shared",
                           sequence_parallel)
    return MoELayer(cfg, ctx, seed, prefix, sequence_parallel, gated=gated, shared=shared, dispatcher=dispatcher)


# ------------------------------------------------------------------------------------------- finding the layers


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of a model (of this rank's pipeline stages), in order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]
