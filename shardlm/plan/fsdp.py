"""Fully sharded data parallelism in the planner (`train.data_sharding = "full"`, `shardlm.training.fsdp`).

shardlm's FSDP makes every transformer layer one unit and the model root (embedding, positions, final
norm, output layer) another, each sharded on dim 0 over the d = DP ranks of the data-parallel group
(ranks TP apart; DP x CP ranks with context parallelism). Per rank, with N this TP rank's parameter
elements, w the bytes of a gathered parameter (4, or 2 with `param_dtype = "half"`) and m the
micro-batches per step:

- state: fp32 parameter and gradient shards, 4 N / d each, AdamW's two fp32 moments 8 N / d and one
  4-byte step per parameter tensor (every rank holds a step for each tensor, even an empty shard), in
  every precision: the fp32 shard is the master weight (`fsdp_state_memory`); with Muon its matrices' M
  elements keep one fp32 momentum, 4 M / d, and no step (`shardlm.plan.muon`);
- gathered (transient, `fsdp_gathered_bytes`): the root is gathered for the whole step (w per element)
  and its unsharded gradient lives from the output layer's backward to the end (w); at most two layers
  are gathered at once (the one computing and the one prefetched, w each) and one layer's unsharded
  gradient waits for its reduce-scatter (fp32). With m > 1 shardlm skips the reduce-scatter of the
  first m - 1 micro-batches (`set_requires_gradient_sync(False)`): every unit's unsharded gradient is
  accumulated in fp32 until the last one, 4 N bytes on top;
- communication per step (`fsdp_collectives`, reshard after forward, shardlm's default): the root
  gathered once; each layer gathered before the first micro-batch's forward and again before every
  micro-batch's backward (later forwards find it still gathered: the non-last backwards do not
  reshard), 1 + m all-gathers; one reduce-scatter of every unit's fp32 gradients after the last
  backward. At m = 1: 2 all-gathers and 1 reduce-scatter of the layers' parameters, as measured in
  `tests/test_fsdp.py` and `make bench` section `fsdp`;
- time (`fsdp_seconds`): a ring all-gather or reduce-scatter of B bytes over d ranks moves
  (d - 1) / d x B per rank; the planner prices it on the DP group's link as the gradient all-reduce
  (`links.over_dp_group`: NVLink inside a server, the node's network shared by its TP groups
  across servers). Each layer's collective overlaps the compute of its neighbour (prefetch), as the DP
  all-reduce overlaps the backward: a fraction `dp_overlap` of it hides, at most the layer's forward
  (gathers) or backward (gather + reduce-scatter) time; the root's gather before the first layer and
  its reduce-scatter after the last have nothing to hide behind.

With context parallelism the units are sharded over the DP x CP ranks (`ctx.dp_cp`), and d = DP x CP.
Which layouts it plans (`fsdp_invalid_reason`): DP x CP > 1, GPT or Llama, shardlm's implementation. What
the compositions change:

- pipeline stages (`parallel.pipeline.shard_stage`: each of a rank's stages an FSDP root over its layers
  and the end pieces it runs): the units are the rank's (`fsdp_units` with its `RankStages`). PyTorch's
  schedules run every backward without gradient sync or reshard and reduce-scatter every unit once after
  the flush (`perform_reduce_grad`): a layer is gathered by a forward that follows a forward (the forward
  reshards it) and by a backward that follows a forward, 1 + m times in any order of m forwards and m
  backwards; after its first backward it stays gathered with its fp32 gradient unsharded until the end, so
  the rank holds all its units, w + 4 bytes per element (`fsdp_gathered_bytes(pipeline=True)`), and the
  reduce-scatters are exposed (`fsdp_seconds(reduce_after_flush=True)`);
- MoE layers at EP > 1 (`training.fsdp.shard_model`): each layer's expert stacks are their own unit over the
  d / EP expert-DP ranks (TP x EP apart), the rest of the layer over d: state 16 bytes per dense element / d
  and per expert element / (d / EP); a layer's gather and reduce-scatter are one collective on each group
  (`FSDPGroups`). At EP = 1 the experts are part of their layer's unit;
- hybrid sharding (`train.fsdp_shard_size` = S): units sharded within groups of S consecutive DP x CP ranks
  (S x TP consecutive GPUs) and replicated across the d / S groups: state / S, gathers and reduce-scatters on
  the shard group's link, and after each reduce-scatter an all-reduce of the unit's 4 / S bytes per element
  gradient shard over the d / S ranks TP x S apart (`fsdp_groups`), overlapped with the backward like the
  reduce-scatter. Split experts keep their own units over expert-DP, not hybrid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardlm.models.config import ModelConfig
from shardlm.plan.hardware import GPUSpec
from shardlm.plan.links import over_dp_group, ring_allreduce_seconds, ring_gather_seconds
from shardlm.plan.memory import StateMemory
from shardlm.plan.muon import MuonCount
from shardlm.plan.parameters import (
    ParameterCount,
    layer_parameter_count,
    layers_parameter_count,
    parameter_count,
    parameter_kind,
)
from shardlm.plan.stages import RankStages, rank_parameter_count

if TYPE_CHECKING:
    from shardlm.plan.layout import Calibration, Layout

REDUCE_BYTES = 4
"""Gradients are reduce-scattered (and accumulated unsharded between micro-batches) in fp32."""


@dataclass(frozen=True)
class FSDPUnits:
    """The FSDP units of one (pipeline rank, TP rank, EP rank)'s model: its layers and the root."""

    layer: int
    """Parameter elements of its largest transformer layer (an MoE layer's include its E / EP experts)."""
    root: int
    """Elements outside the layers: embeddings, final norm, output layer (a pipeline rank's end pieces)."""
    layers: int
    all_layers: int | None = None
    """Elements of all its layers (None: `layers` x `layer`, every layer the same size)."""
    expert: int = 0
    """Routed-expert elements among `all_layers`: with EP > 1 each layer's expert stacks are their own unit over
    the DP x CP / EP expert-DP ranks (`shardlm.training.fsdp.shard_model`)."""

    @property
    def layer_elements(self) -> int:
        return self.layers * self.layer if self.all_layers is None else self.all_layers

    @property
    def total(self) -> int:
        return self.root + self.layer_elements


def fsdp_units(cfg: ModelConfig, tp: int, stages: RankStages | None = None, ep: int = 1) -> FSDPUnits:
    """Layer and root elements of TP rank 0 at expert-parallel size `ep`: the whole model, or pipeline rank
    `stages.rank`'s layers and end pieces (`stages.rank_parameter_count`). Each layer is
    `parameters.layer_parameter_count` (dense or MoE, linear or full attention, with or without a sparse-attention
    indexer); the gathered unit is an MoE layer's when the rank holds one, else a dense layer's (of a hybrid model
    the larger attention kind's, the larger of a sparse-attention model's layers with and without an indexer); the
    root is the rest."""
    indices = range(cfg.num_layers) if stages is None else stages.layer_indices
    layers = layers_parameter_count(cfg, indices, tp, ep)
    kinds = {parameter_kind(cfg, i): i for i in indices}
    moe = any(key[0] for key in kinds)
    largest = max((layer_parameter_count(cfg, i, tp, ep).total for key, i in kinds.items() if key[0] == moe),
                  default=layer_parameter_count(cfg, 0, tp, ep).total)
    held = parameter_count(cfg, tp, ep) if stages is None else rank_parameter_count(cfg, tp, stages, ep)
    return FSDPUnits(layer=largest, root=held.total - layers.total, layers=len(indices), all_layers=layers.total,
                     expert=layers.expert)


def fsdp_invalid_reason(cfg: ModelConfig, dp: int, pp: int, cp: int, implementation: str) -> str | None:
    """Why data_sharding="full" cannot run this layout (shardlm's config validation), or None."""
    if implementation != "shardlm":
        return "FSDP is planned for --implementation shardlm only"
    if dp * cp == 1:
        return "FSDP needs DP x CP > 1"
    if cfg.arch not in ("gpt", "llama"):
        return "FSDP supports GPT and Llama only"
    return None


def hybrid_invalid_reason(shard_size: int, dp: int, cp: int, ep: int) -> str | None:
    """Why hybrid sharding over groups of `shard_size` DP x CP ranks cannot run (shardlm's validation), or None."""
    if shard_size < 1 or (dp * cp) % shard_size:
        return f"fsdp_shard_size={shard_size} does not divide DP x CP = {dp * cp}"
    return None


def fsdp_state_memory(params: ParameterCount, shards: int, expert_shards: int | None = None,
                      muon: MuonCount | None = None) -> StateMemory:
    """Per-rank fp32 parameter and gradient shards (4 N / d each), AdamW moments (8 N / d) and its 4-byte
    step per tensor. N / d rounded up (FSDP pads each tensor's rows to a multiple of d: exact when d
    divides every first dimension). `shards`: DP x CP, or hybrid sharding's shard size S. `expert_shards`
    (EP > 1): the routed experts' `params.expert` elements are their own units over the DP x CP / EP
    expert-DP ranks, the rest over `shards`. `muon` (`plan.muon.muon_count`): Muon's matrices keep one fp32
    momentum per element of their shards (4 M / d) and no step."""
    muon = muon or MuonCount()

    def share(total: int, experts: int) -> int:
        experts = experts if expert_shards else 0
        return -(-(total - experts) // shards) + (-(-experts // expert_shards) if experts else 0)

    elements, matrices = share(params.total, params.expert), share(muon.total.elements, muon.expert.elements)
    return StateMemory(parameters=4 * elements, gradients=4 * elements,
                       optimizer=8 * (elements - matrices) + 4 * matrices + 4 * (params.tensors - muon.total.tensors))


def fsdp_gathered_bytes(units: FSDPUnits, gathered_bytes: int, accumulation: int, pipeline: bool = False) -> int:
    """Transient bytes on a rank at the activation peak (start of the backward): the root gathered and its
    gradient, two layers gathered and one layer's fp32 gradient; with accumulation (m > 1) every unit's
    fp32 gradient instead of the one layer's and the root's (see the module doc). `pipeline`: PyTorch's
    schedules run every backward without gradient sync or reshard, so after a stage's first backward all its
    layers stay gathered and every unit's fp32 gradient unsharded until the step's reduce-scatter: the rank's
    units in full, w + 4 bytes per element (charged on top of the activation peak: an upper bound, since the
    first backward frees a micro-batch's activations while it gathers)."""
    w = gathered_bytes
    if pipeline:
        return units.total * (w + REDUCE_BYTES)
    gathered = units.root * w + 2 * units.layer * w
    if accumulation > 1:
        return gathered + REDUCE_BYTES * units.total
    return gathered + units.root * w + units.layer * REDUCE_BYTES


@dataclass(frozen=True)
class FSDPCollectives:
    """Calls and elements (summed over calls, whole unsharded tensors) of one step's FSDP collectives."""

    all_gather_calls: int
    all_gather_elements: int
    reduce_scatter_calls: int
    reduce_scatter_elements: int


def fsdp_collectives(units: FSDPUnits, accumulation: int, reshard_after_forward: bool = True) -> FSDPCollectives:
    """One step: the root gathered once and each layer before the first forward, again before each of the m
    backwards when resharded after the forward; one reduce-scatter of every unit."""
    layer_gathers = 1 + (accumulation if reshard_after_forward else 0)
    return FSDPCollectives(all_gather_calls=1 + layer_gathers * units.layers,
                           all_gather_elements=units.root + layer_gathers * units.layers * units.layer,
                           reduce_scatter_calls=1 + units.layers, reduce_scatter_elements=units.total)


@dataclass(frozen=True)
class FSDPGroups:
    """How one rank prices a collective of a whole unit of `nbytes` bytes on each group FSDP uses."""

    shard: Callable[[float], float]
    """All-gather or reduce-scatter over the ranks one shard spans (DP x CP, or hybrid's S ranks)."""
    expert: Callable[[float], float] | None = None
    """All-gather or reduce-scatter of split experts over expert-DP (None: the experts are in `shard`'s units)."""
    replicate: Callable[[float], float] | None = None
    """Hybrid sharding: all-reduce of a unit's reduce-scattered gradient shard across the shard groups (called
    with the whole unit's gradient bytes, it prices the shard's)."""


def fsdp_seconds(units: FSDPUnits, accumulation: int, gathered_bytes: int, groups: FSDPGroups,
                 forward_window: float, backward_window: float, overlap: float,
                 reduce_after_flush: bool = False) -> tuple[float, float]:
    """(exposed, total) seconds of one step's FSDP collectives on one rank. `groups` prices the all-gathers
    and reduce-scatters (and hybrid's all-reduce) of one unit (`FSDPGroups`); `forward_window` and
    `backward_window` are one layer's forward and backward (recomputation included) seconds for one
    micro-batch, behind which a fraction `overlap` of each layer's collectives can hide. A layer's collective
    is that of its average size (its dense part on `groups.shard`, its experts on `groups.expert`).
    `reduce_after_flush` (pipeline stages): the schedule reduce-scatters every unit after its last backward,
    with nothing left to hide behind."""
    m, layers = accumulation, units.layers
    expert = units.expert if groups.expert else 0
    dense_layer, expert_layer = (units.layer_elements - expert) / layers, expert / layers

    def per_layer(nbytes_per_element: int, on_expert: bool = True) -> float:
        seconds = groups.shard(dense_layer * nbytes_per_element)
        return seconds + (groups.expert(expert_layer * nbytes_per_element) if expert and on_expert else 0.0)

    gather = per_layer(gathered_bytes)
    reduce = per_layer(REDUCE_BYTES)
    if groups.replicate:  # hybrid: the dense gradient shard all-reduced across shard groups (experts are not hybrid)
        reduce += groups.replicate(dense_layer * REDUCE_BYTES)
    root = groups.shard(units.root * gathered_bytes) + groups.shard(units.root * REDUCE_BYTES)
    if groups.replicate:
        root += groups.replicate(units.root * REDUCE_BYTES)

    def exposed(seconds: float, window: float) -> float:
        return seconds - min(overlap * seconds, window)

    forward = layers * exposed(gather, forward_window)  # the first micro-batch's forward only
    if reduce_after_flush:
        backward = layers * (m * exposed(gather, backward_window) + reduce)
    else:
        backward = layers * ((m - 1) * exposed(gather, backward_window) + exposed(gather + reduce, backward_window))
    total = root + layers * ((1 + m) * gather + reduce)
    return root + forward + backward, total


def fsdp_groups(layout: Layout, gpu: GPUSpec, calibration: Calibration) -> FSDPGroups:
    """Where FSDP's collectives run (`FSDPGroups`): units over the d = DP x CP ranks TP apart, or hybrid
    sharding's S consecutive ones (S x TP consecutive GPUs: NVLink while they fit in a node) with the
    gradient shard (1/S of a unit) all-reduced over the d / S shard groups (ranks TP x S apart); split
    experts (EP > 1) over their d / E expert-DP ranks, TP x E apart."""
    ranks = layout.dp * layout.cp
    shard = layout.fsdp_shard_size or ranks

    def over(ring, ranks_: int, stride: int, divide: int = 1):
        return lambda nbytes: over_dp_group(ring, nbytes / divide, ranks_, stride, gpu, calibration)

    return FSDPGroups(shard=over(ring_gather_seconds, shard, layout.tp),
                      expert=over(ring_gather_seconds, ranks // layout.ep, layout.tp * layout.ep)
                      if layout.ep > 1 else None,
                      replicate=over(ring_allreduce_seconds, ranks // shard, layout.tp * shard, shard)
                      if shard < ranks else None)


def fsdp_optimizer_seconds(units: FSDPUnits, layout: Layout, hbm: float) -> float:
    """AdamW and clipping over FSDP's shards: 40 bytes streamed per element of the rank's shares (the dense
    units' 1 / S, S = DP x CP or hybrid's shard size; split experts' DP x CP / E), at `hbm` bytes/s."""
    shard = layout.fsdp_shard_size or layout.dp * layout.cp
    expert = units.expert if layout.ep > 1 else 0
    elements = (units.total - expert) / shard + expert * layout.ep / (layout.dp * layout.cp)
    return elements * (7 * 4 + 3 * REDUCE_BYTES) / hbm
