"""Online DPO (`rl.loss = "online_dpo"`) against TRL's experimental `OnlineDPOTrainer` (1.16), step by step, and at
the layouts against one process.

A random two-layer Qwen3 with the real Qwen3 vocabulary and chat template is saved beside the shared tokenizer. Two
conversational prompts of the same token length (TRL's forward left-pads prompts without shifting their positions;
equal lengths need no padding), two completions of each a step, fixed token lists different at every step (finished
ones end with `<|im_end|>`, truncated ones are max_new_tokens long without it): TRL's generation is replaced by a
subclass's `_generate` returning them (the first completions of the batch's prompts, then the second ones, as TRL
orders its two samples), shardlm reads them from `rl.completions`. The reward: `answer_and_length` below, with
`missing_eos_penalty` 0.5 on the truncated ones; beta 0.1; fp32, AdamW (eps 1e-8, no weight decay), a constant
learning rate, clipping at 1.0. shardlm packs each pair into one row (`sft.packing = "pad"`).

- Each of 3 steps' loss, chosen and rejected rewards (beta x the policy's log-ratio to the reference), their margin
  and accuracy, and TRL's `objective/scores_margin` agree within 1e-5 (absolute below 1, else relative), the first
  gradient norm too; the chosen completion is the better-rewarded one (a tie: the first), as TRL picks it. Both of
  TRL's loss types: DPO's sigmoid and its online IPO (on the summed log-ratios).
- The same run at DP=2, PP=2, CP=2 and TP=2 with SP equals one process within 1e-5 (losses, gradient norms, the
  rewards, margin, accuracy); a LoRA run (the reference its base, adapters off) trains.
"""

from __future__ import annotations

import json

import pytest
import torch
from llama_reference import tiny_qwen3_policy

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")
transformers = import_or_skip("transformers")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.rl.prompts import round_prompts  # noqa: E402
from shardlm.sft.template import ChatTemplate  # noqa: E402
from shardlm.training.run import train  # noqa: E402

STEPS, MAX_NEW, SEQ, LR, BETA, PENALTY, SEED, TOL = 3, 8, 64, 1e-3, 0.1, 0.5, 0, 1e-5
PROMPTS = [{"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"},
           {"prompt": [{"role": "user", "content": "What is 6 + 1?"}], "answer": "7"}]
# each prompt's completions, step by step: (text, finished); step s takes the pair at 2s
POOLS = [[("7", True), ("It is 8", True), ("The sum of three and four is seven, I think", False), ("3 + 4 = 7", True),
          ("7.", True), ("Seven, since four after three makes seven in all", False)],
         [("It is 5", True), ("7", True), ("6 + 1 = 7", True), ("Adding one to six gives seven as the answer", False),
          ("Seven", True), ("It is 7", True)]]


def answer_and_length(prompts, completions, answer, **kwargs) -> list[float]:
    """1 where the completion holds its record's answer, plus 0.1 per space."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a in t) + 0.1 * t.count(" ") for t, a in zip(texts, answer)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("online_dpo")
    tiny_qwen3_policy(root / "hf", data_dir, SEQ, hidden=32, head_dim=8)
    template = ChatTemplate.from_dir(root / "hf")
    eos = template.tokenizer.token_to_id("<|im_end|>")
    ids = [template.encode(template.render(p["prompt"], add_generation_prompt=True)) for p in PROMPTS]
    assert len(ids[0]) == len(ids[1])  # no left padding on TRL's side

    def tokens(text: str, finished: bool) -> list[int]:
        encoded = template.encode(text)
        if finished:
            assert len(encoded) < MAX_NEW, text
            return encoded + [eos]
        assert len(encoded) > MAX_NEW, text
        return encoded[:MAX_NEW]

    steps = [[[tokens(*pool[2 * s + k]) for k in range(2)] for pool in POOLS] for s in range(STEPS)]
    lines = []
    for s in range(STEPS):
        owners = round_prompts(len(PROMPTS), len(PROMPTS), s, SEED, False)
        lines += [json.dumps({"step": s, "sequence": j, "ids": steps[s][owners[j // 2]][j % 2]})
                  for j in range(2 * len(PROMPTS))]
    (root / "completions.jsonl").write_text("\n".join(lines) + "\n")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {"root": root, "hf": root / "hf", "steps": steps, "ids": ids, "eos": eos}


def trl_steps(setup, loss_type: str = "sigmoid") -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(setup["hf"])
    by_prompt = {tuple(ids): i for i, ids in enumerate(setup["ids"])}

    class Fixed(OnlineDPOTrainer):
        step_done = 0
        losses: list = []  # each step's loss unrounded (TRL logs it rounded to 4 digits)

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss.item())
            return loss

        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

        def _generate(self, model, prompts, images=None):
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
            prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            chosen = [by_prompt[tuple(ids)] for ids in prompt_ids]
            completions = [setup["steps"][self.step_done][i][k] for k in range(2) for i in chosen]
            self.step_done += 1
            width = max(len(c) for c in completions)
            completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in completions])
            completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
            prompt_ids = torch.tensor(prompt_ids).repeat(2, 1)
            return prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, None

    args = OnlineDPOConfig(output_dir=str(setup["root"] / "trl"), per_device_train_batch_size=len(PROMPTS),
                           loss_type=loss_type,
                           max_new_tokens=MAX_NEW, beta=BETA, missing_eos_penalty=PENALTY, max_steps=STEPS,
                           learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                           adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1,
                           report_to=[], save_strategy="no", use_cpu=True, seed=SEED, dataloader_num_workers=0,
                           disable_tqdm=True, bf16=False)
    model = AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    with uncached_datasets():
        trainer = Fixed(model=model, reward_funcs=[answer_and_length], args=args, processing_class=tokenizer,
                        train_dataset=datasets.Dataset.from_list(PROMPTS))
        trainer.train()
    assert trainer.step_done == STEPS
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [round(loss, 4) for loss in trainer.losses] == [log["loss"] for log in logs]
    return [log | {"loss": loss} for log, loss in zip(logs, trainer.losses)]


def shardlm_overrides(setup) -> list[str]:
    return [f"checkpoint.init_from={setup['hf']}", "checkpoint.save=false",
            f"sft.data=[\"{setup['root'] / 'prompts.jsonl'}\"]", "sft.shuffle=false", "sft.packing=\"pad\"",
            'rl.loss="online_dpo"', f"rl.beta={BETA}", "rl.num_generations=2", f"rl.prompts_per_step={len(PROMPTS)}",
            f"rl.max_completion_length={MAX_NEW}", f"rl.missing_eos_penalty={PENALTY}",
            f"rl.completions=\"{setup['root'] / 'completions.jsonl'}\"",
            'rl.rewards=["test_online_dpo:answer_and_length"]',
            f"model.seq_length={SEQ}", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"train.steps={STEPS}", f"train.seed={SEED}", f"train.lr={LR}", f"train.min_lr={LR}",
            "train.decay_style=\"constant\"", "train.warmup_steps=0", "train.weight_decay=0.0",
            "train.adam_beta2=0.999",
            "train.adam_eps=1e-8", "train.clip_grad=1.0", "train.device=\"cpu\"", "train.precision=\"fp32\"",
            "log.interval=1", "log.progress=false", "log.plot=false", "log.tensorboard=false"]


def shardlm_steps(setup, name: str, *extra: str) -> list[dict]:
    run_dir = setup["root"] / name
    train(load_config(None, shardlm_overrides(setup) + list(extra)), run_dir=run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"val_loss"' not in line]


PAIRS = {"loss": "loss", "rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected",
         "reward_margin": "rewards/margins", "reward_accuracy": "rewards/accuracies",
         "objective/scores_margin": "objective/scores_margin"}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_online_dpo_follows_trl_step_by_step(setup, loss_type):
    theirs, ours = trl_steps(setup, loss_type), shardlm_steps(setup, loss_type, f'rl.dpo_loss_type="{loss_type}"')
    assert len(theirs) == len(ours) == STEPS
    for step, (t, o) in enumerate(zip(theirs, ours), start=1):
        for mine, trls in PAIRS.items():
            gap = abs(o[mine] - t[trls]) / max(1.0, abs(t[trls]))
            assert gap <= TOL, (step, mine, o[mine], t[trls])
    assert abs(ours[0]["grad_norm"] - theirs[0]["grad_norm"]) <= TOL * theirs[0]["grad_norm"]
    assert abs(ours[1]["rewards_chosen"]) > 100 * TOL  # the policy left its reference: the rewards move
    assert any(o["objective/scores_margin"] > 0 for o in ours)
