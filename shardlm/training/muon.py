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

Under data sharding each DP rank holds a piece of every matrix (ZeRO-1: the part of the flat fp32 buffer in its
range, `shardlm.training.master_weights`, which also serves half-precision parameters' fp32 masters; FSDP: its rows
of the DTensor). The momentum stays with the piece; the update is whole only for the iteration, spread as
Moonlight's distributed Muon spreads it: one all-gather of every rank's pieces, matrix i orthogonalized by DP rank
i mod d (its TP peers, which share its DP rank, gather over TP with it), one reduce-scatter handing each rank its
pieces of O. Per step that is 2 x 4 bytes per Muon element of a rank's share on the wire (`Muon.elements`), and each
rank runs Newton-Schulz on about 1/d of the matrices. Split experts exchange over expert-DP, the rest over DP x CP.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch
from torch import nn

from shardlm.parallel import Communicator, ParallelContext

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


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyperparameters as `train` names them (`torch.optim.Muon`'s names); `heads` splits GPT's qkv."""

    lr: float
    weight_decay: float
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: str = "original"
    ns_dtype: str = "bf16"
    split: str = "parts"
    heads: int = 1

    @classmethod
    def of(cls, config) -> MuonSettings:
        t = config.train
        return cls(t.lr, t.weight_decay, t.muon_momentum, t.muon_nesterov, t.muon_ns_steps, t.muon_adjust_lr,
                   t.muon_ns_dtype, t.muon_split, config.model.num_heads)


@dataclass
class MuonMatrix:
    """One matrix (or stack of experts' matrices) Muon updates. `shape`: this TP rank's matrix, whole over DP;
    `tp_dim`: its TP split dimension (None: whole on every TP rank); `piece`: the tensor this rank updates and keys
    the state by (the parameter; ZeRO-1's 1-D segment of the master weights; FSDP's DTensor parameter), None when
    this rank holds none of it; `spans`: the flat (start, end) of the matrix each rank of the exchange group holds."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    piece: torch.Tensor | None
    spans: list[tuple[int, int]]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a piece or gradient (an FSDP DTensor's local rows), flattened."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).view(-1)


class Muon(torch.optim.Optimizer):
    """Muon over `matrices`, each orthogonalized whole over TP and DP (module docstring). `group`: the
    communicator whose ranks each hold a piece of every matrix (ZeRO-1, FSDP), None when every rank holds them
    whole. Sharded, a step is: momentum and update on this rank's pieces; one all-gather of every piece (each rank
    sends its pieces once); the owner of matrix i, rank i mod d, orthogonalizes it (with its TP peers, who own it
    too); one reduce-scatter hands each rank its pieces of O (exactly one rank adds a non-zero value to each
    element, so the sum is exact). The all-gather's output and the reduce-scatter's input are `elements` fp32
    values each."""

    def __init__(self, matrices: list[MuonMatrix], ctx: ParallelContext, settings: MuonSettings,
                 group: Communicator | None = None):
        pieces = [m.piece for m in matrices if m.piece is not None]
        super().__init__([{"params": pieces}], {"lr": settings.lr, "weight_decay": settings.weight_decay})
        self.matrices, self.ctx, self.settings = matrices, ctx, settings
        self.group = group if group is not None and group.size > 1 else None
        self.names = {id(m.piece): m.name for m in matrices if m.piece is not None}
        self.ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[settings.ns_dtype]
        d = 1 if self.group is None else self.group.size
        self.width = max([sum(e - s for s, e in (m.spans[r] for m in matrices)) for r in range(d)], default=0)
        self.elements = 0 if self.group is None else d * self.width
        """fp32 values of the step's all-gather output and of its reduce-scatter input (0 when not sharded)."""
        self.shapes = [self._orthogonalized_shape(m) for m in matrices]
        """Per matrix, the (rows, cols) orthogonalized as one, whole over TP: what its learning rate scales by."""

    def _orthogonalized(self, name: str, update: torch.Tensor, param_dim: int | None) -> torch.Tensor:
        """O of one matrix's update (this TP rank's (rows, cols)) whose TP split dimension is `param_dim` (or
        None): gathered over TP, orthogonalized by row groups (`row_groups`), this rank's shard kept; ns dtype."""
        tp, rank, s = self.ctx.tp_size, self.ctx.tp_rank, self.settings
        whole = update if param_dim is None or tp == 1 else torch.cat(self.ctx.tp.all_gather(update.contiguous()),
                                                                        dim=param_dim)
        groups = row_groups(name, whole.shape[0], s.heads, s.split)
        if len(groups) == 1:
            out = newton_schulz(whole, steps=s.ns_steps, dtype=self.ns_dtype)
        else:
            out = torch.empty_like(whole, dtype=self.ns_dtype)
            for rows in groups:
                out[rows] = newton_schulz(whole[rows], steps=s.ns_steps, dtype=self.ns_dtype)
        return out if param_dim is None or tp == 1 else out.chunk(tp, dim=param_dim)[rank]

    def _orthogonalized_matrix(self, m: MuonMatrix, update: torch.Tensor) -> torch.Tensor:
        """O of a whole (over DP) matrix's flat update, flat; a stack of experts one expert at a time."""
        update = update.view(m.shape)
        if len(m.shape) == 3:
            dim = None if m.tp_dim is None else m.tp_dim - 1
            return torch.stack([self._orthogonalized(m.name, u, dim) for u in update]).reshape(-1)
        return self._orthogonalized(m.name, update, m.tp_dim).reshape(-1)

    def _orthogonalized_shape(self, m: MuonMatrix) -> tuple[int, int]:
        """(rows, cols) of the matrices orthogonalized as one (whole over TP; a row group of GPT's qkv)."""
        shape = list(m.shape[-2:])
        dim = None if m.tp_dim is None else m.tp_dim - (len(m.shape) - 2)
        if dim is not None:
            shape[dim] *= self.ctx.tp_size
        return len(row_groups(m.name, shape[0], self.settings.heads, self.settings.split)[0]), shape[1]

    def _exchange(self, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{matrix index: this rank's piece of O} from {index: this rank's piece of the update}."""
        if self.group is None:
            return {i: self._orthogonalized_matrix(self.matrices[i], u) for i, u in updates.items()}
        group, d, w = self.group, self.group.size, self.width
        sent = torch.zeros(w, device=self.ctx.device)
        offset = 0
        for i, m in enumerate(self.matrices):
            s, e = m.spans[group.rank]
            if e > s:
                sent[offset:offset + e - s] = updates[i]
            offset += e - s
        pieces = group.all_gather(sent)
        offsets = [0] * d
        scattered = torch.zeros(d * w, device=self.ctx.device)
        for i, m in enumerate(self.matrices):
            lengths = [e - s for s, e in m.spans]
            if i % d == group.rank:  # this rank's matrix: whole from every rank's piece, orthogonalized, handed out
                whole = torch.cat([pieces[r][offsets[r]:offsets[r] + lengths[r]] for r in range(d)])
                out = self._orthogonalized_matrix(m, whole)
                for r, (s, e) in enumerate(m.spans):
                    scattered[r * w + offsets[r]:r * w + offsets[r] + e - s] = out[s:e]
            offsets = [o + n for o, n in zip(offsets, lengths)]
        mine = group.reduce_scatter(scattered)
        out, offset = {}, 0
        for i, m in enumerate(self.matrices):
            s, e = m.spans[group.rank]
            if i in updates:
                out[i] = mine[offset:offset + e - s]
            offset += e - s
        return out

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, decay, s = group["lr"], group["weight_decay"], self.settings
        updates = {}
        for i, m in enumerate(self.matrices):
            grad = None if m.piece is None else m.piece.grad
            if grad is None:
                if self.group is not None and m.spans[self.group.rank][1] > m.spans[self.group.rank][0]:
                    updates[i] = torch.zeros(m.spans[self.group.rank][1] - m.spans[self.group.rank][0],
                                             device=self.ctx.device)
                continue
            grad = _local(grad)
            state = self.state[m.piece]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(m.piece.grad)
            buffer = _local(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - s.momentum)
            updates[i] = grad.lerp(buffer, s.momentum) if s.nesterov else buffer
        outs = self._exchange(updates)
        for i, m in enumerate(self.matrices):
            if m.piece is None or m.piece.grad is None:
                continue
            piece = _local(m.piece)
            piece.mul_(1 - lr * decay)
            piece.add_(outs[i], alpha=-adjusted_lr(lr, self.settings.adjust_lr, self.shapes[i]))


class _States(MutableMapping):
    """The optimizers' per-parameter states seen as one mapping (a view: nothing is copied); a parameter's state is
    read from and written to the optimizer that owns it (the first Muon that has it, else AdamW)."""

    def __init__(self, muons: list[Muon], adamw: torch.optim.Optimizer):
        self.muons, self.adamw = muons, adamw

    def _owner(self, param) -> dict:
        return next((m.state for m in self.muons if id(param) in m.names), self.adamw.state)

    def __getitem__(self, param):
        return self._owner(param)[param]

    def __setitem__(self, param, value) -> None:
        self._owner(param)[param] = value

    def __delitem__(self, param) -> None:
        del self._owner(param)[param]

    def __iter__(self):
        yield from self.adamw.state
        for muon in self.muons:
            yield from muon.state

    def __len__(self) -> int:
        return len(self.adamw.state) + sum(len(m.state) for m in self.muons)


class MuonWithAdamW:
    """The optimizer the trainer steps when `train.optimizer = "muon"`: `Muon` for the hidden matrices (one per
    exchange group: the dense matrices and, under FSDP with expert parallelism, the split experts) and AdamW for the
    rest, seen as one (`param_groups`, `state`, `defaults`, `step`, `zero_grad`)."""

    def __init__(self, muons: list[Muon], adamw: torch.optim.Optimizer):
        self.muons, self.adamw = muons, adamw
        self.param_groups = adamw.param_groups + [g for m in muons for g in m.param_groups]
        self.defaults = adamw.defaults

    @property
    def state(self) -> _States:
        return _States(self.muons, self.adamw)

    def step(self) -> None:
        self.adamw.step()
        for muon in self.muons:
            muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        for muon in self.muons:
            muon.zero_grad(set_to_none=set_to_none)


def whole_spans(shape: tuple[int, ...], parts: int) -> list[tuple[int, int]]:
    """The flat (start, end) each of `parts` ranks holds of a tensor sharded on dim 0 by `torch.chunk` (FSDP2's
    split; ranks past the last chunk hold nothing)."""
    rows, per_row = shape[0], math.prod(shape[1:])
    chunk = -(-rows // parts)
    return [(min(r * chunk, rows) * per_row, min((r + 1) * chunk, rows) * per_row) for r in range(parts)]


def build_muon(model: nn.Module, ctx: ParallelContext, config, shard_group: Communicator | None = None
               ) -> MuonWithAdamW:
    """Muon and AdamW for `model`'s trainable parameters as `config.train` says (module docstring): replicated
    parameters, or FSDP's DTensor shards (`shard_group`: the ranks a dense shard spans; split experts span
    `ctx.expert_dp`)."""
    from shardlm.training.optim import adamw_groups

    t, settings = config.train, MuonSettings.of(config)
    named = [(n, p) for n, p in model.named_parameters() if is_muon_matrix(n, p)]
    matrices = {id(p) for _, p in named}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in matrices]
    adamw = torch.optim.AdamW(adamw_groups(rest, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                              eps=t.adam_eps, fused=True)
    if shard_group is None:
        whole = [MuonMatrix(n, tuple(p.shape), getattr(p, "tensor_parallel_dim", None), p, [(0, p.numel())])
                 for n, p in named]
        return MuonWithAdamW([Muon(whole, ctx, settings)], adamw)
    groups = {}  # FSDP: each parameter's rows over the group its mesh shards it on
    for n, p in named:
        group = ctx.expert_dp if getattr(p, "expert_parallel", False) and ctx.ep_size > 1 else shard_group
        matrix = MuonMatrix(n, tuple(p.shape), getattr(p, "tensor_parallel_dim", None), p,
                            whole_spans(tuple(p.shape), group.size))
        groups.setdefault(group.name, (group, []))[1].append(matrix)
    return MuonWithAdamW([Muon(ms, ctx, settings, group) for group, ms in groups.values()], adamw)
