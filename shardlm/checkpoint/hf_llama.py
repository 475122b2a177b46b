"""Hugging Face Llama-family interop: `LlamaForCausalLM`, `Qwen3ForCausalLM`, `MixtralForCausalLM`,
`Qwen3MoeForCausalLM`, `Glm4MoeForCausalLM` (GLM-4.5), `Olmo3ForCausalLM` (OLMo 3), `Olmo2ForCausalLM` (OLMo 2),
`MiniMaxM2ForCausalLM` (MiniMax-M2) and `GptOssForCausalLM` (its names and MXFP4 experts:
`shardlm.checkpoint.hf_gpt_oss`) directories <-> shardlm's consolidated checkpoint.

HF's Llama stores every linear as nn.Linear does, (out, in), as shardlm does, and applies rotary
embeddings in the rotate-half layout that `shardlm.models.rotary` uses, so each tensor maps by name
alone: no transpose and no permutation of q/k rows (a round trip is bitwise lossless, and the tests
compare logits with transformers to catch any layout slip). Names:

    model.embed_tokens                   wte            model.norm          ln_f
    model.layers.i.input_layernorm       layers.i.ln_1  lm_head             lm_head (absent when tied)
    model.layers.i.self_attn.{q,k,v,o}_proj          layers.i.attn.{q,k,v,o}
    model.layers.i.post_attention_layernorm          layers.i.ln_2
    model.layers.i.mlp.{gate,up,down}_proj           layers.i.mlp.{gate,up,down}
    model.layers.i.self_attn.{q,k}_norm              layers.i.attn.{q,k}_norm    (Qwen3)
    Mixtral: model.layers.i.block_sparse_moe.gate    layers.i.mlp.router
             ....block_sparse_moe.experts.e.w1/w3/w2 layers.i.mlp.experts.gate/up/down.e
    Qwen3-MoE: model.layers.i.mlp.gate               layers.i.mlp.router
             ....mlp.experts.e.{gate,up,down}_proj   layers.i.mlp.experts.{gate,up,down}.e

Qwen3 is Llama with `qk_norm` (an RMSNorm over each head's q and k) and an explicit `head_dim`.
GLM-4.5 (`glm4_moe`) is Llama with q/k/v biases (`attention_bias`), RoPE on the first half of each head
(`rope_fraction` = partial_rotary_factor, rotate-half as Llama), optional q/k norms (use_qk_norm) and
DeepSeek-V3's routing: `mlp.gate.e_score_correction_bias` -> `router.expert_bias`,
`mlp.shared_experts.*` -> `mlp.shared.*`. Its multi-token prediction layers (`num_nextn_predict_layers`,
stored as layer num_hidden_layers + k with DeepSeek-V3's enorm, hnorm, eh_proj and shared_head.norm) map to
`mtp.k.*`; a directory without their weights (what transformers' save_pretrained writes, since its
Glm4MoeForCausalLM has no MTP module) converts without them, with a note.
OLMo 3 (`olmo3`: post-norms, QK-norm over whole projections, sliding windows), OLMo 2 (`olmo2`: the same block
without windows) and MiniMax-M2 (`minimax_m2`:
whole-projection QK-norm, partial RoPE, sigmoid routing in every layer) are Llama too; their config rules
live in `shardlm.checkpoint.hf_olmo3` and `shardlm.checkpoint.hf_minimax_m2`.
Mixtral and Qwen3-MoE replace each MLP by softmax top-k routing over SwiGLU experts (Mixtral always
renormalises the chosen weights; Qwen3-MoE when `norm_topk_prob`); shardlm's checkpoints store each
expert under its global index, as HF does, so experts map one to one too.
Reads `model.safetensors` or the shards listed in `model.safetensors.index.json`. The default rotary embedding,
YaRN (`rope_yarn_*`: Qwen3's long-context setting) and Llama 3.1's "llama3" scaling (`rope_llama3_*`: Llama 3.1,
3.2 and 3.3) convert; other `rope_scaling` types (dynamic NTK, longrope) are refused, as are biases (but GLM-4.5's
q/k/v ones) and sliding-window attention (but OLMo 3's), each with a one-line error. No network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardlm.checkpoint import hf_gpt_oss, hf_minimax_m2, hf_olmo3
from shardlm.checkpoint.hf_common import (
    MIXTRAL_EXPERTS,
    HFTensor,
    check_pieces,
    drop_missing_mtp,
    llama3_keys,
    rope_parameters,
    rope_parameters_of,
    rope_theta_and_type,
    use_tokenizer,
    weight_files,
    write_directory,
    yarn_keys,
)
from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

MODEL_TYPES = ("llama", "qwen3", "mixtral", "qwen3_moe", "glm4_moe", "gpt_oss", "olmo2", "olmo3", "minimax_m2")
"""The HF model types this module converts."""

def hf_kind(cfg: ModelConfig) -> str:
    """The HF model type of a Llama-family config: "llama", "qwen3", "mixtral", "qwen3_moe", "glm4_moe"
    (sigmoid routing, GLM-4.5), "gpt_oss" (attention sinks), "olmo3" (post-norms, QK-norm over whole projections,
    sliding windows), "olmo2" (the same without windows) or "minimax_m2" (pre-norms, QK-norm over whole projections,
    experts); UserError for what the one HF family with those pieces does not have."""
    if cfg.qk_norm_scope == "projection" and cfg.norm_placement == "pre" and cfg.moe_num_experts:
        hf_minimax_m2.check(cfg)
        return "minimax_m2"
    if cfg.norm_placement == "post" or cfg.qk_norm_scope == "projection":
        hf_olmo3.check(cfg)
        return "olmo3" if any(cfg.is_sliding_layer(i) for i in range(cfg.num_layers)) else "olmo2"
    if cfg.attention_sinks:
        return "gpt_oss"
    if cfg.moe_num_experts and cfg.moe_score == "sigmoid":
        return "glm4_moe"
    if cfg.moe_num_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen3" if cfg.qk_norm else "llama"


"""(shardlm, HF) names of an expert's three matrices in Mixtral's per-expert layout (MiniMax-M2's on disk too)."""


def _moe_names(kind: str, s: str, h: str, experts: int) -> list[tuple[str, str]]:
    """(shardlm, HF) names of one MoE layer's router and experts (`s`, `h`: the layer's prefixes)."""
    if kind in ("mixtral", "minimax_m2"):
        block = f"{h}.block_sparse_moe"
        names = [(f"{s}.mlp.router.weight", f"{block}.gate.weight")]
        if kind == "minimax_m2":  # the score-correction bias sits on the block, not on its gate
            names.append((f"{s}.mlp.router.expert_bias", f"{block}.e_score_correction_bias"))
        return names + [(f"{s}.mlp.experts.{ours}.{e}", f"{block}.experts.{e}.{theirs}.weight")
                        for e in range(experts) for ours, theirs in MIXTRAL_EXPERTS]
    names = [(f"{s}.mlp.router.weight", f"{h}.mlp.gate.weight")]
    if kind == "glm4_moe":  # DeepSeek-V3's names: the score-correction bias and the shared expert
        names += [(f"{s}.mlp.router.expert_bias", f"{h}.mlp.gate.e_score_correction_bias")]
        names += [(f"{s}.mlp.shared.{p}.weight", f"{h}.mlp.shared_experts.{p}_proj.weight")
                  for p in ("gate", "up", "down")]
    return names + [(f"{s}.mlp.experts.{p}.{e}", f"{h}.mlp.experts.{e}.{p}_proj.weight")
                    for e in range(experts) for p in ("gate", "up", "down")]


def name_map(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shardlm name, HF name) of every tensor of a Llama-family model."""
    kind = hf_kind(cfg)
    top = [("wte.weight", "model.embed_tokens.weight"), ("ln_f.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        top.append(("lm_head.weight", "lm_head.weight"))
    layers = []
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}", f"model.layers.{i}"
        norms = ("post_attention", "post_feedforward") if kind in hf_olmo3.KINDS else ("input", "post_attention")
        layers += [(f"{s}.ln_1.weight", f"{h}.{norms[0]}_layernorm.weight"),
                   (f"{s}.ln_2.weight", f"{h}.{norms[1]}_layernorm.weight")]
        layers += [(f"{s}.attn.{p}.weight", f"{h}.self_attn.{p}_proj.weight") for p in "qkvo"]
        if cfg.attention_bias:
            layers += [(f"{s}.attn.{p}.bias", f"{h}.self_attn.{p}_proj.bias") for p in "qkv"]
        if cfg.is_moe_layer(i):
            layers += _moe_names(kind, s, h, cfg.moe_num_experts)
        else:
            layers += [(f"{s}.mlp.{p}.weight", f"{h}.mlp.{p}_proj.weight") for p in ("gate", "up", "down")]
        if cfg.qk_norm:
            layers += [(f"{s}.attn.{p}_norm.weight", f"{h}.self_attn.{p}_norm.weight") for p in "qk"]
    return top + layers + _mtp_names(cfg, kind)


def _mtp_names(cfg: ModelConfig, kind: str) -> list[tuple[str, str]]:
    """GLM-4.5's multi-token prediction depths: depth k is HF layer num_hidden_layers + k, DeepSeek-V3's names."""
    names = []
    for k in range(cfg.mtp_layers if kind == "glm4_moe" else 0):
        s, h = f"mtp.{k}", f"model.layers.{cfg.num_layers + k}"
        names += [(f"{s}.enorm.weight", f"{h}.enorm.weight"), (f"{s}.hnorm.weight", f"{h}.hnorm.weight"),
                  (f"{s}.eh_proj", f"{h}.eh_proj.weight"), (f"{s}.post_norm.weight", f"{h}.shared_head.norm.weight"),
                  (f"{s}.block.ln_1.weight", f"{h}.input_layernorm.weight"),
                  (f"{s}.block.ln_2.weight", f"{h}.post_attention_layernorm.weight")]
        names += [(f"{s}.block.attn.{p}.weight", f"{h}.self_attn.{p}_proj.weight") for p in "qkvo"]
        if cfg.attention_bias:
            names += [(f"{s}.block.attn.{p}.bias", f"{h}.self_attn.{p}_proj.bias") for p in "qkv"]
        if cfg.qk_norm:
            names += [(f"{s}.block.attn.{p}_norm.weight", f"{h}.self_attn.{p}_norm.weight") for p in "qk"]
        names += [(ours.replace(f"layers.{cfg.num_layers + k}", f"{s}.block", 1), theirs)
                  for ours, theirs in _moe_names(kind, f"layers.{cfg.num_layers + k}", h, cfg.moe_num_experts)]
    return names


def _moe_from_hf(hf: dict) -> dict:
    """The `model.moe_*` keys of a Mixtral or Qwen3-MoE config ({} for a dense model); UserError for
    routing shardlm does not compute."""
    kind = hf.get("model_type")
    if kind == "mixtral":
        if hf.get("router_jitter_noise"):
            raise UserError("the HF model has router_jitter_noise, which shardlm's router does not compute")
        return {"moe_num_experts": hf["num_local_experts"], "moe_top_k": hf["num_experts_per_tok"],
                "moe_ffn_hidden_size": hf["intermediate_size"], "moe_norm_topk_prob": True,
                "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}
    if kind == "glm4_moe":
        return _glm4_moe_routing(hf)
    if kind == "minimax_m2":
        return hf_minimax_m2.routing(hf)
    if kind != "qwen3_moe":
        return {}
    dense = list(hf.get("mlp_only_layers") or [])
    if hf.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
        raise UserError("the HF model's MoE layers (decoder_sparse_step / mlp_only_layers) are not "
                        "'every layer after the first k', the pattern shardlm computes")
    experts = hf.get("num_experts") or hf["num_local_experts"]  # transformers 5 writes the second name
    return {"moe_num_experts": experts, "moe_top_k": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_first_dense_layers": len(dense),
            "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}


def _glm4_moe_routing(hf: dict) -> dict:
    """GLM-4.5's `model.moe_*` keys: DeepSeek-V3's routing (sigmoid scores with the score-correction bias,
    group-limited top-k, a shared expert, dense first layers, routed scaling)."""
    groups = hf.get("n_group") or 1
    if (hf.get("n_shared_experts") or 0) < 1 or (groups > 1 and hf["n_routed_experts"] // groups < 2):
        raise UserError("the HF model has no shared expert or one-expert groups, which shardlm's GLM-4.5 does "
                        "not compute")
    return {"moe_num_experts": hf["n_routed_experts"], "moe_top_k": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_shared_experts": hf["n_shared_experts"],
            "moe_first_dense_layers": min(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]),
            "moe_score": "sigmoid", "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "moe_routed_scaling": float(hf.get("routed_scaling_factor", 1.0)),
            "moe_groups": groups if groups > 1 else 0, "moe_topk_groups": (hf.get("topk_group") or 1) if groups > 1
            else 0, "moe_expert_bias": True, "mtp_layers": hf.get("num_nextn_predict_layers") or 0}


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section for a HF LlamaConfig, Qwen3Config, Olmo2Config, Olmo3Config or MiniMaxM2Config dict
    (or their MoE relatives'); UserError for what shardlm's Llama does not compute."""
    if hf.get("model_type") == "minimax_m2":
        hf = hf_minimax_m2.config(hf)
    heads = hf["num_attention_heads"]
    glm = hf.get("model_type") == "glm4_moe"
    olmo3 = hf.get("model_type") == "olmo3"
    minimax = hf.get("model_type") == "minimax_m2"
    qwen3 = hf.get("model_type") in ("qwen3", "qwen3_moe") or (glm and bool(hf.get("use_qk_norm")))
    theta, rope_type = hf_olmo3.rope(hf) if olmo3 else rope_theta_and_type(hf)
    fraction = 1.0  # Llama, Qwen3, Mixtral, Qwen3-MoE and OLMo 2 rotate whole heads whatever partial_rotary_factor says
    if glm or minimax:
        fraction = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    refusals = [
        (rope_type in ("default", "yarn", "llama3"),
         f"rope type {rope_type!r} (the default rotary embedding, YaRN and Llama 3.1's llama3 convert)"),
        (rope_type == "default" or not minimax, f"rope type {rope_type!r} (MiniMaxM2ForCausalLM has none)"),
        ((glm or not hf.get("attention_bias")) and not hf.get("mlp_bias"), "biases (attention_bias / mlp_bias)"),
        (hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')!r} (SwiGLU needs silu)"),
        (olmo3 or not hf.get("use_sliding_window") and (hf.get("model_type") != "mixtral"
                                                         or not hf.get("sliding_window")),
         "sliding-window attention (use_sliding_window / sliding_window)"),
    ]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's llama does not compute")
    scaling = {"yarn": lambda: yarn_keys(rope_parameters(hf), hf["max_position_embeddings"]),
               "llama3": lambda: llama3_keys(rope_parameters(hf))}.get(rope_type, dict)()
    family = (hf_olmo3.from_hf(hf) if olmo3 else hf_olmo3.POST_NORMS if hf.get("model_type") == "olmo2"
              else {"qk_norm": True, "qk_norm_scope": "projection"} if minimax else {"qk_norm": qwen3})
    return ModelConfig(arch="llama", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                       num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                       seq_length=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                       ffn_hidden_size=hf["intermediate_size"], dropout=0.0,
                       attention_dropout=float(hf.get("attention_dropout", 0.0)),
                       layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
                       rope_theta=theta, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       head_dim=0 if hf.get("head_dim") in (None, hf["hidden_size"] // heads) else hf["head_dim"],
                       attention_bias=glm and bool(hf.get("attention_bias")),
                       rope_fraction=float(fraction or 1.0), **family, **scaling, **_moe_from_hf(hf))


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "olmo3": "Olmo3ForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM"}


ROPE_SCALINGS = ("rope_yarn_factor", "rope_llama3_factor")
PIECES_OF = {"glm4_moe": ROPE_SCALINGS + ("moe_routed_scaling", "rope_fraction"),
             "olmo2": ROPE_SCALINGS + ("norm_placement", "qk_norm_scope"),
             "olmo3": ("norm_placement", "qk_norm_scope", "rope_yarn_factor", "sliding_window"),
             "minimax_m2": ("qk_norm_scope", "rope_fraction")}
"""The `hf_common.PIECES` each class computes; the others here have YaRN and Llama 3.1's scaling (`ROPE_SCALINGS`)."""


def _moe_to_hf(cfg: ModelConfig, kind: str) -> dict:
    """The HF MoE keys of a Mixtral, Qwen3-MoE, GLM-4.5 or MiniMax-M2 model; UserError for routing it does not
    compute."""
    if kind == "glm4_moe":
        return _glm4_moe_to_hf(cfg)
    if kind == "minimax_m2":
        return hf_minimax_m2.to_hf(cfg)
    unsupported = [(cfg.moe_score != "softmax", f'moe_score="{cfg.moe_score}"'),
                   (cfg.moe_shared_experts > 0, "shared experts"), (cfg.moe_groups > 0, "group-limited routing"),
                   (cfg.moe_routed_scaling != 1.0, "moe_routed_scaling"), (cfg.moe_layer_interval != 1,
                                                                           "moe_layer_interval > 1"),
                   (cfg.moe_expert_bias_rate > 0, "expert bias (moe_expert_bias_rate)"),
                   (kind == "mixtral" and not cfg.moe_norm_topk_prob, "moe_norm_topk_prob = false"),
                   (kind == "mixtral" and cfg.moe_first_dense_layers > 0, "dense first layers")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{ARCHITECTURES[kind]} has no {what}; this MoE model does not convert to it")
    common = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
              "output_router_logits": False}
    if kind == "mixtral":
        return {**common, "num_local_experts": cfg.moe_num_experts, "intermediate_size": cfg.moe_ffn_size,
                "sliding_window": None, "router_jitter_noise": 0.0}
    return {**common, "num_experts": cfg.moe_num_experts, "moe_intermediate_size": cfg.moe_ffn_size,
            "norm_topk_prob": cfg.moe_norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.moe_first_dense_layers))}


def _glm4_moe_to_hf(cfg: ModelConfig) -> dict:
    """Glm4MoeConfig's routing keys (sigmoid scores, score-correction bias, shared experts)."""
    unsupported = [(cfg.moe_shared_experts < 1, "no shared expert"), (cfg.moe_layer_interval != 1,
                                                                      "moe_layer_interval > 1"),
                   (cfg.moe_groups > 0 and cfg.moe_num_experts // cfg.moe_groups < 2, "one-expert groups")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"Glm4MoeForCausalLM has {what}; this MoE model does not convert to it")
    return {"n_routed_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
            "moe_intermediate_size": cfg.moe_ffn_size, "n_shared_experts": cfg.moe_shared_experts,
            "first_k_dense_replace": cfg.moe_first_dense_layers, "n_group": cfg.moe_groups or 1,
            "topk_group": cfg.moe_topk_groups or 1, "norm_topk_prob": cfg.moe_norm_topk_prob,
            "routed_scaling_factor": cfg.moe_routed_scaling, "use_qk_norm": cfg.qk_norm,
            "num_nextn_predict_layers": cfg.mtp_layers}


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """The HF config.json of a Llama-family model (`hf_kind`: Llama, Qwen3, Mixtral, Qwen3-MoE, GLM-4.5, gpt-oss,
    OLMo 2, OLMo 3 or MiniMax-M2); UserError (one line) for a piece the chosen class would silently drop."""
    kind = hf_kind(cfg)
    if kind == "gpt_oss":
        return hf_gpt_oss.hf_config_from_model(cfg)
    family = _moe_to_hf(cfg, kind) if cfg.moe_num_experts else hf_olmo3.to_hf(cfg, kind) if kind in hf_olmo3.KINDS \
        else {}
    check_pieces(cfg, ARCHITECTURES[kind], has=PIECES_OF.get(kind, ROPE_SCALINGS))
    return {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.attention_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length, "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std, "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope_parameters_of(cfg),
                            **({"partial_rotary_factor": cfg.rope_fraction} if cfg.rope_fraction != 1 else {})},
        "attention_bias": cfg.attention_bias, "mlp_bias": False, "attention_dropout": cfg.attention_dropout_p,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32", **family,
    }


def open_hf(hf_dir: Path) -> tuple[RunConfig, dict]:
    """(config, {shardlm name: its `hf_common.HFTensor`}) of a local HF Llama-family directory (Llama, Qwen3,
    Mixtral, Qwen3-MoE); nothing is read until a tensor is asked for, and then only the rows asked for."""
    located = weight_files(hf_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    gpt_oss = hf_config.get("model_type") == "gpt_oss"
    config = RunConfig(model=(hf_gpt_oss.model_config_from_hf if gpt_oss else model_config_from_hf)(hf_config))
    use_tokenizer(config, hf_dir)
    drop_missing_mtp(config.model, located, hf_dir)
    if gpt_oss:
        return config, hf_gpt_oss.sources_for(config.model, located, hf_dir)
    if config.model.tie_embeddings is False and "lm_head.weight" not in located:
        config.model.tie_embeddings = True  # a tied model saved without its (shared) output weight
    handles: dict = {}
    sources = {}
    minimax = hf_config.get("model_type") == "minimax_m2"
    for ours, theirs in name_map(config.model):
        if theirs not in located and minimax:  # transformers' in-memory names: the experts stacked
            sources[ours] = hf_minimax_m2.in_memory_source(handles, located, config.model, ours, theirs, hf_dir)
            continue
        if theirs not in located:
            raise UserError(f"{hf_dir} has no tensor {theirs}")
        sources[ours] = HFTensor(handles, located[theirs], theirs)
    return config, sources


def to_hf(config: RunConfig, tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write a consolidated Llama-family checkpoint's (config, tensors) as a HF directory (`hf_config_from_model`)."""
    cfg = config.model
    hf_config = hf_config_from_model(cfg)  # its refusals before any tensor is converted
    hf = {}
    for ours, theirs in ([] if cfg.attention_sinks else name_map(cfg)):
        value = tensors.get(f"model/{ours}")
        if value is None and ours.endswith("router.expert_bias"):  # a router trained without one: a zero bias
            value = torch.zeros(cfg.moe_num_experts)
        hf[theirs] = (value[: cfg.vocab_size] if ours in ("wte.weight", "lm_head.weight") else value).contiguous()
    if cfg.attention_sinks:
        hf = hf_gpt_oss.tensors_to_hf(cfg, tensors)
    return write_directory(out_dir, hf, hf_config, config.data)
