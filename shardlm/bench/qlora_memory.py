"""QLoRA's memory per rank, planned against measured (`make bench` section `qlora_memory`).

A small Qwen3-shaped Llama (`QLORA_BENCH`; `QLORA_QUICK` under `--quick`: q/k RMSNorm, grouped KV heads, SwiGLU,
an untied output layer) trains with QLoRA (`[lora] quantize = "nf4"`, rank 16, alpha 32, dropout 0, every attention
and MLP projection) in fp32, one micro-batch per rank, no recomputation, for `steps` steps, in two layouts: one
process (DP = 1), and FSDP at DP = 2 (`train.data_sharding = "full"`, a world of 2 gloo processes x 1 thread).

Measured on each rank, exact tensor bytes (no process figure such as VmData, which adds the allocator's and
PyTorch's own memory): the storages of the NF4 base (packed codes, statistics codes, second-level maxima, offset of
every projection; FSDP's shards as it allocates them, rows padded to a multiple of DP), of the other frozen weights
(embedding, output layer, norms), of the adapters, of their gradients (at the optimizer step: the trainer frees
them after it) and of AdamW's moments and steps. Through `LiveBytes` (every storage an operator creates, at its
current size, from before the trainer is built): what lives between steps (`resident`: the sum of the kinds above
but the gradients, nothing else), what is alive at the end of the model's forward (what autograd saved, the loss's
included, and under FSDP the gathered root) and the most alive at once during the last step beyond
`resident` (`step_peak`: gradients, activations, FSDP's gathered units, the dequantized weights and temporaries).
`shardlm.plan.measure.PeakMemory` cannot count FSDP: FSDP frees and refills its gathered layers by resizing
storages, which no operator sees.

Planned: `shardlm plan`'s own evaluation of the same config and layout (`plan.evaluate.Evaluator.choice`: the state
of `plan.lora_memory.lora_state_memory` or `lora_fsdp_state_memory`, the activation peak, FSDP's gathered units
`lora_fsdp_gathered_bytes`, the dequantized working copy `working_copy_bytes`), its parameters split by kind with
`plan.lora.lora_count`, each kind's 1 / DP share rounded up as the plan rounds it. Where the two differ, by
derivation (checked in tests/test_bench_qlora.py):

- FSDP pads a tensor's rows to a multiple of DP: each NF4 weight's one-element offset is stored on both ranks (4
  bytes each where the plan's split counts 2): the NF4 base is the plan's plus 2 bytes a weight at DP = 2;
- at the end of the forward the plan counts activations as full fine-tuning saves them; QLoRA also saves each
  adapter's r-wide intermediate (7 r per token a layer, fp32), and its frozen output layer saves no input
  (b s h fp32 fewer); a few bytes a token more are not measured: the token ids (made by `torch.from_numpy`, no
  operator) and the first layer's norm statistic (its input, the frozen embedding's output, needs no gradient);
- the step peak: the plan counts every adapter gradient and the largest layer's whole dequantized weights (fp32) at
  the same time as the activations; the backward holds one projection's dequantized weight (with its int64 codes
  while it is built) and only the gradients of the layers it has passed: the plan is an upper bound.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

RANK, ALPHA = 16, 32.0


@dataclass(frozen=True)
class QloraShape:
    """The model and batch of the section."""

    num_layers: int = 8
    hidden_size: int = 1024
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64
    ffn_hidden_size: int = 3072
    seq_length: int = 256
    micro_batch: int = 2
    vocab_size: int = 8192
    steps: int = 2
    """Steps per run: the first creates AdamW's state, the last is measured."""

    def config(self, dp: int):
        """The run's `shardlm.config` at data-parallel size `dp` (FSDP when `dp` > 1), one micro-batch a rank."""
        from shardlm.config import from_dict

        model = {"arch": "llama", "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                 "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                 "qk_norm": True, "ffn_hidden_size": self.ffn_hidden_size, "seq_length": self.seq_length,
                 "vocab_size": self.vocab_size, "dropout": 0.0, "tie_embeddings": False}
        return from_dict({
            "model": model, "data": {"text_file": "in-memory"},
            "lora": {"rank": RANK, "alpha": ALPHA, "targets": ["all-linear"], "dropout": 0.0, "quantize": "nf4"},
            "train": {"precision": "fp32", "micro_batch_size": self.micro_batch,
                      "global_batch_size": self.micro_batch * dp, "steps": 1000, "lr": 1e-4, "seed": 3,
                      "data_sharding": "full" if dp > 1 else "none"},
        })

    def describe(self) -> str:
        return (f"Qwen3-shaped Llama: {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads "
                f"({self.num_kv_heads} KV) of {self.head_dim}, q/k norms, SwiGLU {self.ffn_hidden_size}, vocabulary "
                f"{self.vocab_size} (untied output layer), sequence {self.seq_length}, micro-batch "
                f"{self.micro_batch} per rank, fp32, no recomputation; QLoRA r={RANK} alpha={ALPHA:g} on all seven "
                f"projections of every layer")


QLORA_BENCH = QloraShape()
QLORA_QUICK = QloraShape(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4, ffn_hidden_size=1536,
                         seq_length=128, vocab_size=2048)
PARTS = ("nf4_base", "frozen_fp32", "adapters", "adamw", "gradients", "forward_end", "step_peak", "total")
"""The rows of the comparison: the state by kind, what the step adds, the most alive at once."""
STATE = ("nf4_base", "frozen_fp32", "adapters", "adamw")
"""What lives between steps."""


def _storage(tensor: torch.Tensor):
    """The storage behind `tensor`, or behind a DTensor's local shard."""
    return getattr(tensor, "_local_tensor", tensor).untyped_storage()


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as m:` tracks every tensor storage an operator creates inside the block, for as long as it
    lives, at its current size: FSDP frees and refills its gathered parameters by resizing storages (not an
    operator), so `m.live` sums the tracked storages' sizes after every operator and `m.peak` is its maximum (call
    `update()` after work outside operators). Views and in-place results of an operator's inputs allocate nothing and
    are not counted; a DTensor (FSDP's parameters, gradients, moments) counts its local shard's storage. A storage
    leaves the table when it dies, so a new one the allocator places at a freed one's address is counted."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    def _forget(self, key: int) -> None:
        self._storages.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t)._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = _storage(tensor)
                key = storage._cdata
                if key not in self._storages and key not in inputs:
                    self._storages[key] = weakref.ref(storage)
                    weakref.finalize(storage, self._forget, key)
        self.update()
        return out

    def update(self) -> None:
        """Sum the tracked storages at their current sizes."""
        self.live = sum(storage.nbytes() for storage in (ref() for ref in list(self._storages.values()))
                        if storage is not None)
        self.peak = max(self.peak, self.live)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shard's)."""
    storages = {}
    for tensor in tensors:
        storage = _storage(tensor)
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def state_parts(model, optimizer) -> dict[str, int]:
    """This rank's NF4 tensors, other frozen parameters, trainable parameters and AdamW state (moments and steps),
    in bytes of their storages."""
    named = list(model.named_parameters())
    moments = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {"nf4_base": storage_bytes(p for n, p in named if ".parametrizations." in n),
            "frozen_fp32": storage_bytes(p for n, p in named if ".parametrizations." not in n and not p.requires_grad),
            "adapters": storage_bytes(p for _, p in named if p.requires_grad),
            "adamw": storage_bytes(moments)}


def record_gradients(trainer) -> dict:
    """Wrap `trainer.optimizer.step` to record the bytes of the trainable parameters' gradients when it runs (the
    trainer sets them to None after each step); returns the dict it writes "gradients" into."""
    seen, step = {}, trainer.optimizer.step
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]

    def recording_step(*args, **kwargs):
        seen["gradients"] = storage_bytes(p.grad for p in trainable if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return seen


def measure_rank(shape: QloraShape, dp: int) -> dict:
    """On every rank of a world of `dp` (one process at `dp` = 1): build the QLoRA trainer and run `shape.steps`
    steps, counting storages from before the build (the parallel context's own buffers outside). This rank's state
    by kind (`STATE`), its gradients, `resident` (all that lives between steps) and `resident_other` (of it, what is
    none of the kinds), and of the last step: `forward_end` and `step_peak` (beyond `resident`), `total` (the most
    alive at once); its NF4 tensors' own elements' bytes (`nf4_shard_bytes`: FSDP's unpadded shard) and the losses."""
    import numpy as np

    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    rng = np.random.default_rng(0)
    data = [rng.integers(0, shape.vocab_size, size=shape.seq_length + 1) for _ in range(8 * dp * shape.steps)]
    ctx = ParallelContext.from_process_group(1) if dp > 1 else ParallelContext.single()
    forward_end = []
    with LiveBytes() as memory:
        trainer = Trainer(shape.config(dp), ctx, data)
        gradients = record_gradients(trainer)
        losses = [trainer.train_step()["loss"] for _ in range(shape.steps - 1)]
        memory.update()
        resident = memory.peak = memory.live
        state = state_parts(trainer.model, trainer.optimizer)

        def after_forward(*_):
            memory.update()
            forward_end.append(memory.live - resident)

        hook = trainer.model.register_forward_hook(after_forward)
        losses.append(trainer.train_step()["loss"])
        hook.remove()
    nf4 = [p for n, p in trainer.model.named_parameters() if ".parametrizations." in n]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in nf4]
    return {**state, "gradients": gradients["gradients"], "forward_end": forward_end[-1],
            "step_peak": memory.peak - resident, "total": memory.peak, "resident": resident,
            "resident_other": resident - sum(state.values()),
            "nf4_shard_bytes": sum(p.numel() * p.element_size() for p in local), "losses": losses}


def plan_choice(shape: QloraShape, dp: int):
    """`shardlm plan`'s evaluation (`plan.evaluate.Choice`) of the run's own layout: TP = PP = 1, DP = `dp` (FSDP
    when > 1), the run's micro-batch, no recomputation, fp32, no reserve. The GPU preset only prices time."""
    from shardlm.plan.evaluate import Evaluator
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.layout import Layout
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.request import PlanRequest

    config = shape.config(dp)
    request = PlanRequest(model=PlannedModel("qlora-bench", config.model, config.lora), gpu=gpu_preset("h100"),
                          gpus=dp, global_batch=config.train.global_batch_size, precision="fp32",
                          micro_batch=shape.micro_batch, recompute="none", sequence_parallel="off",
                          data_sharding="full" if dp > 1 else "none", pipeline=1, reserve_gb=0.0)
    layout = Layout(tp=1, dp=dp, micro_batch=shape.micro_batch, checkpointing=False, full_sharding=dp > 1)
    return Evaluator(request).choice(layout)


def planned(shape: QloraShape, dp: int) -> dict:
    """The plan's bytes per rank for the run at `dp` (`plan_choice`), split as `PARTS` (the parameters' three kinds
    from the plan's count, `plan.lora.lora_count`, each part's 1 / DP share rounded up as the plan rounds them), the
    step peak's pieces, and the whole model's NF4 bytes and bits a weight."""
    from shardlm.plan.lora import BASE_BYTES, lora_count

    config = shape.config(dp)
    choice = plan_choice(shape, dp)
    count = lora_count(config.model, config.lora, 1)
    state = choice.state
    parts = {"nf4_base": -(-count.nf4_bytes // dp), "frozen_fp32": BASE_BYTES * -(-count.frozen // dp),
             "adapters": BASE_BYTES * -(-count.trainable.total // dp), "adamw": state.optimizer,
             "gradients": state.gradients}
    if parts["nf4_base"] + parts["frozen_fp32"] + parts["adapters"] != state.parameters:
        raise AssertionError(f"the plan's parameters {state.parameters} are not its count's kinds {parts}")
    # at the end of the forward FSDP holds the root gathered (the first term of `lora_fsdp_gathered_bytes`)
    root_gathered = BASE_BYTES * (count.root_frozen + count.root_trainable) if dp > 1 else 0
    return {**parts, "forward_end": choice.activation_peak + root_gathered,
            "step_peak": state.gradients + choice.activation_peak + choice.gathered + choice.dequantized,
            "total": choice.total_bytes, "activations": choice.activation_peak, "gathered": choice.gathered,
            "dequantized": choice.dequantized, "root_gathered": root_gathered,
            "nf4_whole_model_bytes": count.nf4_bytes, "nf4_parameters": count.quantized,
            "bits_per_weight": count.bits_per_weight, "trainable_parameters": count.trainable.total}


def qlora_memory_bench(quick: bool) -> dict:
    """The `qlora_memory` section of `make bench`."""
    from shardlm.bench.common import machine
    from shardlm.parallel.spawn import run_workers

    shape = QLORA_QUICK if quick else QLORA_BENCH
    layouts = {"dp1": 1, "fsdp_dp2": 2}
    measured = {name: run_workers(dp, measure_rank, shape, dp, timeout=1800) for name, dp in layouts.items()}
    plans = {name: planned(shape, dp) for name, dp in layouts.items()}
    rows = [{"layout": name, "dp": dp, "rank": rank, "part": part, "planned": plans[name][part],
             "measured": value[part], "ratio": value[part] / plans[name][part]}
            for name, dp in layouts.items() for rank, value in enumerate(measured[name]) for part in PARTS]
    one, two = measured["dp1"][0], measured["fsdp_dp2"][0]
    return {"config": f"{shape.describe()}; {shape.steps} steps, the last measured; one process, and FSDP at DP = 2 "
                      "(2 gloo processes x 1 thread)",
            "cpu": machine()["cpu"], "rows": rows, "plan": plans, "measured": measured,
            "fsdp_halving": {part: two[part] / one[part] for part in (*STATE, "gradients")}}


def markdown_lines(r: dict) -> list[str]:
    """The `qlora_memory` section of BENCHMARKS.md."""
    labels = {"nf4_base": "NF4 base (codes, statistics, maxima, offsets)",
              "frozen_fp32": "other frozen weights, fp32 (embedding, output layer, norms)",
              "adapters": "adapters, fp32", "adamw": "AdamW moments and steps",
              "gradients": "adapters' gradients (at the optimizer step)",
              "forward_end": "alive at the end of the forward beyond the state (activations; FSDP: the gathered root)",
              "step_peak": "one step's peak beyond the state between steps",
              "total": "most bytes alive at once during a step"}
    cells = {(row["layout"], row["rank"], row["part"]): row for row in r["rows"]}
    lines = ["## QLoRA memory per rank, planned against measured (`qlora_memory`)", "",
             f"{r['config']}, on {r['cpu']}. Bytes per rank: measured as the tensors' own storages (exact; FSDP's "
             "shards as it allocates them) and, for what a step adds, every storage an operator creates at its "
             "current size (no process figure); planned by `shardlm plan` for the same config and layout "
             "(`shardlm/bench/qlora_memory.py` says how each differs, and why).", "",
             "| part | DP=1 planned | measured | ratio | FSDP DP=2 planned | rank 0 measured | ratio | "
             "rank 1 measured | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for part in PARTS:
        one, rank0, rank1 = (cells[key] for key in (("dp1", 0, part), ("fsdp_dp2", 0, part), ("fsdp_dp2", 1, part)))
        lines.append(f"| {labels[part]} | {one['planned']:,} | {one['measured']:,} | {one['ratio']:.4f} | "
                     f"{rank0['planned']:,} | {rank0['measured']:,} | {rank0['ratio']:.4f} | "
                     f"{rank1['measured']:,} | {rank1['ratio']:.4f} |")
    mib = 2 ** 20
    for name, label in (("dp1", "DP=1"), ("fsdp_dp2", "FSDP DP=2")):
        p = r["plan"][name]
        lines += ["", f"{label}: the plan's step peak is the gradients ({p['gradients'] / mib:.2f} MiB), the "
                  f"activations ({p['activations'] / mib:.2f} MiB), FSDP's gathered units ({p['gathered'] / mib:.2f} "
                  f"MiB) and the largest layer's dequantized weights ({p['dequantized'] / mib:.2f} MiB)."]
    halving = ", ".join(f"{labels[k].split(' (')[0].split(',')[0]} {v:.4f}" for k, v in r["fsdp_halving"].items())
    p = r["plan"]["dp1"]
    lines += ["", f"FSDP DP=2 rank 0 / one process (`qlora_memory.fsdp_halving`): {halving}. The whole model's NF4 "
              f"base: {p['nf4_parameters']:,} weights in {p['nf4_whole_model_bytes']:,} bytes, "
              f"{p['bits_per_weight']:.3f} bits a weight.", ""]
    return lines
