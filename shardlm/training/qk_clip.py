"""QK-clip (`train.qk_clip = tau`), the clip Kimi K2 added to Muon (MuonClip): no attention logit above tau.

Every attention layer tracks the largest logit S_h of each of its heads over the step's micro-batches
(`shardlm.models.max_logits`). After the optimizer step the maxima are taken over the data x context group (the
whole global batch: every DP rank's rows, every CP rank's queries), and each head whose S_h exceeds tau gets
gamma_h = tau / S_h (else 1); its query and key weights are scaled so that its logits, on the same inputs, are
exactly gamma_h times what they were:

- multi-head attention (GPT's fused qkv, bias included): query and key rows of head h by sqrt(gamma_h), as Kimi
  K2's report does;
- grouped-query attention (Llama and the families after it): a key head is shared by a group of query heads, so
  key head g is scaled by sqrt(m_g), m_g the smallest gamma of its group, and query head h by gamma_h / sqrt(m_g)
  (the report's rule when every group has one head);
- multi-head latent attention (DeepSeek-V3, Kimi K2): each head's non-rotated query and key parts (q or q_b's and
  kv_b's rows) by sqrt(gamma_h), its rotated query part by gamma_h; the shared rotated key (kv_a) is untouched.

Under tensor parallelism each rank holds its heads' rows: the gammas of all heads are gathered over TP (one small
all-gather a step) so that a key head a group straddles, or replicated key heads, get one scale on every rank.
With half-precision parameters their fp32 master weights (`shardlm.training.master_weights`, ZeRO-1's ranges of
them too) are scaled, and the parameters cast from them again (ZeRO-1: one all-gather of the parameters on a step
that clipped). Under FSDP each rank holds a range of every weight's rows (`torch.chunk` over the group its DTensor
is sharded on): it scales the rows of that range with their own heads' factors, so the next all-gather assembles
the clipped weight. The step's largest logit over the whole model is returned for the log (`max_logit`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardlm.models.gpt import ParallelAttention
from shardlm.models.llama import LlamaAttention
from shardlm.models.mla import LatentAttention
from shardlm.parallel import ParallelContext
from shardlm.training.fsdp import held_rows

ATTENTION = (ParallelAttention, LlamaAttention, LatentAttention)


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """This rank's softmax attention layers (the linear-attention layers of hybrid models have no logits)."""
    return [m for m in model.modules() if isinstance(m, ATTENTION)]


def track_max_logits(model: nn.Module) -> None:
    """Start tracking each attention layer's per-head largest logit, (local heads,) fp32 from -inf."""
    for layer in attention_layers(model):
        layer.max_logits = torch.full((layer.heads,), float("-inf"), device=layer.ctx.device)


@torch.no_grad()
def clip_qk(model: nn.Module, ctx: ParallelContext, tau: float, master=None) -> float:
    """Scale the query and key weights of every head whose largest logit this step exceeded `tau` (module
    docstring), reset the maxima and return the step's largest logit over the whole model. `master`: the
    trainer's `MasterWeightOptimizer` (or joint one), whose fp32 master weights of half-precision parameters are
    scaled instead, the parameters then cast from them again. Collective over DP x CP, TP and PP."""
    layers = attention_layers(model)
    local = torch.cat([layer.max_logits for layer in layers]) if layers else torch.zeros(0, device=ctx.device)
    ctx.dp_cp.all_reduce(local, op=dist.ReduceOp.MAX)  # over the global batch
    heads = torch.stack(ctx.tp.all_gather(local.contiguous()))  # (TP, this rank's heads of every layer)
    offset, refresh = 0, []
    for layer in layers:
        maxima = heads[:, offset:offset + layer.heads].reshape(-1)  # (H,): TP rank r holds heads r H/TP ...
        offset += layer.heads
        gamma = torch.where(maxima > tau, tau / maxima, torch.ones_like(maxima))
        if bool((gamma < 1).any()):
            for param, factor in SCALE[type(layer)](layer, gamma, ctx.tp_rank):
                owner = master.owner(param) if master is not None else None
                if owner is not None and owner.separate_master:
                    owner.scale_master_rows(param, factor)
                    if owner not in refresh:
                        refresh.append(owner)
                else:
                    _scale_held_rows(param, factor)
        layer.max_logits.fill_(float("-inf"))
    for owner in refresh:  # the same parts on every rank of their DP group: the gammas agree over DP x CP
        owner.refresh_params()
    peak = local.max() if local.numel() else torch.tensor(float("-inf"), device=ctx.device)
    return ctx.pp.all_reduce(ctx.tp.all_reduce(peak.reshape(1), op=dist.ReduceOp.MAX), op=dist.ReduceOp.MAX).item()


def _mine(layer: nn.Module, gamma: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This rank's heads' entries of an (H,) vector."""
    return gamma[tp_rank * layer.heads:(tp_rank + 1) * layer.heads]


def _scale_rows(param: torch.Tensor | None, heads: int, scale: torch.Tensor,
                rows: slice = slice(None)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(param, factor (param rows,))]: rows `rows` of each head's block of a (heads x rows per head, ...) weight
    or bias multiplied by scale (heads,), the other rows by 1 (which leaves them as they are); [] for no param."""
    if param is None:
        return []
    factor = torch.ones(heads, param.shape[0] // heads, dtype=scale.dtype, device=scale.device)
    factor[:, rows] = scale.unsqueeze(-1)
    return [(param, factor.view(-1))]


def _scale_held_rows(param: torch.Tensor, factor: torch.Tensor) -> None:
    """Row i of `param` times factor[i], in the rows this rank holds of it (an FSDP DTensor's local rows)."""
    if hasattr(param, "to_local"):
        param, factor = param.to_local(), held_rows(param, factor)
    param.mul_(factor.view(-1, *[1] * (param.dim() - 1)).to(param.dtype))


def _clip_gpt(layer: ParallelAttention, gamma: torch.Tensor, tp_rank: int) -> list:
    """GPT's fused qkv, rows (heads, q / k / v, head_dim): the q and k rows of head h (and their bias) by
    sqrt(gamma_h)."""
    root = _mine(layer, gamma, tp_rank).sqrt()
    d = layer.head_dim
    return [scaled for param in (layer.qkv.weight, layer.qkv.bias)
            for scaled in _scale_rows(param, layer.heads, root, slice(0, 2 * d))]


def _clip_llama(layer: LlamaAttention, gamma: torch.Tensor, tp_rank: int) -> list:
    """Grouped-query attention: key head g by sqrt(m_g), query head h by gamma_h / sqrt(m_g) (module docstring);
    a gated layer's query rows only (each head's rows: queries, then gate channels)."""
    cfg, d = layer.cfg, layer.head_dim
    group = cfg.num_heads // cfg.kv_heads
    smallest = gamma.view(cfg.kv_heads, group).amin(dim=1).sqrt()  # sqrt(m_g), (KV heads,)
    first_query = tp_rank * layer.heads
    query = _mine(layer, gamma, tp_rank) / smallest[torch.arange(first_query, first_query + layer.heads) // group]
    kv = layer.k
    key = smallest[kv.rows[0] // d:kv.rows[1] // d] if kv.split else smallest
    return [*_scale_rows(layer.q.weight, layer.heads, query, slice(0, d)),
            *_scale_rows(layer.q.bias, layer.heads, query, slice(0, d)),
            *_scale_rows(kv.weight, len(key), key), *_scale_rows(kv.bias, len(key), key)]


def _clip_mla(layer: LatentAttention, gamma: torch.Tensor, tp_rank: int) -> list:
    """MLA: each head's non-rotated query rows and kv_b's key rows by sqrt(gamma_h), its rotated query rows by
    gamma_h; kv_a's shared rotated key untouched."""
    mine = _mine(layer, gamma, tp_rank)
    query = (layer.q_b if layer.q_b is not None else layer.q).weight
    factor = _scale_rows(query, layer.heads, mine.sqrt(), slice(0, layer.nope))[0][1]
    factor.view(layer.heads, -1)[:, layer.nope:] = mine.unsqueeze(-1)  # the rotated rows by gamma_h itself
    return [(query, factor), *_scale_rows(layer.kv_b.weight, layer.heads, mine.sqrt(), slice(0, layer.nope))]


SCALE = {ParallelAttention: _clip_gpt, LlamaAttention: _clip_llama, LatentAttention: _clip_mla}
