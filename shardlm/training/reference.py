"""The reference model of a full fine-tuning run kept as a copy of the starting weights (`ReferenceWeights`: RL's
KL, a preference run's live reference), and TR-DPO's syncs of it towards the policy (`sync_section`)."""

from __future__ import annotations

import contextlib

import torch


def sync_section(config):
    """The [rl] or [preference] section of a run whose reference syncs (sync_ref_model), or None."""
    return next((s for s in (config.rl, config.preference) if s.loss and s.sync_ref_model), None)


class ReferenceWeights:
    """The starting weights of this rank's parameters (their local shards), kept aside: `swapped()` puts them in
    place for a no-gradient forward and restores the policy's afterwards. The reference of a full fine-tuning RL run
    with rl.beta > 0, or of a preference run with preference.reference = "weights", at any layout, for one more copy
    of the weights; under sync_ref_model the trainer `mix`es it towards the policy after its steps and checkpoints
    keep it (`shardlm.checkpoint.state.reference_tensors`). Plain parameters exchange their storage with the saved
    tensors (nothing copied); FSDP's sharded parameters (DTensors, which FSDP keeps views of) are copied in and back,
    and the FSDP units of `modules` resharded each time (a root keeps its gathered parameters after a forward: the
    next forward would use them as they were)."""

    def __init__(self, params: list[torch.nn.Parameter], modules: list[torch.nn.Module] = ()):
        self.params, self.modules = params, list(modules)
        self.saved = [p.detach().clone() for p in params]

    @classmethod
    def of(cls, trainer) -> ReferenceWeights:
        """The starting weights of `trainer`'s parameters (under FSDP, resharding its model and pipeline stages)."""
        modules = [trainer.model] + (trainer.pipeline.stage_modules if trainer.pipeline is not None else [])
        return cls(trainer.params, modules if trainer.fsdp is not None else ())

    @contextlib.contextmanager
    def swapped(self, keep: bool = False):
        """The reference in the parameters' place; `keep`: what is written to them meanwhile stays the reference
        (a checkpoint's reference read by the model's loader)."""
        if any(hasattr(p, "to_local") for p in self.params):
            from shardlm.training.fsdp import reshard

            policy = [p.detach().clone() for p in self.params]
            with torch.no_grad():
                for p, r in zip(self.params, self.saved):
                    p.copy_(r)
            reshard(self.modules)
            try:
                yield
                if keep:
                    with torch.no_grad():
                        for p, r in zip(self.params, self.saved):
                            r.copy_(p)
            finally:
                with torch.no_grad():
                    for p, q in zip(self.params, policy):
                        p.copy_(q)
                reshard(self.modules)
            return
        self._exchange()  # (the saved tensors are the parameters' storage meanwhile: writes land in them)
        try:
            yield
        finally:
            self._exchange()

    @torch.no_grad()
    def mix(self, alpha: float) -> None:
        """TR-DPO's sync (sync_ref_model): the reference becomes alpha x the policy + (1 - alpha) x itself, shard
        by shard (as TRL's `SyncRefModelCallback` computes it)."""
        for p, r in zip(self.params, self.saved):
            r.mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)

    def _exchange(self) -> None:
        for i, p in enumerate(self.params):
            p.data, self.saved[i] = self.saved[i], p.data
