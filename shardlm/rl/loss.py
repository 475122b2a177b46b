"""The RL losses on a round's packed rows, exact at every layout: GRPO's clipped surrogate and its 2025 variants,
as TRL's `GRPOTrainer` defines them (its `_compute_loss`, read in TRL 1.16's source).

Per completion token, with logp the policy's log-probability of the token under logits / temperature (the
vocabulary-parallel cross-entropy: tensor parallelism never gathers logits), old the policy's before the round's
updates (num_iterations 1: logp itself, detached, so the ratio is exactly 1) and A its sequence's advantage:

    token ratio        w = exp(logp - old)
    sequence ratio     w = exp(mean over the completion of (logp - old))                     (GSPO)
    grpo, bnpo, dr_grpo, dapo   l = -min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)
    cispo              l = -min(w, epsilon_high).detach() A logp    (epsilon_high: a cap on the ratio itself)
    KL (beta > 0)      l += beta w (exp(ref - logp) - (ref - logp) - 1)   (k3, with TRL's importance correction)

The loss is sum over tokens of `weight` x l (`shardlm.rl.batch`: the loss type's normalizer over the global batch);
each micro-batch returns its share times micro-batches x DP, which the trainer's mean over micro-batches and DP
turns back into that sum. Metrics, as TRL logs them: `kl` and `entropy` (token means), `clip_ratio/low_mean`,
`clip_ratio/high_mean`, `clip_ratio/region_mean` (token means; sequence means under GSPO) or
`cispo_clip_ratio`, and `logprob_diff_max`, the largest |rollout log-probability - training log-probability| over
the round's first step (training-inference mismatch; 0 when they agree bitwise).
"""

from __future__ import annotations

import torch

from shardlm.config import RLConfig
from shardlm.data.zigzag import zigzag_split
from shardlm.models.documents import Documents
from shardlm.parallel import sum_over

SUMMED = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
          "cispo_clip_ratio")


def rl_parts(batches: list[dict], ctx) -> list[dict]:
    """This rank's micro-batches of a round's rows (dicts of (b, T) arrays, `StepRows`) -> dicts of `inputs`,
    `targets`, `documents`, `rows` (b,), the per-token fields (b, T / C: the zigzag part under context parallelism,
    as the inputs), `sequences` (the micro-batch's sequence count, the same on its CP ranks) and `scale` =
    micro-batches x DP x CP (the trainer averages gradients and losses over DP x CP)."""
    parts = []
    for batch in batches:
        part = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids", "row")}
        part |= {"inputs": batch["input_ids"], "targets": batch["labels"]}
        if ctx.cp_size > 1:
            part = {k: zigzag_split(v, ctx.cp_size, ctx.cp_rank) for k, v in part.items()}
        part |= {"rows": batch["row"][:, 0], "sequences": int(batch["sequence"].max()) + 1,
                 "documents": Documents.from_positions(batch["position_ids"], ctx.cp_size, ctx.cp_rank),
                 "scale": len(batches) * ctx.dp_size * ctx.cp_size, "divisor": None}
        parts.append(part)
    return parts


def sequence_mean(values: torch.Tensor, batch: dict, cp) -> torch.Tensor:
    """Each token's sequence's mean of `values` (b, T) over the completion's tokens (0 where no token counts). Under
    context parallelism a sequence's tokens lie on every CP rank: the sums and counts are all-reduced over the group
    (the sums forward and backward, so each rank's tokens get the gradient of every rank's loss terms)."""
    sequence, counted = batch["sequence"], batch["sequence_weight"] > 0
    index = torch.where(counted, sequence, 0).view(-1)
    size = max(batch["sequences"], 1)
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, (values * counted).view(-1))
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, counted.view(-1).to(
        values.dtype))
    if cp.size > 1:
        sums, counts = sum_over(sums, cp), cp.all_reduce(counts)
    return (sums / counts.clamp(min=1.0))[sequence.clamp(min=0)]


class RLLoss:
    """The trainer's loss for an RL run: `loss(forward, batch)` of an `rl_parts` micro-batch, or
    `of_token_losses(token_losses, batch)` where the pipeline's last stage computed the token losses. Each training
    call adds its metric sums to `sums` (read and reset by the trainer's step: `take_metrics`). `first_step` says
    whether the round's first update is running (the rollout's log-probabilities are then the policy's own)."""

    def __init__(self, cfg: RLConfig, ctx, model):
        self.cfg, self.ctx, self.model = cfg, ctx, model
        self.eps_low, self.eps_high = cfg.epsilon, cfg.epsilon_high or cfg.epsilon
        self.sums = dict.fromkeys(SUMMED, 0.0)
        self.logprob_diff = 0.0
        self.first_step = True
        model.logit_temperature = cfg.temperature
        model.entropies = []

    def __call__(self, forward, batch: dict) -> torch.Tensor:
        return self.of_token_losses(forward(batch["inputs"], batch["targets"], documents=batch["documents"]), batch)

    def of_token_losses(self, token_losses: torch.Tensor, batch: dict) -> torch.Tensor:
        """The micro-batch's share of the global batch's loss, from the policy's token losses (b, T)."""
        cfg = self.cfg
        entropy = self.model.entropies.pop() if self.model.entropies else None
        trained = batch["targets"] != -100
        logp = (-token_losses).double()
        old = batch["old_logp"] if cfg.num_iterations > 1 else logp.detach()
        log_ratio = torch.where(trained, logp - old, 0.0)
        sequence_level = cfg.importance_sampling == "sequence"
        coef = torch.exp(sequence_mean(log_ratio, batch, self.ctx.cp) if sequence_level else log_ratio)
        advantage = batch["advantage"]
        if cfg.loss == "cispo":
            losses = -torch.clamp(coef, max=self.eps_high).detach() * advantage * logp
        else:
            clipped = torch.clamp(coef, 1 - self.eps_low, 1 + self.eps_high)
            losses = -torch.min(coef * advantage, clipped * advantage)
        kl = None
        if cfg.beta:
            delta = batch["ref_logp"] - logp
            kl = (torch.exp(delta) - delta - 1) * coef
            losses = losses + cfg.beta * kl
        loss = (torch.where(trained, losses, 0.0) * batch["weight"]).sum() * batch["scale"]
        if self.model.training:
            self._record(coef.detach(), advantage, kl, entropy, logp.detach(), batch)
        return loss.float()

    def _record(self, coef, advantage, kl, entropy, logp, batch) -> None:
        """Add this micro-batch's metric sums (each token's value times its token or sequence weight)."""
        token_weight = batch["token_weight"]
        weight = batch["sequence_weight"] if self.cfg.importance_sampling == "sequence" else token_weight
        sums = self.sums
        if kl is not None:
            sums["kl"] += (kl.detach() * token_weight).sum().item()
        if entropy is not None:
            sums["entropy"] += (entropy.double() * token_weight).sum().item()
        if self.cfg.loss == "cispo":
            sums["cispo_clip_ratio"] += (((coef > self.eps_high) & (advantage > 0)) * token_weight).sum().item()
        else:
            low = (coef < 1 - self.eps_low) & (advantage < 0)
            high = (coef > 1 + self.eps_high) & (advantage > 0)
            sums["clip_ratio/low_mean"] += (low * weight).sum().item()
            sums["clip_ratio/high_mean"] += (high * weight).sum().item()
            sums["clip_ratio/region_mean"] += ((low | high) * weight).sum().item()
        if self.first_step:
            sampled = batch["sample_logp"]
            known = (token_weight > 0) & ~torch.isnan(sampled)
            if known.any():
                diff = (sampled - logp).abs()[known].max().item()
                self.logprob_diff = max(self.logprob_diff, diff)

    def take_metrics(self) -> dict[str, float]:
        """The step's metrics over the global batch (one all-reduce over DP x CP and the pipeline group, whose last
        stage alone computed them), then reset."""
        clips = ["cispo_clip_ratio"] if self.cfg.loss == "cispo" else [k for k in SUMMED if k.startswith("clip")]
        names = (["kl"] if self.cfg.beta else []) + ["entropy"] + clips
        values = torch.tensor([self.sums[k] for k in names], dtype=torch.float64, device=self.ctx.device)
        diff = torch.tensor([self.logprob_diff], dtype=torch.float64, device=self.ctx.device)
        self.ctx.dp_cp.all_reduce(values)
        self.ctx.dp_cp.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
        if self.ctx.pp_size > 1:
            self.ctx.pp.all_reduce(values)
            self.ctx.pp.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
        self.sums = dict.fromkeys(SUMMED, 0.0)
        self.logprob_diff = 0.0
        self.model.entropies = []
        metrics = dict(zip(names, values.tolist()))
        if self.first_step:
            metrics["logprob_diff_max"] = diff.item()
        return metrics
