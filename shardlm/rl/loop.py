"""The RL loop: each generation round samples completions in the training processes, scores them, turns the
rewards into group-relative advantages, packs the round's rows, and takes its optimizer steps on them: S =
`steps_per_generation` steps of different rows (rl.generation_batch_size), taken in turn rl.num_iterations times over.

One round, on every rank:
  1. the round's prompts (`prompts.round_prompts`: S x rl.prompts_per_step of them, shuffled by train.seed epoch
     after epoch), each repeated rl.num_generations times: sequence j completes prompt j // G;
  2. each data x context-parallel rank samples its contiguous share of the sequences (`rollout.InProcessGenerator`,
     or the fixed completions of rl.completions), and every rank gathers all of them;
  3. the main rank calls the reward functions and broadcasts their values (a function that raises or returns the
     wrong count stops every rank with one line naming it, before any update: nothing saved is lost);
  4. advantages over the round (`advantages.group_advantages`, or GDPO's `decoupled_advantages`) and the rows of its
     S steps (`batch.StepRows`, the sequences split by `batch.split_round`), the same on every rank;
  5. scoring passes at the run's layout, without gradient: the policy's old log-probabilities when the round has
     more than one step, the reference's when rl.beta > 0 (a LoRA run's base with the adapters off, else the
     starting weights, `ReferenceWeights`);
  6. the trainer's steps (`Trainer.train_step`, whose loss is `loss.RLLoss`) on those rows.
Online DPO (rl.loss="online_dpo") replaces 4-6: each prompt's two completions become a pair, the better-rewarded one
chosen, and the step is DPO's on those pairs (`online_dpo`, the trainer's loss `PreferenceLoss`).
Nothing of a round is kept across steps but its rows: sampling seeds come from (train.seed, round, sequence), so a
run resumed at a round boundary samples what the uninterrupted run sampled.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardlm.errors import UserError
from shardlm.parallel import gather_zigzag_rows
from shardlm.parallel.invariant import batch_invariant
from shardlm.rl import a2po, online_dpo, prompts_per_step, round_steps, steps_per_generation
from shardlm.rl.advantages import combine_rewards, decoupled_advantages, group_advantages, nanstd, rloo_advantages
from shardlm.rl.batch import StepRows, split_round
from shardlm.rl.prompts import Prompt, round_prompts
from shardlm.rl.rewards import Reward, reward_names, score
from shardlm.rl.rollout import Rollout, evaluation_seed, gather_samples, sampling_share, sequence_seed
from shardlm.training.data import micro_batches
from shardlm.training.reference import ReferenceWeights


def decode(template, ids: list[int]) -> str:
    """A completion's text without special tokens (as TRL decodes it for the reward functions)."""
    return template.tokenizer.decode(ids, skip_special_tokens=True)


class RLRun:
    """Joins the trainer, the prompts, the generator and the reward functions (module docstring)."""

    def __init__(self, trainer, prompts: list[Prompt], template, generator, rewards: list[Reward], pad_id: int,
                 reference: ReferenceWeights | None = None, completions_file: Path | None = None,
                 eval_prompts: list[Prompt] = (), agent=None, environments=None):
        self.trainer, self.prompts, self.template = trainer, prompts, template
        self.eval_prompts = list(eval_prompts)  # held out (rl.eval_prompts): `evaluate`
        self.generator, self.rewards, self.pad_id, self.reference = generator, rewards, pad_id, reference
        self.agent = agent  # rl.tools: the tool-calling loop (`shardlm.rl.agent.ToolLoop`), else None
        self.environments = environments  # rl.environment (`shardlm.rl.environments.Environments`), else None
        self.sampled: list[Prompt] = []  # the last sampling's prompts (an environment's observation appended)
        self.completions_file = completions_file  # rl.log_completions: each round's samples appended (main rank)
        self.cfg, self.ctx = trainer.config.rl, trainer.ctx
        self.steps = steps_per_generation(trainer.config)  # optimizer steps of different rows a round
        self.per_round = prompts_per_step(trainer.config) * self.steps
        self.round_steps = round_steps(trainer.config)  # optimizer steps a round lasts
        self.round_metrics: dict = {}
        self.rows: StepRows | None = None
        self.values: np.ndarray | None = None  # a2po: each training prompt's V* (`shardlm.rl.a2po.prepare`)
        self.scorers = {}  # the reward models (rl.rewards "model:PATH") by column, at the layout: collective
        if any(reward.model for reward in rewards):
            from shardlm.rl.reward_model import RewardModelScorer

            self.scorers = {j: RewardModelScorer(reward.model, trainer) for j, reward in enumerate(rewards)
                            if reward.model}

    def train_step(self) -> dict:
        """One optimizer step, after a new generation round when the last one's steps are done."""
        trainer = self.trainer
        first = trainer.step % self.round_steps == 0
        with batch_invariant(self.cfg.batch_invariant):  # sampling, scoring and training alike
            if first or self.rows is None:
                self.start_round(trainer.step // self.round_steps)
            trainer.loss.first_step = first
            return trainer.train_step() | self.round_metrics

    def round_file(self, directory: Path) -> Path:
        return Path(directory) / f"rl_round.rank{self.ctx.rank}.npz"

    def save_round(self, directory: Path) -> None:
        """Keep this rank's rows of the round in a checkpoint taken in the middle of one (of several steps):
        a resumed run trains on them as the uninterrupted run does (their old and reference log-probabilities came
        from weights the checkpoint no longer holds). At a round's boundary there is nothing to keep: the next
        round's seeds and weights make the same rows again."""
        if self.rows is None or self.trainer.step % self.round_steps == 0:
            return
        path = self.round_file(directory)
        tmp = path.with_name(f".tmp-{path.name}")
        with open(tmp, "wb") as f:
            np.savez(f, **self.rows.fields, metrics=np.array(json.dumps(self.round_metrics)))
        os.replace(tmp, path)

    def restore(self, directory: Path) -> None:
        """Read the rows a checkpoint taken in the middle of a round kept (`save_round`), if it did."""
        path = self.round_file(directory)
        if self.trainer.step % self.round_steps == 0 or not path.exists():
            return
        with np.load(path) as saved:
            self.round_metrics = json.loads(str(saved["metrics"]))
            self.rows = StepRows.from_fields({k: saved[k] for k in saved.files if k != "metrics"})
        self.trainer.train_data = self.rows

    def rollouts(self, round_index: int) -> tuple[list[int], list[Rollout], float]:
        """(each sequence's prompt index, every sequence's rollout in order, seconds spent generating)."""
        config = self.trainer.config
        chosen = round_prompts(len(self.prompts), self.per_round, round_index, config.train.seed, config.sft.shuffle)
        owners = [i for i in chosen for _ in range(self.cfg.num_generations)]
        start = time.perf_counter()
        rollouts = self.sample([self.prompts[i] for i in owners],
                               lambda j: sequence_seed(config.train.seed, round_index, j), round_index)
        return owners, rollouts, time.perf_counter() - start

    def sample(self, prompts: list[Prompt], seed_of, round_index: int, offset: int = 0) -> list[Rollout]:
        """Every sequence's rollout, in order, of `prompts` (one per sequence; the j-th is sequence offset + j of
        the round, sampled from the seed `seed_of(offset + j)`): each data x context-parallel rank samples its share in
        the training forward's precision, and every rank gathers all of them; with tools, the replies after the tool
        results too (`shardlm.rl.agent`)."""
        sequences = [offset + j for j in range(len(prompts))]
        seeds = [seed_of(j) for j in sequences]
        if self.environments is not None:  # each sequence's environment reset, its observation in the prompt
            prompts = self.environments.start(prompts)
        self.sampled = prompts

        def generate(ids: list[list[int]], seeds: list[int], limits, turn: int, sequences: list[int]) -> list[Rollout]:
            share = sampling_share(len(ids), self.ctx)
            more = {} if limits is None else {"limits": [limits[j] for j in share], "turn": turn}  # (after tools)
            with self.trainer.autocast():
                local = self.generator.generate([ids[j] for j in share], [seeds[j] for j in share], round_index,
                                                [sequences[j] for j in share], **more)
            self.reshard()
            return gather_samples(local, self.ctx)

        first = generate([p.ids for p in prompts], seeds, None, 0, sequences)
        return first if self.agent is None else self.agent.run(first, seeds, sequences, generate)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> np.ndarray:
        """(N, F) reward values (NaN: None) of each sequence's prompt and rollout: the functions' computed on the main
        rank and broadcast (a failing function stops every rank with the same one line), the reward models' by every
        rank at the layout (`shardlm.rl.reward_model`)."""
        result: list = [None]
        completions = None
        if self.ctx.rank == 0 or self.scorers:
            texts = [decode(self.template, r.completion) for r in rollouts]
            completions = [r.messages if r.messages is not None else
                           [{"role": "assistant", "content": t}] if p.conversational else t
                           for p, t, r in zip(prompts, texts, rollouts)]
        if self.ctx.rank == 0:
            keys = sorted({k for p in prompts for k in p.columns})
            columns = {k: [p.columns.get(k) for p in prompts] for k in keys}
            if self.environments is not None:
                columns["environments"] = self.environments.active
            try:
                result = [score(self.rewards, [p.prompt for p in prompts], completions,
                                [r.completion for r in rollouts], columns)]
            except UserError as exc:
                result = [str(exc)]
        if self.ctx.world_size > 1:
            dist.broadcast_object_list(result, src=0)
        if isinstance(result[0], str):
            raise UserError(result[0])
        table = result[0]
        for column, scorer in self.scorers.items():
            table[:, column] = scorer([p.prompt for p in prompts], completions)
        return table

    def start_round(self, round_index: int) -> None:
        cfg, trainer = self.cfg, self.trainer
        owners, rollouts, generation_s = self.rollouts(round_index)
        values = self.score(self.sampled, rollouts)  # (the prompts as sampled: an environment's observation in)
        rewards = combine_rewards(values, self.weights)
        if cfg.loss == online_dpo.ONLINE_DPO:  # the step's pairs, chosen by reward, for DPO's loss
            metrics = online_dpo.start_round(self, owners, rollouts, rewards)
            zero_std = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)[1]
            self.round_metrics = {k: v for k, v in self.describe(values, rewards, zero_std, rollouts).items()
                                  if k != "frac_reward_zero_std"} | metrics | {"generation_s": generation_s}
            return
        rloo = cfg.loss == "rloo"  # (its advantages after the scoring passes: the KL is in its reward)
        values_of = {}
        if rloo:
            advantages = zero_std = np.zeros(len(rollouts))
        elif cfg.loss == a2po.A2PO:  # its target r - V*(x) (no group: one completion a prompt)
            advantages, values_of = a2po.targets(self, owners, rewards)
            zero_std = np.zeros(len(rollouts))
        elif cfg.multi_objective_aggregation == "normalize_then_sum":
            advantages, zero_std = decoupled_advantages(values, self.weights, cfg.num_generations)
        else:
            advantages, zero_std = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
        t = trainer.config.train
        self.rows = StepRows(rollouts, advantages, cfg.loss, cfg.max_completion_length, cfg.mask_truncated_completions,
                             t.global_batch_size, trainer.config.model.seq_length, self.pad_id,
                             trainer.config.sft.packing, split_round(len(rollouts), self.steps, t.seed, round_index))
        trainer.train_data = self.rows
        start = time.perf_counter()
        if self.round_steps > 1 or (rloo and cfg.beta):
            self.score_rows("old_logp", contextlib.nullcontext())
        if cfg.beta or cfg.loss == a2po.A2PO:
            self.score_rows("ref_logp", self.reference_context())
        scoring_s = time.perf_counter() - start
        kl = {}
        if rloo:
            advantages, zero_std, kl = self.leave_one_out(rewards)
            self.rows.set_advantages(advantages)
        if self.completions_file is not None and self.ctx.rank == 0:
            self.log_round(round_index, rollouts, values, rewards, advantages)
        self.round_metrics = self.describe(values, rewards, zero_std, rollouts) | kl | values_of | {
            "generation_s": generation_s, "scoring_s": scoring_s}

    def leave_one_out(self, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """RLOO's (advantages, zero-std flags, {"kl": the round's token mean} with beta), as TRL's RLOOTrainer: the
        rewards clamped to rl.reward_clip_range, less beta x each sequence's summed log-ratio of the policy that
        sampled it to the reference (first order, from the scoring passes), then leave-one-out baselines."""
        cfg = self.cfg
        if cfg.reward_clip_range:
            rewards = np.clip(rewards, *[float(x) for x in cfg.reward_clip_range])
        metrics = {}
        if cfg.beta:
            kl, tokens = self.sequence_kl()
            rewards = rewards - cfg.beta * kl
            metrics["kl"] = float(kl.sum() / max(tokens, 1))
        advantages, zero_std = rloo_advantages(rewards, cfg.num_generations, cfg.normalize_advantages)
        return advantages, zero_std, metrics

    def sequence_kl(self) -> tuple[np.ndarray, int]:
        """((N,) each sequence's sum over its completion tokens of old - reference log-probability, the round's
        completion tokens): each DP rank's scored rows summed over DP (under pipeline stages the last stage's, which
        scored them, sent to every stage)."""
        f = self.rows.fields
        counted = f["token_weight"] > 0
        local = np.zeros(self.rows.num_sequences)
        np.add.at(local, f["sequence"][counted], (f["old_logp"] - f["ref_logp"])[counted])
        sums = torch.from_numpy(local).to(self.ctx.device)
        self.ctx.dp.all_reduce(sums)
        if self.trainer.pipeline is not None:
            sums = self.trainer.pipeline.broadcast_from_last_stage(sums)
        return sums.cpu().numpy(), int(counted.sum())

    @property
    def weights(self) -> np.ndarray:
        """(F,) each reward function's weight (rl.reward_weights; 1 each by default)."""
        return np.array([float(w) for w in self.cfg.reward_weights] or [1.0] * len(self.rewards))

    def evaluate(self) -> dict | None:
        """The held-out prompts' metrics (None without any): rl.num_generations_eval completions of each, sampled as
        the rollouts are (each data x context-parallel rank its share, the training sampling settings) from seeds
        that are the same at every evaluation, scored by the reward functions; the round's metrics (`describe`)
        with a "val_" prefix, as TRL's evaluation logs them with "eval_"."""
        if not self.eval_prompts:
            return None
        group = self.cfg.num_generations_eval or self.cfg.num_generations
        prompts = [p for p in self.eval_prompts for _ in range(group)]
        seed = self.trainer.config.train.seed
        with batch_invariant(self.cfg.batch_invariant):
            rollouts = self.sample(prompts, lambda j: evaluation_seed(seed, j), 0)
        values = self.score(self.sampled, rollouts)
        rewards = combine_rewards(values, self.weights)
        zero_std = group_advantages(rewards, group, "group")[1] if group > 1 else np.zeros(len(rewards))
        return {f"val_{k}": v for k, v in self.describe(values, rewards, zero_std, rollouts).items()}

    def log_round(self, round_index: int, rollouts: list[Rollout], values: np.ndarray,
                  rewards: np.ndarray, advantages: np.ndarray) -> None:
        """Append the round's sequences to `completions_file`, one JSON line each: the round, the step it starts, the
        sequence, the prompt (as the reward functions saw it), the completion's text, whether it was truncated, each
        function's reward (None where it gave none), their weighted sum and the advantage."""
        step = round_index * self.round_steps + 1
        names = reward_names(self.rewards)
        lines = []
        for j, rollout in enumerate(rollouts):
            scores = {n: None if np.isnan(v) else float(v) for n, v in zip(names, values[j])}
            lines.append(json.dumps({"round": round_index, "step": step, "sequence": j,
                                     "prompt": self.sampled[j].prompt,
                                     "completion": decode(self.template, rollout.completion),
                                     "truncated": rollout.truncated, "rewards": scores,
                                     **({"messages": rollout.messages} if rollout.messages is not None else {}),
                                     "reward": float(rewards[j]), "advantage": float(advantages[j])}) + "\n")
        with open(self.completions_file, "a", encoding="utf-8") as f:
            f.write("".join(lines))

    def reference_context(self):
        if self.reference is not None:
            return self.reference.swapped()
        from shardlm.lora.switch import adapters_off

        return adapters_off(self.trainer.model)

    @torch.no_grad()
    def score_rows(self, name: str, context) -> None:
        """Fill the rows' `name` ("old_logp" or "ref_logp") of every step of the round with this rank's
        micro-batches' log-probabilities, at the run's layout (through the pipeline stages under PP: only the last
        stage, which computes the loss, keeps them)."""
        trainer, t = self.trainer, self.trainer.config.train
        batches = [b for s in range(self.steps) for b in trainer.local_part(micro_batches(
            self.rows, trainer.consumed_samples + s * t.global_batch_size, t.global_batch_size, t.micro_batch_size,
            self.ctx.dp_rank, self.ctx.dp_size, self.ctx.device))]

        def record(token_losses, batch):  # (b, T / C) under CP: each rank stores the whole rows
            logps = gather_zigzag_rows(-token_losses.double(), self.ctx.cp)
            self.rows.store(name, batch["rows"].cpu().numpy(), logps.cpu().numpy())

        model = trainer.model
        was_training = model.training
        model.eval()
        model.entropies = None  # log-probabilities only: the update records the entropies it logs
        try:
            with trainer.autocast():
                if trainer.pipeline is not None:
                    trainer.pipeline.reference_pass(batches, record, context)
                else:
                    with context:
                        for batch in batches:
                            record(model(batch["inputs"], batch["targets"], documents=batch["documents"]), batch)
        finally:
            model.train(was_training)
            model.entropies = []
            self.reshard()

    def reshard(self) -> None:
        """Under FSDP, free what a forward without backward left gathered (`shardlm.training.fsdp.reshard`)."""
        trainer = self.trainer
        if trainer.fsdp is not None:
            from shardlm.training.fsdp import reshard

            reshard([trainer.model] + (trainer.pipeline.stage_modules if trainer.pipeline is not None else []))

    def describe(self, values: np.ndarray, rewards: np.ndarray, zero_std: np.ndarray, rollouts: list[Rollout]
                 ) -> dict:
        """The round's reward and completion metrics, named as TRL logs them."""
        metrics = {"reward": float(np.nanmean(rewards)), "reward_std": float(nanstd(rewards))}
        for i, name in enumerate(reward_names(self.rewards)):
            column = values[:, i]
            metrics[f"rewards/{name}/mean"] = float(np.nanmean(column)) if not np.isnan(column).all() else float("nan")
            metrics[f"rewards/{name}/std"] = float(nanstd(column))
        lengths = np.array([r.policy_tokens for r in rollouts], dtype=np.float64)  # (tool results left out)
        truncated = np.array([r.truncated for r in rollouts])
        metrics |= {"frac_reward_zero_std": float(zero_std.mean()), "completions/mean_length": lengths.mean(),
                    "completions/min_length": lengths.min(), "completions/max_length": lengths.max(),
                    "completions/clipped_ratio": float(truncated.mean())}
        if self.agent is not None:  # the last sampling's tool calls, as TRL's tools/ metrics
            calls = self.agent.calls
            metrics |= {"tools/call_frequency": calls / len(rollouts),
                        "tools/failure_frequency": self.agent.failures / calls if calls else 0.0}
        return metrics
