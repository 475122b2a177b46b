"""Data sharding on one CPU (`make bench` section `fsdp`): none, the distributed optimizer and FSDP at DP=2.

A small GPT (`FSDP_BENCH`) trains at DP = 2 (2 gloo processes x 1 thread, one micro-batch per rank per
step) with `train.data_sharding` = "none" (DDP), "optimizer" (ZeRO-1) and "full" (FSDP2, resharded after
the forward), the three trainers built side by side in the same world:

- step time: each trainer's `train_step`, between two barriers, in a new order every round
  (`common.round_orders`); the median of the repeats;
- peak memory per rank, counted as `shardlm.plan.measure.PeakMemory` counts it (every storage an
  operator creates, each once, until it is freed; here at its current size, `StorageBytes`), from before
  the trainer is built: its
  parameters, DDP buckets, master weights, FSDP shards and AdamW state, and during a second
  `train_step` (the first creates the optimizer state) the activations, gathered layers, gradients and
  temporaries. `resident` is what is alive between steps, `peak` the most alive at once during the
  step. DTensors (FSDP's parameters, gradients and moments) count their local shard; the parallel
  context is built before counting starts (its shared-memory segment for collectives is not the model's);
- communication of one FSDP step on rank 0: every `torch.distributed.all_gather_single` and
  `reduce_scatter_single` call FSDP2 makes (wrapped for one step; they go around shardlm's `ctx.comm`
  counters), as calls and elements of the whole (unsharded) tensors, against the planner's formula
  (`shardlm.plan.fsdp.fsdp_collectives`): the root gathered once, each layer twice (before its forward
  and again before its backward), one reduce-scatter of every unit; once more with
  `train.fsdp_reshard_after_forward = false` (each layer gathered once). Bytes on the wire per rank are
  (DP - 1) / DP of these in a ring.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardlm.bench.common import BenchShape, round_orders, summary, timed_between_barriers

FSDP_BENCH = BenchShape(num_layers=4, hidden_size=384, num_heads=6, seq_length=256, micro_batch=4, vocab_size=8192)
FSDP_QUICK = BenchShape(num_layers=2, hidden_size=64, num_heads=4, seq_length=64, micro_batch=2, vocab_size=512)
SHARDINGS = ("none", "optimizer", "full")


class StorageBytes(TorchDispatchMode):
    """`with StorageBytes() as m:` tracks every tensor storage an operator creates inside the block, as
    `PeakMemory` does (each storage once, views and in-place results of inputs not counted), but counts
    each at its current size: FSDP frees and refills its gathered parameters by resizing their storage
    (not an operator), so `m.live` sums the tracked storages' sizes after every operator and `m.peak` is
    its maximum. DTensors (FSDP's parameters, gradients, moments) count their local shard's storage."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t)._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = _storage(tensor)
                if storage.nbytes() and storage._cdata not in self._storages and storage._cdata not in inputs:
                    self._storages[storage._cdata] = weakref.ref(storage)
        self.update()
        return out

    def update(self) -> None:
        """Sum the tracked storages that are still alive, at their current sizes."""
        alive = {key: ref for key, ref in self._storages.items() if ref() is not None}
        self._storages = alive
        self.live = sum(ref().nbytes() for ref in alive.values())
        self.peak = max(self.peak, self.live)


def _storage(tensor: torch.Tensor):
    """The storage behind `tensor`, or behind a DTensor's local shard."""
    return getattr(tensor, "_local_tensor", tensor).untyped_storage()


def _trainer(shape: BenchShape, ctx, sharding: str, **train):
    return shape.trainer(ctx, data_sharding=sharding, **train)


def memory_worker(shape: BenchShape) -> dict | None:
    """In a world of 2: per data sharding, bytes resident between steps and the peak during a step on rank 0
    (one trainer at a time, the previous one freed)."""
    from shardlm.parallel import ParallelContext

    out = {}
    for sharding in SHARDINGS:
        ctx = ParallelContext.from_process_group(1)  # outside: its shared-memory segment for collectives
        with StorageBytes() as memory:
            trainer = _trainer(shape, ctx, sharding)
            trainer.train_step()
            memory.update()
            resident = memory.peak = memory.live
            trainer.train_step()
            out[sharding] = {"resident_bytes": resident, "peak_bytes": memory.peak}
        del trainer
    return out if dist.get_rank() == 0 else None


def fsdp_collectives_of_a_step(trainer) -> dict:
    """Calls and elements of the all-gathers and reduce-scatters of one `train_step` (on this rank)."""
    from shardlm.training.fsdp import counting_collectives

    with counting_collectives() as counts:
        trainer.train_step()
    return {kind: {"calls": calls, "elements": elements} for kind, (calls, elements) in counts.items()}


def speed_worker(shape: BenchShape, repeats: int) -> dict | None:
    """In a world of 2: seconds per step of each data sharding (1 thread per rank, alternating rounds), then
    one counted FSDP step with and without resharding after the forward."""
    from shardlm.parallel import ParallelContext

    trainers = {s: _trainer(shape, ParallelContext.from_process_group(1), s) for s in SHARDINGS}
    for trainer in trainers.values():  # warm-up: the optimizer state exists from here on
        timed_between_barriers(trainer.train_step, True, 1)
    times = {name: [] for name in trainers}
    for order in round_orders(trainers, repeats):
        for name in order:
            times[name].append(timed_between_barriers(trainers[name].train_step, True, 1))
    comm = {"reshard": fsdp_collectives_of_a_step(trainers["full"])}
    keep = _trainer(shape, ParallelContext.from_process_group(1), "full", fsdp_reshard_after_forward=False)
    keep.train_step()
    comm["keep_gathered"] = fsdp_collectives_of_a_step(keep)
    return {"times": times, "comm": comm} if dist.get_rank() == 0 else None


def collectives_formula(shape: BenchShape) -> dict:
    """The planner's count of one step's FSDP collectives (one micro-batch per rank), as measured above."""
    from shardlm.plan.fsdp import fsdp_collectives, fsdp_units

    units = fsdp_units(shape.model_config(), 1)
    out = {}
    for name, reshard in (("reshard", True), ("keep_gathered", False)):
        c = fsdp_collectives(units, 1, reshard)
        out[name] = {"all_gather": {"calls": c.all_gather_calls, "elements": c.all_gather_elements},
                     "reduce_scatter": {"calls": c.reduce_scatter_calls, "elements": c.reduce_scatter_elements}}
    return {"collectives": out, "parameters": units.total, "layer_parameters": units.layer,
            "root_parameters": units.root, "layers": units.layers}


def fsdp_bench(quick: bool, repeats: int) -> dict:
    """The `fsdp` section of `make bench`."""
    from shardlm.parallel.spawn import run_workers
    from shardlm.plan.fsdp import fsdp_state_memory
    from shardlm.plan.parameters import parameter_count

    shape = FSDP_QUICK if quick else FSDP_BENCH
    memory = run_workers(2, memory_worker, shape, timeout=1800)[0]
    speed = run_workers(2, speed_worker, shape, max(5, repeats), timeout=1800)[0]
    formula = collectives_formula(shape)
    comm = {name: {"measured": speed["comm"][name], "formula": formula["collectives"][name],
                   "bytes": 4 * sum(v["elements"] for v in speed["comm"][name].values())}
            for name in ("reshard", "keep_gathered")}
    full = fsdp_state_memory(parameter_count(shape.model_config(), 1), 2)
    times = {name: [1e3 * t for t in ts] for name, ts in speed["times"].items()}  # ms: 6 decimals kept
    return {
        "config": shape.describe(vocabulary=True) + "; DP = 2 (2 processes x 1 thread, gloo), one micro-batch per "
                  "rank per step",
        "step_ms": {name: summary(ts) for name, ts in times.items()},
        "step_ratio_to_none": {name: summary([a / b for a, b in zip(times[name], times["none"])])
                               for name in SHARDINGS},
        "memory": {name: {**memory[name], "peak_ratio_to_none": memory[name]["peak_bytes"]
                          / memory["none"]["peak_bytes"]} for name in SHARDINGS},
        "predicted_full_state_bytes": full.total,
        "comm": {**comm, "parameters": formula["parameters"], "layer_parameters": formula["layer_parameters"],
                 "root_parameters": formula["root_parameters"], "layers": formula["layers"],
                 "matches_formula": all(c["measured"] == c["formula"] for c in comm.values())},
    }


def markdown_lines(r: dict) -> list[str]:
    """The section of BENCHMARKS.md."""
    lines = ["## Data sharding: none, distributed optimizer, FSDP (`fsdp`)", "", f"Config: {r['config']}.", "",
             "Step time (median over the repeats, alternating rounds) and memory per rank (rank 0: every storage "
             "an operator allocated, from before the trainer was built; resident = alive between steps, peak = the "
             "most alive at once during a step):", "",
             "| data_sharding | step ms | step / none | resident MB | peak MB | peak / none |",
             "|---|---|---|---|---|---|"]
    for name, fig in r["step_ms"].items():
        m = r["memory"][name]
        lines.append(f"| {name} | {fig['median']:.1f} (min {fig['min']:.1f}, max {fig['max']:.1f}) | "
                     f"{r['step_ratio_to_none'][name]['median']:.2f} | {m['resident_bytes'] / 1e6:.1f} | "
                     f"{m['peak_bytes'] / 1e6:.1f} | {m['peak_ratio_to_none']:.2f} |")
    c = r["comm"]
    lines += ["", f"FSDP's collectives in one step on rank 0 (calls, elements of the unsharded tensors; "
              f"{c['layers']} layers of {c['layer_parameters']:,} parameters and a root of {c['root_parameters']:,}): "
              "measured by wrapping `torch.distributed.all_gather_single` / `reduce_scatter_single`, against the "
              "formula (root gathered once, each layer twice when resharded after the forward, once when kept, "
              "one reduce-scatter per unit):", "",
              "| reshard after forward | all-gather measured | formula | reduce-scatter measured | formula | MB |",
              "|---|---|---|---|---|---|"]
    for name, label in (("reshard", "yes"), ("keep_gathered", "no")):
        m, f = c[name]["measured"], c[name]["formula"]
        lines.append(f"| {label} | {m['all_gather']['calls']}, {m['all_gather']['elements']:,} | "
                     f"{f['all_gather']['calls']}, {f['all_gather']['elements']:,} | "
                     f"{m['reduce_scatter']['calls']}, {m['reduce_scatter']['elements']:,} | "
                     f"{f['reduce_scatter']['calls']}, {f['reduce_scatter']['elements']:,} | "
                     f"{c[name]['bytes'] / 1e6:.1f} |")
    lines += ["", f"**`fsdp.comm.matches_formula` = {c['matches_formula']}**", ""]
    return lines
