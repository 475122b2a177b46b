"""Put adapters on a model and freeze its base: `add_adapters(model, config, ctx, seed)`.

Targets are the attention and MLP projections of the transformer layers, named by shardlm's module name or by
Hugging Face's (`ALIASES`); "all-linear" is every one of them. The router, the embedding and the output layer
never get an adapter; `modules_to_save` trains whole modules (the embedding, the output layer, the final norm)
beside the adapters, as peft's option of that name does. Everything else is frozen: no gradient, so no optimizer
state, no master copy and no gradient reduction for it. Bad targets are one-line `UserError`s, raised before any
adapter is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardlm.config import LoraConfig
from shardlm.errors import UserError
from shardlm.lora.adapter import LoRA
from shardlm.lora.nf4 import logical
from shardlm.models.llama import KeyValueProjection
from shardlm.parallel import ColumnParallelLinear, ParallelContext, ReplicatedLinear, RowParallelLinear
from shardlm.parallel.init import param_seed

# Hugging Face (and peft's usual target) names -> shardlm's module names
ALIASES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
           "down_proj": "down", "c_attn": "qkv", "c_proj": "proj", "c_fc": "fc", "q_a_proj": "q_a", "q_b_proj": "q_b",
           "kv_a_proj_with_mqa": "kv_a", "kv_b_proj": "kv_b", "o_a_proj": "o_a", "o_b_proj": "o_b", "out_proj": "out"}
PROJECTIONS = ("q", "k", "v", "o", "qkv", "proj", "fc", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b", "o_a",
               "o_b", "out")
"""Projection names an adapter can target; o_a and o_b are DeepSeek-V4's grouped output projection and its mix, out
a Mamba-2 layer's output projection (Nemotron-H; its module is `mixer.o`, `target_of`)."""
SAVED_MODULES = {"embedding": ("wte",), "embed_tokens": ("wte",), "output": ("lm_head",), "lm_head": ("lm_head",),
                 "norm": ("ln_f",)}


@dataclass
class AdapterCount:
    """What a LoRA run trains, over the whole model (every TP shard and stage counted once): `trainable` and
    `total` parameters, and the bytes of AdamW state (two fp32 moments) the frozen base does not need."""

    trainable: int
    total: int

    @property
    def saved_optimizer_bytes(self) -> int:
        return 8 * (self.total - self.trainable)

    def describe(self) -> str:
        return (f"lora: training {self.trainable:,} of {self.total:,} parameters ({self.trainable / self.total:.3%}); "
                f"the frozen base needs no optimizer state ({self.saved_optimizer_bytes / 2**20:,.1f} MiB of AdamW "
                "moments not kept)")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's factor (`...q.lora.A`), not the base's."""
    return ".lora." in name


def target_names(config: LoraConfig) -> set[str]:
    """shardlm's projection names that `config.targets` asks for ("experts" for a MoE layer's experts); UserError
    for a name that is no projection."""
    names = set()
    for target in config.targets:
        if target in ("all-linear", "all_linear"):
            names |= set(PROJECTIONS)
            continue
        name = ALIASES.get(target, target)
        if name == "experts":
            names.add(name)
            continue
        if name not in PROJECTIONS:
            raise UserError(f"lora.targets names {target!r}, which is no projection; use \"all-linear\", \"experts\" "
                            f"or some of {', '.join(PROJECTIONS)} (or their Hugging Face names {', '.join(ALIASES)})")
        names.add(name)
    return names


def check_lora(config: LoraConfig) -> None:
    """The [lora] keys' own values (one line each); the model's modules are checked by `add_adapters`."""
    if config.rank < 0:
        raise UserError(f"lora.rank={config.rank} must be at least 1 (or 0: no adapters)")
    if not 0 <= config.dropout < 1:
        raise UserError(f"lora.dropout={config.dropout} must be in [0, 1)")
    if config.alpha <= 0:
        raise UserError(f"lora.alpha={config.alpha} must be positive")
    if not config.targets:
        raise UserError('lora.targets is empty; name the projections to adapt, e.g. ["all-linear"]')
    if config.quantize not in ("", "nf4"):
        raise UserError(f'lora.quantize="{config.quantize}" must be "nf4" (QLoRA) or empty')
    wanted = target_names(config)
    layers = config.expert_layers
    if layers and (not all(isinstance(i, int) and i >= 0 for i in layers) or len(set(layers)) < len(layers)):
        raise UserError(f"lora.expert_layers={layers} must list distinct layer indices from 0")
    if layers and "experts" not in wanted:
        raise UserError(f'lora.expert_layers={layers} names layers whose experts to adapt; add "experts" to '
                        "lora.targets (or leave expert_layers empty)")
    for name in config.modules_to_save:
        if name not in SAVED_MODULES:
            raise UserError(f"lora.modules_to_save names {name!r}; use some of {', '.join(SAVED_MODULES)}")


def _kind(module: nn.Module) -> str:
    if isinstance(module, RowParallelLinear):
        return "row"
    if isinstance(module, ReplicatedLinear):
        return "replicated"
    if isinstance(module, KeyValueProjection) and not module.split:
        return "replicated rows"
    return "column"


def _shape(module: nn.Module, ctx: ParallelContext) -> tuple[int, int]:
    """(in, out) full sizes of a projection."""
    if isinstance(module, KeyValueProjection):
        weight = logical(module)
        return weight.shape[1], weight.shape[0] * (ctx.tp_size if module.split else 1)
    if isinstance(module, ReplicatedLinear):
        return logical(module).shape[1], logical(module).shape[0]
    return module.in_features, module.out_features


def target_of(name: str, module: nn.Module) -> str:
    """The lora.targets name of projection `module` called `name`: its own name, or the one it was given
    (`lora_target`: a Mamba-2 layer's output projection `mixer.o` is "out", transformers' out_proj)."""
    return getattr(module, "lora_target", name.rsplit(".", 1)[-1])


def adaptable(model: nn.Module, within_layers: bool = True) -> dict[str, nn.Module]:
    """{name: projection} of every module of the transformer layers an adapter can go on (`within_layers` False:
    of `model`, one transformer layer, itself)."""
    kinds = (ColumnParallelLinear, RowParallelLinear, KeyValueProjection, ReplicatedLinear)
    return {name: module for name, module in model.named_modules()
            if (name.startswith("layers.") or not within_layers) and isinstance(module, kinds)
            and target_of(name, module) in PROJECTIONS}


def quantized_projections(model: nn.Module) -> dict[str, nn.Module]:
    """{name: projection} whose weight QLoRA stores in NF4: every projection an adapter could go on in the transformer
    layers and in the multi-token-prediction depths (`mtp.`, which take no adapters), or in `model` itself when it is
    one transformer layer."""
    every = adaptable(model, within_layers=False)
    if not hasattr(model, "layers"):
        return every
    return {name: module for name, module in every.items() if name.startswith(("layers.", "mtp."))}


def add_adapters(model: nn.Module, config: LoraConfig, ctx: ParallelContext, seed: int) -> dict[str, LoRA]:
    """Give every targeted projection of `model` (this rank's layers) an adapter seeded from its full name, and
    freeze every other parameter except `modules_to_save`'s and a reward model's score head (`shardlm.reward.head`;
    peft's SEQ_CLS task trains it whole). Returns {projection name: adapter}."""
    check_lora(config)
    wanted = target_names(config)
    candidates = adaptable(model)
    found = {target_of(name, module) for name, module in candidates.items()}
    missing = sorted(wanted - found - {"experts"}) if not {"all-linear", "all_linear"} & set(config.targets) else []
    if missing and candidates:  # a rank without layers (none on this stage) cannot tell
        raise UserError(f"lora.targets names {', '.join(missing)}, which this model does not have; its projections "
                        f"are {', '.join(sorted(found))}")
    adapters = {}
    if "experts" in wanted:  # a MoE layer's experts: one adapter per expert and projection (`shardlm.lora.experts`)
        from shardlm.lora.experts import ExpertLoRA
        from shardlm.models.moe import GroupedExperts

        cfg = model.cfg
        wrong = [i for i in config.expert_layers if not (i < cfg.num_layers and cfg.is_moe_layer(i))]
        if wrong:
            moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
            raise UserError(f"lora.expert_layers names layers {wrong}, which have no experts; this model's MoE layers "
                            f"are {moe}")
        layers = set(config.expert_layers or range(cfg.num_layers))
        for name, module in model.named_modules():
            if name.startswith("layers.") and isinstance(module, GroupedExperts) and int(name.split(".")[1]) in layers:
                module.lora = ExpertLoRA(module.gated, cfg.hidden_size, cfg.moe_ffn_size, cfg.moe_num_experts,
                                         config.rank, config.alpha, config.dropout, config.rslora, ctx, seed,
                                         name.rsplit(".experts", 1)[0],
                                         dtype=logical(module, expert_weights(module)[0]).dtype)
                adapters[name] = module.lora
    for name, module in candidates.items():
        if target_of(name, module) not in wanted:
            continue
        features = _shape(module, ctx)
        module.lora = LoRA(_kind(module), *features, config.rank, config.alpha, config.dropout, config.rslora, ctx,
                           param_seed(seed, f"{name}.lora"), dtype=logical(module).dtype,
                           partial=getattr(logical(module), "sequence_parallel", False))
        adapters[name] = module.lora
    trained = {id(p) for a in adapters.values() for p in a.parameters()}
    if getattr(model, "score", None) is not None:  # a reward model's head trains whole (peft's SEQ_CLS task)
        trained |= {id(p) for p in model.score.parameters()}
    for saved in config.modules_to_save:
        for attribute in SAVED_MODULES[saved]:
            module = getattr(model, attribute, None)
            if isinstance(module, nn.Module):
                trained |= {id(p) for p in module.parameters()}
    for param in model.parameters():
        if id(param) not in trained:
            param.requires_grad_(False)
            param.frozen_base = True  # FSDP still shards it (`shardlm.training.fsdp`)
    return adapters


def count_parameters(model: nn.Module, ctx: ParallelContext) -> AdapterCount:
    """`AdapterCount` of the whole model (the vocabulary's padding left out), before any FSDP sharding: each rank
    counts what it holds, TP shards whole and replicated parameters on TP rank 0 only, each stage's on DP x CP
    rank 0 (split experts on expert-DP rank 0, i.e. every EP rank once), the last stage's copy of a tied
    embedding not at all (one all-reduce over the world)."""
    from shardlm.lora.nf4 import quantized, stored_name

    local = torch.zeros(2, dtype=torch.float64)
    vocab = model.cfg.vocab_size
    nf4 = quantized(model)
    for name, param in model.named_parameters():
        if name != stored_name(name):  # an NF4 weight: its logical shape and marks, once
            if stored_name(name) is None:
                continue
            weight = nf4[stored_name(name)]
            param = torch.nn.Parameter(torch.empty(weight.shape, device="meta"), requires_grad=False)
            for mark, value in weight.marks.items():
                setattr(param, mark, value)
        whole_here = hasattr(param, "tensor_parallel_dim") or ctx.tp_rank == 0
        if getattr(param, "pipeline_tied_copy", False) or not whole_here:
            continue
        split_expert = ctx.ep_size > 1 and getattr(param, "expert_parallel", False)
        if (ctx.expert_dp if split_expert else ctx.dp_cp).rank == 0:
            count = param.numel()
            if name in ("wte.weight", "lm_head.weight"):  # the real vocabulary's rows, not the padding's
                rows = param.shape[0]
                count = max(0, min(rows, vocab - ctx.tp_rank * rows)) * param.shape[1]
            local += torch.tensor([count if param.requires_grad else 0, count], dtype=torch.float64)
    local = local.to(ctx.device)
    ctx.world.all_reduce(local)
    return AdapterCount(int(local[0]), int(local[1]))


def quantize_base(model: nn.Module, ctx: ParallelContext) -> int:
    """QLoRA: store the weight of every projection of the transformer layers and multi-token-prediction depths
    (targeted or not, `quantized_projections`) and every MoE expert's matrices in NF4 (`shardlm.lora.nf4`), each
    quantized whole; not the embedding, the output layer, the router or a depth's own eh_proj (e_proj, h_proj).
    Weights already in NF4 stay as they are. Returns the bytes this rank keeps. Collective over TP (split weights are
    gathered to be quantized whole), in the same order on every rank of a stage. `model` may be one transformer
    layer (`quantize_layer`)."""
    from torch.nn.utils import parametrize

    from shardlm.lora.nf4 import quantize_weight, stored_bytes

    total = 0
    for module, name in base_weights(model):
        if not parametrize.is_parametrized(module, name):
            quantize_weight(module, name, ctx)
        total += stored_bytes(module, name)
    return total


def base_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of the base's GEMM weights that QLoRA stores in NF4 and LoRA under autocast in half
    (`store_base_in`): the weight of every `quantized_projections` projection and every MoE expert's stacks."""
    from shardlm.models.moe import GroupedExperts

    weights = [(module, "weight") for module in quantized_projections(model).values()]
    return weights + [(module, name) for module in model.modules() if isinstance(module, GroupedExperts)
                      for name in expert_weights(module)]


@torch.no_grad()
def store_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """LoRA under autocast (bf16 or fp16, with fp32 or half parameters): every frozen weight of `base_weights` stored
    in `dtype`, the autocast dtype. Only GEMMs read them, and autocast would cast each to `dtype` for each GEMM: these
    are the values it would give, so the step is the same bit for bit, without the fp32 copy and without the half
    copy each GEMM saved for the backward (it saves the parameter itself); `describe_half_base` says what it
    keeps."""
    for module, name in base_weights(model):
        param = getattr(module, name)
        if not param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)


def describe_half_base(model: nn.Module) -> str:
    """One line for the log of a LoRA run under autocast: what this rank's half projection weights take."""
    weights = [getattr(module, name) for module, name in base_weights(model)]
    values = sum(w.numel() for w in weights)
    half = sum(w.numel() * w.element_size() for w in weights)
    return (f"lora: {len(weights)} frozen projection weights of this rank in {weights[0].dtype if weights else 'half'}"
            f": {half / 2**20:,.2f} MiB instead of {4 * values / 2**20:,.2f} MiB in fp32").replace("torch.", "")


def expert_weights(experts: nn.Module) -> tuple[str, ...]:
    """The names of a `GroupedExperts`' weight stacks."""
    return ("gate", "up", "down") if experts.gated else ("fc", "proj")
