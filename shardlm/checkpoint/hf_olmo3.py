"""OLMo 3 (`Olmo3ForCausalLM`) <-> shardlm's Llama: the config rules `shardlm.checkpoint.hf_llama` applies to
an OLMo 3 directory (its tensors map by name as Llama's do).

OLMo 3 (`olmo3`) is Llama with post-norms (`norm_placement = "post"`: its post_attention_layernorm, applied to
the attention's output, is shardlm's `ln_1`, and post_feedforward_layernorm `ln_2`; there is no input_layernorm),
QK-norm over whole projections (`qk_norm_scope = "projection"`: q_norm of num_heads x head_dim channels, k_norm of
num_kv_heads x head_dim) and a sliding window on the layers `layer_types` names "sliding_attention" (3 of 4). Its
config keeps one rotary embedding per kind of layer. Both kinds share one base; the long-context checkpoints scale
the full layers' by YaRN and leave the sliding ones' unscaled (`rope_yarn_layers = "full"`, with the checkpoint's
attention_factor); YaRN on both kinds is `"all"`. Other rotaries are refused in one line.
"""

from __future__ import annotations

from shardlm.checkpoint.hf_common import rope_parameters_of, yarn_keys
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

LAYERS = ("full_attention", "sliding_attention")
KINDS = ("olmo2", "olmo3")
"""The HF model types of this block: OLMo 3, and OLMo 2 (`Olmo2ForCausalLM`: the same block without sliding windows,
one rotary embedding read and written as Llama's)."""
POST_NORMS = {"norm_placement": "post", "qk_norm": True, "qk_norm_scope": "projection"}
"""The [model] keys of the OLMo block."""


def check(cfg: ModelConfig) -> None:
    """UserError (one line) for a model with post-norms or whole-projection QK-norm that `Olmo3ForCausalLM` and
    `Olmo2ForCausalLM` (the HF families here with either) do not compute."""
    layer_types = set(cfg.layer_types) if cfg.layer_types else set()
    unsupported = [
        (not (cfg.norm_placement == "post" and cfg.qk_norm and cfg.qk_norm_scope == "projection"),
         f'norm_placement="{cfg.norm_placement}" with qk_norm={cfg.qk_norm} and qk_norm_scope="{cfg.qk_norm_scope}" '
         '(it has both post-norms and QK-norm over whole projections)'),
        (cfg.attention != "mha", f'attention="{cfg.attention}"'), (cfg.moe_num_experts > 0, "experts"),
        (cfg.attention_bias or cfg.attention_output_bias, "biases"), (cfg.attention_sinks, "attention sinks"),
        (cfg.attention_output_gate, "an attention output gate"), (cfg.norm_zero_centered, "zero-centred norms"),
        (cfg.rope_fraction != 1.0, "partial rotary embeddings"),
        (not layer_types <= set(LAYERS), "layer types other than full and sliding attention"),
        (cfg.mtp_layers > 0, "multi-token prediction layers")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"Olmo3ForCausalLM has no {what} (nor has Olmo2ForCausalLM); this model does not convert "
                            "to it")


DEFAULT_THETA = 500000.0
"""Olmo3Config's rotary base where a config names none."""


def _rotaries(hf: dict) -> dict:
    """{layer kind: its rotary parameters} of an Olmo3Config dict, for the kinds its layers use: transformers 5 keeps
    one rope_parameters entry per layer type; an older config.json one rope_theta and a rope_scaling for the
    full-attention layers only (as transformers 4 reads it: the sliding ones keep the default at the same base)."""
    params = hf.get("rope_parameters") or {}
    if not any(kind in params for kind in LAYERS):
        theta = hf.get("rope_theta", params.get("rope_theta", DEFAULT_THETA))
        params = {"full_attention": {"rope_theta": theta, **(hf.get("rope_scaling") or {}), **params},
                  "sliding_attention": {"rope_theta": theta}}
    used = [kind for kind in LAYERS if kind in (hf.get("layer_types") or LAYERS)]
    return {kind: params.get(kind) or {} for kind in used}


def _kind(params: dict) -> str:
    return params.get("rope_type") or params.get("type") or "default"


def rope(hf: dict) -> tuple[float, str]:
    """(theta, "default") of an Olmo3Config dict whose rotaries shardlm computes (`rope_keys` has the YaRN keys);
    UserError for the others: another rope type, two bases (shardlm's llama has one), YaRN on the sliding layers
    only or unlike on the two kinds."""
    rotaries = _rotaries(hf)
    kinds = {kind: _kind(params) for kind, params in rotaries.items()}
    thetas = {float(params.get("rope_theta", DEFAULT_THETA)) for params in rotaries.values()}
    scaled = [params for params in rotaries.values() if _kind(params) == "yarn"]
    if (set(kinds.values()) - {"default", "yarn"} or len(thetas) > 1 or any(p != scaled[0] for p in scaled)
            or (kinds.get("sliding_attention"), kinds.get("full_attention")) == ("yarn", "default")):
        raise UserError(f"the HF model's full and sliding attention layers rotate differently ({rotaries}), which "
                        "shardlm's llama does not compute (one rotary base; the default rotary, YaRN on the full "
                        "layers, or alike on both)")
    return (thetas.pop() if thetas else DEFAULT_THETA), "default"


def rope_keys(hf: dict) -> dict:
    """The `model.rope_yarn_*` keys of an Olmo3Config dict that `rope` accepts: none without YaRN; its keys with
    rope_yarn_layers "full" when the sliding layers keep the default rotary, "all" when every layer scales."""
    rotaries = _rotaries(hf)
    scaled = [params for params in rotaries.values() if _kind(params) == "yarn"]
    if not scaled:
        return {}
    full_only = _kind(rotaries.get("sliding_attention", scaled[0])) == "default"
    return yarn_keys(scaled[0], hf["max_position_embeddings"]) | {"rope_yarn_layers": "full" if full_only else "all"}


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
    return POST_NORMS | {"sliding_window": window, "layer_types": layer_types, **rope_keys(hf)}


def to_hf(cfg: ModelConfig, kind: str = "olmo3") -> dict:
    """Olmo3Config's own keys: the window and the layer types, one rotary embedding per layer type (YaRN on the
    full layers, and on the sliding ones unless `rope_yarn_layers` is "full"), and no special tokens (the configs'
    defaults name ids of OLMo's own vocabulary); Olmo2Config's (`kind` "olmo2"): no special tokens."""
    if kind == "olmo2":
        return {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    layer_types = ["sliding_attention" if cfg.is_sliding_layer(i) else "full_attention" for i in range(cfg.num_layers)]
    unscaled = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope = {"full_attention": rope_parameters_of(cfg),
            "sliding_attention": unscaled if cfg.rope_yarn_layers == "full" else rope_parameters_of(cfg)}
    return {"sliding_window": cfg.sliding_window or None, "layer_types": layer_types, "rope_parameters": rope,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
