"""Whether a checkpoint fits the run that loads it: the same model shape and, for a LoRA run, the same frozen base.

A resume needs the model keys that fix the tensors' shapes (`SHAPE_KEYS`) to be the checkpoint's
(`check_compatible`). A LoRA run saves its adapters (and whatever `modules_to_save` trains) with their optimizer,
never the base: the base comes back from `checkpoint.init_from` on every resume. So the checkpoint names it: the
path it was read from and a fingerprint, the sha256 of the list of its weight files' names, sizes and sha256 (a run
started from random weights: of the model shape, init scale and seed that drew them). Hashing reads the base once
per run (about 1 GB/s on one core); loading adapters on a base whose fingerprint differs is a one-line error
(`check_base`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from shardlm.checkpoint import files
from shardlm.config import RunConfig
from shardlm.errors import UserError

SHAPE_KEYS = ("arch", "num_layers", "hidden_size", "num_heads", "vocab_size", "ffn_hidden_size", "activation",
              "num_kv_heads", "tie_embeddings", "moe_num_experts", "moe_ffn_hidden_size", "moe_shared_experts",
              "moe_first_dense_layers", "moe_layer_interval", "head_dim", "qk_norm", "attention", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attention_bias",
              "attention_output_bias", "attention_sinks", "moe_router_bias", "moe_linear_bias", "qk_norm_scope",
              "norm_placement", "index_heads", "index_head_dim", "index_layer_types", "layer_pattern",
              "mamba_num_heads", "mamba_head_dim", "mamba_state_size", "mamba_groups", "mamba_conv_kernel",
              "mamba_conv_bias", "sandwich_norms", "global_head_dim", "global_kv_heads", "attention_k_eq_v",
              "kv_shared_layers", "kv_shared_double_mlp", "per_layer_input_size", "per_layer_vocab_size",
              "moe_beside_mlp", "linear_attention_rule")
"""The [model] keys a checkpoint's tensors depend on: a resume must set each as the checkpoint's run did."""


def check_compatible(saved: dict, config: RunConfig) -> None:
    """UserError (one line) naming the first of `SHAPE_KEYS` where the checkpoint's config (`saved`, its meta)
    differs from the run's `config`."""
    model = dataclasses.asdict(config.model)
    defaults = dataclasses.asdict(type(config.model)())  # keys older checkpoints do not have
    for key in SHAPE_KEYS:
        if saved["config"]["model"].get(key, defaults[key]) != model[key]:
            raise UserError(f"checkpoint has model.{key}={saved['config']['model'].get(key)!r} but the run has "
                            f"{model[key]!r}; use the checkpoint's model settings")


def weight_files(path: Path) -> list[Path]:
    """The weight files of a base: a consolidated file itself; a directory's .safetensors files (a Hugging Face
    model, a sharded checkpoint's step folder or its `latest`), sorted by name."""
    if path.is_file():
        return [path]
    if not (path / "config.json").is_file() and ((path / files.META).is_file() or (path / files.LATEST).is_file()):
        path = files.resolve(path)
    return sorted(path.glob("*.safetensors"))


def fingerprint(config: RunConfig) -> dict:
    """{"base": what it is, "sha256": its fingerprint} of the run's frozen base (module docstring)."""
    source = config.checkpoint.init_from
    if not source:  # what draws the weights: the shape, the init scale and the seed (not dropout or the length)
        model = dataclasses.asdict(config.model)
        drawn = {key: model[key] for key in (*SHAPE_KEYS, "init_std", "num_layers")}
        shape = json.dumps({"model": drawn, "seed": config.train.seed}, sort_keys=True)
        return {"base": f"random initialization (train.seed={config.train.seed})",
                "sha256": hashlib.sha256(shape.encode()).hexdigest()}
    listing = [(p.name, p.stat().st_size, files.sha256_of(p)) for p in weight_files(Path(source))]
    return {"base": str(source), "sha256": hashlib.sha256(json.dumps(listing).encode()).hexdigest()}


def shared_fingerprint(config: RunConfig, ctx) -> dict:
    """`fingerprint` hashed on the main rank only and given to every rank (collective over the world)."""
    return ctx.world.all_gather_object(fingerprint(config) if ctx.is_main else None)[0]


def check_base(saved: dict, config: RunConfig, current: dict) -> None:
    """UserError (one line) when the checkpoint's adapters (`saved`, its meta's "lora") were trained on another
    base than the run's (`current`, this run's `fingerprint`)."""
    if saved["sha256"] != current["sha256"]:
        raise UserError(f"the checkpoint's adapters were trained on the base {saved['base']} (sha256 "
                        f"{saved['sha256'][:12]}), but this run's base is {current['base']} (sha256 "
                        f"{current['sha256'][:12]}); set checkpoint.init_from to the base the adapters were trained on")
