"""Bad RL settings and inputs stop the run with one line naming the problem and the fix, before any work (nothing
written); a reward function that fails mid-run stops every rank with one line naming it, the checkpoints kept."""

from __future__ import annotations

import json

import pytest

from shardlm.cli import main

FAILS_AT_ROUND_2 = "test_rl_errors:fails_at_round_2"
CALLS = {"n": 0}


def fails_at_round_2(prompts, completions, **columns):
    CALLS["n"] += 1
    if CALLS["n"] == 2:
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(completions)


def wrong_count(prompts, completions, **columns):
    return [0.0]


@pytest.fixture()
def config(data_dir, tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text(f"""
[model]
arch = "llama"
num_layers = 1
hidden_size = 32
num_heads = 4
seq_length = 48
[sft]
tokenizer = "{data_dir / 'chat' / 'qwen3'}"
[rl]
loss = "dapo"
task = "arithmetic"
task_size = 8
num_generations = 2
max_completion_length = 3
[train]
micro_batch_size = 2
global_batch_size = 2
steps = 2
precision = "fp32"
[checkpoint]
save_interval = 1
[log]
plot = false
progress = false
""")
    return path


PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
"""A chat template that renders no tool calls."""


def write(root, name: str, text: str) -> str:
    (root / name).write_text(text)
    return str(root / name)


ERRORS = [
    ("one completion a prompt", lambda r: ["rl.num_generations=1"], "rl.num_generations=1 must be at least 2"),
    ("epsilon", lambda r: ["rl.epsilon=0.0"], "rl.epsilon=0.0 must be > 0"),
    ("a2po with groups", lambda r: ['rl.loss="a2po"'], 'rl.loss="a2po" samples one completion a prompt a step'),
    ("a2po with a KL", lambda r: ['rl.loss="a2po"', "rl.num_generations=1", "rl.beta=0.1"],
     'rl.loss="a2po" regresses beta2 x the log-ratio to the reference onto reward - V*'),
    ("a2po without beta2", lambda r: ['rl.loss="a2po"', "rl.num_generations=1", "rl.beta2=0"],
     "rl.beta1=0.5 and rl.beta2=0.0 must be > 0"),
    ("unknown loss", lambda r: ['rl.loss="ppo"'],
     'rl.loss="ppo" must be one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo, rloo'),
    ("iterations", lambda r: ["rl.num_iterations=0"], "rl.num_iterations=0 must be at least 1"),
    ("a round that is not whole steps", lambda r: ["rl.generation_batch_size=3"],
     "rl.generation_batch_size=3 must be a multiple of one step's 2 completions (rl.prompts_per_step=1 x "
     "rl.num_generations=2); 0: one step's"),
    ("a round larger than the task", lambda r: ["rl.generation_batch_size=32"],
     "rl.task_size=8 is below one generation round's 16 prompts"),
    ("a synced reference without a KL", lambda r: ["rl.sync_ref_model=true"],
     "rl.sync_ref_model updates the KL's reference, which rl.beta=0 leaves unused"),
    ("a synced reference under LoRA", lambda r: ["rl.sync_ref_model=true", "rl.beta=0.1", "lora.rank=4"],
     "a LoRA run's reference is its base (adapters off)"),
    ("a mixup above 1", lambda r: ["rl.ref_model_mixup_alpha=1.5"], "rl.ref_model_mixup_alpha=1.5 must be in [0, 1]"),
    ("held-out prompts under fixed completions", lambda r: ["rl.eval_prompts=2", 'rl.completions="c.jsonl"'],
     "rl.eval_prompts samples completions of the held-out prompts; rl.completions fixes the training ones"),
    ("a task held out whole", lambda r: ["rl.eval_prompts=8"],
     "rl.task_size=8 is below one generation round's 1 prompts and rl.eval_prompts=8 held out"),
    ("gmpo with GSPO's ratio", lambda r: ['rl.loss="gmpo"', 'rl.importance_sampling="sequence"'],
     'rl.loss="gmpo" is its own sequence weight (a geometric mean of clipped token ratios'),
    ("online dpo with four completions", lambda r: ['rl.loss="online_dpo"', "rl.num_generations=4"],
     'rl.loss="online_dpo" pairs two completions of each prompt in one step against the reference: set '
     "rl.num_generations=2 and rl.beta > 0"),
    ("online dpo with a clip", lambda r: ['rl.loss="online_dpo"', "rl.num_generations=2", "rl.beta=0.1",
                                         "rl.mask_truncated_completions=true"],
     'rl.loss="online_dpo" is DPO on the pairs, with no advantage, ratio or entropy term'),
    ("an online loss type under GRPO", lambda r: ['rl.dpo_loss_type="ipo"'],
     'rl.dpo_loss_type="ipo" must be "sigmoid" or "ipo", and is rl.loss="online_dpo"\'s'),
    ("an eos penalty under GRPO", lambda r: ["rl.missing_eos_penalty=1.0"],
     'rl.missing_eos_penalty=1.0 must be >= 0 and is rl.loss="online_dpo"\'s'),
    ("rloo with scaled rewards", lambda r: ['rl.loss="rloo"', 'rl.scale_rewards="batch"'],
     "leave rl.scale_rewards and rl.multi_objective_aggregation at their defaults"),
    ("a reward clip the wrong way round", lambda r: ['rl.loss="rloo"', "rl.reward_clip_range=[1.0, 0.0]"],
     "rl.reward_clip_range=[1.0, 0.0] must be [low, high] with low <= high (empty: none)"),
    ("rloo's options under GRPO", lambda r: ["rl.normalize_advantages=true"],
     'rl.normalize_advantages and rl.reward_clip_range are rl.loss="rloo"\'s'),
    ("scale", lambda r: ['rl.scale_rewards="mean"'], 'rl.scale_rewards="mean" must be one of group, batch, none'),
    ("GSPO with a token loss", lambda r: ['rl.importance_sampling="sequence"'],
     'rl.importance_sampling="sequence" (GSPO) takes rl.loss "grpo", "luspo" or "sapo", not "dapo"'),
    ("GSPO with VESPO", lambda r: ['rl.importance_sampling="sequence"', 'rl.loss="vespo"'],
     'weighs the sequence\'s ratio itself; keep "token"'),
    ("a cap inside the clip", lambda r: ["rl.delta=1.1", "rl.epsilon_high=0.28"],
     "rl.delta=1.1 must exceed the upper clip 1 + epsilon_high = 1.28 (0: off)"),
    ("a cap without a clip", lambda r: ["rl.delta=4.0", 'rl.loss="cispo"'],
     'rl.loss="cispo" has none: set rl.delta=0'),
    ("a gate at temperature 0", lambda r: ['rl.loss="sapo"', "rl.sapo_temperature_neg=0.0"],
     "rl.sapo_temperature_pos and rl.sapo_temperature_neg must be > 0"),
    ("a negative power", lambda r: ['rl.loss="vespo"', "rl.vespo_k_neg=-1.0"], "vespo_lambda_neg must be >= 0"),
    ("a quantile above 1", lambda r: ["rl.top_entropy_quantile=1.5"],
     "rl.top_entropy_quantile=1.5 must be in [0, 1] (1: every token)"),
    ("an unknown aggregation", lambda r: ['rl.multi_objective_aggregation="mean"'],
     'rl.multi_objective_aggregation="mean" must be "sum_then_normalize" or "normalize_then_sum"'),
    ("GDPO with batch scaling", lambda r: ['rl.multi_objective_aggregation="normalize_then_sum"',
                                           'rl.scale_rewards="batch"'], 'rl.scale_rewards does not apply'),
    ("a negative mask threshold", lambda r: ["rl.off_policy_mask_threshold=-0.5"],
     "rl.off_policy_mask_threshold=-0.5 must be >= 0 (0: off)"),
    ("a min-p above 1", lambda r: ["rl.min_p=1.5"], "rl.min_p=1.5 must be in [0, 1] (0 disables it)"),
    ("a repetition penalty of 0", lambda r: ["rl.repetition_penalty=0"],
     "rl.repetition_penalty=0.0 must be > 0 (1 disables it)"),
    ("a negative entropy coefficient", lambda r: ["rl.entropy_coef=-0.1"],
     "rl.entropy_coef=-0.1 must be >= 0 (0: no entropy bonus)"),
    ("adaptive bounds the wrong way round", lambda r: ["rl.use_adaptive_entropy=true", "rl.entropy_coef_min=0.5",
                                                        "rl.entropy_coef_max=0.1"],
     "rl.entropy_coef_min=0.5 and rl.entropy_coef_max=0.1 must satisfy 0 <= min <= max"),
    ("an adaptive step of 0", lambda r: ["rl.use_adaptive_entropy=true", "rl.entropy_coef_delta=0"],
     "rl.entropy_coef_delta=0.0 must be > 0 under rl.use_adaptive_entropy"),
    ("a negative entropy target", lambda r: ["rl.entropy_target=-1"],
     "rl.entropy_target=-1.0 must be >= 0 (nats)"),
    ("reward that does not import", lambda r: ['rl.rewards=["no_such_module:score"]'], '"no_such_module:score"'),
    ("tools with online dpo", lambda r: ['rl.loss="online_dpo"', "rl.num_generations=2", "rl.beta=0.1",
                                        'rl.tools=["test_rl_tools:add"]'],
     'rl.tools and rl.environment run multi-turn rollouts for the policy-gradient losses; rl.loss="online_dpo" '
     "takes single replies"),
    ("a negative tool iteration limit", lambda r: ["rl.max_tool_calling_iterations=-1"],
     "rl.max_tool_calling_iterations=-1 must be >= 0 (0: no limit)"),
    ("a tool that does not import", lambda r: ['rl.tools=["no_such_module:add"]'],
     'rl.tools: "no_such_module:add" does not import'),
    ("a tool without a docstring", lambda r: ['rl.tools=["test_rl_tools:undocumented"]'],
     'rl.tools: "test_rl_tools:undocumented" has no JSON schema'),
    ("two tools of one name", lambda r: ['rl.tools=["test_rl_tools:add", "test_rl_tools:add"]'],
     "are both called 'add'"),
    ("tools with text prompts", lambda r: ['rl.task=""', 'rl.tools=["test_rl_tools:add"]',
                                           f'sft.data=["{write(r, "p.jsonl", json.dumps({"prompt": "2+2="}))}"]'],
     "p.jsonl:1: rl.tools and rl.environment need conversational prompts"),
    ("an environment with text prompts",
     lambda r: ['rl.task=""', 'rl.environment="test_rl_tools:Bare"',
                f'sft.data=["{write(r, "p.jsonl", json.dumps({"prompt": "2+"}))}"]'],
     "p.jsonl:1: rl.tools and rl.environment need conversational prompts"),
    ("an environment without reset", lambda r: ['rl.environment="test_rl_tools:NoReset"'],
     'rl.environment: "test_rl_tools:NoReset" has no reset method'),
    ("an environment that is a function", lambda r: ['rl.environment="test_rl_tools:add"'],
     'rl.environment: "test_rl_tools:add" is not a class'),
    ("tools with a template that cannot call them", lambda r: ['rl.tools=["test_rl_tools:add"]',
                                                               f'sft.template="{write(r, "t.jinja", PLAIN)}"'],
     "cannot render a tool call and its result"),
    ("weights", lambda r: ["rl.reward_weights=[1.0, 2.0]"], "rl.reward_weights has 2 weights for 1 reward"),
    ("prompts and a task", lambda r: [f'sft.data=["{write(r, "p.jsonl", "{}")}"]'], "set exactly one"),
    ("record without a prompt", lambda r: ['rl.task=""', f'sft.data=["{write(r, "p.jsonl", json.dumps({"q": 1}))}"]'],
     "p.jsonl:1: the record has no 'prompt'"),
]


@pytest.mark.parametrize("name,extra,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_rl_errors_are_one_line(config, tmp_path, capsys, name, extra, message):
    workdir = tmp_path / "case"
    workdir.mkdir()
    code = main(["train", str(config), *extra(workdir), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists(), "nothing is written before the input is checked"


@pytest.mark.parametrize("reward,message", [
    (FAILS_AT_ROUND_2, f'reward "{FAILS_AT_ROUND_2}" raised ZeroDivisionError: division by zero'),
    ("test_rl_errors:wrong_count", 'returned 1 values for 2 completions')])
def test_a_failing_reward_stops_the_run_in_one_line_and_keeps_the_checkpoints(config, tmp_path, capsys, reward,
                                                                              message):
    CALLS["n"] = 0
    code = main(["train", str(config), f'rl.rewards=["{reward}"]', "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == (["step_00000001"] if reward == FAILS_AT_ROUND_2 else []), saved


def test_prompts_from_a_saved_dataset_folder(config, tmp_path):
    """Prompt records read from the folder `datasets.Dataset.save_to_disk` wrote (its Arrow files), columns kept; a
    saved DatasetDict is refused in one line naming a split's folder."""
    datasets = pytest.importorskip("datasets")
    from shardlm.config import load_config
    from shardlm.errors import UserError
    from shardlm.rl.setup import load_rl_inputs

    records = [{"prompt": "Compute 2 + 3.", "answer": "5"}, {"prompt": [{"role": "user", "content": "Hi?"}],
                                                            "answer": "1"}]
    datasets.Dataset.from_list(records[:1]).save_to_disk(str(tmp_path / "saved"))
    inputs = load_rl_inputs(load_config(config, ['rl.task=""', f'sft.data=["{tmp_path / "saved"}"]']))
    assert [(p.prompt, p.columns) for p in inputs.prompts] == [("Compute 2 + 3.", {"answer": "5"})]
    assert inputs.prompts[0].ids == inputs.template.encode("Compute 2 + 3.")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records[:1])}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(UserError, match="give one split's folder"):
        load_rl_inputs(load_config(config, ['rl.task=""', f'sft.data=["{tmp_path / "dict"}"]']))
