"""The networks, built from the tensor-parallel layers, and how the trainer computes their loss.

`build_model(cfg, ctx, ...)` picks the class by `cfg.arch`; `training_loss(arch)` returns the function
`loss(forward, batch) -> scalar` the trainer calls once per micro-batch, where `forward` is the model
(or its DDP wrapper, which must be called for gradient reduction to happen) and `batch` is a
micro-batch as `shardlm.training.data.micro_batches` stacks it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardlm.models.config import ModelConfig, ParallelOptions

ARCHITECTURES = ("gpt", "bert", "llama")


def build_model(cfg: ModelConfig, ctx, seed: int = 1234, activation_checkpointing: bool = False,
                recompute: str | None = None, sequence_parallel: bool = False,
                layer_ids: list[int] | None = None, options: ParallelOptions | None = None,
                finish_layer=None) -> torch.nn.Module:
    """The model `cfg.arch` names, sharded over `ctx`'s tensor-parallel group.

    `recompute` is "none", "selective" (the attention core) or "full" (whole layers; what
    `activation_checkpointing=True` means); `sequence_parallel` splits the replicated activations
    along the sequence; `layer_ids` builds only those layers (a pipeline rank's), under their own
    indices; `options` says how the layers talk over `ctx`'s groups (default `ParallelOptions()`);
    `finish_layer(layer)` runs on each transformer layer as soon as it is built, before the next (QLoRA
    quantizes it there, so the full-precision layers are never all held at once; GPT and Llama).
    Selective recomputation, sequence parallelism and pipeline stages are GPT's and Llama's (the config
    refuses them for BERT)."""
    recompute = recompute or ("full" if activation_checkpointing else "none")
    if cfg.arch == "gpt":
        from shardlm.models.gpt import GPT

        return GPT(cfg, ctx, seed=seed, recompute=recompute, sequence_parallel=sequence_parallel, layer_ids=layer_ids,
                   options=options, finish_layer=finish_layer)
    if cfg.arch == "llama":
        from shardlm.models.llama import Llama

        return Llama(cfg, ctx, seed=seed, recompute=recompute, sequence_parallel=sequence_parallel,
                     layer_ids=layer_ids, options=options, finish_layer=finish_layer)
    if recompute == "selective" or sequence_parallel or layer_ids is not None:
        raise ValueError(f"model.arch={cfg.arch!r} has no selective recomputation or sequence parallelism")
    if cfg.arch == "bert":
        from shardlm.models.bert import BERT

        return BERT(cfg, ctx, seed=seed, activation_checkpointing=recompute == "full")
    raise ValueError(f"unknown model.arch {cfg.arch!r}")


def gpt_loss(forward, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | dict) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T + 1) token batch, or of an (inputs, targets) pair of (B, T')
    (a context-parallel rank's part, `shardlm.training.data.context_parallel_part`). Packed rows (a dict
    of `inputs`, `targets`, `documents`, `divisor`, `shardlm.training.data.packed_parts`): the sum of the
    trained tokens' losses over `divisor` (the mean when it is None). With `mtp` in the dict (DeepSeek-V3's
    multi-token prediction, `shardlm.training.data.add_multi_token_targets`): the value is the next-token
    loss, the gradient adds `mtp_weight` x the mean over depths, recorded in `batch["mtp_loss"]`. With `dft` in the
    dict the next-token losses are Dynamic Fine-Tuning's (`dynamic_fine_tuning`)."""
    if isinstance(batch, dict):
        mtp = batch.get("mtp")
        losses = forward(batch["inputs"], batch["targets"], documents=batch["documents"], mtp=mtp)
        main = losses[0] if mtp is not None else losses
        if batch.get("dft"):
            main = dynamic_fine_tuning(main)
        loss = main.mean() if batch["divisor"] is None else main.sum() / batch["divisor"]
        if mtp is None:
            return loss
        from shardlm.models.mtp import add_mtp_gradient

        loss, batch["mtp_loss"] = add_mtp_gradient(loss, losses[1:], batch["mtp_divisors"], batch["mtp_weight"])
        return loss
    inputs, targets = batch if isinstance(batch, tuple) else (batch[:, :-1], batch[:, 1:])
    return forward(inputs, targets).mean()


def dynamic_fine_tuning(token_losses: torch.Tensor) -> torch.Tensor:
    """Dynamic Fine-Tuning (Wu et al., 2025; TRL's SFT loss_type "dft"): each token's loss -log p times p, the
    token's probability exp(-loss) without gradient; ignored positions (loss 0) stay 0. Any shape."""
    return token_losses * torch.exp(-token_losses.detach())


def training_loss(arch: str) -> Callable:
    if arch == "bert":
        from shardlm.models.bert import bert_loss

        return bert_loss
    return gpt_loss
