"""The comparison point for tensor parallelism: a plain GPT parallelized with PyTorch's own
`torch.distributed.tensor.parallel` (ColwiseParallel / RowwiseParallel), as a user would write it.

Separate q, k, v projections (each column-parallel, so three gradient all-reduces backward where a
fused QKV needs one), a row-parallel attention output and MLP output, and the embedding, LM head and
loss replicated on every rank (PyTorch TP has no vocabulary-parallel cross-entropy for this layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        B, T, _ = x.shape
        # heads from the tensor's own width, so the same code runs on a TP shard of the heads
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.fc, self.proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch modules. idx, targets: (B, T) -> scalar loss."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def parallelize(model: PlainGPT, world: int, device_type: str = "cpu") -> PlainGPT:
    """Apply PyTorch tensor parallelism over all `world` ranks (q/k/v/fc column-, o/proj row-parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device_type, (world,))
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    return model


def training_step(model: nn.Module, batch: torch.Tensor):
    """forward + backward + AdamW on a fixed (B, T + 1) batch, as a zero-argument function. (No
    clipping: `clip_grad_norm_` cannot mix the DTensor and plain parameters of a TP-parallelized model.)"""
    from torch.distributed.tensor import DTensor

    # foreach kernels cannot mix DTensor and plain tensors: one optimizer for each kind
    groups = [[p for p in model.parameters() if isinstance(p, DTensor) == is_dtensor] for is_dtensor in (True, False)]
    optimizers = [torch.optim.AdamW(g, lr=1e-4, weight_decay=0.01, foreach=True) for g in groups if g]

    def step():
        model(batch[:, :-1], batch[:, 1:]).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step
