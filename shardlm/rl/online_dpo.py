"""Online DPO (`rl.loss = "online_dpo"`, TRL's experimental OnlineDPOTrainer): each step the policy samples two
completions of each of the step's prompts at the training layout (the RL rollouts, `rl.num_generations = 2`), the
run's rewards score them (functions and reward models, weighted; `rl.missing_eos_penalty` subtracted from a
completion cut before its end token), the better one is chosen (a tie: the first sampled), and the step is DPO's
sigmoid loss on those pairs with beta = `rl.beta` (or, `rl.dpo_loss_type = "ipo"`, TRL's online IPO: (d - 1 / (2
beta))^2 of the summed log-ratio difference d, not divided by the answers' lengths as the DPO runs' "ipo" is).

The pairs go through the preference runs' machinery: each pair's two sequences (prompt + chosen, prompt + rejected)
packed into one row (`sft.packing`; `StepPairs` places the step's rows at its samples, empty rows after them), their
log-probabilities summed over the answer tokens of the vocabulary-parallel loss and the CP chunks, the reference's
from a copy of the starting weights run in the same step (`preference.reference = "weights"`; a LoRA run's base with
the adapters off), the loss a mean over the global batch's pairs (`shardlm.preference.loss.PreferenceLoss`), so every
layout that trains DPO trains this. As TRL's, the log-probabilities are those of the raw logits (the sampling
temperature shapes the sampling only).
"""

from __future__ import annotations

import numpy as np

from shardlm.errors import UserError
from shardlm.preference.data import PairRows, empty_row
from shardlm.preference.pairs import TokenizedPair

ONLINE_DPO = "online_dpo"


def preference_config(rl):
    """The `PreferenceConfig` of an online DPO run's loss: DPO's sigmoid (or IPO on the summed log-ratios, as TRL's
    online "ipo", `rl.dpo_loss_type`) with the run's beta, against the reference weights (or a LoRA run's base: the
    adapters switched off)."""
    from shardlm.config import PreferenceConfig
    from shardlm.preference.loss import IPO_SUMMED

    loss = IPO_SUMMED if rl.dpo_loss_type == "ipo" else "sigmoid"
    return PreferenceConfig(loss=loss, beta=rl.beta, reference="weights")


def pairs_of(prompts: list, rollouts: list, rewards: np.ndarray, penalty: float) -> tuple[list, np.ndarray]:
    """(the step's pairs, each pair's reward margin chosen - rejected) of `rollouts` in groups of two per prompt (the
    `prompts` of each rollout, in order), with `rewards` (N,) less `penalty` for a truncated completion. A NaN reward
    (no function scored it) counts as the lowest."""
    scores = np.where(np.isnan(rewards), -np.inf, rewards) - penalty * np.array([r.truncated for r in rollouts])
    pairs, margins = [], []
    for k in range(0, len(rollouts), 2):
        first, second = rollouts[k], rollouts[k + 1]
        better = scores[k] >= scores[k + 1]
        chosen, rejected = (first, second) if better else (second, first)
        pairs.append(TokenizedPair(list(first.prompt), list(chosen.completion), list(rejected.completion),
                                   prompts[k].where))
        margins.append(abs(scores[k] - scores[k + 1]) if np.isfinite(scores[k] - scores[k + 1]) else np.nan)
    return pairs, np.array(margins, dtype=np.float64)


class StepPairs:
    """One step's pair rows as the trainer reads a dataset: sample `start + i` is the step's row i (the pairs packed
    by `sft.packing`), later samples of the step are empty rows. A pair whose two sequences do not fit a row is a
    one-line error (a longer model.seq_length, or a shorter rl.max_completion_length)."""

    def __init__(self, pairs: list[TokenizedPair], start: int, rows_per_step: int, seq_length: int, pad_id: int,
                 packing: str):
        self.rows = PairRows(pairs, seq_length, pad_id, seed=None, strategy=packing, overflow="drop")
        if self.rows.stats.dropped:
            longest = max(len(p) for p in pairs)
            raise UserError(f"an online DPO pair's two sequences take {longest} tokens, more than model.seq_length="
                            f"{seq_length}; raise it (or lower rl.max_completion_length)")
        self.plan = self.rows.plan(0)
        if len(self.plan) > rows_per_step:
            raise UserError(f"a step's {len(pairs)} online DPO pairs pack into {len(self.plan)} rows, more than "
                            f"train.global_batch_size={rows_per_step}; raise it or lower rl.prompts_per_step")
        self.start = start

    def __getitem__(self, index: int) -> dict:
        i = index - self.start
        if not 0 <= i < len(self.plan):
            return empty_row(self.rows.seq_length, self.rows.pad_id, False)
        row = self.rows.row(0, i)
        arrays = {"input_ids": row.input_ids, "labels": row.labels, "position_ids": row.position_ids,
                  "pair": row.pair, "side": row.side}
        return {key: value.numpy() for key, value in arrays.items()}


def start_round(run, owners: list[int], rollouts: list, rewards: np.ndarray) -> dict:
    """An online DPO step's rows from its scored rollouts (`RLRun.start_round`'s part): the trainer's data set to the
    step's pairs; returns the round's metrics beside the reward's (TRL's `objective/scores_margin`)."""
    trainer, cfg = run.trainer, run.cfg
    pairs, margins = pairs_of([run.prompts[i] for i in owners], rollouts, rewards, cfg.missing_eos_penalty)
    t = trainer.config.train
    trainer.train_data = StepPairs(pairs, trainer.consumed_samples, t.global_batch_size,
                                   trainer.config.model.seq_length, run.pad_id, trainer.config.sft.packing)
    return {"objective/scores_margin": float(np.nanmean(margins)) if not np.isnan(margins).all() else float("nan")}
