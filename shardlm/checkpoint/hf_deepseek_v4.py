"""Hugging Face DeepSeek-V4 interop: `DeepseekV4ForCausalLM` directories (model_type "deepseek_v4") <-> shardlm's
consolidated checkpoint of its `shardlm.models.deepseek_v4.DeepseekV4`.

transformers saves DeepSeek's own names (its conversion mapping renames them on load), and so do these. HF (under
`model.`, layer i as L) -> shardlm:

    embed_tokens, norm, hc_head.hc_{fn,base,scale}; head (no prefix)      wte, ln_f.{weight,fn,base,scale}; lm_head
    L.attn_norm, L.ffn_norm, L.hc_attn_{fn,base,scale}, L.hc_ffn_*          layers.i.ln_1, ln_2, attn_hc.*, mlp_hc.*
    L.attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink}          layers.i.attn.{q_a, q_a_norm, q_b, kv,
                                                                            kv_norm, o_a, o_b, sinks}
    L.attn.compressor.{wkv, wgate, ape, norm}                              layers.i.attn.compressor.{kv, gate,
                                                                            position_bias, kv_norm}
    L.attn.indexer.{compressor.*, wq_b, weights_proj}                      layers.i.attn.indexer.{compressor.*, q_b,
                                                                            weights_proj}
    L.ffn.gate.{weight, bias, tid2eid}                                     layers.i.mlp.router.{weight, expert_bias,
                                                                            tid2eid}
    L.ffn.experts.e.{w1, w3, w2}, L.ffn.shared_experts.{w1, w3, w2}        layers.i.mlp.experts.{gate, up, down}.e,
                                                                            layers.i.mlp.shared.{gate, up, down}

    mtp.k.{enorm, hnorm, e_proj, h_proj}, mtp.k.norm                       mtp.k.{enorm, hnorm, e_proj, h_proj},
    mtp.k.hc_head_{fn,base,scale}                                          mtp.k.head.{weight, fn, base, scale}
    mtp.k.<a layer's names, without model.layers.i>                        mtp.k.block.<as layers.i>

DeepSeek's own directories (the same names without the `model.` prefix, `embed`, `norm` and `hc_head_fn` at the
top) read too. The multi-token-prediction depths (num_nextn_predict_layers) are DeepSeek's `mtp.k` in either kind of
directory: transformers neither builds nor saves them (its load ignores them), so a directory it saved converts
without them, with a note. Every tensor maps whole (tid2eid's int64 expert ids as fp32 and back, exact): a round
trip is bitwise. The config: layer_types (or DeepSeek's compress_ratios, one per layer and depth) and compress_rates
become `model.compress_ratios` (0 sliding, the CSA rate, the HCA rate per layer, then per depth; index_topk 0 when
no layer is CSA), mlp_layer_types' leading hash_moe layers `model.moe_hash_layers`, swiglu_limit
`model.swiglu_clip`, compress_rope_theta `model.global_rope_theta`, the compressed layers' YaRN `model.rope_yarn_*`.
Refused in one line: other scaled rotaries, other scoring functions, hash layers after a routed one, more than one
shared expert, quantized weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardlm.checkpoint.hf_common import (
    HFTensor,
    check_pieces,
    check_shared_width,
    drop_missing_mtp,
    use_tokenizer,
    weight_files,
    write_directory,
    yarn_keys,
)
from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models.compressed_attention import compressed_kinds
from shardlm.models.config import ModelConfig

KINDS = ("deepseek_v4",)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def _rope(hf: dict, kind: str) -> dict:
    """The `kind` ("main" or "compress") rotary settings of a DeepSeek-V4 config, in either of its styles."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get(kind), dict):
        return params[kind]
    theta = hf.get("rope_theta", 10000.0) if kind == "main" else hf.get("compress_rope_theta", 160000.0)
    return {"rope_type": params.get("rope_type", "default") if kind == "compress" else "default", "rope_theta": theta}


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section of a DeepseekV4Config dict; UserError (one line) for what it does not compute."""
    layers, depths = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers", 1) or 0
    rates = {CSA: 4, HCA: 128, **(hf.get("compress_rates") or {})}
    kinds = hf.get("layer_types") or [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(layers - 2)]
    if not hf.get("layer_types") and hf.get("compress_ratios"):  # DeepSeek's own config: a ratio per layer and depth
        named = {0: "sliding_attention", rates[CSA]: CSA, rates[HCA]: HCA}
        unknown = sorted(set(hf["compress_ratios"]) - set(named))
        if unknown:
            raise UserError(f"the HF model's compress_ratios hold {unknown}, neither 0 nor its compress_rates "
                            f"({rates[CSA]}, {rates[HCA]})")
        kinds = [named[r] for r in hf["compress_ratios"]]
    mlp = hf.get("mlp_layer_types") or ["hash_moe"] * min(layers, 3) + ["moe"] * max(0, layers - 3)
    hashed = mlp.count("hash_moe")
    quantized = (hf.get("quantization_config") or {}).get("quant_method")
    refusals = [
        (not quantized, f"quantized weights ({quantized})"),
        (_rope(hf, "compress").get("rope_type", "default") in ("default", "yarn")
         and _rope(hf, "compress").get("attention_factor", 1.0) == 1.0, "a compressed rotary other than default or "
         "yarn without attention factor"),
        (_rope(hf, "main").get("rope_type", "default") == "default", "a scaled rotary on its sliding layers"),
        (hf.get("scoring_func", "sqrtsoftplus") == "sqrtsoftplus", f"scoring_func={hf.get('scoring_func')!r}"),
        (mlp == ["hash_moe"] * hashed + ["moe"] * (layers - hashed), "hash_moe layers after a routed one"),
        (hf.get("n_shared_experts", 1) == 1, "other than one shared expert"),
        (float(hf.get("swiglu_limit", 10.0)) > 0, "swiglu_limit <= 0 (transformers clamps to it: zero up projections)"),
        (hf.get("hidden_act", "silu") == "silu" and not hf.get("attention_bias") and not hf.get("mlp_bias"),
         "biases or an activation other than silu"),
        (CSA not in kinds or HCA not in kinds or rates[CSA] < rates[HCA], "CSA windows as long as HCA's"),
    ]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's deepseek_v4 does not compute")
    head_dim = hf.get("head_dim", 512)
    rotary = hf.get("qk_rope_head_dim") or int(head_dim * (hf.get("partial_rotary_factor") or 64 / 512))
    nested = {_rope(hf, kind).get("partial_rotary_factor") for kind in ("main", "compress")} - {None}
    if any(int(head_dim * factor) != rotary for factor in nested):
        raise UserError(f"the HF model's rope_parameters rotate {sorted(nested)} of each head, not its "
                        f"qk_rope_head_dim / partial_rotary_factor ({rotary} of {head_dim} channels); shardlm's "
                        "deepseek_v4 reads one rotary width")
    ratios = [0 if kind == "sliding_attention" else rates[kind] for kind in kinds][:layers + depths]
    return ModelConfig(
        arch="llama", num_layers=layers, hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
        num_kv_heads=1, head_dim=head_dim, seq_length=hf.get("max_position_embeddings", 4096),
        vocab_size=hf["vocab_size"], ffn_hidden_size=hf["moe_intermediate_size"], dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)), layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        init_std=hf.get("initializer_range", 0.02), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        q_lora_rank=hf["q_lora_rank"], qk_rope_head_dim=rotary, sliding_window=hf["sliding_window"],
        attention_sinks=True, rope_theta=float(_rope(hf, "main")["rope_theta"]),
        global_rope_theta=float(_rope(hf, "compress")["rope_theta"]), hc_mult=hf.get("hc_mult", 4),
        hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20), hc_eps=float(hf.get("hc_eps", 1e-6)),
        compress_ratios=ratios, output_groups=hf["o_groups"], output_rank=hf["o_lora_rank"],
        index_topk=hf.get("index_topk", 512) if CSA in kinds else 0, index_heads=hf.get("index_n_heads", 64),
        index_head_dim=hf.get("index_head_dim", 128), moe_num_experts=hf["n_routed_experts"],
        moe_top_k=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_shared_experts=1,
        moe_score="sqrtsoftplus", moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        moe_expert_bias=True, moe_hash_layers=hashed, swiglu_clip=float(hf.get("swiglu_limit", 10.0)),
        mtp_layers=depths, **_yarn(hf))


def _yarn(hf: dict) -> dict:
    """The `rope_yarn_*` keys of the compressed layers' YaRN (transformers' V4 always truncates the correction
    range: it reads `truncate` beside "main" and "compress", where it never is)."""
    params = _rope(hf, "compress")
    if params.get("rope_type") != "yarn":
        return {}
    return {**yarn_keys(params, hf.get("max_position_embeddings", 4096)), "rope_yarn_truncate": True,
            "rope_yarn_mscale": 0.0, "rope_yarn_mscale_all_dim": 0.0}


def _layer_names(cfg: ModelConfig, i: int, kind: str, s: str, h: str) -> list[tuple[str, str]]:
    """(shardlm name, HF name) of layer i's tensors, under the prefixes `s` and `h`; `kind` from `compressed_kinds`."""
    out = [(f"{s}.ln_1.weight", f"{h}.attn_norm.weight"), (f"{s}.ln_2.weight", f"{h}.ffn_norm.weight")]
    out += [(f"{s}.{ours}_hc.{p}", f"{h}.hc_{theirs}_{p}") for ours, theirs in (("attn", "attn"), ("mlp", "ffn"))
            for p in ("fn", "base", "scale")]
    attn = [("q_a", "wq_a.weight"), ("q_a_norm", "q_norm.weight"), ("q_b.weight", "wq_b.weight"),
            ("kv", "wkv.weight"), ("kv_norm", "norm.weight"), ("o_a.weight", "wo_a.weight"),
            ("o_b.weight", "wo_b.weight"), ("sinks", "attn_sink")]
    out += [(f"{s}.attn.{ours}", f"{h}.attn.{theirs}") for ours, theirs in attn]
    compressor = [("kv", "wkv.weight"), ("gate", "wgate.weight"), ("position_bias", "ape"), ("kv_norm", "norm.weight")]
    if kind != "sliding":
        out += [(f"{s}.attn.compressor.{ours}", f"{h}.attn.compressor.{theirs}") for ours, theirs in compressor]
    if kind == "csa":
        out += [(f"{s}.attn.indexer.compressor.{ours}", f"{h}.attn.indexer.compressor.{theirs}")
                for ours, theirs in compressor]
        out += [(f"{s}.attn.indexer.q_b", f"{h}.attn.indexer.wq_b.weight"),
                (f"{s}.attn.indexer.weights_proj", f"{h}.attn.indexer.weights_proj.weight")]
    out += [(f"{s}.mlp.router.weight", f"{h}.ffn.gate.weight")]
    if i < cfg.moe_hash_layers:
        out += [(f"{s}.mlp.router.tid2eid", f"{h}.ffn.gate.tid2eid")]
    else:
        out += [(f"{s}.mlp.router.expert_bias", f"{h}.ffn.gate.bias")]
    out += [(f"{s}.mlp.experts.{p}.{e}", f"{h}.ffn.experts.{e}.{w}.weight")
            for e in range(cfg.moe_num_experts) for p, w in EXPERT.items()]
    return out + [(f"{s}.mlp.shared.{p}.weight", f"{h}.ffn.shared_experts.{w}.weight") for p, w in EXPERT.items()]


def name_map(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shardlm name, HF name) of every tensor, in the names transformers' save_pretrained writes."""
    out = [("wte.weight", "model.embed_tokens.weight"), ("ln_f.weight", "model.norm.weight")]
    out += [(f"ln_f.{p}", f"model.hc_head.hc_{p}") for p in ("fn", "base", "scale")]
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", "head.weight"))
    kinds = compressed_kinds(cfg)
    for i in range(cfg.num_layers):
        out += _layer_names(cfg, i, kinds[i], f"layers.{i}", f"model.layers.{i}")
    for k in range(cfg.mtp_layers):  # DeepSeek's own names, which transformers neither reads nor saves
        s, h = f"mtp.{k}", f"mtp.{k}"
        out += [(f"{s}.{p}.weight", f"{h}.{p}.weight") for p in ("enorm", "hnorm")]
        out += [(f"{s}.{p}", f"{h}.{p}.weight") for p in ("e_proj", "h_proj")]
        out += [(f"{s}.head.weight", f"{h}.norm.weight")] + [(f"{s}.head.{p}", f"{h}.hc_head_{p}")
                                                             for p in ("fn", "base", "scale")]
        out += _layer_names(cfg, cfg.num_layers + k, kinds[cfg.num_layers + k], f"{s}.block", h)
    return out


IN_MEMORY = ((".attn.", ".self_attn."), (".ffn.", ".mlp."), (".wq_b.", ".q_b_proj."), (".wo_a.", ".o_a_proj."),
             (".wo_b.", ".o_b_proj."), (".shared_experts.w1.", ".shared_experts.gate_proj."),
             (".shared_experts.w2.", ".shared_experts.down_proj."), (".shared_experts.w3.", ".shared_experts.up_proj."),
             (".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."))
"""transformers' renames (its conversion mapping) of the names of the modules `in_memory` names."""


def in_memory(name: str) -> str:
    """The module path transformers' model gives a tensor `name_map` names (peft's target_modules and adapter files
    use these): model.layers.i.attn.wq_b.weight -> model.layers.i.self_attn.q_b_proj.weight, head -> lm_head. Only the
    attention's q_b, o_a and o_b, the shared expert's projections, the router, the layers' norms and the ends."""
    if name == "head.weight":
        return "lm_head.weight"
    for old, new in IN_MEMORY:
        name = name.replace(old, new)
    return name


def original_name(name: str) -> str:
    """The name DeepSeek's own checkpoints give a tensor that transformers saves as `name` (no `model.` prefix,
    embed / norm / hc_head_fn at the top)."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           **{f"model.hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}}
    return top.get(name, name.removeprefix("model."))


def open_hf(hf_dir: Path) -> tuple[RunConfig, dict[str, HFTensor]]:
    """(config, {shardlm name: `HFTensor`}) of a local DeepSeek-V4 directory, read on demand: transformers' saved
    names, or DeepSeek's own (`original_name`)."""
    located = weight_files(hf_dir)
    own = "embed.weight" in located  # DeepSeek's own names
    config = RunConfig(model=model_config_from_hf(json.loads((hf_dir / "config.json").read_text())))
    if not config.model.tie_embeddings and "head.weight" not in located:
        config.model.tie_embeddings = True
    m = config.model
    drop_missing_mtp(m, located, hf_dir, "mtp.0.e_proj.weight")
    m.compress_ratios = m.compress_ratios[:m.num_layers + m.mtp_layers]
    use_tokenizer(config, hf_dir)
    handles: dict = {}
    sources = {}
    for ours, theirs in name_map(config.model):
        stored = original_name(theirs) if own else theirs
        if stored not in located:
            raise UserError(f"{hf_dir} has no tensor {stored} (a DeepSeek-V4 directory as transformers saves it)")
        sources[ours] = HFTensor(handles, located[stored], stored)
    read = {source.name for source in sources.values()}
    left = sorted(name for name in located if name not in read and not (name.startswith("mtp.") and not m.mtp_layers))
    if left:
        raise UserError(f"{hf_dir} holds {len(left)} weights shardlm would not read (first: {left[0]})")
    return config, sources


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """The HF config.json of `DeepseekV4ForCausalLM` for a shardlm DeepSeek-V4 model."""
    kinds = compressed_kinds(cfg)
    names = {"sliding": "sliding_attention", "csa": CSA, "hca": HCA}
    rates = {CSA: 4, HCA: 128}
    for kind, ratio in zip(kinds, cfg.compress_ratios or [0] * cfg.num_layers):
        if kind != "sliding":
            rates[names[kind]] = ratio
    rotary = cfg.qk_rope_head_dim / cfg.head_dim
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank, "partial_rotary_factor": rotary, "num_experts_per_tok": cfg.moe_top_k,
        "n_routed_experts": cfg.moe_num_experts, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "routed_scaling_factor": cfg.moe_routed_scaling,
        "max_position_embeddings": cfg.seq_length, "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.global_rope_theta,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                     "partial_rotary_factor": rotary},
                            "compress": {"rope_type": "default", "rope_theta": cfg.global_rope_theta,
                                         "partial_rotary_factor": rotary, **_yarn_parameters(cfg)}},
        "layer_types": [names[kind] for kind in kinds], "compress_rates": rates, "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "mlp_layer_types": ["hash_moe" if i < cfg.moe_hash_layers else "moe" for i in range(cfg.num_layers)],
        "swiglu_limit": cfg.swiglu_clip, "sliding_window": cfg.sliding_window, "o_groups": cfg.output_groups,
        "o_lora_rank": cfg.output_rank, "index_n_heads": cfg.index_heads, "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk or 512, "num_nextn_predict_layers": cfg.mtp_layers,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std, "attention_dropout": cfg.attention_dropout_p, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
    }


def _yarn_parameters(cfg: ModelConfig) -> dict:
    """The compressed layers' YaRN settings of `rope_parameters["compress"]` (none without YaRN)."""
    if not cfg.rope_yarn_factor:
        return {}
    return {"rope_type": "yarn", "factor": cfg.rope_yarn_factor,
            "original_max_position_embeddings": cfg.rope_yarn_original_positions,
            "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow, "attention_factor": 1.0}


def check_exportable(cfg: ModelConfig) -> None:
    """UserError (one line) for a model with hyper-connections that `DeepseekV4ForCausalLM` does not compute."""
    check_pieces(cfg, "DeepseekV4ForCausalLM", has=("swiglu_clip", "sliding_window", "rope_yarn_factor",
                                                    "moe_routed_scaling", "attention_sinks"))
    if cfg.moe_shared_experts != 1:
        raise UserError(f"DeepseekV4ForCausalLM has one shared expert (model.moe_shared_experts = "
                        f"{cfg.moe_shared_experts}); this model does not convert to it")
    check_shared_width(cfg, "DeepseekV4ForCausalLM")


def to_hf(config: RunConfig, tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write a consolidated DeepSeek-V4 checkpoint as an HF directory (`hf_config_from_model`), in the names
    transformers saves (its tid2eid tables int64 again)."""
    cfg = config.model
    check_exportable(cfg)
    hf = {}
    for ours, theirs in name_map(cfg):
        value = tensors.get(f"model/{ours}")
        if value is None and ours.endswith("router.expert_bias"):  # a router trained without one: a zero bias
            value = torch.zeros(cfg.moe_num_experts)
        if ours in ("wte.weight", "lm_head.weight"):
            value = value[: cfg.vocab_size]
        if ours.endswith("tid2eid"):
            value = value.to(torch.int64)
        hf[theirs] = value.contiguous()
    return write_directory(out_dir, hf, hf_config_from_model(cfg), config.data)
