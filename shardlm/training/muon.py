"""Muon for the hidden weight matrices, AdamW for everything else, with every matrix orthogonalized whole.

Muon (Jordan et al. 2024; `torch.optim.Muon`): per matrix W with gradient G, a momentum buffer
B <- m B + (1 - m) G, the update U = (1 - m) G + m B with Nesterov (else B), O = NS(U) the Newton-Schulz
orthogonalization of U (quintic, coefficients (a, b, c), `ns_steps` iterations, U first scaled to unit Frobenius
norm, transposed when it has more rows than columns), then decoupled weight decay W <- W (1 - lr wd) and
W <- W - lr' O, lr' = lr sqrt(max(1, rows / cols)) ("original") or 0.2 lr sqrt(max(rows, cols))
("match_rms_adamw", Moonlight's). As Moonlight and Kimi K2 split them, Muon takes the 2-D weights of the
transformer layers' projections (and each MoE expert's matrices, one by one); AdamW (`build_optimizer`'s groups)
takes the embeddings, the output layer, norms, biases, routers and sinks. In a LoRA run Muon takes the
adapters' A and B (the base is frozen).

O depends on the whole matrix, so under tensor parallelism each rank gathers its matrices' momentum updates over
TP (`tensor_parallel_dim`), orthogonalizes the whole matrix (every TP rank the same one) and keeps its shard of O;
orthogonalizing each shard alone would be another optimizer (the layout test's control shows it). Which rows are
orthogonalized as one (`split`): GPT's fused qkv as its q, k and v parts ("parts", the default), each head's rows
of them ("heads"), or the fused matrix whole ("whole"); other matrices are whole. The Newton-Schulz iteration runs
in `ns_dtype`: bf16 as `torch.optim.Muon` does, or fp32 (every layout then equals one process to fp32 rounding).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import torch
from torch import nn

from shardlm.parallel import ParallelContext

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def newton_schulz(update: torch.Tensor, coefficients=COEFFICIENTS, steps: int = 5, eps: float = EPS,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of a (rows, cols) matrix, in `dtype` (module docstring)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.shape[0] > update.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, mode: str, shape: tuple[int, int]) -> float:
    rows, cols = shape
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """A hidden weight matrix Muon updates: a 2-D projection weight of a transformer layer (or a stack of MoE
    experts' matrices), a LoRA adapter's A or B (or an expert adapter's stack); not a norm, a router, a bias, a
    sink, the embedding or the output layer."""
    if not (name.startswith("layers.") and param.requires_grad):
        return False
    if ".lora." in name:  # LoRA's factors, whole over TP like any matrix; experts' adapters one expert at a time
        return param.ndim == (3 if ".experts.lora." in name else 2)
    if not name.endswith((".weight", ".gate", ".up", ".down", ".fc", ".proj")):
        return False
    if ".router." in name or "norm" in name.rsplit(".", 2)[-2]:
        return False
    expert = getattr(param, "expert_parallel", False)
    return param.ndim == (3 if expert else 2)


def row_groups(name: str, full_rows: int, heads: int, split: str) -> list[torch.Tensor]:
    """The row sets of a full (TP=1) matrix orthogonalized as one: GPT's fused qkv (rows ordered heads, 3, d) by
    `split`; every other matrix whole."""
    if not name.endswith("attn.qkv.weight") or split == "whole":
        return [torch.arange(full_rows)]
    rows = torch.arange(full_rows).view(heads, 3, -1)  # (heads, q/k/v, head_dim)
    if split == "heads":
        return [rows[h, part] for part in range(3) for h in range(heads)]
    return [rows[:, part].reshape(-1) for part in range(3)]


class Muon(torch.optim.Optimizer):
    """Muon over `named` ((name, parameter) of this rank, `is_muon_matrix`), each matrix orthogonalized whole over
    TP. `heads`: the model's attention heads (for splitting GPT's qkv)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], ctx: ParallelContext, lr: float, weight_decay: float,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, adjust_lr: str = "original",
                 ns_dtype: str = "bf16", split: str = "parts", heads: int = 1):
        super().__init__([p for _, p in named], {"lr": lr, "weight_decay": weight_decay})
        self.names = {id(p): n for n, p in named}
        self.ctx, self.momentum, self.nesterov, self.ns_steps = ctx, momentum, nesterov, ns_steps
        self.adjust, self.split, self.heads = adjust_lr, split, heads
        self.ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[ns_dtype]

    def _orthogonalized(self, name: str, update: torch.Tensor, param_dim: int | None) -> tuple[torch.Tensor, tuple]:
        """(O, the shape of the matrices orthogonalized as one) of one matrix's local update (rows, cols) whose TP
        split dimension is `param_dim` (or None): O is this rank's shard, in the Newton-Schulz dtype."""
        tp, rank = self.ctx.tp_size, self.ctx.tp_rank
        whole = update if param_dim is None or tp == 1 else torch.cat(self.ctx.tp.all_gather(update.contiguous()),
                                                                        dim=param_dim)
        groups = row_groups(name, whole.shape[0], self.heads, self.split)
        if len(groups) == 1:
            out = newton_schulz(whole, steps=self.ns_steps, dtype=self.ns_dtype)
        else:
            out = torch.empty_like(whole, dtype=self.ns_dtype)
            for rows in groups:
                out[rows] = newton_schulz(whole[rows], steps=self.ns_steps, dtype=self.ns_dtype)
        shape = (len(groups[0]), whole.shape[1])
        return (out if param_dim is None or tp == 1 else out.chunk(tp, dim=param_dim)[rank]), shape

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - self.momentum)
                update = param.grad.lerp(buffer, self.momentum) if self.nesterov else buffer
                name, dim = self.names[id(param)], getattr(param, "tensor_parallel_dim", None)
                param.mul_(1 - lr * decay)
                if param.ndim == 3:  # a stack of experts: each expert's matrix on its own
                    for weight, expert_update in zip(param, update):
                        out, shape = self._orthogonalized(name, expert_update, None if dim is None else dim - 1)
                        weight.add_(out, alpha=-adjusted_lr(lr, self.adjust, shape))
                else:
                    out, shape = self._orthogonalized(name, update, dim)
                    param.add_(out, alpha=-adjusted_lr(lr, self.adjust, shape))


class _States(MutableMapping):
    """Both optimizers' per-parameter state seen as one mapping (a view: nothing is copied); a parameter's state is
    read from and written to the optimizer that owns it."""

    def __init__(self, muon: Muon, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    def _owner(self, param) -> dict:
        return (self.muon if id(param) in self.muon.names else self.adamw).state

    def __getitem__(self, param):
        return self._owner(param)[param]

    def __setitem__(self, param, value) -> None:
        self._owner(param)[param] = value

    def __delitem__(self, param) -> None:
        del self._owner(param)[param]

    def __iter__(self):
        yield from self.adamw.state
        yield from self.muon.state

    def __len__(self) -> int:
        return len(self.adamw.state) + len(self.muon.state)


class MuonWithAdamW:
    """The optimizer the trainer steps when `train.optimizer = "muon"`: `Muon` for the hidden matrices and AdamW
    for the rest, seen as one (`param_groups`, `state`, `defaults`, `step`, `zero_grad`)."""

    def __init__(self, muon: Muon, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        self.param_groups = adamw.param_groups + muon.param_groups
        self.defaults = adamw.defaults

    @property
    def state(self) -> _States:
        return _States(self.muon, self.adamw)

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)


def build_muon(model: nn.Module, ctx: ParallelContext, config) -> MuonWithAdamW:
    """Muon and AdamW for `model`'s trainable parameters as `config.train` says (module docstring)."""
    from shardlm.training.optim import adamw_groups

    t = config.train
    named = [(n, p) for n, p in model.named_parameters() if is_muon_matrix(n, p)]
    matrices = {id(p) for _, p in named}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in matrices]
    adamw = torch.optim.AdamW(adamw_groups(rest, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                              eps=t.adam_eps, fused=True)
    heads = config.model.num_heads
    muon = Muon(named, ctx, t.lr, t.weight_decay, t.muon_momentum, t.muon_nesterov, t.muon_ns_steps,
                t.muon_adjust_lr, t.muon_ns_dtype, t.muon_split, heads)
    return MuonWithAdamW(muon, adamw)
