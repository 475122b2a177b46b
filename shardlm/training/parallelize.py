"""The parallelize step: this rank's part of the model, made trainable in one fixed order.

The model classes know nothing of pipeline stages, compilation or data parallelism (torchtitan's
lesson). `parallelize(config, ctx, micro_batches)` builds the model and applies, in this order:

  1. **stages** (`parallel.pipeline` > 1): the model is built with only the layers of this rank's
     pipeline stages (`pipeline_layout`), so a rank never holds another stage's layers;
  2. **compile** (`train.compile`): each transformer layer under `torch.compile` (`compile_layers`);
  3. **the pipeline schedule**: the `PipelineRunner` drops the ends (embedding, final norm, output
     layer) this rank's stages do not need and wraps the stages in PyTorch's schedule
     (`shardlm.training.pipeline`);
  4. **data parallelism**, one of:
     - FSDP2 (`train.data_sharding = "full"`): parameters, gradients and moments sharded over DP x CP
       (`shardlm.training.fsdp`), each pipeline stage a root;
     - fp32 master weights (`train.param_dtype = "half"` or `train.distributed_optimizer`): the
       `MasterWeightOptimizer`, split experts in one of their own over expert-DP
       (`shardlm.training.master_weights`);
     - otherwise DDP over DP x CP when there is more than one such rank and no pipeline (split experts
       left to `reduce_expert_gradients`), and AdamW over the parameters.

Layers are compiled before the schedule wraps them, so the stages run the compiled layers; the ends
are dropped before step 4, so FSDP and the optimizers see only the parameters this rank keeps.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models import build_model
from shardlm.models.config import ParallelOptions
from shardlm.parallel import ParallelContext, graph_break
from shardlm.training.gradients import expert_gradient_divisor, is_split_expert
from shardlm.training.optim import build_optimizer

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def can_compile(device: torch.device) -> bool:
    """Whether `torch.compile` can build kernels for `device`: on the CPU Inductor needs a C++ compiler."""
    return device.type != "cpu" or any(shutil.which(c) for c in ("c++", "g++", "clang++"))


def check_can_compile(device: torch.device) -> None:
    """`train.compile` where `can_compile` says no: a one-line error."""
    if not can_compile(device):
        raise UserError("train.compile=true on the CPU needs a C++ compiler (install g++), "
                        "or set train.compile=false")


def inductor_cache_per_cpu_kind() -> None:
    """A run that picks its CPU kernels (`ATEN_CPU_CAPABILITY=avx2`, `default`, ...) gets Inductor caches
    of its own, `<Inductor's folder>-<capability>`, unless `TORCHINDUCTOR_CACHE_DIR` names another folder.
    Inductor vectorizes for that capability, but its on-disk caches are shared with runs of another one, and a
    kernel cached by one fails to build under the other (`'at::vec' has not been declared` under `default`;
    in a multi-rank run the other ranks then wait in a collective until its timeout).
    (Importing TorchDynamo already wrote Inductor's default folder into the variable: that one is replaced.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    default = os.path.abspath(default_cache_dir())
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{capability}"


def compile_layers(model: torch.nn.Module, device: torch.device) -> None:
    """`train.compile`: each transformer layer under `torch.compile`; the embedding, the final norm
    and the fused output layer + loss stay eager."""
    check_can_compile(device)
    if device.type == "cpu":
        inductor_cache_per_cpu_kind()
    graph_break.arm()  # the collectives and other boundaries: graph breaks from the first trace on
    layers = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
    for layer in layers:
        layer.compile()


def _counting_allreduce_hook(state, bucket):
    """DDP communication hook: the default averaging all-reduce, recorded in the comm stats.

    Where the DP group's ranks share a machine and the tensors are on the CPU, the bucket goes through
    shared memory (`shardlm.parallel.shm`): synchronous, so it no longer overlaps the rest of the
    backward as gloo's asynchronous all-reduce does, but several times faster."""
    dp = state
    buffer = bucket.buffer()
    dp.stats.record("all_reduce", dp.name, buffer)
    buffer.div_(dp.size)
    if dp.shm is not None:  # only CPU communicators have one
        future = torch.futures.Future()
        future.set_result(dp.shm.all_reduce(buffer))
        return future
    future = dist.all_reduce(buffer, group=dp.group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


@dataclass
class Parallelized:
    """What `parallelize` hands the trainer: this rank's model and how its gradients and update run.

    `pipeline` is the `PipelineRunner` under pipeline stages (else None); exactly one of `fsdp` (FSDP2's
    sharded AdamW), `master` (the fp32 master-weight optimizer) and `ddp` (DDP over DP x CP, when there is
    more than one such rank and no pipeline) may be set; `optimizer` is the one to step; `params` the
    trainable parameters this rank holds."""

    model: torch.nn.Module
    pipeline: object | None
    params: list[torch.nn.Parameter]
    optimizer: object
    ddp: DistributedDataParallel | None = None
    master: object | None = None
    fsdp: object | None = None


def parallelize(config: RunConfig, ctx: ParallelContext, micro_batches: int) -> Parallelized:
    """Build this rank's part of `config.model` over `ctx` and apply stages, compile, the pipeline
    schedule and data parallelism in the module docstring's order. `micro_batches`: micro-batches per
    step on this rank (the schedule's length). Collective over the groups the chosen wrappers use."""
    t, p = config.train, config.parallel
    layers, stage_ids = None, None
    if ctx.pp_size > 1:  # 1. this rank builds only the layers of its pipeline stages
        from shardlm.training.pipeline import PipelineRunner, pipeline_layout

        layers, stage_ids = pipeline_layout(config, ctx)
    options = ParallelOptions(expert_dispatcher=p.expert_dispatcher, context_exchange=p.cp_comm,
                              lm_head_fp32=t.cast_lm_head_to_fp32)
    finish_layer = None
    if config.lora.rank and config.lora.quantize:  # QLoRA: each layer in NF4 as soon as it is built
        from shardlm.lora.apply import quantize_base

        def finish_layer(layer):
            quantize_base(layer, ctx)
    model = build_model(config.model, ctx, seed=t.seed, recompute=t.recompute, sequence_parallel=p.sequence_parallel,
                        layer_ids=None if layers is None else [i for s in stage_ids for i in layers[s]],
                        options=options, finish_layer=finish_layer)
    if config.reward.loss:  # a reward model: the score head in place of the language-model head
        from shardlm.reward.head import add_score_head

        add_score_head(model, t.seed)
    if config.lora.rank:  # adapters on the targeted projections, the rest frozen (`shardlm.lora`)
        from shardlm.lora import add_adapters
        from shardlm.lora.apply import quantize_base

        add_adapters(model, config.lora, ctx, t.seed)
        if t.precision in HALF and not config.lora.quantize:  # the frozen GEMM weights in half, as autocast would
            from shardlm.lora.apply import store_base_in  # cast them: bitwise the same step, less memory

            store_base_in(model, HALF[t.precision])
        if config.lora.quantize:  # QLoRA: anything not yet in NF4 (the layers are); loading a base re-quantizes each
            quantize_base(model, ctx)
            if t.recompute != "full":  # (full recomputation saves only each layer's input anyway)
                from shardlm.lora.nf4 import dequantize_again

                for layer in [*model.layers.values(), *(depth.block for depth in getattr(model, "mtp", None) or ())]:
                    dequantize_again(layer)  # the layers and the multi-token-prediction depths' blocks
    if config.model.index_topk and config.model.index_stage == "warmup":  # DeepSeek's dense warm-up: the indexers
        from shardlm.training.indexer import freeze_for_warmup  # alone train

        freeze_for_warmup(model)
    if t.compile:  # 2.
        compile_layers(model, ctx.device)
    pipeline = None
    if ctx.pp_size > 1:  # 3. drops the ends this rank's stages do not need, before the optimizer sees them
        pipeline = PipelineRunner(model, ctx, layers, stage_ids, p.pipeline_schedule, micro_batches)
    # 4. data parallelism
    if t.data_sharding == "full":
        return _fully_sharded(config, ctx, model, pipeline)
    if t.param_dtype == "half" or t.distributed_optimizer:
        return _master_weights(config, ctx, model, pipeline)
    return _replicated(config, ctx, model, pipeline)


def _fully_sharded(config: RunConfig, ctx: ParallelContext, model, pipeline) -> Parallelized:
    """FSDP2: parameters, gradients and moments sharded over DP (`shardlm.training.fsdp`)."""
    from shardlm.training.fsdp import FullyShardedAdamW, shard_model

    t = config.train
    shard_group = shard_model(model, ctx, t.fsdp_reshard_after_forward,
                              HALF[t.precision] if t.param_dtype == "half" else None,
                              stages=None if pipeline is None else pipeline.stage_modules,
                              shard_size=t.fsdp_shard_size)
    params = [p for p in model.parameters() if p.requires_grad]
    inner = None
    if t.optimizer == "muon":  # each matrix's rows gathered over DP for its orthogonalization (`shardlm.training.muon`)
        from shardlm.training.muon import build_muon

        inner = build_muon(model, ctx, config, shard_group)
    fsdp = FullyShardedAdamW(model, ctx, t.lr, t.weight_decay, (t.adam_beta1, t.adam_beta2), t.adam_eps,
                             shard_group, inner)
    return Parallelized(model, pipeline, params, fsdp, fsdp=fsdp)


def _master_weights(config: RunConfig, ctx: ParallelContext, model, pipeline) -> Parallelized:
    """fp32 master weights (and the distributed optimizer): split experts in their own optimizer, reduced
    and sharded over expert-DP and divided by DP x C; with Muon, its matrices in their own optimizers too
    (`shardlm.training.master_weights`, `shardlm.training.muon`)."""
    from shardlm.training.master_weights import JointMasterOptimizer, MasterWeightOptimizer
    from shardlm.training.muon import MuonSettings, is_muon_matrix

    t = config.train
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = HALF[t.precision] if t.param_dtype == "half" else torch.float32
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    args = (ctx, t.lr, t.weight_decay, (t.adam_beta1, t.adam_beta2), t.adam_eps, dtype)
    muon = MuonSettings.of(config) if t.optimizer == "muon" else None
    parts = []
    for expert in (False, True):
        mine = [(n, p) for n, p in named if is_split_expert(p, ctx) == expert]
        split = {"dp": ctx.expert_dp, "grad_divisor": expert_gradient_divisor(ctx)} if expert else {}
        matrices = [(n, p) for n, p in mine if muon is not None and is_muon_matrix(n, p)]
        rest = [(n, p) for n, p in mine if not (muon is not None and is_muon_matrix(n, p))]
        if rest or not expert:  # the dense AdamW part always (its groups carry the step's learning rate)
            parts.append(MasterWeightOptimizer(rest, *args, shard=t.distributed_optimizer, **split))
        if matrices:
            parts.append(MasterWeightOptimizer(matrices, *args, shard=t.distributed_optimizer, muon=muon, **split))
    master = parts[0] if len(parts) == 1 else JointMasterOptimizer(parts)
    return Parallelized(model, pipeline, params, master, master=master)


def _replicated(config: RunConfig, ctx: ParallelContext, model, pipeline) -> Parallelized:
    """Replicated parameters: DDP over DP x CP (`dp_cp` is `dp` when C = 1) without pipeline stages, the
    split experts left out of it (`reduce_expert_gradients` reduces them); AdamW over the parameters."""
    t = config.train
    params = [p for p in model.parameters() if p.requires_grad]
    ddp = None
    if ctx.dp_cp.size > 1 and pipeline is None:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, p in model.named_parameters() if is_split_expert(p, ctx)])
        ddp = DistributedDataParallel(model, process_group=ctx.dp_cp.group, gradient_as_bucket_view=True)
        ddp.register_comm_hook(ctx.dp_cp, _counting_allreduce_hook)
    if t.optimizer == "muon":  # Muon for the layers' matrices (orthogonalized whole over TP), AdamW for the rest
        from shardlm.training.muon import build_muon

        optimizer = build_muon(model, ctx, config)
    else:
        optimizer = build_optimizer(model, t.lr, t.weight_decay, (t.adam_beta1, t.adam_beta2), t.adam_eps,
                                    ctx.device)
    return Parallelized(model, pipeline, params, optimizer, ddp=ddp)
