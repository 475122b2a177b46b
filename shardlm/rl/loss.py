"""The RL losses on a round's packed rows, exact at every layout: GRPO's clipped surrogate and its 2025 variants,
as TRL's `GRPOTrainer` defines them (its `_compute_loss`, read in TRL 1.16's source).

Per completion token, with logp the policy's log-probability of the token under logits / temperature (the
vocabulary-parallel cross-entropy: tensor parallelism never gathers logits), old the policy's before the round's
updates (a round of one step: logp itself, detached, so the ratio is exactly 1) and A its sequence's advantage:

    token ratio        w = exp(logp - old)
    sequence ratio     w = exp(mean over the completion of (logp - old))                     (GSPO)
    grpo, bnpo, dr_grpo, dapo, luspo   l = -min(w' A, clip(w, 1 - epsilon, 1 + epsilon_high) A),
                       w' = min(w, delta) under INTELLECT-2's two-sided clip (rl.delta), else w
    cispo              l = -min(w, epsilon_high).detach() A logp    (epsilon_high: a cap on the ratio itself)
    sapo               l = -sigmoid(tau (w - 1)) 4 / tau A          (tau: sapo_temperature_pos where A > 0, else _neg)
    vespo              l = -phi A logp, phi = exp(lambda + k log W - lambda W) detached, W the sequence's whole ratio
                       exp(sum of its clamped log-ratios) clamped to [1e-8, e^20]; k, lambda by the sign of A
    rloo               l = -min(W A, clip(W, 1 - epsilon, 1 + epsilon_high) A), W = exp(sum over the completion of
                       (logp - old)), the same at each of the sequence's tokens (TRL's RLOOTrainer; A leave-one-out)
    gmpo               l = -G A, G = exp(mean over the completion of r'), r' = min(r, clip(r)) where A > 0 else
                       max(r, clip(r)), r = logp - old clipped to [-epsilon, epsilon_high] in log space (TRL's
                       experimental GMPOTrainer: the geometric mean of the clipped token ratios; its KL without w)
    a2po               l = (beta2 (S - S_ref) - A)^2, S the sequence's log-probability summed over its completion
                       (and CP ranks), S_ref the reference's, A = r - V*(x) (TRL's experimental A2POTrainer; the
                       log-probabilities of the raw logits, as its)
    off-policy mask    l = 0 on a sequence with A < 0 whose mean (old - logp) exceeds rl.off_policy_mask_threshold
    entropy mask       l = 0 on a token whose entropy is below the global batch's (1 - rl.top_entropy_quantile)
                       quantile (`prepare`: a no-gradient pass over the step's rows, the quantile over DP x CP)
    KL (beta > 0)      l += beta w (exp(ref - logp) - (ref - logp) - 1)   (k3, with TRL's importance correction;
                       without w under rl.use_bias_correction_kl = false); rloo: none (its KL is in the reward)
    entropy bonus      loss -= c x the mean entropy H over the global batch's completion tokens (those the entropy
                       mask keeps), with its gradient, whatever the loss type's normalizer; c = rl.entropy_coef, under
                       Skywork-OR1's adaptive control (rl.use_adaptive_entropy) moved after each step by
                       rl.entropy_coef_delta towards keeping that mean at rl.entropy_target, and 0 while the last
                       step's mean was above it

The loss is sum over tokens of `weight` x l (`shardlm.rl.batch`: the loss type's normalizer over the global batch);
each micro-batch returns its share times micro-batches x DP, which the trainer's mean over micro-batches and DP
turns back into that sum. A sequence's sums (GSPO's mean, VESPO's total, the mask's mean) span its CP ranks.
Metrics, as TRL logs them: `kl` and `entropy` (token means), `clip_ratio/low_mean`, `clip_ratio/high_mean`,
`clip_ratio/region_mean` (token means; sequence means under GSPO), `cispo_clip_ratio` or `vespo/phi_seq_mean` (the
sequences' mean weight), with an entropy bonus `policy_loss` (the loss without it) and `entropy_coef` (after the
step's update), and `logprob_diff_max`, the largest |rollout log-probability - training log-probability| over the
round's first step (training-inference mismatch; 0 when they agree bitwise).
"""

from __future__ import annotations

import contextlib
import math

import torch

from shardlm.config import RLConfig
from shardlm.data.zigzag import zigzag_split
from shardlm.models.documents import Documents
from shardlm.parallel import sum_over

SUMMED = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
          "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss", "bonus_entropy", "implicit_reward")
CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


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


def sequence_sums(values: torch.Tensor, batch: dict, cp) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's sequence's sum of `values` (b, T) over the completion's counted tokens, and their count (0 where
    no token counts). Under context parallelism a sequence's tokens lie on every CP rank: the sums and counts are
    all-reduced over the group (the sums forward and backward, so each rank's tokens get the gradient of every
    rank's loss terms)."""
    sequence, counted = batch["sequence"], batch["sequence_weight"] > 0
    index = torch.where(counted, sequence, 0).view(-1)
    size = max(batch["sequences"], 1)
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, (values * counted).view(-1))
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, counted.view(-1).to(
        values.dtype))
    if cp.size > 1:
        sums, counts = sum_over(sums, cp), cp.all_reduce(counts)
    where = sequence.clamp(min=0)
    return sums[where], counts[where]


def sequence_mean(values: torch.Tensor, batch: dict, cp) -> torch.Tensor:
    """Each token's sequence's mean of `values` (b, T) over the completion's tokens (`sequence_sums`)."""
    sums, counts = sequence_sums(values, batch, cp)
    return sums / counts.clamp(min=1.0)


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """`torch.quantile(values, q)` (`torch.lerp` between the sorted values around q (n - 1)) without its input size
    limit: values (n,) float32."""
    ordered = torch.sort(values).values
    rank = torch.tensor(q, dtype=values.dtype) * (ordered.numel() - 1)  # in the values' dtype, as torch's
    below = int(rank.long())
    above = min(below + 1, ordered.numel() - 1)
    return torch.lerp(ordered[below], ordered[above], rank - below)


def loss_metrics(loss: str) -> list[str]:
    """The metrics `loss` logs beside kl and entropy, as TRL logs them."""
    return {"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"], "sapo": [],
            "a2po": ["implicit_reward"]}.get(loss, list(CLIPS))


class RLLoss:
    """The trainer's loss for an RL run: `loss(forward, batch)` of an `rl_parts` micro-batch, or
    `of_token_losses(token_losses, batch)` where the pipeline's last stage computed the token losses. Each training
    call adds its metric sums to `sums` (read and reset by the trainer's step: `take_metrics`). `first_step` says
    whether the round's first update is running (the rollout's log-probabilities are then the policy's own);
    `round_steps` is how many optimizer steps a round lasts (more than one: the rows carry the old log-probabilities
    of the policy that sampled them)."""

    def __init__(self, cfg: RLConfig, ctx, model, round_steps: int):
        self.cfg, self.ctx, self.model, self.round_steps = cfg, ctx, model, round_steps
        self.eps_low, self.eps_high = cfg.epsilon, cfg.epsilon_high or cfg.epsilon
        self.sums = dict.fromkeys(SUMMED, 0.0)
        self.logprob_diff = 0.0
        self.first_step = True
        self.bonus = cfg.entropy_coef != 0 or cfg.use_adaptive_entropy
        self.entropy_coef = cfg.entropy_coef
        self.last_entropy = math.inf  # the last step's mean entropy of the bonus's tokens (adaptive control)
        model.logit_temperature = 1.0 if cfg.loss == "a2po" else cfg.temperature  # (A2PO's: the raw logits)
        model.entropies = []
        model.entropy_gradient = self.bonus

    def __call__(self, forward, batch: dict) -> torch.Tensor:
        return self.of_token_losses(forward(batch["inputs"], batch["targets"], documents=batch["documents"]), batch)

    def of_token_losses(self, token_losses: torch.Tensor, batch: dict) -> torch.Tensor:
        """The micro-batch's share of the global batch's loss, from the policy's token losses (b, T)."""
        cfg = self.cfg
        entropy = self.model.entropies.pop() if self.model.entropies else None
        trained = batch["targets"] != -100
        logp = (-token_losses).double()
        old = batch["old_logp"] if self.round_steps > 1 else logp.detach()
        if cfg.loss == "a2po":
            return self._a2po(logp, trained, entropy, batch)
        log_ratio = torch.where(trained, logp - old, 0.0)
        sequence_level = cfg.importance_sampling == "sequence"
        if cfg.loss == "rloo":  # TRL's RLOO: the ratio of the sequence's whole log-probability
            coef = torch.exp(sequence_sums(log_ratio, batch, self.ctx.cp)[0])
        elif cfg.loss == "gmpo":  # the geometric mean of the tokens' ratios, each clipped in log space by A's sign
            clamped = log_ratio.clamp(-self.eps_low, self.eps_high)
            clipped = torch.where(batch["advantage"] > 0, torch.minimum(log_ratio, clamped),
                                  torch.maximum(log_ratio, clamped))
            coef = torch.exp(sequence_mean(clipped, batch, self.ctx.cp))
        else:
            coef = torch.exp(sequence_mean(log_ratio, batch, self.ctx.cp) if sequence_level else log_ratio)
        advantage = batch["advantage"]
        losses, seen = self._policy_losses(coef, log_ratio, advantage, logp, batch)
        if cfg.off_policy_mask_threshold:
            drift = sequence_mean(torch.where(trained, old - logp.detach(), 0.0), batch, self.ctx.cp)
            losses = losses * ((advantage >= 0) | (drift <= cfg.off_policy_mask_threshold))
        if "high_entropy" in batch:
            losses = losses * batch["high_entropy"]
        kl = None
        if cfg.beta and cfg.loss != "rloo":  # (RLOO's KL is in its reward: `RLRun.leave_one_out`)
            delta = batch["ref_logp"] - logp
            kl = torch.exp(delta) - delta - 1
            if cfg.use_bias_correction_kl and cfg.loss != "gmpo":  # (GMPO's is the plain sequence mean)
                kl = kl * coef
            losses = losses + cfg.beta * kl
        loss = policy = (torch.where(trained, losses, 0.0) * batch["weight"]).sum()
        if "masked_share" in batch:  # RLOO, GMPO: a masked truncated sequence's constant -A in the mean (TRL's)
            loss = policy = policy - (advantage * batch["masked_share"]).sum()
        if self.bonus and entropy is not None:  # the global batch's mean over the bonus's tokens (`mark_high_entropy`)
            mean_entropy = (entropy.double() * batch.get("entropy_weight", batch["token_weight"])).sum()
            loss = policy - self.applied_coef() * mean_entropy
            if self.model.training:
                self.sums["policy_loss"] += policy.item()
                self.sums["bonus_entropy"] += mean_entropy.item()
        if self.model.training:
            self._record(seen.detach(), advantage, kl, entropy, logp.detach(), batch)
        return (loss * batch["scale"]).float()

    def _a2po(self, logp: torch.Tensor, trained: torch.Tensor, entropy, batch: dict) -> torch.Tensor:
        """A*-PO's share of the loss (module docstring): each sequence's squared error, the same at each of its tokens,
        weighted to its mean over the global batch's sequences."""
        cp, cfg = self.ctx.cp, self.cfg
        total = sequence_sums(torch.where(trained, logp, 0.0), batch, cp)[0]
        reference = sequence_sums(torch.where(trained, batch["ref_logp"], 0.0), batch, cp)[0]
        implicit = cfg.beta2 * (total - reference)
        loss = (torch.where(trained, (implicit - batch["advantage"]) ** 2, 0.0) * batch["weight"]).sum()
        if self.model.training:
            self.sums["implicit_reward"] += (implicit.detach() * batch["sequence_weight"]).sum().item()
            self._record(None, batch["advantage"], None, entropy, logp.detach(), batch)
        return (loss * batch["scale"]).float()

    def applied_coef(self) -> float:
        """The entropy bonus's coefficient this step (the adaptive one only at or below the target, as TRL)."""
        if self.cfg.use_adaptive_entropy and self.last_entropy > self.cfg.entropy_target:
            return 0.0
        return self.entropy_coef

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the loss: the adaptive entropy control's coefficient and last mean."""
        return {"entropy_coef": self.entropy_coef,
                "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.entropy_coef = state["entropy_coef"]
        self.last_entropy = math.inf if state["last_entropy"] is None else state["last_entropy"]

    def prepare(self, forward, batches: list[dict]) -> None:
        """Before a step's micro-batches, with `rl.top_entropy_quantile` < 1: each micro-batch's `high_entropy` mask
        (b, T), its tokens at or above the global batch's entropy quantile (`record_entropies` of one no-gradient
        forward pass of each)."""
        if self.cfg.top_entropy_quantile >= 1:
            return
        with torch.no_grad():  # (the entropies without gradient, whatever `entropy_gradient` says)
            for batch in batches:
                self.record_entropies(forward(batch["inputs"], batch["targets"], documents=batch["documents"]), batch)
        self.mark_high_entropy(batches)

    def prepare_stages(self, pipeline, batches: list[dict]) -> None:
        """`prepare` under pipeline stages: the no-gradient pass through the stages, the entropies and the masks on
        the last stage (which alone computes the loss)."""
        if self.cfg.top_entropy_quantile >= 1:
            return
        pipeline.reference_pass(batches, self.record_entropies, contextlib.nullcontext())  # (without gradient)
        if self.ctx.pp_rank == pipeline.last_rank:
            self.mark_high_entropy(batches)

    def record_entropies(self, token_losses: torch.Tensor, batch: dict) -> None:
        """Keep the entropies (b, T) the forward that gave `token_losses` appended to the model's list."""
        batch["entropy"] = self.model.entropies.pop()

    def mark_high_entropy(self, batches: list[dict]) -> None:
        """Each batch's `high_entropy` (b, T): its counted tokens whose entropy is at least the (1 -
        top_entropy_quantile) quantile of every counted token's of the global batch (all-gathered over DP x CP; linear
        interpolation, as `torch.quantile` in TRL's `get_high_entropy_mask`), and its `entropy_weight` (b, T): 1 / the
        global batch's count of such tokens on them (the entropy bonus's mean)."""
        entropies = [b.pop("entropy").float() for b in batches]
        counted = [b["token_weight"] > 0 for b in batches]
        values = self.ctx.dp_cp.all_gather_rows(torch.cat([e[c] for e, c in zip(entropies, counted)]))[0]
        threshold = quantile(values, 1.0 - self.cfg.top_entropy_quantile) if values.numel() else math.inf
        count = max(int((values >= threshold).sum()), 1)
        for batch, entropy, kept in zip(batches, entropies, counted):
            batch["high_entropy"] = kept & (entropy >= threshold)
            batch["entropy_weight"] = batch["high_entropy"] / count

    def _policy_losses(self, coef, log_ratio, advantage, logp, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's policy term l (b, T) (module docstring) and what the loss type's metric reads: the ratio as
        the surrogate took it (delta's cap included, as TRL counts clipped tokens) or VESPO's weight."""
        cfg = self.cfg
        if cfg.loss == "cispo":
            return -torch.clamp(coef, max=self.eps_high).detach() * advantage * logp, coef
        if cfg.loss == "sapo":
            tau = torch.where(advantage > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
            return -torch.sigmoid(tau * (coef - 1)) * 4 / tau * advantage, coef
        if cfg.loss == "vespo":
            phi = self._gamma_weights(log_ratio.detach(), advantage, batch)
            return -phi * advantage * logp, phi
        if cfg.loss == "gmpo":  # (its clip ratios count the tokens' log-ratios outside the log-space range)
            return -coef * advantage, log_ratio
        clipped = torch.clamp(coef, 1 - self.eps_low, 1 + self.eps_high)
        if cfg.delta:
            coef = torch.clamp(coef, max=cfg.delta)
        return -torch.min(coef * advantage, clipped * advantage), coef

    def _gamma_weights(self, log_ratio, advantage, batch) -> torch.Tensor:
        """VESPO's weight phi of each token's sequence (b, T), as TRL's `get_gamma_weights`: the sequence's log-ratio
        log W, the sum of its tokens' (each clamped to [-20, 20]), clamped to [log 1e-8, 20]; phi = exp(lambda +
        k log W - lambda W), k and lambda those of A >= 0 or A < 0 (lambda at least 1e-4); phi(1) = 1."""
        cfg = self.cfg
        log_w = sequence_sums(log_ratio.clamp(-20.0, 20.0), batch, self.ctx.cp)[0].clamp(math.log(1e-8), 20.0)
        positive = advantage >= 0
        k = torch.where(positive, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = torch.where(positive, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def _record(self, coef, advantage, kl, entropy, logp, batch) -> None:
        """Add this micro-batch's metric sums (each token's value times its token or sequence weight)."""
        token_weight = batch["token_weight"]
        by_sequence = self.cfg.importance_sampling == "sequence" or self.cfg.loss == "rloo"
        weight = batch["sequence_weight"] if by_sequence else token_weight
        sums = self.sums
        if kl is not None:
            sums["kl"] += (kl.detach() * token_weight).sum().item()
        if entropy is not None:
            sums["entropy"] += (entropy.double() * token_weight).sum().item()
        if self.cfg.loss == "cispo":
            sums["cispo_clip_ratio"] += (((coef > self.eps_high) & (advantage > 0)) * token_weight).sum().item()
        elif self.cfg.loss == "vespo":  # the mean over sequences less 1 (a masked sequence's phi is exactly 1)
            sums["vespo/phi_seq_mean"] += ((coef - 1) * batch["sequence_weight"]).sum().item()
        elif self.cfg.loss not in ("sapo", "a2po"):
            low, high = (coef < -self.eps_low, coef > self.eps_high) if self.cfg.loss == "gmpo" else (
                coef < 1 - self.eps_low, coef > 1 + self.eps_high)  # (gmpo: the log-ratios, in log space)
            low, high = low & (advantage < 0), high & (advantage > 0)
            sums["clip_ratio/low_mean"] += (low * weight).sum().item()
            sums["clip_ratio/high_mean"] += (high * weight).sum().item()
            sums["clip_ratio/region_mean"] += ((low | high) * weight).sum().item()
        if self.first_step and self.cfg.loss != "a2po":  # (A2PO's rollouts: logits / temperature; its loss: raw)
            sampled = batch["sample_logp"]
            known = (token_weight > 0) & ~torch.isnan(sampled)
            if known.any():
                diff = (sampled - logp).abs()[known].max().item()
                self.logprob_diff = max(self.logprob_diff, diff)

    def take_metrics(self) -> dict[str, float]:
        """The step's metrics over the global batch (one all-reduce over DP x CP and the pipeline group, whose last
        stage alone computed them), then reset."""
        kl = self.cfg.beta and self.cfg.loss != "rloo"  # (RLOO's is the round's, logged by the loop)
        names = ((["kl"] if kl else []) + ["entropy"] + loss_metrics(self.cfg.loss)
                 + (["policy_loss", "bonus_entropy"] if self.bonus else []))
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
        if "vespo/phi_seq_mean" in metrics:
            metrics["vespo/phi_seq_mean"] += 1.0
        if self.first_step and self.cfg.loss != "a2po":
            metrics["logprob_diff_max"] = diff.item()
        if self.bonus:
            self._adapt(metrics.pop("bonus_entropy"))
            metrics["entropy_coef"] = self.entropy_coef
        return metrics

    def _adapt(self, mean_entropy: float) -> None:
        """Skywork-OR1's control after a step, as TRL's: the coefficient up by delta (at most the max) at or below the
        target, else down (at least the min)."""
        cfg = self.cfg
        if not cfg.use_adaptive_entropy:
            return
        if mean_entropy <= cfg.entropy_target:
            self.entropy_coef = min(self.entropy_coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self.last_entropy = mean_entropy
