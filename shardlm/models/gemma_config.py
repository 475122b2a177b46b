"""Gemma 4's layer kinds and the checks of its [model] keys (`shardlm.models.gemma` builds the model): which layers
slide and which attend to everything, each kind's head size and KV heads, which layers share which layer's keys and
values, and the one-line UserErrors for settings the model cannot compute."""

from __future__ import annotations

from dataclasses import replace

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_kind(cfg: ModelConfig, index: int) -> str:
    """"sliding_attention" or "full_attention"."""
    return SLIDING if cfg.is_sliding_layer(index) else FULL


def layer_shape(cfg: ModelConfig, index: int) -> ModelConfig:
    """`cfg` with layer `index`'s head size and KV heads (a full layer's `global_head_dim` / `global_kv_heads`)."""
    if layer_kind(cfg, index) == SLIDING:
        return cfg
    return replace(cfg, head_dim=cfg.global_head_dim or cfg.attention_head_dim,
                   num_kv_heads=cfg.global_kv_heads or cfg.kv_heads)


def kv_source(cfg: ModelConfig, index: int) -> int | None:
    """The layer whose keys and values layer `index` attends to: None when it computes its own, else the last layer
    of its kind before the first KV-sharing one (transformers' kv_sharing_modes)."""
    first_shared = cfg.num_layers - cfg.kv_shared_layers
    if not cfg.kv_shared_layers or index < first_shared:
        return None
    kind = layer_kind(cfg, index)
    return max((i for i in range(first_shared) if layer_kind(cfg, i) == kind), default=None)


def kv_producers(cfg: ModelConfig) -> set[int]:
    """The layers whose keys and values later layers reuse."""
    return {kv_source(cfg, i) for i in range(cfg.num_layers)} - {None}


def hidden_only_split_problem(cfg: ModelConfig, stages: list[list[int]]) -> str | None:
    """Why a pipeline forward that hands only the hidden state from stage to stage (RL rollouts, on-policy
    distillation's sampling, a distillation teacher) cannot run this model split into `stages` (lists of layer ids),
    or None: training's schedule hands the shared keys and values and the per-layer inputs on
    (`Gemma4.stage_handoff`), those forwards do not."""
    if not cfg.sandwich_norms or sum(1 for stage in stages if stage) <= 1:
        return None
    if cfg.per_layer_input_size:
        return ("Gemma 4's per-layer inputs (model.per_layer_input_size) cannot reach the layers of later pipeline "
                "stages when sampling; set parallel.pipeline=1 for rollouts")
    for stage in stages:
        for i in stage:
            source = kv_source(cfg, i)
            if source is not None and source not in stage:
                return (f"Gemma 4's layer {i} shares layer {source}'s keys and values from another pipeline stage, "
                        "which sampling cannot hand on; keep them in one stage (parallel.first_stage_layers / "
                        "last_stage_layers) or set parallel.pipeline=1")
    return None


def check_gemma(cfg: ModelConfig, tp_size: int = 1) -> None:
    """One-line UserErrors for Gemma keys the model cannot compute (called when it is built); the Gemma-only keys
    without `sandwich_norms = true` are refused by `check_gemma_keys`."""
    check_gemma_keys(cfg)
    problems = [
        (cfg.attention == "mha", f'model.sandwich_norms (Gemma 4) needs attention="mha", not '
                                 f'"{cfg.attention}"'),
        (cfg.qk_norm and cfg.qk_norm_scope == "head" and not cfg.norm_zero_centered,
         'model.sandwich_norms (Gemma 4) needs qk_norm = true with qk_norm_scope="head" and plain norms'),
        (not any(cfg.is_linear_layer(i) for i in range(cfg.num_layers)) and not cfg.mtp_layers,
         'model.sandwich_norms (Gemma 4) has no linear-attention or multi-token-prediction layers'),
        (not (cfg.attention_sinks or cfg.attention_output_gate or cfg.rope_yarn_factor or cfg.rope_llama3_factor
              or cfg.rope_fraction != 1),
         'model.sandwich_norms (Gemma 4) has no sinks, output gate, YaRN, llama3 rope scaling or rope_fraction (use '
         'global_rope_fraction)'),
        (0 <= cfg.kv_shared_layers < cfg.num_layers,
         f"model.kv_shared_layers={cfg.kv_shared_layers} must be in 0..num_layers-1 (an earlier layer computes them)"),
        (all(kv_source(cfg, i) is not None for i in range(cfg.num_layers - cfg.kv_shared_layers, cfg.num_layers)),
         "model.kv_shared_layers: a key/value-sharing layer has no earlier layer of its kind (sliding or full) "
         "to share with; share fewer layers"),
        (0 < cfg.global_rope_fraction <= 1, f"model.global_rope_fraction={cfg.global_rope_fraction} must be in (0, 1]"),
        (cfg.final_logit_softcap >= 0, f"model.final_logit_softcap={cfg.final_logit_softcap} must be >= 0"),
        (cfg.num_heads % max(1, cfg.global_kv_heads) == 0,
         f"model.global_kv_heads={cfg.global_kv_heads} must divide num_heads={cfg.num_heads}"),
        (not cfg.moe_beside_mlp or cfg.moe_num_experts > 0, "model.moe_beside_mlp needs moe_num_experts > 0"),
        (cfg.moe_beside_mlp or not cfg.moe_num_experts,
         'model.sandwich_norms (Gemma 4) runs experts beside the MLP: set moe_beside_mlp = true'),
        ((cfg.per_layer_vocab_size or cfg.vocab_size) % tp_size == 0,
         f"model.per_layer_vocab_size={cfg.per_layer_vocab_size or cfg.vocab_size} (the per-layer table's rows, "
         f"split over TP unpadded) must divide by parallel.tensor={tp_size}"),
    ]
    for ok, message in problems:
        if not ok:
            raise UserError(message)


GEMMA_KEYS = ("embedding_scale", "attention_scale", "value_norm", "attention_k_eq_v", "global_head_dim",
              "global_kv_heads", "global_rope_theta", "kv_shared_layers", "kv_shared_double_mlp",
              "per_layer_input_size", "per_layer_vocab_size", "final_logit_softcap", "moe_beside_mlp")


def check_gemma_keys(cfg: ModelConfig) -> None:
    """UserError (one line) for a Gemma 4 key set on a model that is not Gemma 4's block."""
    if cfg.sandwich_norms:
        if cfg.norm_placement != "pre":
            raise UserError(f'model.sandwich_norms (Gemma 4) has norms before and after each sublayer; it needs '
                            f'model.norm_placement="pre", not "{cfg.norm_placement}"')
        return
    defaults = ModelConfig()
    shared = {"global_rope_theta"} if cfg.hc_mult else set()  # DeepSeek-V4's compressing layers' rotary base too
    used = [key for key in GEMMA_KEYS if getattr(cfg, key) != getattr(defaults, key) and key not in shared]
    if cfg.global_rope_fraction != 1.0:
        used.append("global_rope_fraction")
    if used:
        raise UserError(f"model.{used[0]} is Gemma 4's; it needs model.sandwich_norms = true (Gemma 4's block)")


def gemma_flops_per_token(cfg: ModelConfig, recompute: bool = False) -> float:
    """Matmul FLOPs of training on one token (3 x the forward, plus the layers' forward again with `recompute`) of
    Gemma 4 (`plan.flops.flops_per_token` counts it here), per layer by its kind: q and o (2 h H d_i each), k and v
    (2 h kv_i d_i each) on the layers that compute their own (no v on a full layer with k = v), the scores and values
    over min(s, window) keys on sliding layers and s on full ones (4 keys H d_i), the GeGLU's three matrices (2 h f_i
    each, f_i twice as wide on a sharing layer with `kv_shared_double_mlp`), with experts beside it the router (2 h E)
    and the top-k experts' three matrices, with per-layer inputs the gate and projection (4 h d); outside the layers
    the output layer (2 h V) and the per-layer inputs' projection (2 h L d)."""
    s, h, heads = cfg.seq_length, cfg.hidden_size, cfg.num_heads
    ple = cfg.per_layer_input_size

    def layer(i: int) -> float:
        shape, full = layer_shape(cfg, i), layer_kind(cfg, i) == FULL
        d, kv = shape.attention_head_dim, shape.kv_heads
        flops = 4 * h * heads * d + 4 * (s if full else min(s, cfg.sliding_window)) * heads * d
        if kv_source(cfg, i) is None:
            flops += 2 * h * kv * d * (1 if cfg.attention_k_eq_v and full else 2)
        wide = 2 if cfg.kv_shared_double_mlp and kv_source(cfg, i) is not None else 1
        flops += 6 * h * cfg.ffn_size * wide + 4 * h * ple
        if cfg.moe_beside_mlp:
            flops += 2 * h * cfg.moe_num_experts + cfg.moe_top_k * 6 * h * cfg.moe_ffn_size
        return flops

    layers = sum(layer(i) for i in range(cfg.num_layers))
    forward = layers + 2 * h * cfg.vocab_size + 2 * h * cfg.num_layers * ple
    return 3 * forward + (layers if recompute else 0.0)
