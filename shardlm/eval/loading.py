"""What every evaluation command does first: check its inputs, then load the checkpoint's model.

`check_inputs` runs in the launching process, before any worker starts; `load_for_evaluation` runs
on each rank. Both are shared by `shardlm eval`, `shardlm generate` and the lm-evaluation-harness
model, so none of those modules imports another's command-line code.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlm.errors import UserError


def check_inputs(args: argparse.Namespace) -> None:
    """Fail before any worker starts when a path is missing or the process counts do not divide."""
    if not Path(args.checkpoint).exists():
        raise UserError(f"checkpoint not found: {args.checkpoint}; pass a checkpoint directory with --checkpoint")
    data = getattr(args, "data", None)
    if data is not None and not Path(data).is_file():
        raise UserError(f"evaluation data not found: {data}; pass an existing file with --data")
    from shardlm.eval.launch import world_size_for

    world_size_for(args)


def load_for_evaluation(args: argparse.Namespace, with_config: bool = False):
    """(ctx, model, tokenizer) of this rank: the process group, the checkpoint's model sharded for
    --tensor-parallel (eval mode), and the tokenizer its config names. `with_config`: (ctx, model, config)
    instead, for callers that bring their own tokenizer (chat generation)."""
    import torch

    from shardlm.checkpoint import load_model
    from shardlm.data.tokenizers import build_tokenizer_for
    from shardlm.parallel import init_distributed

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available; use --device cpu")
    device = torch.device("cpu") if args.device == "cpu" else None
    ctx = init_distributed(args.tensor_parallel, device=device)
    model, config = load_model(args.checkpoint, ctx)
    if config.model.arch not in ("gpt", "llama"):
        raise UserError(f"the checkpoint holds a model.arch={config.model.arch!r} model; eval and generate need "
                        "a causal language model (gpt or llama) checkpoint")
    if with_config:
        return ctx, model, config
    tokenizer = build_tokenizer_for(config.data)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise UserError(f"the checkpoint's tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.cfg.vocab_size}; check the checkpoint's data.tokenizer settings")
    return ctx, model, tokenizer
