"""A trained reward model as an RL run's reward (`rl.rewards = ["model:PATH"]`), scored at the training layout, as
TRL's GRPOTrainer scores a sequence-classification model among its reward functions.

PATH is a Hugging Face `XForSequenceClassification` directory with one label (what TRL's RewardTrainer saves) or a
shardlm reward model's checkpoint (`docs/reward-model.md`). Each completion is scored as TRL scores it: the text of
its prompt and completion, rendered with the reward model's own chat template (conversational prompts: the prompt's
messages and the completion as the assistant's turn, no generation prompt) or joined (text prompts), tokenized by the
reward model's tokenizer without special tokens, and the score head read at the last token.

At the layout (`shardlm.training.frozen.load_frozen`): the reward model's heads and vocabulary split over TP, its
experts over EP, its layers over the run's pipeline stages, under FSDP its tensors sharded over DP. The sequences
are shared out over the data x context-parallel ranks as the rollouts are (`sampling_share`): each rank scores its
share in one padded forward (context parallelism off: each CP rank runs its own whole sequences; sequence
parallelism off), through the stages in order under PP (the last stage's scores broadcast to the others); every
rank runs exactly one forward (a one-token forward where its share is empty), so the exchanges of EP and FSDP
meet; the scores are gathered back on every rank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardlm.errors import UserError

PREFIX = "model:"
"""How `rl.rewards` names a reward model: this, then its path."""


def open_reward_model(path: str):
    """`shardlm.checkpoint.init.open_source` of a reward model, checked: a one-line error when it is missing, has no
    score head (a language model) or no tokenizer."""
    from shardlm.checkpoint.init import open_source

    setting = f'rl.rewards "{PREFIX}{path}"'
    try:
        source = open_source(path)
    except UserError as error:
        raise UserError(str(error).replace(f"checkpoint.init_from={path}", f"{setting}: {path}")
                        .replace("checkpoint.init_from", setting)) from None
    if "model/score.weight" not in source.reader.keys():
        raise UserError(f"{setting}: {path} is a language model, not a reward model (no score head); train one "
                        "with [reward] or give a Hugging Face XForSequenceClassification directory")
    tokenizer_dir(source, setting)
    return source


def tokenizer_dir(source, setting: str) -> Path:
    """The reward model's tokenizer directory: a Hugging Face directory itself, a shardlm checkpoint's run's tokenizer
    (`sft.tokenizer`, else its `checkpoint.init_from`)."""
    if source.kind == "huggingface":
        folder = Path(source.path)
    else:
        config = source.config
        folder = Path(config.sft.tokenizer or config.checkpoint.init_from or ".")
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{setting}: no tokenizer.json for the reward model (looked in {folder})")
    return folder


class RewardModelScorer:
    """`scorer(prompts, completions) -> (N,) float64 scores` of the trainer's layout (module docstring), called by
    every rank with the same N prompts (strings or message lists) and completions (strings or
    `[{"role": "assistant", "content": text}]`)."""

    def __init__(self, path: str, trainer):
        from shardlm.rl.rollout import InProcessGenerator
        from shardlm.sft.template import ChatTemplate
        from shardlm.training.frozen import FrozenStages, load_frozen

        source = open_reward_model(path)
        self.path, self.trainer, self.ctx = path, trainer, trainer.ctx
        self.template = ChatTemplate.from_dir(tokenizer_dir(source, f'rl.rewards "{PREFIX}{path}"'))
        self.model = load_frozen(trainer.config, self.ctx, source, f'rl.rewards "{PREFIX}{path}"', score_head=True)
        self.stages = FrozenStages.of(self.model, self.ctx) if self.ctx.pp_size > 1 else None
        self.forward = InProcessGenerator(self.model, self.ctx, None, set(), pipeline=self.stages)._forward

    def text(self, prompt, completion) -> str:
        """The text the reward model reads (module docstring)."""
        if isinstance(prompt, list):
            return self.template.render(list(prompt) + list(completion))
        return prompt + completion

    def __call__(self, prompts: list, completions: list) -> np.ndarray:
        from shardlm.rl.rollout import context_parallel_off, gather_samples, sampling_share, sequence_parallel_off
        from shardlm.training.frozen import release

        share = sampling_share(len(prompts), self.ctx)
        ids = [self.template.encode(self.text(prompts[j], completions[j])) or [0] for j in share]
        width = max((len(i) for i in ids), default=1)
        tokens = torch.tensor([i + [0] * (width - len(i)) for i in ids] or [[0]], device=self.ctx.device)
        last = torch.tensor([len(i) - 1 for i in ids] or [0], device=self.ctx.device)
        scores = torch.zeros(len(tokens), dtype=torch.float64, device=self.ctx.device)
        with torch.no_grad(), context_parallel_off(self.ctx), sequence_parallel_off(self.model), \
                self.trainer.autocast():
            hidden = self.forward(tokens, None)
            if hidden is not None:  # the last stage (every rank without stages)
                scores = self.model.score(hidden[torch.arange(len(tokens), device=hidden.device), last]
                                          ).squeeze(-1).double()
        release(self.model)
        if self.stages is not None:
            scores = self.ctx.pp.broadcast(scores, self.stages.last_rank)
        return np.array(gather_samples(scores[:len(share)].tolist(), self.ctx), dtype=np.float64)
