"""Preference optimization (DPO and TRL's relatives of it: IPO, hinge, robust, EXO, DiscoPOP, NCA, BCO, SPPO,
APO, AOT, f-DPO; the reference-free SimPO, ORPO and CPO) on packed pairs, and KTO on unpaired examples: records and
their tokens (`pairs`, `unpaired`), rows of pairs or examples (`data`), the losses and the reference (`loss`, `kto`,
`aot`, `reference_free`, `reference`), the run's data sets (`dataset`). `docs/preference.md`."""

from __future__ import annotations


def reference_mode(config) -> str:
    """"none" (a reference-free loss), "adapters", "precomputed" or "weights": where a run's reference
    log-probabilities come from (`preference.reference`, "auto" resolved: "weights" when TR-DPO's syncs or BEMA's
    updates move it)."""
    from shardlm.preference.reference_free import reference_free

    p = config.preference
    if reference_free(p.loss):
        return "none"
    if p.reference == "auto":
        moves = p.sync_ref_model or (config.bema.enabled and config.bema.update_ref_model)
        return "adapters" if config.lora.rank else "weights" if moves else "precomputed"
    return p.reference


def check_preference(config) -> str | None:
    """A one-line problem with a run's [preference] settings, or None."""
    from shardlm.preference.aot import AOT_LOSSES
    from shardlm.preference.kto import UNPAIRED
    from shardlm.preference.loss import F_DIVERGENCE_LOSSES, F_DIVERGENCES, LOSSES, NLL_TERMS, REFERENCED
    from shardlm.preference.reference_free import ALPHAPO, MEAN, reference_free

    p = config.preference
    parts = p.loss.split("+")
    free = reference_free(p.loss)
    ld_refusal = ("no pairs" if p.loss in UNPAIRED else "its own length normalization"
                  if any(part in MEAN for part in parts) else "no reference model")  # why LD-DPO is refused
    summed = len(parts) > 1 or p.loss in NLL_TERMS
    dropouts = (config.model.dropout, max(config.model.attention_dropout, 0.0),
                config.lora.dropout if config.lora.rank else 0.0)
    checks = [
        (p.loss in LOSSES or summed, f'preference.loss="{p.loss}" must be one of {", ".join(LOSSES)}, or a sum of '
                                     f'{", ".join(REFERENCED)}, "sft" and "gold" joined by "+"'),
        (not summed or all(part in REFERENCED + NLL_TERMS for part in parts)
         or (sum(part in ALPHAPO for part in parts) == 1 and all(part in ALPHAPO + NLL_TERMS for part in parts)),
         f'preference.loss="{p.loss}": a sum joins {", ".join(REFERENCED)}, "sft" and "gold" (MPO: '
         f'"sigmoid+bco_pair+sft"), or one of {", ".join(ALPHAPO)}, "sft" and "gold" (CPO: "cpo+sft", TPO: '
         '"cpo+gold")'),
        (not summed or any(part not in NLL_TERMS for part in parts),
         f'preference.loss="{p.loss}" is supervised fine-tuning on the answers: add a preference loss '
         '("sigmoid+sft", TPO\'s "cpo+gold") or train them with [sft] alone'),
        (not p.loss_weights or len(p.loss_weights) == len(parts),
         f"preference.loss_weights has {len(p.loss_weights)} weights for the {len(parts)} losses of "
         f'preference.loss="{p.loss}"'),
        (sum(part in AOT_LOSSES for part in parts) <= 1,
         f'preference.loss="{p.loss}" sums two AOT losses; keep one of {", ".join(AOT_LOSSES)}'),
        (not p.use_weighting or not any(part in AOT_LOSSES for part in parts),
         f'preference.use_weighting (WPO) is not defined for preference.loss="{p.loss}", which sorts the pairs\' '
         "log-ratios across the batch (TRL refuses it too): set it to false"),
        (p.disable_dropout or not any(part in AOT_LOSSES for part in parts) or not any(dropouts),
         f'preference.loss="{p.loss}" ranks the global batch\'s pairs in a pass before the step, which must see '
         "the step's values: set preference.disable_dropout=true (or the dropouts to 0)"),
        (not p.alpha or any(part in ALPHAPO for part in parts),
         f'preference.alpha (AlphaPO) shapes the rewards of {", ".join(ALPHAPO)}, not preference.loss="{p.loss}"'),
        (p.beta > 0, f"preference.beta={p.beta} must be > 0"),
        (0 <= p.label_smoothing < 0.5, f"preference.label_smoothing={p.label_smoothing} must be in [0, 0.5)"),
        ("exo_pair" not in parts or p.label_smoothing > 0,
         'preference.loss="exo_pair" takes its epsilon from preference.label_smoothing, which must be > 0 (the EXO '
         "paper uses 1e-3)"),
        (p.f_divergence_type in F_DIVERGENCES,
         f'preference.f_divergence_type="{p.f_divergence_type}" must be one of {", ".join(F_DIVERGENCES)}'),
        (p.f_divergence_type == "reverse_kl" or all(part in F_DIVERGENCE_LOSSES + NLL_TERMS for part in parts),
         f'preference.f_divergence_type="{p.f_divergence_type}" takes preference.loss '
         f'{", ".join(F_DIVERGENCE_LOSSES)}, not "{p.loss}"'),
        (p.discopop_tau > 0, f"preference.discopop_tau={p.discopop_tau} must be > 0"),
        (0 <= p.ld_alpha <= 1, f"preference.ld_alpha={p.ld_alpha} must be in [0, 1] (1: no weighting)"),
        (not p.use_weighting or not (free or p.loss in UNPAIRED),
         f'preference.use_weighting (WPO) weighs the pairs of the losses with a reference; preference.loss="{p.loss}" '
         "takes none: set it to false"),
        (p.ld_alpha == 1 or not (free or p.loss in UNPAIRED),
         f'preference.ld_alpha weighs the tokens past the shorter answer of a pair (LD-DPO); preference.loss='
         f'"{p.loss}" has {ld_refusal}: set it to 1'),
        (p.desirable_weight > 0 and p.undesirable_weight > 0,
         f"preference.desirable_weight={p.desirable_weight:g} and undesirable_weight={p.undesirable_weight:g} must "
         "be > 0"),
        (p.reference in ("auto", "precomputed", "adapters", "weights"),
         f'preference.reference="{p.reference}" must be "auto", "precomputed", "adapters" or "weights"'),
        (p.reference != "weights" or not config.lora.rank,
         'preference.reference="weights" keeps a copy of a full fine-tuning run\'s starting weights; a LoRA run\'s '
         'reference is its base: use "adapters" (or "precomputed")'),
        (not p.sync_ref_model or not free,
         f'preference.sync_ref_model updates the reference, which preference.loss="{p.loss}" does not use'),
        (not p.sync_ref_model or not config.lora.rank,
         "preference.sync_ref_model mixes the policy into a copy of the reference weights; a LoRA run's reference is "
         "its base (adapters off): train every weight, or set preference.sync_ref_model=false"),
        (not p.sync_ref_model or p.reference in ("auto", "weights"),
         f'preference.sync_ref_model moves the reference as the run trains; preference.reference="{p.reference}" '
         'holds it fixed (precomputed once): use "weights" (or "auto")'),
        (0 <= p.ref_model_mixup_alpha <= 1,
         f"preference.ref_model_mixup_alpha={p.ref_model_mixup_alpha} must be in [0, 1]"),
        (p.ref_model_sync_steps >= 1, f"preference.ref_model_sync_steps={p.ref_model_sync_steps} must be at least 1"),
        (not free or p.reference == "auto",
         f'preference.loss="{p.loss}" uses no reference model; leave preference.reference at "auto"'),
        (p.reference != "adapters" or config.lora.rank > 0,
         'preference.reference="adapters" is the base of a LoRA run; set lora.rank or use "precomputed"'),
        (reference_mode(config) != "adapters" or not config.lora.modules_to_save,
         'lora.modules_to_save trains modules the adapters-off reference would keep; use preference.reference='
         '"precomputed"'),
        (bool(config.sft.data), "preference optimization reads sft.data (records with prompt, chosen, rejected; "
         "KTO's prompt, completion, label); set it"),
        (not config.model.mtp_layers, "preference optimization trains without multi-token prediction; set "
         "model.mtp_layers=0"),
    ]
    return next((message for ok, message in checks if not ok), None)
