"""The post-training sections of the run configuration ([sft], [preference], [rl], [lora], [distill]); `shardlm.config`
assembles them with the others into `RunConfig` and reads, checks and describes every section alike."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SFTConfig:
    """The `[sft]` section: instruction fine-tuning on chat records instead of [data] (`docs/sft.md`)."""

    data: list = field(default_factory=list)
    """JSONL or Parquet files of `messages`, `prompt`/`completion` or instruction records; set: an SFT run."""
    tokenizer: str = ""
    """Hugging Face tokenizer directory with the chat template; empty: checkpoint.init_from's directory."""
    template: str = ""
    """A .jinja file replacing the tokenizer's chat template (e.g. one with {% generation %} tags)."""
    end_of_turn: str = ""
    """The token that ends an assistant turn; empty: the tokenizer's eos_token or a generation_config.json eos id."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Variables every conversation is rendered with, as transformers' `apply_chat_template(..., **kwargs)` and
    TRL's `chat_template_kwargs` take them (Qwen3's {enable_thinking = false}): SFT, preference and RL prompts."""
    fields: str = "auto"
    """Instruction records' keys: "auto" (Dolly's, then Alpaca's), "dolly" or "alpaca"."""
    system_prompt: str = ""
    """A system turn put first in every conversation that has none."""
    packing: str = "bfd"
    """Conversations per row: "bfd" (best-fit-decreasing), "greedy" (in order) or "pad" (one per row)."""
    overflow: str = "truncate"
    """A conversation longer than model.seq_length: "truncate", "split" (pieces of model.seq_length tokens, each a
    document of its own: no token lost, TRL's "bfd_split") or "drop" (each counted and reported); a preference
    pair whose sequences do not fit one row: "truncate" cuts each of its k sequences to model.seq_length / k tokens,
    keeping its start (TRL's max_length), or "drop"."""
    shuffle: bool = True
    """Reshuffle and repack the conversations every epoch (by train.seed); false keeps the records' order (an RL
    run's prompts too: TRL's shuffle_dataset)."""
    valid_fraction: float = 0.05
    """Share of the conversations held out for the validation loss over assistant tokens (0: none)."""
    loss_type: str = "nll"
    """"nll" (each trained token's negative log-likelihood, their mean over the global batch) or "dft" (Dynamic
    Fine-Tuning, TRL's SFTConfig loss_type: each token's NLL times its probability, without gradient through that
    weight); the SFT loss of runs without [preference], [rl] or [distill]."""


@dataclass
class PreferenceConfig:
    """The `[preference]` section: preference optimization (DPO and its relatives) on the preference records of
    [sft]'s data (`prompt`, `chosen`, `rejected`; KTO's `prompt`, `completion`, `label`), with [sft]'s tokenizer and
    template (`docs/preference.md`)."""

    loss: str = ""
    """"sigmoid" (DPO), "ipo", "hinge", "robust", "exo_pair", "discopop", "sigmoid_norm", "nca_pair", "bco_pair",
    "sppo_hard", "apo_zero", "apo_down", "aot", "aot_unpaired" (as TRL's DPOTrainer defines them; AOT's sort spans
    the global batch) or a weighted sum of them joined by "+", which may add "sft", the chosen answers' NLL (MPO:
    "sigmoid+bco_pair+sft" with loss_weights [0.8, 0.2, 1.0]); the reference-free "simpo", "orpo" and CPO's "cpo",
    "cpo_hinge", "cpo_ipo" (TRL's CPOTrainer), each but orpo with an optional "+sft" (CPO: "cpo+sft", its cpo_alpha
    the second loss weight; CPO-SimPO "simpo+sft"); "gold", the NLL of each record's gold answer (its `reference`),
    in a sum: TPO (TRL's TPOTrainer) "cpo+gold", "cpo_hinge+gold", "cpo_ipo+gold" or TPO-L "simpo+gold", tpo_alpha
    the second loss weight; on unpaired examples (`prompt`, `completion`, `label`) "kto" and "apo_zero_unpaired";
    empty: no preference run."""
    loss_weights: list = field(default_factory=list)
    """The weight of each loss of a sum ("a+b+..."), in its order; empty: 1 each."""
    beta: float = 0.1
    """Strength of the preference (DPO's beta; SimPO's beta; ORPO's lambda on its odds-ratio term)."""
    label_smoothing: float = 0.0
    """The share of pairs assumed flipped, in [0, 0.5): sigmoid (conservative DPO), robust (rDPO), aot,
    aot_unpaired, simpo, cpo, exo_pair (its target distribution's epsilon: must be > 0)."""
    f_divergence_type: str = "reverse_kl"
    """f-DPO's divergence to the reference: "reverse_kl" (DPO's), "forward_kl", "js_divergence" or
    "alpha_divergence"; other than "reverse_kl" with sigmoid, sigmoid_norm, ipo, hinge, robust, exo_pair or
    discopop."""
    f_alpha_divergence_coef: float = 0.5
    """alpha_divergence: its alpha."""
    ld_alpha: float = 1.0
    """LD-DPO's weight, in [0, 1], of each answer's tokens past the shorter answer of its pair (the first
    min(chosen, rejected) tokens of both count fully) in the sequence log-probabilities of the policy and the
    reference; 1: no weighting (DPO)."""
    use_weighting: bool = False
    """WPO: each pair's loss times the product of its two answers' weights exp(mean over the answer's tokens of (log p
    of the token - log sum of p^2 over the vocabulary)), the policy's, without gradient (as TRL's use_weighting)."""
    discopop_tau: float = 0.05
    """discopop: the temperature of the gate between its logistic and exponential parts."""
    simpo_gamma: float = 0.5
    """simpo: the target margin gamma of the length-normalized rewards."""
    alpha: float = 0.0
    """AlphaPO (TRL's CPOConfig alpha) for simpo and the cpo losses: each answer's score s (its log-probability,
    length-normalized for simpo and cpo_ipo) replaced by the reward shape (1 - exp(s)^-alpha) / alpha; 0: s itself."""
    desirable_weight: float = 1.0
    """kto, apo_zero_unpaired: the weight of the desirable examples' losses."""
    undesirable_weight: float = 1.0
    """kto, apo_zero_unpaired: the weight of the undesirable examples' losses."""
    disable_dropout: bool = True
    """Train without dropout (model.dropout, model.attention_dropout and lora.dropout set to 0), as TRL's
    `disable_dropout` default: the policy's log-probabilities and the reference's are those of the same
    deterministic model, so the first step's DPO loss is ln 2."""
    reference: str = "auto"
    """The reference model's log-probabilities: "precomputed" (one pass of the starting weights over the data
    before the first step, saved in the run directory), "adapters" (a LoRA run's base: the same forward with the
    adapters off, no extra memory), "weights" (a copy of the starting weights, a no-gradient forward each step, as
    TRL's reference model), "auto" (adapters with LoRA, weights under sync_ref_model, else precomputed)."""
    sync_ref_model: bool = False
    """TR-DPO (TRL's name): every ref_model_sync_steps optimizer steps the reference becomes ref_model_mixup_alpha
    x the policy + (1 - alpha) x itself (full fine-tuning, the "weights" reference; saved in checkpoints)."""
    ref_model_mixup_alpha: float = 0.6
    """The policy's share of the reference at each sync (TR-DPO's alpha; 1: a copy of the policy)."""
    ref_model_sync_steps: int = 512
    """Optimizer steps between the reference's syncs (TR-DPO's tau)."""


@dataclass
class RewardConfig:
    """The `[reward]` section: a reward model trained on the preference pairs of [sft]'s data (`prompt`, `chosen`,
    `rejected`, an optional `margin`) with [sft]'s tokenizer and template, as TRL's RewardTrainer
    (`docs/reward-model.md`)."""

    loss: str = ""
    """"bradley_terry": each pair's -log sigmoid(r_chosen - r_rejected - margin), r a sequence's scalar reward (the
    score head on its last token's final hidden state), the margin the record's `margin` (0 without); empty: no
    reward-model run."""
    center_rewards_coefficient: float = 0.0
    """TRL's center_rewards_coefficient (Eisenstein et al. 2023): each pair adds this x (r_chosen + r_rejected)^2,
    which keeps the rewards near mean 0 (0.01 recommended; 0: off)."""
    disable_dropout: bool = True
    """Train without dropout (model.dropout and model.attention_dropout set to 0), as TRL's `disable_dropout`
    default."""


@dataclass
class RLConfig:
    """The `[rl]` section: online reinforcement learning with verifiable rewards (GRPO and its 2025 variants). The
    prompts are [sft]'s records (text or messages, rendered with [sft]'s tokenizer and template; their other columns
    go to the reward functions) or a built-in task; the completions are sampled by the policy itself, at the
    training layout (`docs/rl.md`). `train.global_batch_size` counts rows; each step's sequences are packed into
    that many rows of model.seq_length tokens."""

    loss: str = ""
    """"grpo", "bnpo", "dr_grpo", "dapo" (token mean over the global batch), "cispo", "sapo" (a soft sigmoid gate in
    place of the clip), "luspo" (each sequence's loss times its length) or "vespo" (a Gamma weight of the sequence's
    ratio), as TRL's GRPOTrainer defines them, "rloo" (TRL's RLOOTrainer: leave-one-out baselines, the KL in the
    reward, the clipped surrogate on each sequence's whole ratio), "gmpo" (TRL's experimental GMPOTrainer: the
    geometric mean of the token ratios, each clipped in log space to [-epsilon, epsilon_high], the paper's 0.4) or
    "online_dpo" (TRL's experimental OnlineDPOTrainer: two completions a prompt, the better-rewarded one chosen, DPO's
    sigmoid loss with beta against the reference) or "a2po" (A*-PO, TRL's experimental A2POTrainer: before training
    each prompt's optimal value V* from num_value_samples completions of the starting policy, then one completion a
    prompt a step and the squared error of beta2 x its log-ratio to the reference against reward - V*); empty: no RL
    run."""
    task: str = ""
    """"arithmetic": a built-in verifiable task generated from train.seed instead of sft.data."""
    task_size: int = 512
    """Prompts of the built-in task."""
    num_generations: int = 8
    """Completions sampled per prompt (G, the group)."""
    prompts_per_step: int = 0
    """Prompts per optimizer step (each gives num_generations sequences); 0: train.global_batch_size //
    num_generations."""
    max_completion_length: int = 64
    """Tokens sampled per completion at most; a completion that reaches it without the end-of-turn token is
    truncated."""
    temperature: float = 1.0
    """Sampling temperature; the log-probabilities are those of the temperature-scaled logits (as TRL's)."""
    top_p: float = 1.0
    """Nucleus sampling (1 disables it)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 disables it)."""
    min_p: float = 0.0
    """Sample among the tokens at least min_p times as likely as the most likely one (0 disables it)."""
    disable_dropout: bool = True
    """Train without dropout (model.dropout, model.attention_dropout and lora.dropout set to 0), as TRL's
    `disable_dropout` default: the training forward's log-probabilities are those the rollout sampled with, and
    the reference's."""
    log_completions: bool = False
    """Append each round's prompts, completions, rewards and advantages to the run directory's completions.jsonl
    (the main rank; a resumed run's file equals the uninterrupted run's)."""
    repetition_penalty: float = 1.0
    """The logits of the ids already in the sequence (prompt and completion) divided by this where positive and
    multiplied where negative before sampling, as transformers and vLLM apply it (1 disables it); the
    log-probabilities stay the policy's own."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference (k3 estimator); 0: no reference model."""
    use_bias_correction_kl: bool = True
    """Multiply each token's KL term by its importance ratio (DeepSeek-V3.2's unbiased KL gradient, TRL's default);
    false: the plain k3 term."""
    sync_ref_model: bool = False
    """TR-DPO's reference updates (TRL's name): every ref_model_sync_steps optimizer steps the reference becomes
    ref_model_mixup_alpha x the policy + (1 - alpha) x itself (full fine-tuning with beta > 0; saved in
    checkpoints)."""
    ref_model_mixup_alpha: float = 0.6
    """The policy's share of the reference at each sync (1: a copy of the policy)."""
    ref_model_sync_steps: int = 512
    """Optimizer steps between the reference's syncs."""
    epsilon: float = 0.2
    """Lower clipping range of the importance ratio (1 - epsilon)."""
    epsilon_high: float = 0.0
    """Upper clipping range (DAPO's clip-higher; cispo: the cap on the ratio itself); 0: epsilon."""
    delta: float = 0.0
    """INTELLECT-2's two-sided clipping: the ratio capped at delta (> 1 + epsilon_high) before the clipped
    surrogate, so a negative advantage's term is bounded too (grpo, bnpo, dr_grpo, dapo, luspo); 0: off."""
    sapo_temperature_pos: float = 1.0
    """sapo: the gate's temperature where the advantage is positive (its slope at ratio 1 is that of the unclipped
    ratio; a higher temperature gates off-policy tokens faster)."""
    sapo_temperature_neg: float = 1.05
    """sapo: the gate's temperature where the advantage is zero or negative."""
    vespo_k_pos: float = 2.0
    """vespo: the Gamma weight's power k where the advantage is >= 0: phi(w) = exp(lambda) w^k exp(-lambda w), w the
    sequence's ratio (the product of its tokens'), phi(1) = 1."""
    vespo_lambda_pos: float = 3.0
    """vespo: the Gamma weight's decay lambda where the advantage is >= 0."""
    vespo_k_neg: float = 3.0
    """vespo: the power k where the advantage is negative."""
    vespo_lambda_neg: float = 2.0
    """vespo: the decay lambda where the advantage is negative."""
    top_entropy_quantile: float = 1.0
    """"Beyond the 80/20 rule": only the tokens whose entropy is in this top share of the global batch's completion
    tokens get a policy loss (0.2 in the paper; the KL term stays on every token); 1: every token. The threshold is
    the quantile over the whole global batch (one no-gradient forward pass of the step's rows first)."""
    entropy_coef: float = 0.0
    """An entropy bonus: the loss less entropy_coef x the mean entropy over the global batch's completion tokens (those
    the entropy mask keeps, under rl.top_entropy_quantile), whatever the loss type's normalizer; 0: none. Under
    use_adaptive_entropy, the starting coefficient."""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive entropy control: after each step the coefficient rises by entropy_coef_delta while that
    mean entropy is at or below entropy_target and falls by it above, within [entropy_coef_min, entropy_coef_max];
    a step applies it only when the last step's mean entropy was at or below the target. Saved in checkpoints."""
    entropy_coef_min: float = 0.0
    """The adaptive coefficient's lower bound."""
    entropy_coef_max: float = 1.0
    """The adaptive coefficient's upper bound."""
    entropy_coef_delta: float = 0.005
    """The adaptive coefficient's change per step."""
    entropy_target: float = 0.2
    """The mean entropy (nats) at or below which the adaptive bonus applies; set it near the entropy the run logs
    early on (2 to 10 nats for typical models)."""
    off_policy_mask_threshold: float = 0.0
    """DeepSeek-V3.2's off-policy sequence masking: a completion with a negative advantage whose mean
    log-probability under the policy that sampled it exceeds the current policy's by more than this gets no policy
    loss (the KL term stays); 0: off."""
    dpo_loss_type: str = "sigmoid"
    """online_dpo: "sigmoid" (DPO) or "ipo" ((d - 1 / (2 beta))^2 of the summed log-ratio difference d), as TRL's
    OnlineDPOConfig loss_type."""
    missing_eos_penalty: float = 0.0
    """online_dpo: subtracted from the reward of a completion cut before its end token (TRL's missing_eos_penalty)."""
    num_value_samples: int = 8
    """a2po: completions of each training prompt the starting policy samples to estimate its optimal value (TRL's)."""
    beta1: float = 0.5
    """a2po: the temperature of the optimal value, V*(x) = beta1 log(mean over the samples of exp(reward / beta1))
    (TRL's A2POConfig.beta1)."""
    beta2: float = 1e-3
    """a2po: the implicit reward's scale, beta2 log(pi(y|x) / pi_ref(y|x)) summed over the completion (TRL's beta2)."""
    filter_all_incorrect: bool = True
    """a2po: drop the training prompts whose value samples all scored 0 (no signal), as TRL's default."""
    normalize_advantages: bool = False
    """rloo: normalize the advantages over the round's completions (mean 0, std 1; TRL's RLOO option)."""
    reward_clip_range: list = field(default_factory=list)
    """rloo: [low, high] the rewards are clamped to before the KL penalty and the baselines (TRL's); empty: none."""
    scale_rewards: str = "group"
    """Advantages are reward minus the group mean, divided by the "group"'s std, the "batch"'s std, or "none"."""
    num_iterations: int = 1
    """Optimizer steps on each step's rows of a generation round (the ratio taken against the old log-probabilities
    of the policy that sampled them)."""
    generation_batch_size: int = 0
    """Completions sampled per generation round (TRL's name): a multiple of one step's prompts_per_step x
    num_generations; the round's sequences are shuffled (seeded by train.seed and the round) and split into
    generation_batch_size / (prompts_per_step x num_generations) optimizer steps, taken in turn, num_iterations
    times over, each against the old log-probabilities of the policy that sampled them; advantages (and
    scale_rewards="batch") span the round, and dapo, cispo and vespo normalize by the round's tokens over its steps,
    as TRL does. 0: one step's. (TRL's steps_per_generation is gradient_accumulation_steps times the steps.)"""
    importance_sampling: str = "token"
    """"token" (GRPO) or "sequence" (GSPO: the mean log-ratio over the completion's tokens)."""
    mask_truncated_completions: bool = False
    """Give truncated completions no gradient (they still count as sequences in the normalizers, as in TRL;
    rloo and gmpo count each one's constant loss -A, its ratio exp(0), as TRL's RLOO and GMPO do)."""
    rewards: list = field(default_factory=lambda: ["math"])
    """Reward functions: "math" (the last number or \\boxed{} against the record's `answer`), "format" (a regex,
    rl.format_pattern), "module:function" with TRL's signature, or "model:PATH", a trained reward model (a Hugging
    Face XForSequenceClassification directory or a shardlm reward run's checkpoint) scored at the training layout."""
    reward_weights: list = field(default_factory=list)
    """Weight of each reward function (empty: 1 each); the reward is their weighted sum."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """Several reward functions: "sum_then_normalize" (their weighted sum, then scale_rewards) or
    "normalize_then_sum" (GDPO: each function normalized within its group, their weighted sum normalized over the
    batch)."""
    format_pattern: str = ""
    """The "format" reward's regex, matched against the whole completion."""
    eval_prompts: int = 0
    """Prompts held out from the prompt pool (sft.data's records or the task's, drawn by train.seed) to evaluate the
    policy on, as TRL's evaluation: every train.eval_interval steps and at the end it samples num_generations_eval
    completions of each (the training sampling settings, the same seeds each time) at the training layout and logs
    their rewards (val_reward, val_rewards/<function>/mean, val_completions/mean_length, ...); 0: none."""
    num_generations_eval: int = 0
    """Completions sampled per held-out prompt (0: num_generations)."""
    batch_invariant: bool = False
    """Batch-invariant numerics (`shardlm.parallel.invariant`): the rollout's log-probabilities equal the training
    forward's bitwise in fp32 (dense attention models), at the cost of slower attention; off: they differ by
    round-off (logged as logprob_diff_max)."""
    completions: str = ""
    """A JSONL file of fixed completions (`{"step": s, "sequence": j, "ids": [...]}`, with tools a `"turn": k` for
    the reply after the k-th tool results) used instead of sampling: for checking a layout or another trainer on the
    same tokens."""
    tools: list = field(default_factory=list)
    """Tools the policy may call while it completes a prompt (TRL's GRPOTrainer `tools`): "module:function" names of
    Python functions with type hints and a Google-style docstring (their JSON schemas, rendered into each prompt by the
    chat template, are transformers' `get_json_schema`'s). A reply's calls (Hermes or Qwen3.5 format, or the
    tokenizer's own response template) are run on the main rank, their results appended and the policy continues;
    the results' tokens are never trained (`docs/rl.md`). Conversational prompts only; not with online_dpo or a2po."""
    environment: str = ""
    """A class ("module:Class") whose instances are the sequences' environments (TRL's GRPOTrainer
    environment_factory): one a sequence on the main rank, reset with its record's columns before each sampling (the
    text reset returns appended to the prompt's last message), its public methods the sequence's tools beside
    rl.tools', its get_reward() (if defined) a reward function of its own; the reward functions get environments=
    too (`docs/rl.md`). Empty: none."""
    max_tool_calling_iterations: int = 0
    """The most rounds of tool results a completion gets (TRL's name); 0: no limit (a completion still ends within
    max_completion_length)."""


@dataclass
class LoraConfig:
    """The `[lora]` section: train low-rank adapters on a frozen base instead of every weight (`docs/lora.md`)."""

    rank: int = 0
    """Adapter rank r (8-64 are usual); 0: no adapters, every weight trains."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.0
    """Dropout on each adapter's input, as peft's lora_dropout."""
    targets: list = field(default_factory=lambda: ["all-linear"])
    """Projections that get adapters, by shardlm or Hugging Face name (q/q_proj, k, v, o, qkv, proj, fc, gate,
    up, down; out/out_proj a Mamba-2 layer's output projection): "all-linear" is every attention, Mamba-2 output and
    MLP projection (never the router or the output layer)."""
    expert_layers: list = field(default_factory=list)
    """With "experts" in targets: the layers (0-based) whose experts get adapters, as peft's target_parameters naming
    layers ("7.mlp.experts.gate_up_proj"); empty: every MoE layer's."""
    rslora: bool = False
    """rsLoRA: scale by alpha / sqrt(r) instead of alpha / r."""
    modules_to_save: list = field(default_factory=list)
    """Whole modules trained in full beside the adapters, by name: "embedding" (wte / embed_tokens),
    "output" (lm_head), "norm" (the final norm)."""
    quantize: str = ""
    """QLoRA: "nf4" stores the frozen projections of the transformer layers and the MoE experts in 4-bit NormalFloat
    with double quantization (each matrix quantized whole, the same base at every layout), dequantized in the
    forward; empty: they stay fp32, or half under bf16 or fp16 autocast (the values autocast would cast them to)."""


@dataclass
class DistillConfig:
    """The `[distill]` section: knowledge distillation from a frozen teacher on [sft]'s records (the teacher scores
    the dataset's own answers), the divergence computed over the vocabulary-parallel logits of both models at the
    training layout (`docs/distillation.md`). The loss is the sum over the answer tokens of the global batch of
    each token's divergence, over their count (TRL's "batchmean")."""

    disable_dropout: bool = True
    """Train without dropout (model.dropout, model.attention_dropout and lora.dropout set to 0), as TRL's
    `disable_dropout` default: the student's distributions are those it samples its on-policy completions from."""
    teacher: str = ""
    """The frozen teacher: a Hugging Face model directory or a shardlm checkpoint (a consolidated file or a sharded
    directory) with the student's vocabulary; empty: no distillation."""
    loss: str = "jsd"
    """"jsd": the generalized Jensen-Shannon divergence of the whole next-token distributions (`beta`); "token_kl":
    on-policy distillation's per-token reverse KL of the row's own tokens, log p_student - log p_teacher at each
    answer token, minimized as a reward (its gradient (log p_s - log p_t) x grad log p_s, the teacher's score a
    per-token advantage; meant for on-policy steps, `lmbda` 1, where the tokens are the student's samples);
    "iw_opd": importance-weighted on-policy distillation (TRL's `IWOPDTrainer`): token_kl's advantage
    log p_teacher - log p_student weighted by 1 + iw_opd_gamma (1 - the share of its document's summed |advantage|
    before the token), the loss -weight x advantage x log p_student."""
    beta: float = 0.5
    """The generalized Jensen-Shannon divergence's weight of the teacher's side, as TRL's `generalized_jsd_loss`:
    beta KL(teacher || mixture) + (1 - beta) KL(student || mixture), the mixture (1 - beta) student + beta teacher;
    0 is the forward KL(teacher || student), 1 the reverse KL(student || teacher)."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the divergence (as TRL's DistillationTrainer; no T^2 factor)."""
    loss_top_k: int = 0
    """"jsd" on a top-k support (TRL's IW-OPD trainer's `loss_top_k`, 1 there): the teacher's k most likely tokens
    (beta 0), the student's (beta 1; k 1: the reverse top-1 token) or both (the teacher's top token and the reverse
    top-1 token at k 1), each position's distributions restricted to them; 0 (or at least the vocabulary): the whole
    vocabulary."""
    loss_add_tail: bool = True
    """loss_top_k: the mass outside the support as one more entry of both distributions (TRL's `loss_add_tail`);
    false: the support's probabilities renormalized."""
    reverse_kl_top_1_mode: str = "sampled"
    """loss_top_k 1 with beta > 0: the reverse top-1 token, "sampled" (the position's own next token: the sampled
    one on an on-policy step) or "argmax" (the student's most likely token), as TRL's."""
    iw_opd_gamma: float = 0.5
    """IW-OPD's amplification (TRL's `iw_opd_gamma`): a document's first answer token weighs 1 + gamma, its last
    about 1 (loss "iw_opd" only)."""
    iw_opd_epsilon: float = 1e-8
    """The least a document's summed |advantage| counts as when the weights divide by it (TRL's `iw_opd_epsilon`)."""
    teacher_dtype: str = "fp32"
    """The teacher's weights: "fp32", or "bf16" (half the memory; its forward then runs under bf16 autocast)."""
    lmbda: float = 0.0
    """GKD's lambda: the share of steps trained on the student's own completions (on-policy distillation). Each step
    is on-policy with this probability (drawn from train.seed and the step): every conversation of the step's rows
    is cut before its last answer, the student completes it at the training layout (KV cache, the RL generator),
    and the divergence is taken over the sampled tokens. 0: offline only (the records' own answers)."""
    seq_kd: bool = False
    """GKD's sequence-level KD (TRL's `seq_kd`): the steps that are not on-policy train on the teacher's own
    completions of each conversation's prompt (sampled by the teacher at the training layout, as the student samples
    its own) instead of the records' answers."""
    max_new_tokens: int = 128
    """An on-policy (or seq_kd) completion's length at most (it stops earlier at the end-of-turn token)."""
    sampling_temperature: float = 1.0
    """The temperature the student (and under seq_kd the teacher) samples its completions at (TRL's
    GKDConfig.temperature)."""
    top_p: float = 1.0
    """On-policy (and seq_kd) sampling: nucleus sampling (1 disables it), as TRL's DistillationConfig.top_p."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 disables it)."""
    min_p: float = 0.0
    """Sample among the tokens at least min_p times as likely as the most likely one (0 disables it)."""
    repetition_penalty: float = 1.0
    """The logits of the ids already in the sequence divided by this where positive and multiplied where negative,
    before the temperature (1 disables it)."""
