"""An RL run under context parallelism from the command line: `shardlm train` at CP=2 on two processes (the
arithmetic task's prompts, completions sampled by the policy: each CP rank samples its share of whole sequences, and
the training forward splits the packed rows over both) logs one process's run, step by step."""

from __future__ import annotations

import json

from test_rl_errors import config  # noqa: F401 - the tiny arithmetic run's config file (a fixture)

from shardlm.cli import main

REWARD = """
def by_ids(prompts, completions, completion_ids, **columns):
    return [(sum(ids) % 7) / 6 for ids in completion_ids]
"""
"""A reward that varies among a random model's completions (its arithmetic is never right), so the advantages and
the updates are not 0."""
COLUMNS = ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean",
           "completions/mean_length")


def logged(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def held_out(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"val_reward"' in x]


def test_context_parallel_rl_run_equals_one_process(config, tmp_path, capfd):  # noqa: F811 - the fixture
    """4 steps of 2 rounds (num_iterations 2: the old log-probabilities from a scoring pass at the layout; beta 0.04:
    the reference's), 4 completions of one prompt a round: loss, gradient norm, reward, KL, entropy, clip ratio and
    completion length within 1e-5 of one process; so are the rewards and lengths of 3 completions of each of 2
    held-out prompts (rl.eval_prompts), sampled at steps 2 and 4. The config keeps the model's default dropout
    (attention dropout 0.1, which context parallelism refuses): the launcher checks the run as it will train, with
    rl.disable_dropout's zeros."""
    (tmp_path / "reward.py").write_text(REWARD)
    # (the model's default dropout: the run turns it off before the checks)
    settings = ["train.steps=4", "checkpoint.save_interval=0",
                f'rl.rewards=["{tmp_path / "reward.py"}:by_ids"]', "rl.num_generations=4", "rl.num_iterations=2",
                "rl.beta=0.04", "train.global_batch_size=4", "train.lr=1e-2", "log.interval=1",
                "rl.eval_prompts=2", "rl.num_generations_eval=3", "train.eval_interval=2"]
    assert main(["train", str(config), *settings, "--run-dir", str(tmp_path / "one")]) == 0
    assert main(["train", str(config), *settings, "parallel.context=2", "--nproc-per-node", "2",
                 "--run-dir", str(tmp_path / "cp2")]) == 0
    out = capfd.readouterr().out
    assert "CP=2 (ring)" in out, out
    one, cp2 = logged(tmp_path / "one"), logged(tmp_path / "cp2")
    assert len(one) == len(cp2) == 4, (one, cp2)
    assert one[0]["reward_std"] > 0 and one[0]["grad_norm"] > 0 and one[1]["kl"] > 0, one
    for step, (a, b) in enumerate(zip(one, cp2)):
        for key in COLUMNS:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (step, key, a[key], b[key])
    # the held-out prompts' completions, sampled at steps 2 and 4 (each CP rank its share), scored alike
    one, cp2 = held_out(tmp_path / "one"), held_out(tmp_path / "cp2")
    assert [r["step"] for r in one] == [r["step"] for r in cp2] == [2, 4], (one, cp2)
    assert one[0]["val_reward_std"] > 0 and one[0] != one[1], one  # varied rewards; the policy moved in between
    for a, b in zip(one, cp2):
        for key in ("val_reward", "val_reward_std", "val_completions/mean_length", "val_completions/clipped_ratio"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a, b)
    assert "validation at step 2: held-out reward" in out, out
