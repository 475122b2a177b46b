"""An RL run stopped between steps resumes bitwise, and a SIGTERM while the rollouts are sampled saves the last
finished step with one line.

One process, the built-in arithmetic task with the real Qwen3 tokenizer and chat template, a tiny model, rollouts
sampled by the policy (4 prompts x 4 completions a round, split between its 2 optimizer steps:
rl.generation_batch_size 16; a KL reference, which TR-DPO's sync moves towards the policy after every step). Three
runs of the same 4-step schedule: uninterrupted; stopped after step 3 (in the middle of a round: the checkpoint
keeps the round's rows of both steps, whose old and reference log-probabilities came from weights it no longer
holds) and resumed; SIGTERMed during round 1's sampling (after step 2), which saves step 2 and exits 143, then
resumed. Every resumed step's metrics (loss, gradient norm, KL, reward, ...) and every final parameter equal the
uninterrupted run's bit for bit (the KL's reference comes back from the checkpoint: no longer the starting weights).
The run keeps dropout 0.1 on (`rl.disable_dropout = false`: the restored generators must draw the same masks) and
has an entropy bonus under Skywork-OR1's adaptive control, whose coefficient and last mean entropy the
checkpoint keeps, and logs its completions (`rl.log_completions`): each resumed run's completions.jsonl equals the
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from shardlm.checkpoint import latest_in, load_checkpoint
from shardlm.checkpoint.sharded import model_file
from shardlm.config import from_dict
from shardlm.rl.rollout import InProcessGenerator
from shardlm.signals import TERMINATED_EXIT_CODE
from shardlm.training.run import train

STEPS = 4


def rl_config(data_dir, steps: int):
    return from_dict({
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                  "head_dim": 8, "qk_norm": True, "ffn_hidden_size": 64, "seq_length": 64, "dropout": 0.1,
                  "init_std": 0.05},
        "sft": {"tokenizer": str(data_dir / "chat" / "qwen3")},
        "rl": {"loss": "dapo", "task": "arithmetic", "task_size": 16, "num_generations": 4, "prompts_per_step": 2,
               "max_completion_length": 6, "beta": 0.04, "generation_batch_size": 16, "temperature": 1.2,
               "sync_ref_model": True, "ref_model_sync_steps": 1,
               "entropy_coef": 0.01, "use_adaptive_entropy": True, "entropy_coef_delta": 0.02,
               "entropy_target": 100.0, "log_completions": True, "disable_dropout": False},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "steps": steps, "decay_steps": STEPS,
                  "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 0, "precision": "fp32", "seed": 3},
        "log": {"interval": 1, "plot": False, "progress": False},
    })


def metrics_of(run_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drop = ("step_time_s", "tokens_per_sec", "tflops", "tflops_per_device", "generation_s", "scoring_s")
    return {r["step"]: {k: v for k, v in r.items() if k not in drop} for r in records if "loss" in r}


def parameters(run_dir, data_dir) -> dict[str, torch.Tensor]:
    from shardlm.parallel import ParallelContext
    from shardlm.training.trainer import Trainer

    config = rl_config(data_dir, STEPS)
    config.model.vocab_size = json.loads((run_dir / "config.json").read_text())["model"]["vocab_size"]
    trainer = Trainer(config, ParallelContext.single(), None, None)
    load_checkpoint(trainer, latest_in(run_dir / "checkpoints"))
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def synced_reference(run_dir) -> dict[str, torch.Tensor]:
    """The KL's reference weights the run's last checkpoint keeps (rl.sync_ref_model)."""
    tensors = load_file(latest_in(run_dir / "checkpoints") / model_file(0))
    return {k: v for k, v in tensors.items() if k.startswith("reference/")}


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl-resume")
    train(rl_config(data_dir, STEPS), folder / "whole")
    train(rl_config(data_dir, 3), folder / "mid-round")
    train(rl_config(data_dir, STEPS), folder / "mid-round")
    forward, calls = InProcessGenerator._forward, {"n": 0}

    def sigterm_in_round_1(self, tokens, cache):
        calls["n"] += 1
        if calls["n"] == 8 + 3:  # round 0 takes 1 + 6 forwards at most; a few positions into round 1
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, tokens, cache)

    InProcessGenerator._forward = sigterm_in_round_1
    try:
        with pytest.raises(SystemExit) as stopped:
            train(rl_config(data_dir, STEPS), folder / "sigterm")
    finally:
        InProcessGenerator._forward = forward
    saved = latest_in(folder / "sigterm" / "checkpoints")
    train(rl_config(data_dir, STEPS), folder / "sigterm")
    return folder, stopped.value.code, saved


def test_a_run_stopped_mid_round_resumes_bitwise(runs, data_dir):
    folder = runs[0]
    whole, resumed = metrics_of(folder / "whole"), metrics_of(folder / "mid-round")
    assert resumed[4] == whole[4], (resumed[4], whole[4])
    assert whole[4]["kl"] > 0 and whole[4]["loss"] != 0.0  # a step that trains
    # with dropout on (rl.disable_dropout = false): the resumed run's dropout masks come from the restored generators
    assert json.loads((folder / "mid-round" / "config.json").read_text())["model"]["dropout"] == 0.1
    # the adaptive entropy control's state came back from the checkpoint: raised after each of the 4 steps, applied
    # from the second (a fresh controller would apply none at step 4)
    assert whole[4]["entropy_coef"] == pytest.approx(0.01 + 4 * 0.02)
    assert abs(whole[4]["loss"] - whole[4]["policy_loss"]) > 0.1
    want, got = parameters(folder / "whole", data_dir), parameters(folder / "mid-round", data_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the reference synced after step 4 from the one the checkpoint of step 3 kept
    want, got = synced_reference(folder / "whole"), synced_reference(folder / "mid-round")
    assert want and want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_logged_completions_are_the_uninterrupted_runs(runs):
    """`rl.log_completions`: each round once, in order (the round a SIGTERM interrupted while sampling is logged when
    the resumed run samples it), so both resumed runs' completions.jsonl equal the uninterrupted run's, line for
    line; each line holds the prompt, the completion's text, the rewards and the advantage."""
    folder = runs[0]
    whole = (folder / "whole" / "completions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in whole]
    assert [(r["round"], r["step"]) for r in records] == [(0, 1)] * 16 + [(1, 3)] * 16  # 4 prompts x 4, 2 rounds
    assert all(isinstance(r["prompt"], list) and isinstance(r["completion"], str) and r["rewards"].keys() == {"math"}
               and isinstance(r["advantage"], float) for r in records)
    assert len({r["completion"] for r in records}) == len(records)  # sampled, each its own
    for name in ("mid-round", "sigterm"):
        assert (folder / name / "completions.jsonl").read_text().splitlines() == whole, name


def test_sigterm_during_sampling_saves_the_last_step_and_resumes_bitwise(runs, data_dir, capsys):
    folder, code, saved = runs
    assert code == TERMINATED_EXIT_CODE
    assert saved is not None and saved.name.endswith("00000002"), saved
    whole, resumed = metrics_of(folder / "whole"), metrics_of(folder / "sigterm")
    assert {3: resumed[3], 4: resumed[4]} == {3: whole[3], 4: whole[4]}
    want, got = parameters(folder / "whole", data_dir), parameters(folder / "sigterm", data_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)
