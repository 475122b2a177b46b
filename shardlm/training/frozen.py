"""A frozen model at the run's layout: a Hugging Face directory or shardlm checkpoint built with the run's TP split
of heads and vocabulary, its experts over EP, its layers over the run's pipeline stages, in eval mode, with no
gradient and no optimizer state; under FSDP sharded over the run's data-parallel mesh. What a distillation teacher
(`shardlm.distill.teacher`) and an RL run's reward model (`shardlm.rl.reward_model`) are.

Under pipeline stages a rank's frozen model holds its stages' layers and end pieces only (`pipeline.keep_stages`),
and `FrozenStages` tells the sampler's stage-by-stage forward (`shardlm.rl.rollout.InProcessGenerator`) how to run
them. Under FSDP (`train.data_sharding = "full"`) each DP rank holds 1/DP of each tensor (`shard_frozen`): a layer's
forward gathers that layer and frees it after, and the root (embedding, final norm, output layer or score head)
stays gathered from the forward until `release` frees it. Its all-gathers are collectives: every DP rank must run
it as often as the others."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.errors import UserError


def load_frozen(config, ctx, source, setting: str, bf16: bool = False, score_head: bool = False) -> torch.nn.Module:
    """The model of `source` (`shardlm.checkpoint.init.open_source`'s, named by the config key `setting` in errors)
    at `ctx`'s layout: built with the run's sequence length and sequence parallelism, its layers over the run's
    pipeline stages, its weights read (every rank its shard), frozen, in bf16 when `bf16`, with a reward model's score
    head when `score_head`, and under FSDP sharded over the data-parallel mesh (`shard_frozen`). Collective over the
    ranks that read shards (and under FSDP over the DP group)."""
    from shardlm.checkpoint import files
    from shardlm.checkpoint.init import MappedReader
    from shardlm.checkpoint.sharded import model_files
    from shardlm.checkpoint.state import load_weights
    from shardlm.models import build_model
    from shardlm.models.gemma_config import hidden_only_split_problem
    from shardlm.parallel.pipeline import V_SHAPED, keep_stages, local_stages, stage_layers, stages_per_rank

    model_config = source.config.model
    model_config.seq_length = config.model.seq_length
    model_config.dropout = 0.0
    if source.meta is not None:
        names = [name for row in model_files(source.meta) for name in row]
        files.verify(source.path, source.meta, names, world=ctx.world, device=ctx.device)
    layers = stage_ids = None
    if ctx.pp_size > 1:  # the model's layers over the same stages
        p = config.parallel
        per_rank = stages_per_rank(p.pipeline_schedule, p.virtual_stages)
        if model_config.num_layers < ctx.pp_size * per_rank:
            raise UserError(f"{setting} has {model_config.num_layers} layers, fewer than the run's "
                            f"{ctx.pp_size * per_rank} pipeline stages")
        layers = stage_layers(model_config.num_layers, ctx.pp_size * per_rank, 0, 0)
        if (problem := hidden_only_split_problem(model_config, layers)) is not None:  # Gemma 4's shared keys
            raise UserError(f"{setting}: {problem}")
        stage_ids = local_stages(ctx, per_rank, p.pipeline_schedule in V_SHAPED)
    model = build_model(model_config, ctx, seed=config.train.seed,
                        sequence_parallel=config.parallel.sequence_parallel,
                        layer_ids=None if layers is None else [i for s in stage_ids for i in layers[s]])
    if score_head:
        from shardlm.reward.head import add_score_head

        add_score_head(model, config.train.seed)
    if layers is not None:  # this rank's stages' end pieces only (the first's embedding, the last's norm and head)
        keep_stages(model, layers, stage_ids)
    model.stage_layers = layers
    model.v_shaped = ctx.pp_size > 1 and config.parallel.pipeline_schedule in V_SHAPED
    if isinstance(source.reader, MappedReader):
        source.reader.expect(model, ctx.tp_size)
    load_weights(model, source.reader, ctx)
    for param in model.parameters():
        param.requires_grad_(False)
    if bf16:
        model.to(torch.bfloat16)
    if config.train.data_sharding == "full":
        shard_frozen(model, ctx, config.train.fsdp_shard_size)
    return model.eval()


def shard_frozen(model: torch.nn.Module, ctx, shard_size: int = 0) -> None:
    """FSDP2 (`fully_shard`) of a frozen model over the run's data-parallel mesh
    (`shardlm.training.fsdp.data_parallel_mesh`, hybrid with `shard_size`), in place: each layer one unit that
    gathers its parameters for its forward and frees them after (reshard_after_forward), split experts their own
    unit over expert-DP, then the root (embedding, final norm, output layer or score head), kept gathered after the
    forward until `release`. Every (TP-local) parameter becomes a DTensor of the same shape of which this rank
    keeps rows `torch.chunk(p, DP)[r]`; no parameter needs a gradient, so FSDP reduces nothing and no optimizer
    sees them.
    Under pipeline stages (this rank's layers only) the stage-by-stage forwards (`shardlm.distill.teacher.
    pipelined_hidden`, the sampler's) call the pieces one by one, never the model's forward: they set the root up
    and gather it themselves (`training.fsdp.gather_root`)."""
    from torch.distributed.fsdp import fully_shard

    from shardlm.training.fsdp import PARAM_ATTRIBUTES, data_parallel_mesh, expert_data_parallel_mesh

    marks = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)}
             for name, p in model.named_parameters()}
    mesh, _ = data_parallel_mesh(ctx, shard_size)
    expert_mesh = expert_data_parallel_mesh(ctx) if ctx.ep_size > 1 else None
    layers = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
    for layer in layers:
        block = layer.mlp if hasattr(layer, "mlp") else getattr(layer, "mixer", None)
        experts = getattr(block, "experts", None)
        if experts is not None and expert_mesh is not None:  # different experts on the DP ranks of one EP group
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=True)
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model.shards = mesh.shape[-1]  # the ranks one shard group spans (hybrid: a row of the mesh)
    for name, param in model.named_parameters():
        for attribute, value in marks[name].items():
            setattr(param, attribute, value)


def release(model: torch.nn.Module) -> None:
    """Free a sharded frozen model's gathered root (embedding, final norm, output layer or score head) once its
    output has been used: back to this rank's shards. Nothing for a model that FSDP does not shard."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def local_bytes(param: torch.Tensor) -> int:
    """The bytes of `param` this rank holds: its local shard's for an FSDP DTensor, all of them otherwise."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


@dataclass
class FrozenStages:
    """What the sampler (`shardlm.rl.rollout.InProcessGenerator`) reads of a pipeline runner, for a frozen model's
    own stages (a teacher's seq_kd sampling, a reward model's scoring): each stage's layer ids, the FSDP roots its
    forwards gather, the stage order, and whether (and which pipeline rank) runs the last stage."""

    layers: list
    stage_modules: list
    v_shaped: bool
    has_last: bool
    last_rank: int

    @classmethod
    def of(cls, model, ctx) -> FrozenStages:
        from shardlm.parallel.pipeline import stage_owner

        count = len(model.stage_layers)
        last = stage_owner(count - 1, ctx.pp_size, count, model.v_shaped)
        return cls(model.stage_layers, [model], model.v_shaped, last == ctx.pp_rank, last)
