"""Online RL on one CPU (`make bench` section `rl`): shardlm's GRPO steps against TRL's `GRPOTrainer` as shipped,
and decoding with the key/value cache against transformers' `generate`.

Model: the `sft` section's tiny Qwen3 (the real 151,936-token vocabulary, tied embeddings, random init, fp32), saved
as a Hugging Face folder with the shared Qwen3 tokenizer; both trainers start from it. Prompts: the built-in
arithmetic task (`shardlm.rl.arithmetic.arithmetic_records(n, seed, conversational=True)`, rendered with the Qwen3
chat template), `prompts_per_step` prompts a step, each completed `num_generations` times, at most
`max_completion_length` new tokens, temperature 1 over the whole vocabulary; the "math" reward; the DAPO loss, one
optimizer step per generation round, AdamW at a constant 1e-6, clipping at 1.0; one process, `threads` threads.

- TRL as shipped: `GRPOTrainer` with `use_vllm=False` (its own rollouts: transformers' `generate` with its dynamic
  cache, left-padded prompts), `bf16=False`, `per_device_train_batch_size` = the step's sequences (one forward
  and backward a step, TRL's own batching). Its dataset is the prompts in shardlm's round order and
  `shuffle_dataset=False`, so each pair of steps completes the same prompts.
- shardlm: `train` with `[rl]` (`rl.task="arithmetic"`, the same records) for its `warmup_steps` steps (importing
  the folder and building the trainer), then `RLRun.train_step` (rollouts by `InProcessGenerator`, rewards,
  advantages, the round's sequences packed best-fit-decreasing into `rows_per_step` rows of `seq_length` tokens,
  scoring passes, the update).

The first `warmup_steps` steps of each are not counted (shardlm's run in `train`, TRL's alone); then the two take
turns, one step each (a shardlm step right after each TRL step, outside TRL's clock), on the same prompt ids
(`same_prompts`, per pair: TRL's step i and shardlm's round i). Neither stops before
`max_completion_length` unless it samples the end-of-turn token (rare with random weights: the completion tokens per
step are reported on both sides). `ratio`: TRL's step seconds over shardlm's, per pair (goal 1.5). Shares of
shardlm's step: `generation_s` (rollouts), `scoring_s` (the reference pass: 0 with beta 0), `update_s` (the
trainer's forward, backward and AdamW: `step_time_s`) and the rest (rewards, advantages, packing); TRL's the same,
from its `_generate_single_turn`, its no-gradient log-probability passes and its `_generate_and_score_completions`.
A second, shorter pair of runs with beta > 0 (TRL's frozen reference model; shardlm's `ReferenceWeights`, a copy of
the weights swapped in for a no-gradient pass, taken after its warm-up step: the same work as the starting weights)
gives the same figures with a reference.

`decode`: before the paired steps, both decoders load the starting weights from the folder (shardlm's
`checkpoint.init.load_model`) and decode the first round's sequences, `max_completion_length`
new tokens each, sampled at temperature 1: shardlm's `InProcessGenerator` (key/value cache, lockstep over prompt
lengths, each sampled token's log-probability as RL needs it; an end-of-turn id that never occurs, so every row
runs the full length) against transformers' `generate` (dynamic cache, left padding, `min_new_tokens` =
`max_new_tokens`), taking turns in a new order every round. tokens/s counts the new tokens, B x N on both sides.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shardlm.bench.common import interleaved, median_cell, summary, torch_threads, uncached_datasets
from shardlm.bench.sft import SFT_BENCH, SFT_QUICK, SFTShape, chat_data, make_model_dir

LR, SEED, LOSS = 1e-6, 0, "dapo"


@dataclass(frozen=True)
class RLShape:
    """The model (an `SFTShape`: its rows of `seq_length` tokens, `rows_per_step` a step, `steps` of which the first
    `warmup_steps` are not counted), the rollouts of a step, and the shorter run with a reference."""

    model: SFTShape
    prompts_per_step: int
    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    beta: float = 0.04
    beta_steps: int = 3
    """Steps of the run with beta > 0 (its first `model.warmup_steps` not counted); 0 skips it."""
    decode_repeats: int = 3
    decode_warmup: int = 1
    """Untimed decoding rounds before the timed ones (the quick shape's 0)."""

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.num_generations

    def describe(self, vocab_size: int, threads: int) -> str:
        m = self.model
        return (f"Qwen3 {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads ({m.num_kv_heads} KV) x "
                f"{m.head_dim}, MLP {m.ffn_hidden_size}, vocabulary {vocab_size}, tied embeddings, random init, "
                f"fp32, {threads} threads; {self.prompts_per_step} arithmetic prompts x {self.num_generations} "
                f"completions a step, at most {self.max_completion_length} new tokens, temperature "
                f"{self.temperature:g}, {LOSS} loss; shardlm packs them into {m.rows_per_step} rows of "
                f"{m.seq_length} tokens")


RL_BENCH = RLShape(replace(SFT_BENCH, seq_length=512, rows_per_step=1, steps=4, warmup_steps=1),
                   prompts_per_step=1, num_generations=8, max_completion_length=32)
RL_QUICK = RLShape(replace(SFT_QUICK, seq_length=128, rows_per_step=1, steps=2, warmup_steps=1),
                   prompts_per_step=1, num_generations=2, max_completion_length=8, beta_steps=2, decode_repeats=1,
                   decode_warmup=0)


def round_records(shape: RLShape, records: list[dict], rounds: range) -> list[dict]:
    """The records that shardlm's generation rounds `rounds` take, in their order (`round_prompts` with train.seed =
    SEED): TRL reads them in this order (`shuffle_dataset=False`), so each pair of steps completes the same prompts."""
    from shardlm.rl.prompts import round_prompts

    return [records[i] for r in rounds for i in round_prompts(len(records), shape.prompts_per_step, r, SEED)]


class RLSteps:
    """shardlm's side: `train` with `[rl]` for the first `warmup_steps` steps (imports `model_dir`, builds the
    trainer), then one more `RLRun.train_step` per `step()` call, timed around it, with the round's `generation_s`,
    `scoring_s`, the update's `step_time_s` and the completion tokens."""

    def __init__(self, shape: RLShape, model_dir: Path, run_dir: Path, threads: int, beta: float, task_size: int):
        from shardlm.config import load_config
        from shardlm.rl.setup import load_rl_inputs, start_rl
        from shardlm.training.reference import ReferenceWeights
        from shardlm.training.run import train

        m, quote = shape.model, json.dumps
        overrides = [
            f"checkpoint.init_from={quote(str(model_dir))}", "checkpoint.save=false", f'rl.loss="{LOSS}"',
            'rl.task="arithmetic"', f"rl.task_size={task_size}", f"rl.num_generations={shape.num_generations}",
            f"rl.prompts_per_step={shape.prompts_per_step}", f"rl.max_completion_length={shape.max_completion_length}",
            f"rl.temperature={shape.temperature}", f"rl.beta={beta}", 'rl.rewards=["math"]',
            f"model.seq_length={m.seq_length}", f"train.micro_batch_size={m.rows_per_step}",
            f"train.global_batch_size={m.rows_per_step}", f"train.steps={m.warmup_steps}", f"train.seed={SEED}",
            f"train.lr={LR}", f"train.min_lr={LR}", 'train.decay_style="constant"', "train.warmup_steps=0",
            "train.weight_decay=0.0", "train.clip_grad=1.0", 'train.device="cpu"', 'train.precision="fp32"',
            "log.progress=false", "log.plot=false", "log.tensorboard=false", "log.interval=1"]
        self.threads, self.records = threads, []
        with torch_threads(threads):
            config = load_config(None, overrides)
            self.trainer = train(config, run_dir=run_dir).trainer
            self.inputs = load_rl_inputs(config)
            reference = ReferenceWeights.of(self.trainer) if beta else None  # after the warm-up: the same work
            self.run, _ = start_rl(self.trainer, self.inputs, reference)

    def step(self) -> None:
        from shardlm.rl.prompts import round_prompts

        prompts, per_round = self.inputs.prompts, self.run.per_round  # the round this step starts (RLRun.rollouts)
        chosen = round_prompts(len(prompts), per_round, self.trainer.step, SEED)
        with torch_threads(self.threads):
            start = time.perf_counter()
            metrics = self.run.train_step()
            total = time.perf_counter() - start
        sequences = self.run.rows.num_sequences
        self.records.append({"step_s": total, "generation_s": metrics["generation_s"],
                             "scoring_s": metrics["scoring_s"], "update_s": metrics["step_time_s"],
                             "completion_tokens": round(metrics["completions/mean_length"] * sequences),
                             "loss": metrics["loss"], "prompts": sorted(tuple(prompts[i].ids) for i in chosen
                                                                        for _ in range(self.run.cfg.num_generations))})


def trl_grpo_run(shape: RLShape, model_dir: Path, records: list[dict], out_dir: Path, threads: int, beta: float,
                 steps: int, after_step) -> list[dict]:
    """TRL's GRPOTrainer as shipped on `records` in order: per step its seconds (from one `on_step_end` to the next),
    the seconds in its rollouts (`_generate_single_turn`), in its no-gradient log-probability passes (the reference
    with beta > 0) and in `_generate_and_score_completions`, and the completion tokens; `after_step(step)` (step 1,
    2, ...) runs outside its clock."""
    import datasets
    import transformers
    import trl

    from shardlm.rl.rewards import math_answer

    seconds = {"generation": 0.0, "scoring": 0.0, "prepare": 0.0, "tokens": 0}
    prompts: list[tuple] = []  # the prompt ids of the step's rollouts

    class Timed(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            prompts.extend(tuple(p) for p in prompt_ids)
            start = time.perf_counter()
            completions, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            seconds["generation"] += time.perf_counter() - start
            seconds["tokens"] += sum(len(c) for c in completions)
            return completions, logprobs

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if not torch.is_grad_enabled():  # the scoring passes, not the training forward
                seconds["scoring"] += time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            seconds["prepare"] += time.perf_counter() - start
            return out

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.records = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.seen = time.perf_counter(), dict(seconds)

        def on_step_end(self, args, state, control, **kwargs):
            total = time.perf_counter() - self.last
            spent = {k: seconds[k] - self.seen[k] for k in seconds}
            self.records.append({"step_s": total, "generation_s": spent["generation"], "scoring_s": spent["scoring"],
                                 "update_s": total - spent["prepare"], "completion_tokens": spent["tokens"],
                                 "prompts": sorted(prompts)})
            self.seen = dict(seconds)
            prompts.clear()
            after_step(state.global_step)
            self.last = time.perf_counter()

    with uncached_datasets(), torch_threads(threads):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        args = trl.GRPOConfig(
            output_dir=str(out_dir), loss_type=LOSS, beta=beta, num_generations=shape.num_generations,
            per_device_train_batch_size=shape.sequences, gradient_accumulation_steps=1,
            max_completion_length=shape.max_completion_length, temperature=shape.temperature, top_k=0, top_p=1.0,
            shuffle_dataset=False, max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, logging_steps=10**6, report_to=[], save_strategy="no",
            use_cpu=True, seed=SEED, dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True,
            bf16=False, fp16=False, use_vllm=False, log_completions=False)
        clock = StepClock()
        trainer = Timed(model=model, reward_funcs=[math_answer], args=args,
                        train_dataset=datasets.Dataset.from_list(records),
                        processing_class=transformers.AutoTokenizer.from_pretrained(str(model_dir)), callbacks=[clock])
        trainer.train()
    return clock.records


def decode_speed(shape: RLShape, ctx, inputs, model_dir: Path, threads: int) -> dict:
    """New tokens/s of shardlm's `InProcessGenerator` and transformers' `generate`, both loading the weights of
    `model_dir`, on the first round's sequences (module docstring), and the largest difference of their next-token
    logits on one prompt. `ctx`: one process's context; `inputs`: the run's `RLInputs` (prompts, end-of-turn id)."""
    import transformers

    from shardlm.checkpoint.init import load_model
    from shardlm.eval.generate import SamplingConfig
    from shardlm.rl.prompts import round_prompts
    from shardlm.rl.rollout import InProcessGenerator

    new_tokens = shape.max_completion_length
    chosen = round_prompts(len(inputs.prompts), shape.prompts_per_step, 0, SEED)
    prompts = [inputs.prompts[i].ids for i in chosen for _ in range(shape.num_generations)]
    with torch_threads(threads):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        pad = tokenizer.pad_token_id
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        config = transformers.GenerationConfig(do_sample=True, temperature=shape.temperature, top_k=0, top_p=1.0,
                                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                                               eos_token_id=inputs.eod, disable_compile=True)
        model, _ = load_model(model_dir, ctx)
        generator = InProcessGenerator(model, ctx, SamplingConfig(max_new_tokens=new_tokens,
                                                                                 temperature=shape.temperature),
                                       eod=-1)  # no id is -1: every row runs the full length
        counts: dict[str, list[int]] = {"shardlm": [], "transformers": []}

        def ours():
            rollouts = generator.generate(prompts, list(range(len(prompts))))
            counts["shardlm"].append(sum(len(r.completion) for r in rollouts))

        def theirs():
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            counts["transformers"].append(out[:, longest:].numel())

        times = interleaved({"shardlm": ours, "transformers": theirs}, shape.decode_repeats,
                            warmup=shape.decode_warmup)
        with torch.no_grad():  # the same weights: next-token logits of the first prompt
            first = torch.tensor([prompts[0]])
            mine = model.full_logits(model.output_layer(model(first, hidden_only=True)[:, -1:]))[0, 0]
            difference = (mine - hf(first).logits[0, -1]).abs().max().item()
    tokens = {name: c[-len(times[name]):] for name, c in counts.items()}  # the timed rounds' counts
    rates = {name: [n / t for n, t in zip(tokens[name], times[name])] for name in times}
    return {"sequences": len(prompts), "new_tokens": new_tokens,
            "prompt_tokens": [min(len(p) for p in prompts), longest],
            "tokens_per_round": tokens,
            **{f"{name}_tokens_per_sec": summary(r) for name, r in rates.items()},
            "ratio": summary([a / b for a, b in zip(rates["shardlm"], rates["transformers"])]),
            "max_abs_logit_difference": difference}


def paired_steps(shape: RLShape, model_dir: Path, records: list[dict], folder: Path, threads: int, beta: float,
                 steps: int, with_decode: bool = False) -> dict:
    """One pair of runs (TRL, shardlm) taking turns for `steps` steps; the figures after the warm-up steps."""
    warmup = shape.model.warmup_steps
    ours = RLSteps(shape, model_dir, folder / f"shardlm-beta{beta:g}", threads, beta, task_size=len(records))
    decode = decode_speed(shape, ours.trainer.ctx, ours.inputs, model_dir, threads) if with_decode else None
    # TRL's warm-up steps run alone (shardlm's ran in `train`), then the two take turns, on the same rounds
    theirs = trl_grpo_run(shape, model_dir, round_records(shape, records, range(steps)), folder / f"trl-beta{beta:g}",
                          threads, beta, steps, after_step=lambda step: ours.step() if step > warmup else None)
    mine, trl = ours.records, theirs[warmup:]
    if not mine or len(mine) != len(trl):
        raise RuntimeError(f"{len(ours.records)} shardlm steps for {len(theirs)} TRL steps after {warmup} warm-up")
    figures = {"pairs": len(mine), "beta": beta,
               "same_prompts": [a["prompts"] == b["prompts"] for a, b in zip(mine, trl)],  # each pair's, as token ids
               "ratio": summary([b["step_s"] / a["step_s"] for a, b in zip(mine, trl)])}
    for name, run in (("shardlm", mine), ("trl", trl)):
        figures[name] = {
            "step_s": summary([r["step_s"] for r in run]),
            **{f"{part}_share": summary([r[f"{part}_s"] / r["step_s"] for r in run])
               for part in ("generation", "scoring", "update")},
            "other_share": summary([1 - (r["generation_s"] + r["scoring_s"] + r["update_s"]) / r["step_s"]
                                    for r in run]),
            "generation_s": summary([r["generation_s"] for r in run]),
            "completion_tokens": [r["completion_tokens"] for r in run]}
    figures["shardlm_losses"] = [r["loss"] for r in ours.records]
    return figures | ({"decode": decode} if decode else {})


def rl_bench(quick: bool, data_dir: Path | None = None, threads: int = 2) -> dict:
    """The `rl` section of `make bench`."""
    from shardlm.rl.arithmetic import arithmetic_records

    shape = RL_QUICK if quick else RL_BENCH
    m = shape.model
    _, tokenizer_dir = chat_data(data_dir)
    with tempfile.TemporaryDirectory(prefix="shardlm-rl-bench-") as folder:
        folder = Path(folder)
        model_dir, vocab = make_model_dir(m, tokenizer_dir, folder / "model")
        records = arithmetic_records(shape.prompts_per_step * m.steps, SEED, conversational=True)
        figures = paired_steps(shape, model_dir, records, folder, threads, 0.0, m.steps, with_decode=True)
        decode = figures.pop("decode")
        with_reference = None
        if shape.beta_steps:
            beta_records = arithmetic_records(shape.prompts_per_step * shape.beta_steps, SEED, conversational=True)
            with_reference = paired_steps(shape, model_dir, beta_records, folder, threads, shape.beta,
                                          shape.beta_steps)
    return {"config": shape.describe(vocab, threads), **figures, "decode": decode,
            **({"with_reference": with_reference} if with_reference else {})}


def _share_row(name: str, f: dict) -> str:
    return (f"| {name} | {median_cell(f['step_s'])} | {median_cell(f['generation_share'])} | "
            f"{median_cell(f['scoring_share'])} | {median_cell(f['update_share'])} | {median_cell(f['other_share'])} "
            f"| {sum(f['completion_tokens']) / len(f['completion_tokens']):.0f} |")


def markdown_lines(r: dict) -> list[str]:
    """The `rl` section of BENCHMARKS.md."""
    d = r["decode"]
    lines = ["## Online RL: GRPO steps (`rl`)", "",
             f"{r['config']}. TRL's `GRPOTrainer` as shipped (its rollouts by transformers' `generate`) and shardlm "
             f"take turns, one step (rollouts + update) each; {r['pairs']} pairs of steps after the warm-up, "
             f"{sum(r['same_prompts'])} of them on the same prompt ids (`rl.same_prompts`). Shares are of each "
             "trainer's own step.", "",
             "| trainer | step s | generation | scoring | update | other | completion tokens a step |",
             "|---|---|---|---|---|---|---|",
             _share_row("shardlm (`[rl]`)", r["shardlm"]), _share_row("TRL `GRPOTrainer`", r["trl"]), "",
             f"**TRL's step / shardlm's (`rl.ratio`, per pair of steps): {median_cell(r['ratio'])}** (goal 1.5).", ""]
    w = r.get("with_reference")
    if w:
        lines += [f"With a reference (beta {w['beta']:g}: TRL's frozen reference model, shardlm's copy of the weights "
                  f"swapped in), {w['pairs']} pair(s) of steps:", "",
                  "| trainer | step s | generation | scoring | update | other | completion tokens a step |",
                  "|---|---|---|---|---|---|---|",
                  _share_row("shardlm", w["shardlm"]), _share_row("TRL", w["trl"]), "",
                  f"TRL's step / shardlm's (`rl.with_reference.ratio`): {median_cell(w['ratio'])}.", ""]
    lines += [f"Decoding (`rl.decode`), the same starting weights (next-token logits within "
              f"{d['max_abs_logit_difference']:.1e}): {d['sequences']} sequences, prompts of "
              f"{d['prompt_tokens'][0]}-{d['prompt_tokens'][1]} tokens, {d['new_tokens']} new tokens each, sampled:",
              "", "| decoder | new tokens/s |", "|---|---|",
              f"| shardlm `InProcessGenerator` (KV cache, log-probabilities) | "
              f"{median_cell(d['shardlm_tokens_per_sec'], digits=0)} |",
              "| transformers `generate` (dynamic cache) | "
              f"{median_cell(d['transformers_tokens_per_sec'], digits=0)} |",
              "", f"shardlm / transformers (`rl.decode.ratio`, per round): {median_cell(d['ratio'])}.", ""]
    return lines
