"""Hugging Face DeepSeek-V3 interop: `DeepseekV3ForCausalLM` directories (model_type "deepseek_v3", and
"kimi_k2", the same architecture) <-> shardlm's consolidated checkpoint of a Llama with MLA and MoE.

Names (HF -> shardlm; everything else as in `shardlm.checkpoint.hf_llama`):

    model.layers.i.self_attn.q_a_proj / q_a_layernorm / q_b_proj    layers.i.attn.q_a / q_a_norm / q_b
    model.layers.i.self_attn.q_proj      (q_lora_rank null)         layers.i.attn.q
    model.layers.i.self_attn.kv_a_proj_with_mqa / kv_a_layernorm    layers.i.attn.kv_a / kv_a_norm
    model.layers.i.self_attn.kv_b_proj / o_proj                     layers.i.attn.kv_b / o
    model.layers.i.mlp.gate.weight / .e_score_correction_bias       layers.i.mlp.router.weight / .expert_bias
    model.layers.i.mlp.experts.e.{gate,up,down}_proj                layers.i.mlp.experts.{gate,up,down}.e
    model.layers.i.mlp.shared_experts.{gate,up,down}_proj           layers.i.mlp.shared.{gate,up,down}
    model.layers.i.self_attn.indexer.{wq_b,wk,k_norm,weights_proj}  layers.i.attn.indexer.{...}  (DeepSeek-V3.2,
                                                                    GLM-5: DeepSeek Sparse Attention)

DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) are DeepSeek-V3 with a lightning indexer
(`shardlm.models.sparse_attention`): index_topk, index_n_heads, index_head_dim, and GLM-5's indexer_types
("full" / "shared" per layer, kept in `model.index_layer_types`, whose presence also marks a GLM-5 model for
export; without the key, derived as transformers does from index_topk_pattern or index_topk_freq and
index_skip_topk_offset; a first "shared" layer is refused). Their MLA always interleaves its rotary
channels. The indexer rotates the first qk_rope_head_dim channels of its heads: half-split in DeepSeek-V3.2
(shardlm's layout, copied as is), interleaved in GLM-5 (the rows of wq_b and wk, and k_norm's weight and bias,
permuted like the MLA's).

With `rope_interleave` (DeepSeek's default) the checkpoint stores each rotary pair's channels next to
each other; shardlm rotates the halves (`shardlm.models.rotary`), so the rotary rows of q_b (or q) and
kv_a are permuted to [even channels | odd channels] on import and back on export: transformers'
interleaved rotation is exactly rotate-half on those de-interleaved channels (the same products and
sums), and a round trip is bitwise. Routing maps to shardlm's DeepSeek options: sigmoid scores, the
expert bias as a fixed bias (`moe_expert_bias`, moved only if moe_expert_bias_rate is set later),
group-limited top-k by the sum of each group's two best scores, norm_topk_prob, routed_scaling_factor,
dense first_k_dense_replace layers, shared experts. Multi-token prediction depths
(num_nextn_predict_layers; stored as layers num_hidden_layers + k with enorm, hnorm, eh_proj and
shared_head.norm) map to `mtp.k.*` (`shardlm.models.mtp`); a directory without their weights (what
transformers' save_pretrained writes) converts without them, with a note. No network.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from shardlm.checkpoint.hf_common import (
    HFTensor,
    check_pieces,
    check_shared_width,
    drop_missing_mtp,
    rope_parameters,
    rope_parameters_of,
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
from shardlm.models.moe import group_rule

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v32", "glm_moe_dsa", "mistral4", "mistral3")
SPARSE = ("deepseek_v32", "glm_moe_dsa")
"""DeepSeek Sparse Attention: MLA with a lightning indexer per layer (GLM-5: on its "full" layers)."""


def rope_permutation(rope: int) -> torch.Tensor:
    """Indices taking interleaved rotary channels (x0, x1, x2, x3, ...) to rotate-half's [x0, x2, ... | x1, x3, ...]."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


def _permute_rope_rows(weight: torch.Tensor, cfg: ModelConfig, name: str, inverse: bool) -> torch.Tensor:
    """De-interleave (or with `inverse` re-interleave) the rotary rows of a q / q_b weight (per head, the last
    qk_rope_head_dim rows of each head's nope + rope) or of kv_a (its last qk_rope_head_dim rows)."""
    rope = cfg.qk_rope_head_dim
    perm = rope_permutation(rope)
    perm = torch.argsort(perm) if inverse else perm
    if name == "kv_a":
        head = weight[-rope:]
        return torch.cat((weight[:-rope], head[perm])).contiguous()
    heads = weight.view(cfg.num_heads, cfg.qk_nope_head_dim + rope, -1)
    return torch.cat((heads[:, :-rope], heads[:, -rope:][:, perm]), dim=1).reshape(weight.shape).contiguous()


def output_name(prefix: str) -> str:
    """The output layer's HF name beside a language model under `prefix`."""
    return "language_model.lm_head.weight" if prefix.startswith("language_model.") else "lm_head.weight"


def name_map(cfg: ModelConfig, prefix: str = "model.") -> list[tuple[str, str]]:
    """(shardlm name, HF name) of every tensor of a DeepSeek-V3 model; `prefix`: "model." or a multimodal
    directory's language model's ("language_model.model.", whose output layer is language_model.lm_head)."""
    top = [("wte.weight", f"{prefix}embed_tokens.weight"), ("ln_f.weight", f"{prefix}norm.weight")]
    if not cfg.tie_embeddings:
        top.append(("lm_head.weight", output_name(prefix)))
    out = []
    for i in range(cfg.num_layers):
        out += _layer_names(cfg, i, f"layers.{i}", f"{prefix}layers.{i}")
    for k in range(cfg.mtp_layers):  # DeepSeek stores depth k as layer num_hidden_layers + k
        s, h = f"mtp.{k}", f"{prefix}layers.{cfg.num_layers + k}"
        out += [(f"{s}.enorm.weight", f"{h}.enorm.weight"), (f"{s}.hnorm.weight", f"{h}.hnorm.weight"),
                (f"{s}.eh_proj", f"{h}.eh_proj.weight"), (f"{s}.post_norm.weight", f"{h}.shared_head.norm.weight")]
        out += _layer_names(cfg, cfg.num_layers + k, f"{s}.block", h)
    return top + out


def _layer_names(cfg: ModelConfig, i: int, s: str, h: str) -> list[tuple[str, str]]:
    """(shardlm, HF) names of transformer layer `i`, under the prefixes `s` and `h`."""
    out = [(f"{s}.ln_1.weight", f"{h}.input_layernorm.weight"),
           (f"{s}.ln_2.weight", f"{h}.post_attention_layernorm.weight")]
    attn = [("q_a", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b", "q_b_proj")] if cfg.q_lora_rank \
        else [("q", "q_proj")]
    attn += [("kv_a", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b", "kv_b_proj"),
             ("o", "o_proj")]
    out += [(f"{s}.attn.{ours}.weight", f"{h}.self_attn.{theirs}.weight") for ours, theirs in attn]
    if cfg.index_source(i) == i:
        out += [(f"{s}.attn.indexer.{p}", f"{h}.self_attn.indexer.{p}") for p in
                ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")]
    mlp = ("gate", "up", "down")
    if not cfg.is_moe_layer(i):
        return out + [(f"{s}.mlp.{p}.weight", f"{h}.mlp.{p}_proj.weight") for p in mlp]
    out += [(f"{s}.mlp.router.weight", f"{h}.mlp.gate.weight")]
    if cfg.moe_score == "sigmoid":  # DeepSeek-V2's softmax router has no score-correction bias
        out += [(f"{s}.mlp.router.expert_bias", f"{h}.mlp.gate.e_score_correction_bias")]
    out += [(f"{s}.mlp.experts.{p}.{e}", f"{h}.mlp.experts.{e}.{p}_proj.weight")
            for e in range(cfg.moe_num_experts) for p in mlp]
    out += [(f"{s}.mlp.shared.{p}.weight", f"{h}.mlp.shared_experts.{p}_proj.weight") for p in mlp]
    return out


def _rope_keys(hf: dict) -> dict:
    """The `model.rope_*` keys of either config style (rope_parameters, or rope_theta + rope_scaling)."""
    params = rope_parameters(hf)
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "yarn" or params.get("attention_factor") is not None or params.get("truncate") is False:
        raise UserError(f"the HF model has rope type {kind!r} with options shardlm's MLA does not compute "
                        "(only default and yarn rotary embeddings convert)")
    return {"rope_theta": theta, **yarn_keys(params, hf["max_position_embeddings"])}


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section for a HF DeepseekV3Config dict (or its relatives'; a multimodal Mistral 4's
    text_config); UserError for what shardlm does not compute."""
    hf = text_config(hf)
    heads = hf["num_attention_heads"]
    v2 = hf.get("model_type") == "deepseek_v2"
    mistral = hf.get("model_type") == "mistral4"  # DeepSeek-V3's shape, softmax routing, Llama 4's query scaling
    experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts")
    groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if v2 and hf.get("topk_method", "greedy") == "greedy":
        groups = topk_groups = 1  # DeepSeek-V2-Lite: plain top-k over all experts
    quantized = (hf.get("quantization_config") or {}).get("quant_method")
    if quantized:
        raise UserError(f"the HF model's weights are quantized ({quantized}, with scale tensors); convert a bf16 copy "
                        "(DeepSeek's fp8_cast_bf16.py) and read that")
    rotary = _mistral_rotary(hf) if mistral else None
    refusals = [
        (not hf.get("attention_bias"), "attention biases (attention_bias)"),
        (hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')!r} (SwiGLU needs silu)"),
        (hf.get("num_key_value_heads") in (None, heads), "num_key_value_heads != num_attention_heads"),
        (hf.get("scoring_func", "softmax" if v2 else "sigmoid") == ("softmax" if v2 else "sigmoid"),
         f"scoring_func={hf.get('scoring_func')!r}"),
        (hf.get("topk_method", "greedy" if v2 else "noaux_tc") in (("greedy", "group_limited_greedy") if v2
                                                                   else ("noaux_tc",)),
         f"topk_method={hf.get('topk_method')!r}"),
        (hf.get("moe_layer_freq", 1) == 1, "moe_layer_freq != 1"),
        (bool(experts) and (hf.get("n_shared_experts") or 0) >= 1, "no routed or no shared experts"),
        (experts // groups >= 2 or groups == 1, "expert groups of one expert (n_group = n_routed_experts)"),
        (not mistral or rotary == hf["qk_rope_head_dim"],
         f"a rotary width of {rotary} channels (head_dim x partial_rotary_factor) unlike "
         f"qk_rope_head_dim={hf['qk_rope_head_dim']}"),
    ]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's DeepSeek-V3 does not compute")
    first_dense = min(hf.get("first_k_dense_replace", 0) or 0, hf["num_hidden_layers"])
    if hf.get("mlp_layer_types"):
        kinds = hf["mlp_layer_types"]
        first_dense = kinds.count("dense")
        if kinds != ["dense"] * first_dense + ["sparse"] * (len(kinds) - first_dense):
            raise UserError("the HF model's mlp_layer_types mix dense and MoE layers after the first MoE layer, "
                            "which shardlm's DeepSeek layers (dense first, then MoE) do not compute")
    return ModelConfig(
        arch="llama", attention="mla", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_heads=heads, seq_length=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf["intermediate_size"], dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], moe_num_experts=experts,
        moe_top_k=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_experts=hf["n_shared_experts"], moe_first_dense_layers=first_dense,
        moe_score="softmax" if v2 or mistral else "sigmoid",  # V2's router never renormalizes its top-k
        moe_norm_topk_prob=False if v2 else bool(hf.get("norm_topk_prob", True)),
        moe_group_score="top2_sum" if mistral else "auto",
        moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        moe_groups=groups if groups > 1 else 0, moe_topk_groups=topk_groups if groups > 1 else 0,
        moe_expert_bias=not (v2 or mistral), **_v2_losses(hf), **_query_scale(hf),
        mtp_layers=hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0, **_rope_keys(hf),
        **_sparse_keys(hf))


def _mistral_rotary(hf: dict) -> int:
    """The channels per head transformers' Mistral 4 rotates: int(head_dim x partial_rotary_factor), head_dim by
    default qk_nope + qk_rope and the factor qk_rope over that (an explicit head_dim changes the width)."""
    width = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return int((hf.get("head_dim") or width) * (factor or hf["qk_rope_head_dim"] / width))


def _query_scale(hf: dict) -> dict:
    """Mistral 4's Llama 4 query scaling (rope_parameters' llama_4_scaling_beta) as the model's keys."""
    params = rope_parameters(hf)
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return {}
    return {"query_scale_beta": float(beta), "query_scale_positions": int(params["original_max_position_embeddings"])}


def _sparse_keys(hf: dict) -> dict:
    """The sparse-attention keys of a DeepSeek-V3.2 or GLM-5 config (none for DeepSeek-V3)."""
    if hf.get("model_type") not in SPARSE:
        return {}
    kinds = _indexer_types(hf) if hf["model_type"] == "glm_moe_dsa" else []
    return {"index_topk": hf.get("index_topk", 2048), "index_heads": hf.get("index_n_heads", 64),
            "index_head_dim": hf.get("index_head_dim", 128), "index_layer_types": list(kinds)}


def _indexer_types(hf: dict) -> list[str]:
    """GLM-5's "full" / "shared" per layer: indexer_types, else (as transformers' GlmMoeDsaConfig derives it) from
    index_topk_pattern ("F" / "S" per layer), else index_topk_freq and index_skip_topk_offset (defaults 1, 2).
    UserError (one line) for a pattern that does not start with a full layer or names another kind."""
    layers, kinds = hf["num_hidden_layers"], hf.get("indexer_types")
    if not kinds and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if not kinds:
        freq, offset = max(hf.get("index_topk_freq") or 1, 1), hf.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    kinds = list(kinds)
    if len(kinds) != layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
        raise UserError(f"the HF model's indexer_types ({len(kinds)} entries, the first {kinds[0]!r}) must give one "
                        f"\"full\" or \"shared\" per layer ({layers}), the first \"full\" (a shared layer reuses an "
                        "earlier layer's choice)")
    return kinds


def _v2_losses(hf: dict) -> dict:
    """DeepSeek-V2's balance loss (aux_loss_alpha, sequence-wise with seq_aux) as the model's MoE loss keys."""
    if hf.get("model_type") != "deepseek_v2" or not hf.get("aux_loss_alpha"):
        return {}
    return {"moe_aux_loss_coeff": float(hf["aux_loss_alpha"]),
            "moe_aux_loss_type": "sequence" if hf.get("seq_aux", True) else "micro_batch"}


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """The HF config.json of a shardlm Llama with MLA and DeepSeek-style MoE: DeepseekV3ForCausalLM (sigmoid
    scores), DeepseekV2ForCausalLM (softmax scores, no top-k renormalization) or Mistral4ForCausalLM (softmax
    scores renormalized, groups by their top-2 sum)."""
    mistral = cfg.moe_score == "softmax" and cfg.moe_norm_topk_prob
    v2 = cfg.moe_score == "softmax" and not mistral
    unsupported = [(cfg.moe_num_experts == 0, "routed experts (moe_num_experts = 0)"),
                   (mistral and cfg.moe_groups > 0 and group_rule(cfg) != "top2_sum",
                    "groups ranked by their best expert with renormalized softmax scores"),
                   (v2 and group_rule(cfg) != "max" and cfg.moe_groups > 0, "groups ranked by their top-2 sum"),
                   ((v2 or mistral) and cfg.moe_expert_bias_rate > 0, "an expert bias with softmax scores"),
                   (cfg.query_scale_beta > 0 and not mistral, "Llama 4's query scaling"),
                   (v2 and cfg.moe_expert_bias_rate > 0, "an expert bias with softmax scores"),
                   (cfg.moe_shared_experts < 1, "no shared expert"), (cfg.moe_layer_interval != 1,
                                                                       "moe_layer_interval > 1"),
                   (cfg.moe_groups > 0 and cfg.moe_num_experts // cfg.moe_groups < 2, "one-expert groups"),
                   (cfg.moe_score not in ("sigmoid", "softmax"), f'no moe_score="{cfg.moe_score}" router'),
                   (cfg.moe_score == "sigmoid" and cfg.moe_groups > 0 and group_rule(cfg) != "top2_sum",
                    "no groups ranked by their best expert with sigmoid scores")]
    kind = "Mistral4" if mistral else "DeepseekV2" if v2 else "DeepseekV3"
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{kind}ForCausalLM has {what}; this model does not convert to it")
    check_pieces(cfg, f"{kind}ForCausalLM", has=("rope_yarn_factor", "query_scale_beta", "moe_routed_scaling"))
    check_shared_width(cfg, f"{kind}ForCausalLM")
    rope = rope_parameters_of(cfg)
    sparse = {}
    if cfg.index_topk:
        glm = bool(cfg.index_layer_types)
        sparse = {"architectures": ["GlmMoeDsaForCausalLM" if glm else "DeepseekV32ForCausalLM"],
                  "model_type": "glm_moe_dsa" if glm else "deepseek_v32", "index_topk": cfg.index_topk,
                  "index_n_heads": cfg.index_heads, "index_head_dim": cfg.index_head_dim,
                  **({"indexer_types": list(cfg.index_layer_types)} if glm else {}),
                  "mlp_layer_types": ["dense" if i < cfg.moe_first_dense_layers else "sparse"
                                      for i in range(cfg.num_layers)]}
    routing = ({"topk_method": "group_limited_greedy" if cfg.moe_groups else "greedy", "scoring_func": "softmax",
                "aux_loss_alpha": cfg.moe_aux_loss_coeff, "seq_aux": cfg.moe_aux_loss_type == "sequence"} if v2
               else {})
    if cfg.query_scale_beta:
        rope = {**rope, "llama_4_scaling_beta": cfg.query_scale_beta,
                "original_max_position_embeddings": cfg.query_scale_positions}
    kind = "Mistral4" if mistral else "DeepseekV2" if v2 else "DeepseekV3"
    return {
        "architectures": [f"{kind}ForCausalLM"],
        "model_type": {"Mistral4": "mistral4", "DeepseekV2": "deepseek_v2"}.get(kind, "deepseek_v3"),
        "vocab_size": cfg.vocab_size, **routing,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads, "hidden_act": "silu",
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "rope_interleave": True, "rope_parameters": rope,
        "n_routed_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
        "moe_intermediate_size": cfg.moe_ffn_size, "n_shared_experts": cfg.moe_shared_experts,
        "first_k_dense_replace": cfg.moe_first_dense_layers, "n_group": cfg.moe_groups or 1,
        "topk_group": cfg.moe_topk_groups or 1, "norm_topk_prob": cfg.moe_norm_topk_prob,
        "routed_scaling_factor": cfg.moe_routed_scaling, "num_nextn_predict_layers": cfg.mtp_layers,
        "max_position_embeddings": cfg.seq_length, "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std, "attention_bias": False, "attention_dropout": cfg.attention_dropout_p,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32", **sparse,
    }


def _permute_indexer(value: torch.Tensor, cfg: ModelConfig, ours: str, inverse: bool) -> torch.Tensor:
    """GLM-5's indexer: the first qk_rope_head_dim channels of each head (wq_b's rows, wk's rows, k_norm's
    weight and bias) de-interleaved, or re-interleaved with `inverse`."""
    perm = rope_permutation(cfg.qk_rope_head_dim)
    perm = torch.argsort(perm) if inverse else perm
    rope, dim = cfg.qk_rope_head_dim, cfg.index_head_dim
    heads = value.reshape(-1, dim, *value.shape[1:])
    return torch.cat((heads[:, :rope][:, perm], heads[:, rope:]), dim=1).reshape(value.shape).contiguous()


def _indexer_interleaved(cfg: ModelConfig, ours: str) -> bool:
    """Whether `ours` is a GLM-5 indexer tensor whose rotary channels HF interleaves."""
    return ".indexer." in ours and bool(cfg.index_layer_types) and "weights_proj" not in ours


def _reordered(cfg: ModelConfig, ours: str, interleaved: bool) -> bool:
    """Whether the HF tensor `ours` has rotary rows to de-interleave on import (and re-interleave on export)."""
    kind = ours.split(".")[-2]
    return _indexer_interleaved(cfg, ours) or (interleaved and ".attn." in ours and kind in ("q", "q_b", "kv_a")
                                               and ".indexer." not in ours)


def tensor_from_hf(cfg: ModelConfig, ours: str, value: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A HF tensor in shardlm's layout (the rotary rows de-interleaved when the checkpoint interleaves them)."""
    if not _reordered(cfg, ours, interleaved):
        return value
    if _indexer_interleaved(cfg, ours):
        return _permute_indexer(value, cfg, ours, inverse=False)
    return _permute_rope_rows(value, cfg, ours.split(".")[-2], inverse=False)


def tensor_to_hf(cfg: ModelConfig, ours: str, value: torch.Tensor) -> torch.Tensor:
    """A shardlm tensor in HF's interleaved layout (`rope_interleave` true), vocabulary padding dropped."""
    if _indexer_interleaved(cfg, ours):
        return _permute_indexer(value, cfg, ours, inverse=True)
    kind = ours.split(".")[-2]
    if ".attn." in ours and kind in ("q", "q_b", "kv_a"):
        return _permute_rope_rows(value, cfg, kind, inverse=True)
    return value[: cfg.vocab_size] if ours in ("wte.weight", "lm_head.weight") else value


def open_hf(hf_dir: Path) -> tuple[RunConfig, dict[str, HFTensor]]:
    """(config, {shardlm name: its `HFTensor` in shardlm's layout}) of a local HF DeepSeek-V2/V3/V3.2 or GLM-5
    directory, read on demand (`checkpoint.init_from` reads it in place); the tensors with rotary rows to reorder
    are read whole, the others only in the rows asked for."""
    located = weight_files(hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    config = RunConfig(model=model_config_from_hf(hf))
    prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if any(n.startswith(p) for n in located)), "model.")
    use_tokenizer(config, hf_dir)
    if not config.model.tie_embeddings and output_name(prefix) not in located:
        config.model.tie_embeddings = True  # a tied model saved without its (shared) output weight
    drop_missing_mtp(config.model, located, hf_dir)
    hf = text_config(hf)
    # DeepseekV2ForCausalLM (and the sparse families) interleave whatever rope_interleave says
    interleaved = hf.get("rope_interleave", True) or hf["model_type"] in SPARSE + ("deepseek_v2",)
    handles: dict = {}
    sources = {}
    for ours, theirs in name_map(config.model, prefix):
        if theirs not in located:
            sources[ours] = stacked_expert(handles, located, config.model, ours, theirs, hf_dir)
            continue
        convert = None
        if _reordered(config.model, ours, interleaved):
            convert = functools.partial(tensor_from_hf, config.model, ours, interleaved=interleaved)
        sources[ours] = HFTensor(handles, located[theirs], theirs, convert)
    _refuse_unplaced(located, {source.name for source in sources.values()}, hf_dir)
    return config, sources


LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
"""Where a multimodal directory (Mistral 3's format: a Mistral 4 language model) keeps its language model."""
SET_ASIDE = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
"""A multimodal directory's other towers, which shardlm's language model leaves out."""


def _refuse_unplaced(located: dict, placed: set[str], hf_dir: Path) -> None:
    """UserError (one line) when the directory holds language-model weights that no shardlm tensor reads."""
    left = sorted(n for n in located if n not in placed and not n.startswith(SET_ASIDE))
    if left:
        raise UserError(f"{hf_dir} holds {len(left)} weights shardlm would not read (first: {left[0]}); "
                        "its config.json does not describe them")


def to_hf(config: RunConfig, tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write a consolidated shardlm checkpoint of a Llama with MLA as a HF DeepseekV3ForCausalLM directory
    (a router without an expert bias is written with a zero e_score_correction_bias)."""
    cfg = config.model
    hf_config = hf_config_from_model(cfg)
    if cfg.index_topk and cfg.index_stage == "warmup":
        print("note: this checkpoint is at DeepSeek Sparse Attention's dense warm-up stage (model.index_stage = "
              '"warmup": its attention is dense, only the indexers train); the directory attends sparsely, to each '
              "query's top-k keys as chosen by those indexers", file=sys.stderr)
    hf = {}
    for ours, theirs in name_map(cfg):
        value = tensors.get(f"model/{ours}")
        if value is None and ours.endswith("router.expert_bias"):
            value = torch.zeros(cfg.moe_num_experts)
        hf[theirs] = tensor_to_hf(cfg, ours, value).contiguous()
    if hf_config["model_type"] == "mistral4":  # transformers stores its experts stacked
        hf = stack_experts(hf, cfg)
    return write_directory(out_dir, hf, hf_config, config.data)


def stack_experts(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors (`mlp.experts.e.{gate,up,down}_proj.weight`) as transformers' stacked ones: gate_up_proj
    (E, 2 f, h), each expert's gate rows then its up rows, and down_proj (E, h, f)."""
    out = {name: value for name, value in hf.items() if ".mlp.experts." not in name}
    layers = sorted({name.split(".mlp.experts.")[0] for name in hf if ".mlp.experts." in name})
    for layer in layers:
        experts = range(cfg.moe_num_experts)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat((hf[f"{layer}.mlp.experts.{e}.gate_proj.weight"], hf[f"{layer}.mlp.experts.{e}.up_proj.weight"]))
            for e in experts])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([hf[f"{layer}.mlp.experts.{e}.down_proj.weight"]
                                                             for e in experts])
    return out
