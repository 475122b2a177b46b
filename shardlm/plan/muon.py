"""Muon (`train.optimizer = "muon"`, `shardlm.training.muon`) in the planner: which weights of a rank Muon updates,
the state it keeps for them, and what its optimizer step costs.

Muon takes the 2-D projection weights of the transformer layers (`shardlm.training.muon.is_muon_matrix`): GPT's
fused qkv and proj, Llama's q, k, v and o, MLA's q_a, q_b (or q), kv_a, kv_b and o, a Gated DeltaNet layer's q, k,
v, z, b, a and o, every MLP's gate/up/down or fc/proj, and each routed expert's matrices (a stack of E / EP
experts is one parameter); AdamW keeps the rest (embeddings, output layer, norms, biases, routers, sinks, the
convolutions and the multi-token-prediction depths, which live outside `layers.`). `layer_matrices` lists one
layer's, with the shapes `parameters` counts.

- state (`memory.state_memory`, `fsdp.fsdp_state_memory`): one fp32 momentum buffer per Muon element (4 bytes, no
  `step` scalar) instead of AdamW's two moments (8 bytes) and its 4-byte step per tensor;
- step (`muon_cost`), with t = TP, d = the ranks a Muon matrix's pieces span (ZeRO-1: DP x CP; FSDP: DP x CP or
  hybrid's S; split experts: DP x CP / EP; 1 without data sharding), S the rank's elements of TP-split Muon
  matrices and N all its Muon elements:
  - TP: a split matrix's update is all-gathered whole over TP (fp32) by the DP rank that orthogonalizes it, so a
    rank sends 4 (t - 1) S / d bytes (ring), one all-gather per matrix (per expert of a stack);
  - DP (ZeRO-1, FSDP): one all-gather of every rank's pieces and one reduce-scatter of the orthogonalized result,
    fp32 over N: 2 x 4 N (d - 1) / d bytes a rank sends (ring);
  - Newton-Schulz: per matrix (m, n), m <= n (a tall one transposed), `ns_steps` x (X X^T 2 m^2 n, b A + c A A
    2 m^3, B X 2 m^2 n) = ns_steps (4 m^2 n + 2 m^3) FLOPs, on the whole matrix (every TP rank the same); GPT's
    qkv as its q, k and v parts (`train.muon_split = "parts"`, the default); matrix i by DP rank i mod d: 1 / d of
    the work per rank; priced at the GEMM rate (peak x compute efficiency, the bf16 iteration's).
  Nothing of it overlaps: the step runs after the backward, the collectives and the iterations one after another.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from shardlm.models.config import ModelConfig
from shardlm.plan.links import direction_bandwidth, over_dp_group, ring_gather_seconds
from shardlm.plan.parameters import _split

if TYPE_CHECKING:
    from shardlm.plan.hardware import GPUSpec
    from shardlm.plan.layout import Calibration, Layout

OPTIMIZERS = ("adamw", "muon")
NS_STEPS = 5
"""`train.muon_ns_steps`' default."""
UPDATE_BYTES = 4
"""Muon's updates and orthogonalized results travel in fp32."""


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter of a layer: `copies` matrices (a stack of experts; 1 otherwise) of the whole (TP = 1)
    shape (rows, cols), split over TP along `tp_dim` (0 rows, 1 columns, None replicated), each orthogonalized as
    `groups` blocks of rows (GPT's qkv: its q, k and v parts)."""

    rows: int
    cols: int
    tp_dim: int | None
    copies: int = 1
    expert: bool = False
    groups: int = 1

    def elements(self, tp: int) -> int:
        """Elements one TP rank holds: `copies` x rows x cols, 1 / tp of them when split."""
        if self.tp_dim is None:
            return self.copies * self.rows * self.cols
        _split((self.rows, self.cols)[self.tp_dim], tp, "a Muon matrix's split dimension")
        return self.copies * self.rows * self.cols // tp


@dataclass(frozen=True)
class MuonPart:
    """Muon's matrices of one exchange group on one rank (`MuonCount`)."""

    elements: int = 0
    """Elements this rank holds (its TP shards; of routed experts its E / EP)."""
    tensors: int = 0
    """Parameter tensors among them (a stack of experts is one)."""
    split: int = 0
    """Elements of TP-split matrices among `elements` (gathered over TP for the iteration)."""
    gathers: int = 0
    """TP all-gathers of one step: one per split matrix, one per expert of a split stack."""
    flops: float = 0.0
    """Newton-Schulz FLOPs of one step over the whole matrices (each TP rank computes them all)."""

    def __add__(self, other: MuonPart) -> MuonPart:
        return MuonPart(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class MuonCount:
    """A rank's Muon matrices: the dense ones and the routed experts' (their own exchange group at EP > 1)."""

    dense: MuonPart = MuonPart()
    expert: MuonPart = MuonPart()

    @property
    def total(self) -> MuonPart:
        return self.dense + self.expert

    def __add__(self, other: MuonCount) -> MuonCount:
        return MuonCount(self.dense + other.dense, self.expert + other.expert)


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """FLOPs of `shardlm.training.muon.newton_schulz` on one (rows, cols) matrix: m <= n its short and long side,
    per iteration X X^T (2 m^2 n), b A + c A A (2 m^3) and B X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def _attention(cfg: ModelConfig, tp: int, linear: bool) -> list[Matrix]:
    """A layer's attention matrices (`parameters._full_attention_count`, `_mla_count`, `_linear_attention_count`)."""
    h = cfg.hidden_size
    if cfg.arch != "llama":  # GPT's and BERT's fused qkv (orthogonalized as q, k, v) and proj
        return [Matrix(3 * h, h, 0, groups=3), Matrix(h, h, 1)]
    if linear:
        keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        values, heads = cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_num_value_heads
        return [Matrix(keys, h, 0), Matrix(keys, h, 0), Matrix(values, h, 0), Matrix(values, h, 0),
                Matrix(heads, h, 0), Matrix(heads, h, 0), Matrix(h, values, 1)]
    if cfg.attention == "mla":
        heads, rope, q_rank, kv_rank = cfg.num_heads, cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + rope
        queries = [Matrix(q_rank, h, None), Matrix(heads * qk, q_rank, 0)] if q_rank else [Matrix(heads * qk, h, 0)]
        return queries + [Matrix(kv_rank + rope, h, None),
                          Matrix(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv_rank, 0),
                          Matrix(h, heads * cfg.v_head_dim, 1)]
    width = cfg.num_heads * cfg.attention_head_dim
    kv_split = cfg.kv_heads % tp == 0  # else every rank holds k and v whole (`parameters._kv_rows`)
    kv = Matrix(cfg.kv_heads * cfg.attention_head_dim, h, 0 if kv_split else None)
    return [Matrix(width * (2 if cfg.attention_output_gate else 1), h, 0), kv, kv, Matrix(h, width, 1)]


def _mlp(cfg: ModelConfig, index: int, ep: int) -> list[Matrix]:
    """A layer's MLP matrices (`parameters._mlp_count`): dense, or the E / EP experts' stacks and the shared
    experts' MLP."""
    h, gated = cfg.hidden_size, cfg.arch == "llama"

    def dense(width: int, copies: int = 1, expert: bool = False) -> list[Matrix]:
        inputs = [Matrix(width, h, 0, copies, expert)] * (2 if gated else 1)
        return inputs + [Matrix(h, width, 1, copies, expert)]

    if not cfg.is_moe_layer(index):
        return dense(cfg.ffn_size)
    experts = dense(cfg.moe_ffn_size, cfg.moe_num_experts // ep, expert=True)
    return experts + (dense(cfg.shared_ffn_size) if cfg.moe_shared_experts else [])


def layer_matrices(cfg: ModelConfig, index: int, tp: int, ep: int = 1) -> list[Matrix]:
    """Layer `index`'s Muon parameters on one (TP, EP) rank, as `shardlm.models` builds them."""
    return _attention(cfg, tp, cfg.is_linear_layer(index)) + _mlp(cfg, index, ep)


def _part(matrices: list[Matrix], tp: int, ns_steps: int) -> MuonPart:
    """`matrices` on one TP rank, summed."""
    total = MuonPart()
    for m in matrices:
        elements, split = m.elements(tp), m.tp_dim is not None
        flops = m.copies * m.groups * newton_schulz_flops(m.rows // m.groups, m.cols, ns_steps)
        total += MuonPart(elements, 1, elements if split else 0, m.copies if split else 0, flops)
    return total


def muon_count(cfg: ModelConfig, tp: int, indices, ep: int = 1, ns_steps: int = NS_STEPS) -> MuonCount:
    """The Muon matrices of the layers `indices` on one (TP, EP) rank (multi-token-prediction depths, index >=
    num_layers, are AdamW's: they are not in `layers.`)."""
    kinds: dict[tuple[bool, bool], MuonCount] = {}
    total = MuonCount()
    for index in indices:
        if index >= cfg.num_layers:
            continue
        key = (cfg.is_linear_layer(index), cfg.is_moe_layer(index))
        if key not in kinds:
            matrices = layer_matrices(cfg, index, tp, ep)
            kinds[key] = MuonCount(_part([m for m in matrices if not m.expert], tp, ns_steps),
                                   _part([m for m in matrices if m.expert], tp, ns_steps))
        total += kinds[key]
    return total


@dataclass(frozen=True)
class MuonCost:
    """What one step of Muon costs one rank (module docstring): bytes it sends, FLOPs it computes, seconds."""

    tp_bytes: float = 0.0
    """Sent in the TP all-gathers of the split matrices' updates (ring, fp32)."""
    dp_bytes: float = 0.0
    """Sent in the all-gather and the reduce-scatter over the data-sharding group (ring, fp32); 0 unsharded."""
    flops: float = 0.0
    """Newton-Schulz FLOPs this rank computes (its 1 / d of the matrices' under ZeRO-1 and FSDP)."""
    tp_s: float = 0.0
    """Seconds of the TP all-gathers (NVLink)."""
    dp_s: float = 0.0
    """Seconds of the data-sharding group's all-gather and reduce-scatter (the DP group's link)."""
    ns_s: float = 0.0
    """Seconds of the Newton-Schulz iterations at the GEMM rate."""

    @property
    def seconds(self) -> float:
        return self.tp_s + self.dp_s + self.ns_s

    def __add__(self, other: MuonCost) -> MuonCost:
        return MuonCost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def exchange_groups(count: MuonCount, layout: Layout) -> list[tuple[MuonPart, int, int]]:
    """(matrices, d ranks their pieces span, the ranks' stride) of each exchange group of one rank: the dense
    matrices (with the experts at EP = 1) over DP x CP (FSDP's hybrid: S), TP apart; split experts (EP > 1) over
    the DP x CP / EP expert-DP ranks, TP x EP apart; d = 1 without data sharding (every rank holds them whole)."""
    ranks = layout.dp * layout.cp
    sharded = layout.distributed_optimizer or layout.full_sharding
    dense = (layout.fsdp_shard_size or ranks) if layout.full_sharding else ranks if sharded else 1
    if layout.ep == 1:
        return [(count.total, dense, layout.tp)]
    return [(count.dense, dense, layout.tp), (count.expert, ranks // layout.ep if sharded else 1,
                                              layout.tp * layout.ep)]


def muon_cost(count: MuonCount, layout: Layout, gpu: GPUSpec, calibration: Calibration) -> MuonCost:
    """One step of Muon on a rank holding `count` (module docstring): per exchange group of d ranks
    (`exchange_groups`), the TP all-gathers of its 1 / d of the split matrices on the TP link (NVLink: TP stays in a
    node; one latency per gather and ring step), the all-gather and reduce-scatter of its N elements over the group
    (`links.over_dp_group`), and its 1 / d of the Newton-Schulz FLOPs at peak x compute efficiency."""
    t = layout.tp
    intra, _ = direction_bandwidth(gpu, calibration)
    rate = gpu.peak_tflops * 1e12 * calibration.compute_efficiency
    total = MuonCost()
    for part, d, stride in exchange_groups(count, layout):
        gathered = UPDATE_BYTES * part.split / d  # this rank's shards of the matrices it orthogonalizes
        latency = -(-part.gathers // d) * (t - 1) * calibration.intra_node_latency_s if t > 1 else 0.0
        tp_s = ring_gather_seconds(t * gathered, t, intra, 0.0) + latency
        pieces = UPDATE_BYTES * part.elements
        dp_s = 2 * over_dp_group(ring_gather_seconds, pieces, d, stride, gpu, calibration)
        total += MuonCost(tp_bytes=(t - 1) * gathered, dp_bytes=2 * pieces * (d - 1) / d, flops=part.flops / d,
                          tp_s=tp_s, dp_s=dp_s, ns_s=part.flops / d / rate)
    return total
