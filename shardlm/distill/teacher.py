"""The frozen teacher: a Hugging Face directory or shardlm checkpoint built at the run's layout (its own TP split of
heads and vocabulary, its experts over EP), in eval mode, with no gradient and no optimizer state.

Under pipeline stages a rank's teacher holds its stages' layers and end pieces only (`pipeline.keep_stages`, as the
student's). Under FSDP (`train.data_sharding = "full"`) the teacher is sharded as the student is, over the same
data-parallel mesh (`shardlm.training.frozen`): each DP rank holds 1/DP of each of its tensors, a layer's forward
gathers that layer and frees it after, and the root (embedding, final norm, output layer) stays gathered from the
teacher's forward until the loss has used its output layer (`release_teacher`); under pipeline stages the root is
gathered where a rank runs the first or the last stage, before the step's pipelined pass (`pipelined_hidden`), and
freed after the step's schedule. Its all-gathers are collectives: the teacher runs exactly once per student forward
(`DistillLoss.__call__`; under pipeline stages once per micro-batch before the schedule, `DistillLoss.teacher_pass`,
the same stages on the DP ranks of a stage), and the student's FSDP forward already runs in lockstep over the DP ranks
(the same micro-batch count on every rank, on-policy steps included: sampling is the student's, in lockstep), so the
teacher's does too."""

from __future__ import annotations

import torch

from shardlm.errors import UserError
from shardlm.training.frozen import load_frozen, local_bytes
from shardlm.training.frozen import release as release_teacher  # noqa: F401  (the distillation loss's name)


def open_teacher(path: str):
    """`shardlm.checkpoint.init.open_source` of the teacher, its errors naming `distill.teacher`."""
    from shardlm.checkpoint.init import open_source

    try:
        return open_source(path)
    except UserError as error:
        raise UserError(str(error).replace("checkpoint.init_from", "distill.teacher")) from None


def load_teacher(config, ctx) -> torch.nn.Module:
    """The teacher of `config.distill` at `ctx`'s layout (`shardlm.training.frozen.load_frozen`: the student's
    sequence length, sequence parallelism, pipeline stages and FSDP mesh), in bf16 under `distill.teacher_dtype`."""
    return load_frozen(config, ctx, open_teacher(config.distill.teacher), "distill.teacher",
                       bf16=config.distill.teacher_dtype == "bf16")


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
