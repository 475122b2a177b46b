"""Memory and time of one layout's options (`Choice`): the planner's evaluation of a `timing.Layout`.

`Evaluator.choice` charges the busiest pipeline rank its state (`memory.state_memory`, or under FSDP
`fsdp.fsdp_state_memory` and the gathered units `fsdp.fsdp_gathered_bytes`), the activation peak of its
in-flight micro-batches (`activations.rank_activation_peak`) and the reserve, and prices the step
(`timing.step_time`). With `--optimizer muon` each rank's Muon matrices (`muon.muon_count` of its layers) change
its optimizer state, and the slowest pipeline rank's Muon step (`muon.muon_cost`) is added to the step time. A
config's `[lora]` (`shardlm.plan.lora`) makes each rank's state that of its adapters and frozen (NF4) base, adds
the weights the layers' GEMMs save beyond full fine-tuning's to the activations and the largest layer's
dequantized NF4 weights once (`Choice.dequantized`); the step time is full fine-tuning's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import TYPE_CHECKING

from shardlm.plan import dualpipe
from shardlm.plan.activations import (
    LayerSetting,
    flash_memory,
    korthikanti_memory,
    rank_activation_peak,
    shardlm_memory,
)
from shardlm.plan.experts import moe_layer_count
from shardlm.plan.fp8 import fp8_layer_bytes
from shardlm.plan.fsdp import fsdp_gathered_bytes, fsdp_state_memory, fsdp_units
from shardlm.plan.kernels import CORE_KERNELS, SC21_KERNELS
from shardlm.plan.lora import LoraCount, lora_count
from shardlm.plan.lora_memory import (
    lora_fsdp_gathered_bytes,
    lora_fsdp_state_memory,
    lora_state_memory,
    saved_weight_bytes,
    working_copy_bytes,
)
from shardlm.plan.memory import GB, ActivationMemory, StateMemory, state_memory
from shardlm.plan.mtp import with_mtp
from shardlm.plan.muon import MuonCost, MuonCount, muon_cost, muon_count
from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages, trimmed_layers
from shardlm.plan.timing import Layout, StepTime, step_time

if TYPE_CHECKING:
    from shardlm.plan.request import PlanRequest


@dataclass(frozen=True)
class Choice:
    """One option of a layout (micro-batch, virtual stages, SP, recomputation, ZeRO) with its memory and time."""

    layout: Layout
    accumulation: int
    """Micro-batches per DP rank per step."""
    activations: ActivationMemory
    """Per micro-batch, as the first stage's TP rank saves them."""
    total_bytes: int
    """State + peak activations (in-flight micro-batches) + reserve, on the busiest GPU."""
    fits: bool
    time: StepTime
    state: StateMemory
    """Parameters, gradients, optimizer state on the busiest GPU."""
    activation_peak: int
    """Peak activation bytes on the busiest GPU."""
    busiest_stage: int = 0
    """Pipeline rank whose GPU needs the most memory."""
    gathered: int = 0
    """FSDP's transient gathered parameters and unsharded gradients at the peak (`fsdp.fsdp_gathered_bytes`)."""
    muon: MuonCost | None = None
    """With `--optimizer muon`: the step of the pipeline rank whose Muon step is the slowest (`time.muon_s`)."""
    dequantized: int = 0
    """QLoRA: the busiest rank's largest layer's NF4 weights dequantized (fp32), counted once
    (`lora_memory.working_copy_bytes`)."""


class Evaluator:
    """Memory and time of the options of one request, with the per-shape pieces cached."""

    def __init__(self, request: PlanRequest):
        self.request, self.cfg, self.fmt = request, request.model.config, request.format
        self.megatron = request.implementation == "megatron"
        self.core = request.implementation == "megatron-core"
        self.kernels = request.kernels or (CORE_KERNELS if self.core else SC21_KERNELS)
        self.activations = lru_cache(maxsize=None)(self._activations)
        self.rank_params = lru_cache(maxsize=None)(self._rank_params)
        self.units = lru_cache(maxsize=None)(self._units)
        self.rank_muon = lru_cache(maxsize=None)(self._rank_muon)
        self.rank_lora = lru_cache(maxsize=None)(self._rank_lora)
        self.lora = request.model.lora if request.model.lora.rank else None
        self.memo: dict = {}  # `step_time`'s counts that depend on a few of the layout's sizes
        # a stage without the first dense layers can be the busiest: check every stage of such models
        self.mixed = 0 < moe_layer_count(self.cfg) < self.cfg.num_layers

    def _activations(self, tp: int, micro: int, setting: LayerSetting, ep: int, cp: int = 1) -> ActivationMemory:
        cfg = replace(self.cfg, seq_length=self.cfg.seq_length // cp)  # a CP rank saves T / C tokens' activations
        if self.megatron:
            acts = korthikanti_memory(cfg, tp, micro, setting)
        elif self.core:
            acts = flash_memory(cfg, tp, micro, setting)
        else:
            acts = shardlm_memory(cfg, tp, micro, self.fmt, setting, ep=ep, context=cp)
        if self.kernels.fp8_storage:  # DeepSeek's FP8-cached layers, shardlm's embedding, head and loss
            layer = partial(fp8_layer_bytes, cfg, tp, micro, setting.sequence_parallel)
            acts = replace(acts, per_layer=layer("none"), layer_input=layer("full"))
        if self.lora is not None:  # the weights a LoRA run's GEMMs save beyond full fine-tuning's (`lora`)
            acts = replace(acts, per_layer=acts.per_layer + saved_weight_bytes(self.cfg, self.lora, tp, ep, self.fmt,
                                                                               setting.recompute))
        return with_mtp(acts, cfg, tp, micro, self.fmt, setting.sequence_parallel,  # the depths: last stage
                        setting.recompute == "full")

    def _rank_params(self, pp: int, virtual: int, tp: int, rank: int, ep: int = 1, trim: bool = False,
                     dual: bool = False, v_shaped: bool = False):
        if dual:  # DualPipe: stage `rank` and its mirror (`dualpipe.rank_stages`)
            stages = dualpipe.rank_stages(pipeline_layers(self.cfg.num_layers, pp, 1), pp, rank)
        else:  # loop placement, or ZB-V's / DualPipeV's stages r and 2P - 1 - r
            split = trimmed_layers if trim else pipeline_layers
            stages = rank_stages(split(self.cfg.num_layers, pp, virtual), pp, rank, v_shaped)
        return stages, rank_parameter_count(self.cfg, tp, stages, ep)

    def _rank_muon(self, pp: int, virtual: int, tp: int, rank: int, ep: int = 1, trim: bool = False,
                   dual: bool = False, v_shaped: bool = False) -> MuonCount | None:
        """The Muon matrices of the layers `rank_params` gives the rank (None with AdamW)."""
        if self.request.optimizer != "muon":
            return None
        stages = self.rank_params(pp, virtual, tp, rank, ep, trim, dual, v_shaped)[0]
        return muon_count(self.cfg, tp, stages.layer_indices, ep, self.request.muon_ns_steps)

    def _rank_lora(self, pp: int, virtual: int, tp: int, rank: int, ep: int = 1, trim: bool = False,
                   dual: bool = False, v_shaped: bool = False) -> LoraCount | None:
        """The adapters and frozen base of the rank `rank_params` describes (None without `[lora]`)."""
        if self.lora is None:
            return None
        stages, params = self.rank_params(pp, virtual, tp, rank, ep, trim, dual, v_shaped)
        return lora_count(self.cfg, self.lora, tp, stages.layer_indices, stages.first, stages.last, ep, held=params,
                          half_base=self.fmt.half_gemms)

    def _muon_cost(self, layout: Layout, ranks, dual: bool) -> MuonCost | None:
        """The slowest of `ranks`' Muon steps (`muon.muon_cost`; None with AdamW)."""
        if self.request.optimizer != "muon":
            return None
        request = self.request
        costs = [muon_cost(self.rank_muon(layout.pp, layout.virtual, layout.tp, rank, layout.ep, layout.end_trim,
                                          dual, layout.v_shaped), layout, request.gpu, request.calibration)
                 for rank in ranks]
        return max(costs, key=lambda cost: cost.seconds)

    def _units(self, pp: int, virtual: int, tp: int, rank: int, ep: int, v_shaped: bool = False):
        stages = self.rank_params(pp, virtual, tp, rank, ep, False, False, v_shaped)[0] if pp > 1 else None
        return fsdp_units(self.cfg, tp, stages, ep)

    def _fsdp_memory(self, layout: Layout, rank: int, accumulation: int):
        """(state, gathered) of pipeline rank `rank` under FSDP (`fsdp.fsdp_state_memory`, `fsdp_gathered_bytes`):
        dense units sharded over DP x CP (hybrid: over S), split experts over DP x CP / EP."""
        tp, ep, ranks, v_shaped = layout.tp, layout.ep, layout.dp * layout.cp, layout.v_shaped
        lora = self.rank_lora(layout.pp, layout.virtual, tp, rank, ep, False, False, v_shaped)
        if lora is not None:
            state = lora_fsdp_state_memory(lora, layout.fsdp_shard_size or ranks, ranks // ep if ep > 1 else None)
            return state, lora_fsdp_gathered_bytes(lora, self.fmt.weight_bytes, accumulation, layout.pp > 1)
        params = self.rank_params(layout.pp, layout.virtual, tp, rank, ep, False, False, v_shaped)[1]
        state = fsdp_state_memory(params, layout.fsdp_shard_size or ranks, ranks // ep if ep > 1 else None,
                                  self.rank_muon(layout.pp, layout.virtual, tp, rank, ep, False, False, v_shaped))
        units = self.units(layout.pp, layout.virtual, tp, rank, ep, v_shaped)
        return state, fsdp_gathered_bytes(units, self.fmt.weight_bytes, accumulation, pipeline=layout.pp > 1)

    def choice(self, layout: Layout) -> Choice:
        request, tp, pp, ep = self.request, layout.tp, layout.pp, layout.ep
        accumulation = request.global_batch // (layout.dp * layout.micro_batch)
        setting = LayerSetting(layout.sequence_parallel, layout.recompute)
        acts = self.activations(tp, layout.micro_batch, setting, ep, layout.cp)
        reserve = int(request.reserve_gb * GB)
        worst = None
        dual = self.kernels.dualpipe and pp > 1
        v_shaped = layout.v_shaped
        if dual:
            ranks = dualpipe.mirrored_ranks(pp)
        elif v_shaped:  # rank 0 holds both ends, the others two middle stages each: any can be the busiest
            ranks = range(pp)
        else:
            ranks = range(pp) if self.mixed else sorted({0, pp - 1} | ({min(1, pp - 1)} if layout.end_trim else set()))
        for rank in ranks:  # with trimmed ends the second rank holds a full first chunk
            stages, params = self.rank_params(pp, layout.virtual, tp, rank, ep, layout.end_trim, dual, v_shaped)
            muon = self.rank_muon(pp, layout.virtual, tp, rank, ep, layout.end_trim, dual, v_shaped)
            lora = self.rank_lora(pp, layout.virtual, tp, rank, ep, layout.end_trim, dual, v_shaped)
            if layout.full_sharding:
                state, gathered = self._fsdp_memory(layout, rank, accumulation)
            elif lora is not None:
                state, gathered = lora_state_memory(lora, self.fmt, layout.dp * layout.cp,
                                                    layout.distributed_optimizer, ep), 0
            else:
                state, gathered = state_memory(params, self.fmt, layout.dp * layout.cp, layout.distributed_optimizer,
                                               ep=ep, muon=muon), 0
            # QLoRA: the largest layer's weights dequantized while it computes
            dequantized = working_copy_bytes(lora, self.fmt, layout.recompute) if lora is not None else 0
            if self.core and layout.distributed_optimizer:  # ZeRO-2: the fp32 gradients sharded with the state
                state = replace(state, gradients=-(-state.gradients // (layout.dp * layout.cp)))
            if self.kernels.fp8_storage:  # AdamW's moments in BF16: 4 + 2 x 2 of the 4 + 2 x 4 bytes a parameter
                state = replace(state, optimizer=state.optimizer * 2 // 3)
            schedule = "dualpipe" if self.kernels.dualpipe else layout.schedule
            peak = rank_activation_peak(acts, stages, schedule, pp, accumulation, layout.recompute,
                                        keeps_received=not (self.megatron or self.core or self.kernels.dualpipe),
                                        frees_stage_input=self.core)
            if worst is None or state.total + peak + gathered + dequantized > \
                    worst[0].total + worst[1] + worst[3] + worst[4]:
                worst = (state, peak, rank, gathered, dequantized)
        state, peak, rank, gathered, dequantized = worst
        params = self.rank_params(pp, layout.virtual, tp, 0, ep, layout.end_trim, dual, v_shaped)[1]
        units = self.units(pp, layout.virtual, tp, 0, ep, v_shaped) if layout.full_sharding else None
        time = step_time(self.cfg, layout, request.global_batch, request.gpu, self.fmt, params, request.calibration,
                         attention_scores=self.megatron, scatter_gather=self.megatron or self.core, units=units,
                         kernels=self.kernels, memo=self.memo)
        muon = self._muon_cost(layout, dualpipe.mirrored_ranks(pp) if dual else range(pp), dual)
        if muon is not None:
            time = replace(time, muon_s=muon.seconds)
        total = state.total + peak + gathered + dequantized + reserve
        return Choice(layout, accumulation, acts, total, total <= request.gpu.memory_gb * GB, time, state, peak, rank,
                      gathered, muon, dequantized)
