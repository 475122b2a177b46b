"""Reward modeling (`docs/reward-model.md`): a decoder LM with a scalar score head (`head`) trained on preference
pairs with the Bradley-Terry loss (`loss`), as TRL's RewardTrainer; in full or with LoRA adapters (the head then
trained whole beside them, as peft's SEQ_CLS task does); exported as Hugging Face's `XForSequenceClassification` (or a
peft adapter of task SEQ_CLS). The pairs are the preference runs' (`shardlm.preference.dataset`)."""

from __future__ import annotations

LOSSES = ("bradley_terry",)


def check_reward(config) -> str | None:
    """A one-line problem with a run's [reward] settings, or None."""
    r, m = config.reward, config.model
    checks = [
        (r.loss in LOSSES, f'reward.loss="{r.loss}" must be "bradley_terry" (or empty: no reward-model run)'),
        (r.center_rewards_coefficient >= 0,
         f"reward.center_rewards_coefficient={r.center_rewards_coefficient} must be >= 0 (0: off)"),
        (bool(config.sft.data), "a reward model trains on the preference records of sft.data; set sft.data"),
        (not (config.preference.loss or config.rl.loss or config.distill.teacher),
         "reward, preference, rl and distill are different losses; set one of reward.loss, preference.loss, "
         "rl.loss, [distill].teacher"),
        (m.arch in ("gpt", "llama"), f"a reward model is a decoder with a score head (model.arch gpt or llama), not "
                                     f"{m.arch}"),
        (not m.mtp_layers, "a reward model scores sequences, it predicts no tokens; set model.mtp_layers=0"),
        (config.sft.loss_type == "nll", 'sft.loss_type is the SFT loss; a reward run has its own: leave it "nll"'),
    ]
    return next((message for ok, message in checks if not ok), None)
