"""A*-PO (`rl.loss = "a2po"`, TRL's experimental A2POTrainer; Brantley et al. 2025, "Accelerating RL for LLM
Reasoning with Optimal Advantage Regression"): GRPO's groups replaced by an optimal value estimated once.

Stage 1, before the first step (`prepare`): each training prompt's `rl.num_value_samples` completions, sampled by the
starting policy (the reference) at the training layout as rollouts are (each data x context-parallel rank its share,
every sequence from its own seed), scored by the run's rewards, give its optimal value

    V*(x) = beta1 (log sum_i exp(r_i / beta1) - log N)        (a soft maximum of the N rewards; beta1 = rl.beta1)

and, with `rl.filter_all_incorrect`, the prompts whose rewards sum to 0 leave the training set (no signal), as TRL's.
The values go to the run directory (`a2po_values.json`): a resumed run reads them, since its weights are no longer
the starting ones.

Stage 2, every step: one completion a prompt (`rl.num_generations = 1`) sampled by the policy; its target
A = r - V*(x) is the rows' advantage, and the loss (`shardlm.rl.loss`) is the mean over the global batch's sequences
of (beta2 (log pi(y|x) - log pi_ref(y|x)) - A)^2, each log-probability summed over the completion (and its CP
ranks) from the raw logits, as TRL's; the reference's from a scoring pass of the starting weights (a LoRA run's base).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from shardlm.errors import UserError

A2PO = "a2po"
VALUE_ROUND = -1
"""The round index stage 1 samples under (fixed completions: `rl.completions` records of step -1)."""
VALUES_FILE = "a2po_values.json"


def value_seed(seed: int, sequence: int) -> int:
    """The sampling seed of stage 1's sequence `sequence` (prompt i's k-th sample: i N + k); a key of another length
    than the rounds' and the evaluation's, so never one of their seeds."""
    return int(np.random.SeedSequence([seed, sequence, 0, 2, 0]).generate_state(1, np.uint64)[0] >> 1)


def optimal_values(rewards: np.ndarray, beta1: float) -> np.ndarray:
    """(P, N) each prompt's samples' rewards -> (P,) V* = beta1 (logsumexp(r / beta1) - log N), in fp32 as TRL's."""
    r = torch.from_numpy(np.asarray(rewards, dtype=np.float32))
    return (beta1 * (torch.logsumexp(r / beta1, dim=1) - math.log(r.shape[1]))).double().numpy()


def estimate(run) -> dict:
    """Stage 1 over `run`'s training prompts, a round's prompts at a time (announced in one line, counted by a
    progress bar on the main rank, as the training steps are: `log.progress`): {"values": V* per prompt,
    "all_incorrect": whether its rewards sum to 0}, the same on every rank."""
    from tqdm import tqdm

    from shardlm.rl.advantages import combine_rewards

    n, per_chunk = run.cfg.num_value_samples, max(run.per_round, 1)
    config = run.trainer.config
    values, incorrect = [], []
    show = run.ctx.is_main and config.log.progress
    if show:
        tqdm.write(f"a2po: sampling {n} completions of each of {len(run.prompts)} prompts with the starting weights "
                   "(stage 1: their optimal values)")
    with tqdm(total=len(run.prompts), desc="a2po values", unit="prompt", dynamic_ncols=True, leave=False,
              disable=not show) as bar:
        for first in range(0, len(run.prompts), per_chunk):
            owners = [i for i in range(first, min(first + per_chunk, len(run.prompts))) for _ in range(n)]
            prompts = [run.prompts[i] for i in owners]
            rollouts = run.sample(prompts, lambda j: value_seed(config.train.seed, j), VALUE_ROUND, offset=first * n)
            rewards = combine_rewards(run.score(prompts, rollouts), run.weights).reshape(-1, n)
            values += optimal_values(rewards, run.cfg.beta1).tolist()
            incorrect += [bool(np.nansum(row) == 0) for row in rewards]
            bar.update(len(rewards))
    return {"prompts": len(run.prompts), "num_value_samples": n, "beta1": run.cfg.beta1, "values": values,
            "all_incorrect": incorrect}


def prepare(run, run_dir: Path | None, resumed: bool) -> str:
    """Stage 1 (or, resumed, its saved result), then the training prompts kept; the line that says what it found."""
    cfg = run.cfg
    path = Path(run_dir) / VALUES_FILE if run_dir is not None else None
    if resumed:
        if path is None or not path.exists():
            raise UserError(f"{path}: a resumed rl.loss=\"a2po\" run needs the optimal values its start estimated "
                            "from the starting weights, and they are missing; start the run again from scratch")
        saved = json.loads(path.read_text(encoding="utf-8"))
        expected = {"prompts": len(run.prompts), "num_value_samples": cfg.num_value_samples, "beta1": cfg.beta1}
        if {k: saved.get(k) for k in expected} != expected:
            raise UserError(f"{path}: its optimal values are of {saved.get('prompts')} prompts, "
                            f"{saved.get('num_value_samples')} samples, beta1 {saved.get('beta1')}; this run has "
                            f"{expected['prompts']}, {expected['num_value_samples']}, {expected['beta1']}")
    else:
        saved = estimate(run)
        if path is not None and run.ctx.is_main:
            tmp = path.with_name(f".tmp-{path.name}")
            tmp.write_text(json.dumps(saved), encoding="utf-8")
            os.replace(tmp, path)
    values, incorrect = np.array(saved["values"]), np.array(saved["all_incorrect"], dtype=bool)
    kept = np.flatnonzero(~incorrect) if cfg.filter_all_incorrect else np.arange(len(values))
    if not len(kept):
        raise UserError(f"every training prompt's {cfg.num_value_samples} value samples scored 0: nothing to learn "
                        "from; set rl.filter_all_incorrect=false or check the rewards")
    run.prompts, run.values = [run.prompts[i] for i in kept], values[kept]
    dropped = len(values) - len(kept)
    return (f"a2po: V* of {len(values)} prompts from {cfg.num_value_samples} samples each of the starting policy "
            f"(beta1 {cfg.beta1:g}{', read from ' + str(path) if resumed else ''}): mean {values.mean():.4g}; "
            + (f"{dropped} prompts whose samples all scored 0 left out" if cfg.filter_all_incorrect
               else f"{int(incorrect.sum())} prompts whose samples all scored 0 kept"))


def targets(run, owners: list[int], rewards: np.ndarray) -> tuple[np.ndarray, dict]:
    """(each sequence's target r - V*(x) (N,), the round's metrics as TRL logs them: `v_star` and `advantage`)."""
    v_star = run.values[np.asarray(owners)]
    advantages = rewards - v_star
    return advantages, {"v_star": float(v_star.mean()), "advantage": float(np.nanmean(advantages))}
