"""MiniMax-M2 (`MiniMaxM2ForCausalLM`) <-> shardlm's Llama with experts: the config rules
`shardlm.checkpoint.hf_llama` applies to a MiniMax-M2 directory, and its tensors under transformers'
in-memory names.

MiniMax-M2 (`minimax_m2`) is Llama (pre-norms) with OLMo 3's QK-norm over whole projections (`qk_norm_scope =
"projection"`, before RoPE, at rms_norm_eps like every norm), RoPE on the first rotary_dim channels of each head
(rotate-half within them: `rope_fraction` = partial_rotary_factor, or rotary_dim / head_dim in an older config.json)
and an MoE in every layer: sigmoid scores of the fp32 gate logits, the top-k chosen over scores +
e_score_correction_bias (`moe_expert_bias`), weights the chosen scores without the bias divided by their sum
(`moe_norm_topk_prob`), no routed scaling, groups or shared expert. On disk its experts are Mixtral's, one tensor per
expert (transformers 5 stacks them in memory and writes them back so):
    model.layers.i.block_sparse_moe.gate                   layers.i.mlp.router
    model.layers.i.block_sparse_moe.e_score_correction_bias  layers.i.mlp.router.expert_bias
    model.layers.i.block_sparse_moe.experts.e.w1/w3/w2     layers.i.mlp.experts.gate/up/down.e
and a directory holding transformers' in-memory names instead (`mlp.gate`, `mlp.e_score_correction_bias`, stacked
`mlp.experts.gate_up_proj` / `down_proj`) is read too. Its router_aux_loss_coef becomes `moe_aux_loss_coeff`, as
Mixtral's does: the weight of shardlm's balance loss (over the sigmoid scores divided by their sum, reported apart from
the language-model loss); transformers adds its own, over a softmax of the gate logits, only with
output_router_logits.
"""

from __future__ import annotations

from pathlib import Path

from shardlm.checkpoint.hf_common import MIXTRAL_EXPERTS, HFTensor, stacked_expert
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig


def check(cfg: ModelConfig) -> None:
    """UserError (one line) for a pre-norm model with whole-projection QK-norm and experts that `MiniMaxM2ForCausalLM`
    does not compute (sigmoid top-k routing over all experts of every layer, renormalized, with the score-correction
    bias; partial rotary embeddings; no biases, windows or shared experts)."""
    unsupported = [
        (cfg.attention != "mha", f'attention="{cfg.attention}"'),
        (cfg.attention_bias or cfg.attention_output_bias, "attention biases"), (cfg.attention_sinks, "attention sinks"),
        (cfg.attention_output_gate, "an attention output gate"), (cfg.norm_zero_centered, "zero-centred norms"),
        (cfg.rope_yarn_factor > 0, "YaRN rotary embeddings"),
        (cfg.sliding_window > 0 or bool(cfg.layer_types), "sliding-window or linear attention layers"),
        (cfg.mtp_layers > 0, "multi-token prediction layers"),
        (cfg.moe_score != "sigmoid", f'moe_score="{cfg.moe_score}" (its router scores are sigmoids)'),
        (not cfg.moe_norm_topk_prob, "moe_norm_topk_prob = false (it divides the chosen scores by their sum)"),
        (cfg.moe_routed_scaling != 1.0, "moe_routed_scaling"), (cfg.moe_shared_experts > 0, "shared experts"),
        (cfg.moe_groups > 0, "group-limited routing"),
        (cfg.moe_first_dense_layers > 0 or cfg.moe_layer_interval != 1, "dense MLP layers"),
        (cfg.moe_router_bias or cfg.moe_linear_bias, "router or expert biases"),
        (cfg.swiglu_limit > 0, "a clamped SwiGLU")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"MiniMaxM2ForCausalLM has no {what}; this model does not convert to it")


def routing(hf: dict) -> dict:
    """MiniMax-M2's `model.moe_*` keys: sigmoid scores, the score-correction bias in the choice only, the chosen
    scores divided by their sum, every layer's MLP an MoE of intermediate_size-wide experts."""
    return {"moe_num_experts": hf["num_local_experts"], "moe_top_k": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["intermediate_size"], "moe_score": "sigmoid", "moe_expert_bias": True,
            "moe_norm_topk_prob": True, "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}


DEFAULTS = {"head_dim": 128, "rope_theta": 5000000.0, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8,
                       "num_local_experts": 256}
"""MiniMaxM2Config's values of the keys a config.json may leave out and shardlm reads (its head_dim is not
hidden_size / num_attention_heads, its default rotary base 5e6)."""


def config(hf: dict) -> dict:
    """A MiniMax-M2 config.json as MiniMaxM2Config reads it: its defaults for absent keys, and partial_rotary_factor
    from the legacy rotary_dim (rotary_dim / head_dim) unless one is given. UserError (one line) for what
    transformers' MiniMaxM2ForCausalLM (and so shardlm) does not compute: quantized weights, the released
    checkpoints' per-head QK-norm or none, other router scores, a shared expert, lightning-attention layers,
    router jitter."""
    hf = DEFAULTS | hf
    if hf.get("rotary_dim") is not None and "partial_rotary_factor" not in hf:
        hf["partial_rotary_factor"] = hf["rotary_dim"] / hf["head_dim"]
    quantized = (hf.get("quantization_config") or {}).get("quant_method")
    refusals = [
        (not quantized, f"quantized weights ({quantized}, with scale tensors); convert a bf16 copy and read that"),
        (hf.get("use_qk_norm", True), "no QK-norm (use_qk_norm=false)"),
        (hf.get("qk_norm_type", "per_layer") == "per_layer",
         f"qk_norm_type={hf.get('qk_norm_type')!r} (only per_layer, one norm over each whole projection, converts)"),
        (hf.get("scoring_func", "sigmoid") == "sigmoid", f"scoring_func={hf.get('scoring_func')!r}"),
        (not hf.get("shared_intermediate_size"), "a shared expert (shared_intermediate_size)"),
        (all(kind == 1 for kind in hf.get("attn_type_list") or []), "lightning (linear) attention layers "
                                                                      "(attn_type_list entries 0)"),
        (not hf.get("router_jitter_noise"), "router_jitter_noise"),
    ]
    for ok, what in refusals:
        if not ok:
            raise UserError(f"the HF model has {what}, which shardlm's MiniMax-M2 does not compute")
    return hf


def to_hf(cfg: ModelConfig) -> dict:
    """MiniMaxM2Config's own keys (experts, legacy rotary_dim, no special tokens); `check` refused what it does not
    compute."""
    return {"num_local_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
            "intermediate_size": cfg.moe_ffn_size, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
            "output_router_logits": False, "router_jitter_noise": 0.0,
            "rotary_dim": int(cfg.attention_head_dim * cfg.rope_fraction),
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def in_memory_source(handles: dict, located: dict, cfg: ModelConfig, ours: str, theirs: str,
                      hf_dir: Path) -> HFTensor:
    """A MiniMax-M2 tensor from a directory saved under transformers' in-memory names: `mlp.` for
    `block_sparse_moe.`, the router `mlp.gate`, its bias `mlp.e_score_correction_bias`, and an expert's w1 / w3 / w2
    read from the stacked `mlp.experts.gate_up_proj` (E, 2 f, h; gate rows first) / `down_proj` (E, h, f)."""
    name = theirs.replace(".block_sparse_moe.", ".mlp.")
    for ours_part, theirs_part in MIXTRAL_EXPERTS:
        name = name.replace(f".{theirs_part}.weight", f".{ours_part}_proj.weight")
    if ".experts." not in name:
        if name not in located:
            raise UserError(f"{hf_dir} has no tensor {theirs} (nor {name})")
        return HFTensor(handles, located[name], name)
    return stacked_expert(handles, located, cfg, ours, name, hf_dir)
