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

    source = open_teacher(config.distill.teacher)
    model_config = source.config.model
    model_config.seq_length = config.model.seq_length
    model_config.dropout = 0.0
    if source.meta is not None:
        names = [name for row in model_files(source.meta) for name in row]
        files.verify(source.path, source.meta, names, world=ctx.world, device=ctx.device)
    teacher = build_model(model_config, ctx, seed=config.train.seed,
                          sequence_parallel=config.parallel.sequence_parallel)
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
