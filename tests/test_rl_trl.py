"""TRL's `GRPOTrainer` (1.16) as an external oracle for shardlm's GRPO and its variants, step by step.

A random two-layer Qwen3 with the real Qwen3 vocabulary and chat template is saved as a Hugging Face directory
beside the shared Qwen3 tokenizer. Both trainers read the same 2 conversational arithmetic prompts (an `answer`
column each) and train 2 steps (3 for the control's case) on the same completions: fixed token lists, G = 4 a
prompt a round, built by tokenizing fixed texts (finished ones end with the end-of-turn `<|im_end|>`, truncated
ones are exactly max_completion_length tokens without it), different in each round. TRL's generation is replaced by a
subclass's `_generate_single_turn`, which answers each prompt (found by its token ids, so the sampler's order does not
matter) with its completions of the round; shardlm reads them from `rl.completions`. The reward is
`length_and_answer` below (the answer's presence plus a length term), passed to TRL as the function and to shardlm
as "test_rl_trl:length_and_answer", so rewards differ within every group.

Each step holds every prompt (TRL: per_device_train_batch_size = P x G, one accumulation step, so its shuffling
only reorders the sums; shardlm: rl.prompts_per_step = P) and both train in fp32 with the same AdamW (betas
0.9 / 0.999, no weight decay, eps 1e-4: GRPO's nearly cancelling gradients make fp32 runs drift apart at 1e-8),
a constant learning rate, clipping at 1.0 and the sampling temperature 0.9 (the log-probabilities and entropies
are those of logits / 0.9). shardlm packs the 8 sequences best-fit into 4 rows of 64 tokens, 2 micro-batches a
step (TRL pads one sequence a row).

Each step's loss, gradient norm, kl (beta > 0), clip ratios (low, high, region; CISPO's own), entropy, reward and
completion lengths agree within TOL = 1e-5, absolute where the value is below 1 and relative above (the entropies
near 11.9, the gradient norms): `differences`. Measured: at most 1.3e-6 (a gradient norm), 6.6e-7 (a loss),
1.9e-7 (entropy), 5.4e-8 (kl), 6e-8 (reward: TRL's are fp32), 2.3e-8 (clip ratios: the same tokens clipped). The
cases cover grpo, dr_grpo, dapo, cispo, sapo, luspo and vespo, num_iterations 1 and 2, beta 0 and 0.04,
clip-higher, masked truncated completions, scale_rewards "batch" and "none", GSPO's sequence-level ratio and
DeepSeek-V3.2's off-policy mask, the 80/20 rule's entropy mask, the KL without its importance ratio, GDPO's
normalization of two reward functions, the entropy bonus (on the entropy mask's tokens) and Skywork-OR1's adaptive
control of its coefficient (measured: within 1.1e-6, the gradient norms; `policy_loss` and `entropy_coef` too),
and generation rounds of 16 completions of 4 prompts split between two steps (rl.generation_batch_size; TRL's
shuffle of its generation batch replaced by shardlm's split, so both train the same sequences in each step;
measured within 1.2e-6). rl.loss="rloo" against TRL's `RLOOTrainer` (the same fixture, its generation replaced the
same way): the KL in the reward with masked truncation over 3 steps, and two iterations a round on normalized
advantages of clamped rewards (measured within 2.0e-6). rl.loss="gmpo" against TRL's experimental `GMPOTrainer`
(KL, two iterations a round, masked truncation). A trained reward model (a `Qwen3ForSequenceClassification` beside the
shared tokenizer) among the rewards: TRL loads it from its path and scores each prompt and completion rendered with
its chat template; shardlm's `rl.rewards` names it "model:PATH" and scores at the layout (its rewards/rm/mean and std,
and the weighted reward, within TOL).
Control runs with another temperature, or without each of those options, miss TRL's numbers by far more than TOL,
so the comparison can fail. (INTELLECT-2's `delta`
has nothing to cap on this fixture: `test_rl_loss_variants.py`.)
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from chat_cache import template_parsed_once  # noqa: F401 (parses the chat template once per module)
from llama_reference import tiny_qwen3_policy, tiny_qwen3_reward_model
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")
transformers = import_or_skip("transformers")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.rl.batch import split_round  # noqa: E402
from shardlm.rl.loss import loss_metrics  # noqa: E402
from shardlm.rl.prompts import round_prompts  # noqa: E402
from shardlm.sft.template import ChatTemplate  # noqa: E402
from shardlm.training.run import train  # noqa: E402

G, STEPS, MAX_COMPLETION, SEQ, ROWS, MICRO = 4, 2, 8, 64, 4, 2
ROUNDS = 3  # the most steps a case trains (its "steps"; STEPS by default)
LR, TEMPERATURE, ADAM_EPS, SEED, TOL = 1e-3, 0.9, 1e-4, 0, 1e-5

PROMPTS = [
    {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 6 x 7?"}],
     "answer": "42"},
]
# Two more prompts for the cases whose generation round feeds two steps (rl.generation_batch_size): 4 a round
EXTRA = [
    {"prompt": [{"role": "user", "content": "What is 9 - 5?"}], "answer": "4"},
    {"prompt": [{"role": "user", "content": "What is 8 / 2?"}], "answer": "4"},
]
# Each prompt's pool of completion texts: round r takes the G texts from position r on. True: finished (the
# end-of-turn id follows the text); False: truncated (the text's first MAX_COMPLETION tokens).
POOLS = [
    [("7", True), ("The answer is 7.", True), ("It is 8", True),
     ("Let me count on my fingers: three, then four more", False), ("3 + 4 = 7", True),
     ("Seven, since four after three makes seven in total", False)],
    [("42", True), ("Six times seven is a product I know well", False), ("It is 36", True), ("6x7=42", True),
     ("Multiplying six by seven gives forty two as", False), ("42.", True)],
    [("4", True), ("Nine less five leaves four of them in the end", False), ("It is 5", True), ("9-5=4", True),
     ("Taking five away from nine gives us four in", False), ("four", True)],
    [("4.", True), ("Eight split in two equal parts is four each time", False), ("2", True), ("8/2 = 4", True),
     ("Halving eight gives four, since four plus four", False), ("It is 4", True)],
]


def length_and_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """The reward: 1 where the completion contains its record's answer, plus 0.1 per space in its text."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a in t) + 0.1 * t.count(" ") for t, a in zip(texts, answer)]


def digits(prompts, completions, **kwargs) -> list[float]:
    """A second reward (GDPO's case): the share of digits among the completion's characters."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    """The tiny Qwen3 directory `hf`, the prompts (prompts.jsonl) and each round's completions (completions.jsonl,
    shardlm's `rl.completions`) under `root`; "rounds": [prompt][k] completion ids of each round, "ids": each
    prompt's token ids as shardlm's template renders it; "tokenizer": TRL's tokenizer of `hf`."""
    root = tmp_path_factory.mktemp("rl_trl")
    tiny_qwen3_policy(root / "hf", data_dir, SEQ, hidden=64, head_dim=16)
    tiny_qwen3_reward_model(root / "rm", data_dir, SEQ, head_std=1.0)  # the "reward_model" reward
    template = ChatTemplate.from_dir(root / "hf")
    eos = template.tokenizer.token_to_id("<|im_end|>")
    for name, records in (("prompts", PROMPTS), ("prompts4", PROMPTS + EXTRA)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in records))

    def tokens(text: str, finished: bool) -> list[int]:
        ids = template.encode(text)
        if finished:
            assert len(ids) < MAX_COMPLETION, text  # room for the end-of-turn id
            return ids + [eos]
        assert len(ids) > MAX_COMPLETION, text  # cut before its end: no end-of-turn id
        return ids[:MAX_COMPLETION]

    rounds = [[[tokens(*pool[r + k]) for k in range(G)] for pool in POOLS] for r in range(ROUNDS)]
    for name, count in (("completions", len(PROMPTS)), ("completions4", len(PROMPTS + EXTRA))):
        lines = []
        for r, completions in enumerate(rounds):
            owners = round_prompts(count, count, r, SEED)
            lines += [json.dumps({"step": r, "sequence": j, "ids": completions[owners[j // G]][j % G]})
                      for j in range(len(owners) * G)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    ids = [template.encode(template.render(p["prompt"], add_generation_prompt=True)) for p in PROMPTS + EXTRA]
    # one tokenizer for every TRL run (parsing the 11 MB tokenizer.json is a CPU second a run; the trainers only
    # set its pad token, to the same end-of-text token each time)
    return {"root": root, "hf": root / "hf", "rm": root / "rm", "rounds": rounds, "ids": ids,
            "tokenizer": transformers.AutoTokenizer.from_pretrained(root / "hf")}


def trl_steps(setup, name: str, case: dict) -> list[dict]:
    """TRL's logged steps for `case` (shardlm's [rl] names: loss, beta, num_iterations, epsilon, epsilon_high,
    scale_rewards, importance_sampling, mask_truncated_completions), its generation replaced by the fixed
    completions of `setup`."""
    from transformers import AutoModelForCausalLM

    prompt_index = {tuple(ids): i for i, ids in enumerate(setup["ids"])}
    records = case_prompts(case)
    rloo, gmpo = case.get("loss") == "rloo", case.get("loss") == "gmpo"  # TRL's RLOOTrainer, GMPOTrainer, GRPOTrainer
    if gmpo:
        from trl.experimental.gmpo import GMPOConfig, GMPOTrainer
    base = trl.RLOOTrainer if rloo else GMPOTrainer if gmpo else trl.GRPOTrainer

    class FixedCompletions(base):
        rounds_done = 0

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            completions = setup["rounds"][self.rounds_done]
            self.rounds_done += 1
            taken: Counter = Counter()
            chosen = []
            for ids in prompt_ids:
                i = prompt_index.get(tuple(ids))
                assert i is not None, f"TRL rendered a prompt unlike shardlm's template: {ids}"
                chosen.append(list(completions[i][taken[i]]))
                taken[i] += 1
            assert sorted(taken.values()) == [G] * len(records)  # every prompt's group, once
            return chosen if rloo else (chosen, None)

    def split_like_shardlm(batch: dict) -> dict:
        """TRL's shuffle of its generation batch (before cutting it into steps) replaced by shardlm's split of the
        round (`split_round`): each sequence, found by its completion's ids, goes to the step shardlm trains it in."""
        r = len(rounds_split)
        owners = round_prompts(len(records), len(records), r, SEED)
        sequence = {tuple(setup["rounds"][r][owners[j // G]][j % G]): j for j in range(len(owners) * G)}
        step_of = split_round(len(owners) * G, case["generation_batch_size"] // (G * len(PROMPTS)), SEED, r)
        pad = setup["tokenizer"].pad_token_id
        rows = [sequence[tuple(t for t in ids.tolist() if t != pad)] for ids in batch["completion_ids"]]
        order = sorted(range(len(rows)), key=lambda i: step_of[rows[i]])
        rounds_split.append(order)

        def reorder(v):
            if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
                return v
            return v[torch.tensor(order)] if isinstance(v, torch.Tensor) else [v[i] for i in order]

        return {k: reorder(v) for k, v in batch.items()}

    rounds_split: list = []

    options = {"beta": case.get("beta", 0.0), "num_iterations": case.get("num_iterations", 1),
               "epsilon": case.get("epsilon", 0.2),
               "mask_truncated_completions": case.get("mask_truncated_completions", False)}
    if not rloo:
        options |= {"scale_rewards": case.get("scale_rewards", "group"),
                    "importance_sampling_level": case.get("importance_sampling", "token")}
    if not (rloo or gmpo):
        options["loss_type"] = case.get("loss", "grpo")
    if case.get("epsilon_high"):
        options["epsilon_high"] = case["epsilon_high"]
    options |= {k: case[k] for k in SAME_NAMES if k in case}
    config = trl.RLOOConfig if rloo else GMPOConfig if gmpo else trl.GRPOConfig
    args = config(output_dir=str(setup["root"] / f"trl_{name}"), num_generations=G,
                          per_device_train_batch_size=G * len(PROMPTS), gradient_accumulation_steps=1,
                          max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                          max_steps=case.get("steps", STEPS), learning_rate=LR, lr_scheduler_type="constant",
                          warmup_steps=0, weight_decay=0.0,
                          adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=ADAM_EPS, max_grad_norm=1.0,
                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=SEED,
                          dataloader_num_workers=0, disable_tqdm=True, bf16=False, log_completions=False, **options)
    model = AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    with uncached_datasets():
        functions = [str(setup["rm"]) if name == "reward_model" else globals()[name]  # TRL loads a model's path
                     for name in case.get("rewards", ["length_and_answer"])]
        trainer = FixedCompletions(model=model, reward_funcs=functions, args=args,
                                   train_dataset=datasets.Dataset.from_list(records),
                                   processing_class=setup["tokenizer"])
        with pytest.MonkeyPatch.context() as patch:
            if "generation_batch_size" in case:
                patch.setattr(trl.trainer.grpo_trainer, "shuffle_sequence_dict", split_like_shardlm)
            trainer.train()
    # every round from the fixed completions
    round_steps = options["num_iterations"] * args.steps_per_generation
    assert trainer.rounds_done == -(-args.max_steps // round_steps)
    assert len(rounds_split) == (trainer.rounds_done if "generation_batch_size" in case else 0)
    return [log for log in trainer.state.log_history if "loss" in log]


def case_prompts(case: dict) -> list[dict]:
    """The prompts of `case`'s dataset: 4 where a round feeds two steps, else 2 (one step's)."""
    return PROMPTS + EXTRA if "generation_batch_size" in case else PROMPTS


def shardlm_steps(setup, name: str, case: dict) -> list[dict]:
    """shardlm's metrics.jsonl steps for `case` from the same directory, prompts and completions."""
    files = ("prompts4.jsonl", "completions4.jsonl") if "generation_batch_size" in case else (
        "prompts.jsonl", "completions.jsonl")
    rl = {"loss": f'"{case.get("loss", "grpo")}"', "beta": case.get("beta", 0.0),
          "num_iterations": case.get("num_iterations", 1), "epsilon": case.get("epsilon", 0.2),
          "epsilon_high": case.get("epsilon_high", 0.0),
          "scale_rewards": f'"{case.get("scale_rewards", "group")}"',
          "importance_sampling": f'"{case.get("importance_sampling", "token")}"',
          "mask_truncated_completions": str(case.get("mask_truncated_completions", False)).lower(),
          "temperature": case.get("temperature", TEMPERATURE),
          **{k: toml_value(case[k]) for k in SAME_NAMES if k in case}}
    overrides = [f"checkpoint.init_from={setup['hf']}", "checkpoint.save=false",
                 f"sft.data=[\"{setup['root'] / files[0]}\"]", *(f"rl.{k}={v}" for k, v in rl.items()),
                 f"rl.num_generations={G}", f"rl.prompts_per_step={len(PROMPTS)}",
                 f"rl.max_completion_length={MAX_COMPLETION}",
                 f"rl.completions=\"{setup['root'] / files[1]}\"",
                 "rl.rewards=[" + ", ".join(f'"model:{setup["rm"]}"' if name == "reward_model" else
                                            f'"test_rl_trl:{name}"'
                                            for name in case.get("rewards", ["length_and_answer"])) + "]",
                 f"model.seq_length={SEQ}", *same_training(case.get("steps", STEPS), MICRO, ROWS)]
    run_dir = setup["root"] / f"shardlm_{name}"
    train(load_config(None, overrides), run_dir=run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"val_loss"' not in line]


def same_training(steps: int, micro: int, rows: int) -> list[str]:
    """The [train] and [log] overrides of a shardlm run matching TRL's arguments here: fp32 on the CPU, `rows` rows a
    step in micro-batches of `micro`, AdamW (betas 0.9 / 0.999, eps ADAM_EPS, no weight decay), a constant learning
    rate, clipping at 1.0, every step logged."""
    return [f"train.micro_batch_size={micro}", f"train.global_batch_size={rows}", f"train.steps={steps}",
            f"train.seed={SEED}", f"train.lr={LR}", f"train.min_lr={LR}", "train.decay_style=\"constant\"",
            "train.warmup_steps=0", "train.weight_decay=0.0", "train.adam_beta1=0.9", "train.adam_beta2=0.999",
            f"train.adam_eps={ADAM_EPS}", "train.clip_grad=1.0", "train.device=\"cpu\"", "train.precision=\"fp32\"",
            "log.interval=1", "log.progress=false", "log.plot=false", "log.tensorboard=false"]


SAME_NAMES = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
              "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold", "top_entropy_quantile",
              "use_bias_correction_kl", "multi_objective_aggregation", "reward_weights", "entropy_coef",
              "use_adaptive_entropy", "entropy_coef_delta", "entropy_target", "generation_batch_size",
              "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "normalize_advantages",
              "reward_clip_range")
"""Options that TRL's GRPOConfig and shardlm's [rl] name alike."""


def toml_value(value) -> str:
    """A case's option as a config override's value."""
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else str(value)

CASES = {
    # num_iterations 1: the ratio is exactly 1; the loss is the KL term's. 3 steps: the control's temperature
    # moves the second step's loss by 6.6e-4 only (the KL times beta), the third's by more than 1e-3
    "grpo_kl": {"beta": 0.04, "steps": 3},
    "dr_grpo_clip_higher": {"loss": "dr_grpo", "beta": 0.04, "num_iterations": 2, "epsilon": 0.1,
                            "epsilon_high": 0.28},
    "dapo_masked_batch": {"loss": "dapo", "num_iterations": 2, "mask_truncated_completions": True,
                          "scale_rewards": "batch"},
    # the second step's sequence ratios: about 0.55-0.6 where the advantage is negative (all clipped at 0.7),
    # 1.42-1.55 and above 1.7 where it is positive (half clipped at 1.6), so some sequences still train
    "gspo_masked": {"importance_sampling": "sequence", "num_iterations": 2, "epsilon": 0.3, "epsilon_high": 0.6,
                    "mask_truncated_completions": True},
    "cispo": {"loss": "cispo", "num_iterations": 2, "epsilon_high": 1.0},  # the cap: any ratio above 1
    # SAPO's gate at temperatures other than TRL's defaults (the second step's ratios move it off its slope at 1)
    "sapo": {"loss": "sapo", "num_iterations": 2, "beta": 0.04, "sapo_temperature_pos": 1.5,
             "sapo_temperature_neg": 2.5},
    "luspo_gspo": {"loss": "luspo", "importance_sampling": "sequence", "num_iterations": 2, "epsilon": 0.3,
                   "epsilon_high": 0.6},
    # VESPO's weights of whole-sequence ratios, masked truncated completions counted in the mean weight at 1
    "vespo": {"loss": "vespo", "num_iterations": 2, "mask_truncated_completions": True, "vespo_k_pos": 1.5,
              "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5},
    # DeepSeek-V3.2's off-policy mask: the second step's negative sequences drifted 0.18-0.57 (the control below).
    # (INTELLECT-2's rl.delta caps a negative advantage's rising ratio; here every such ratio falls, below 0.95, so
    # tests/test_rl_loss_variants.py checks it on ratios made to rise)
    "dapo_opsm": {"loss": "dapo", "num_iterations": 2, "epsilon": 0.1, "off_policy_mask_threshold": 0.3},
    # the 80/20 rule: the policy loss on the top 30% of tokens by entropy (TRL's quantile over its one micro-batch a
    # step, the global batch here), with the KL on every token, its plain k3 term (no importance ratio), and the
    # entropy bonus on those tokens (its gradient through the output layer; a mean over them, not GRPO's
    # per-sequence weights)
    "grpo_top_entropy_plain_kl_bonus": {"beta": 0.04, "num_iterations": 2, "top_entropy_quantile": 0.3,
                                        "use_bias_correction_kl": False, "entropy_coef": 0.05},
    # GDPO: two reward functions, each normalized within its group, their weighted sum over the batch
    "gdpo": {"rewards": ["length_and_answer", "digits"], "reward_weights": [1.0, 2.0],
             "multi_objective_aggregation": "normalize_then_sum"},
    # Skywork-OR1's adaptive control, the target above every entropy: no bonus at the first step (no mean yet), then
    # the coefficient 0.03 and 0.05, raised after each step; TR-DPO's reference syncs after each step (0.4 of the
    # policy), which the KL of steps 2 and 3 sees
    "grpo_adaptive_entropy_sync_ref": {"steps": 3, "beta": 0.04, "entropy_coef": 0.01, "use_adaptive_entropy": True,
                                       "entropy_coef_delta": 0.02, "entropy_target": 12.0, "sync_ref_model": True,
                                       "ref_model_mixup_alpha": 0.4, "ref_model_sync_steps": 1},
    # a generation round of 16 completions (4 prompts) feeding two steps of 8, shuffled between them: the second
    # step's ratios against the policy that sampled them, DAPO's normalizer the round's tokens over its 2 steps, the
    # advantages' std over the round; 2 rounds. Then one round of 2 steps, each taken twice (steps 0, 1, 0, 1), with
    # the KL and unscaled rewards
    "dapo_generation_batch": {"loss": "dapo", "generation_batch_size": 16, "beta": 0.04, "scale_rewards": "batch",
                              "steps": 4},
    "grpo_kl_unscaled_generation_batch_twice": {"generation_batch_size": 16, "num_iterations": 2, "steps": 4,
                                                "beta": 0.04, "scale_rewards": "none"},
    # TRL's RLOOTrainer: leave-one-out baselines; the first-order KL summed over each sequence, in the reward (3
    # steps: it is 0 at the first, the policy being its reference); then each round trained twice (the sequences'
    # whole ratios clipped) on normalized advantages of rewards clamped to [0, 1.2]
    "rloo_kl_masked": {"loss": "rloo", "beta": 0.05, "steps": 3, "mask_truncated_completions": True},
    "gmpo_kl_masked": {"loss": "gmpo", "beta": 0.04, "num_iterations": 2, "epsilon": 0.4,
                       "mask_truncated_completions": True},
    # a trained reward model (Qwen3ForSequenceClassification) beside a function: TRL renders each prompt and
    # completion with the model's chat template and reads the score at the last token that is not padding
    "grpo_reward_model": {"rewards": ["length_and_answer", "reward_model"], "reward_weights": [1.0, 0.5],
                          "beta": 0.04},
    "rloo_twice_normalized_clipped": {"loss": "rloo", "num_iterations": 2, "epsilon": 0.9, "epsilon_high": 9.0,
                                      "normalize_advantages": True, "reward_clip_range": [0.0, 1.2]},
}
METRICS = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean", "reward", "reward_std",
           "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "policy_loss",
           "entropy_coef", "rewards/rm/mean", "rewards/rm/std")


@pytest.fixture(scope="module")
def runs(setup):
    """`runs(name)`: (TRL's steps, shardlm's steps) of CASES[name], each pair run once per module."""
    done: dict = {}

    def run(name: str) -> tuple[list[dict], list[dict]]:
        if name not in done:
            done[name] = trl_steps(setup, name, CASES[name]), shardlm_steps(setup, name, CASES[name])
        return done[name]

    return run


def differences(ours: list[dict], theirs: list[dict]) -> dict:
    """{metric: the largest |shardlm - TRL| / max(1, |TRL|) over the steps where TRL logged it} (TRL logs the
    rewards and lengths at the steps that generate only)."""
    assert len(ours) == len(theirs) >= STEPS, (ours, theirs)
    worst: dict = {}
    for mine, trls in zip(ours, theirs):
        for key in METRICS:
            if key in trls:  # (one shardlm does not log: infinitely far)
                gap = abs(mine[key] - trls[key]) / max(1.0, abs(trls[key])) if key in mine else float("inf")
                worst[key] = max(worst.get(key, 0.0), gap)
    return worst


@pytest.mark.parametrize("name", list(CASES))
def test_grpo_follows_trl_step_by_step(runs, name):
    """Every metric TRL logs of METRICS, at each step (2, or the case's "steps"), within TOL (absolute below 1,
    relative above: the entropies near ln V = 11.9 and the gradient norms); each case exercises what it names: the
    KL moves the loss after the first step, and a second step on the same round clips some ratios."""
    theirs, ours = runs(name)
    case = CASES[name]
    clips = loss_metrics(case.get("loss", "grpo"))
    expected = {"loss", "grad_norm", "entropy", *clips, *(["kl"] if case.get("beta") else [])}
    assert all(expected <= set(log) for log in theirs), theirs
    assert len(theirs) == case.get("steps", STEPS), theirs
    round_steps = case.get("num_iterations", 1) * case.get("generation_batch_size", G * len(PROMPTS)) // (
        G * len(PROMPTS))
    assert all("reward" in theirs[s] for s in range(0, len(theirs), round_steps))
    worst = differences(ours, theirs)
    assert all(value <= TOL for value in worst.values()), {k: v for k, v in worst.items() if v > TOL}
    if case.get("beta"):  # (RLOO's first-order KL may be negative)
        assert abs(theirs[1]["kl"]) > 100 * TOL, theirs[1]
    if case.get("entropy_coef"):  # the bonus moved the loss (from the second step under the adaptive control)
        assert {"policy_loss", "entropy_coef"} <= set(ours[-1]) and {"policy_loss", "entropy_coef"} <= set(theirs[-1])
        assert all(abs(o["loss"] - o["policy_loss"]) > 0.1 for o in ours[case.get("use_adaptive_entropy", 0):])
    if round_steps > 1:  # the second step: the ratios against the policy that sampled the round
        assert theirs[1]["grad_norm"] > 0, theirs[1]
        # some clipped (cispo: capped) tokens, or VESPO's weights off their value 1 at ratio 1
        assert not clips or any(abs(theirs[1][k] - (k == "vespo/phi_seq_mean")) > 1e-3 for k in clips), theirs[1]


def test_another_temperature_misses_trl(setup, runs):
    """The control: shardlm at temperature 1 instead of 0.9 misses TRL's run by far more than TOL (the gradient
    norm from the first step, the loss from the second), so the comparison above can fail."""
    theirs, _ = runs("grpo_kl")
    ours = shardlm_steps(setup, "temperature_1", CASES["grpo_kl"] | {"temperature": 1.0})
    worst = differences(ours, theirs)
    assert worst["loss"] > 100 * TOL and worst["grad_norm"] > 100 * TOL, worst



@pytest.mark.parametrize("name, option", [("dapo_opsm", "off_policy_mask_threshold"),
                                          ("grpo_top_entropy_plain_kl_bonus", "top_entropy_quantile"),
                                          ("grpo_top_entropy_plain_kl_bonus", "use_bias_correction_kl"),
                                          ("gdpo", "multi_objective_aggregation"),
                                          ("grpo_top_entropy_plain_kl_bonus", "entropy_coef"),
                                          ("grpo_adaptive_entropy_sync_ref", "sync_ref_model"),
                                          ("rloo_kl_masked", "beta"), ("rloo_kl_masked", "mask_truncated_completions"),
                                          ("gmpo_kl_masked", "loss"),
                                          ("rloo_twice_normalized_clipped", "normalize_advantages"),
                                          ("rloo_twice_normalized_clipped", "reward_clip_range")])
def test_without_its_option_it_misses_trl(setup, runs, name, option):
    """The controls: shardlm without the off-policy mask, the entropy mask, the KL's plain term, GDPO's
    normalization, the entropy bonus, the reference's syncs, RLOO's KL in the reward, masking, normalized advantages
    or clipped rewards, or GMPO's loss (GRPO's in its place) misses TRL's run by far more than TOL."""
    theirs, _ = runs(name)
    case = {k: v for k, v in CASES[name].items() if k != option}
    worst = differences(shardlm_steps(setup, f"without_{option}", case), theirs)
    assert worst["grad_norm"] > 100 * TOL, worst
