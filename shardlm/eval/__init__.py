"""The paper's zero-shot evaluations and text generation.

    evaluate_wikitext   WikiText-103 perplexity with overlapping windows, plain and adjusted
    evaluate_lambada    LAMBADA last-word accuracy, strict or not
    generate            greedy / temperature / top-k / top-p sampling with a key/value cache

All take a `GPT` sharded for its `ParallelContext` (TP inside the model, DP over windows or
examples). Names are imported on first use, so importing `shardlm.eval.cli` stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "evaluate_wikitext": "shardlm.eval.wikitext",
    "WikitextResult": "shardlm.eval.wikitext",
    "evaluate_stream": "shardlm.eval.perplexity",
    "evaluation_windows": "shardlm.eval.windows",
    "wikitext_detokenize": "shardlm.eval.detokenize",
    "evaluate_lambada": "shardlm.eval.lambada",
    "read_lambada": "shardlm.eval.lambada",
    "LambadaResult": "shardlm.eval.lambada",
    "generate": "shardlm.eval.generate",
    "generate_tokens": "shardlm.eval.generate",
    "SamplingConfig": "shardlm.eval.generate",
    "Generation": "shardlm.eval.generate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardlm.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
