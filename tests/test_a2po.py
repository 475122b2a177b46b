"""A*-PO (`rl.loss = "a2po"`) against TRL 1.16's experimental `A2POTrainer`, step by step.

The fixture of `test_rl_trl` (a random two-layer Qwen3 over the real vocabulary and chat template, 2 conversational
arithmetic prompts, the `length_and_answer` reward): stage 1 samples N = 3 completions of each prompt from the
starting policy, stage 2 one completion of each prompt a step for 2 steps. Both trainers get the same fixed
completions (finished ones end with `<|im_end|>`, truncated ones are 8 tokens without it): shardlm reads them from
`rl.completions` (stage 1's as step -1), TRL's `generate` of the reference and of the policy is replaced by one that
answers each prompt, found by its ids, with them. One prompt a micro-batch, two a step on both sides, in the records'
order; both sample at temperature 0.9, which shapes the sampling only (the loss's log-probabilities are the raw
logits' on both sides).

Each step's loss, gradient norm, reward, V* and advantage (means over the step's sequences) and implicit reward agree
within TOL (absolute below 1, relative above; measured in the test's docstring).
"""

from __future__ import annotations

import json

import pytest
import test_rl_trl
import torch
from chat_cache import template_parsed_once  # noqa: F401 (parses the chat template once per module)
from test_rl_trl import (
    ADAM_EPS,
    LR,
    MAX_COMPLETION,
    POOLS,
    PROMPTS,
    SEED,
    SEQ,
    TEMPERATURE,
    TOL,
    length_and_answer,
    same_training,
)

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.rl.a2po import optimal_values  # noqa: E402
from shardlm.training.run import train  # noqa: E402

setup = test_rl_trl.setup  # the fixture: the tiny Qwen3 directory, the prompts, TRL's tokenizer
N, STEPS, BETA1, BETA2 = 3, 2, 0.5, 0.05
KEYS = ("loss", "grad_norm", "reward", "v_star", "advantage", "implicit_reward")


def completion_ids(setup, text: str, finished: bool) -> list[int]:
    from shardlm.sft.template import ChatTemplate

    template = ChatTemplate.from_dir(setup["hf"])
    ids = template.encode(text)
    return ids + [template.tokenizer.token_to_id("<|im_end|>")] if finished else ids[:MAX_COMPLETION]


@pytest.fixture(scope="module")
def a2po(setup):
    """The fixed completions: "values" [prompt][k] stage 1's, "rounds" [step][prompt] stage 2's (from the pools of
    `test_rl_trl`), and shardlm's `rl.completions` file of both."""
    values = [[completion_ids(setup, *pool[k]) for k in range(N)] for pool in POOLS[:len(PROMPTS)]]
    rounds = [[completion_ids(setup, *pool[N + s]) for pool in POOLS[:len(PROMPTS)]] for s in range(STEPS)]
    lines = [{"step": -1, "sequence": i * N + k, "ids": ids} for i, samples in enumerate(values)
             for k, ids in enumerate(samples)]
    lines += [{"step": s, "sequence": i, "ids": ids} for s, step in enumerate(rounds) for i, ids in enumerate(step)]
    path = setup["root"] / "a2po_completions.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {"values": values, "rounds": rounds, "file": path}


def trl_a2po(setup, a2po, beta2: float) -> list[dict]:
    """`A2POTrainer`'s logged steps with the fixed completions, in the records' order."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.a2po import A2POConfig, A2POTrainer

    prompt_index = {tuple(ids): i for i, ids in enumerate(setup["ids"])}
    pad = setup["tokenizer"].pad_token_id
    served = [0] * len(PROMPTS)

    def answer(samples_of):
        def generate(input_ids, attention_mask, generation_config, **_):
            assert input_ids.shape[0] == 1 and attention_mask.all(), "one prompt a call, unpadded"
            samples = samples_of(prompt_index[tuple(input_ids[0].tolist())])
            width = max(map(len, samples))
            tails = torch.tensor([ids + [pad] * (width - len(ids)) for ids in samples])
            return torch.cat([input_ids.expand(len(samples), -1), tails], dim=1)
        return generate

    def next_round(i):
        served[i] += 1
        return [a2po["rounds"][served[i] - 1][i]]

    class InOrder(A2POTrainer):
        def _get_train_sampler(self, dataset=None):
            return torch.utils.data.SequentialSampler(dataset if dataset is not None else self.train_dataset)

    args = A2POConfig(output_dir=str(setup["root"] / f"trl_a2po_{beta2}"), per_device_train_batch_size=1,
                      gradient_accumulation_steps=len(PROMPTS), max_steps=STEPS, learning_rate=LR,
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                      adam_beta2=0.999, adam_epsilon=ADAM_EPS, max_grad_norm=1.0, logging_steps=1, report_to=[],
                      save_strategy="no", use_cpu=True, seed=SEED, dataloader_num_workers=0, disable_tqdm=True,
                      bf16=False, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                      num_value_samples=N, beta1=BETA1, beta2=beta2)
    model = AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    with uncached_datasets():
        trainer = InOrder(model=model, reward_funcs=[length_and_answer], args=args,
                          train_dataset=datasets.Dataset.from_list(PROMPTS), processing_class=setup["tokenizer"])
        trainer.ref_model.generate = answer(lambda i: a2po["values"][i])
        trainer.model.generate = answer(next_round)
        trainer.train()
    assert served == [STEPS] * len(PROMPTS)
    return [log for log in trainer.state.log_history if "loss" in log]


def shardlm_a2po(setup, a2po, beta2: float) -> list[dict]:
    overrides = [f"checkpoint.init_from={setup['hf']}", "checkpoint.save=false", "sft.shuffle=false",
                 f"sft.data=[\"{setup['root'] / 'prompts.jsonl'}\"]", 'rl.loss="a2po"', "rl.num_generations=1",
                 f"rl.prompts_per_step={len(PROMPTS)}", f"rl.num_value_samples={N}", f"rl.beta1={BETA1}",
                 f"rl.beta2={beta2}", f"rl.temperature={TEMPERATURE}", f"rl.max_completion_length={MAX_COMPLETION}",
                 f"rl.completions=\"{a2po['file']}\"", 'rl.rewards=["test_rl_trl:length_and_answer"]',
                 f"model.seq_length={SEQ}", *same_training(STEPS, 1, len(PROMPTS))]
    run_dir = setup["root"] / f"shardlm_a2po_{beta2}"
    train(load_config(None, overrides), run_dir=run_dir)
    saved = json.loads((run_dir / "a2po_values.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line and '"val_loss"' not in line]
    return steps, saved


def differences(ours: list[dict], theirs: list[dict]) -> dict[str, float]:
    """The largest difference of each of KEYS over the steps: absolute below 1, relative above."""
    assert len(ours) == len(theirs) == STEPS, (ours, theirs)
    return {k: max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(ours, theirs)) for k in KEYS}


@pytest.mark.timeout(180)
def test_a2po_follows_trls_a2po_trainer(setup, a2po):
    """Stage 1's values are TRL's formula of the samples' rewards, the file keeps them; each step's figures agree
    within TOL (measured: at most 3.7e-7, a gradient norm). The control: beta2 doubled moves the loss by far more.
    Checked by hand: the log-probabilities of logits / 0.9 (the sampling temperature) move the first gradient norm by
    11%."""
    ours, saved = shardlm_a2po(setup, a2po, BETA2)
    theirs = trl_a2po(setup, a2po, BETA2)
    decode = setup["tokenizer"].decode
    rewards = [[length_and_answer(None, [decode(ids, skip_special_tokens=True)], [p["answer"]])[0] for ids in samples]
               for samples, p in zip(a2po["values"], PROMPTS)]
    assert saved["values"] == pytest.approx(optimal_values(torch.tensor(rewards).numpy(), BETA1).tolist(), abs=1e-6)
    assert saved["all_incorrect"] == [False, False]
    worst = differences(ours, theirs)
    assert all(value <= TOL for value in worst.values()), (worst, ours, theirs)
    assert all(abs(log["implicit_reward"]) > 0 for log in ours[1:]), ours  # the policy moved off the reference
    doubled = differences(shardlm_a2po(setup, a2po, 2 * BETA2)[0], theirs)
    assert doubled["loss"] > 100 * TOL, doubled


def by_length(prompts, completions, completion_ids, **columns) -> list[float]:
    """The resume check's reward: a tenth of the completion's length (a signal a random model's samples have)."""
    return [len(ids) / 10 for ids in completion_ids]


def resume_config(data_dir, steps: int):
    from test_rl_resume import rl_config

    config = rl_config(data_dir, steps)
    rl = config.rl
    rl.loss, rl.num_generations, rl.prompts_per_step, rl.beta, rl.sync_ref_model = "a2po", 1, 4, 0.0, False
    rl.generation_batch_size, rl.entropy_coef, rl.use_adaptive_entropy, rl.num_value_samples = 0, 0.0, False, 2
    rl.rewards, rl.log_completions = ["test_a2po:by_length"], False
    config.train.decay_steps = 3
    return config


@pytest.mark.timeout(180)
def test_a_resumed_a2po_run_reads_its_values_and_equals_the_straight_run(data_dir, tmp_path, capsys):
    """3 steps straight against 2 steps, then a restart to 3: the restart reads stage 1's values from the run
    directory (its weights are no longer the starting ones) and its step 3 equals the straight run's bitwise (the
    reference rebuilt from the starting weights, dropout on). Without the values file a restart stops in one line."""
    from test_rl_resume import metrics_of

    from shardlm.errors import UserError

    train(resume_config(data_dir, 3), tmp_path / "whole")
    train(resume_config(data_dir, 2), tmp_path / "resumed")
    capsys.readouterr()
    train(resume_config(data_dir, 3), tmp_path / "resumed")
    assert f"read from {tmp_path / 'resumed' / 'a2po_values.json'}" in capsys.readouterr().out
    whole, resumed = metrics_of(tmp_path / "whole"), metrics_of(tmp_path / "resumed")
    assert resumed[3] == whole[3] and whole[3]["implicit_reward"] != 0.0, (resumed[3], whole[3])
    (tmp_path / "resumed" / "a2po_values.json").unlink()
    with pytest.raises(UserError, match="needs the optimal values its start estimated"):
        train(resume_config(data_dir, 4), tmp_path / "resumed")

