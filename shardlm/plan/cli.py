"""`shardlm plan`: memory per GPU and predicted step time of every PP x TP x DP layout, and a recommendation.

    shardlm plan --model gpt2-8.3b --gpus 512 --gpu h100 --global-batch 512
    shardlm plan --model qwen3-235b-a22b --gpus 64 --gpu h100 --param-dtype half --pipeline 8
    shardlm plan --model llama3-8b --gpus 16 --gpu h100 --global-batch 64 --optimizer muon
    shardlm plan --model sc21-145.6b --gpus 1536 --gpu a100 --global-batch 2304 --implementation megatron
    shardlm plan --model configs/tiny.toml --gpus 8 --gpu-memory 24 --flops 165 --gpus-per-node 8 \
        --intra-node-bw 64 --inter-node-bw 25 --global-batch 64 --json
    shardlm plan --validate-paper                  # Shoeybi et al. 2019, Table 1
    shardlm plan --validate-paper narayanan2021    # Narayanan et al. 2021 (SC21), Table 1
    shardlm plan --validate-paper llama3           # Llama 3 405B on H100s (Meta 2024), Table 4
    shardlm plan --validate-paper deepseek-v3      # DeepSeek-V3 on 2,048 H800s (its technical report)

Imports stay light here: the model code loads only when the command runs.
"""

from __future__ import annotations

import argparse

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
"""`--schedule`: `shardlm.plan.stages.SCHEDULES`, repeated here to keep the import light (a test keeps them equal)."""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="which PP x TP x CP x DP (x EP) layout fits, and how fast it runs",
        description="Per-GPU memory and predicted step time of every valid pipeline x tensor x data parallel "
                    "layout (and, for long sequences, context parallel size; for Mixture-of-Experts models, "
                    "expert parallel size), with micro-batch, "
                    "interleaving, sequence parallelism, recomputation and the data sharding (none, distributed "
                    "optimizer, FSDP) chosen per "
                    "layout. "
                    "Bandwidths: intra-node per GPU with both directions summed (as NVLink is quoted), "
                    "inter-node per node and direction.",
    )
    parser.add_argument("--model", help="model preset (gpt2-355m, gpt2-2.5b, gpt2-8.3b, bert-336m, bert-1.3b, "
                                        "bert-3.9b, scaling-1.2b/2.5b/4.2b/8.3b, llama3-8b, llama3-70b, "
                                        "the MoE models mixtral-8x7b, qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, "
                                        "moonlight-16b-a3b, glm-4.5, glm-4.5-air, gpt-oss-20b, gpt-oss-120b, "
                                        "the sparse-attention deepseek-v3.2 and glm-5, deepseek-v4 (= -flash), "
                                        "the hybrid linear-attention qwen3-next-80b-a3b, qwen3.5-27b, "
                                        "qwen3.5-35b-a3b, qwen3.5-397b-a17b, kimi-linear-48b-a3b (KDA and MLA), "
                                        "nemotron-h-8b and nemotron-3-nano-30b-a3b (Mamba-2 hybrids), "
                                        "mistral-small-4, minimax-m2, gemma-4-e4b, olmo-3-7b, olmo-3-32b, "
                                        "olmo-2-7b, olmo-2-13b, olmo-2-32b, "
                                        "the SC21 models sc21-1.7b ... sc21-1008b) or a "
                                        "shardlm TOML config")
    parser.add_argument("--gpus", type=int, help="total GPUs")
    parser.add_argument("--gpu", help="GPU preset: v100 (the paper's DGX-2H), a100, h100, h200, h800")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per server (preset: its server)")
    parser.add_argument("--gpu-memory", type=float, metavar="GB", help="GPU memory, overrides the preset")
    parser.add_argument("--flops", type=float, metavar="TFLOPS", help="peak half-precision TFLOP/s per GPU")
    parser.add_argument("--hbm-bw", type=float, metavar="GB/s", help="GPU memory bandwidth")
    parser.add_argument("--intra-node-bw", type=float, metavar="GB/s", help="NVLink/NVSwitch per GPU, bidirectional")
    parser.add_argument("--inter-node-bw", type=float, metavar="GB/s", help="network per node, per direction")
    parser.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step (default 512)")
    parser.add_argument("--micro-batch", type=int, default=None, help="fix the micro-batch (default: planner picks)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--implementation", default="shardlm", choices=("shardlm", "megatron", "megatron-core"),
                        help="shardlm: fp32 weights+grads+Adam (4+4+8 B/param), autocast activations; "
                             "megatron: SC21's Megatron, half weights+grads, fp32 master+Adam (2+2+12), unfused "
                             "softmax; megatron-core: today's Megatron-Core / Llama 3 stack, flash attention, "
                             "fp32 gradients (2+4+12), ZeRO-2 with the distributed optimizer")
    parser.add_argument("--checkpointing", default="auto", choices=("auto", "on", "off"),
                        help="older switch: on = --recompute full, off = --recompute none")
    parser.add_argument("--recompute", default="auto", choices=("auto", "none", "selective", "full"),
                        help="activation recomputation (default: the fastest that fits)")
    parser.add_argument("--sequence-parallel", default="auto", choices=("auto", "on", "off"),
                        help="split LayerNorm/dropout activations along the sequence over TP")
    parser.add_argument("--distributed-optimizer", default="auto", choices=("auto", "on", "off"),
                        help="older switch: on = --data-sharding optimizer, off = --data-sharding none")
    parser.add_argument("--data-sharding", default="auto", choices=("auto", "none", "optimizer", "full"),
                        help="train.data_sharding: none, optimizer (ZeRO-1: optimizer state over DP) or full "
                             "(FSDP: parameters, gradients and optimizer state over DP; default: the fastest "
                             "that fits)")
    parser.add_argument("--fsdp-shard-size", type=int, default=None,
                        help="train.fsdp_shard_size for FSDP layouts: hybrid sharding within groups of S DP x CP "
                             "ranks (0: over all of them; default: try 0 and GPUs per node / TP)")
    parser.add_argument("--param-dtype", default="fp32", choices=("fp32", "half"),
                        help="shardlm: half parameters with fp32 gradients and master weights (2+4+12 B/param)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                        help="train.optimizer: adamw (default), or muon: the layers' weight matrices keep one fp32 "
                             "momentum (4 B/param, no step) and the step adds Muon's TP all-gathers, its ZeRO-1/FSDP "
                             "all-gather and reduce-scatter and the Newton-Schulz FLOPs (shardlm implementation)")
    parser.add_argument("--pipeline", type=int, default=None, help="fix the pipeline size (default: search)")
    parser.add_argument("--expert", type=int, default=None,
                        help="fix the expert-parallel size of an MoE model (default: search the sizes dividing DP "
                             "x CP and the expert count)")
    parser.add_argument("--context", type=int, default=None,
                        help="fix the context-parallel size (default: 1, and every size for sequences of 8192+ "
                             "tokens of GPT and Llama)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="train at this sequence length instead of the model's (e.g. a long-context run)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="fix the virtual stages per pipeline rank (default: search; zbv and dualpipev run 2)")
    parser.add_argument("--schedule", default=None, choices=SCHEDULES,
                        help="fix the pipeline schedule (default: 1f1b, interleaved with virtual stages); the "
                             "zero-bubble interleaved-zb (ZB-H1 at one stage a rank), zbv and dualpipev (two "
                             "stages a rank in a V, rank 0 holding the first and the last; dualpipev needs 2P "
                             "micro-batches) are planned from PyTorch's own action order")
    parser.add_argument("--reserve-gb", type=float, default=2.0, help="memory kept for CUDA context and workspaces")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="fraction of peak FLOP/s reached (default: calibrated on Megatron's published runs: "
                             "0.32 on the 2019 V100s, 0.71 on the SC21 A100s, 0.66 on H100/H200 (A100's scaled "
                             "by measured GEMM efficiency), 0.71 for any other GPU)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--validate-paper", nargs="?", const="shoeybi2019",
                        choices=tuple(_PAPERS),
                        help="print a paper's table beside the predictions: shoeybi2019 (the default: Megatron-LM's "
                             "V100 efficiencies), narayanan2021 (SC21: 1.7B to 1T on A100s, TFLOP/s and %% of peak), "
                             "llama3 (Llama 3 405B on up to 16,384 H100s, Meta 2024, Table 4) or deepseek-v3 "
                             "(DeepSeek-V3 on 2,048 H800s, its technical report)")
    parser.set_defaults(func=run)


def _gpu(args: argparse.Namespace):
    from shardlm.plan.hardware import custom_gpu, gpu_preset

    base = gpu_preset(args.gpu) if args.gpu else None
    return custom_gpu(base, memory_gb=args.gpu_memory, peak_tflops=args.flops, hbm_gbps=args.hbm_bw,
                      gpus_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_bw,
                      inter_node_gbps=args.inter_node_bw)


def _llama3():
    from shardlm.plan import llama3, report

    return lambda: [llama3.compare(row) for row in llama3.TABLE4], report.llama3_dict, report.render_llama3


def _deepseek():
    from shardlm.plan import deepseek, report

    return deepseek.compare, report.deepseek_dict, report.render_deepseek


def _sc21():
    from shardlm.plan import report, sc21

    return sc21.compare, report.sc21_dict, report.render_sc21


def _shoeybi2019():
    from shardlm.plan import paper, report

    return paper.compare_table1, report.comparison_dict, report.render_comparison


_PAPERS = {"shoeybi2019": _shoeybi2019, "narayanan2021": _sc21, "llama3": _llama3, "deepseek-v3": _deepseek}
"""`--validate-paper NAME`: (the comparison, its JSON form, its table), imported only when asked for."""


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from rich.console import Console

    from shardlm.errors import UserError
    from shardlm.plan import report

    console = Console(width=None if Console().is_terminal else 140)
    if args.validate_paper:
        compare, as_dict, render = _PAPERS[args.validate_paper]()
        verdict = compare()
        if args.json:
            print(json.dumps(as_dict(verdict), indent=2))
        else:
            render(verdict, console)
        return 0
    if not args.model or not args.gpus:
        raise UserError("give --model and --gpus (or --validate-paper)")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency={args.efficiency} must be in (0, 1]")

    from shardlm.plan.generations import default_calibration
    from shardlm.plan.models import resolve_model
    from shardlm.plan.planner import PlanRequest, plan

    gpu = _gpu(args)
    calibration = default_calibration(gpu)
    if args.efficiency is not None:
        calibration = dataclasses.replace(calibration, compute_efficiency=args.efficiency)
    model = resolve_model(args.model)
    if args.seq_length is not None:
        if args.seq_length < 1:
            raise UserError(f"--seq-length={args.seq_length} must be at least 1")
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, seq_length=args.seq_length))
    request = PlanRequest(model=model, gpu=gpu, gpus=args.gpus,
                          global_batch=args.global_batch, precision=args.precision,
                          implementation=args.implementation, micro_batch=args.micro_batch,
                          checkpointing=args.checkpointing, recompute=args.recompute,
                          sequence_parallel=args.sequence_parallel, distributed_optimizer=args.distributed_optimizer,
                          data_sharding=args.data_sharding, fsdp_shard_size=args.fsdp_shard_size,
                          param_dtype=args.param_dtype, optimizer=args.optimizer, pipeline=args.pipeline,
                          expert=args.expert,
                          context=args.context,
                          virtual_stages=args.virtual_stages,
                          schedule=args.schedule, reserve_gb=args.reserve_gb, calibration=calibration)
    result = plan(request)
    if args.json:
        print(json.dumps(report.plan_dict(result), indent=2))
    else:
        report.render_plan(result, console)
    return 0
