"""Online reinforcement learning with verifiable rewards: GRPO and its 2025 variants (DAPO, Dr. GRPO, GSPO, CISPO,
SAPO, LUSPO, VESPO, INTELLECT-2's two-sided clip, DeepSeek-V3.2's off-policy sequence mask, the 80/20 rule's entropy
mask, an entropy bonus with Skywork-OR1's adaptive control), RLOO (TRL's RLOOTrainer), GMPO, online DPO
(`online_dpo`: DPO on pairs of the policy's own completions chosen by reward) and A*-PO (`a2po`: a regression onto
reward - V*, V* estimated before training), the completions sampled by the policy in the training processes, at the
training layout. Prompts and rewards (`prompts`, `rewards`, the built-in task `arithmetic`), rollouts (`rollout`;
with tools, `tools` and the multi-turn `agent`), group-relative and leave-one-out advantages (`advantages`), the
step's packed rows (`batch`), the losses (`loss`) and the loop joining them (`loop`). `docs/rl.md`."""

from __future__ import annotations

LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "rloo", "gmpo", "online_dpo",
          "a2po")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""The losses of the clipped surrogate -min(w A, clip(w) A) (INTELLECT-2's `rl.delta` caps their ratio)."""
SEQUENCE_RATIO = ("grpo", "luspo", "sapo")
"""The losses that take GSPO's sequence-level ratio (`rl.importance_sampling = "sequence"`)."""
SCALE_REWARDS = ("group", "batch", "none")


def check_rl(config, world_size: int = 1) -> str | None:
    """A one-line problem with a run's [rl] settings, or None (checked before any expensive work)."""
    r, t = config.rl, config.train
    prompts_per_step = r.prompts_per_step or t.global_batch_size // max(r.num_generations, 1)
    round_prompts = prompts_per_step * max(r.generation_batch_size // max(prompts_per_step * r.num_generations, 1), 1)
    trained = r.task_size - r.eval_prompts  # the task's prompts left to train on
    checks = [
        (r.loss in LOSSES, f'rl.loss="{r.loss}" must be one of {", ".join(LOSSES)}'),
        (r.num_generations >= 2 or r.loss == "a2po", f"rl.num_generations={r.num_generations} must be at least 2: "
                                                     "advantages compare the completions of one prompt"),
        (r.loss != "a2po" or r.num_generations == 1,
         f'rl.loss="a2po" samples one completion a prompt a step (its baseline is V*); set rl.num_generations=1, not '
         f"{r.num_generations}"),
        (r.loss != "a2po" or (r.beta1 > 0 and r.beta2 > 0 and r.num_value_samples >= 1),
         f"rl.beta1={r.beta1} and rl.beta2={r.beta2} must be > 0 and rl.num_value_samples={r.num_value_samples} at "
         "least 1"),
        (r.loss != "a2po" or not (r.beta or r.sync_ref_model or r.num_iterations != 1 or r.generation_batch_size
                                  or r.delta or r.off_policy_mask_threshold or r.entropy_coef
                                  or r.top_entropy_quantile < 1 or r.importance_sampling != "token"
                                  or r.mask_truncated_completions or r.scale_rewards != "group"
                                  or r.multi_objective_aggregation != "sum_then_normalize"),
         'rl.loss="a2po" regresses beta2 x the log-ratio to the reference onto reward - V*, one update a completion: '
         "leave rl.beta, rl.sync_ref_model, rl.num_iterations, rl.generation_batch_size, rl.delta, "
         "rl.off_policy_mask_threshold, rl.entropy_coef, rl.top_entropy_quantile, rl.importance_sampling, "
         "rl.mask_truncated_completions, rl.scale_rewards and rl.multi_objective_aggregation at their defaults"),
        (r.epsilon > 0, f"rl.epsilon={r.epsilon} must be > 0"),
        (r.epsilon_high >= 0, f"rl.epsilon_high={r.epsilon_high} must be > 0 (0: rl.epsilon)"),
        (r.num_iterations >= 1, f"rl.num_iterations={r.num_iterations} must be at least 1"),
        (r.generation_batch_size >= 0 and r.generation_batch_size % max(prompts_per_step * r.num_generations, 1) == 0,
         f"rl.generation_batch_size={r.generation_batch_size} must be a multiple of one step's "
         f"{prompts_per_step * r.num_generations} completions (rl.prompts_per_step={prompts_per_step} x "
         f"rl.num_generations={r.num_generations}); 0: one step's"),
        (r.beta >= 0, f"rl.beta={r.beta} must be >= 0"),
        (not r.sync_ref_model or r.beta > 0, "rl.sync_ref_model updates the KL's reference, which rl.beta=0 leaves "
                                             "unused: set rl.beta > 0 or rl.sync_ref_model=false"),
        (not r.sync_ref_model or not config.lora.rank,
         "rl.sync_ref_model mixes the policy into a copy of the reference weights; a LoRA run's reference is its base "
         "(adapters off): train every weight, or set rl.sync_ref_model=false"),
        (0 <= r.ref_model_mixup_alpha <= 1, f"rl.ref_model_mixup_alpha={r.ref_model_mixup_alpha} must be in [0, 1]"),
        (r.ref_model_sync_steps >= 1, f"rl.ref_model_sync_steps={r.ref_model_sync_steps} must be at least 1"),
        (r.temperature > 0, f"rl.temperature={r.temperature} must be > 0 (sampling needs a distribution)"),
        (0 < r.top_p <= 1, f"rl.top_p={r.top_p} must be in (0, 1]"),
        (r.top_k >= 0, f"rl.top_k={r.top_k} must be >= 0 (0 disables it)"),
        (0 <= r.min_p <= 1, f"rl.min_p={r.min_p} must be in [0, 1] (0 disables it)"),
        (r.repetition_penalty > 0, f"rl.repetition_penalty={r.repetition_penalty} must be > 0 (1 disables it)"),
        (r.max_completion_length >= 1, f"rl.max_completion_length={r.max_completion_length} must be at least 1"),
        (r.max_completion_length < config.model.seq_length,
         f"rl.max_completion_length={r.max_completion_length} leaves no room for a prompt in model.seq_length="
         f"{config.model.seq_length}"),
        (r.scale_rewards in SCALE_REWARDS, f'rl.scale_rewards="{r.scale_rewards}" must be one of '
                                           f'{", ".join(SCALE_REWARDS)}'),
        (r.loss != "rloo" or (r.scale_rewards == "group" and r.multi_objective_aggregation == "sum_then_normalize"),
         'rl.loss="rloo" takes leave-one-out baselines of the weighted reward (rl.normalize_advantages scales them): '
         "leave rl.scale_rewards and rl.multi_objective_aggregation at their defaults"),
        (not r.reward_clip_range or (len(r.reward_clip_range) == 2
                                     and r.reward_clip_range[0] <= r.reward_clip_range[1]),
         f"rl.reward_clip_range={list(r.reward_clip_range)} must be [low, high] with low <= high (empty: none)"),
        (r.loss == "rloo" or not (r.normalize_advantages or r.reward_clip_range),
         'rl.normalize_advantages and rl.reward_clip_range are rl.loss="rloo"\'s (GRPO scales by rl.scale_rewards)'),
        (r.loss != "gmpo" or not (r.delta or r.off_policy_mask_threshold or r.entropy_coef
                                  or r.top_entropy_quantile < 1 or r.importance_sampling != "token"),
         'rl.loss="gmpo" is its own sequence weight (a geometric mean of clipped token ratios, as TRL\'s GMPOTrainer): '
         "leave rl.delta, rl.off_policy_mask_threshold, rl.entropy_coef, rl.top_entropy_quantile and "
         "rl.importance_sampling at their defaults"),
        (r.loss != "online_dpo" or (r.num_generations == 2 and r.beta > 0 and r.num_iterations == 1
                                    and not r.generation_batch_size and not r.sync_ref_model),
         'rl.loss="online_dpo" pairs two completions of each prompt in one step against the reference: set '
         "rl.num_generations=2 and rl.beta > 0 (DPO's beta), and leave rl.num_iterations, rl.generation_batch_size "
         "and rl.sync_ref_model at their defaults"),
        (r.loss != "online_dpo" or not (r.delta or r.off_policy_mask_threshold or r.entropy_coef or
                                        r.top_entropy_quantile < 1 or r.importance_sampling != "token" or
                                        r.mask_truncated_completions or r.scale_rewards != "group" or
                                        r.multi_objective_aggregation != "sum_then_normalize"),
         'rl.loss="online_dpo" is DPO on the pairs, with no advantage, ratio or entropy term: leave rl.delta, '
         "rl.off_policy_mask_threshold, rl.entropy_coef, rl.top_entropy_quantile, rl.importance_sampling, "
         "rl.mask_truncated_completions, rl.scale_rewards and rl.multi_objective_aggregation at their defaults"),
        (r.dpo_loss_type in ("sigmoid", "ipo") and (r.loss == "online_dpo" or r.dpo_loss_type == "sigmoid"),
         f'rl.dpo_loss_type="{r.dpo_loss_type}" must be "sigmoid" or "ipo", and is rl.loss="online_dpo"\'s'),
        (r.missing_eos_penalty >= 0 and (r.loss == "online_dpo" or not r.missing_eos_penalty),
         f"rl.missing_eos_penalty={r.missing_eos_penalty} must be >= 0 and is rl.loss=\"online_dpo\"'s"),
        (r.importance_sampling in ("token", "sequence"),
         f'rl.importance_sampling="{r.importance_sampling}" must be "token" or "sequence" (GSPO)'),
        (r.importance_sampling == "token" or r.loss in SEQUENCE_RATIO,
         f'rl.importance_sampling="sequence" (GSPO) takes rl.loss "grpo", "luspo" or "sapo", not "{r.loss}"'
         + (" (vespo weighs the sequence's ratio itself; keep \"token\")" if r.loss == "vespo" else "")),
        (not r.delta or r.delta > 1 + (r.epsilon_high or r.epsilon),
         f"rl.delta={r.delta} must exceed the upper clip 1 + epsilon_high = {1 + (r.epsilon_high or r.epsilon):g} "
         "(0: off)"),
        (not r.delta or r.loss in CLIPPED, f'rl.delta caps the clipped surrogate\'s ratio ({", ".join(CLIPPED)}); '
                                           f'rl.loss="{r.loss}" has none: set rl.delta=0'),
        (min(r.sapo_temperature_pos, r.sapo_temperature_neg) > 0,
         "rl.sapo_temperature_pos and rl.sapo_temperature_neg must be > 0"),
        (min(r.vespo_k_pos, r.vespo_k_neg, r.vespo_lambda_pos, r.vespo_lambda_neg) >= 0,
         "rl.vespo_k_pos, vespo_k_neg, vespo_lambda_pos and vespo_lambda_neg must be >= 0"),
        (0 <= r.top_entropy_quantile <= 1, f"rl.top_entropy_quantile={r.top_entropy_quantile} must be in [0, 1] "
                                           "(1: every token)"),
        (r.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
         f'rl.multi_objective_aggregation="{r.multi_objective_aggregation}" must be "sum_then_normalize" or '
         '"normalize_then_sum"'),
        (r.multi_objective_aggregation == "sum_then_normalize" or r.scale_rewards == "group",
         'rl.multi_objective_aggregation="normalize_then_sum" (GDPO) normalizes each reward function within its group '
         'and their sum over the batch; rl.scale_rewards does not apply: leave it "group"'),
        (r.entropy_coef >= 0, f"rl.entropy_coef={r.entropy_coef} must be >= 0 (0: no entropy bonus)"),
        (not r.use_adaptive_entropy or 0 <= r.entropy_coef_min <= r.entropy_coef_max,
         f"rl.entropy_coef_min={r.entropy_coef_min} and rl.entropy_coef_max={r.entropy_coef_max} must satisfy "
         "0 <= min <= max"),
        (not r.use_adaptive_entropy or r.entropy_coef_delta > 0,
         f"rl.entropy_coef_delta={r.entropy_coef_delta} must be > 0 under rl.use_adaptive_entropy"),
        (r.entropy_target >= 0, f"rl.entropy_target={r.entropy_target} must be >= 0 (nats)"),
        (r.off_policy_mask_threshold >= 0, f"rl.off_policy_mask_threshold={r.off_policy_mask_threshold} must be >= 0 "
                                           "(0: off)"),
        (r.task in ("", "arithmetic"), f'rl.task="{r.task}" must be "arithmetic" or empty (prompts from sft.data)'),
        (bool(r.task) != bool(config.sft.data), "an RL run reads its prompts from sft.data or rl.task; set exactly "
                                                "one"),
        (r.eval_prompts >= 0 and r.num_generations_eval >= 0,
         f"rl.eval_prompts={r.eval_prompts} and rl.num_generations_eval={r.num_generations_eval} must be >= 0"),
        (not (r.eval_prompts and r.completions), "rl.eval_prompts samples completions of the held-out prompts; "
                                                 "rl.completions fixes the training ones: set rl.eval_prompts=0"),
        (not r.task or trained >= round_prompts,
         f"rl.task_size={r.task_size} is below one generation round's {round_prompts} prompts"
         + (f" and rl.eval_prompts={r.eval_prompts} held out" if r.eval_prompts else "")),
        (prompts_per_step >= 1, f"train.global_batch_size={t.global_batch_size} is below rl.num_generations="
                                f"{r.num_generations}; set rl.prompts_per_step"),
        (not r.reward_weights or len(r.reward_weights) == len(r.rewards),
         f"rl.reward_weights has {len(r.reward_weights)} weights for {len(r.rewards)} reward functions"),
        (not (r.tools or r.environment) or r.loss not in ("online_dpo", "a2po"),
         f'rl.tools and rl.environment run multi-turn rollouts for the policy-gradient losses; rl.loss="{r.loss}" '
         "takes single replies: leave them empty"),
        (r.max_tool_calling_iterations >= 0,
         f"rl.max_tool_calling_iterations={r.max_tool_calling_iterations} must be >= 0 (0: no limit)"),
        (not config.model.mtp_layers, "an RL run trains without multi-token prediction; set model.mtp_layers=0"),
        (not config.train.compile, "an RL run samples with the eager model; set train.compile=false"),
        (not config.preference.loss, "set either [preference] or [rl], not both"),
        (config.model.arch != "bert", "an RL run needs a causal language model, not model.arch=\"bert\""),
    ]
    problem = next((message for ok, message in checks if not ok), None)
    return problem or (None if r.completions else sampling_split_problem(config))


def sampling_split_problem(config) -> str | None:
    """Why the run's pipeline split cannot sample (its stages hand only the hidden state on while decoding:
    `shardlm.models.gemma_config.hidden_only_split_problem`), or None."""
    from shardlm.models.gemma_config import hidden_only_split_problem
    from shardlm.parallel.pipeline import stage_layers, stages_per_rank

    m, p = config.model, config.parallel
    if p.pipeline <= 1 or not m.sandwich_norms:  # (other models hand nothing on between stages)
        return None
    stages = stage_layers(m.num_layers, p.pipeline * stages_per_rank(p.pipeline_schedule, p.virtual_stages),
                          p.first_stage_layers, p.last_stage_layers)
    return hidden_only_split_problem(m, stages)


def prompts_per_step(config) -> int:
    """Prompts of one optimizer step (`rl.prompts_per_step`, 0 resolved)."""
    return config.rl.prompts_per_step or config.train.global_batch_size // config.rl.num_generations


def steps_per_generation(config) -> int:
    """Optimizer steps one generation round's sequences are split into (`rl.generation_batch_size` over one step's
    sequences; 1 when it is 0). A round lasts this times rl.num_iterations steps."""
    r = config.rl
    return max(r.generation_batch_size // (prompts_per_step(config) * r.num_generations), 1)


def round_steps(config) -> int:
    """Optimizer steps one generation round lasts: its steps of different rows, each rl.num_iterations times."""
    return steps_per_generation(config) * config.rl.num_iterations
