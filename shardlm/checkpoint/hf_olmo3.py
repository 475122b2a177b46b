"""OLMo 3 (`Olmo3ForCausalLM`) <-> shardlm's Llama: the config rules `shardlm.checkpoint.hf_llama` applies to
an OLMo 3 directory (its tensors map by name as Llama's do).

OLMo 3 (`olmo3`) is Llama with post-norms (`norm_placement = "post"`: its post_attention_layernorm, applied to
the attention's output, is shardlm's `ln_1`, and post_feedforward_layernorm `ln_2`; there is no input_layernorm),
QK-norm over whole projections (`qk_norm_scope = "projection"`: q_norm of num_heads x head_dim channels, k_norm of
num_kv_heads x head_dim) and a sliding window on the layers `layer_types` names "sliding_attention" (3 of 4); its
rotary embedding must be the same default one on both kinds of layer (the YaRN long-context variants scale the full
layers' only, which shardlm does not compute).
"""

from __future__ import annotations

from shardlm.checkpoint.hf_common import rope_theta_and_type
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

LAYERS = ("full_attention", "sliding_attention")


def check(cfg: ModelConfig) -> None:
    """UserError (one line) for a model with post-norms or whole-projection QK-norm that `Olmo3ForCausalLM` (the one
    HF family here with either) does not compute."""
    layer_types = set(cfg.layer_types) if cfg.layer_types else set()
    unsupported = [
        (not (cfg.norm_placement == "post" and cfg.qk_norm and cfg.qk_norm_scope == "projection"),
         f'norm_placement="{cfg.norm_placement}" with qk_norm={cfg.qk_norm} and qk_norm_scope="{cfg.qk_norm_scope}" '
         '(it has both post-norms and QK-norm over whole projections)'),
        (cfg.attention != "mha", f'attention="{cfg.attention}"'), (cfg.moe_num_experts > 0, "experts"),
        (cfg.attention_bias or cfg.attention_output_bias, "biases"), (cfg.attention_sinks, "attention sinks"),
        (cfg.attention_output_gate, "an attention output gate"), (cfg.norm_zero_centered, "zero-centred norms"),
        (cfg.rope_fraction != 1.0 or cfg.rope_yarn_factor > 0, "partial or YaRN rotary embeddings"),
        (not layer_types <= set(LAYERS), "layer types other than full and sliding attention"),
        (cfg.mtp_layers > 0, "multi-token prediction layers")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"Olmo3ForCausalLM has no {what}; this model does not convert to it")


def rope(hf: dict) -> tuple[float, str]:
    """(theta, rope type) of an Olmo3Config dict: transformers 5 keeps one rope_parameters entry per layer type, an
    older config.json a rope_theta and a rope_scaling that applies to the full-attention layers only. UserError when
    the two kinds of layer rotate differently (shardlm has one rotary embedding)."""
    params = hf.get("rope_parameters") or {}
    if any(kind in params for kind in LAYERS):
        used = {kind for kind in hf.get("layer_types") or LAYERS if kind in LAYERS}
        found = {(float(params[kind].get("rope_theta", 500000.0)), params[kind].get("rope_type", "default"))
                 for kind in used if params.get(kind)}
        if len(found) > 1:
            raise UserError(f"the HF model's full and sliding attention layers rotate differently ({sorted(found)} "
                            "in rope_parameters), which shardlm's llama (one rotary embedding) does not compute")
        return found.pop() if found else (500000.0, "default")
    return rope_theta_and_type(hf | {"rope_theta": hf.get("rope_theta", 500000.0)})


def from_hf(hf: dict) -> dict:
    """The OLMo 3 keys of the [model] section: post-norms, QK-norm over whole projections, the sliding window and the
    layer types (without them, Olmo3Config's: 3 sliding layers before each full one; UserError for layer types
    shardlm's OLMo 3 does not compute)."""
    layers = hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                                 for i in range(layers)])
    window = hf.get("sliding_window") or 0
    if not set(layer_types) <= set(LAYERS) or len(layer_types) != layers:
        raise UserError(f"the HF model's layer_types {layer_types} are not one of {list(LAYERS)} per layer, "
                        "which shardlm's OLMo 3 computes")
    if "sliding_attention" in layer_types and not window:
        raise UserError("the HF model names sliding_attention layers without a sliding_window; set its size")
    if not window or "sliding_attention" not in layer_types:
        window, layer_types = 0, []
    return {"norm_placement": "post", "qk_norm": True, "qk_norm_scope": "projection", "sliding_window": window,
            "layer_types": layer_types}


def to_hf(cfg: ModelConfig) -> dict:
    """Olmo3Config's own keys: the window and the layer types, one rotary embedding per layer type (both the same),
    and no special tokens (Olmo3Config's defaults name ids of OLMo's own vocabulary)."""
    layer_types = ["sliding_attention" if cfg.is_sliding_layer(i) else "full_attention" for i in range(cfg.num_layers)]
    rope = {kind: {"rope_type": "default", "rope_theta": cfg.rope_theta} for kind in LAYERS}
    return {"sliding_window": cfg.sliding_window or None, "layer_types": layer_types, "rope_parameters": rope,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
