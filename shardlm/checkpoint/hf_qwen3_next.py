"""Hugging Face interop of the hybrid linear-attention families: `Qwen3NextForCausalLM` (qwen3_next),
`Qwen3_5ForCausalLM` (qwen3_5_text) and `Qwen3_5MoeForCausalLM` (qwen3_5_moe_text) directories, and the
language model of a multimodal Qwen3.5 directory (qwen3_5 / qwen3_5_moe: `text_config`, weights under
`model.language_model.`, the vision tower left out) <-> shardlm's consolidated checkpoint.

Both families are shardlm's Llama (`shardlm.models.llama`) with `layer_types` choosing Gated DeltaNet
(`shardlm.models.linear_attention`) or gated full attention per layer, zero-centred RMSNorms and, for the
MoE models, a shared expert behind a sigmoid gate. Names (HF -> shardlm, layer i):

    linear_attn.in_proj_qkv (Qwen3.5)      rows [q | k | v]   -> attn.q, attn.k, attn.v
    linear_attn.in_proj_z / _b / _a (Qwen3.5)                -> attn.z, attn.b, attn.a
    linear_attn.in_proj_qkvz (Qwen3-Next)  rows per key head [q_j, k_j, v_j (r heads), z_j (r heads)]
    linear_attn.in_proj_ba (Qwen3-Next)    rows per key head [b_j (r), a_j (r)]   (r = value / key heads)
    linear_attn.conv1d.weight (C, 1, K)    rows [q | k | v]   -> attn.conv_q, attn.conv_k, attn.conv_v (C, K)
    linear_attn.{A_log, dt_bias, norm.weight, out_proj}       -> attn.{A_log, dt_bias, norm.weight, o}
    self_attn.* (q_proj holds each head's queries then its gate) -> attn.* as Llama's
    mlp.shared_expert.*, mlp.shared_expert_gate                -> mlp.shared.*, mlp.shared_gate
    mtp.fc, mtp.pre_fc_norm_embedding / _hidden, mtp.norm, mtp.layers.0.* -> mtp.0.eh_proj, enorm / hnorm,
                                                                           post_norm, block.*

Experts are read per expert (`mlp.experts.e.{gate,up,down}_proj`, what save_pretrained writes) or from the
stacked `mlp.experts.gate_up_proj` / `down_proj`, and written per expert. Every mapping is a permutation of
rows, so a round trip is bitwise. Which input-projection layout a model exports to is
`model.hf_linear_projections` ("separate": Qwen3.5, "grouped": Qwen3-Next), set from the source directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardlm.checkpoint.hf_common import (
    HFTensor,
    check_pieces,
    rope_parameters_of,
    rows_reader,
    stacked_expert,
    text_config,
    use_tokenizer,
    weight_files,
    write_directory,
    yarn_keys,
)
from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
"""HF model types this module converts."""


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section of a Qwen3-Next or Qwen3.5 (text) config; UserError for what it does not compute."""
    kind = hf.get("model_type", "")
    hf = text_config(hf)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else
                                      "full_attention" for i in range(layers)]
    rope_type = params.get("rope_type") or params.get("type") or "default"
    qwen35 = kind != "qwen3_next"  # Qwen3.5-MoE has experts in every layer: it drops the two keys below
    refusals = [(rope_type in ("default", "yarn"), f"rope type {rope_type!r} (the default rotary and YaRN convert)"),
                (not hf.get("attention_bias"), "attention biases"),
                (hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')!r}"),
                (set(types) <= {"linear_attention", "full_attention"}, f"layer types {sorted(set(types))}"),
                (qwen35 or hf.get("decoder_sparse_step", 1) == 1, "decoder_sparse_step > 1"),
                ((hf.get("mtp_num_hidden_layers") or 0) <= 1, "more than one multi-token-prediction layer")]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's {kind} does not compute")
    experts = hf.get("num_experts") or 0
    dense = [] if qwen35 else list(hf.get("mlp_only_layers") or [])
    if experts and dense != list(range(len(dense))):
        raise UserError("the HF model's mlp_only_layers are not the first k layers, the pattern shardlm computes")
    moe = {}
    if experts:
        moe = {"moe_num_experts": experts, "moe_top_k": hf["num_experts_per_tok"],
               "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_first_dense_layers": len(dense),
               # Qwen3.5's router always divides the chosen scores by their sum, whatever norm_topk_prob says
               "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", True)) or kind != "qwen3_next",
               "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0)),
               "moe_shared_experts": 1, "moe_shared_ffn_hidden_size": hf["shared_expert_intermediate_size"],
               "moe_shared_expert_gate": True}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    yarn = yarn_keys(params, hf["max_position_embeddings"]) if rope_type == "yarn" else {}
    return ModelConfig(
        arch="llama", num_layers=layers, hidden_size=hf["hidden_size"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, seq_length=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], ffn_hidden_size=hf.get("intermediate_size") or hf["moe_intermediate_size"],
        dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
        rope_theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=0 if head_dim == hf["hidden_size"] // heads else head_dim, qk_norm=True,
        rope_fraction=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        layer_types=list(types), linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"], linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"], linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        attention_output_gate=True, norm_zero_centered=True, mtp_layers=int(hf.get("mtp_num_hidden_layers") or 0),
        hf_linear_projections="grouped" if kind == "qwen3_next" else "separate", **yarn, **moe)


def _linear_rows(cfg: ModelConfig) -> dict[str, list[torch.Tensor]]:
    """Row indices of q, k, v, z (in the fused in_proj_qkvz) and b, a (in in_proj_ba) of Qwen3-Next's grouped
    layout, per key head [q_j, k_j, v_j, z_j] and [b_j, a_j]; Qwen3.5's in_proj_qkv is [q | k | v]."""
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // nk
    group = 2 * dk + 2 * r * dv
    rows = {name: [] for name in "qkvzba"}
    for j in range(nk):
        start = j * group
        for name, width in (("q", dk), ("k", dk), ("v", r * dv), ("z", r * dv)):
            rows[name].append(torch.arange(start, start + width))
            start += width
        rows["b"].append(torch.arange(2 * r * j, 2 * r * j + r))
        rows["a"].append(torch.arange(2 * r * j + r, 2 * r * (j + 1)))
    return {name: torch.cat(parts) for name, parts in rows.items()}


def _widths(cfg: ModelConfig) -> tuple[int, int]:
    return cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim


def layer_names(cfg: ModelConfig, s: str, h: str, index: int) -> list[tuple[str, str, object]]:
    """(shardlm name, HF name, rows) of one layer's tensors: rows None maps the whole tensor; a tensor of row
    indices takes those rows of the HF tensor (of its first dimension; conv1d's middle dimension dropped)."""
    names = [(f"{s}.ln_1.weight", f"{h}.input_layernorm.weight", None),
             (f"{s}.ln_2.weight", f"{h}.post_attention_layernorm.weight", None)]
    if cfg.is_linear_layer(index):
        a = f"{h}.linear_attn"
        key, value = _widths(cfg)
        spans = {"q": torch.arange(0, key), "k": torch.arange(key, 2 * key),
                 "v": torch.arange(2 * key, 2 * key + value)}
        names += [(f"{s}.attn.conv_{p}", f"{a}.conv1d.weight", spans[p]) for p in "qkv"]
        names += [(f"{s}.attn.A_log", f"{a}.A_log", None), (f"{s}.attn.dt_bias", f"{a}.dt_bias", None),
                  (f"{s}.attn.norm.weight", f"{a}.norm.weight", None),
                  (f"{s}.attn.o.weight", f"{a}.out_proj.weight", None)]
        if cfg.hf_linear_projections == "grouped":
            rows = _linear_rows(cfg)
            names += [(f"{s}.attn.{p}.weight", f"{a}.in_proj_qkvz.weight", rows[p]) for p in "qkvz"]
            names += [(f"{s}.attn.{p}.weight", f"{a}.in_proj_ba.weight", rows[p]) for p in "ba"]
        else:
            names += [(f"{s}.attn.{p}.weight", f"{a}.in_proj_qkv.weight", spans[p]) for p in "qkv"]
            names += [(f"{s}.attn.{p}.weight", f"{a}.in_proj_{p}.weight", None) for p in "zba"]
    else:
        names += [(f"{s}.attn.{p}.weight", f"{h}.self_attn.{p}_proj.weight", None) for p in "qkvo"]
        names += [(f"{s}.attn.{p}_norm.weight", f"{h}.self_attn.{p}_norm.weight", None) for p in "qk"]
    if cfg.is_moe_layer(index):
        m = f"{h}.mlp"
        names += [(f"{s}.mlp.router.weight", f"{m}.gate.weight", None), (f"{s}.mlp.shared_gate",
                                                                        f"{m}.shared_expert_gate.weight", None)]
        names += [(f"{s}.mlp.shared.{p}.weight", f"{m}.shared_expert.{p}_proj.weight", None)
                  for p in ("gate", "up", "down")]
        names += [(f"{s}.mlp.experts.{p}.{e}", f"{m}.experts.{e}.{p}_proj.weight", None)
                  for e in range(cfg.moe_num_experts) for p in ("gate", "up", "down")]
    else:
        names += [(f"{s}.mlp.{p}.weight", f"{h}.mlp.{p}_proj.weight", None) for p in ("gate", "up", "down")]
    return names


def name_map(cfg: ModelConfig, prefix: str = "model.") -> list[tuple[str, str, object]]:
    """(shardlm name, HF name, rows) of every tensor; `prefix`: "model." or a multimodal directory's
    "model.language_model."."""
    names = [("wte.weight", f"{prefix}embed_tokens.weight", None), ("ln_f.weight", f"{prefix}norm.weight", None)]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight", None))
    for i in range(cfg.num_layers):
        names += layer_names(cfg, f"layers.{i}", f"{prefix}layers.{i}", i)
    for k in range(cfg.mtp_layers):  # one depth: Qwen3-Next / Qwen3.5's mtp.* module
        names += [(f"mtp.{k}.eh_proj", "mtp.fc.weight", None),
                  (f"mtp.{k}.enorm.weight", "mtp.pre_fc_norm_embedding.weight", None),
                  (f"mtp.{k}.hnorm.weight", "mtp.pre_fc_norm_hidden.weight", None),
                  (f"mtp.{k}.post_norm.weight", "mtp.norm.weight", None)]
        names += layer_names(cfg, f"mtp.{k}.block", f"mtp.layers.{k}", cfg.num_layers + k)
    return names


def open_hf(hf_dir: Path) -> tuple[RunConfig, dict]:
    """(config, {shardlm name: `HFTensor`}) of a local Qwen3-Next or Qwen3.5 directory, read on demand."""
    located = weight_files(hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = model_config_from_hf(hf)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in located) else "model."
    if cfg.mtp_layers and "mtp.fc.weight" not in located:
        cfg.mtp_layers = 0  # transformers saves the main model only; a hub directory holds the depth
    if not cfg.tie_embeddings and "lm_head.weight" not in located:
        cfg.tie_embeddings = True
    config = RunConfig(model=cfg)
    use_tokenizer(config, hf_dir)
    handles: dict = {}
    sources = {}
    for ours, theirs, rows in name_map(cfg, prefix):
        if theirs in located:
            convert = rows_reader(rows, theirs.endswith("conv1d.weight"))
            sources[ours] = HFTensor(handles, located[theirs], theirs, convert)
            continue
        sources[ours] = stacked_expert(handles, located, cfg, ours, theirs, hf_dir)
    return config, sources


def architecture(cfg: ModelConfig) -> tuple[str, str]:
    """(HF model type, class) of a hybrid model: Qwen3-Next for "grouped" projections, else Qwen3.5 (MoE or dense)."""
    if cfg.hf_linear_projections == "grouped":
        return "qwen3_next", "Qwen3NextForCausalLM"
    return ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM") if cfg.moe_num_experts else \
        ("qwen3_5_text", "Qwen3_5ForCausalLM")


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """The HF config.json: Qwen3NextForCausalLM ("grouped" projections), Qwen3_5MoeForCausalLM or
    Qwen3_5ForCausalLM."""
    kind, arch = architecture(cfg)
    moe = {}
    if cfg.moe_num_experts:
        moe = {"num_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
               "moe_intermediate_size": cfg.moe_ffn_size, "shared_expert_intermediate_size": cfg.shared_ffn_size,
               "norm_topk_prob": cfg.moe_norm_topk_prob, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
               "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.moe_first_dense_layers)),
               "output_router_logits": False}
    return {
        "architectures": [arch], "model_type": kind, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attention_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length, "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std, "attention_bias": False, "attention_dropout": cfg.attention_dropout_p,
        "rope_parameters": {**rope_parameters_of(cfg), "partial_rotary_factor": cfg.rope_fraction},
        "layer_types": [("linear_attention" if cfg.is_linear_layer(i) else "full_attention")
                        for i in range(cfg.num_layers)],
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel, "mtp_num_hidden_layers": cfg.mtp_layers,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32", **moe,
    }


def check_exportable(cfg: ModelConfig) -> None:
    """UserError (one line) for a hybrid model the HF classes do not compute."""
    bad = [(not (cfg.attention_output_gate and cfg.norm_zero_centered and cfg.qk_norm),
            "Qwen3-Next / Qwen3.5 need attention_output_gate, norm_zero_centered and qk_norm"),
           (cfg.moe_num_experts and not (cfg.moe_shared_experts == 1 and cfg.moe_shared_expert_gate),
            "their MoE layers have one gated shared expert (moe_shared_experts = 1, moe_shared_expert_gate)"),
           (cfg.moe_num_experts and cfg.moe_score != "softmax", "their routers score by softmax"),
           (cfg.moe_num_experts and not cfg.moe_norm_topk_prob and cfg.hf_linear_projections != "grouped",
            "Qwen3.5's router renormalizes the chosen scores (moe_norm_topk_prob = true)"),
           (cfg.moe_num_experts and cfg.moe_first_dense_layers and cfg.hf_linear_projections != "grouped",
            "Qwen3.5-MoE has experts in every layer (moe_first_dense_layers = 0)"),
           (cfg.attention_bias or cfg.attention_sinks or cfg.sliding_window, "no biases, sinks or windows")]
    for failed, what in bad:
        if failed:
            raise UserError(f"this model does not convert to Hugging Face: {what}")
    check_pieces(cfg, architecture(cfg)[1], has=("norm_zero_centered", "attention_output_gate",
                                                 "moe_shared_expert_gate", "rope_yarn_factor", "rope_fraction"))


def to_hf(config: RunConfig, tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write a consolidated hybrid checkpoint as an HF directory (`hf_config_from_model`)."""
    cfg = config.model
    check_exportable(cfg)
    hf: dict[str, torch.Tensor] = {}
    for ours, theirs, rows in name_map(cfg):
        value = tensors[f"model/{ours}"]
        if ours in ("wte.weight", "lm_head.weight"):
            value = value[: cfg.vocab_size]
        if theirs.endswith("conv1d.weight"):
            value = value.unsqueeze(1)
        if rows is None:
            hf[theirs] = value.contiguous()
            continue
        if theirs not in hf:
            total = sum(len(r) for o, t, r in name_map(cfg) if t == theirs)
            hf[theirs] = value.new_zeros(total, *value.shape[1:])
        hf[theirs][rows] = value
    return write_directory(out_dir, hf, hf_config_from_model(cfg), config.data)
