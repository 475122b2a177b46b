"""The frozen teacher: a Hugging Face directory or shardlm checkpoint built at the run's layout (its own TP split of
heads and vocabulary, its experts over EP), in eval mode, with no gradient and no optimizer state.

Under pipeline stages a rank's teacher holds its stages' layers and end pieces only (`pipeline.keep_stages`, as the
student's). Under FSDP (`train.data_sharding = "full"`) the teacher is sharded as the student is, over the same
data-parallel mesh (`shard_teacher`): each DP rank holds 1/DP of each of its tensors, a layer's forward gathers that
layer and frees it after, and the root (embedding, final norm, output layer) stays gathered from the teacher's
forward until the loss has used its output layer (`release_teacher`); under pipeline stages the root is gathered
where a rank runs the first or the last stage, before the step's pipelined pass (`pipelined_hidden`), and freed
after the step's schedule. Its all-gathers are collectives: the teacher runs exactly once per student forward
(`DistillLoss.__call__`; under pipeline stages once per micro-batch before the schedule, `DistillLoss.teacher_pass`,
the same stages on the DP ranks of a stage), and the student's FSDP forward already runs in lockstep over the DP
ranks (the same micro-batch count on every rank, on-policy steps included: sampling is the student's, in lockstep),
so the teacher's does too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.errors import UserError


def open_teacher(path: str):
    """`shardlm.checkpoint.init.open_source` of the teacher, its errors naming `distill.teacher`."""
    from shardlm.checkpoint.init import open_source

    try:
        return open_source(path)
    except UserError as error:
        raise UserError(str(error).replace("checkpoint.init_from", "distill.teacher")) from None


def load_teacher(config, ctx) -> torch.nn.Module:
    """The teacher of `config.distill` at `ctx`'s layout: built with the student's sequence length and sequence
    parallelism, its weights read (every rank its shard), frozen, and under FSDP sharded over the data-parallel
    mesh (`shard_teacher`). Collective over the ranks that read shards (and under FSDP over the DP group)."""
    from shardlm.checkpoint import files
    from shardlm.checkpoint.init import MappedReader
    from shardlm.checkpoint.sharded import model_files
    from shardlm.checkpoint.state import load_weights
    from shardlm.models import build_model
    from shardlm.models.gemma_config import hidden_only_split_problem
    from shardlm.parallel.pipeline import V_SHAPED, keep_stages, local_stages, stage_layers, stages_per_rank

    source = open_teacher(config.distill.teacher)
    model_config = source.config.model
    model_config.seq_length = config.model.seq_length
    model_config.dropout = 0.0
    if source.meta is not None:
        names = [name for row in model_files(source.meta) for name in row]
        files.verify(source.path, source.meta, names, world=ctx.world, device=ctx.device)
    layers = stage_ids = None
    if ctx.pp_size > 1:  # the teacher's layers over the same stages (`pipelined_hidden`)
        p = config.parallel
        per_rank = stages_per_rank(p.pipeline_schedule, p.virtual_stages)
        if model_config.num_layers < ctx.pp_size * per_rank:
            raise UserError(f"distill.teacher has {model_config.num_layers} layers, fewer than the run's "
                            f"{ctx.pp_size * per_rank} pipeline stages")
        layers = stage_layers(model_config.num_layers, ctx.pp_size * per_rank, 0, 0)
        if (problem := hidden_only_split_problem(model_config, layers)) is not None:  # Gemma 4's shared keys
            raise UserError(f"distill.teacher: {problem}")
        stage_ids = local_stages(ctx, per_rank, p.pipeline_schedule in V_SHAPED)
    teacher = build_model(model_config, ctx, seed=config.train.seed,
                          sequence_parallel=config.parallel.sequence_parallel,
                          layer_ids=None if layers is None else [i for s in stage_ids for i in layers[s]])
    if layers is not None:  # this rank's stages' end pieces only (the first's embedding, the last's norm and head)
        keep_stages(teacher, layers, stage_ids)
    teacher.stage_layers = layers
    teacher.v_shaped = ctx.pp_size > 1 and config.parallel.pipeline_schedule in V_SHAPED
    if isinstance(source.reader, MappedReader):
        source.reader.expect(teacher, ctx.tp_size)
    load_weights(teacher, source.reader, ctx)
    for param in teacher.parameters():
        param.requires_grad_(False)
    if config.distill.teacher_dtype == "bf16":
        teacher.to(torch.bfloat16)
    if config.train.data_sharding == "full":
        shard_teacher(teacher, ctx, config.train.fsdp_shard_size)
    return teacher.eval()


def shard_teacher(teacher: torch.nn.Module, ctx, shard_size: int = 0) -> None:
    """FSDP2 (`fully_shard`) of the frozen teacher over the student's data-parallel mesh
    (`shardlm.training.fsdp.data_parallel_mesh`, hybrid with `shard_size`), in place: each layer one unit that
    gathers its parameters for its forward and frees them after (reshard_after_forward), split experts their own
    unit over expert-DP, then the root (embedding, final norm, output layer), kept gathered after the forward until
    `release_teacher`. Every (TP-local) parameter becomes a DTensor of the same shape of which this rank keeps rows
    `torch.chunk(p, DP)[r]`; no parameter needs a gradient, so FSDP reduces nothing and no optimizer sees them.
    Under pipeline stages (this rank's layers only) `pipelined_hidden` calls the pieces one by one, never the
    teacher's forward: it sets the root up and gathers it itself (`training.fsdp.gather_root`)."""
    from torch.distributed.fsdp import fully_shard

    from shardlm.training.fsdp import PARAM_ATTRIBUTES, data_parallel_mesh, expert_data_parallel_mesh

    marks = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)}
             for name, p in teacher.named_parameters()}
    mesh, _ = data_parallel_mesh(ctx, shard_size)
    expert_mesh = expert_data_parallel_mesh(ctx) if ctx.ep_size > 1 else None
    layers = teacher.layers.values() if isinstance(teacher.layers, torch.nn.ModuleDict) else teacher.layers
    for layer in layers:
        block = layer.mlp if hasattr(layer, "mlp") else getattr(layer, "mixer", None)
        experts = getattr(block, "experts", None)
        if experts is not None and expert_mesh is not None:  # different experts on the DP ranks of one EP group
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=True)
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=False)
    teacher.shards = mesh.shape[-1]  # the ranks one shard group spans (hybrid: a row of the mesh)
    for name, param in teacher.named_parameters():
        for attribute, value in marks[name].items():
            setattr(param, attribute, value)


def release_teacher(teacher: torch.nn.Module) -> None:
    """Free a sharded teacher's gathered root (embedding, final norm, output layer) once the loss has used its
    output layer: back to this rank's shards. Nothing for a teacher that FSDP does not shard."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(teacher, FSDPModule):
        teacher.reshard()


def local_bytes(param: torch.Tensor) -> int:
    """The bytes of `param` this rank holds: its local shard's for an FSDP DTensor, all of them otherwise."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


def describe_teacher(teacher: torch.nn.Module, path: str) -> str:
    """One line for the run's log: the teacher and what its weights take on this rank (under FSDP its shards:
    1/DP of the whole, `local_bytes`)."""
    m = teacher.cfg
    held = sum(local_bytes(p) for p in teacher.parameters())
    sharded = ""
    if hasattr(teacher, "shards"):
        sharded = f" (its FSDP shards: 1/{teacher.shards} of the teacher)"
    return (f"distill: teacher {path} ({m.arch}, {m.num_layers} layers, hidden {m.hidden_size}, vocabulary "
            f"{m.vocab_size}): {held / 2**20:,.1f} MiB of frozen weights on this rank{sharded}, no gradient, no "
            "optimizer state")


@dataclass
class TeacherStages:
    """What the sampler (`shardlm.rl.rollout.InProcessGenerator`) reads of a pipeline runner, for the teacher's own
    stages (seq_kd under pipeline stages): each stage's layer ids, the FSDP roots its decoding gathers, the stage
    order, and whether (and which pipeline rank) runs the last stage."""

    layers: list
    stage_modules: list
    v_shaped: bool
    has_last: bool
    last_rank: int

    @classmethod
    def of(cls, teacher, ctx) -> TeacherStages:
        from shardlm.parallel.pipeline import stage_owner

        count = len(teacher.stage_layers)
        last = stage_owner(count - 1, ctx.pp_size, count, teacher.v_shaped)
        return cls(teacher.stage_layers, [teacher], teacher.v_shaped, last == ctx.pp_rank, last)


def pipelined_hidden(teacher, inputs: torch.Tensor, documents, ctx) -> torch.Tensor | None:
    """The teacher's final-norm output of one micro-batch through the pipeline stages in order: each stage's owner
    runs its layers and hands the (B, T, h) activations (sequence chunks under SP) on by a broadcast over the
    pipeline group; the last stage's owner returns the output, the others None. Every pipeline rank calls it. Under
    FSDP the root's end pieces are gathered where this rank runs the first or the last stage (every DP rank of a
    stage alike), until `release_teacher` after the step's schedule."""
    from shardlm.parallel.pipeline import stage_owner
    from shardlm.training.fsdp import gather_root

    count, x = len(teacher.stage_layers), None
    ends = {stage_owner(stage, ctx.pp_size, count, teacher.v_shaped) for stage in (0, count - 1)}
    gather_root(teacher, gather=ctx.pp_rank in ends)
    length = inputs.shape[1] // (ctx.tp_size if teacher.sequence_parallel else 1)
    for stage, layer_ids in enumerate(teacher.stage_layers):
        owner = stage_owner(stage, ctx.pp_size, count, teacher.v_shaped)
        if owner == ctx.pp_rank:
            if stage == 0:
                x = teacher.embed(inputs, 0, documents)
            x = teacher.run_layers(x, [teacher.layers[str(i)] for i in layer_ids], documents)
            if stage == count - 1:
                return teacher.ln_f(x)
        if stage < count - 1:
            shape = (inputs.shape[0], length, teacher.cfg.hidden_size)
            x = ctx.pp.broadcast(x.float() if owner == ctx.pp_rank else
                                 torch.empty(shape, dtype=torch.float32, device=ctx.device), owner)
    return None
