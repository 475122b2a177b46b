"""The token-level work of the lm-evaluation-harness adapter, run by every rank of a TP group.

The harness itself (task loading, prompts, metrics) runs on TP rank 0 only. Each forward pass,
though, needs every rank of the group, since each holds a slice of every layer. So TP rank 0, the
leader, sends each call (`"loglikelihood"` or `"generate"` with its token lists) to the other ranks
before running it, and they run the same call in the same order: `TensorParallelCalls.serve` is
their whole loop, until the leader's `close()`. Calls travel as JSON (token ids, numbers, stop
strings) in two broadcasts over the TP group: the length, then the bytes. Nothing here imports
lm_eval, so the other ranks never load it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from shardlm.eval.continuation import continuation_logprobs
from shardlm.eval.generate import SamplingConfig, generate_tokens
from shardlm.parallel import Communicator


class HarnessScorer:
    """The adapter's token-level operations on one rank's shard of `model`.

    model: a causal LM sharded for its `ctx` (TP inside it); tokenizer: the checkpoint's
    `shardlm.data.tokenizers.Tokenizer`, used to test stop strings while generating. Every TP rank
    must make the same calls with the same arguments.
    """

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer

    def loglikelihood(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each (context ids, continuation ids); see `continuation_logprobs`."""
        return continuation_logprobs(self.model, pairs)

    def generate(self, prompts: list[list[int]], sampling: dict, until: list[str]) -> list[list[int]]:
        """New ids after each prompt, with the KV-cache generator. sampling: `SamplingConfig`
        fields; a row stops at the end-of-document token, after max_new_tokens, or as soon as its
        decoded new text contains one of `until` (the ids that completed it are kept; the caller
        cuts the text)."""
        stops = [s for s in until if s]

        def stop(ids: list[int]) -> bool:
            text = self.tokenizer.decode(ids)
            return any(s in text for s in stops)

        results = generate_tokens(self.model, prompts, SamplingConfig(**sampling), eod=self.tokenizer.eod,
                                  stop=stop if stops else None)
        return [result.tokens for result in results]


def broadcast_json(obj, tp: Communicator, device: torch.device):
    """TP rank 0's JSON-serializable `obj`, on every rank of the TP group (2 broadcasts:
    the byte count, then the bytes). Other ranks pass None."""
    if tp.size == 1:
        return obj
    if tp.rank == 0:
        payload = torch.frombuffer(bytearray(json.dumps(obj).encode("utf-8")), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    tp.broadcast(size, 0)
    if tp.rank != 0:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    tp.broadcast(payload, 0)
    return obj if tp.rank == 0 else json.loads(payload.cpu().numpy().tobytes().decode("utf-8"))


class TensorParallelCalls:
    """Runs `HarnessScorer` calls on every rank of the TP group (see the module docstring).

    On TP rank 0, `calls(name, *args)` sends the call to the other ranks and runs it here; `close()`
    releases them. On the other ranks, `serve()` runs the leader's calls until `close()`.
    With TP=1 a call is a plain method call.
    """

    OPERATIONS = ("loglikelihood", "generate")

    def __init__(self, scorer: HarnessScorer, ctx) -> None:
        self.scorer, self.ctx = scorer, ctx

    @property
    def is_leader(self) -> bool:
        return self.ctx.tp.rank == 0

    def __call__(self, name: str, *args):
        if name not in self.OPERATIONS:
            raise ValueError(f"unknown harness call {name!r}")
        broadcast_json([name, list(args)], self.ctx.tp, self.ctx.device)
        return getattr(self.scorer, name)(*args)

    def close(self) -> None:
        """Leader: tell the other ranks that no call follows."""
        broadcast_json(None, self.ctx.tp, self.ctx.device)

    def serve(self) -> int:
        """Other ranks: run the leader's calls until it closes; returns how many were run."""
        served = 0
        while (message := broadcast_json(None, self.ctx.tp, self.ctx.device)) is not None:
            name, args = message
            if name not in self.OPERATIONS:
                raise ValueError(f"unknown harness call {name!r}")
            getattr(self.scorer, name)(*args)
            served += 1
        return served
