"""`shardlm plan` against shardlm on this CPU, in three dimensions (`make bench` section `plan3d`).

- memory: per (pipeline rank, TP rank) of PP=2 x DP=4 (1F1B, GPipe, interleaved 1F1B) and PP=2 x
  TP=2 x DP=2 (with and without sequence parallelism, and SP + selective recomputation), in one world
  of 8 processes: parameter, gradient and optimizer bytes beside the planner's (`stages`,
  `memory.state_memory`), and the most bytes saved for backward alive at once during one step's
  schedule (`measure.SavedPeak`) beside `activations.rank_activation_peak`;
- time: one step of each of DP=2, TP=2, TP=2 with SP, PP=2 (1F1B, GPipe, interleaved) in one world of
  2 processes (one per core), layouts alternated step by step, the fastest of the repeats kept; the
  planner's step time with this CPU described as a GPU (`measure.cpu_as_gpu`) and the compute
  efficiency fitted on DP=2 alone; the ratios to DP=2, measured and predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shardlm.plan.activations import LayerSetting, rank_activation_peak, shardlm_memory
from shardlm.plan.memory import numeric_format, state_memory
from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages


@dataclass(frozen=True)
class Shape:
    """Model and batch of the measurement."""

    num_layers: int = 4
    hidden_size: int = 32
    num_heads: int = 4
    seq_length: int = 16
    vocab_size: int = 100
    micro_batch: int = 2
    micro_batches: int = 4
    """Per data-parallel rank and step."""
    dropout: float = 0.1

    def config(self, case: tuple, world: int, global_batch: int | None = None):
        """The RunConfig of `case` = (tensor, pipeline, schedule, virtual stages, sequence parallel, recompute,
        half parameters, distributed optimizer); `global_batch` defaults to `micro_batches` per DP rank."""
        from shardlm.config import from_dict

        tp, pp, schedule, virtual, sp, recompute, half, zero = case
        dp = world // (tp * pp)
        global_batch = global_batch or self.micro_batch * self.micro_batches * dp
        return from_dict({
            "model": {"num_layers": self.num_layers, "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                      "seq_length": self.seq_length, "vocab_size": self.vocab_size, "dropout": self.dropout,
                      "attention_dropout": 0.0},
            "parallel": {"tensor": tp, "pipeline": pp, "pipeline_schedule": schedule, "virtual_stages": virtual,
                         "sequence_parallel": sp},
            "data": {"text_file": "unused"},
            "train": {"micro_batch_size": self.micro_batch, "steps": 1000, "seed": 3, "recompute": recompute,
                      "global_batch_size": global_batch, "precision": "bf16" if half else "fp32",
                      "param_dtype": "half" if half else "fp32", "distributed_optimizer": zero},
        })

    def trainer(self, ctx, case: tuple, global_batch: int | None = None):
        import numpy as np

        from shardlm.data.gpt_dataset import TokenArrayDataset
        from shardlm.training.trainer import Trainer

        tokens = np.random.default_rng(0).integers(0, self.vocab_size, 200 * self.micro_batch * self.seq_length)
        data = TokenArrayDataset(tokens, self.seq_length, seed=1, num_samples=100_000)
        return Trainer(self.config(case, ctx.world_size, global_batch), ctx, data)


# (tensor, pipeline, schedule, virtual stages, sequence parallel, recompute, half parameters, distributed
# optimizer) in a world of 8
MEMORY_CASES = [(1, 2, "1f1b", 1, False, "none", False, False), (1, 2, "gpipe", 1, False, "none", False, False),
                (1, 2, "interleaved-1f1b", 2, False, "none", False, False),
                (2, 2, "1f1b", 1, False, "none", False, False), (2, 2, "1f1b", 1, True, "none", False, False),
                (2, 2, "interleaved-1f1b", 2, True, "selective", False, False),
                (1, 2, "1f1b", 1, False, "none", False, True), (2, 2, "1f1b", 1, True, "selective", True, True)]


def measure_pipeline_memory(shape: Shape, cases: list) -> dict:
    """On every rank of a world of 8: state bytes and the saved-activation peak of one step per case."""
    from shardlm.parallel import ParallelContext
    from shardlm.plan.measure import SavedPeak, state_bytes

    out = {}
    for case in cases:
        ctx = ParallelContext.from_process_group(case[0], pipeline_parallel=case[1])
        ctx.rng = None
        trainer = shape.trainer(ctx, case)
        trainer.train_step()  # AdamW creates its state
        generator = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length + 1), generator=generator)
                   for _ in range(shape.micro_batches)]
        with SavedPeak(trainer.model) as saved:
            trainer.pipeline.forward_backward(batches)
        out[case] = {"pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank, "saved_peak": saved.peak,
                     "sizes": [p.numel() for p in trainer.params],
                     "saved_left": saved.live, "parameter_elements": sum(p.numel() for p in trainer.params),
                     **state_bytes(trainer.params, trainer.optimizer)}
    return out


def predict_pipeline_memory(shape: Shape, case: tuple, measured: dict, world: int = 8) -> dict:
    """The planner's parameter elements, state bytes and saved-activation peak for the rank of `case` that
    `measured` describes (its pipeline, TP and DP ranks, and the order of its parameter tensors, which
    decides how many of them the distributed optimizer's range cuts)."""
    tp, pp, schedule, virtual, sp, recompute, half, zero = case
    pp_rank, tp_rank = measured["pp_rank"], measured["tp_rank"]
    cfg = shape.config(case, world).model
    stages = rank_stages(pipeline_layers(cfg.num_layers, pp, virtual), pp, pp_rank)
    params = rank_parameter_count(cfg, tp, stages)
    fmt = numeric_format("bf16", "shardlm", "half") if half else numeric_format("fp32")
    state = state_memory(params, fmt, world // (tp * pp), zero, measured["dp_rank"], measured["sizes"])
    acts = shardlm_memory(cfg, tp, shape.micro_batch, fmt, LayerSetting(sp, recompute), backend="cpu", rank=tp_rank)
    peak = rank_activation_peak(acts, stages, schedule, pp, shape.micro_batches, recompute, transient=False,
                                keeps_received=True)
    return {"parameter_elements": params.total, "parameters": state.parameters, "gradients": state.gradients,
            "optimizer": state.optimizer, "saved_peak": peak}


def memory_rows(shape: Shape, measured: list[dict], world: int = 8) -> list[dict]:
    rows = []
    for rank in measured:
        for case, got in rank.items():
            predicted = predict_pipeline_memory(shape, case, got, world)
            rows.append({"case": _name(case, world), "pp_rank": got["pp_rank"], "tp_rank": got["tp_rank"],
                         "dp_rank": got["dp_rank"],
                         "measured": {k: got[k] for k in predicted}, "predicted": predicted,
                         "state_equal": all(got[k] == predicted[k] for k in predicted if k != "saved_peak"),
                         "activation_error": predicted["saved_peak"] / got["saved_peak"] - 1})
    # DP replicas are identical unless the distributed optimizer gives each its own range
    unique = {(row["case"], row["pp_rank"], row["tp_rank"], row["dp_rank"] if "distributed" in row["case"] else 0): row
              for row in rows}
    return [unique[key] for key in sorted(unique)]


def _name(case: tuple, world: int = 8) -> str:
    tp, pp, schedule, virtual, sp, recompute, half, zero = case
    extras = ([schedule + (f" V={virtual}" if virtual > 1 else "")] if pp > 1 else []) + (["SP"] if sp else []) + \
        ([recompute] if recompute != "none" else []) + (["bf16 parameters"] if half else []) + \
        (["distributed optimizer"] if zero else [])
    return ", ".join([f"PP={pp} x TP={tp} x DP={world // (tp * pp)}", *extras])


# the same fields, in a world of 2, all with the global batch of DP=2 x `micro_batches` micro-batches
# (PP=2 runs 2 x micro_batches through its pipeline)
TIME_CASES = [(1, 1, "1f1b", 1, False, "none", False, False), (2, 1, "1f1b", 1, False, "none", False, False),
              (2, 1, "1f1b", 1, True, "none", False, False), (1, 2, "1f1b", 1, False, "none", False, False),
              (1, 2, "gpipe", 1, False, "none", False, False),
              (1, 2, "interleaved-1f1b", 2, False, "none", False, False)]
TIME_SHAPE = Shape(num_layers=4, hidden_size=256, num_heads=4, seq_length=128, vocab_size=512, micro_batch=2,
                   micro_batches=4, dropout=0.0)


def time_worker(shape: Shape, cases: list, repeats: int) -> dict:
    from shardlm.parallel import ParallelContext
    from shardlm.plan.measure import measure_cpu_hardware, time_steps

    torch.set_num_threads(1)
    world = ParallelContext.from_process_group(2)
    hardware = measure_cpu_hardware(world.tp)
    trainers = {}
    for case in cases:
        ctx = ParallelContext.from_process_group(case[0], pipeline_parallel=case[1])
        ctx.rng = None
        trainers[case] = shape.trainer(ctx, case, time_global_batch(shape))
    times = {case: [] for case in cases}
    for _ in range(repeats + 1):  # alternate the layouts so load from other processes hits them alike
        for case, trainer in trainers.items():
            times[case].append(time_steps(trainer.train_step, repeats=1, warmup=0))
    return {"hardware": hardware, "times": {case: min(values[1:]) for case, values in times.items()}}


def time_global_batch(shape: Shape) -> int:
    return 2 * shape.micro_batch * shape.micro_batches


def predicted_times(shape: Shape, hardware, measured_base: float) -> dict:
    """The planner's `StepTime` of every TIME_CASES layout on this CPU, compute efficiency fitted on the first."""
    from shardlm.plan.measure import cpu_as_gpu
    from shardlm.plan.timing import Calibration, Layout, step_time

    gpu, fmt = cpu_as_gpu(hardware), numeric_format("fp32")
    calibration = Calibration(compute_efficiency=1.0, link_efficiency=1.0, dp_overlap=0.0,
                              intra_node_latency_s=hardware.allreduce_latency_s,
                              inter_node_latency_s=hardware.allreduce_latency_s)

    def predict(case, calib):
        tp, pp, schedule, virtual, sp, recompute, _, _ = case
        cfg = shape.config(case, 2, time_global_batch(shape)).model
        dp = 2 // (tp * pp)
        layout = Layout(tp=tp, dp=dp, micro_batch=shape.micro_batch, checkpointing=recompute == "full", pp=pp,
                        virtual=virtual, schedule=schedule, sequence_parallel=sp, selective=recompute == "selective")
        params = rank_parameter_count(cfg, tp, rank_stages(pipeline_layers(cfg.num_layers, pp, virtual), pp, 0))
        return step_time(cfg, layout, time_global_batch(shape), gpu, fmt, params, calib)

    base = predict(TIME_CASES[0], calibration)
    efficiency = base.compute_s / max(measured_base - (base.total_s - base.compute_s), 1e-9)
    calibration = replace(calibration, compute_efficiency=efficiency)
    return {case: predict(case, calibration) for case in TIME_CASES}


def _quick_worker(memory_shape: Shape, time_shape: Shape, time_cases: list) -> tuple:
    return measure_pipeline_memory(memory_shape, MEMORY_CASES[:1]), time_worker(time_shape, time_cases, 1)


def plan_against_cpu(quick: bool = False, repeats: int = 5) -> dict:
    from shardlm.parallel.spawn import run_workers

    memory_shape = Shape()
    time_shape = replace(TIME_SHAPE, hidden_size=64, seq_length=32) if quick else TIME_SHAPE
    if quick:  # PP=2 alone and two timed layouts in one world of 2: checks the harness, not the figures
        memory_world, time_cases = 2, [TIME_CASES[0], TIME_CASES[3]]
        both = run_workers(2, _quick_worker, memory_shape, time_shape, time_cases, timeout=1800)
        measured, timed = [rank[0] for rank in both], both[0][1]
    else:
        memory_world, time_cases = 8, TIME_CASES
        measured = run_workers(8, measure_pipeline_memory, memory_shape, MEMORY_CASES, timeout=1800)
        timed = run_workers(2, time_worker, time_shape, time_cases, repeats, timeout=1800)[0]
    base = timed["times"][time_cases[0]]
    predicted = predicted_times(time_shape, timed["hardware"], base)
    time_rows = [{"layout": _name(case, 2),
                  "measured_s": timed["times"][case], "predicted_s": predicted[case].total_s,
                  "predicted_parts_s": {"compute": predicted[case].compute_s,
                                        "elementwise": predicted[case].elementwise_s,
                                        "tp_comm": predicted[case].tp_comm_s, "bubble": predicted[case].bubble_s,
                                        "p2p": predicted[case].p2p_s, "dp": predicted[case].dp_exposed_s,
                                        "optimizer": predicted[case].optimizer_s},
                  "measured_ratio": timed["times"][case] / base,
                  "predicted_ratio": predicted[case].total_s / predicted[TIME_CASES[0]].total_s}
                 for case in time_cases]
    return {"memory_config": f"GPT {memory_shape.num_layers} layers, hidden {memory_shape.hidden_size}, "
                             f"{memory_shape.num_heads} heads, sequence {memory_shape.seq_length}, vocabulary "
                             f"{memory_shape.vocab_size}, micro-batch {memory_shape.micro_batch}, "
                             f"{memory_shape.micro_batches} micro-batches per step, fp32, residual dropout 0.1; one "
                             f"world of {memory_world} gloo processes",
            "memory": memory_rows(memory_shape, measured, memory_world),
            "time_config": f"GPT {time_shape.num_layers} layers, hidden {time_shape.hidden_size}, sequence "
                           f"{time_shape.seq_length}, global batch {time_global_batch(time_shape)} in micro-batches "
                           f"of {time_shape.micro_batch}, fp32; one world of 2 processes x 1 thread; "
                           "fastest of the repeats; compute efficiency fitted on DP=2",
            "time": time_rows, "hardware": timed["hardware"].__dict__}


def markdown_lines(result: dict) -> list[str]:
    """The section of BENCHMARKS.md."""
    lines = ["## `shardlm plan` in three dimensions against this CPU (`plan3d`)", "", result["memory_config"] + ".",
             "", "| layout | PP, TP, DP rank | state bytes (measured = predicted) | saved peak measured | "
             "predicted | error |", "|---|---|---|---|---|---|"]
    for row in result["memory"]:
        state = row["measured"]["parameters"] + row["measured"]["gradients"] + row["measured"]["optimizer"]
        lines.append(f"| {row['case']} | {row['pp_rank']}, {row['tp_rank']}, {row['dp_rank']} | {state:,} "
                     f"({'equal' if row['state_equal'] else 'DIFFERENT'}) | {row['measured']['saved_peak']:,} | "
                     f"{row['predicted']['saved_peak']:,} | {row['activation_error']:+.1%} |")
    lines += ["", result["time_config"] + ".", "", "| layout | measured s | predicted s | measured ratio to DP=2 | "
              "predicted ratio |", "|---|---|---|---|---|"]
    for row in result["time"]:
        lines.append(f"| {row['layout']} | {row['measured_s']:.3f} | {row['predicted_s']:.3f} | "
                     f"{row['measured_ratio']:.2f} | {row['predicted_ratio']:.2f} |")
    return lines + [""]
