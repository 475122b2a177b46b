"""The output layer of a causal language model (GPT or Llama) applied to selected hidden states only.

Evaluation and generation need logits at a few positions (the scored targets of a window, the last
position of a prompt), while `GPT.forward` computes them at every position. Running the tied,
vocabulary-parallel output layer on just those rows gives the same values at a fraction of the cost.
"""

from __future__ import annotations

import torch

from shardlm.models.decoder import DecoderLM, KVCache

CAUSAL_MODELS = (DecoderLM,)  # GPT and Llama


def logits_at(model, inputs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(M, V_padded / tp) this rank's logits at the M positions where `keep` (B, T) is True.
    A model that is not a `GPT` or `Llama` (a test stand-in) is called as `model(inputs)` and indexed."""
    if not isinstance(model, CAUSAL_MODELS):
        return model(inputs)[keep]
    return model.output_layer(model.hidden_states(inputs)[keep])


def last_logits(model, inputs: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """(B, V_padded / tp) this rank's logits at the last position of `inputs` (B, T), continuing
    `cache` when given."""
    if not isinstance(model, CAUSAL_MODELS):
        return model(inputs, cache=cache)[:, -1]
    return model.output_layer(model.hidden_states(inputs, cache)[:, -1])
