"""Text generation: greedy, temperature, top-k and top-p sampling, with a key/value cache.

Prompts of different lengths run as one batch in lockstep, as the reference implementation does:
decoding starts at the shortest prompt's length, and at every position a row that still has prompt
tokens takes its own token instead of the sampled one. No row needs padding on the left, so every
row sees exactly the positions and attention it would see alone. With the cache (the default) the
prompt prefix is processed once and each further step is one forward over one position; without it
each step reruns the whole prefix (same tokens, for checking and benchmarking).

Under tensor parallelism every rank gathers the last position's logits (B x V, one position, for
sampling), draws from the same seeded generator and takes TP rank 0's choice (a broadcast of B ids),
so all ranks of a group continue with the same tokens. Draws are made in float64 from the sorted
distribution, so TP=1 and TP=2 pick the same tokens unless two choices differ by round-off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from shardlm.errors import UserError
from shardlm.eval.head import last_logits


@dataclass
class SamplingConfig:
    """How the next token is chosen."""

    max_new_tokens: int = 32
    """Tokens generated after each prompt (fewer when the model's sequence length ends first)."""
    temperature: float = 1.0
    """Logits are divided by this before sampling; 0 means greedy."""
    top_k: int = 0
    """Sample only among the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Sample only among the most likely tokens whose probabilities sum to top_p (nucleus); 1 disables."""
    min_p: float = 0.0
    """Sample only among the tokens at least min_p times as likely as the most likely one (after top-k and top-p);
    0 disables."""
    repetition_penalty: float = 1.0
    """The logits of the ids already in the row (its prompt and what it generated) divided by this where positive and
    multiplied where negative, before the temperature (CTRL's penalty, as transformers and vLLM apply it; greedy
    decoding too); 1 disables."""
    seed: int = 0
    """Seed of the sampling generator: the same seed and prompts give the same tokens."""
    stop_at_eod: bool = True
    """A row stops when it generates the end-of-document token (which is not returned)."""
    use_cache: bool = True
    """Keep keys and values of processed positions; False recomputes the prefix every step."""

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise UserError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise UserError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p={self.top_p} must be in (0, 1] (1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise UserError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)")


@dataclass
class Generation:
    """One prompt's result: its ids, the new ids, why it stopped ("eod", "length", "stop" or "context"),
    and the new text when a tokenizer was given."""

    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: str
    text: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """(B, V) logits with the ids of each row's `seen` (B, P) int64 (its prompt and generated tokens) penalized: a
    logit z becomes z / penalty where positive, z x penalty where not (as transformers' repetition penalty)."""
    if penalty == 1.0 or seen.shape[-1] == 0:
        return logits
    values = logits.gather(-1, seen)
    return logits.scatter(-1, seen, torch.where(values < 0, values * penalty, values / penalty))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  min_p: float = 0.0) -> torch.Tensor:
    """(B, V) logits -> (B, V) float64 probabilities after temperature, top-k, top-p and min-p."""
    scores = logits.double() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the most likely token is always kept (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose_next(logits: torch.Tensor, uniform: torch.Tensor, config: SamplingConfig,
                seen: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) real-vocabulary logits and (B,) uniforms in [0, 1) -> (B,) int64 next ids; `seen` (B, P): each row's
    ids so far, for the repetition penalty. Greedy when temperature is 0; else the inverse CDF of the filtered
    distribution, sorted by probability (ties by id), evaluated at `uniform`."""
    if seen is not None:
        logits = penalize_repetition(logits, seen.to(logits.device), config.repetition_penalty)
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, config.temperature, config.top_k, config.top_p, config.min_p)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    cdf = sorted_probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (uniform.to(cdf) * cdf[:, -1]).unsqueeze(-1)).clamp_max(cdf.shape[-1] - 1)
    return order.gather(-1, pick).squeeze(-1)


@torch.no_grad()
def generate_tokens(model, prompts: list[list[int]], config: SamplingConfig,
                    eod: int | None = None, stop: Callable[[list[int]], bool] | None = None,
                    ends: frozenset[int] = frozenset()) -> list[Generation]:
    """Continue each prompt (a list of ids) with `model` (a `GPT` on its `ctx`); see the module docstring.

    Every TP rank must call this with the same prompts and config; all return the same tokens.
    An empty prompt starts from `eod`; `ends`, further ids that end a row as `eod` does (a chat template's
    end-of-turn ids). `stop(new_ids)`, when given, is asked after each new token
    of a row; True ends that row (finish reason "stop"; the ids that completed the stop are kept).
    It sees the same ids on every rank, so every rank stops the same rows. Talks to the TP group
    (the model's collectives, one all-gather of the last position's logits and one broadcast of
    B ids per step).
    """
    config.validate()
    if not prompts:
        raise UserError("no prompts to continue; pass at least one")
    ctx, seq_length = model.ctx, model.cfg.seq_length
    prompts = [list(p) if len(p) else [eod if eod is not None else 0] for p in prompts]
    lengths = [len(p) for p in prompts]
    if max(lengths) >= seq_length:
        raise UserError(f"a prompt of {max(lengths)} tokens leaves no room in model.seq_length={seq_length}; "
                        "shorten the prompt")
    total = min(seq_length, max(lengths) + config.max_new_tokens)
    batch = len(prompts)
    tokens = torch.zeros(batch, total, dtype=torch.long, device=ctx.device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt)
    prompt_length = torch.tensor(lengths, device=ctx.device)
    generator = torch.Generator().manual_seed(config.seed)
    was_training = model.training
    model.eval()

    cache = model.new_kv_cache(total) if config.use_cache else None
    position = min(lengths)
    logits = last_logits(model, tokens[:, :position], cache)  # (B, V_padded / tp)
    new: list[list[int]] = [[] for _ in prompts]
    reason: list[str | None] = [None] * batch
    while position < total:
        full = model.full_logits(logits)  # (B, V): gathered, padding dropped
        uniform = torch.rand(batch, generator=generator, dtype=torch.float64)
        chosen = ctx.tp.broadcast(choose_next(full, uniform, config, tokens[:, :position]).to(ctx.device), 0)
        in_prompt = position < prompt_length
        step = torch.where(in_prompt, tokens[:, position], chosen)
        tokens[:, position] = step
        for row, (token, forced) in enumerate(zip(step.tolist(), in_prompt.tolist())):
            if forced or reason[row] is not None:
                continue
            if config.stop_at_eod and (token == eod or token in ends):
                reason[row] = "eod"
                continue
            new[row].append(token)
            if stop is not None and stop(new[row]):
                reason[row] = "stop"
            elif len(new[row]) == config.max_new_tokens:
                reason[row] = "length"
        position += 1
        if all(r is not None for r in reason) or position == total:
            break
        logits = last_logits(model, tokens[:, position - 1:position] if cache is not None else tokens[:, :position],
                             cache)
    model.train(was_training)
    return [Generation(p, n, r or "context") for p, n, r in zip(prompts, new, reason)]


def generate(model, tokenizer, prompts: list[str], config: SamplingConfig | None = None) -> list[Generation]:
    """Continue each text prompt; `Generation.text` is the decoded new text. See `generate_tokens`."""
    config = config or SamplingConfig()
    results = generate_tokens(model, tokenizer.encode_batch(prompts), config, eod=tokenizer.eod)
    for result in results:
        result.text = tokenizer.decode(result.tokens)
    return results
