"""Hugging Face interop of Nemotron-H (`NemotronHForCausalLM`, model_type nemotron_h) <-> shardlm's consolidated
checkpoint.

Nemotron-H is shardlm's Llama with `model.layer_pattern` (its hybrid_override_pattern) choosing each block's one
mixer (`shardlm.models.mamba`): "M" Mamba-2, "*" attention without positions, "-" a ReLU^2 MLP. Names (HF ->
shardlm, layer i; the HF prefix is `backbone.`, as transformers saves and the published directories hold it, or
`model.`, transformers' names in memory):

    layers.i.norm.weight                                      -> layers.i.norm.weight
    mixer.in_proj.weight          rows [z | x | B | C | dt]   -> mixer.z, mixer.x, mixer.B, mixer.C, mixer.dt
    mixer.conv1d.weight (C, 1, K), mixer.conv1d.bias (C,)  rows [x | B | C] -> mixer.conv_{x,B,C} (C, K), _bias
    mixer.{A_log, D, dt_bias, norm.weight}, mixer.out_proj    -> mixer.{A_log, D, dt_bias, norm.weight}, mixer.o
    mixer.{q,k,v,o}_proj (attention), mixer.{up,down}_proj (MLP) -> mixer.{q,k,v,o}, mixer.{up,down}
    mixer.gate.weight / .e_score_correction_bias (MoE)        -> mixer.router.weight / .expert_bias
    mixer.experts.e.{up,down}_proj.weight                     -> mixer.experts.{fc,proj}.e
    mixer.shared_experts.{up,down}_proj.weight                -> mixer.shared.{up,down}.weight
    embeddings, norm_f, lm_head                               -> wte, ln_f, lm_head

Experts are read per expert (what save_pretrained writes) or from transformers' stacked `mixer.experts.up_proj`
/ `down_proj`, and written per expert. Every mapping is a permutation of rows, so a round trip is bitwise. The
MoE layers' latent projections (moe_latent_size) are refused in one line; the multi-token-prediction layers, which
transformers neither runs nor loads, are left out.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardlm.checkpoint.hf_common import (
    HFTensor,
    check_pieces,
    rows_reader,
    use_tokenizer,
    weight_files,
    write_directory,
)
from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.models.routing import group_rule

KINDS = ("nemotron_h",)
"""HF model types this module converts."""
PATTERN = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
"""transformers' layers_block_type names (and their older ones) -> hybrid_override_pattern characters."""
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
          "mamba_dt_limit": "time_step_limit", "mamba_chunk_size": "chunk_size", "attention_head_dim": "head_dim"}
"""Older Nemotron-H config keys -> the names transformers' NemotronHConfig keeps."""


def layer_pattern(hf: dict) -> str:
    """The hybrid_override_pattern of an HF config (its own key, or its layers_block_type list)."""
    if hf.get("hybrid_override_pattern"):
        return hf["hybrid_override_pattern"]
    kinds = hf.get("layers_block_type") or hf.get("layer_types") or []
    unknown = sorted({kind for kind in kinds if kind not in PATTERN})
    if unknown or not kinds:
        raise UserError(f"the HF Nemotron-H config's layers_block_type {unknown or kinds} are not "
                        f"{', '.join(PATTERN)}")
    return "".join(PATTERN[kind] for kind in kinds)


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section of a Nemotron-H config; UserError (one line) for what it does not compute."""
    hf = {LEGACY.get(key, key): value for key, value in hf.items()}
    pattern = layer_pattern(hf)
    limit = [float(v["__float__"]) if isinstance(v, dict) else float(v)  # transformers writes inf as a dict
             for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    refusals = [(not hf.get("moe_latent_size"), "MoE latent projections (moe_latent_size)"),
                (hf.get("mamba_hidden_act", "silu") == "silu", f"mamba_hidden_act={hf.get('mamba_hidden_act')!r}"),
                (hf.get("mlp_hidden_act", "relu2") == "relu2", f"mlp_hidden_act={hf.get('mlp_hidden_act')!r}"),
                (not (hf.get("use_bias") or hf.get("mamba_proj_bias") or hf.get("mlp_bias")
                      or hf.get("attention_bias")), "biases on its projections"),
                (limit[0] == 0.0 and limit[1] == float("inf"), f"a time_step_limit of {limit}"),
                (not hf.get("sliding_window"), "a sliding window")]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's nemotron_h does not compute")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return ModelConfig(
        arch="llama", num_layers=len(pattern), hidden_size=hf["hidden_size"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, seq_length=hf.get("max_position_embeddings", 4096),
        vocab_size=hf["vocab_size"], ffn_hidden_size=hf.get("intermediate_size", 21504), dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)), layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        init_std=hf.get("initializer_range", 0.02), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=0 if head_dim == hf["hidden_size"] // heads else head_dim, layer_pattern=pattern,
        mamba_num_heads=hf.get("mamba_num_heads", 128), mamba_head_dim=hf.get("mamba_head_dim", 64),
        mamba_state_size=hf.get("ssm_state_size", 128), mamba_groups=hf.get("n_groups", 8),
        mamba_conv_kernel=hf.get("conv_kernel", 4), mamba_conv_bias=bool(hf.get("use_conv_bias", True)),
        mamba_chunk_size=hf.get("chunk_size", 128), **(moe_keys(hf) if "E" in pattern else {}))


def moe_keys(hf: dict) -> dict:
    """The MoE keys of a Nemotron-H config with "E" layers: sigmoid scores, the score-correction bias in the choice
    (kept fixed), groups, the top-k renormalized and scaled, one ReLU^2 shared expert."""
    groups = hf.get("n_group", 1)
    return {"moe_num_experts": hf.get("n_routed_experts", 8), "moe_top_k": hf.get("num_experts_per_tok", 2),
            "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 7688), "moe_shared_experts": 1,
            "moe_shared_ffn_hidden_size": hf.get("moe_shared_expert_intermediate_size", 7688), "moe_score": "sigmoid",
            "moe_expert_bias": True, "moe_groups": groups if groups > 1 else 0,
            "moe_topk_groups": hf.get("topk_group", 1) if groups > 1 else 0,
            "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "moe_routed_scaling": float(hf.get("routed_scaling_factor", 1.0))}


def _widths(cfg: ModelConfig) -> dict[str, int]:
    inner, state = cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.mamba_groups * cfg.mamba_state_size
    return {"z": inner, "x": inner, "B": state, "C": state, "dt": cfg.mamba_num_heads}


def _spans(names: str, widths: dict[str, int]) -> dict[str, torch.Tensor]:
    """Row indices of each of `names` in a tensor that stacks them in that order."""
    spans, start = {}, 0
    for name in names:
        spans[name] = torch.arange(start, start + widths[name])
        start += widths[name]
    return spans


def layer_names(cfg: ModelConfig, s: str, h: str, index: int) -> list[tuple[str, str, object]]:
    """(shardlm name, HF name, rows) of one layer's tensors: rows None maps the whole tensor; a tensor of row
    indices takes those rows of the HF tensor (conv1d's middle dimension dropped)."""
    names = [(f"{s}.norm.weight", f"{h}.norm.weight", None)]
    s, h = f"{s}.mixer", f"{h}.mixer"
    kind = cfg.layer_pattern[index]
    if kind == "*":
        return names + [(f"{s}.{p}.weight", f"{h}.{p}_proj.weight", None) for p in "qkvo"]
    if kind == "-":
        return names + [(f"{s}.{p}.weight", f"{h}.{p}_proj.weight", None) for p in ("up", "down")]
    if kind == "E":
        names += [(f"{s}.router.weight", f"{h}.gate.weight", None),
                  (f"{s}.router.expert_bias", f"{h}.gate.e_score_correction_bias", None)]
        names += [(f"{s}.shared.{p}.weight", f"{h}.shared_experts.{p}_proj.weight", None) for p in ("up", "down")]
        return names + [(f"{s}.experts.{ours}.{e}", f"{h}.experts.{e}.{theirs}_proj.weight", None)
                        for e in range(cfg.moe_num_experts) for ours, theirs in (("fc", "up"), ("proj", "down"))]
    widths = _widths(cfg)
    rows, conv = _spans(("z", "x", "B", "C", "dt"), widths), _spans("xBC", widths)
    names += [(f"{s}.{p}.weight", f"{h}.in_proj.weight", rows[p]) for p in ("z", "x", "B", "C", "dt")]
    names += [(f"{s}.conv_{p}", f"{h}.conv1d.weight", conv[p]) for p in "xBC"]
    if cfg.mamba_conv_bias:
        names += [(f"{s}.conv_{p}_bias", f"{h}.conv1d.bias", conv[p]) for p in "xBC"]
    names += [(f"{s}.{p}", f"{h}.{p}", None) for p in ("A_log", "D", "dt_bias")]
    return names + [(f"{s}.norm.weight", f"{h}.norm.weight", None), (f"{s}.o.weight", f"{h}.out_proj.weight", None)]


def name_map(cfg: ModelConfig, prefix: str = "model.") -> list[tuple[str, str, object]]:
    """(shardlm name, HF name, rows) of every tensor; `prefix`: "backbone." (on disk) or "model."."""
    names = [("wte.weight", f"{prefix}embeddings.weight", None), ("ln_f.weight", f"{prefix}norm_f.weight", None)]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight", None))
    for i in range(cfg.num_layers):
        names += layer_names(cfg, f"layers.{i}", f"{prefix}layers.{i}", i)
    return names


def open_hf(hf_dir: Path) -> tuple[RunConfig, dict]:
    """(config, {shardlm name: `HFTensor`}) of a local Nemotron-H directory, read on demand."""
    located = weight_files(hf_dir)
    cfg = model_config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    prefix = "backbone." if any(name.startswith("backbone.") for name in located) else "model."
    if not cfg.tie_embeddings and "lm_head.weight" not in located:
        cfg.tie_embeddings = True
    config = RunConfig(model=cfg)
    use_tokenizer(config, hf_dir)
    handles: dict = {}
    sources = {}
    for ours, theirs, rows in name_map(cfg, prefix):
        if theirs not in located and ".experts." in theirs:  # transformers' stacked names: (E, out, in)
            head, _, tail = theirs.partition(".experts.")
            expert, projection = tail.split(".")[:2]
            stacked = f"{head}.experts.{projection}"
            if stacked in located:
                sources[ours] = HFTensor(handles, located[stacked], stacked, select=int(expert))
                continue
        if theirs not in located:
            raise UserError(f"{hf_dir} has no tensor {theirs}")
        sources[ours] = HFTensor(handles, located[theirs], theirs, rows_reader(rows, theirs.endswith("conv1d.weight")))
    return config, sources


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """The HF config.json of `NemotronHForCausalLM`."""
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    moe = {}
    if cfg.moe_num_experts:
        moe = {"n_routed_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
               "moe_intermediate_size": cfg.moe_ffn_size, "moe_shared_expert_intermediate_size": cfg.shared_ffn_size,
               "n_shared_experts": 1, "n_group": max(cfg.moe_groups, 1), "topk_group": max(cfg.moe_topk_groups, 1),
               "norm_topk_prob": cfg.moe_norm_topk_prob, "routed_scaling_factor": cfg.moe_routed_scaling}
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
        "layers_block_type": [kinds[kind] for kind in cfg.layer_pattern],
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attention_head_dim,
        "max_position_embeddings": cfg.seq_length, "layer_norm_epsilon": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std, "attention_bias": False, "attention_dropout": cfg.attention_dropout_p,
        "mlp_hidden_act": "relu2", "mlp_bias": False, "use_bias": False, "mamba_hidden_act": "silu",
        "mamba_num_heads": cfg.mamba_num_heads, "mamba_head_dim": cfg.mamba_head_dim,
        "ssm_state_size": cfg.mamba_state_size, "n_groups": cfg.mamba_groups, "conv_kernel": cfg.mamba_conv_kernel,
        "use_conv_bias": cfg.mamba_conv_bias, "chunk_size": cfg.mamba_chunk_size,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32", **moe,
    }


def check_exportable(cfg: ModelConfig) -> None:
    """UserError (one line) for a hybrid model that `NemotronHForCausalLM` does not compute."""
    if cfg.attention_bias or cfg.norm_zero_centered or cfg.qk_norm:
        raise UserError("this model does not convert to Nemotron-H: its attention has no biases or q/k norms and "
                        "its norms are plain RMSNorms")
    if cfg.moe_num_experts and (cfg.moe_score != "sigmoid" or cfg.moe_shared_experts != 1 or cfg.moe_router_bias):
        raise UserError("this model does not convert to Nemotron-H: its MoE layers score by sigmoid with one shared "
                        "expert and no router bias")
    if cfg.moe_num_experts and cfg.moe_groups > 0 and group_rule(cfg) != "top2_sum":
        raise UserError("NemotronHForCausalLM has no groups ranked by their best expert (model.moe_group_score = "
                        '"max"); this model does not convert to it')
    check_pieces(cfg, "NemotronHForCausalLM", has=("moe_routed_scaling",))


def to_hf(config: RunConfig, tensors: dict[str, torch.Tensor], out_dir: Path, prefix: str = "backbone.") -> Path:
    """Write a consolidated Nemotron-H checkpoint as an HF directory (`hf_config_from_model`), its tensors under
    `prefix` ("backbone.", what transformers' save_pretrained and the published directories hold)."""
    cfg = config.model
    check_exportable(cfg)
    names = name_map(cfg, prefix)
    hf: dict[str, torch.Tensor] = {}
    for ours, theirs, rows in names:
        value = tensors.get(f"model/{ours}")
        if value is None and ours.endswith("router.expert_bias"):  # a router trained without one: a zero bias
            value = torch.zeros(cfg.moe_num_experts)
        if ours in ("wte.weight", "lm_head.weight"):
            value = value[: cfg.vocab_size]
        if theirs.endswith("conv1d.weight"):
            value = value.unsqueeze(1)
        if rows is None:
            hf[theirs] = value.contiguous()
            continue
        if theirs not in hf:
            total = sum(len(r) for _, t, r in names if t == theirs)
            hf[theirs] = value.new_zeros(total, *value.shape[1:])
        hf[theirs][rows] = value
    return write_directory(out_dir, hf, hf_config_from_model(cfg), config.data)
