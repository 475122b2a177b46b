"""Environments: a stateful object a sequence, whose methods are its tools (rl.environment), as TRL's GRPOTrainer
`environment_factory` takes them.

`rl.environment` names a class ("module:Class" or "path/to/file.py:Class") built with no arguments. One instance
serves each sequence position of a sampling (the pool grows to the most sequences sampled at once, and instances are
reused: built once, reset often), on the main rank only, where tools and rewards run. Before each sampling:

1. each sequence's instance is reset with its record's columns (`reset(prompt=..., answer=..., ...)`); the text it
   returns, if any, is appended to the prompt's last message;
2. the prompt is rendered with the tools' schemas (rl.tools' and the environment's public methods, but `reset` and
   `get_reward`) and its ids handed to every rank;
3. the sequence's tool calls go to rl.tools' functions and its own instance's methods (`tools_of`);
4. the reward functions get `environments=` (the instances, one a sequence), and a `get_reward()` method, where the
   class defines one, is a reward function of its own, named after the class, weight 1 (after rl.reward_weights').
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist

from shardlm.errors import UserError
from shardlm.rl.prompts import Prompt, to_prompt
from shardlm.rl.rewards import Reward, load_function
from shardlm.rl.tools import Tool


def _methods(instance) -> list:
    """The instance's tool methods: its class's public functions but reset and get_reward."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class Environments:
    """The run's environment class, its pool and its tools (module docstring). Built on every rank (one probe
    instance gives the methods' schemas, as TRL probes one); `reset`, the tools and the rewards run on the main
    rank."""

    def __init__(self, name: str, tools: list[Tool], template, ctx=None):
        self.factory = load_function(name, "rl.environment")
        if not inspect.isclass(self.factory):
            raise UserError(f'rl.environment: "{name}" is not a class; name a class built with no arguments')
        try:
            probe = self.factory()
        except Exception as exc:
            raise UserError(f'rl.environment: "{name}" could not be built with no arguments '
                            f"({type(exc).__name__}: {exc})") from None
        if not callable(getattr(probe, "reset", None)):
            raise UserError(f'rl.environment: "{name}" has no reset method; define reset(self, **record)')
        self.template, self.ctx = template, ctx
        self.tools = tools  # rl.tools' functions, beside each instance's methods
        self.methods = [Tool(f"{name}.{m.__name__}", m) for m in _methods(probe)]
        self.schemas = [t.schema for t in tools] + [t.schema for t in self.methods]
        self.pool = [probe]
        self.active: list = []  # the last sampling's instances, one a sequence (main rank)

    def reward(self) -> Reward | None:
        """The class's `get_reward()` as a reward function over `environments=` (None without one)."""
        kind = self.factory
        if not callable(getattr(kind, "get_reward", None)):
            return None

        def get_reward(environments, **kwargs) -> list:
            return [environment.get_reward() for environment in environments]

        get_reward.__name__ = kind.__name__
        return Reward(kind.__name__, get_reward, 1.0)

    def start(self, prompts: list[Prompt]) -> list[Prompt]:
        """Every sequence's prompt after its instance's reset (module docstring: steps 1-2), on every rank."""
        result: list = [None]
        if self.ctx is None or self.ctx.rank == 0:
            while len(self.pool) < len(prompts):
                self.pool.append(self.factory())
            self.active = self.pool[:len(prompts)]
            started = []
            for prompt, environment in zip(prompts, self.active):
                observation = environment.reset(**{"prompt": prompt.prompt, **prompt.columns})
                messages = list(prompt.prompt)
                if observation is not None:
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
                started.append(to_prompt(self.template, {**prompt.columns, "prompt": messages}, prompt.where,
                                         self.schemas))
            result = [started]
        if self.ctx is not None and self.ctx.world_size > 1:
            dist.broadcast_object_list(result, src=0)
        return result[0]

    def tools_of(self, sequence: int) -> dict[str, Any]:
        """The tools of the sequence at position `sequence` of the last sampling, by name (main rank)."""
        methods = _methods(self.active[sequence])
        return {t.function_name: t.function for t in self.tools} | {m.__name__: m for m in methods}
