"""Every valid PP x TP x DP (x EP) layout of a model on a cluster: memory per GPU, fit, step time, recommendation.

A layout is valid when TP stays inside a server (divides `gpus_per_node`) and divides the attention
heads and the MLP width, PP (across servers) is at most the layer count, and DP = GPUs / (TP x PP)
divides the global batch. For each valid layout the planner tries every micro-batch size that divides
the per-replica batch (up to `max_micro_batch`; a pipeline needs at least P micro-batches), every
virtual-stage count V that splits the layers evenly (interleaved 1F1B, P dividing the micro-batches; with
`--implementation megatron-core` also Llama 3's split, the first and last stage one layer short),
sequence parallelism on and off (TP > 1), no / selective / full recomputation and the data sharding
(none; the distributed optimizer at DP > 1; FSDP where `shardlm.plan.fsdp` models it), and keeps the
fastest choice whose busiest GPU (the first or the last pipeline stage; any stage when an MoE model
mixes dense and MoE layers) fits in memory, or, when none
fits, the smallest one, marked as not fitting. An MoE model gets one row per expert-parallel size E
that divides both DP x CP (experts fold over the data x context ranks, CP ranks first) and its expert
count (E = 1 for dense models). GPT and Llama (MoE included) at sequences of `context.LONG_CONTEXT`
tokens or more also get one row per context-parallel size C (dividing GPUs / (PP x TP), the sequence a
multiple of 2C): a CP rank saves the activations of T / C tokens, routes T / C tokens to the experts and
pays the ring (`shardlm.plan.context`). FSDP options include hybrid sharding over a node's DP x CP ranks
(`shard_size_options`); a layout's memory and time are `shardlm.plan.evaluate`'s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shardlm.errors import UserError
from shardlm.plan.context import LONG_CONTEXT, context_invalid_reason, context_options
from shardlm.plan.evaluate import Choice, Evaluator
from shardlm.plan.experts import moe_layer_count
from shardlm.plan.fsdp import fsdp_invalid_reason, hybrid_invalid_reason
from shardlm.plan.layout import Layout
from shardlm.plan.lora import check_lora_model
from shardlm.plan.memory import StateMemory, numeric_format
from shardlm.plan.models import check_model
from shardlm.plan.muon import OPTIMIZERS
from shardlm.plan.parameters import ParameterCount
from shardlm.plan.request import DATA_SHARDING, PlanRequest  # noqa: F401 (PlanRequest re-exported)
from shardlm.plan.schedule_sim import SPLIT_BACKWARD, V_SHAPED, schedule_invalid_reason
from shardlm.plan.stages import SCHEDULES, schedule_name, trimmed_split

SWITCH = ("auto", "on", "off")
RECOMPUTE_CHOICES = ("auto", "none", "selective", "full")


@dataclass(frozen=True)
class PlanRow:
    """The planner's verdict on one PP x TP x DP layout."""

    tp: int
    dp: int
    params: ParameterCount
    """The first pipeline rank's (all of the model's without a pipeline)."""
    choice: Choice
    """The chosen option."""
    pp: int = 1
    ep: int = 1
    """Expert-parallel size (1 for dense models)."""
    cp: int = 1
    """Context-parallel size."""

    @property
    def fits(self) -> bool:
        return self.choice.fits

    @property
    def state(self) -> StateMemory:
        return self.choice.state


@dataclass
class Plan:
    """All layouts, the skipped ones with their reason, and the recommendation."""

    request: PlanRequest
    rows: list[PlanRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """"PPxTPxDP" (MoE models: "PPxTPxDPxEP") -> why it is not a valid layout."""

    @property
    def recommended(self) -> PlanRow | None:
        """The fitting layout with the lowest predicted step time (ties: smaller PP, then TP, then EP, then CP)."""
        fitting = [row for row in self.rows if row.fits]
        return min(fitting, key=lambda row: (row.choice.time.total_s, row.pp, row.tp, row.ep, row.cp)) \
            if fitting else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_request(request: PlanRequest) -> None:
    check_model(request.model.config)
    gpus, per_node = request.gpus, request.gpu.gpus_per_node
    if gpus < 1 or request.global_batch < 1:
        raise UserError(f"--gpus={gpus} and --global-batch={request.global_batch} must be at least 1")
    if gpus > per_node and gpus % per_node:
        raise UserError(f"--gpus={gpus} is not a whole number of {per_node}-GPU nodes; "
                        f"use a multiple of --gpus-per-node={per_node}")
    for name, value, allowed in (("--checkpointing", request.checkpointing, SWITCH),
                                 ("--recompute", request.recompute, RECOMPUTE_CHOICES),
                                 ("--sequence-parallel", request.sequence_parallel, SWITCH),
                                 ("--distributed-optimizer", request.distributed_optimizer, SWITCH)):
        if value not in allowed:
            raise UserError(f"{name} {value!r} must be one of {', '.join(allowed)}")
    if request.data_sharding not in ("auto", *DATA_SHARDING):
        raise UserError(f"--data-sharding {request.data_sharding!r} must be one of auto, {', '.join(DATA_SHARDING)}")
    if request.distributed_optimizer != "auto" and request.data_sharding != "auto" and \
            request.sharding_options() != (request.data_sharding,):
        raise UserError(f"--distributed-optimizer {request.distributed_optimizer} contradicts --data-sharding "
                        f"{request.data_sharding}; give --data-sharding alone")
    if request.micro_batch is not None and request.micro_batch < 1:
        raise UserError(f"--micro-batch={request.micro_batch} must be at least 1")
    if request.schedule is not None and request.schedule not in SCHEDULES:
        raise UserError(f"--schedule {request.schedule!r} must be one of {', '.join(SCHEDULES)}")
    _check_zero_bubble(request)
    for name, value in (("--pipeline", request.pipeline), ("--virtual-stages", request.virtual_stages),
                        ("--expert", request.expert), ("--context", request.context)):
        if value is not None and value < 1:
            raise UserError(f"{name}={value} must be at least 1")
    experts = request.model.config.moe_num_experts
    if experts and request.implementation != "shardlm":
        raise UserError(f"--implementation {request.implementation} has no activation model for MoE layers; use "
                        "--implementation shardlm for a Mixture-of-Experts model")
    if request.model.config.attention == "mla" and request.implementation != "shardlm":
        raise UserError(f"--implementation {request.implementation} has no activation model for multi-head latent "
                        "attention; use --implementation shardlm")
    if any(request.model.config.is_linear_layer(i) for i in range(request.model.config.num_layers)) and \
            request.implementation != "shardlm":
        raise UserError(f"--implementation {request.implementation} has no activation model for linear-attention "
                        "(Gated DeltaNet) layers; use --implementation shardlm")
    if request.expert not in (None, 1) and not experts:
        raise UserError(f"--expert={request.expert} needs a Mixture-of-Experts model (model.moe_num_experts > 0); "
                        "drop --expert or use --expert 1")
    if experts and request.expert is not None and experts % request.expert:
        raise UserError(f"--expert={request.expert} does not divide the model's {experts} experts; use a divisor "
                        f"of {experts}")
    if request.fsdp_shard_size is not None and request.fsdp_shard_size < 0:
        raise UserError(f"--fsdp-shard-size={request.fsdp_shard_size} must be 0 (no hybrid sharding) or more")
    if request.context not in (None, 1):
        reason = context_invalid_reason(request.model.config, request.context)
        if not reason and request.implementation == "megatron":
            reason = ("not planned for --implementation megatron (SC21's unfused softmax); use --implementation "
                      "megatron-core or shardlm")
        if reason:
            raise UserError(f"--context={request.context}: {reason}")
    numeric_format(request.precision, request.implementation, request.param_dtype)  # UserError if invalid
    _check_optimizer(request)
    _check_lora(request)


def _check_lora(request: PlanRequest) -> None:
    """A config's `[lora]` is planned as shardlm trains it (`shardlm.plan.lora`): its implementation, AdamW."""
    lora = request.model.lora
    if not lora.rank:
        return
    if request.implementation != "shardlm":
        raise UserError(f"[lora] is planned for --implementation shardlm (shardlm's LoRA); drop --implementation "
                        f"{request.implementation}")
    if request.optimizer != "adamw":
        raise UserError("--optimizer muon with [lora] is not planned yet (Muon would update the adapters); use "
                        "--optimizer adamw")
    check_lora_model(request.model.config, lora)


def _check_zero_bubble(request: PlanRequest) -> None:
    """The zero-bubble schedules up front: ZB-V and DualPipeV run 2 stages a rank and, on a fixed pipeline, need
    2P stages of a layer or more. What depends on the micro-batches (DualPipeV's m >= 2P) skips a layout, and
    says why when no layout is left (`_no_option_reason`)."""
    schedule, pp, layers = request.schedule, request.pipeline, request.model.config.num_layers
    if schedule not in SPLIT_BACKWARD:
        return
    virtual = request.virtual_stages
    if virtual is not None and virtual < 1:
        return  # said by the check of the sizes
    reason = schedule_invalid_reason(schedule, pp or 1, virtual)
    if reason:
        raise UserError(f"--schedule {schedule}: {reason}")
    if pp is not None and pp > 1 and schedule in V_SHAPED and 2 * pp > layers:
        raise UserError(f"--schedule {schedule} places 2P = {2 * pp} stages on --pipeline={pp} ranks, more than the "
                        f"model's {layers} layers; use --pipeline {layers // 2} or less")


def _check_optimizer(request: PlanRequest) -> None:
    """Muon is planned as shardlm runs it (`shardlm.plan.muon`): its implementation and kernels only."""
    if request.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer {request.optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
    if request.optimizer == "muon" and (request.implementation != "shardlm" or request.kernels is not None):
        raise UserError("--optimizer muon is planned for --implementation shardlm (shardlm's Muon); drop "
                        f"--implementation {request.implementation} or use --optimizer adamw")
    if request.muon_ns_steps < 1:
        raise UserError(f"muon_ns_steps={request.muon_ns_steps} must be at least 1")


def invalid_reason(request: PlanRequest, tp: int, pp: int = 1, ep: int = 1, cp: int = 1) -> str | None:
    """Why TP size `tp` with PP size `pp` (and EP size `ep`, CP size `cp`) is not a valid layout for this
    request, or None."""
    cfg, gpu = request.model.config, request.gpu
    if (request.gpus // (tp * pp)) % cp:
        return f"{request.gpus // (tp * pp)} GPUs per TP x PP position are not divisible by CP={cp}"
    dp = request.gpus // (tp * pp * cp)
    if tp > gpu.gpus_per_node or gpu.gpus_per_node % tp:
        return f"TP={tp} does not divide a {gpu.gpus_per_node}-GPU node"
    if cfg.num_heads % tp:
        return f"{cfg.num_heads} heads are not divisible by TP={tp}"
    if cfg.hc_mult and cfg.output_groups % tp:  # DeepSeek-V4's grouped output projection splits by groups
        return f"{cfg.output_groups} output groups are not divisible by TP={tp}"
    if any(cfg.is_linear_layer(i) for i in range(cfg.num_layers)) and \
            (cfg.linear_num_key_heads % tp or cfg.linear_num_value_heads % tp):
        return (f"linear-attention heads ({cfg.linear_num_key_heads} key, {cfg.linear_num_value_heads} value) are "
                f"not divisible by TP={tp}")
    if cfg.ffn_size % tp and moe_layer_count(cfg) < cfg.num_layers:
        return f"MLP width {cfg.ffn_size} is not divisible by TP={tp}"
    if cfg.moe_num_experts and cfg.moe_ffn_size % tp:
        return f"expert MLP width {cfg.moe_ffn_size} is not divisible by TP={tp}"
    if (dp * cp) % ep:  # experts fold over the DP x CP ranks (`parallel.layout.check_expert_layout`)
        return f"DP={dp}" + (f" x CP={cp}" if cp > 1 else "") + f" is not divisible by EP={ep}"
    if pp > cfg.num_layers:
        return f"PP={pp} exceeds the {cfg.num_layers} layers"
    if pp > 1 and cfg.arch == "bert":
        return "pipeline parallelism is planned for GPT and Llama only"
    if pp > 1 and cfg.sandwich_norms:  # Gemma 4: no split of per-layer inputs or of a KV producer from its sharers
        from shardlm.plan.gemma import gemma_pipeline_problem

        if (problem := gemma_pipeline_problem(cfg, pp)) is not None:
            return problem
    if pp > 1 and request.schedule in V_SHAPED and 2 * pp > cfg.num_layers:
        return f"{request.schedule} needs 2P = {2 * pp} stages, more than the {cfg.num_layers} layers"
    if context_invalid_reason(cfg, cp):
        return context_invalid_reason(cfg, cp)
    if request.global_batch % dp:
        return f"global batch {request.global_batch} is not divisible by DP={dp}"
    if request.micro_batch is not None and (request.global_batch // dp) % request.micro_batch:
        return f"per-replica batch {request.global_batch // dp} is not divisible by micro-batch {request.micro_batch}"
    if request.sharding_options() == ("full",):
        fixed = request.fsdp_shard_size
        return fsdp_invalid_reason(cfg, dp, pp, cp, request.implementation) or \
            (hybrid_invalid_reason(fixed, dp, cp, ep) if fixed else None)
    return None


def shard_size_options(request: PlanRequest, tp: int, dp: int, cp: int, ep: int) -> list[int]:
    """FSDP shard sizes to try (`Layout.fsdp_shard_size`): the fixed one (DP x CP itself is plain FSDP, 0),
    else 0 and hybrid sharding over S = GPUs per node / TP ranks, a node's TP groups, when 1 < S < DP x CP
    divides DP x CP (`fsdp.hybrid_invalid_reason`)."""
    ranks = dp * cp
    if request.fsdp_shard_size is not None:
        size = 0 if request.fsdp_shard_size in (0, ranks) else request.fsdp_shard_size
        return [size] if not size or hybrid_invalid_reason(size, dp, cp, ep) is None else []
    node = request.gpu.gpus_per_node // tp
    return [0] + ([node] if 1 < node < ranks and hybrid_invalid_reason(node, dp, cp, ep) is None else [])


def _switch(value: str, possible: bool) -> tuple[bool, ...]:
    if not possible:
        return (False,)
    return {"auto": (False, True), "on": (True,), "off": (False,)}[value]


def _virtual_options(request: PlanRequest, pp: int, micro_batches: int) -> list[tuple[int, bool]]:
    """(virtual stages per rank, trimmed ends) to try: V splitting the layers evenly (interleaving needs P | m);
    with `--implementation megatron-core`, where L is not a multiple of P x V but L + 2 is, also Llama 3's split
    with the first and last stage one layer short (`stages.trimmed_split`)."""
    if pp == 1:
        return [(1, False)]
    layers = request.model.config.num_layers
    core = request.implementation == "megatron-core"

    def option(v: int) -> list[tuple[int, bool]]:
        if layers % (pp * v) == 0:
            return [(v, False)]
        return [(v, True)] if core and trimmed_split(layers, pp, v) else []

    schedule = request.schedule
    if schedule in V_SHAPED:  # two stages a rank, whatever the layers' split
        options = [(2, False)]
    elif request.virtual_stages is not None:
        options = option(request.virtual_stages) or [(request.virtual_stages, False)]
    else:
        interleave = [o for v in range(2, 9) if micro_batches % pp == 0 for o in option(v)]
        first = option(1) or [(1, False)]
        options = first + interleave if schedule in (None, "interleaved-1f1b", "interleaved-zb") else first
    if schedule in SPLIT_BACKWARD:  # what PyTorch's schedule class accepts (DualPipeV: m >= 2P, ...)
        options = [(v, trim) for v, trim in options if not trim and
                   schedule_invalid_reason(schedule, pp, v, micro_batches) is None]
    return options


def expert_options(request: PlanRequest, dp: int, cp: int = 1) -> list[int]:
    """Expert-parallel sizes to try at data-parallel size `dp` and context-parallel size `cp`: the fixed one,
    else every E dividing DP x CP (experts fold over the data x context ranks) and the model's expert count
    (1 for a dense model)."""
    experts = request.model.config.moe_num_experts
    if request.expert is not None:
        return [request.expert]
    return [e for e in _divisors(dp * cp) if experts % e == 0] if experts else [1]


def _layouts(request: PlanRequest, tp: int, pp: int, ep: int = 1, cp: int = 1):
    """Every option of the (PP, TP, EP, CP) layout the request allows."""
    cfg = request.model.config
    dp = request.gpus // (tp * pp * cp)
    per_replica = request.global_batch // dp
    micro_batches = ([request.micro_batch] if request.micro_batch is not None else
                     [m for m in _divisors(per_replica) if m <= request.max_micro_batch])
    # shardlm runs sequence parallelism and selective recomputation for GPT and Llama (not BERT)
    supported = request.implementation == "megatron" or cfg.arch in ("gpt", "llama")
    sp_multiple = tp * (2 * cp if cp > 1 else 1)  # a CP rank's 2L tokens split over TP
    sp_options = _switch(request.sequence_parallel, tp > 1 and cfg.seq_length % sp_multiple == 0 and supported)
    recompute_options = [r for r in request.recompute_options() if r != "selective" or supported] or ["full"]
    full_possible = fsdp_invalid_reason(cfg, dp, pp, cp, request.implementation) is None
    sharding_options = [s for s in request.sharding_options()
                        if s == "none" or (s == "optimizer" and dp * cp > 1) or (s == "full" and full_possible)]
    shardings = [(s, size) for s in sharding_options
                 for size in (shard_size_options(request, tp, dp, cp, ep) if s == "full" else [0])]
    shardings = shardings or [("none", 0)]  # "optimizer" at DP = 1: nothing to shard
    for micro in micro_batches:
        m = per_replica // micro
        if pp > 1 and m < pp and request.schedule != "gpipe":
            continue  # 1F1B needs at least P micro-batches in flight
        for virtual, trim in _virtual_options(request, pp, m):
            schedule = request.schedule or schedule_name(pp, virtual)
            for sp, recompute, (sharding, size) in itertools.product(sp_options, recompute_options, shardings):
                yield Layout(tp=tp, dp=dp, micro_batch=micro, checkpointing=recompute == "full", pp=pp,
                             virtual=virtual, schedule=schedule, sequence_parallel=sp,
                             selective=recompute == "selective", distributed_optimizer=sharding == "optimizer",
                             ep=ep, cp=cp, full_sharding=sharding == "full", fsdp_shard_size=size, end_trim=trim)


def _no_option_reason(request: PlanRequest, pp: int, dp: int) -> str:
    """Why no micro-batch size gives layout (PP, DP) an option: too few micro-batches for P stages, or the
    zero-bubble schedule's own condition at the most micro-batches it could have."""
    if request.schedule in SPLIT_BACKWARD:
        most = request.global_batch // dp // (request.micro_batch or 1)
        virtual = 2 if request.schedule in V_SHAPED else request.virtual_stages or 1
        reason = schedule_invalid_reason(request.schedule, pp, virtual, most)
        if reason:
            return reason
    return f"fewer micro-batches than PP={pp} stages at every micro-batch size"


def plan(request: PlanRequest) -> Plan:
    """Evaluate every PP x TP size whose product divides the GPUs."""
    _check_request(request)
    result = Plan(request)
    evaluator = Evaluator(request)
    pipelines = [request.pipeline] if request.pipeline is not None else _divisors(request.gpus)
    for pp in pipelines:
        if request.gpus % pp:
            raise UserError(f"--pipeline={pp} does not divide --gpus={request.gpus}")
        if pp > 1 and request.model.config.arch == "bert":
            result.skipped["PP>1"] = "pipeline parallelism is planned for GPT and Llama only"
            continue
        for tp, cp in ((t, c) for t in _divisors(request.gpus // pp)
                       for c in context_options(request.model.config, request.gpus // (pp * t), request.context,
                                                request.implementation)):
            dp = request.gpus // (pp * tp * cp)
            context = f"-cp{cp}" if cp > 1 else ""
            reason = invalid_reason(request, tp, pp, cp=cp)
            if reason:
                per_node = request.gpu.gpus_per_node
                repeated = cp > 1 and invalid_reason(request, tp, pp) is not None  # said once, at CP = 1
                if not repeated and (pp == 1 or (pp <= request.model.config.num_layers and per_node % tp == 0)):
                    result.skipped[f"{pp}x{tp}x{dp}{context}"] = reason  # beyond one pipeline size, the instructive
                continue
            for ep in expert_options(request, dp, cp):
                key = f"{pp}x{tp}x{dp}" + (f"x{ep}" if request.model.config.moe_num_experts else "") + context
                reason = invalid_reason(request, tp, pp, ep, cp)
                if reason:
                    result.skipped[key] = reason
                    continue
                choices = [evaluator.choice(layout) for layout in _layouts(request, tp, pp, ep, cp)]
                if not choices:
                    result.skipped[key] = _no_option_reason(request, pp, dp)
                    continue
                fitting = [c for c in choices if c.fits]
                best = (min(fitting, key=lambda c: (c.time.total_s, c.total_bytes)) if fitting
                        else min(choices, key=lambda c: c.total_bytes))
                params = evaluator.rank_params(pp, best.layout.virtual, tp, 0, ep, best.layout.end_trim, False,
                                               best.layout.v_shaped)[1]
                result.rows.append(PlanRow(tp, dp, params, best, pp, ep, cp))
    if not result.rows:
        hint = ""
        cfg = request.model.config
        if request.implementation == "megatron" and cfg.seq_length >= LONG_CONTEXT and cfg.arch in ("gpt", "llama"):
            hint = ("; context parallelism, which splits a long sequence over GPUs, is planned with "
                    "--implementation megatron-core or shardlm")
        raise UserError("no valid PP x TP x DP layout: " + "; ".join(sorted(set(result.skipped.values()))) + hint)
    return result
