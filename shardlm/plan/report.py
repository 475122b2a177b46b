"""The planner's output: a rich table for people, a JSON document for scripts."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.table import Table

from shardlm.plan.memory import GB, parameter_count
from shardlm.plan.paper import BASELINE_TFLOPS, Comparison
from shardlm.plan.planner import Plan, PlanRow

ASSUMPTIONS = [
    "compute = matmul FLOPs (72 B s l h^2 (1 + s/6h + V/12lh), + the layers' forward again when recomputing) "
    "/ (GPUs x peak x compute efficiency)",
    "TP all-reduces (4 per layer per micro-batch, +2 recomputed) are not overlapped with compute",
    "DP gradient all-reduce overlaps the last micro-batch's backward; the dp_overlap fraction of it hides",
    "ring all-reduce: 2(p-1)/p x bytes / (achieved per-direction bandwidth) + 2(p-1) x latency",
    "memory = parameters + gradients + optimizer + peak saved activations + logits + reserve",
]


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f}"


def row_dict(row: PlanRow) -> dict:
    """One layout as plain numbers (bytes and seconds)."""
    choice, time = row.choice, row.choice.time
    acts = choice.activations
    return {
        "tp": row.tp, "dp": row.dp, "micro_batch": choice.layout.micro_batch,
        "accumulation": choice.accumulation, "checkpointing": choice.layout.checkpointing,
        "parameters_per_rank": row.params.total, "sharded_parameters": row.params.sharded,
        "replicated_parameters": row.params.replicated,
        "memory_bytes": {
            "parameters": row.state.parameters, "gradients": row.state.gradients, "optimizer": row.state.optimizer,
            "activations_peak_no_checkpointing": acts.peak(False),
            "activations_peak_checkpointing": acts.peak(True),
            "transient": acts.transient, "total": choice.total_bytes,
        },
        "fits": row.fits,
        "time_s": {"step": time.total_s, "compute": time.compute_s, "elementwise": time.elementwise_s,
                   "tp_comm": time.tp_comm_s, "dp_comm": time.dp_comm_s, "dp_exposed": time.dp_exposed_s,
                   "optimizer": time.optimizer_s},
        "tflops_per_gpu": time.tflops_per_gpu(row.tp * row.dp),
    }


def plan_dict(result: Plan) -> dict:
    """The whole plan as JSON-ready data."""
    request = result.request
    best = result.recommended
    return {
        "model": {"name": request.model.name, **dataclasses.asdict(request.model.config)},
        "gpu": dataclasses.asdict(request.gpu), "gpus": request.gpus, "global_batch": request.global_batch,
        "precision": request.precision, "implementation": request.implementation,
        "format": dataclasses.asdict(request.format), "reserve_gb": request.reserve_gb,
        "calibration": dataclasses.asdict(request.calibration), "assumptions": ASSUMPTIONS,
        "layouts": [row_dict(row) for row in result.rows], "skipped": result.skipped,
        "recommended": None if best is None else {"tp": best.tp, "dp": best.dp},
    }


def render_plan(result: Plan, console: Console) -> None:
    """Print the layouts table, the assumptions and the recommendation."""
    request, best = result.request, result.recommended
    cfg, gpu = request.model.config, request.gpu
    total_params = parameter_count(cfg, 1).total
    title = (f"{request.model.name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
             f"seq {cfg.seq_length}, vocab {cfg.vocab_size}, {total_params / 1e9:.3g}B parameters")
    console.print(f"[bold]{title}[/bold]")
    console.print(f"{request.gpus} x {gpu.name} ({gpu.memory_gb:g} GB, {gpu.peak_tflops:g} TFLOP/s, "
                  f"{gpu.gpus_per_node}/node, intra {gpu.intra_node_gbps:g} GB/s, inter {gpu.inter_node_gbps:g} "
                  f"GB/s/node); global batch {request.global_batch}; {request.format.name} "
                  f"({request.format.weight_bytes}+{request.format.grad_bytes}+{request.format.optimizer_bytes} "
                  f"bytes/parameter)")
    table = Table(header_style="bold")
    console.print("Memory in GB per GPU; act = peak saved activations of one micro-batch without / with "
                  "checkpointing; time in s per step; TF = TFLOP/s per GPU by the FLOP formula (counting "
                  "recomputation when checkpointing, as the paper does)")
    for name in ("TP", "DP", "micro x acc", "ckpt", "param", "grad", "optim", "act", "act ckpt", "total", "fits",
                 "step", "TP comm", "DP exp", "TF"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in result.rows:
        choice, time, acts = row.choice, row.choice.time, row.choice.activations
        mark = "[green]yes[/green]" if row.fits else "[red]no[/red]"
        style = "bold" if row is best else None
        table.add_row(str(row.tp), str(row.dp), f"{choice.layout.micro_batch} x {choice.accumulation}",
                      "on" if choice.layout.checkpointing else "off", _gb(row.state.parameters),
                      _gb(row.state.gradients), _gb(row.state.optimizer), _gb(acts.peak(False)),
                      _gb(acts.peak(True)), _gb(choice.total_bytes), mark, f"{time.total_s:.3f}",
                      f"{time.tp_comm_s:.3f}", f"{time.dp_exposed_s:.3f}",
                      f"{time.tflops_per_gpu(row.tp * row.dp):.1f}", style=style)
    console.print(table)
    for line in ASSUMPTIONS:
        console.print(f"  - {line}")
    c = request.calibration
    console.print(f"  - calibration: compute efficiency {c.compute_efficiency:.3f}, link efficiency "
                  f"{c.link_efficiency:.3f}, DP overlap {c.dp_overlap:.3f} (fitted on the paper's V100 runs)")
    for key, reason in result.skipped.items():
        console.print(f"  [dim]skipped {key}: {reason}[/dim]")
    if best is None:
        console.print("[red]No layout fits: use more GPUs, a smaller micro-batch or a smaller model.[/red]")
    else:
        console.print(f"[bold]Recommended: TP={best.tp} x DP={best.dp}[/bold], micro-batch "
                      f"{best.choice.layout.micro_batch}, checkpointing "
                      f"{'on' if best.choice.layout.checkpointing else 'off'}: "
                      f"{best.choice.time.total_s:.3f} s/step, {_gb(best.choice.total_bytes)} GB per GPU")


def comparison_dict(rows: list[Comparison]) -> list[dict]:
    return [{**dataclasses.asdict(row), "difference": row.difference} for row in rows]


def render_comparison(rows: list[Comparison], console: Console) -> None:
    """The paper's Table 1 beside the model's predictions."""
    console.print(f"[bold]Weak scaling on the paper's hardware (V100 DGX-2H), relative to "
                  f"{BASELINE_TFLOPS:g} TFLOP/s on one GPU[/bold]")
    table = Table(header_style="bold")
    for name in ("model", "TP", "GPUs", "paper %", "predicted %", "difference", "note"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(row.model, str(row.tp), str(row.gpus), f"{row.paper:.0f}", f"{row.predicted:.1f}",
                      f"{row.difference:+.1f}", "fitted" if row.fitted else "predicted")
    console.print(table)
