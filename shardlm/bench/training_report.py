"""BENCHMARKS.md's training sections: shardlm vs transformers per vocabulary and precision, and the CPU MFU."""

from __future__ import annotations

from shardlm.bench.common import median_cell

GOAL_SAME_KERNELS, GOAL_AS_SHIPPED, GOAL_FP32_MFU = 1.0, 1.2, 0.80

PROGRAMS = (("shardlm", "shardlm Trainer step"), ("shardlm_train", "`shardlm train` loop"),
            ("shardlm_half", "shardlm, half-precision parameters"),
            ("shardlm_compiled", "shardlm, `train.compile`"), ("hf", "transformers as shipped"),
            ("hf_fused_gelu", "transformers, same kernels"))

# What was tried to cut the time outside the GEMMs, and what it gave (paired measurements while developing;
# the figures above are this run's).
TRIED = [
    "**Output layer + cross-entropy fused (kept; every TP size).** At TP=1 the step used to compute the padded "
    "logits, copy the real vocabulary out of them (`[..., :V]` is not contiguous once V is padded), write "
    "PyTorch's fp32 log-softmax, and in the backward fill zeros for the NLL gradient and for the slice's "
    "gradient and run the log-softmax backward: about six passes over the (tokens x V) logits besides the "
    "GEMMs, one more fp32 copy under bf16 autocast. At TP > 1 the vocabulary-parallel loss made about seven "
    "passes over its (tokens x V/p) slice and kept an fp32 softmax. `shardlm.parallel.linear_cross_entropy` "
    "multiplies by this rank's real vocabulary rows only (in bf16 and on GPUs now rounded up to a multiple of "
    "64, below) and turns the logits into their own gradient "
    "`softmax - onehot` in three passes, chunk by chunk (about 16 MiB of fp32 rows), with the same two "
    "all-reduces (MAX, SUM) of O(tokens) values; the backward scales the (tokens x h) side of its two GEMMs "
    "by the loss gradient instead of the logits. Output layer + loss, forward and backward, 2,048 tokens x "
    "50,257, one thread, CPU time, 3 paired repeats: fp32 4.72 s -> 3.45 s (-27%), bf16 autocast 6.38 s -> "
    "5.45 s (-15%). Whole Trainer step against transformers with the same kernels, one thread, CPU time, 5 "
    "paired repeats: 1.17x at V=50,257, 0.97x at V=8,192 (where the head is 12% of the FLOPs). Chunks of "
    "256 KiB to 16 MiB took the same CPU time on one thread; on two threads of a busy machine small chunks "
    "were 1.5-2.5x slower (every parallel region waits for both threads), hence 16 MiB.",
    "**Row-parallel bias inside the GEMM at TP=1, and one copy for the QKV gradient (kept).** With nothing "
    "to reduce, the row-parallel layer now calls `F.linear` with its bias (one `addmm`, like transformers' "
    "Conv1D) instead of `mm` and a separate add; splitting the fused QKV output with `split` instead of "
    "`permute` + `unbind` makes its backward write the three gradients into one contiguous tensor (unbind's "
    "stacks them, then the view copies again). Per layer, forward + backward, one thread, 9 paired repeats: "
    "row linear 28.9 -> 27.4 ms, attention input split + SDPA 93.8 -> 92.1 ms: small, kept because they cost "
    "nothing. A whole shardlm block then runs forward + backward in 287 ms against 306 ms for transformers' "
    "GPT2Block with the same kernels (2 threads, 15 paired repeats).",
    "**The Trainer around the step (nothing to change).** A Trainer step and a hand-written loop on the same "
    "model (forward, backward, clipping, fused AdamW) showed the same operators, calls and times in "
    "`torch.profiler` op totals, within the run-to-run noise of a shared machine (about 5% per operator).",
    "**Autocast's casts (measured; kept as they are).** In the bf16 step at V=8,192 the copies (autocast's casts "
    "of weights and of activations in and out of the GEMMs, and of their gradients) took 570 ms of 7.1 s of "
    "operator time in shardlm and 723 ms in transformers. Autocast caches a weight's bf16 copy only inside one "
    "`autocast` region, so with accumulation each weight is cast once per micro-batch; the BENCH step has one. "
    "`train.param_dtype = \"half\"` (the `shardlm_half` rows) keeps bf16 weights and removes those casts.",
    "**SDPA kernel choice (nothing to change).** On the CPU both libraries run "
    "`_scaled_dot_product_flash_attention_for_cpu` forward and backward, in fp32 and in bf16 (PyTorch's "
    "CPU flash kernel takes bf16); the math kernel would materialize the T x T scores.",
    "**LayerNorm, GeLU, residual adds and the optimizer (nothing to change).** The profiles show the same "
    "kernels, calls and times in shardlm and transformers (`native_layer_norm`, one `gelu` kernel in the "
    "control, fused AdamW).",
    "**`torch.compile` of shardlm's layers (an option: `train.compile`, the `shardlm_compiled` rows).** It "
    "changed the fp32 step time by about 2% on the AVX2 machine where it was first tried. On the Xeon with "
    "AVX-512-BF16 (BENCH shape, V=8,192, 2 threads, 7 paired repeats) the fp32 step was unchanged (eager / "
    "compiled 0.98) and the bf16 step 12% faster (1.12: Inductor fuses autocast's casts with LayerNorm, "
    "GeLU and the residual adds). Not the default: the first step compiles for about 15 s, and on the CPU "
    "Inductor needs a C++ compiler. On an H200 (GPT-2 1.5B) it gave +8%.",
    "**The output layer's GEMM width (kept for bf16 and GPUs).** The fused output layer + loss multiplied by "
    "the 50,257 real vocabulary rows, an odd width. On an H200 that sent cuBLAS to unaligned kernels (16% of "
    "a GPT-2 1.5B step). Rounding the width up to a multiple of 64 (the extra columns take no part in the "
    "softmax) made the bf16 head + loss 11% faster here too (2,048 tokens, hidden 512, 2 threads, 25 paired "
    "repeats); fp32 showed no difference, so fp32 on the CPU keeps the exact width.",
    "**Where the fp32 step goes (measured, Xeon with AVX-512-BF16, V=8,192, `torch.profiler` op totals over "
    "two steps).** GEMMs (`mm`, `addmm`) 67% of the operator time, running at about 236 GFLOP/s, the rate of "
    "a square 1024 x 1024 GEMM on the same threads; the CPU flash-attention kernel 18% (forward and backward "
    "together run at about half the GEMM rate counted in model FLOPs, which count the whole s x s score "
    "matrix, so at a quarter of it in the FLOPs a causal kernel does); GeLU and its backward 5%; everything "
    "else (copies, LayerNorm, bias sums, AdamW, the gradient norm) 10%. In bf16 the GEMMs are 69%, attention "
    "19%, the rest 11%. So the fp32 MFU is bounded by the attention kernel, not by work around the GEMMs.",
    "**A block-causal attention of batched GEMMs (not kept).** Queries in 4 blocks, each block multiplying "
    "only the keys it may see (10/16 of the full score matrix), `baddbmm` with the causal mask, the fused "
    "softmax and `bmm`, with a hand-written backward; equal to SDPA within 6e-6 (fp32). Keeping the "
    "probabilities for the backward, (B, heads, 512, 64) forward + backward took 38-42 ms against 52-60 ms "
    "for SDPA's flash kernel in fp32 and 44 against 75-92 ms in bf16 (2 threads, medians of 7) alone. Inside "
    "the whole BENCH Trainer step (7 paired repeats) it was 7% slower in fp32 (2.28 against 2.14 s: the "
    "copies of q, k, v and the 21 MB of probabilities per layer it keeps, B x heads x 10/16 x s^2 x 4 "
    "bytes, cost more than the kernel saved) and 6% faster in bf16 (min 0.84x, max 1.10x), while keeping "
    "the memory flash attention exists to avoid. Recomputing the probabilities in the backward instead "
    "(saving only q, k, v) was slower than flash in fp32 (67-77 ms) and faster only in bf16 (66 ms).",
    "**The benchmark's own order (fixed).** `make bench` rotated one order of the programs (A B C, then B C "
    "A), so each ran right after the same other one in every round but one: the shardlm Trainer step always "
    "right after the `shardlm train` loop (a thread of the same process, with its own OpenMP threads), "
    "transformers with the same kernels always right after transformers as shipped, shardlm at TP=2 always "
    "right after TP=1. Timed alone, alternating (bf16, V=8,192, 2 threads, 5 paired repeats), shardlm's step "
    "took 3.5-4.0 s and transformers' with the same kernels 4.2-5.0 s (ratio 1.15-1.30), where the rotation "
    "had given 0.97 (and 1.01 when that section ran again). Each round now takes a new order that keeps "
    "pairs of programs apart (`shardlm.bench.common.round_orders`); nothing else changed between the two "
    "`make bench` runs, and in this one the bf16 ratio at V=8,192 is 1.15 and TP=2 efficiency 1.03.",
    "**Collectives through shared memory (kept; TP and DP on one machine).** gloo sends every byte over "
    "loopback TCP: 5.6-6.4 ms for a 4 MiB all-reduce between 2 processes and 0.35 ms for one element, 34 "
    "of the former per TP=2 step at this shape. `shardlm.parallel.shm` has the ranks of a group on one "
    "machine write into a shared segment, each reduce 1/n of it and copy the rest back: 1.3 ms and 80 us. "
    "TP=2 efficiency on a quiet machine went from 0.88 (min 0.83, max 0.95) to 0.97 (min 0.78, max 1.07) "
    "in the `tp2_efficiency` section. DDP's gradient buckets use it too (synchronously, so they no longer "
    "overlap the backward as gloo's do): DP=2 step 4.45-4.49 s against 4.55-4.63 s with gloo, 2-4%.",
]


def _features(f: dict) -> str:
    yes = {True: "yes", False: "no"}
    return (f"CPU matrix features (`train_vs_hf.cpu_features`): **{f['matrix']}** (AMX {yes[f['amx']]}, "
            f"AVX-512-BF16 {yes[f['avx512_bf16']]}, AVX-512 {yes[f['avx512']]}, AVX2 {yes[f['avx2']]}; PyTorch "
            f"CPU capability {f['torch_cpu_capability']}, oneDNN bf16 {yes[f['onednn_bf16']]})"
            + (f"; these are the flags of a simulated CPU kind (`SHARDLM_CPU_KIND={f['simulated']}`), not this "
               "machine's, so the precisions follow that kind while the kernels are this CPU's." if f.get("simulated")
               else "."))


def train_lines(t: dict) -> list[str]:
    lines = [
        "## Training throughput: shardlm vs HuggingFace transformers (`train_vs_hf`)",
        "",
        f"Config: {t['config']}; vocabularies {', '.join(str(v) for v in t['vocabularies'])}. One step = forward + "
        "backward + clipping + fused AdamW. All programs compute the same function (GPT-2's tanh GeLU, SDPA "
        "attention, tied LM head) and took turns, in a new order every round, one (vocabulary, precision) at a "
        "time. The `shardlm "
        "train` loop is the CLI's own loop (progress bar, metrics.jsonl, TensorBoard) on an indexed dataset, "
        "timed from one step's start to the next's. bf16 = autocast around the forward and loss in both "
        "libraries; half-precision parameters = `train.param_dtype = \"half\"`; compiled = `train.compile = true` "
        "(each transformer layer under `torch.compile`; transformers runs eager).",
        "",
        _features(t["cpu_features"]),
        "",
    ]
    if t["cpu_features"].get("bf16_note"):
        lines += [t["cpu_features"]["bf16_note"] + ".", ""]
    lines += ["| V | precision | " + " | ".join(label for _, label in PROGRAMS) + " |",
              "|---" * (2 + len(PROGRAMS)) + "|"]
    for vocab, by_precision in t["by_vocabulary"].items():
        for precision, fig in by_precision.items():
            cells = [median_cell(fig.get(f"{name}_tokens_per_sec"), digits=0) for name, _ in PROGRAMS]
            lines.append(f"| {vocab} | {precision} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios (tokens/s over tokens/s, per interleaved repeat; `train_vs_hf.by_vocabulary.V.precision.*`; "
              f"goals: >= {GOAL_SAME_KERNELS} against the same kernels, >= {GOAL_AS_SHIPPED} against transformers "
              "as shipped):", "",
              "| V | precision | step / same kernels (`ratio_same_kernels`) | step / as shipped (`ratio`) | "
              "`shardlm train` / same kernels (`ratio_train_same_kernels`) | `shardlm train` / as shipped "
              "(`ratio_train`) | half parameters / same kernels (`ratio_half_same_kernels`) | half parameters / as "
              "shipped (`ratio_half`) | compiled / same kernels (`ratio_compiled_same_kernels`) | compiled / as "
              "shipped (`ratio_compiled`) | `shardlm train` / step (`train_command_over_step`) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for vocab, by_precision in t["by_vocabulary"].items():
        for precision, fig in by_precision.items():
            keys = ("ratio_same_kernels", "ratio", "ratio_train_same_kernels", "ratio_train",
                    "ratio_half_same_kernels", "ratio_half", "ratio_compiled_same_kernels", "ratio_compiled",
                    "train_command_over_step")
            lines.append(f"| {vocab} | {precision} | " + " | ".join(median_cell(fig.get(k)) for k in keys) + " |")
    goals = []
    for vocab, by_precision in t["by_vocabulary"].items():
        for precision, fig in by_precision.items():
            for key, goal in (("ratio_same_kernels", GOAL_SAME_KERNELS), ("ratio", GOAL_AS_SHIPPED),
                              ("ratio_train_same_kernels", GOAL_SAME_KERNELS), ("ratio_train", GOAL_AS_SHIPPED)):
                if fig[key]["median"] < goal:
                    goals.append(f"`{key}` at V={vocab} {precision} ({fig[key]['median']:.2f} < {goal})")
    lines += ["", f"**`train_vs_hf.ratio` = {median_cell(t['ratio'])}** (shardlm / transformers as shipped, fp32, "
              f"V={t['vocabularies'][0]}).", "",
              f"`train_vs_hf.ratio_same_kernels` = {median_cell(t['ratio_same_kernels'])} "
              "(shardlm / the control, fp32, "
              f"V={t['vocabularies'][0]}).", "",
              ("Goals missed in this run: " + "; ".join(goals) + ".") if goals
              else "Every ratio goal is met in this run.",
              "", "### What was tried to cut the time outside the GEMMs", ""]
    lines += [f"- {item}" for item in TRIED]
    return lines + [""]


def mfu_lines(r: dict) -> list[str]:
    u = r["mfu"]
    ceilings = u.get("gemm_ceilings_gflops", {"fp32": {"1024": u["gemm_ceiling_gflops"]}})
    rates = "; ".join(f"{dtype} " + ", ".join(f"{v:.0f} GFLOP/s at {n}x{n}" for n, v in by_size.items())
                      for dtype, by_size in ceilings.items())
    lines = [
        "## CPU model-FLOPs utilization (`mfu`)",
        "",
        "Achieved matmul FLOP/s of the shardlm Trainer step above (`shardlm.plan.flops.flops_per_token`, "
        "model FLOPs) over this CPU's GEMM rate in the same dtype with the same threads (medians: "
        f"{rates}). The GEMM probes ran in the same rounds as the steps, so each repeat divides by a GEMM "
        "rate measured seconds apart under the same load; the fraction is the median of those per-repeat "
        "ratios (their min-max in brackets). `fraction` divides by the first size (the ceiling of earlier runs), "
        f"`fraction_of_best` by the best size. Goal for fp32: `fraction` >= {GOAL_FP32_MFU:.0%}.",
        "",
    ]
    rows = [(vocab, program, row) for vocab, by_program in u.get("by_vocabulary", {}).items()
            for program, row in by_program.items()]
    own = all("step_gemm_gflops" in row for *_, row in rows)
    if own:
        lines[-1] += ("The step's own GEMMs (`step_gemm_gflops`): exactly the GEMMs of its linear layers (QKV, "
                      "projection, MLP and LM head, forward and both backward products, at its tokens x hidden "
                      "shapes), timed alone back to back in the same rounds: the rate these shapes allow on this "
                      "CPU, as a share of the best square GEMM (`step_gemm_of_best`), and the step's achieved rate "
                      "over it (`fraction_of_step_gemms`, which counts the attention products too, at that rate).")
    lines += ["", "| V | program | MFLOP per token | achieved GFLOP/s | ceiling GFLOP/s | fraction | best ceiling | "
              "fraction of best |" + (" step's own GEMMs GFLOP/s | their share of best | fraction of step's GEMMs |"
                                      if own else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if own else "")]
    for vocab, program, row in rows:
        spread = (f" ({row['fraction_range'][0] * 100:.0f}-{row['fraction_range'][1] * 100:.0f}%)"
                  if "fraction_range" in row else "")
        line = (f"| {vocab} | {program} | {row['flops_per_token'] / 1e6:.1f} | {row['achieved_gflops']:.0f} | "
                f"{row['gemm_ceiling_gflops']:.0f} | {row['fraction'] * 100:.0f}%{spread} | "
                f"{row['best_gemm_ceiling_gflops']:.0f} | {row['fraction_of_best'] * 100:.0f}% |")
        if own:
            line += (f" {row['step_gemm_gflops']:.0f} | {row['step_gemm_of_best'] * 100:.0f}% | "
                     f"{row['fraction_of_step_gemms'] * 100:.0f}% |")
        lines.append(line)
    lines += ["", f"**`mfu.fraction` = {u['fraction'] * 100:.0f}%** (fp32, first vocabulary: "
              f"{u['achieved_gflops']:.0f} of {u['gemm_ceiling_gflops']:.0f} GFLOP/s)."
              + (f" Below the {GOAL_FP32_MFU:.0%} goal in this run." if u["fraction"] < GOAL_FP32_MFU else ""), ""]
    if "bf16" in ceilings and max(ceilings["bf16"].values()) < max(ceilings["fp32"].values()):
        lines += ["On this CPU the bf16 GEMM ceiling is below the fp32 one: AVX-512-BF16 without AMX gives bf16 "
                  "dot products, but oneDNN's bf16 GEMMs do not outrun MKL's fp32 ones here, so bf16 saves memory, "
                  "not time; the roofline a bf16 step hits is that bf16 GEMM ceiling.", ""]
    return lines
