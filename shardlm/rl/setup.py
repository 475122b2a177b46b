"""What an RL run reads before its process groups exist (`load_rl_inputs`: the tokenizer and template, the prompts,
the reward functions, each bad input a one-line error before any expensive work) and what it builds once the
trainer exists (`start_rl`: the generator and the loop)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.rl import prompts_per_step, steps_per_generation
from shardlm.rl.prompts import Prompt, hold_out, load_prompts
from shardlm.rl.rewards import Reward, load_rewards, reward_names
from shardlm.sft.dataset import run_template, tokenizer_dir
from shardlm.sft.template import ChatTemplate


@dataclass
class RLInputs:
    """An RL run's template, prompts, reward functions, and the ids of its end-of-turn and padding tokens."""

    template: ChatTemplate
    prompts: list[Prompt]
    rewards: list[Reward]
    eod: int
    pad_id: int
    stops: set[int]
    eval_prompts: list[Prompt] = field(default_factory=list)  # held out (rl.eval_prompts)
    tools: list = field(default_factory=list)  # rl.tools (`shardlm.rl.tools.Tool`)
    call_format: object = None  # how the template's replies are parsed (`shardlm.rl.tools.CallFormat`), with tools
    environments: object = None  # rl.environment (`shardlm.rl.environments.Environments`)

    @property
    def max_token_id(self) -> int:
        return max(max(max(p.ids) for p in self.prompts), self.eod, self.pad_id)

    def summary(self) -> str:
        lengths = [len(p.ids) for p in self.prompts]
        held = f" (+ {len(self.eval_prompts)} held out to evaluate on)" if self.eval_prompts else ""
        names = [t.function_name for t in self.tools] + [t.function_name for t in getattr(self.environments,
                                                                                         "methods", [])]
        tools = f" | tools {', '.join(names)}" if names else ""
        return (f"rl: {len(self.prompts)} prompts{held} of {min(lengths)}-{max(lengths)} tokens | rewards "
                f"{', '.join(reward_names(self.rewards))}{tools}")


def load_rl_inputs(config) -> RLInputs:
    """The run's [rl] inputs (module docstring)."""
    r, sft = config.rl, config.sft
    tokenizer_path = tokenizer_dir(sft, config.checkpoint.init_from)
    template = run_template(sft, config.checkpoint.init_from)
    tools, call_format, environments = [], None, None
    if r.tools or r.environment:
        from shardlm.rl.tools import CallFormat, load_tools

        tools = load_tools(list(r.tools))
        if r.environment:
            from shardlm.rl.environments import Environments

            environments = Environments(r.environment, tools, template)
        schemas = environments.schemas if environments else [tool.schema for tool in tools]
        call_format = CallFormat.of(template, schemas)
    own = environments.reward() if environments else None  # an environment's get_reward, a reward of its own
    rewards = [] if own and not r.rewards else load_rewards(list(r.rewards), [float(w) for w in r.reward_weights],
                                                             r.format_pattern)
    rewards += [own] if own else []
    records = ()
    if r.task == "arithmetic":
        from shardlm.rl.arithmetic import arithmetic_records

        records = arithmetic_records(r.task_size, config.train.seed, conversational=True)
    schemas = call_format.schemas if call_format is not None else None  # (with tools, text prompts are refused)
    prompts, held = hold_out(load_prompts(template, list(sft.data), records, schemas), r.eval_prompts,
                             config.train.seed)
    eod, pad_id = end_ids(template)
    stops = stop_ids(eod, pad_id, tokenizer_path)
    return RLInputs(template, prompts, rewards, eod, pad_id if pad_id is not None else 0, stops, held, tools,
                    call_format, environments)


def end_ids(template) -> tuple[int, int | None]:
    """(the id a completion ends with: the tokenizer's end-of-sequence token, else the template's end of turn; the
    padding id, None without one). UserError when there is no end id."""
    eos = template.special_tokens.get("eos_token") or template.end_of_turn
    eod = template.tokenizer.token_to_id(eos) if eos else None
    if eod is None:
        from shardlm.errors import UserError

        raise UserError("the tokenizer has no end-of-turn token to stop completions at; set sft.end_of_turn")
    pad = template.special_tokens.get("pad_token") or template.end_of_turn
    return eod, template.tokenizer.token_to_id(pad) if pad else None


def stop_ids(eod: int, pad_id: int | None, directory: Path) -> set[int]:
    """The ids a completion stops at, as TRL's: the end-of-turn token, the tokenizer's end and padding tokens, and
    the model's `generation_config.json` `eos_token_id`s when the directory has one."""
    stops = {eod} | ({pad_id} if pad_id is not None else set())
    config = Path(directory) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        stops |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return {int(i) for i in stops}


def start_rl(trainer, inputs: RLInputs, reference=None, stop_requested=None, run_dir: Path | None = None):
    """(the run's `RLRun`, the line that describes it) once the trainer holds the starting weights; with
    rl.log_completions the rounds go to `run_dir`/completions.jsonl."""
    from shardlm.eval.generate import SamplingConfig
    from shardlm.rl.loop import RLRun
    from shardlm.rl.rollout import FixedCompletions, InProcessGenerator

    r = trainer.config.rl
    if r.completions:
        generator = FixedCompletions(r.completions, inputs.stops, r.max_completion_length)
        source = f"fixed completions from {r.completions}"
    else:
        sampling = SamplingConfig(max_new_tokens=r.max_completion_length, temperature=r.temperature, top_k=r.top_k,
                                  top_p=r.top_p, min_p=r.min_p, repetition_penalty=r.repetition_penalty)
        generator = InProcessGenerator(trainer.model, trainer.ctx, sampling, inputs.stops,
                                       lockstep=trainer.ctx.world_size > 1, pipeline=trainer.pipeline,
                                       stop_requested=stop_requested)
        source = "sampled by the policy"
    completions = Path(run_dir) / "completions.jsonl" if r.log_completions and run_dir is not None else None
    agent, environments = None, inputs.environments
    if inputs.call_format is not None:
        from shardlm.rl.agent import ToolLoop

        if environments is not None:
            environments.ctx = trainer.ctx
        agent = ToolLoop(inputs.tools, inputs.call_format, inputs.stops, r.max_tool_calling_iterations,
                         r.max_completion_length, trainer.config.model.seq_length, trainer.ctx,
                         environments.tools_of if environments is not None else None)
        source += ", calling tools" + (f" in {r.environment} environments" if environments is not None else "")
    run = RLRun(trainer, inputs.prompts, inputs.template, generator, inputs.rewards, inputs.pad_id, reference,
                completions, inputs.eval_prompts, agent, environments)
    kind = r.loss + (" (GSPO: sequence-level ratio)" if r.importance_sampling == "sequence" else "")
    ref = ("" if not (r.beta or r.loss == "a2po") else ", reference: " + (
        "the starting weights" if reference is not None else "the base (adapters off)"))
    if r.sync_ref_model:
        ref += f", synced every {r.ref_model_sync_steps} steps ({r.ref_model_mixup_alpha:g} of the policy)"
    steps = steps_per_generation(trainer.config)
    completions_a_step = f"{r.num_generations} completion{'s' if r.num_generations > 1 else ''}"
    line = (f"rl: {kind} loss, {prompts_per_step(trainer.config)} prompts x {completions_a_step} a step, "
            + (f"{steps} steps a generation round, " if steps > 1 else "")
            + f"{r.num_iterations} update(s) each, "
            + (f"beta1 {r.beta1:g}, beta2 {r.beta2:g}" if r.loss == "a2po" else f"beta {r.beta:g}")
            + f"{ref}; completions {source}"
            + (f", logged to {completions}" if completions else ""))
    return run, line
