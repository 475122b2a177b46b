"""Hugging Face Gemma 4 interop: `Gemma4ForCausalLM` directories (model_type "gemma4_text") and the language model of
the published multimodal ones (`Gemma4ForConditionalGeneration`, model_type "gemma4", the text model under
`model.language_model.`) <-> shardlm's consolidated checkpoint (`shardlm.models.gemma`). Names map one to one (no
transpose, no permutation; a round trip is bitwise):

    embed_tokens / norm                         wte / ln_f
    embed_tokens_per_layer                      ple_wte        (per-layer inputs)
    per_layer_model_projection / per_layer_projection_norm      ple_projection / ple_norm
    layers.i.input_layernorm / post_attention_layernorm         layers.i.ln_1 / ln_1_post
    layers.i.pre_feedforward_layernorm / post_feedforward_layernorm   layers.i.ln_2 / ln_2_post
    layers.i.self_attn.{q,k,v,o}_proj / {q,k}_norm              layers.i.attn.{q,k,v,o} / {q,k}_norm
    layers.i.mlp.{gate,up,down}_proj            layers.i.mlp.{gate,up,down}  (layers.i.mlp.dense.* with experts)
    layers.i.per_layer_input_gate / per_layer_projection / post_per_layer_input_norm   layers.i.ple_gate / ple_proj /
                                                                                        ple_norm
    layers.i.layer_scalar                       layers.i.layer_scalar
    layers.i.router.{proj.weight,scale,per_expert_scale}   layers.i.mlp.router.{weight,scale,per_expert_scale}
    layers.i.experts.gate_up_proj[e] (gate rows, then up) / down_proj[e]   layers.i.mlp.experts.{gate,up,down}.e
    layers.i.post_feedforward_layernorm_1 / pre_feedforward_layernorm_2 / post_feedforward_layernorm_2
                                                layers.i.mlp.ln_dense_post / ln_experts / ln_experts_post

Layers that share another's keys and values have no k/v projections or k_norm (transformers drops them too); v_norm
has no weight. A multimodal directory's vision and audio towers (`model.vision_tower.`, `model.audio_tower.`,
`model.embed_vision.`, `model.embed_audio.`) are left out with a note naming them; any other weight no shardlm tensor
reads is refused in one line (transformers' text class would load such a directory and silently drop every
`model.language_model.` weight). `to_hf` writes the text model, `Gemma4ForCausalLM`; asking it for the towers
(`include_towers`) is refused in one line naming them. Refused in one line too: attention biases, an activation other
than the tanh GeLU, bidirectional attention ("all"), rotary embeddings other than the default (sliding layers) and
proportional (full layers) ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from shardlm.checkpoint.hf_common import (
    HFTensor,
    stacked_expert,
    text_config,
    use_tokenizer,
    weight_files,
    write_directory,
)
from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.models.gemma_config import FULL, SLIDING, kv_source

MODEL_TYPES = ("gemma4", "gemma4_text")
"""The HF model types this module converts (the multimodal directory and the text model)."""
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
"""A multimodal directory's weights that shardlm's language model leaves out."""


def _rope(hf: dict) -> dict:
    """The rotary keys of the [model] section from Gemma 4's per-layer-type rope_parameters; UserError for a kind
    shardlm does not compute."""
    params = hf.get("rope_parameters") or {}
    sliding = params.get(SLIDING) or {"rope_type": "default", "rope_theta": 10_000.0}
    full = params.get(FULL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
            "default", "proportional") or float(full.get("factor", 1.0)) != 1.0:
        raise UserError(f"the HF model's rope_parameters {params} are not Gemma 4's (default on sliding layers, "
                        "default or unscaled proportional on full layers), which shardlm computes")
    fraction = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    return {"rope_theta": float(sliding.get("rope_theta", 10_000.0)), "global_rope_theta": float(full["rope_theta"]),
            "global_rope_fraction": fraction}


def _global_shape(hf: dict, layer_types: list[str]) -> dict:
    """The full-attention layers' head size and KV heads: config.json's global_head_dim / num_global_key_value_heads
    (what Gemma4TextConfig reads; 512 and num_key_value_heads when absent), or the per_layer_config entries
    transformers writes (one per full layer, all alike: UserError otherwise)."""
    entries = {int(i): entry for i, entry in (hf.get("per_layer_config") or {}).items()}
    full = entries.get(layer_types.index(FULL), {}) if entries else {}
    if entries and (set(entries) != {i for i, kind in enumerate(layer_types) if kind == FULL}
                    or any(entry != full for entry in entries.values())):
        raise UserError(f"the HF model's per_layer_config {hf['per_layer_config']} is not one override of the full "
                        "layers' head size and KV heads, which shardlm's Gemma 4 computes")
    if "per_layer_config" in hf:  # transformers 5 writes the overrides only (none where they equal the base)
        return {"global_head_dim": int(full.get("head_dim") or hf.get("head_dim", 256)),
                "global_kv_heads": int(full.get("num_key_value_heads") or hf["num_key_value_heads"])}
    kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
    return {"global_head_dim": int(hf.get("global_head_dim") or 512),
            "global_kv_heads": int(kv or hf["num_key_value_heads"])}


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section for a Gemma4Config or Gemma4TextConfig dict; UserError for what it does not compute."""
    hf = text_config(hf)
    refusals = [(not hf.get("attention_bias"), "attention biases"),
                (hf.get("hidden_activation", "gelu_pytorch_tanh") == "gelu_pytorch_tanh",
                 f"hidden_activation={hf.get('hidden_activation')!r} (its MLPs use the tanh GeLU)"),
                (hf.get("use_bidirectional_attention") != "all", 'use_bidirectional_attention="all"')]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's Gemma 4 does not compute")
    layers = hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
    layer_types[-1] = FULL  # as Gemma4TextConfig forces it
    moe = {}
    if hf.get("enable_moe_block"):
        moe = {"moe_beside_mlp": True, "moe_num_experts": hf["num_experts"], "moe_top_k": hf["top_k_experts"],
               "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_aux_loss_coeff": 0.0}
    ple = hf.get("hidden_size_per_layer_input") or 0
    cap = hf.get("final_logit_softcapping")
    return ModelConfig(
        arch="llama", sandwich_norms=True, num_layers=layers, hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"], head_dim=hf.get("head_dim", 256),
        seq_length=hf.get("max_position_embeddings", 131_072), vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf["intermediate_size"], activation="gelu_tanh", dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0), layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        init_std=hf.get("initializer_range", 0.02), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qk_norm=True, value_norm=True, attention_scale=1.0, embedding_scale=True,
        sliding_window=hf.get("sliding_window", 512) if SLIDING in layer_types else 0,
        layer_types=layer_types if SLIDING in layer_types else [],
        attention_k_eq_v=bool(hf.get("attention_k_eq_v")), kv_shared_layers=hf.get("num_kv_shared_layers") or 0,
        kv_shared_double_mlp=bool(hf.get("use_double_wide_mlp")), per_layer_input_size=ple,
        per_layer_vocab_size=(hf.get("vocab_size_per_layer_input") or hf["vocab_size"]) if ple else 0,
        final_logit_softcap=float(cap or 0.0), **_rope(hf), **_global_shape(hf, layer_types), **moe)


def name_map(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shardlm name, HF name under the text model's prefix) of every tensor of a Gemma 4 config."""
    names = [("wte.weight", "embed_tokens.weight"), ("ln_f.weight", "norm.weight")]
    if cfg.per_layer_input_size:
        names += [("ple_wte.weight", "embed_tokens_per_layer.weight"),
                  ("ple_projection.weight", "per_layer_model_projection.weight"),
                  ("ple_norm.weight", "per_layer_projection_norm.weight")]
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}", f"layers.{i}"
        names += [(f"{s}.{ours}.weight", f"{h}.{theirs}.weight") for ours, theirs in (
            ("ln_1", "input_layernorm"), ("ln_1_post", "post_attention_layernorm"),
            ("ln_2", "pre_feedforward_layernorm"), ("ln_2_post", "post_feedforward_layernorm"))]
        names += [(f"{s}.layer_scalar", f"{h}.layer_scalar")]
        projections = ["q", "o", "q_norm"]
        if kv_source(cfg, i) is None:
            projections += ["k", "k_norm"] + ([] if cfg.attention_k_eq_v and not cfg.is_sliding_layer(i) else ["v"])
        names += [(f"{s}.attn.{p}.weight", f"{h}.self_attn.{p if 'norm' in p else p + '_proj'}.weight")
                  for p in projections]
        dense = f"{s}.mlp.dense" if cfg.moe_beside_mlp else f"{s}.mlp"
        names += [(f"{dense}.{p}.weight", f"{h}.mlp.{p}_proj.weight") for p in ("gate", "up", "down")]
        if cfg.per_layer_input_size:
            names += [(f"{s}.ple_gate.weight", f"{h}.per_layer_input_gate.weight"),
                      (f"{s}.ple_proj.weight", f"{h}.per_layer_projection.weight"),
                      (f"{s}.ple_norm.weight", f"{h}.post_per_layer_input_norm.weight")]
        if cfg.moe_beside_mlp:
            names += [(f"{s}.mlp.router.weight", f"{h}.router.proj.weight"), (f"{s}.mlp.router.scale",
                                                                              f"{h}.router.scale"),
                      (f"{s}.mlp.router.per_expert_scale", f"{h}.router.per_expert_scale"),
                      (f"{s}.mlp.ln_dense_post.weight", f"{h}.post_feedforward_layernorm_1.weight"),
                      (f"{s}.mlp.ln_experts.weight", f"{h}.pre_feedforward_layernorm_2.weight"),
                      (f"{s}.mlp.ln_experts_post.weight", f"{h}.post_feedforward_layernorm_2.weight")]
            names += [(f"{s}.mlp.experts.{p}.{e}", f"{h}.experts.{e}.{p}_proj.weight")
                      for e in range(cfg.moe_num_experts) for p in ("gate", "up", "down")]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    return names


def _prefix(located: dict) -> str:
    """Where the text model's weights live: "model.language_model." (multimodal) or "model." (text model)."""
    return "model.language_model." if any(n.startswith("model.language_model.") for n in located) else "model."


def open_hf(hf_dir: Path) -> tuple[RunConfig, dict[str, HFTensor]]:
    """(config, {shardlm name: its `HFTensor`}) of a Gemma 4 directory, its language model read in place (module
    docstring); nothing is read until asked for."""
    located = weight_files(hf_dir)
    config = RunConfig(model=model_config_from_hf(json.loads((hf_dir / "config.json").read_text())))
    use_tokenizer(config, hf_dir)
    prefix, handles, sources = _prefix(located), {}, {}
    for ours, theirs in name_map(config.model):
        name = theirs if theirs == "lm_head.weight" else prefix + theirs
        if ".experts." in name:
            sources[ours] = stacked_expert(handles, located, config.model, ours, name, hf_dir)
        elif name not in located:
            raise UserError(f"{hf_dir} has no tensor {name}")
        else:
            sources[ours] = HFTensor(handles, located[name], name)
    towers = sorted({tower.rstrip(".") for tower in TOWERS for n in located if n.startswith(tower)})
    placed = {source.name for source in sources.values()}
    left = sorted(n for n in located if n not in placed and not n.startswith(TOWERS))
    if left:
        raise UserError(f"{hf_dir} holds {len(left)} language-model weights shardlm would not read (first: "
                        f"{left[0]}); its config.json does not describe them")
    if towers:
        print(f"note: {hf_dir} is a multimodal Gemma 4; shardlm reads its language model and leaves out "
              f"{', '.join(towers)}", file=sys.stderr)
    return config, sources


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """Gemma4TextConfig's config.json (`Gemma4ForCausalLM`) of a Gemma 4 model config."""
    full = {"rope_type": "proportional", "partial_rotary_factor": cfg.global_rope_fraction,
            "rope_theta": cfg.global_rope_theta or cfg.rope_theta}
    layer_types = [SLIDING if cfg.is_sliding_layer(i) else FULL for i in range(cfg.num_layers)]
    moe = {"enable_moe_block": cfg.moe_beside_mlp, "num_experts": cfg.moe_num_experts or None,
           "top_k_experts": cfg.moe_top_k if cfg.moe_beside_mlp else None,
           "moe_intermediate_size": cfg.moe_ffn_size if cfg.moe_beside_mlp else None}
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attention_head_dim,
        "global_head_dim": cfg.global_head_dim or cfg.attention_head_dim,
        "num_global_key_value_heads": cfg.global_kv_heads or cfg.kv_heads,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.layernorm_epsilon, "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "attention_dropout": cfg.attention_dropout_p, "sliding_window": cfg.sliding_window or 512,
        "layer_types": layer_types,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_theta}, FULL: full},
        "final_logit_softcapping": cfg.final_logit_softcap or None,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
        "hidden_size_per_layer_input": cfg.per_layer_input_size, "attention_k_eq_v": cfg.attention_k_eq_v,
        "num_kv_shared_layers": cfg.kv_shared_layers, "use_double_wide_mlp": cfg.kv_shared_double_mlp,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32", **moe}


def check_exportable(cfg: ModelConfig) -> None:
    """UserError (one line) for a sandwich-norm model that Gemma4ForCausalLM does not compute."""
    unsupported = [(not cfg.qk_norm or not cfg.value_norm, "a model without q/k/v norms"),
                   (cfg.attention_scale != 1.0, f"attention_scale={cfg.attention_scale} (its softmax scale is 1)"),
                   (not cfg.embedding_scale, "unscaled word embeddings"),
                   (cfg.activation != "gelu_tanh", f'activation="{cfg.activation}" (its MLPs use the tanh GeLU)'),
                   (cfg.attention_bias or cfg.attention_output_bias, "attention biases"),
                   (cfg.global_kv_heads not in (0, cfg.kv_heads) and not cfg.attention_k_eq_v,
                    "global_kv_heads without attention_k_eq_v")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"Gemma4ForCausalLM has no {what}; this model does not convert to it")


def to_hf(config: RunConfig, tensors: dict[str, torch.Tensor], out_dir: Path, include_towers: bool = False) -> Path:
    """Write a consolidated Gemma 4 checkpoint's (config, tensors) as a `Gemma4ForCausalLM` directory. The towers of a
    multimodal Gemma 4 were never read: `include_towers` is refused in one line."""
    if include_towers:
        raise UserError("shardlm holds Gemma 4's language model only; its vision and audio towers "
                        f"({', '.join(t.rstrip('.') for t in TOWERS)}) were left out when it was read and cannot be "
                        "exported: copy them from the original directory")
    cfg = config.model
    check_exportable(cfg)
    hf = {}
    for ours, theirs in name_map(cfg):
        value = tensors[f"model/{ours}"]
        if ours in ("wte.weight", "lm_head.weight"):
            value = value[: cfg.vocab_size]
        if ".experts." in ours:
            continue
        hf[theirs if theirs == "lm_head.weight" else f"model.{theirs}"] = value.contiguous()
    for i in range(cfg.num_layers if cfg.moe_beside_mlp else 0):
        experts = [[tensors[f"model/layers.{i}.mlp.experts.{p}.{e}"] for e in range(cfg.moe_num_experts)]
                   for p in ("gate", "up", "down")]
        gate_up = torch.stack([torch.cat((g, u)) for g, u in zip(experts[0], experts[1])])
        hf[f"model.layers.{i}.experts.gate_up_proj"] = gate_up.contiguous()
        hf[f"model.layers.{i}.experts.down_proj"] = torch.stack(experts[2]).contiguous()
    return write_directory(out_dir, hf, hf_config_from_model(cfg), config.data)
