"""Memory settings in one process: the fp32 master weights of bf16 parameters follow AdamW written out by hand,
and bad memory settings are one-line errors before any process starts."""

from __future__ import annotations

import pytest
import torch
from test_memory import config
from test_training import tiny_config, train_run

from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.validation import validate


def test_master_weights_follow_a_hand_written_adamw():
    """One more step of the bf16 model: the fp32 master weights after it equal AdamW written out by hand
    on the same (clipped, fp32) gradients; the bf16 parameters are the master weights rounded."""
    _, _, trainer = train_run(ParallelContext.single(), config(micro=4, precision="bf16", param_dtype="half"))
    inner = trainer.optimizer.optimizer
    captured = {}
    real_step = inner.step

    def capturing_step(*args, **kwargs):
        for group in inner.param_groups:
            for seg in group["params"]:
                state = inner.state[seg]
                captured[id(seg)] = (seg.detach().clone(), seg.grad.clone(), state["exp_avg"].clone(),
                                     state["exp_avg_sq"].clone(), float(state["step"]), group["lr"],
                                     group["weight_decay"])
        return real_step(*args, **kwargs)

    inner.step = capturing_step
    trainer.consumed_samples = 0  # the data of step 1 again: the synthetic set has 10 steps' worth
    trainer.train_step()
    inner.step = real_step
    t = trainer.config.train
    for group in inner.param_groups:
        for seg in group["params"]:
            p, g, m, v, step, lr, wd = captured[id(seg)]
            step += 1
            m = t.adam_beta1 * m + (1 - t.adam_beta1) * g
            v = t.adam_beta2 * v + (1 - t.adam_beta2) * g * g
            p = p * (1 - lr * wd)
            denom = (v / (1 - t.adam_beta2 ** step)).sqrt() + t.adam_eps
            p = p - lr / (1 - t.adam_beta1 ** step) * m / denom
            assert torch.allclose(seg, p, rtol=1e-6, atol=1e-9)
    master = torch.cat([seg.detach() for seg in trainer.optimizer.segments])
    params = torch.cat([p.detach().reshape(-1) for p in trainer.params])
    assert torch.equal(params, master[: params.numel()].to(torch.bfloat16))


@pytest.mark.parametrize("overrides,message", [
    ({"sp": True}, "needs parallel.tensor > 1"),
    ({"tp": 4, "sp": True, "seq": 18}, "model.seq_length=18 is not divisible by parallel.tensor=4"),
    ({"recompute": "some"}, 'train.recompute="some" must be'),
    ({"param_dtype": "half"}, 'set train.precision to "bf16" or "fp16"'),
    ({"param_dtype": "fp8", "precision": "bf16"}, 'train.param_dtype="fp8" must be'),
])
def test_bad_memory_settings_get_one_line_errors(overrides, message):
    seq = overrides.pop("seq", None)
    cfg = config(**overrides)
    cfg.model.seq_length = seq or cfg.model.seq_length
    with pytest.raises(UserError, match=message):
        validate(cfg, cfg.parallel.tensor, check_paths=False)


def test_activation_checkpointing_key_means_full_recompute():
    assert tiny_config(checkpointing=True).train.recompute == "full"
