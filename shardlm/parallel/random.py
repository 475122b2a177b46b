"""Model-parallel random numbers.

Dropout on replicated activations (after the residual projections, on embeddings) must drop the
same elements on every tensor-parallel rank, so it uses the ordinary default generator, seeded
identically on those ranks. Dropout inside a parallel region (attention probabilities, where each
rank holds different heads) must differ per rank, so it runs under `tracker.fork()`, which swaps in
a generator seeded `seed + 2718 + tp_rank` and swaps back afterwards. Activation checkpointing
snapshots and restores the tracker's states so that recomputed masks equal the original ones.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from shardlm.parallel.graph_break import graph_break

MODEL_PARALLEL_RNG = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_device_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_device_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states for one device; `fork(name)` runs a block on one of them."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Register a state seeded with `seed`, without touching the default generator."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.states[name] = generator.get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Use generator `name` as the device's default inside the block, then restore."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added")
        original = _get_device_state(self.device)
        _set_device_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_device_state(self.device)
            _set_device_state(original, self.device)

    def checkpoint_context_fn(self):
        """`context_fn` for `torch.utils.checkpoint`: the recomputation sees the tracker's states
        as they were at the original forward, and leaves the current states untouched. The recompute
        context can be entered more than once: a backward split into its input- and weight-gradient steps
        (the zero-bubble schedules) recomputes the block in each."""
        return contextlib.nullcontext(), _AsAtForward(self, self.get_states())


class _AsAtForward:
    """Within the block, `tracker` holds the states `snapshot`; on leaving, its states before the block.
    Re-enterable (unlike a generator's context manager)."""

    def __init__(self, tracker: RNGStatesTracker, snapshot: dict):
        self.tracker, self.snapshot, self.saved = tracker, snapshot, []

    def __enter__(self):
        self.saved.append(self.tracker.get_states())
        self.tracker.set_states(self.snapshot)

    def __exit__(self, *exc):
        self.tracker.set_states(self.saved.pop())
        return False


@graph_break
def recompute(fn, *args, rng: RNGStatesTracker):
    """`fn(*args)` under `torch.utils.checkpoint` (non-reentrant): its activations are recomputed in
    the backward, which sees the tracker's RNG states as they were at the forward (so dropout draws
    the same masks). A graph break under `torch.compile`, whose tracing of checkpoint does not take
    this `context_fn`."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=rng.checkpoint_context_fn)


def seed_model_parallel(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> RNGStatesTracker:
    """Seed the default generators with `seed` (same on all TP ranks) and return a tracker whose
    model-parallel generator is seeded `seed + 2718 + tp_rank`."""
    torch.manual_seed(seed)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker
