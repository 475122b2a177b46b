"""BEMA (`[bema]`): a bias-corrected exponential moving average of the trained weights (Block and Zhang 2025, "EMA
Without the Lag: Bias-Corrected Iterate Averaging Schemes"; TRL's `BEMACallback`), at the training layout.

Three copies of this rank's trained parameters (their local shards: TP slices, pipeline stages, FSDP shards, each
expert on its EP rank) sit beside the weights as `ReferenceWeights` do: theta_0 (the weights at `update_after`), the
EMA, and the BEMA weights. After optimizer step t (t = update_after: theta_0 and the EMA become the weights;
then every `update_freq` steps):

    beta_t  = max((lag + multiplier t)^-ema_power, min_ema_multiplier)
    alpha_t = (lag + multiplier t)^-bias_power
    EMA     <- (1 - beta_t) EMA + beta_t theta_t
    BEMA    =  EMA + alpha_t (theta_t - theta_0)

every operation elementwise on each rank's shards (no communication), as TRL's callback computes it on whole tensors;
before update_after both copies hold the starting weights and the BEMA weights are the starting weights. With
`update_ref_model` (TRL's bema_for_ref_model) the run's reference weights (a preference run's live reference, an RL
run's KL reference: `ReferenceWeights` over the same parameters) become the BEMA weights every
`ref_model_update_freq` steps from `ref_model_update_after` on, after the average's own update. Checkpoints
keep the three copies (`bema/`, `bema_theta0/`, `bema_ema/` beside `model/`, resharded on loading like the model), so
a resumed run continues them bitwise; the run's last checkpoint's BEMA weights are written at the end as a
consolidated file (`RUN_DIR/bema.safetensors`), which `shardlm convert`, `shardlm eval` and `checkpoint.init_from`
read like any checkpoint.
"""

from __future__ import annotations

import torch

from shardlm.training.reference import ReferenceWeights

PREFIXES = ("bema", "bema_theta0", "bema_ema")
"""The checkpoint's names of the BEMA weights, theta_0 and the EMA (each followed by /NAME, as model/NAME)."""
FILE = "bema.safetensors"


class BEMA:
    """The three copies of module docstring over `trainer`'s parameters, each a `ReferenceWeights` (its `swapped()`
    puts the copy in the weights' place, e.g. to evaluate the BEMA weights)."""

    def __init__(self, cfg, trainer, reference=None):
        """`reference`: the run's reference weights (`ReferenceWeights`) that `update_ref_model` sets to the BEMA
        weights; None: none moves."""
        self.cfg = cfg
        self.weights = ReferenceWeights.of(trainer)
        self.theta0 = ReferenceWeights.of(trainer)
        self.ema = ReferenceWeights.of(trainer)
        self.params = self.weights.params
        self.reference = reference

    def copies(self) -> dict[str, ReferenceWeights]:
        """{checkpoint prefix: copy}."""
        return dict(zip(PREFIXES, (self.weights, self.theta0, self.ema)))

    def factors(self, step: int) -> tuple[float, float]:
        """(beta_t, alpha_t) of step `step` (module docstring)."""
        cfg = self.cfg
        age = cfg.lag + cfg.multiplier * step
        return max(age ** -cfg.ema_power, cfg.min_ema_multiplier), age ** -cfg.bias_power

    @torch.no_grad()
    def on_step_end(self, step: int) -> None:
        """After optimizer step `step` (counted from 1)."""
        cfg = self.cfg
        if step < cfg.update_after:
            return
        if step == cfg.update_after:
            for p, theta0, ema in zip(self.params, self.theta0.saved, self.ema.saved):
                theta0.copy_(p.detach())
                ema.copy_(p.detach())
        elif (step - cfg.update_after) % cfg.update_freq == 0:
            beta, alpha = self.factors(step)
            for p, theta0, ema, bema in zip(self.params, self.theta0.saved, self.ema.saved, self.weights.saved):
                ema.mul_(1 - beta).add_(p.detach(), alpha=beta)
                bema.copy_(ema + alpha * (p.detach() - theta0))
        after, every = cfg.ref_model_update_after, cfg.ref_model_update_freq
        if self.reference is not None and step >= after and (step - after) % every == 0:
            for reference, bema in zip(self.reference.saved, self.weights.saved):
                reference.copy_(bema)

    def describe(self) -> str:
        cfg = self.cfg
        from shardlm.training.frozen import local_bytes

        held = sum(local_bytes(t) for t in self.weights.saved) * 3
        return (f"bema: every {cfg.update_freq} steps after step {cfg.update_after} (ema_power {cfg.ema_power:g}, "
                f"bias_power {cfg.bias_power:g}, lag {cfg.lag}, multiplier {cfg.multiplier:g}); "
                f"{held / 2**20:,.1f} MiB on this rank for its three copies")


def write_bema(trainer, checkpoint, run_dir) -> str:
    """The end of a [bema] run: the BEMA weights of its last checkpoint (`checkpoint`; None: checkpoint.save=false)
    written as a consolidated file `run_dir`/bema.safetensors by the main rank; the line that says so."""
    from pathlib import Path

    if checkpoint is None:
        return "bema: checkpoint.save=false: the BEMA weights are not written"
    out = Path(run_dir) / FILE
    if trainer.ctx.is_main:
        from shardlm.checkpoint.state import consolidate

        consolidate(checkpoint, out, prefix="bema")
    trainer.ctx.world.barrier()
    return f"bema: the BEMA weights of step {trainer.step} written to {out}"


def bema_validation(trainer) -> dict[str, float]:
    """{"val_bema_loss": the BEMA weights' validation loss} on the run's own held-out data ({} without [bema] or
    held-out data): a second evaluation with the BEMA weights swapped in (a reward model's held-out figures of it
    dropped)."""
    if trainer.bema is None:
        return {}
    with trainer.bema.weights.swapped():
        loss = trainer.evaluate()
    if trainer.reward:
        trainer.loss.take_eval_metrics()
    return {} if loss is None else {"val_bema_loss": loss}

