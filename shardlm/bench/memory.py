"""Memory per rank at TP = 1, 2, 4: state bytes against the analytic ideal, activations with and
without checkpointing (measured exactly with saved-tensor hooks, see `shardlm.plan.measure`)."""

from __future__ import annotations

import torch

from shardlm.bench.common import BenchShape

MEMORY_SHAPE = BenchShape(num_layers=4, hidden_size=256, num_heads=8, seq_length=256, micro_batch=2,
                          vocab_size=8000)


def measure(shape: BenchShape, tps: list[int]) -> dict:
    """On every rank of the current world (or alone): measured bytes per TP size; rank 0's returned."""
    from shardlm.parallel import ParallelContext
    from shardlm.plan.measure import measure_trainer_memory

    out = {}
    for tp in tps:
        ctx = ParallelContext.single() if tp == 1 and not torch.distributed.is_initialized() \
            else ParallelContext.from_process_group(tp)
        batch = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length + 1))
        runs = {}
        for checkpointing in (False, True):
            ctx.rng = None
            trainer = shape.trainer(ctx, tp=tp, activation_checkpointing=checkpointing)
            runs[checkpointing] = measure_trainer_memory(trainer, batch[:, :-1], batch[:, 1:])
        out[tp] = runs
    return out if ctx.rank == ctx.world_size - 1 else None  # the last rank holds the vocabulary padding


def memory_per_rank(quick: bool = False) -> dict:
    from shardlm.parallel.spawn import run_workers
    from shardlm.plan.memory import activation_memory, numeric_format, state_memory
    from shardlm.plan.parameters import parameter_count

    shape = BenchShape(num_layers=2, hidden_size=64, num_heads=4, seq_length=64, micro_batch=2, vocab_size=500) \
        if quick else MEMORY_SHAPE
    measured = measure(shape, [1])
    world4 = [r for r in run_workers(4, measure, shape, [2, 4]) if r is not None][0]
    measured.update(world4)
    cfg, fmt = shape.model_config(), numeric_format("fp32")
    rows = []
    for tp in (1, 2, 4):
        plain, checkpointed = measured[tp][False], measured[tp][True]
        ideal = state_memory(parameter_count(cfg, tp), fmt)
        predicted = activation_memory(cfg, tp, shape.micro_batch, fmt, backend="cpu")
        rows.append({
            "tp": tp,
            "state_bytes": plain["parameters"] + plain["gradients"] + plain["optimizer"],
            "ideal_state_bytes": ideal.total,
            "parameters": plain["parameters"], "gradients": plain["gradients"], "optimizer": plain["optimizer"],
            "activation_bytes": plain["saved_total"], "predicted_activation_bytes": predicted.stored(False),
            "activation_bytes_checkpointed": checkpointed["saved_total"],
            "peak_step_bytes": plain["peak_step"], "peak_step_bytes_checkpointed": checkpointed["peak_step"],
            "predicted_activation_bytes_checkpointed": predicted.stored(True),
        })
    return {"config": shape.describe() + "; per rank of TP=1 (1 process) and TP=2, TP=4 (world of 4). State = "
            "fp32 parameters + gradients + AdamW moments and step scalars; ideal = sharded part / TP + replicated "
            "part (`shardlm.plan.memory`); activations = bytes autograd saves for backward in one forward "
            "(saved-tensor hooks), the planner's prediction beside them in benchmarks.json; peak = the most "
            "bytes alive at once during a forward + backward beyond parameters and optimizer state "
            "(activations, temporaries such as the logits, and gradients as they appear), tracked per storage "
            "by a dispatch mode.", "rows": rows}
