"""The frozen teacher: a Hugging Face directory or shardlm checkpoint built at the run's layout (its own TP split of
heads and vocabulary, its experts over EP), in eval mode, with no gradient and no optimizer state."""

from __future__ import annotations

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
    parallelism, its weights read (every rank its shard), frozen. Collective over the ranks that read shards."""
    from shardlm.checkpoint import files
    from shardlm.checkpoint.init import MappedReader
    from shardlm.checkpoint.sharded import model_files
    from shardlm.checkpoint.state import load_weights
    from shardlm.models import build_model
    from shardlm.models.gemma_config import hidden_only_split_problem
    from shardlm.parallel.pipeline import V_SHAPED, local_stages, stage_layers, stages_per_rank

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
    teacher.stage_layers = layers
    teacher.v_shaped = ctx.pp_size > 1 and config.parallel.pipeline_schedule in V_SHAPED
    if isinstance(source.reader, MappedReader):
        source.reader.expect(teacher, ctx.tp_size)
    load_weights(teacher, source.reader, ctx)
    for param in teacher.parameters():
        param.requires_grad_(False)
    if config.distill.teacher_dtype == "bf16":
        teacher.to(torch.bfloat16)
    return teacher.eval()


def describe_teacher(teacher: torch.nn.Module, path: str) -> str:
    """One line for the run's log: the teacher and what its weights take on this rank."""
    m = teacher.cfg
    held = sum(p.numel() * p.element_size() for p in teacher.parameters())
    return (f"distill: teacher {path} ({m.arch}, {m.num_layers} layers, hidden {m.hidden_size}, vocabulary "
            f"{m.vocab_size}): {held / 2**20:,.1f} MiB of frozen weights on this rank, no gradient, no optimizer "
            "state")


def pipelined_hidden(teacher, inputs: torch.Tensor, documents, ctx) -> torch.Tensor | None:
    """The teacher's final-norm output of one micro-batch through the pipeline stages in order: each stage's owner
    runs its layers and hands the (B, T, h) activations (sequence chunks under SP) on by a broadcast over the
    pipeline group; the last stage's owner returns the output, the others None. Every pipeline rank calls it."""
    from shardlm.parallel.pipeline import stage_owner

    count, x = len(teacher.stage_layers), None
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
