"""Rollouts: completions of the prompts, sampled by the current policy in the training processes, at the training
layout, with the key/value cache.

The generator sits behind one small interface (`Generator.generate`: prompt ids and one seed per sequence in;
completion ids, their log-probabilities and whether each was truncated out), so that an external engine with weight
sync can take its place. `InProcessGenerator` is the policy itself:

- every sequence draws from its own generator, seeded by (train.seed, round, sequence), and only when it samples:
  a sequence's tokens depend neither on which others share its batch nor on the data-parallel rank it ran on
  (unless two choices differ by round-off between layouts);
- prompts of different lengths run as one batch in lockstep (`shardlm.eval.generate`: decoding starts at the
  shortest prompt, a row still in its prompt takes its own next token);
- the sequences are shared out over the data x context-parallel ranks (`sampling_share`, gathered back with
  `gather_samples`): under context parallelism each CP rank decodes its own whole sequences, the model's context
  parallelism off (`context_parallel_off`; a CP rank holds the whole weights, and a sequence's cache is small beside
  the training forward's activations), and the training forward then splits the packed rows over the CP group;
- under tensor parallelism (sequence parallelism off while decoding) each rank gathers the last position's logits,
  all draw alike and take TP rank 0's choice (a broadcast), so the group continues with the same tokens;
- under pipeline stages each decoding forward runs through the stages in order, each stage's owner handing its
  activations on; the last stage samples and hands the chosen ids and their log-probabilities to the others (under
  FSDP as well: each stage's root set up and its end pieces gathered first, `training.fsdp.gather_root`);
- under expert parallelism (and FSDP) the ranks exchange tokens (parameters) in every forward, so every rank runs as
  many forwards as the longest generation in the world (a rank whose rows are finished runs one-token forwards
  without a cache until all are done: one all-reduce MAX of a flag per position);
- the log-probability of each sampled token is that of the temperature-scaled logits over the whole vocabulary
  (top-k and top-p shape the sampling only, as in TRL): from the gathered logits, or with `rl.batch_invariant`
  (`shardlm.parallel.invariant`) from the function the training forward uses (`DecoderLM.output_loss`) on the
  decoding step's hidden state, the very numbers the training forward computes for the token, bitwise.

A completion ends with a stop token (kept: the policy learns to stop): the end-of-turn token, the tokenizer's end
and padding tokens and the model's generation_config.json `eos_token_id`s, the ones TRL stops at; or it is truncated at
rl.max_completion_length (or where the model's sequence length ends).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from shardlm.errors import UserError
from shardlm.eval.generate import SamplingConfig, penalize_repetition
from shardlm.parallel import invariant
from shardlm.parallel.comm import Communicator
from shardlm.training.fsdp import gather_root


@dataclass
class Rollout:
    """One sequence: the `prompt` ids, the sampled `completion` ids (the end-of-turn id last unless `truncated`)
    and their log-probabilities `logps` under the sampling policy (NaN where unknown: fixed completions, tool
    results). With tools (`shardlm.rl.agent`): `mask` (1 on the policy's tokens, 0 on the tool results') and the
    completion's `messages` (the replies parsed, the tool results)."""

    prompt: list[int]
    completion: list[int]
    logps: list[float]
    truncated: bool
    mask: list[int] | None = None
    messages: list[dict] | None = None

    @property
    def policy_tokens(self) -> int:
        """The completion's tokens sampled by the policy (all but the tool results')."""
        return len(self.completion) if self.mask is None else sum(self.mask)


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], seeds: list[int], round_index: int, sequences: list[int],
                 limits: list[int] | None = None, turn: int = 0) -> list[Rollout]:
        """Complete `prompts` (one per sequence; `seeds` one per sequence), sequences numbered `sequences` of
        generation round `round_index`; each with at most its `limits` tokens (None: the sampling settings'), the
        `turn`-th reply of the sequence (after tool results: `shardlm.rl.agent`)."""


class GenerationStopped(Exception):
    """A stop was requested (SIGTERM) while the rollouts were being sampled: the round is dropped unfinished (the
    weights have not moved; a resumed run samples it again from the same seeds)."""


def sample_next(logits: torch.Tensor, uniform: torch.Tensor, temperature: float, top_k: int = 0,
                top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) real-vocabulary logits and (B,) uniforms in [0, 1) -> ((B,) sampled ids, (B, V) fp32 log-probabilities of
    logits / temperature, unfiltered and unpenalized: the policy's). The inverse CDF at `uniform` of the filtered
    distribution (`filter_logits`' after `penalize_repetition` of the ids `seen` (B, P)): over the candidates in id
    order for plain temperature sampling (no sort of the vocabulary: it was most of a decoding step at a
    151,936-token vocabulary), over the top-k in decreasing order with `top_k`, and over the nucleus found among the
    largest candidates (`topk` of 64, then 4x as many until it is covered) with `top_p`; `min_p` then drops the
    candidates below min_p times the most likely one."""
    scores = logits.float() / temperature
    logps = torch.log_softmax(scores, dim=-1)
    if seen is not None and repetition_penalty != 1.0:
        scores = penalize_repetition(logits, seen.to(logits.device), repetition_penalty).float() / temperature
    candidates = None
    if 0 < top_k < scores.shape[-1]:
        scores, candidates = scores.topk(top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1).double()
    if top_p < 1.0:
        count = 64
        while True:  # the nucleus lies among the `count` most likely candidates once their mass reaches top_p
            count = min(count, probs.shape[-1])
            kept, order = probs.topk(count, dim=-1)
            if count == probs.shape[-1] or bool((kept.sum(-1) >= top_p).all()):
                break
            count *= 4
        candidates = order if candidates is None else candidates.gather(-1, order)
        before = kept.cumsum(dim=-1) - kept  # mass of the more likely candidates: the most likely is always kept
        probs = kept.masked_fill(before >= top_p, 0.0)
    if min_p > 0.0:  # (the most likely candidate is always kept)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (uniform.to(cdf) * cdf[:, -1]).unsqueeze(-1)).clamp_max(cdf.shape[-1] - 1)
    chosen = pick if candidates is None else candidates.gather(-1, pick)
    return chosen.squeeze(-1), logps


def sequence_seed(seed: int, round_index: int, sequence: int) -> int:
    """The sampling seed of one sequence of one generation round."""
    return int(np.random.SeedSequence([seed, round_index, sequence]).generate_state(1, np.uint64)[0] >> 1)


def evaluation_seed(seed: int, sequence: int) -> int:
    """The sampling seed of one held-out sequence (`RLRun.evaluate`: the same at every evaluation); a key of
    another length than `sequence_seed`'s, so never a training sequence's."""
    return int(np.random.SeedSequence([seed, sequence, 0, 1]).generate_state(1, np.uint64)[0] >> 1)


def sampling_share(count: int, ctx) -> list[int]:
    """The sequences (of `count`) this rank samples: its contiguous share over the data x context-parallel ranks
    (`ctx.dp_cp`; the TP and pipeline ranks of one replica sample the same ones together)."""
    return np.array_split(np.arange(count), ctx.dp_cp.size)[ctx.dp_cp.rank].tolist()


def gather_samples(local: list, ctx) -> list:
    """Every rank's `sampling_share` results, in sequence order, on every rank."""
    return [r for part in ctx.dp_cp.all_gather_object(local) for r in part]


@contextlib.contextmanager
def context_parallel_off(ctx):
    """`ctx` without context parallelism for the block: its CP group a group of one (the models read `ctx.cp` at
    every forward), so each CP rank runs whole sequences on its own; the group restored afterwards."""
    group = ctx.cp
    if group.size > 1:
        ctx.cp = Communicator("cp", None, 1, 0, ctx.comm)
    try:
        yield
    finally:
        ctx.cp = group


@contextlib.contextmanager
def sequence_parallel_off(model):
    """The model without sequence parallelism for the block: every module's `sequence_parallel` flag off (the same
    products and sums, the activations whole on each TP rank instead of split along the sequence), as the KV cache
    needs; the flags restored afterwards."""
    flagged = [m for m in model.modules() if getattr(m, "sequence_parallel", False)]
    for m in flagged:
        m.sequence_parallel = False
    try:
        yield
    finally:
        for m in flagged:
            m.sequence_parallel = True


class InProcessGenerator:
    """The policy samples its own completions (module docstring). `model` is the run's `DecoderLM` on `ctx`, with
    its `logit_temperature` set to the sampling temperature."""

    def __init__(self, model, ctx, sampling: SamplingConfig, eod: int | set[int], lockstep: bool = False, pipeline=None,
                 stop_requested: Callable[[], bool] | None = None):
        self.model, self.ctx, self.sampling, self.lockstep = model, ctx, sampling, lockstep
        self.stops = {eod} if isinstance(eod, int) else set(eod)
        self.pipeline, self.stop_requested = pipeline, stop_requested
        self.dtype = next(model.parameters()).dtype

    def _forward(self, tokens: torch.Tensor, cache) -> torch.Tensor | None:
        """(B, T) ids after the cached positions -> (B, T, h) final-norm output, through the model's own call;
        under pipeline stages `_stages` (None but on the last stage)."""
        if self.pipeline is not None:
            return self._stages(tokens, cache)
        return self.model(tokens, cache=cache, hidden_only=True)

    def _stages(self, tokens: torch.Tensor, cache) -> torch.Tensor | None:
        """The forward through the pipeline stages in order: each stage's owner runs its layers (with their part of
        the cache) and hands the (B, T, h) activations on (a broadcast over the pipeline group); the last stage's
        owner returns the final norm's output."""
        from shardlm.parallel.pipeline import stage_owner  # loaded by pipeline runs only (it loads TorchDynamo)

        model, ctx, runner = self.model, self.ctx, self.pipeline
        count, x = len(runner.layers), None
        for stage in runner.stage_modules:  # FSDP roots whose layers and end pieces are called one by one
            gather_root(stage)
        carry = model.layer_carry()  # GLM-5's shared choice, Gemma 4's shared keys (never across a stage boundary)
        extra = () if carry is None else (carry,)
        for stage, layer_ids in enumerate(runner.layers):
            owner = stage_owner(stage, ctx.pp_size, count, runner.v_shaped)
            if owner == ctx.pp_rank:
                if stage == 0:
                    x = model.embed(tokens, 0 if cache is None else cache.length, None)
                for i in layer_ids:
                    x = model.layers[str(i)](x, None if cache is None else cache.layers[i], None, *extra)
                if stage == count - 1:
                    return model.ln_f(x)
            if stage < count - 1:
                shape = (*tokens.shape, model.cfg.hidden_size)
                x = ctx.pp.broadcast(x.to(self.dtype) if owner == ctx.pp_rank else
                                     torch.empty(shape, dtype=self.dtype, device=ctx.device), owner)
        return None

    def _idle(self) -> None:
        """The forward of a rank with nothing left to decode while others still do (its exchanges: experts, FSDP)."""
        self._forward(torch.zeros(1, 1, dtype=torch.long, device=self.ctx.device), None)

    def _choose(self, hidden, tokens, position: int, in_prompt, generators, done) -> tuple[torch.Tensor, list]:
        """(B,) ids of this position (the prompt's own where a row is still in it, else sampled) and their
        log-probabilities; sampled where the last stage runs, handed to the other stages (a broadcast)."""
        model, ctx, config = self.model, self.ctx, self.sampling
        batch = tokens.shape[0]
        picked = torch.zeros(2, batch, dtype=torch.float64, device=ctx.device)
        if self.pipeline is None or self.pipeline.has_last:
            full = model.full_logits(model.output_layer(hidden)[:, 0])  # (B, V)
            uniform = torch.tensor([torch.rand(1, generator=g, dtype=torch.float64).item()
                                    if not (forced or finished) else 0.0
                                    for g, forced, finished in zip(generators, in_prompt.tolist(), done)],
                                   dtype=torch.float64)
            seen = tokens[:, :position]  # each row's prompt and completion so far (the repetition penalty's)
            if config.temperature == 0:
                penalized = penalize_repetition(full, seen.to(full.device), config.repetition_penalty)
                chosen, all_logps = penalized.argmax(dim=-1), torch.log_softmax(full.float(), dim=-1)
            else:
                chosen, all_logps = sample_next(full, uniform, config.temperature, config.top_k, config.top_p,
                                                config.min_p, config.repetition_penalty, seen)
            chosen = ctx.tp.broadcast(chosen.to(ctx.device), 0)
            step = torch.where(in_prompt, tokens[:, position], chosen)
            if invariant.enabled():  # the training forward's own function: its numbers, bit for bit
                logps = -model.output_loss(hidden, step.view(-1, 1))[:, 0].double()
            else:  # from the logits already gathered, without a second pass of the output layer
                logps = all_logps.gather(-1, step.view(-1, 1).to(all_logps.device))[:, 0].double()
            picked = torch.stack((step.double(), logps))
        if self.pipeline is not None:
            picked = ctx.pp.broadcast(picked, self.pipeline.last_rank)
        return picked[0].long(), picked[1].tolist()

    def _lockstep(self, active: bool) -> bool:
        """Whether any rank of the world still decodes (with `lockstep`, every rank asks at every position: the
        forward itself talks across data-parallel ranks, experts and FSDP, and a stop request reaches every rank at
        the same position). Raises `GenerationStopped` when any rank's `stop_requested()` says so (a SIGTERM)."""
        stop = bool(self.stop_requested is not None and self.stop_requested())
        if self.lockstep:
            flags = torch.tensor([float(active), float(stop)], device=self.ctx.device)
            self.ctx.world.all_reduce(flags, op=dist.ReduceOp.MAX)
            active, stop = bool(flags[0].item()), bool(flags[1].item())
        if stop:
            raise GenerationStopped()
        return active

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int], round_index: int = 0,
                 sequences: list[int] | None = None, limits: list[int] | None = None, turn: int = 0
                 ) -> list[Rollout]:
        with sequence_parallel_off(self.model), context_parallel_off(self.ctx):
            return self._generate(prompts, seeds, limits)

    def _generate(self, prompts: list[list[int]], seeds: list[int], limits: list[int] | None) -> list[Rollout]:
        model, ctx, config = self.model, self.ctx, self.sampling
        seq_length = model.cfg.seq_length
        limits = [config.max_new_tokens] * len(prompts) if limits is None else list(limits)
        lengths = [len(p) for p in prompts]
        if lengths and max(lengths) >= seq_length:
            raise UserError(f"a prompt of {max(lengths)} tokens leaves no room in model.seq_length={seq_length}; "
                            "shorten the prompts or raise model.seq_length")
        batch = len(prompts)
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        total = min(seq_length, max(n + k for n, k in zip(lengths, limits))) if prompts else 1
        tokens = torch.zeros(batch, total, dtype=torch.long, device=ctx.device)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.tensor(prompt)
        prompt_length = torch.tensor(lengths, device=ctx.device, dtype=torch.long)
        new: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        done = [k <= 0 for k in limits]
        was_training, entropies = model.training, model.entropies
        model.eval()
        model.entropies = None  # the sampled tokens' log-probabilities only
        cache = model.new_kv_cache(total) if prompts else None
        position = min(lengths) if prompts else 0
        hidden = self._forward(tokens[:, :position], cache) if prompts else self._idle()
        hidden = hidden[:, -1:] if hidden is not None else None
        active = bool(prompts) and not all(done)
        while True:  # each pass: sample one position where active, then one forward on every rank
            if active:
                in_prompt = position < prompt_length
                step, step_logps = self._choose(hidden, tokens, position, in_prompt, generators, done)
                tokens[:, position] = step
                for row, (token, forced) in enumerate(zip(step.tolist(), in_prompt.tolist())):
                    if forced or done[row]:
                        continue
                    new[row].append(token)
                    logps[row].append(step_logps[row])
                    done[row] = token in self.stops or len(new[row]) == limits[row]
                position += 1
                active = not all(done) and position < total
            if not self._lockstep(active):
                break
            hidden = self._forward(tokens[:, position - 1:position], cache) if active else self._idle()
        model.train(was_training)
        model.entropies = entropies
        return [Rollout(p, n, lp, not n or n[-1] not in self.stops) for p, n, lp in zip(prompts, new, logps)]


class FixedCompletions:
    """Completions read from a JSONL file (`rl.completions`) instead of sampled: one record per sequence and reply,
    `{"step": round, "sequence": j, "ids": [completion ids]}` (with tools also `"turn": k`, the reply after the k-th
    tool results; 0 by default), each cut to the reply's room; their log-probabilities are unknown (NaN). For
    checking that a layout, or another trainer, trains the same tokens the same way."""

    def __init__(self, path: str | Path, eod: int | set[int], max_length: int):
        self.stops, self.by_key = {eod} if isinstance(eod, int) else set(eod), {}
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    key = (int(record["step"]), int(record["sequence"]), int(record.get("turn", 0)))
                    ids = [int(i) for i in record["ids"]]
                except (ValueError, KeyError, TypeError) as exc:
                    raise UserError(f"{path}:{line_number}: a fixed completion needs 'step', 'sequence' and 'ids' "
                                    f"({exc})") from None
                if not ids or len(ids) > max_length:
                    raise UserError(f"{path}:{line_number}: a completion of {len(ids)} tokens; it must have 1 to "
                                    f"rl.max_completion_length={max_length}")
                self.by_key[key] = ids
        self.path = path

    def generate(self, prompts: list[list[int]], seeds: list[int], round_index: int = 0,
                 sequences: list[int] | None = None, limits: list[int] | None = None, turn: int = 0
                 ) -> list[Rollout]:
        rollouts = []
        for row, (prompt, sequence) in enumerate(zip(prompts, sequences)):
            ids = self.by_key.get((round_index, sequence, turn))
            if ids is None:
                raise UserError(f"{self.path}: no completion for step {round_index}, sequence {sequence}"
                                + (f", turn {turn}" if turn else ""))
            ids = ids if limits is None else ids[:limits[row]]
            rollouts.append(Rollout(prompt, ids, [math.nan] * len(ids), not ids or ids[-1] not in self.stops))
        return rollouts
