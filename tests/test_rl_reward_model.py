"""A trained reward model as an RL reward (`rl.rewards = ["model:PATH"]`, `shardlm.rl.reward_model`): its scores equal
TRL's way of computing them at one process, and every layout's equal one process's.

The reward model: a random two-layer `Qwen3ForSequenceClassification` (one label, every norm weight spread from 1.0)
with the real Qwen3 vocabulary, saved beside the shared Qwen3 tokenizer (pad token `<|endoftext|>`). The sequences: 7
completions of conversational prompts (a system turn in some) and 2 of text prompts, of different lengths, so the
padded batch and an odd share per rank are exercised.

- one process: each score equals TRL's lines written out with transformers (`GRPOTrainer._calculate_rewards`:
  conversational prompt + completion through `apply_chat_template`, text ones joined, the batch tokenized without
  special tokens and padded on the right, `logits[:, 0]`) within 1e-5;
- world 2: DP=2, TP=2, TP=2 with SP, CP=2, PP=2, FSDP DP=2: every rank's scores equal one process's within 1e-5, in
  the sequences' order (PP x FSDP runs the stage-by-stage forward a distillation teacher's seq_kd sampling runs
  there, `tests/test_distill_layouts.py`);
- a language model named as a reward model, or a missing path, is a one-line error.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from llama_reference import tiny_qwen3_reward_model

from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.rl.reward_model import RewardModelScorer, open_reward_model

from layouts import layout, layout_config, layout_context, spawn_layouts, tiny_model

TOL = 1e-5
PROMPTS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 6 x 7?"}],
    [{"role": "user", "content": "Name a colour."}],
]
ANSWERS = ["7", "The answer is 7.", "42", "Six times seven is forty two", "blue", "It is a shade of the sky", "red"]
TEXTS = [("Question: 9 - 5 = ", "4"), ("The capital of France is", " Paris, a city on the Seine.")]


def sequences() -> tuple[list, list]:
    """(prompts, completions) of the 9 sequences: 7 conversational, 2 text."""
    prompts = [PROMPTS[i * len(PROMPTS) // len(ANSWERS)] for i in range(len(ANSWERS))] + [p for p, _ in TEXTS]
    completions = [[{"role": "assistant", "content": a}] for a in ANSWERS] + [c for _, c in TEXTS]
    return prompts, completions


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, data_dir):
    return tiny_qwen3_reward_model(tmp_path_factory.mktemp("rl_reward_model") / "rm", data_dir, 128, head_std=1.0)


def scorer_of(ctx, path: str, **layout_options) -> RewardModelScorer:
    """The scorer of a run at `layout_options` (its model section only sets the sequence length the reward model
    is built with; its [parallel] and [train] sections place it)."""
    config = layout_config(tiny_model("llama", 128, layers=2), micro=1, **layout_options)
    trainer = SimpleNamespace(config=config, ctx=ctx, autocast=contextlib.nullcontext)
    return RewardModelScorer(path, trainer)


def score_layout(tp: int, pp: int, cp: int, ep: int, path: str = "", **options) -> list[float]:
    return scorer_of(layout_context(tp, pp, cp, ep), path, tp=tp, pp=pp, cp=cp, **options)(*sequences()).tolist()


@pytest.fixture(scope="module")
def one_process(reward_dir):
    return scorer_of(ParallelContext.single(), str(reward_dir))(*sequences())


def test_the_scores_are_trls(reward_dir, one_process):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32).eval()
    prompts, completions = sequences()
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) if isinstance(p, list) else p + c
             for p, c in zip(prompts, completions)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        theirs = model(**inputs).logits[:, 0].double().numpy()
    assert np.allclose(one_process, theirs, rtol=TOL, atol=TOL), (one_process, theirs)
    assert np.std(theirs) > 0.05  # the sequences score differently


WORLD2 = {"dp2": layout(), "tp2": layout(tp=2), "tp2 sp": layout(tp=2, sp=True), "cp2": layout(cp=2),
          "pp2": layout(pp=2), "fsdp dp2": layout(data_sharding="full")}


@pytest.fixture(scope="module")
def worlds(reward_dir):
    path = str(reward_dir)
    return {2: spawn_layouts(2, score_layout, {k: v | {"path": path} for k, v in WORLD2.items()})}


@pytest.mark.parametrize("world, name", [(2, n) for n in WORLD2])
def test_every_layout_scores_as_one_process(worlds, one_process, world, name):
    def same(value, ref, where):
        assert np.allclose(value, ref, rtol=TOL, atol=TOL), (where, value, ref)
    for rank, value in enumerate(worlds[world]):
        status, scores = value[name]
        assert status == "ok", scores
        same(scores, one_process.tolist(), f"{name} rank {rank}")


def test_a_language_model_or_a_missing_path_is_refused(tmp_path, data_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="is a language model, not a reward model"):
        open_reward_model(str(tmp_path))
    with pytest.raises(UserError, match=r'rl.rewards "model:/nowhere": /nowhere does not exist'):
        open_reward_model("/nowhere")
