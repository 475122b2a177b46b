"""Preference losses on packed pairs, exact at every layout.

A sequence's log-probability is the sum over its answer's tokens of log p(token | everything before it) (the
prompt masked, as in SFT), from the model's per-token losses through the vocabulary-parallel cross-entropy,
so tensor parallelism never gathers logits. Per micro-batch: the token losses are summed per (pair, side)
(`sequence_logps`); under context parallelism each rank holds part of each sequence, so the sums are
all-reduced over CP, and their gradient too (every CP rank computes the same pair losses, each rank's tokens
receive their share from every copy: `sum_over`). The loss of the global batch is the mean over its pairs:
each micro-batch returns its pairs' summed losses over `divisor` = pairs of the global batch / (micro-batches x
DP), which the trainer's mean over micro-batches and DP x CP turns into exactly that mean.

Losses (`preference.loss`), as TRL's `DPOTrainer` (1.16) defines them, with r = log pi(y | x) - log pi_ref(y | x)
per answer, s = f'(r) its f-divergence score (`f_divergence_type`: r itself for the reverse KL, DPO's), z = beta
(s_chosen - s_rejected), sigma the sigmoid and eps = label_smoothing:

    sigmoid   -(1 - eps) log sigma(z) - eps log sigma(-z)                   DPO (eps > 0: conservative DPO)
    sigmoid_norm  -log sigma(z) with each answer's s divided by its token count
    ipo       (z / beta - 1 / (2 beta))^2 with each s divided by its token count, as TRL computes IPO
    hinge     max(0, 1 - z)                                                 (SLiC)
    robust    (-(1 - eps) log sigma(z) + eps log sigma(-z)) / (1 - 2 eps)   (rDPO: eps of the labels flipped)
    exo_pair  sigma(z) (log sigma(z) - log(1 - eps)) + sigma(-z) (log sigma(-z) - log eps)   (EXO, eps > 0)
    discopop  -log sigma(z) (1 - m) + exp(-z) m, m = sigma(z / discopop_tau)
    nca_pair  -log sigma(beta r_c) - log sigma(-beta r_c) / 2 - log sigma(-beta r_r) / 2
    bco_pair  -log sigma(beta r_c) - log sigma(-beta r_r)
    sppo_hard (r_c - 1 / (2 beta))^2 + (r_r + 1 / (2 beta))^2
    apo_zero  1 - sigma(beta r_c) + sigma(beta r_r)
    apo_down  sigma(beta r_c) + 1 - sigma(beta (r_c - r_r))
    a+b+...   the weighted sum of those losses (`loss_weights`; MPO: "sigmoid+bco_pair+sft", 0.8, 0.2, 1.0), where
              "sft" is the chosen answers' NLL, a mean over the global batch's chosen tokens (TRL's is per device
              micro-batch): each pair contributes -logp_c x pairs / chosen tokens, both counted over the global batch;
              "gold" the same NLL of TPO's gold answers (the records' `reference`, a third sequence of each pair:
              TPO is "cpo+gold", TPO-L "simpo+gold", with loss_weights [1, tpo_alpha])
    simpo, orpo, cpo, cpo_hinge, cpo_ipo   reference-free (`shardlm.preference.reference_free`; a sum with "sft":
              CPO's NLL term)
    kto       unpaired examples, each desirable or not, against a KL reference point (`shardlm.preference.kto`);
              apo_zero_unpaired the same without it

WPO (`use_weighting`, the losses with a reference): each pair's loss times w_c w_r, w = exp of the mean over the
answer's tokens of (log p - log sum_v p_v^2), the policy's without gradient (`wpo_weights`; the vocabulary's sum of
squares from the output layer, `log_sum_sq`, reduced over TP; the means over a sequence's CP ranks).

LD-DPO (`ld_alpha` < 1, the losses with a reference): each answer's log-probability, the policy's and the
reference's, counts its first min(n_c, n_r) tokens fully and the rest times ld_alpha (`length_weights`: positions
within each answer found on the whole rows, before a CP split); the token counts and the "sft" term stay unweighted,
as in TRL.

Logged as TRL logs them: rewards of chosen and rejected (beta r; SimPO and ORPO: beta times the normalized
log-probability), their margin and the accuracy (chosen reward above rejected), each a mean over the pairs.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from shardlm.config import PreferenceConfig
from shardlm.data.zigzag import zigzag_split
from shardlm.errors import UserError
from shardlm.lora.switch import adapters_off, has_adapters
from shardlm.models.documents import Documents
from shardlm.parallel import sum_over
from shardlm.preference import aot, kto, reference_free
from shardlm.preference.reference_free import REFERENCE_FREE

F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "ipo", "hinge", "robust", "exo_pair", "discopop")
"""The losses of the score difference z, which take an f-divergence other than the reverse KL (TRL's list less its
"sft"): the others read each side's log-ratio, where the f-DPO reparameterization's log Z(x) would not cancel."""
REFERENCED = F_DIVERGENCE_LOSSES + ("nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down") + aot.AOT_LOSSES
IPO_SUMMED = "ipo_summed"
"""IPO on the summed log-ratios, not divided by the answers' token counts: online DPO's "ipo" (TRL's
OnlineDPOTrainer), set by `shardlm.rl.online_dpo`, not a [preference] loss."""
LOSSES = REFERENCED + REFERENCE_FREE + kto.UNPAIRED
NLL_TERMS = ("sft", "gold")
"""The terms of a sum ("a+b+...") that are answers' NLL: the chosen answers' and TPO's gold answers'."""
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def preference_parts(batches: list[dict], ctx, count_pairs: bool = True, ld_alpha: float = 1.0) -> list[dict]:
    """This rank's micro-batches of pair rows (dicts of (b, T) arrays, `shardlm.preference.data`) -> dicts of
    `inputs`, `targets`, `occurrence`, `side` (b, T / C: the zigzag part under CP; with `ld_alpha` < 1 also
    `length_weight`, LD-DPO's token weights: `length_weights`), `documents`, `pairs` (the pair
    index of each of the micro-batch's pair occurrences, `pair_occurrences`), `divisor` (module docstring) and
    `chosen_share` and `gold_share` (the global batch's pairs / its chosen, or gold, answers' trained tokens: the
    "sft" and "gold" terms' scales), all from one all-reduce over DP (None without `count_pairs`); KTO's micro-batches
    also `kl`, the same of their KL sequences."""
    found = [pair_occurrences(b["pair"]) for b in batches]
    divisor = chosen_share = gold_share = None
    if count_pairs:
        def trained(b: dict, side: int) -> float:
            return float(torch.count_nonzero((b["pair"] >= 0) & (b["side"] == side) & (b["labels"] != -100)))
        total = torch.tensor([float(sum(len(pairs) for pairs, _ in found)), sum(trained(b, 0) for b in batches),
                              sum(trained(b, 2) for b in batches)], dtype=torch.float64, device=ctx.device)
        ctx.dp.all_reduce(total)
        if total[0].item() == 0:
            raise UserError("a global batch holds no preference pair: check the records")
        divisor = total[0].item() / (len(batches) * ctx.dp_size)
        chosen_share = total[0].item() / max(total[1].item(), 1.0)
        gold_share = total[0].item() / max(total[2].item(), 1.0)
    parts = []
    for batch, (pairs, occurrence) in zip(batches, found):
        part = _local_part(batch, "", occurrence, ctx, ld_alpha) | {"pairs": pairs, "divisor": divisor,
                                                                    "chosen_share": chosen_share,
                                                                    "gold_share": gold_share}
        if "kl_input_ids" in batch:  # KTO: the examples' KL sequences, their own rows (`shardlm.preference.kto`)
            kl_pairs, kl_occurrence = pair_occurrences(batch["kl_pair"])  # each row holds the same examples
            part["kl"] = _local_part(batch, "kl_", kl_occurrence, ctx) | {"pairs": kl_pairs, "divisor": divisor}
        parts.append(part)
    return parts


def pair_occurrences(owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs (P,), occurrence (b, T)) of a micro-batch's `pair` array (b, T; -1 off pairs): each (row, pair) the
    rows hold is one occurrence, in row-then-pair order; `pairs` is the pair index of each, `occurrence` each token's
    (-1 off pairs). A pair the micro-batch holds twice (a batch across an epoch's end on a small data set) is two
    occurrences, each its own sequences' sum, as it would be in two micro-batches."""
    rows = torch.arange(owner.shape[0], device=owner.device).unsqueeze(1)
    key = torch.where(owner >= 0, rows * PAIR_SPAN + owner, -1)
    keys = torch.unique(key[key >= 0])
    occurrence = torch.where(owner >= 0, torch.searchsorted(keys, key.clamp(min=0)), -1)
    return keys % PAIR_SPAN, occurrence


PAIR_SPAN = 1 << 40
"""More than any data set's pair count: (row, pair) -> row x PAIR_SPAN + pair keeps the order and fits int64."""


def _local_part(batch: dict, prefix: str, occurrence: torch.Tensor, ctx, ld_alpha: float = 1.0) -> dict:
    """This rank's `inputs`, `targets`, `occurrence`, `side` and `documents` of the micro-batch's arrays named
    `prefix` + `input_ids`, `labels`, `side`, `position_ids` and of `occurrence` (the zigzag part under CP), and
    with `ld_alpha` < 1 the `length_weight` of its tokens."""
    local = {k: batch[prefix + k] for k in ("input_ids", "labels", "side")} | {"occurrence": occurrence}
    if ld_alpha < 1:
        local["length_weight"] = length_weights(local["labels"], occurrence, local["side"], ld_alpha)
    if ctx.cp_size > 1:
        local = {k: zigzag_split(v, ctx.cp_size, ctx.cp_rank) for k, v in local.items()}
    return {"inputs": local["input_ids"], "targets": local["labels"], "occurrence": local["occurrence"],
            "side": local["side"],
            "documents": Documents.from_positions(batch[prefix + "position_ids"], ctx.cp_size, ctx.cp_rank)} | (
        {"length_weight": local["length_weight"]} if "length_weight" in local else {})


def length_weights(labels: torch.Tensor, occurrence: torch.Tensor, side: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's weights (b, T) fp64 of whole rows' tokens: on each pair occurrence's answers, 1 for an answer's first
    min(n_chosen, n_rejected) trained tokens and `alpha` after them; 0 off the answers. An occurrence lies in one row,
    so each answer's tokens come in order along it."""
    trained = (occurrence >= 0) & (labels != -100) & (side < 2)  # (a gold answer is weighed by no LD-DPO)
    weights = torch.zeros(labels.shape, dtype=torch.float64, device=labels.device)
    slot = (occurrence * 2 + side)[trained]  # row-major: each answer's tokens in their order
    if not len(slot):
        return weights
    counts = torch.zeros(int(slot.max()) // 2 * 2 + 2, dtype=torch.long, device=slot.device).index_add(
        0, slot, torch.ones_like(slot))
    order = torch.argsort(slot, stable=True)
    position = torch.empty_like(slot)
    position[order] = torch.arange(len(slot), device=slot.device) - (torch.cumsum(counts, 0) - counts)[slot[order]]
    shared = torch.minimum(counts[0::2], counts[1::2])[slot // 2]
    weights[trained] = torch.where(position < shared, 1.0, alpha).double()
    return weights


def sequence_logps(token_losses: torch.Tensor, batch: dict, cp, weighted: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities (pairs, 2), answer token counts (pairs, 2)) of the micro-batch's pair occurrences, chosen
    first, from per-token losses (b, T_local) (0 where the target is ignored), summed over the CP group; under
    LD-DPO with its `length_weight` unless not `weighted`. TPO's gold answers are left out (`gold_logps`)."""
    pairs, occurrence, side = batch["pairs"], batch["occurrence"], batch["side"]
    trained = (occurrence >= 0) & (batch["targets"] != -100) & (side < 2)
    slot = occurrence.clamp(min=0) * 2 + side.clamp(min=0)
    slot, values = slot[trained], -token_losses[trained].double()
    if weighted and "length_weight" in batch:  # LD-DPO
        values = values * batch["length_weight"][trained]
    logps = torch.zeros(2 * len(pairs), dtype=torch.float64, device=values.device).index_add(0, slot, values)
    counts = torch.zeros(2 * len(pairs), dtype=torch.float64, device=values.device).index_add(
        0, slot, torch.ones_like(values))
    if cp.size > 1:
        logps = sum_over(logps, cp)
        counts = cp.all_reduce(counts)
    return logps.view(-1, 2), counts.view(-1, 2)


def gold_logps(token_losses: torch.Tensor, batch: dict, cp) -> torch.Tensor:
    """The log-probabilities (pairs,) of the micro-batch's pair occurrences' gold answers (side 2: TPO's), from the
    per-token losses (b, T_local), summed over the CP group."""
    occurrence = batch["occurrence"]
    gold = (occurrence >= 0) & (batch["targets"] != -100) & (batch["side"] == 2)
    logps = torch.zeros(len(batch["pairs"]), dtype=torch.float64, device=token_losses.device).index_add(
        0, occurrence[gold], -token_losses[gold].double())
    return sum_over(logps, cp) if cp.size > 1 else logps


def wpo_weights(token_losses: torch.Tensor, log_sum_sq: torch.Tensor, batch: dict, cp) -> torch.Tensor:
    """WPO's weight (P,) of each pair occurrence: w_c w_r, w = exp(mean over the answer's trained tokens of (log p -
    log sum_v p_v^2)), from the policy's token losses and log sums of squares (b, T_local), without gradient; the
    means over the CP group (LD-DPO's weights left out, as in TRL)."""
    sums, counts = sequence_logps(token_losses + log_sum_sq, batch, cp, weighted=False)  # of log p - log sum p^2
    return torch.exp(sums / counts.clamp(min=1.0)).prod(dim=1)


def pair_losses(cfg: PreferenceConfig, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None,
                chosen_share: float | None = None, chosen_logps: torch.Tensor | None = None,
                matched: torch.Tensor | None = None, gold: tuple[torch.Tensor, float] | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair losses (P,), per-pair metrics {name: (P,)}) of sequence log-probabilities (P, 2), their token
    counts (P, 2) and the reference's (P, 2) (None for the reference-free losses); fp64. `chosen_share`: the global
    batch's pairs / chosen tokens (`preference_parts`), which the "sft" term of a weighted sum reads, with the chosen
    answers' log-probabilities `chosen_logps` (P,) (default logps[:, 0]; under LD-DPO the unweighted ones); the "gold"
    term reads `gold`, the gold answers' log-probabilities (P,) and the batch's `gold_share`; AOT reads the pairs'
    `matched` constants (P, 2) (`shardlm.preference.aot.match`)."""
    parts = cfg.loss.split("+")
    free = next((part for part in parts if part in REFERENCE_FREE), None)
    scored = logps - reference if free is None else reference_free.scores(free, logps, counts, cfg.alpha)
    chosen = logps[:, 0] if chosen_logps is None else chosen_logps
    terms = [-chosen * chosen_share if part == "sft" else -gold[0] * gold[1] if part == "gold"
             else reference_free.reference_free_losses(cfg, part, logps, counts, scored) if part == free
             else referenced_losses(cfg, part, scored, counts, matched) for part in parts]
    if cfg.loss_weights:  # a weighted sum ("a+b+...")
        terms = [weight * term for weight, term in zip(cfg.loss_weights, terms)]
    losses = terms[0]
    for term in terms[1:]:
        losses = losses + term
    rewards = cfg.beta * scored.detach()
    margin = rewards[:, 0] - rewards[:, 1]
    return losses, {"rewards_chosen": rewards[:, 0], "rewards_rejected": rewards[:, 1], "reward_margin": margin,
                    "reward_accuracy": (margin > 0).double()}


def referenced_losses(cfg: PreferenceConfig, loss: str, ratio: torch.Tensor, counts: torch.Tensor,
                      matched: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair losses (P,) of `loss`, one of the losses with a reference (module docstring; its options from `cfg`),
    from the log-ratios r (P, 2), the answers' token counts (P, 2) and AOT's `matched` constants (P, 2)."""
    beta, eps = cfg.beta, cfg.label_smoothing
    if loss in aot.AOT_LOSSES:
        return aot.aot_losses(loss, ratio, matched, beta, eps)
    if loss not in F_DIVERGENCE_LOSSES + (IPO_SUMMED,):
        chosen, rejected = beta * ratio[:, 0], beta * ratio[:, 1]
        if loss == "nca_pair":
            return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
        if loss == "bco_pair":
            return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)
        if loss == "sppo_hard":
            return (ratio[:, 0] - 0.5 / beta) ** 2 + (ratio[:, 1] + 0.5 / beta) ** 2
        if loss == "apo_zero":
            return 1 - torch.sigmoid(chosen) + torch.sigmoid(rejected)
        return torch.sigmoid(chosen) + 1 - torch.sigmoid(chosen - rejected)  # apo_down
    scores = f_scores(cfg, ratio)
    if loss in ("ipo", "sigmoid_norm"):
        scores = scores / counts
    d = scores[:, 0] - scores[:, 1]
    z = beta * d
    if loss == "sigmoid":
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss == "sigmoid_norm":
        return -F.logsigmoid(z)
    if loss in ("ipo", IPO_SUMMED):
        return (d - 1 / (2 * beta)) ** 2
    if loss == "hinge":
        return torch.relu(1 - z)
    if loss == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss == "exo_pair":
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    modulation = torch.sigmoid(z / cfg.discopop_tau)  # discopop
    return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation


def f_scores(cfg: PreferenceConfig, ratio: torch.Tensor) -> torch.Tensor:
    """f'(exp r) of the log-ratios r (P, 2), f the run's f-divergence (TRL's f-DPO): the reverse KL's is r itself;
    forward KL 1 - exp(-r); Jensen-Shannon log 2 + log sigmoid(r); the alpha divergence (exp((alpha - 1) r) - 1) /
    (alpha - 1), its exponent capped at 80 (r itself within 1e-6 of alpha = 1)."""
    kind, alpha = cfg.f_divergence_type, cfg.f_alpha_divergence_coef
    if kind == "forward_kl":
        return 1 - torch.exp(-ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(ratio)
    if kind == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        return (torch.exp(torch.clamp((alpha - 1.0) * ratio, max=80.0)) - 1.0) / (alpha - 1.0)
    return ratio


class PreferenceLoss:
    """The trainer's loss for a preference run: `loss(forward, batch)` of a `preference_parts` micro-batch, or
    `of_token_losses(token_losses, batch)` where the pipeline's last stage computed the token losses. The reference
    log-probabilities are the batch's `reference` ((pairs, 2): `attach_reference` copies them from the tables
    precomputed over the training and validation sets, `tables`), or come from a forward without gradient under
    `reference_context`: a LoRA run's with the adapters off, or with the reference weights swapped in (`weights`, a
    `ReferenceWeights`: preference.reference="weights") (`record_reference` under pipeline stages). Each training
    call adds its pairs' loss and metric sums to `sums` (read and reset by the trainer's step: `take_metrics`)."""

    def __init__(self, cfg: PreferenceConfig, ctx, model):
        self.cfg, self.ctx, self.model = cfg, ctx, model
        self.unpaired = cfg.loss in kto.UNPAIRED
        self.aot = next((part for part in cfg.loss.split("+") if part in aot.AOT_LOSSES), None)
        self.no_reference = reference_free.reference_free(cfg.loss)  # a reference-free loss (or sum)
        self.tables: dict[str, torch.Tensor] = {}  # "train" / "valid" -> (pairs, 2) precomputed reference
        self.weights = None  # the reference's weights (`ReferenceWeights`) of a "weights" reference
        self.labels: dict[str, torch.Tensor] = {}  # KTO: "train" / "valid" -> (examples,) bool, True: desirable
        self.sums = torch.zeros(len(kto.SUMS) if self.unpaired else len(METRICS) + 1, dtype=torch.float64)
        self.pairs = 0.0
        self.kl = torch.zeros((), dtype=torch.float64)  # KTO: z0 of the micro-batches being run (`prepare`)
        self.step_kl = 0.0  # and of the last training step's (on every rank: the pipeline's first stages too)
        if cfg.use_weighting:  # WPO: each forward's log sum p^2 per token, from the output layer
            model.log_sum_sq = []

    def set_labels(self, datasets: dict) -> None:
        """KTO: the examples' labels of each split ({"train": PairDataset, "valid": ...}, None skipped)."""
        self.labels = {split: torch.tensor(data.rows.labels, dtype=torch.bool) for split, data in datasets.items()
                       if data is not None and data.rows.labels is not None}

    def attach_reference(self, parts: list[dict], split: str) -> list[dict]:
        """Give each micro-batch of `split` ("train" or "valid") its pairs' precomputed reference, when there is a
        table of that split (KTO: the examples' column 0 to the micro-batch, the KL sequences' column 1 to its
        `kl` part), and KTO's labels."""
        table, labels = self.tables.get(split), self.labels.get(split)
        for part in parts:
            if table is not None:
                rows = table.to(part["pairs"].device)[part["pairs"]]
                part["reference"] = rows
                if "kl" in part:
                    part["kl"]["reference"] = rows[:, 1:]
            if labels is not None:
                part["label"] = labels.to(part["pairs"].device)[part["pairs"]]
        return parts

    def prepare(self, forward, batches: list[dict]) -> None:
        """Without pipeline stages, before a step's (or an evaluation's) micro-batches, without gradient: KTO's KL
        sequences' reference log-probabilities (a LoRA run's base) and the policy's, and z0 from them
        (`shardlm.preference.kto`); AOT's the same of the pairs, and their matched constants
        (`shardlm.preference.aot`). Nothing for the other losses."""
        parts = self._before_step(batches)
        with torch.no_grad():
            for part in parts:
                self.reference_logps(forward, part)
                self.record_policy(forward(part["inputs"], part["targets"], documents=part["documents"]), part)
        if parts:
            self._after_pass(batches)

    def prepare_stages(self, pipeline, batches: list[dict]) -> None:
        """`prepare` under pipeline stages: those sequences forward through the stages (the reference's first where
        the step needs it), recorded on the last stage."""
        parts = self._before_step(batches)
        if not parts:
            return
        if self.needs_reference_pass(parts):
            pipeline.reference_pass(parts, self.record_reference, self.reference_context())
        pipeline.reference_pass(parts, self.record_policy, contextlib.nullcontext())
        self._after_pass(batches)

    def _before_step(self, batches: list[dict]) -> list[dict]:
        """The micro-batch parts whose policy log-probabilities the loss needs before the step: KTO's KL sequences,
        AOT's pairs."""
        if self.cfg.loss in kto.KL_LOSSES:
            return [batch["kl"] for batch in batches]
        return batches if self.aot else []

    def _after_pass(self, batches: list[dict]) -> None:
        if self.aot:
            aot.match(batches, self.aot, self.ctx.dp)
        else:
            self._set_kl(batches)

    def record_policy(self, token_losses: torch.Tensor, part: dict) -> None:
        """Store the policy's log-probabilities (P, 2) of a micro-batch's pairs (or KTO's KL sequences, all on side
        0) from its token losses, without gradient."""
        part["policy"] = sequence_logps(token_losses.detach(), part, self.ctx.cp)[0]

    def _set_kl(self, batches: list[dict]) -> None:
        self.kl = kto.estimate_kl(batches, self.ctx)
        if self.model.training:
            self.step_kl = self.kl.item()

    def record_reference(self, token_losses: torch.Tensor, batch: dict) -> None:
        """Store the batch's reference log-probabilities from the reference model's token losses."""
        batch["reference"] = sequence_logps(token_losses.detach(), batch, self.ctx.cp)[0]

    def needs_reference_pass(self, batches: list[dict]) -> bool:
        """Whether these micro-batches still need the reference model's forward (under `reference_context`)."""
        return not self.no_reference and any("reference" not in b for b in batches)

    def reference_context(self):
        """The reference model in the policy's place: its weights swapped in, or a LoRA run's adapters off."""
        if self.weights is not None:
            return self.weights.swapped()
        if not has_adapters(self.model):  # the "reference" would be the policy itself: a loss stuck at ln 2
            raise RuntimeError("a preference batch has no precomputed reference log-probabilities, no reference "
                               "weights and no LoRA adapters to switch off for them")
        return adapters_off(self.model)

    def reference_logps(self, forward, batch: dict) -> torch.Tensor | None:
        if self.no_reference:
            return None
        if "reference" not in batch:  # the reference weights, or the base of a LoRA run, in the same step
            with torch.no_grad(), self.reference_context():
                self.record_reference(forward(batch["inputs"], batch["targets"], documents=batch["documents"]), batch)
        return batch["reference"]

    def __call__(self, forward, batch: dict) -> torch.Tensor:
        reference = self.reference_logps(forward, batch)
        return self.of_token_losses(forward(batch["inputs"], batch["targets"], documents=batch["documents"]), batch,
                                    reference)

    def of_token_losses(self, token_losses: torch.Tensor, batch: dict, reference: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """The micro-batch's share of the global batch's mean pair loss, from the policy's token losses (b, T)."""
        if reference is None and not self.no_reference:
            reference = batch["reference"]
        logps, counts = sequence_logps(token_losses, batch, self.ctx.cp)
        if self.unpaired:
            losses, rewards = kto.kto_losses(self.cfg, logps[:, 0], reference[:, 0], batch["label"], self.kl)
            sums = kto.metric_sums(losses, rewards, batch["label"])
        else:
            plain = None  # LD-DPO's "sft" term: the chosen answers' unweighted log-probabilities
            if "length_weight" in batch and "sft" in self.cfg.loss.split("+"):
                plain = sequence_logps(token_losses, batch, self.ctx.cp, weighted=False)[0][:, 0]
            gold = None  # TPO's "gold" term: the gold answers' log-probabilities and the batch's scale
            if "gold" in self.cfg.loss.split("+"):
                gold = gold_logps(token_losses, batch, self.ctx.cp), batch["gold_share"]
            losses, metrics = pair_losses(self.cfg, logps, counts, reference, batch.get("chosen_share"), plain,
                                          batch.get("aot"), gold)
            if self.cfg.use_weighting:
                squares = self.model.log_sum_sq.pop()
                self.model.log_sum_sq.clear()  # (a LoRA reference pass's, the policy's being the last)
                losses = losses * wpo_weights(token_losses.detach(), squares, batch, self.ctx.cp)
            sums = torch.stack([losses.detach().sum()] + [metrics[k].sum() for k in METRICS]).cpu()
        if self.model.training:  # a training step's, not an evaluation's
            self.sums += sums
            self.pairs += len(batch["pairs"])
        return (losses.sum() / batch["divisor"]).float()

    def take_metrics(self) -> dict[str, float]:
        """The step's mean over the global batch's pairs of each metric (one all-reduce over DP, and over the
        pipeline group, whose last stage alone computed them), then reset."""
        sums = torch.cat([self.sums, torch.tensor([self.pairs], dtype=torch.float64)]).to(self.ctx.device)
        self.ctx.dp.all_reduce(sums)
        if self.ctx.pp_size > 1:
            self.ctx.pp.all_reduce(sums)
        self.sums.zero_()
        self.pairs = 0.0
        if self.unpaired:
            return kto.metrics_of(sums, self.step_kl)
        pairs = max(sums[-1].item(), 1.0)
        return {name: sums[i + 1].item() / pairs for i, name in enumerate(METRICS)}


LN2 = math.log(2.0)
"""The sigmoid DPO loss at step 0, where the policy is the reference: -log sigmoid(0)."""
