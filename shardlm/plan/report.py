"""The planner's output: a rich table for people, a JSON document for scripts."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.table import Table

from shardlm.plan.experts import activated_parameter_count
from shardlm.plan.lora_memory import describe_lora, lora_summary
from shardlm.plan.memory import GB
from shardlm.plan.paper import BASELINE_TFLOPS, Comparison
from shardlm.plan.parameters import parameter_count
from shardlm.plan.planner import Plan, PlanRow
from shardlm.plan.recurrent import MOE_BLOCK_NOTE
from shardlm.plan.schedule_sim import SPLIT_BACKWARD

ASSUMPTIONS = [
    "compute = matmul FLOPs (72 B s l h^2 (1 + s/6h + V/12lh), + the layers' forward again when recomputing) "
    "/ (GPUs x peak x compute efficiency)",
    "TP all-reduces (4 per layer per micro-batch, +2 recomputed) are not overlapped with compute",
    "DP gradient all-reduce overlaps the last micro-batch's backward; the dp_overlap fraction of it hides "
    "(with a pipeline it runs after the flush: nothing hides)",
    "pipeline: bubble (P-1)/(V m) of the rank's work; each micro-batch crosses the rank's V stage boundaries "
    "forward and backward, not overlapped; the first stage keeps the schedule's in-flight micro-batches",
    "ring all-reduce: 2(p-1)/p x bytes / (achieved per-direction bandwidth) + 2(p-1) x latency",
    "memory = parameters + gradients + optimizer (1/DP of it with the distributed optimizer) + peak saved "
    "activations of the in-flight micro-batches + logits + reserve, on the busiest pipeline stage",
    "CP: a rank keeps the activations and per-token work of T/C tokens; the K/V ring (C-1 hops forward, K/V and "
    "fp32 dK/dV backward, per layer and micro-batch) overlaps the two attention blocks computed per hop, only "
    "the rest is exposed; gradients and the distributed optimizer span DP x CP",
    "FSDP (data sharding full): parameters, gradients and optimizer state / DP on every rank, plus the root and two "
    "layers gathered and the unsharded gradients awaiting their reduce-scatter (all of them under accumulation); "
    "per layer an all-gather before the forward and before each backward and one reduce-scatter, on the DP "
    "group's link, the dp_overlap fraction hidden behind the layer's forward or backward",
    "FSDP with pipeline stages: each stage an FSDP root; every backward keeps its layers gathered and gradients "
    "unsharded (all of the rank's units at the peak), one reduce-scatter per unit after the flush, not hidden; "
    "with MoE: split experts are their own units over DP x CP / EP ranks; hybrid (full/S): state / S, gathers "
    "on the S x TP consecutive GPUs' link, plus an all-reduce of each gradient shard across the shard groups",
    "MoE: FLOPs count the activated experts (top-k + shared + router); a rank holds 1/EP of the experts, whose "
    "gradients are reduced (and, with the distributed optimizer, state sharded) over DP x CP/EP ranks "
    "(EP folds over DP x CP, each CP rank routing its T/C tokens); routing is "
    "assumed uniform (each rank's experts get b s k rows); each MoE layer's all-to-all (dispatch + combine "
    "forward and backward, again when recomputing) is not overlapped",
]
MUON_ASSUMPTION = (
    "Muon (--optimizer muon): the layers' weight matrices keep one fp32 momentum (4 B/param, no step), the rest "
    "AdamW; its step (the Muon column) adds each TP-split matrix's update all-gathered over TP (fp32, by the DP rank "
    "that orthogonalizes it), with ZeRO-1/FSDP one all-gather and one reduce-scatter of the matrices over the "
    "sharding group (fp32, matrix i orthogonalized by DP rank i mod d) and the Newton-Schulz iterations, "
    "ns_steps (4 m^2 n + 2 m^3) FLOPs per (m <= n) matrix at the GEMM rate (1/d of them with ZeRO-1/FSDP), none "
    "overlapped")
ZERO_BUBBLE_ASSUMPTION = (
    "zero-bubble schedules (interleaved-zb, zbv, dualpipev): bubble and in-flight micro-batches from a replay of "
    "PyTorch's own action order with a stage's forward, input-gradient and weight-gradient backward equal (the "
    "input half again as long under full recomputation), transfers free; a micro-batch's activations live from its "
    "forward to its weight-gradient step; zbv and dualpipev put stages r and 2P - 1 - r on rank r (rank 0: the "
    "embedding and the output layer, one word embedding)")
LORA_ASSUMPTION = (
    "[lora]: the frozen base (fp32; with quantize = \"nf4\" the layers' projections in NF4) has no gradient or "
    "optimizer state, the adapters and modules_to_save take the run's; FSDP shards the base with them; the layers' "
    "GEMMs save their weights as full fine-tuning does, plus autocast's copies of the fp32 base with half parameters "
    "and, in fp32 under full recomputation, the recomputed layer's dequantized NF4 weights; the largest layer's "
    "dequantized weights (fp32) once; the adapters' own activations are not counted and the step time is full "
    "fine-tuning's")
CORE_ASSUMPTIONS = [
    "megatron-core (today's Megatron-Core / the Llama 3 stack): causal flash attention executes half of the s x s "
    "blocks, 2.5x the forward's FLOPs backward, at its own measured efficiency; bf16 weights, fp32 gradients "
    "sharded with the optimizer state (ZeRO-2); the gradient reduce-scatter overlaps the backward also with "
    "stages; CP all-gathers K/V (exposed); pipelines may put one layer fewer on the first and last stage",
]


SHARDING_CELL = {"none": "none", "optimizer": "optim", "full": "full"}


def _sharding_cell(layout) -> str:
    """The shard column: none, optim, full, or hybrid sharding as "full/S"."""
    cell = SHARDING_CELL[layout.data_sharding]
    return f"{cell}/{layout.fsdp_shard_size}" if layout.full_sharding and layout.fsdp_shard_size else cell


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f}"


def _muon_dict(choice) -> dict | None:
    """Muon's step on the rank `Choice.muon` describes (bytes it sends, FLOPs, seconds), or None with AdamW."""
    muon = choice.muon
    if muon is None:
        return None
    return {"tp_gather_bytes": muon.tp_bytes, "dp_exchange_bytes": muon.dp_bytes, "newton_schulz_flops": muon.flops,
            "seconds": {"total": muon.seconds, "tp_gather": muon.tp_s, "dp_exchange": muon.dp_s,
                        "newton_schulz": muon.ns_s}}


def _assumptions(request) -> list[str]:
    return (ASSUMPTIONS + (CORE_ASSUMPTIONS if request.implementation == "megatron-core" else [])
            + ([MUON_ASSUMPTION] if request.optimizer == "muon" else [])
            + ([ZERO_BUBBLE_ASSUMPTION] if request.schedule in SPLIT_BACKWARD else [])
            + ([LORA_ASSUMPTION] if request.model.lora.rank else [])
            + ([MOE_BLOCK_NOTE] if "E" in request.model.config.layer_pattern else []))


def row_dict(row: PlanRow) -> dict:
    """One layout as plain numbers (bytes and seconds)."""
    choice, time = row.choice, row.choice.time
    acts = choice.activations
    layout = choice.layout
    return {
        "pp": row.pp, "tp": row.tp, "dp": row.dp, "ep": row.ep, "cp": row.cp, "micro_batch": layout.micro_batch,
        "accumulation": choice.accumulation, "checkpointing": layout.checkpointing,
        "virtual_stages": layout.virtual, "schedule": layout.schedule if row.pp > 1 else None,
        "sequence_parallel": layout.sequence_parallel, "recompute": layout.recompute,
        "distributed_optimizer": layout.distributed_optimizer, "data_sharding": layout.data_sharding,
        "fsdp_shard_size": layout.fsdp_shard_size,
        "busiest_stage": choice.busiest_stage,
        "parameters_per_rank": row.params.total, "sharded_parameters": row.params.sharded,
        "replicated_parameters": row.params.replicated, "expert_parameters": row.params.expert,
        "memory_bytes": {
            "parameters": row.state.parameters, "gradients": row.state.gradients, "optimizer": row.state.optimizer,
            "activations_peak_no_checkpointing": acts.peak(False),
            "activations_peak_checkpointing": acts.peak(True),
            "transient": acts.transient, "activations_peak": choice.activation_peak,
            "fsdp_gathered": choice.gathered, "dequantized": choice.dequantized, "total": choice.total_bytes,
        },
        "fits": row.fits,
        "time_s": {"step": time.total_s, "compute": time.compute_s, "elementwise": time.elementwise_s,
                   "tp_comm": time.tp_comm_s, "dp_comm": time.dp_comm_s, "dp_exposed": time.dp_exposed_s,
                   "optimizer": time.optimizer_s, "bubble": time.bubble_s, "p2p": time.p2p_s,
                   "ep_comm": time.ep_comm_s, "cp_comm": time.cp_comm_s, "cp_ring": time.cp_ring_s,
                   "muon": time.muon_s},
        "muon": _muon_dict(choice),
        "tflops_per_gpu": time.tflops_per_gpu(layout.gpus),
    }


def plan_dict(result: Plan) -> dict:
    """The whole plan as JSON-ready data."""
    request = result.request
    best = result.recommended
    return {
        "model": {"name": request.model.name, **dataclasses.asdict(request.model.config)},
        "gpu": dataclasses.asdict(request.gpu), "gpus": request.gpus, "global_batch": request.global_batch,
        "precision": request.precision, "implementation": request.implementation, "optimizer": request.optimizer,
        "format": dataclasses.asdict(request.format), "reserve_gb": request.reserve_gb,
        "calibration": dataclasses.asdict(request.calibration),
        "assumptions": _assumptions(request),
        "lora": lora_summary(request.model.config, request.model.lora, request.format) if request.model.lora.rank
        else None,
        "layouts": [row_dict(row) for row in result.rows], "skipped": result.skipped,
        "recommended": None if best is None else row_dict(best),
    }


def render_plan(result: Plan, console: Console) -> None:
    """Print the layouts table, the assumptions and the recommendation."""
    request, best = result.request, result.recommended
    cfg, gpu = request.model.config, request.gpu
    total_params = parameter_count(cfg, 1).total
    title = (f"{request.model.name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
             f"seq {cfg.seq_length}, vocab {cfg.vocab_size}, {total_params / 1e9:.3g}B parameters")
    moe = bool(cfg.moe_num_experts)
    context = any(row.cp > 1 for row in result.rows)
    muon = request.optimizer == "muon"
    if moe:
        title += (f" ({activated_parameter_count(cfg) / 1e9:.3g}B activated: {cfg.moe_num_experts} experts of width "
                  f"{cfg.moe_ffn_size}, top-{cfg.moe_top_k})")
    console.print(f"[bold]{title}[/bold]")
    console.print(f"{request.gpus} x {gpu.name} ({gpu.memory_gb:g} GB, {gpu.peak_tflops:g} TFLOP/s, "
                  f"{gpu.gpus_per_node}/node, intra {gpu.intra_node_gbps:g} GB/s, inter {gpu.inter_node_gbps:g} "
                  f"GB/s/node); global batch {request.global_batch}; {request.format.name} "
                  f"({request.format.weight_bytes}+{request.format.grad_bytes}+{request.format.optimizer_bytes} "
                  f"bytes/parameter" + (f"; Muon's matrices {request.format.weight_bytes}+{request.format.grad_bytes}"
                                        f"+{request.format.optimizer_bytes - 4}" if muon else "") + ")")
    if request.model.lora.rank:
        console.print(describe_lora(lora_summary(cfg, request.model.lora, request.format)))
    table = Table(header_style="bold")
    console.print("Memory in GB per GPU on the busiest pipeline stage; act = peak activations of the in-flight "
                  "micro-batches (+ FSDP's gathered layers, + QLoRA's dequantized layer); SP = sequence parallel; "
                  "recomp = recomputation; shard = "
                  "data sharding (none, optim = distributed optimizer, full = FSDP, full/S = hybrid over S ranks); "
                  "DP exp = exposed DP all-reduce "
                  "or FSDP collectives; time in s per step; TF = TFLOP/s per GPU by the FLOP formula (counting "
                  "recomputation)"
                  + ("; EP = expert parallel, A2A = the MoE all-to-all" if moe else "")
                  + ("; CP = context parallel, ring = its exposed K/V transfers" if context else "")
                  + ("; Muon = Muon's step (TP and DP gathers, Newton-Schulz)" if muon else ""))
    columns = ["PP", "TP", "DP", "V", "micro x acc", "SP", "recomp", "shard", "param", "grad", "optim", "act",
               "total", "fits", "step", "bubble", "TP comm", "DP exp", "TF"]
    if moe:
        columns[3:3], columns[-2:-2] = ["EP"], ["A2A"]
    if context:
        columns[2:2], columns[-2:-2] = ["CP"], ["ring"]
    if muon:
        columns[-1:-1] = ["Muon"]
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for row in result.rows:
        choice, time, layout = row.choice, row.choice.time, row.choice.layout
        mark = "[green]yes[/green]" if row.fits else "[red]no[/red]"
        style = "bold" if row is best else None
        cells = [str(row.pp), str(row.tp), str(row.dp), str(layout.virtual),
                 f"{layout.micro_batch} x {choice.accumulation}", "on" if layout.sequence_parallel else "off",
                 layout.recompute, _sharding_cell(layout), _gb(row.state.parameters),
                 _gb(row.state.gradients), _gb(row.state.optimizer),
                 _gb(choice.activation_peak + choice.gathered + choice.dequantized),
                 _gb(choice.total_bytes), mark, f"{time.total_s:.3f}", f"{time.bubble_s:.3f}",
                 f"{time.tp_comm_s:.3f}", f"{time.dp_exposed_s:.3f}", f"{time.tflops_per_gpu(layout.gpus):.1f}"]
        if moe:
            cells[3:3], cells[-2:-2] = [str(row.ep)], [f"{time.ep_comm_s:.3f}"]
        if context:
            cells[2:2], cells[-2:-2] = [str(row.cp)], [f"{time.cp_comm_s:.3f}"]
        if muon:
            cells[-1:-1] = [f"{time.muon_s:.3f}"]
        table.add_row(*cells, style=style)
    console.print(table)
    for line in _assumptions(request):
        console.print(f"  - {line}")
    c = request.calibration
    source = "Megatron-LM's 2019 V100 runs" if c.memory_efficiency == 1.0 else \
        "the SC21 A100 runs (compute, memory) and the 2019 V100 runs (link, overlap)"
    if c.attention_efficiency:
        source += "; compute scaled by H100's measured GEMM efficiency over A100's, flash attention " \
            f"{c.attention_efficiency:.3f} / {c.attention_backward_efficiency:.3f} of peak (measured)"
    console.print(f"  - calibration: compute efficiency {c.compute_efficiency:.3f}, HBM efficiency "
                  f"{c.memory_efficiency:.3f}, link efficiency {c.link_efficiency:.3f}, DP overlap "
                  f"{c.dp_overlap:.3f} (fitted on {source})")
    for key, reason in result.skipped.items():
        console.print(f"  [dim]skipped PPxTPxDP{'(xEP)' if moe else ''}{'(-cpC)' if '-cp' in key else ''} {key}: "
                      f"{reason}[/dim]")
    if best is None:
        console.print("[red]No layout fits: use more GPUs, a smaller micro-batch or a smaller model.[/red]")
    else:
        layout = best.choice.layout
        pipeline = f"PP={best.pp} x " if best.pp > 1 else ""
        stages = (" (stages r and 2P - 1 - r on rank r)" if layout.v_shaped else
                  f" with {layout.virtual} virtual stages" if layout.virtual > 1 else "")
        schedule = f", {layout.schedule}{stages}" if best.pp > 1 else ""
        experts = f" (EP={best.ep})" if moe else ""
        context_size = f"CP={best.cp} x " if best.cp > 1 else ""
        console.print(f"[bold]Recommended: {pipeline}TP={best.tp} x {context_size}DP={best.dp}{experts}[/bold], "
                      "micro-batch "
                      f"{layout.micro_batch}{schedule}, sequence parallel "
                      f"{'on' if layout.sequence_parallel else 'off'}, recompute {layout.recompute}, data sharding "
                      f"{layout.data_sharding}"
                      + (f" (fsdp_shard_size {layout.fsdp_shard_size})" if layout.fsdp_shard_size else "") + ": "
                      f"{best.choice.time.total_s:.3f} s/step"
                      + (f" (Muon's step {best.choice.time.muon_s:.3f} s)" if muon else "")
                      + f", {_gb(best.choice.total_bytes)} GB per GPU")


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


def sc21_dict(rows) -> list[dict]:
    """`shardlm.plan.sc21.compare`'s rows as JSON-ready data."""
    return [{**dataclasses.asdict(c.row), "dp": c.row.dp, "virtual_stages": c.row.virtual,
             "predicted_tflops": c.predicted_tflops, "predicted_percent": c.predicted_percent,
             "difference_points": c.difference, "fitted": c.fitted,
             "time_s": {"step": c.time.total_s, "compute": c.time.compute_s, "elementwise": c.time.elementwise_s,
                        "tp_comm": c.time.tp_comm_s, "bubble": c.time.bubble_s, "p2p": c.time.p2p_s,
                        "dp_exposed": c.time.dp_exposed_s}} for c in rows]


def render_sc21(rows, console: Console) -> None:
    """Narayanan et al. 2021, Table 1, beside the planner's predictions."""
    console.print("[bold]Weak scaling on Selene (A100 80GB, 8 per server, 8 x 200 Gb/s HDR per server): "
                  "Narayanan et al. 2021, Table 1[/bold]")
    table = Table(header_style="bold")
    for name in ("model", "TP", "PP", "V", "GPUs", "batch", "micro", "paper TF", "predicted TF", "paper %",
                 "predicted %", "difference", "note"):
        table.add_column(name, justify="right")
    for c in rows:
        r = c.row
        table.add_row(r.name, str(r.tp), str(r.pp), str(r.virtual), str(r.gpus), str(r.global_batch),
                      str(r.micro_batch), f"{r.paper_tflops:g}", f"{c.predicted_tflops:.1f}", f"{r.paper_percent:g}",
                      f"{c.predicted_percent:.1f}", f"{c.difference:+.1f}", "fitted" if c.fitted else "predicted")
    console.print(table)


def llama3_dict(comparisons) -> list[dict]:
    """`shardlm.plan.llama3.compare`'s verdicts as JSON-ready data."""
    out = []
    for c in comparisons:
        t = c.as_run.time
        out.append({**dataclasses.asdict(c.row), "predicted_tflops": c.predicted_tflops, "error": c.error,
                    "as_run_bytes": c.as_run.total_bytes, "as_run_fits": c.as_run.fits, "rank": c.rank,
                    "planned_tflops": c.planned_tflops,
                    "time_s": {"step": t.total_s, "compute": t.compute_s, "tp_comm": t.tp_comm_s,
                               "bubble": t.bubble_s, "p2p": t.p2p_s, "cp_comm": t.cp_comm_s,
                               "dp_exposed": t.dp_exposed_s}})
    return out


def render_llama3(comparisons, console: Console) -> None:
    """Llama 3 405B's Table 4 (Meta 2024) beside the planner's predictions."""
    console.print("[bold]Llama 3 405B on H100s (8 per server, RoCE 400 Gb/s per GPU), --implementation "
                  "megatron-core: Meta 2024, Table 4[/bold]")
    table = Table(header_style="bold")
    for name in ("GPUs", "TP", "CP", "PP", "DP", "tokens", "batch", "paper TF", "predicted TF", "error",
                 "as run GB", "fits", "rank", "planner's TF"):
        table.add_column(name, justify="right")
    for c in comparisons:
        r = c.row
        table.add_row(str(r.gpus), str(r.tp), str(r.cp), str(r.pp), str(r.dp), str(r.sequence), str(r.global_batch),
                      f"{r.paper_tflops:g}", f"{c.predicted_tflops:.1f}", f"{100 * c.error:+.1f}%",
                      _gb(c.as_run.total_bytes), "yes" if c.as_run.fits else "no",
                      "-" if c.rank is None else str(c.rank + 1), f"{c.planned_tflops:.1f}")
    console.print(table)
    console.print("  predicted = the published layout as the paper ran it (micro-batch 1, no recomputation, SP, "
                  "gradients and optimizer state sharded, interleaved with V = 8 and the short end stages); rank = "
                  "its place among the fitting layouts the planner finds with --pipeline 16; planner's TF = the "
                  "planner's own best option for that layout; TFLOP/s in PaLM's MFU count (the paper's)")


def deepseek_dict(c) -> dict:
    """`deepseek.compare()` as JSON: the published and predicted tokens/s per GPU, the step's parts, memory, rank."""
    from shardlm.plan.deepseek import PUBLISHED_TOKENS_PER_GPU_S

    t = c.as_run.time
    return {"published_tokens_per_gpu_s": PUBLISHED_TOKENS_PER_GPU_S, "predicted_tokens_per_gpu_s": c.predicted,
            "error": c.error, "as_run_bytes": c.as_run.total_bytes, "as_run_fits": c.as_run.fits,
            "rank": c.rank, "time_s": {"step": t.total_s, "compute": t.compute_s, "elementwise": t.elementwise_s,
                                       "ep_exposed": t.ep_comm_s, "bubble": t.bubble_s, "dp_exposed": t.dp_exposed_s}}


def render_deepseek(c, console: Console) -> None:
    """DeepSeek-V3's run on 2,048 H800s (its technical report) beside the planner's prediction."""
    d = deepseek_dict(c)
    console.print("[bold]DeepSeek-V3 on 2,048 H800s, PP 16 x DP 128, EP 64, ZeRO-1, MTP 1, DeepSeek's stack "
                  "(FP8 GEMMs, DualPipe, node-limited routing): DeepSeek-AI 2024[/bold]")
    table = Table(header_style="bold")
    for name in ("published tok/s/GPU", "predicted", "error", "step s", "compute", "HBM passes", "a2a exposed",
                 "bubble", "as run GB", "fits", "rank"):
        table.add_column(name, justify="right")
    t = d["time_s"]
    table.add_row(f"{d['published_tokens_per_gpu_s']:.0f}", f"{c.predicted:.0f}", f"{100 * c.error:+.1f}%",
                  f"{t['step']:.2f}", f"{t['compute']:.2f}", f"{t['elementwise']:.2f}", f"{t['ep_exposed']:.2f}",
                  f"{t['bubble']:.2f}",
                  _gb(c.as_run.total_bytes), "yes" if c.as_run.fits else "no",
                  "-" if c.rank is None else str(c.rank + 1))
    console.print(table)
    console.print("  published = 14.8T tokens in 2.664M H800 GPU hours; predicted = the published layout as run "
                  "(micro-batch 1, no full recomputation); memory as DeepSeek stores it (FP8 activations, BF16 "
                  "moments, DualPipe's two stages a rank; docs/plan.md)")
