"""Writing `benchmarks.json` and `BENCHMARKS.md` from the collected figures (atomically)."""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.bench.common import median_cell
from shardlm.checkpoint.files import write_atomically

# The keys of benchmarks.json users may rely on (dotted paths), with what each holds. Every figure
# with a median also has min, max and the raw values.
KEYS = {
    "machine": "cpu, cores, python, torch, platform, date of the run",
    "train_vs_hf.ratio": "shardlm tokens/s / transformers GPT2LMHeadModel as shipped, per interleaved repeat "
                         "(fp32, BENCH's vocabulary)",
    "train_vs_hf.ratio_same_kernels": "shardlm tokens/s / transformers with PyTorch's tanh-GeLU kernel (the control)",
    "train_vs_hf.shardlm_tokens_per_sec": "shardlm TP=1 training tokens/s",
    "train_vs_hf.hf_tokens_per_sec": "transformers (as shipped) training tokens/s",
    "train_vs_hf.hf_fused_gelu_tokens_per_sec": "transformers with `gelu_pytorch_tanh` training tokens/s",
    "train_vs_hf.cpu_features": "the CPU's matrix features (matrix: AMX, AVX-512-BF16, AVX-512 or AVX2; native_bf16; "
                                "bf16_note when bf16 is skipped)",
    "train_vs_hf.by_vocabulary": "per vocabulary (8192, 50257) and precision (fp32; bf16 on a CPU with native bf16): "
                                 "tokens/s of shardlm, shardlm_train (the `shardlm train` loop), shardlm_half, "
                                 "shardlm_compiled (`train.compile`), hf, hf_fused_gelu and the ratios "
                                 "ratio[_train|_half|_compiled][_same_kernels], "
                                 "train_command_over_step, gemm_gflops (the GEMM probes), step_gemm_gflops (the "
                                 "step's own GEMMs alone), step_gemm_of_best and mfu[_half] (paired)",
    "goals.rows": "each speed goal of the run: goal, key (the figure it reads), value (its median), target, met, "
                  "and why (for a missed one, from the run's figures: the profiled steps by kind of operator, or the "
                  "rate of the step's own GEMMs)",
    "goals.missed": "how many of goals.rows are missed",
    "deepseek.fp32.breakdown": "one profiled step of shardlm and hf after the timed rounds: self ms per kind of "
                               "operator (gemm, attention, triangular_solve, optimizer, other) and the wall total; "
                               "the same in every family's section and precision",
    "mfu.fraction": "median over repeats of shardlm's achieved matmul FLOP/s / the fp32 GEMM rate probed in the "
                    "same repeat",
    "mfu.gemm_ceiling_gflops": "median 1024x1024 fp32 matmul rate with the same threads, probed between the steps",
    "mfu.gemm_ceilings_gflops": "median matmul rate per dtype (fp32; bf16 on a CPU with native bf16) and square size "
                                "(1024, 2048)",
    "mfu.by_vocabulary": "per vocabulary and program (fp32, bf16, bf16_half): achieved GFLOP/s, fraction of the "
                         "1024x1024 ceiling, fraction_of_best, step_gemm_gflops (the rate of the step's own linear-"
                         "layer GEMMs timed alone), step_gemm_of_best, fraction_of_step_gemms and breakdown (one "
                         "profiled shardlm step by kind of operator)",
    "tp2_efficiency.shardlm": "shardlm tokens/s at TP=2 (2 x 1 thread) / TP=1 (1 x 2 threads)",
    "tp2_efficiency.torch_tp": "the same ratio for PyTorch's `tensor.parallel` on an equivalent model",
    "comm.matches_formula": "true when every collective's calls and elements equal the formula",
    "comm.tp2.rows": "per collective at TP=2: measured, expected, match",
    "comm.dp2.rows": "per collective at DP=2: measured, expected, match",
    "memory.rows": "per TP size: state bytes, analytic ideal, activation bytes saved for backward and peak "
    "forward+backward bytes, each with and without checkpointing",
    "plan3d.memory": "per (PP rank, TP rank) of PP=2 layouts in a world of 8: measured and predicted parameter "
                     "elements, state bytes and the peak of bytes saved for backward during one step",
    "plan3d.time": "per layout in a world of 2: measured and predicted step seconds and their ratios to DP=2",
    "pipeline.rows": "PP=2 per schedule and micro-batch count: measured step seconds, the ideal (one process / 2), "
    "the predicted bubble (P-1)/(V m) and peak bytes per stage",
    "pipeline.zero_bubble.rows": "PP=2 per schedule (1F1B, interleaved 1F1B, interleaved zero bubble, ZB-V, "
    "DualPipeV) at m micro-batches: median step seconds; from one recorded step its span, busy and idle seconds per "
    "rank and measured bubble; the median forward / input-gradient / weight-gradient seconds (f, i, w) and the "
    "makespan, bubble and idle per rank that PyTorch's order of the schedule promises for them",
    "moe.single_process": "per precision: tokens/s of shardlm's MoE step, transformers' Mixtral as shipped (hf) and "
                          "with its per-expert loop (hf_eager), ratio and ratio_eager, hf_experts_implementation, "
                          "experts_dtype (the dtype each program's expert GEMMs ran in, measured in one step)",
    "moe.single_process.fp32.ratio": "shardlm MoE tokens/s / transformers' Mixtral as shipped, per repeat (fp32)",
    "moe.expert_parallel.ep2_efficiency": "tokens/s at EP=2 (2 x 1 thread) / one process x 2 threads, same batch",
    "moe.expert_parallel_bf16": "the same EP=2 / DP=2 / one-process figures in bf16 autocast where the CPU "
                                "multiplies bf16 natively, else {skipped: why}",
    "moe.expert_parallel.all_to_all.matches_formula": "true when one EP=2 step's all-to-all bytes (summed over the "
                                                      "group) and calls per rank equal the formula",
    "deepseek.fp32.ratio": "shardlm tokens/s / transformers' DeepseekV3ForCausalLM as shipped, per round (fp32; "
                           "deepseek.bf16.ratio under bf16 autocast where the CPU has native bf16)",
    "deepseek.fp32": "per precision: step_ms and tokens_per_sec of shardlm, hf (as shipped) and hf_eager (its "
                     "per-expert loop), ratio, ratio_eager, hf_experts_implementation, experts_dtype",
    "deepseek.loss_check.match": "true when transformers' losses of steps 1 and 2 (fp32, same weights and batch) are "
                                 "within 1e-4 of shardlm's",
    "deepseek.goal.met": "true when the fp32 median of deepseek.fp32.ratio is at least 1.2",
    "gpt_oss.fp32.ratio": "shardlm tokens/s / transformers' GptOssForCausalLM as shipped, per round (fp32; "
                          "gpt_oss.bf16.ratio under bf16 autocast where the CPU has native bf16)",
    "gpt_oss.fp32": "per precision: step_ms and tokens_per_sec of shardlm, hf (as shipped) and hf_eager (its "
                    "per-expert loop), ratio and ratio_eager per round, hf_attn_implementation and "
                    "hf_experts_implementation (what transformers ran as shipped), experts_dtype",
    "gpt_oss.loss_check.match": "true when transformers' losses of steps 1 and 2 (fp32, same weights and batch) are "
                                "within 1e-4 of shardlm's",
    "gpt_oss.goal.met": "true when the fp32 median of gpt_oss.fp32.ratio is at least 1.2",
    "linear_attention.train_vs_hf.fp32.ratio": "shardlm tokens/s / transformers' Qwen3_5MoeForCausalLM as shipped "
                                               "(its PyTorch Gated DeltaNet on a CPU), per round (fp32; "
                                               "...bf16.ratio under bf16 autocast where the CPU has native bf16)",
    "linear_attention.train_vs_hf.loss_check.match": "true when transformers' Qwen3.5-MoE losses of steps 1 and 2 "
                                                     "(fp32, same weights and batch) are within 1e-4 of shardlm's",
    "linear_attention.train_vs_hf.goal.met": "true when the fp32 median of linear_attention.train_vs_hf.fp32.ratio "
                                             "is at least 1.2",
    "linear_attention.scaling.rows": "per sequence length (batch 1, fp32): forward + backward ms of the hybrid "
                                     "stack (3 Gated DeltaNet + 1 full attention) and of as many full-attention "
                                     "layers (hybrid_ms, attention_ms), speedup = attention / hybrid per round, "
                                     "us per token, rounds run (fewer, or `skipped` with the projection, past "
                                     "the section's time budget)",
    "sparse_attention.train_vs_hf.fp32.ratio": "shardlm tokens/s / transformers' DeepseekV32ForCausalLM as shipped "
                                               "(its indexer's top-k as a dense mask for SDPA), per round (fp32; "
                                               "both without the indexer's loss, as transformers trains); goal 1.2",
    "sparse_attention.train_vs_hf.fp32.ratio_kl": "the same with shardlm training its indexers by their KL loss "
                                                  "(shardlm_kl; transformers trains no indexer)",
    "sparse_attention.train_vs_hf.loss_check.match": "true when transformers' DeepSeek-V3.2 losses of steps 1 and 2 "
                                                     "(fp32, same weights and batch) are within 1e-4 of shardlm's",
    "sparse_attention.v4_train_vs_hf.fp32.ratio": "shardlm tokens/s / transformers' DeepseekV4ForCausalLM as shipped, "
                                                  "per round (fp32); goal 1.2",
    "sparse_attention.v4_train_vs_hf.loss_check.match": "true when transformers' DeepSeek-V4 losses of steps 1 and 2 "
                                                        "(fp32, same weights and batch) are within 1e-4 of shardlm's",
    "sparse_attention.layer.rows": "per sequence length (one MLA layer, batch 1, fp32, forward + backward): dense_ms "
                                   "and per top-k k dsa_<k> (ms, choice_ms: the indexer's scoring and top-k inside "
                                   "it, speedup = dense / DSA per round, saved_bytes alive for the backward when the "
                                   "forward ends, peak_bytes, saved_ratio = DSA / dense saved bytes), "
                                   "dense_saved_bytes, dense_peak_bytes, rounds (`skipped` with the projection past "
                                   "the time budget)",
    "sparse_attention.layer_bytes.saved_ratio": "bytes one MLA layer at DeepSeek-V3.2's proportions saves for the "
                                                "backward with DSA (top-512) / without (dense), per token "
                                                "(dense_saved_bytes_per_token, dsa_saved_bytes_per_token)",
    "families.mistral4.fp32.ratio": "shardlm tokens/s / transformers' Mistral4ForCausalLM as shipped, per round "
                                    "(fp32; ...bf16.ratio under bf16 autocast where the CPU has native bf16); goal 1.2",
    "families.mistral4.loss_check.match": "true when transformers' Mistral Small 4 losses of steps 1 and 2 (fp32, same "
                                          "weights and batch) are within 1e-4 of shardlm's",
    "families.olmo3.fp32.ratio": "shardlm tokens/s / transformers' Olmo3ForCausalLM as shipped, per round (fp32)",
    "families.olmo3.loss_check.match": "the same check for OLMo 3",
    "families.minimax_m2.fp32.ratio": "shardlm tokens/s / transformers' MiniMaxM2ForCausalLM as shipped, per round "
                                      "(fp32)",
    "families.minimax_m2.loss_check.match": "the same check for MiniMax-M2",
    "families.gemma4.fp32.ratio": "shardlm tokens/s / transformers' Gemma4ForCausalLM as shipped, per round (fp32)",
    "families.gemma4.loss_check.match": "the same check for Gemma 4",
    "families.kimi_linear.fp32.ratio": "shardlm tokens/s / transformers' KimiLinearForCausalLM as shipped (KDA on "
                                       "its PyTorch fallback), per round (fp32)",
    "families.kimi_linear.loss_check.match": "the same check for Kimi Linear",
    "families.nemotron_h.fp32.ratio": "shardlm tokens/s / transformers' NemotronHForCausalLM as shipped (Mamba-2 on "
                                      "its PyTorch fallback), per round (fp32)",
    "families.nemotron_h.loss_check.match": "the same check for Nemotron-H",
    "context_parallel.memory.rows": "per context-parallel size C = 1, 2, 4: bytes saved for backward per rank in one "
                                    "forward + backward of one long sequence, C = 1's / C and their ratio",
    "context_parallel.memory_cap": "one long sequence under a per-process RLIMIT_DATA cap (cap_bytes): the C = 1 "
                                   "run's out_of_memory step, the C = 4 run's losses and per-rank peak resident "
                                   "bytes, the uncapped C = 1 reference, max_relative_difference, demonstrated",
    "context_parallel.cp2_efficiency": "tokens/s at CP = 2 (2 x 1 thread) / one process x 2 threads, same sequence",
    "context_parallel.balance": "per split (zigzag, contiguous) at C = 4: per-rank causal attention seconds and the "
                                "spread max / min - 1",
    "window.ring.saving": "1 - ms with / ms without the sliding window of context_parallel_attention forward + "
                          "backward at CP = 2 (2 x 1 thread, one long sequence with sinks), per round",
    "window.ring.blocks_per_rank": "per CP rank, with (window) and without (full) the window: the chunk blocks "
                                   "computed and skipped per pass",
    "window.one_process.saving": "1 - ms with / ms without the window of tiled_attention forward + backward, one "
                                 "process, per round; saving_vs_sdpa against causal SDPA (no sink)",
    "window.one_process.tiles": "tiles computed and skipped per pass by tiled_attention with the window",
    "window.kept_fraction": "(query, key) pairs the window keeps / the causal triangle's: an ideal kernel's saving "
                            "is 1 minus it",
    "fsdp.step_ms": "per data_sharding (none, optimizer, full) at DP=2 (2 x 1 thread): milliseconds per training step",
    "fsdp.step_ratio_to_none": "per data_sharding: step time / data_sharding none's, per round",
    "fsdp.memory": "per data_sharding: bytes rank 0 allocated that stay alive between steps (resident_bytes) and the "
                   "most alive at once during a step (peak_bytes), and peak_ratio_to_none",
    "fsdp.comm.matches_formula": "true when one FSDP step's all-gathers and reduce-scatters (calls, unsharded "
                                 "elements) equal the formula, resharded after the forward and kept gathered",
    "sft.attention": "forward + backward ms of attention over packed rows of real chat documents: "
                     "per_document_ms (`document_causal_attention`), dense_mask_ms (one SDPA with the block-causal "
                     "mask), causal_row_ms (causal SDPA over whole rows) and ratio_dense_over_per_document, per round",
    "sft.throughput.ratio": "shardlm SFT real (non-padding) tokens/s / TRL SFTTrainer's on the same tiny Qwen3, "
                            "records and bfd packing, per pair of steps (the two take turns, one step each)",
    "sft.throughput": "per trainer (shardlm, trl): tokens_per_sec, step_ms and real_tokens_per_step after the warm-up "
                      "steps; ratio_of_totals, trl_lm_head_loss_fraction (TRL's step share in its chunked LM head and "
                      "log-probabilities); `error` when it could not run",
    "lora.ratio_lora_over_trl_peft": "shardlm LoRA real tokens/s / TRL SFTTrainer + peft LoraConfig's on the sft "
                                     "section's tiny Qwen3 and records (r=16 on all-linear), per round of steps (the "
                                     "trainers take turns); goal 1.2",
    "preference.ratio": "shardlm DPO real tokens/s / TRL DPOTrainer's as shipped (its reference run each step) on "
                        "the sft section's tiny Qwen3 and Dolly pairs, per pair of steps (the two take turns); goal "
                        "1.2",
    "preference.ratio_without_trl_reference": "the same against TRL's step minus its reference model's forward",
    "preference.kto.ratio": "shardlm KTO real tokens/s / TRL KTOTrainer's as shipped (its reference run each step, "
                            "its KL sequences in the step) on the same model and the pairs unpaired, per pair of "
                            "steps; goal 1.2",
    "preference.trl_reference_share": "seconds in TRL's reference forward / its step seconds, per step; "
                                      "shardlm_reference_share: its precomputed pass per pair / (that + the training "
                                      "step's seconds per pair)",
    "rl.ratio": "TRL GRPOTrainer's step seconds / shardlm's GRPO step (rollouts + update) on the sft section's tiny "
                "Qwen3 and the same arithmetic prompts, per pair of steps (the two take turns); goal 1.5",
    "rl.shardlm": "per trainer (shardlm, trl): step_s and the shares of its step in generation, scoring (the "
                  "reference pass), update (forward, backward, AdamW) and other, completion tokens per step",
    "rl.with_reference.ratio": "the same ratio with beta > 0 (TRL's frozen reference model, shardlm's copy of the "
                               "weights swapped in)",
    "rl.decode.ratio": "shardlm InProcessGenerator's new tokens/s / transformers generate's (both with a KV cache) on "
                       "the same weights and sequences, per round",
    "distill.ratio": "shardlm distillation real tokens/s / TRL GKDTrainer's as shipped (offline: lmbda 0, seq_kd "
                     "off) on the sft section's tiny Qwen3 student, a larger Qwen3 teacher and the Dolly records, per "
                     "pair of steps (the two take turns); goal 1.5",
    "distill.shardlm_tokens_per_sec": "per trainer (shardlm, trl): tokens_per_sec, step_ms and real_tokens_per_step "
                                      "after the warm-up steps; ratio_of_totals, trl_conversations_per_step",
    "distill.shardlm_teacher_share": "seconds of a step inside the loss's teacher_context blocks (the teacher's "
                                     "layers and its output layer in each chunk of the divergence) / shardlm's "
                                     "step seconds, per step; "
                                     "shardlm_teacher_ms the seconds, shardlm_teacher_layers_ms the layers' part "
                                     "(forward hooks), shardlm_teacher_forward_calls (one a micro-batch) and "
                                     "shardlm_teacher_blocks per step",
    "distill.trl_teacher_share": "the same of TRL's teacher_model forward (LM head included, forward hooks) / its "
                                 "step seconds; trl_teacher_ms, trl_teacher_forward_calls (one a conversation)",
    "lora.ratio_lora_over_full": "shardlm LoRA tokens/s / shardlm fine-tuning every weight, per round",
    "optimizers.muon_minus_adamw_best_valid_loss": "best final validation loss of Muon minus AdamW's over the "
                                                    "learning-rate sweep (same steps and tokens; < 0: Muon better)",
    "optimizers.step_ms_ratio_muon_over_adamw": "median step ms of Muon's best run over AdamW's best run",
    "qlora_memory.rows": "QLoRA (nf4, r=16, all-linear) at one process (layout dp1) and FSDP DP=2 (fsdp_dp2), per "
                         "rank and part (nf4_base, frozen_fp32, adapters, adamw, gradients, forward_end, step_peak, "
                         "total): planned and measured bytes and measured / planned",
    "qlora_memory.plan": "per layout: `shardlm plan`'s bytes per rank by part, and the step peak's pieces "
                         "(activations, gathered, dequantized), the whole model's NF4 bytes and bits a weight",
    "qlora_memory.measured": "per layout, per rank: the parts measured, resident (alive between steps), "
                             "resident_other (of it, none of the parts), nf4_shard_bytes (FSDP's unpadded shards), "
                             "losses",
    "qlora_memory.fsdp_halving": "FSDP DP=2 rank 0's measured bytes / one process's, per part of the state and the "
                                 "gradients",
    "qlora_memory.cpu": "the CPU the section ran on",
    "lora.memory": "per shardlm run (lora, full): parameter_bytes (frozen base included), adam_moment_bytes, "
                   "step_peak_bytes (the most one step allocates beyond them), total_bytes, trainable_parameters",
    "sft.packing": "per strategy (bfd, pad = one conversation per row): rows, real tokens and efficiency (real tokens "
                   "per row token)",
    "checkpoint.save_s": "seconds to save parameters and Adam moments (fsync and sha256 included)",
    "checkpoint.load_s": "seconds to verify and load them",
    "preprocess.by_workers": "documents/s and tokens/s of `shardlm preprocess` per worker count",
    "eval.wikitext": "scored tokens/s of the WikiText perplexity evaluation",
    "eval.generation": "milliseconds per generated token with and without the KV cache",
}


def write_reports(results: dict, out_dir: Path) -> None:
    from shardlm.bench.goals import speed_goals

    out_dir.mkdir(parents=True, exist_ok=True)
    results = {**results, "goals": speed_goals(results)}
    report = json.dumps(results, indent=2, default=float) + "\n"
    write_atomically(out_dir / "benchmarks.json", lambda tmp: tmp.write_text(report))
    write_atomically(out_dir / "BENCHMARKS.md", lambda tmp: tmp.write_text(markdown(results)))


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# shardlm benchmarks",
        "",
        f"Measured by `make bench` on {m['date']}: {m['cpu']}, {m['cores']} cores, Python {m['python']}, "
        f"torch {m['torch']}"
        + (f", 1-minute load average {m['load_average'][0]} when it started" if m.get("load_average") else "")
        + f". Every figure is the median (min, max) over {r['repeats']} repeats; programs "
        "that are compared took turns in the same run, one round of all of them per repeat, in a new order "
        "every round so that no program keeps running right after the same other one; the ratios, taken "
        "within a round, are what to read on a noisy machine. Each section ran in its own new process, so its "
        "figures do not depend on the sections before it (`python -m shardlm.bench --only SECTION` measures it "
        "the same way). The same figures are in `benchmarks.json` (keys below in `code`).",
        "",
    ]
    from shardlm.bench.goals import markdown_lines as goal_lines
    from shardlm.bench.training_report import mfu_lines, train_lines

    if r.get("goals"):
        lines += goal_lines(r["goals"])

    if r.get("train_vs_hf"):
        lines += train_lines(r["train_vs_hf"])
    if "mfu" in r:
        lines += mfu_lines(r)
    p = r.get("tp2_efficiency")
    if p:
        tok = p["tokens_per_sec"]
        lines += [
            "## Tensor-parallel efficiency on this CPU (`tp2_efficiency`)",
            "",
            f"Config: {p['config']}. Efficiency = tokens/s at TP=2 / tokens/s at TP=1 of the same code.",
            "",
            "| program | TP=1 tokens/s | TP=2 tokens/s | efficiency |", "|---|---|---|---|",
            f"| shardlm (`tp2_efficiency.shardlm`) | {median_cell(tok['shardlm_tp1'], digits=0)} | "
            f"{median_cell(tok['shardlm_tp2'], digits=0)} | **{median_cell(p['shardlm'])}** |",
            f"| PyTorch `tensor.parallel` (`tp2_efficiency.torch_tp`) | {median_cell(tok['torch_tp1'], digits=0)} | "
            f"{median_cell(tok['torch_tp2'], digits=0)} | {median_cell(p['torch_tp'])} |",
            "",
            "PyTorch's layout (written inside the benchmark, `shardlm/bench/torch_tp.py`) projects q, k, v "
            "separately (three backward all-reduces per layer where shardlm's fused QKV needs one) and runs the "
            "embedding, LM head and loss replicated on both ranks; shardlm's vocabulary-parallel LM head and "
            "cross-entropy split that work.",
            "",
        ]
    c = r.get("comm")
    if c:
        lines += [
            "## Communication per training step vs the formula (`comm.matches_formula`)",
            "",
            "Counted by shardlm's accounting layer (`ctx.comm`) over one step of the BENCH shape with one "
            "micro-batch per rank, against the documented formula (`shardlm/bench/tensor_parallel.py:expected_comm`): "
            "TP: 4 all-reduces of b*s*h per layer, 1 for the embedding, 1 for the LM head, 1 SUM of 2*b*s and 1 MAX "
            "of b*s for the cross-entropy, 1 scalar for the gradient norm; DP: every gradient element once plus the "
            "logged loss.",
            "",
            "| layout | collective | measured (calls, elements) | formula | match |", "|---|---|---|---|---|",
        ]
        for label in ("tp2", "dp2"):
            for key, row in c[label]["rows"].items():
                lines.append(f"| {label} | {key} | {row['measured']} | {row['expected']} | {row['match']} |")
        lines += ["", f"**`comm.matches_formula` = {c['matches_formula']}**", ""]
    mem = r.get("memory")
    if mem:
        lines += ["## Memory per rank (`memory`)", "", mem.get("config", ""), "",
                  "| TP | parameters+gradients+optimizer bytes | analytic ideal | match | saved for backward | "
                  "saved, checkpointing | peak in forward+backward | peak, checkpointing |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in mem["rows"]:
            lines.append(f"| {row['tp']} | {row['state_bytes']:,} | {row['ideal_state_bytes']:,} | "
                         f"{row['state_bytes'] == row['ideal_state_bytes']} | {row['activation_bytes']:,} | "
                         f"{row['activation_bytes_checkpointed']:,} | {row['peak_step_bytes']:,} | "
                         f"{row['peak_step_bytes_checkpointed']:,} |")
        lines.append("")
    pp = r.get("pipeline")
    if pp:
        lines += ["## Pipeline parallelism (`pipeline`)", "", pp.get("config", ""), "",
                  "| schedule | V | m | one process s | PP=2 measured s | ideal s | predicted bubble | predicted s | "
                  "measured overhead | peak MB per stage |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in pp["rows"]:
            peaks = " / ".join(f"{b / 1e6:.1f}" for b in row["peak_bytes_per_stage"])
            lines.append(f"| {row['schedule']} | {row['virtual_stages']} | {row['micro_batches']} | "
                         f"{row['one_process_s']:.3f} | {row['measured_s']:.3f} | {row['ideal_s']:.3f} | "
                         f"{row['predicted_bubble']:.0%} | {row['predicted_s']:.3f} | {row['measured_overhead']:.0%} | "
                         f"{peaks} |")
        lines.append("")
        if pp.get("zero_bubble"):
            from shardlm.bench.zero_bubble import markdown_lines as zero_bubble_lines

            lines += zero_bubble_lines(pp["zero_bubble"])
    if r.get("plan3d"):
        from shardlm.bench.plan3d import markdown_lines

        lines += markdown_lines(r["plan3d"])
    if r.get("moe"):
        from shardlm.bench.moe import markdown_lines as moe_lines

        lines += moe_lines(r["moe"])
    if r.get("deepseek"):
        from shardlm.bench.deepseek import markdown_lines as deepseek_lines

        lines += deepseek_lines(r["deepseek"])
    if r.get("gpt_oss"):
        from shardlm.bench.gpt_oss import markdown_lines as gpt_oss_lines

        lines += gpt_oss_lines(r["gpt_oss"])
    if r.get("linear_attention"):
        from shardlm.bench.linear_attention import markdown_lines as linear_attention_lines

        lines += linear_attention_lines(r["linear_attention"])
    if r.get("sparse_attention"):
        from shardlm.bench.sparse_attention import markdown_lines as sparse_attention_lines

        lines += sparse_attention_lines(r["sparse_attention"])
    if r.get("families"):
        from shardlm.bench.families import markdown_lines as families_lines

        lines += families_lines(r["families"])
    if r.get("context_parallel"):
        from shardlm.bench.context_parallel import markdown_lines as context_lines

        lines += context_lines(r["context_parallel"])
    if r.get("window"):
        from shardlm.bench.window import markdown_lines as window_lines

        lines += window_lines(r["window"])
    if r.get("fsdp"):
        from shardlm.bench.fsdp import markdown_lines as fsdp_lines

        lines += fsdp_lines(r["fsdp"])
    if r.get("sft"):
        from shardlm.bench.sft import markdown_lines as sft_lines

        lines += sft_lines(r["sft"])
    if r.get("lora"):
        from shardlm.bench.lora import markdown_lines as lora_lines

        lines += lora_lines(r["lora"])
    if r.get("qlora_memory"):
        from shardlm.bench.qlora_memory import markdown_lines as qlora_memory_lines

        lines += qlora_memory_lines(r["qlora_memory"])
    if r.get("preference"):
        from shardlm.bench.preference import markdown_lines as preference_lines

        lines += preference_lines(r["preference"])
    if r.get("rl"):
        from shardlm.bench.rl import markdown_lines as rl_lines

        lines += rl_lines(r["rl"])
    if r.get("distill"):
        from shardlm.bench.distill import markdown_lines as distill_lines

        lines += distill_lines(r["distill"])
    if r.get("optimizers"):
        from shardlm.bench.optimizers import markdown_lines as optimizer_lines

        lines += optimizer_lines(r["optimizers"])
    ck = r.get("checkpoint")
    if ck:
        lines += ["## Checkpoint save and load (`checkpoint`)", "", f"Config: {ck['config']}.", "",
                  f"Size {ck['bytes'] / 1e6:.1f} MB; save {median_cell(ck['save_s'])} s "
                  f"(~{ck['save_mb_per_s']:.0f} MB/s, including fsync and sha256); "
                  f"load and verify {median_cell(ck['load_s'])} s.", ""]
    pre = r.get("preprocess")
    if pre:
        lines += ["## Preprocessing (`preprocess`)", "",
                  f"GPT-2 BPE over {pre['input_bytes'] / 1e6:.1f} MB of the shared corpora ({pre['documents']} "
                  f"documents, {pre['tokens']} tokens), `shardlm preprocess --workers N`.", "",
                  "| workers | documents/s | tokens/s |", "|---|---|---|"]
        for workers, fig in pre["by_workers"].items():
            lines.append(f"| {workers} | {median_cell(fig['documents_per_second'], digits=0)} | "
                         f"{median_cell(fig['tokens_per_second'], digits=0)} |")
        lines.append("")
    ev = r.get("eval")
    if ev:
        lines += ["## Evaluation and generation (`eval`)", "", "```json", json.dumps(ev, indent=2, default=float),
                  "```", ""]
    lines += ["## Keys of `benchmarks.json`", "", "| key | meaning |", "|---|---|"]
    lines += [f"| `{key}` | {meaning} |" for key, meaning in KEYS.items()]
    lines.append("")
    for key, error in r.get("errors", {}).items():
        lines += [f"**{key}: not measured** ({error})", ""]
    lines += ["## GPU", "", r.get("gpu_note", ""), ""]
    return "\n".join(lines)
