"""Hugging Face interop of Kimi Linear: `KimiLinearForCausalLM` directories (model_type "kimi_linear") <->
shardlm's consolidated checkpoint of a Llama with Kimi Delta Attention layers (`shardlm.models.kimi_delta`,
`model.linear_attention_rule = "kimi_delta"`) where `layer_types` says "linear_attention", MLA without positions
(`model.mla_nope`) in the others, and DeepSeek-V3's MoE (sigmoid scores with the score-correction bias, shared
experts, the first layers dense).

Names on disk (the published checkpoints' and what transformers' save_pretrained writes; transformers' in-memory
names, on the right, are read too) -> shardlm, layer i:

    self_attn.{q,k,v,o}_proj, b_proj                     (forget_gate.)    -> attn.{q,k,v,o}, attn.b
    self_attn.f_a_proj, f_b_proj, dt_bias, A_log         forget_gate.*     -> attn.f_a, attn.f_b, attn.dt_bias,
                                                                              attn.A_log ((1, 1, H, 1) -> (H,))
    self_attn.{q,k,v}_conv1d (C, 1, K)                   conv1d [q|k|v]    -> attn.conv_{q,k,v} (C, K)
    self_attn.g_a_proj, g_b_proj, o_norm                                   -> attn.g_a, attn.g_b, attn.norm
    self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
                                                         (MLA layers)      -> attn.q | q_a, q_a_norm, q_b, kv_a, ...
    block_sparse_moe.gate.weight / .e_score_correction_bias   mlp.gate.*   -> mlp.router.weight / .expert_bias
    block_sparse_moe.experts.e.w1 / w3 / w2              mlp.experts.gate_up_proj / down_proj (stacked)
                                                                           -> mlp.experts.{gate,up,down}.e
    block_sparse_moe.shared_experts.*                    mlp.shared_experts.*  -> mlp.shared.*
    block_sparse_moe.{gate,up,down}_proj (dense layers)  mlp.*             -> mlp.{gate,up,down}

The MLA rotary channels are not permuted: nothing rotates them. Every mapping keeps the values, so a round trip
is bitwise. Settings transformers' KimiLinear does not compute differently are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardlm.checkpoint.hf_common import (
    HFTensor,
    check_pieces,
    check_shared_width,
    stacked_expert,
    use_tokenizer,
    weight_files,
    write_directory,
)
from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

KINDS = ("kimi_linear",)
"""HF model types this module converts."""


def _first(hf: dict, *names, default=None):
    """The value of the first of `names` the config holds (the published config.json and transformers' own
    name some settings differently)."""
    return next((hf[n] for n in names if hf.get(n) is not None), default)


def _layer_types(hf: dict, layers: int) -> list[str]:
    """One "linear_attention" / "full_attention" per layer: layer_types, else the published linear_attn_config's
    1-based kda_layers and full_attn_layers, else transformers' default (full every fourth, from layer 4)."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    linear = hf.get("linear_attn_config") or {}
    if "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * layers
        for i in linear["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in linear["kda_layers"]:
            types[i - 1] = "linear_attention"
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def _dense_layers(hf: dict, layers: int) -> int:
    """How many first layers keep a dense MLP (mlp_layer_types, else first_k_dense_replace, default 1)."""
    kinds = hf.get("mlp_layer_types") or ["dense" if i < hf.get("first_k_dense_replace", 1) else "sparse"
                                          for i in range(layers)]
    dense = kinds.count("dense")
    if kinds != ["dense"] * dense + ["sparse"] * (layers - dense):
        raise UserError("the HF model's mlp_layer_types mix dense and MoE layers after the first MoE layer, which "
                        "shardlm's layers (dense first, then MoE) do not compute")
    return dense


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section of a Kimi Linear config.json; UserError (one line) for what it does not compute."""
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    linear = hf.get("linear_attn_config") or {}
    types = _layer_types(hf, layers)
    refusals = [(not hf.get("attention_bias"), "attention biases"),
                (hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')!r}"),
                (_first(hf, "num_key_value_heads", default=heads) == heads,
                 "num_key_value_heads != num_attention_heads"),
                (set(types) <= {"linear_attention", "full_attention"}, f"layer types {sorted(map(str, set(types)))}"),
                (hf.get("moe_layer_freq", 1) == 1, "moe_layer_freq != 1"),
                (hf.get("moe_router_activation_func", "sigmoid") == "sigmoid", "a router other than sigmoid"),
                (hf.get("mla_use_nope", True), "MLA with rotary embeddings (mla_use_nope false)")]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's kimi_linear does not compute")
    dense = _dense_layers(hf, layers)
    experts = _first(hf, "num_local_experts", "num_experts", default=0) if dense < layers else 0
    groups = _first(hf, "n_group", "num_expert_group", default=1)
    moe = {}
    if experts:
        moe = {"moe_num_experts": experts, "moe_top_k": _first(hf, "num_experts_per_tok", "num_experts_per_token"),
               "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_first_dense_layers": dense,
               "moe_shared_experts": _first(hf, "n_shared_experts", "num_shared_experts", default=1),
               "moe_score": "sigmoid", "moe_expert_bias": True,
               "moe_norm_topk_prob": bool(_first(hf, "norm_topk_prob", "moe_renormalize", default=True)),
               "moe_routed_scaling": float(hf.get("routed_scaling_factor", 1.0)),
               "moe_groups": groups if groups > 1 else 0,
               "moe_topk_groups": _first(hf, "topk_group", default=1) if groups > 1 else 0}
    linear_heads = _first(hf, "linear_num_heads", default=linear.get("num_heads", 32))
    head_dim = _first(hf, "linear_head_dim", default=linear.get("head_dim", 128))
    return ModelConfig(
        arch="llama", attention="mla", mla_nope=True, num_layers=layers, hidden_size=hf["hidden_size"],
        num_heads=heads, seq_length=_first(hf, "max_position_embeddings", "model_max_length"),
        vocab_size=hf["vocab_size"], ffn_hidden_size=hf["intermediate_size"], dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0), layernorm_epsilon=hf.get("rms_norm_eps", 1e-5),
        init_std=hf.get("initializer_range", 0.02), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], layer_types=types, linear_attention_rule="kimi_delta",
        linear_num_key_heads=linear_heads, linear_num_value_heads=linear_heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel=_first(hf, "linear_conv_kernel_dim", default=linear.get("short_conv_kernel_size", 4)),
        **moe)


def layer_names(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(shardlm name, HF name on disk) of layer i's tensors."""
    s, h = f"layers.{i}", f"model.layers.{i}"
    names = [(f"{s}.ln_1.weight", f"{h}.input_layernorm.weight"),
             (f"{s}.ln_2.weight", f"{h}.post_attention_layernorm.weight")]
    a = f"{h}.self_attn"
    if cfg.is_linear_layer(i):
        names += [(f"{s}.attn.{p}.weight", f"{a}.{p}_proj.weight") for p in ("q", "k", "v", "o", "b", "f_b", "g_b")]
        names += [(f"{s}.attn.f_a", f"{a}.f_a_proj.weight"), (f"{s}.attn.g_a", f"{a}.g_a_proj.weight"),
                  (f"{s}.attn.dt_bias", f"{a}.dt_bias"), (f"{s}.attn.A_log", f"{a}.A_log"),
                  (f"{s}.attn.norm.weight", f"{a}.o_norm.weight")]
        names += [(f"{s}.attn.conv_{p}", f"{a}.{p}_conv1d.weight") for p in "qkv"]
    else:
        attn = [("q_a", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b", "q_b_proj")] if cfg.q_lora_rank \
            else [("q", "q_proj")]
        attn += [("kv_a", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b", "kv_b_proj"),
                 ("o", "o_proj")]
        names += [(f"{s}.attn.{ours}.weight", f"{a}.{theirs}.weight") for ours, theirs in attn]
    mlp, m = ("gate", "up", "down"), f"{h}.block_sparse_moe"
    if not cfg.is_moe_layer(i):  # transformers saves the dense MLPs under block_sparse_moe too (mlp. is read)
        return names + [(f"{s}.mlp.{p}.weight", f"{m}.{p}_proj.weight") for p in mlp]
    names += [(f"{s}.mlp.router.weight", f"{m}.gate.weight"),
              (f"{s}.mlp.router.expert_bias", f"{m}.gate.e_score_correction_bias")]
    names += [(f"{s}.mlp.experts.{p}.{e}", f"{m}.experts.{e}.{w}.weight") for e in range(cfg.moe_num_experts)
              for p, w in zip(mlp, ("w1", "w3", "w2"))]
    return names + [(f"{s}.mlp.shared.{p}.weight", f"{m}.shared_experts.{p}_proj.weight") for p in mlp]


def name_map(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shardlm name, HF name on disk) of every tensor."""
    names = [("wte.weight", "model.embed_tokens.weight"), ("ln_f.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    for i in range(cfg.num_layers):
        names += layer_names(cfg, i)
    return names


IN_MEMORY = (("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
             ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
             ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"), ("self_attn.A_log", "self_attn.forget_gate.A_log"),
             (".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"), (".w3.weight", ".up_proj.weight"),
             (".w2.weight", ".down_proj.weight"))
"""Disk name -> transformers' in-memory name, by parts (what a directory written without its conversion holds)."""


def in_memory(name: str) -> str:
    """transformers' in-memory name of a tensor's disk name (`IN_MEMORY`); peft's module names are these."""
    for disk, memory in IN_MEMORY:
        name = name.replace(disk, memory)
    return name


def _source(handles: dict, located: dict, cfg: ModelConfig, ours: str, theirs: str, hf_dir: Path) -> HFTensor:
    """The `HFTensor` of one shardlm tensor, from its disk name or transformers' in-memory one."""
    kind = ours.rsplit(".", 1)[-1]
    if theirs in located:
        convert = {"A_log": lambda v: v.flatten(), "conv_q": lambda v: v[:, 0], "conv_k": lambda v: v[:, 0],
                   "conv_v": lambda v: v[:, 0]}.get(kind)
        return HFTensor(handles, located[theirs], theirs, convert)
    memory = in_memory(theirs)
    if kind.startswith("conv_"):  # one conv1d (3 H d, 1, K), rows [q | k | v]
        memory = theirs.rsplit(".", 2)[0] + ".conv1d.weight"
        width = cfg.linear_num_value_heads * cfg.linear_key_head_dim
        start = "qkv".index(kind[-1]) * width
        if memory in located:
            return HFTensor(handles, located[memory], memory, lambda v: v[start:start + width, 0])
    elif memory in located:
        return HFTensor(handles, located[memory], memory, (lambda v: v.flatten()) if kind == "A_log" else None)
    return stacked_expert(handles, located, cfg, ours, memory, hf_dir)


def open_hf(hf_dir: Path) -> tuple[RunConfig, dict]:
    """(config, {shardlm name: `HFTensor`}) of a local Kimi Linear directory, read on demand."""
    located = weight_files(hf_dir)
    cfg = model_config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    if not cfg.tie_embeddings and "lm_head.weight" not in located:
        cfg.tie_embeddings = True
    config = RunConfig(model=cfg)
    use_tokenizer(config, hf_dir)
    handles: dict = {}
    return config, {ours: _source(handles, located, cfg, ours, theirs, hf_dir) for ours, theirs in name_map(cfg)}


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """The HF config.json of a Kimi Linear model (transformers' KimiLinearConfig keys)."""
    moe = {"num_experts": max(cfg.moe_num_experts, 1), "num_experts_per_token": cfg.moe_top_k,
           "moe_intermediate_size": cfg.moe_ffn_size, "num_shared_experts": max(cfg.moe_shared_experts, 1),
           "moe_renormalize": cfg.moe_norm_topk_prob, "routed_scaling_factor": cfg.moe_routed_scaling,
           "num_expert_group": cfg.moe_groups or 1, "topk_group": cfg.moe_topk_groups or 1}
    dense = cfg.moe_first_dense_layers if cfg.moe_num_experts else cfg.num_layers
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads, "hidden_act": "silu",
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "model_max_length": cfg.seq_length, "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std, "attention_bias": False, "attention_dropout": cfg.attention_dropout_p,
        "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32", **moe,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,  # not Kimi's 163k-token ids at any size
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(cfg.num_layers)],
        "layer_types": ["linear_attention" if cfg.is_linear_layer(i) else "full_attention"
                        for i in range(cfg.num_layers)],
        "linear_num_heads": cfg.linear_num_value_heads, "linear_head_dim": cfg.linear_key_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
    }


def check_exportable(cfg: ModelConfig) -> None:
    """UserError (one line) for a KDA model that transformers' KimiLinear does not compute."""
    bad = [(cfg.attention != "mla" or not cfg.mla_nope, "its full-attention layers are MLA without RoPE"),
           (cfg.moe_num_experts and (cfg.moe_score != "sigmoid" or cfg.moe_layer_interval != 1 or
                                     cfg.moe_shared_experts < 1), "its MoE layers route by sigmoid scores, every "
            "layer after the first dense ones, with shared experts"),
           (cfg.attention_bias or cfg.norm_zero_centered or cfg.mtp_layers, "no biases, zero-centred norms or MTP")]
    for failed, what in bad:
        if failed:
            raise UserError(f"this model does not convert to Hugging Face's kimi_linear: {what}")
    check_pieces(cfg, "KimiLinearForCausalLM", has=("mla_nope", "moe_routed_scaling"))
    check_shared_width(cfg, "KimiLinearForCausalLM")


def to_hf(config: RunConfig, tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write a consolidated Kimi Linear checkpoint as an HF directory in the published checkpoints' names."""
    cfg = config.model
    check_exportable(cfg)
    hf: dict[str, torch.Tensor] = {}
    for ours, theirs in name_map(cfg):
        value = tensors.get(f"model/{ours}")
        if value is None and ours.endswith("router.expert_bias"):
            value = torch.zeros(cfg.moe_num_experts)
        kind = ours.rsplit(".", 1)[-1]
        if ours in ("wte.weight", "lm_head.weight"):
            value = value[: cfg.vocab_size]
        elif kind == "A_log":
            value = value.view(1, 1, -1, 1)
        elif kind.startswith("conv_"):
            value = value.unsqueeze(1)
        hf[theirs] = value.contiguous()
    return write_directory(out_dir, hf, hf_config_from_model(cfg), config.data)
