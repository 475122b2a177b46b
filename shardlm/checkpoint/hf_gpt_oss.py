"""Hugging Face gpt-oss interop: `GptOssForCausalLM` directories (gpt-oss-20b, gpt-oss-120b) <-> shardlm.

gpt-oss is shardlm's Llama (`arch = "llama"`) with every layer an MoE layer and these keys set:
`attention_bias` and `attention_output_bias` (q/k/v/o biases), `attention_sinks` (`self_attn.sinks`, one
logit per head), `sliding_window` with `layer_types`, YaRN (`rope_yarn_*`, truncate off), `moe_router_bias`
(the router's softmax over its top-k logits is shardlm's softmax top-k renormalized), `moe_linear_bias` and
`swiglu_limit` / `swiglu_alpha` (biased experts with the clamped SwiGLU). Names:

    model.layers.i.self_attn.sinks                 layers.i.attn.sinks
    model.layers.i.self_attn.{q,k,v,o}_proj.bias   layers.i.attn.{q,k,v,o}.bias
    model.layers.i.mlp.router.{weight,bias}        layers.i.mlp.router.{weight,bias}
    model.layers.i.mlp.experts.gate_up_proj        layers.i.mlp.experts.{gate,up}.e   (E, h, 2f): x @ W, the
                                                   gate and up columns interleaved; ours (f, h) per expert
    model.layers.i.mlp.experts.gate_up_proj_bias   layers.i.mlp.experts.{gate,up}_bias.e
    model.layers.i.mlp.experts.down_proj(_bias)    layers.i.mlp.experts.down(_bias).e  (E, f, h) -> (h, f)

and the Llama names for the rest. The released checkpoints store the expert matrices in MXFP4
(`gate_up_proj_blocks` / `_scales`, `down_proj_blocks` / `_scales`: 32-value blocks of 4-bit E2M1 numbers
sharing one power-of-two scale); `dequantize_mxfp4` expands them exactly (every value is a small float
times a power of two, so fp32 holds it without rounding), as transformers' `convert_moe_packed_tensors`
does. Reading is per expert, so a 120B directory is never read whole. The export writes unquantized fp32
experts in transformers' layout with no `quantization_config` (transformers loads it as is).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.checkpoint.hf_common import HFTensor, check_pieces, rope_parameters, rope_parameters_of, yarn_keys
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit E2M1 number, by its bits (OCP Microscaling Formats spec, FP4 E2M1)."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> fp32: blocks (..., rows, G, 16) uint8 (two 4-bit values a byte, the low nibble first), scales
    (..., rows, G) uint8 (a biased power-of-two exponent, 127 = 2^0, per 32 values) -> (..., rows, 32 G)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2)


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's [model] section of a `GptOssConfig` dict; UserError for what shardlm does not compute."""
    rope = rope_parameters(hf)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "yarn") or rope.get("attention_factor") is not None:
        raise UserError(f"the HF model has rope type {kind!r} with {rope}, which shardlm's gpt-oss does not compute "
                        "(default and yarn without attention_factor convert)")
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    yarn = yarn_keys(rope, hf["max_position_embeddings"]) if kind == "yarn" else {}
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        arch="llama", num_layers=layers, hidden_size=hf["hidden_size"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, seq_length=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], ffn_hidden_size=hf["intermediate_size"], dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)), layernorm_epsilon=hf.get("rms_norm_eps", 1e-5),
        init_std=hf.get("initializer_range", 0.02), rope_theta=float(rope.get("rope_theta", hf.get("rope_theta",
                                                                                                      150000.0))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), head_dim=hf.get("head_dim") or 0,
        attention_bias=bias, attention_output_bias=bias, attention_sinks=True,
        sliding_window=hf.get("sliding_window") or 0, layer_types=list(hf.get("layer_types") or []),
        moe_num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"], moe_norm_topk_prob=True, moe_router_bias=True,
        moe_linear_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), **yarn)


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """The `GptOssConfig` dict of a gpt-oss-shaped shardlm model; UserError for what gpt-oss has no key for."""
    unsupported = [(cfg.moe_num_experts == 0 or cfg.moe_first_dense_layers or cfg.moe_layer_interval != 1,
                    "dense layers"), (cfg.moe_score != "softmax" or not cfg.moe_norm_topk_prob, "this routing"),
                   (cfg.moe_shared_experts or cfg.moe_groups or cfg.moe_expert_bias or cfg.moe_expert_bias_rate,
                    "shared experts, expert groups or an expert bias"), (cfg.qk_norm, "q/k norms"),
                   (cfg.rope_fraction != 1, "partial rotary"),
                   (cfg.attention_bias != cfg.attention_output_bias, "q/k/v biases without an o bias or back"),
                   (not (cfg.moe_router_bias and cfg.moe_linear_bias), "a router or experts without biases"),
                   (cfg.rope_yarn_factor and (cfg.rope_yarn_mscale_all_dim or cfg.rope_yarn_mscale not in (0, 1)),
                    "YaRN mscale"),
                   (cfg.rope_yarn_factor and cfg.rope_yarn_layers != "all", "YaRN on the full-attention layers only")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"GptOssForCausalLM has no {what}; this model does not convert to it")
    check_pieces(cfg, "GptOssForCausalLM",
                 has=("attention_sinks", "sliding_window", "rope_yarn_factor", "swiglu_limit"))
    rope = rope_parameters_of(cfg)
    layer_types = cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.num_layers
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.moe_ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attention_head_dim,
        "num_local_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
        "sliding_window": cfg.sliding_window or None, "layer_types": list(layer_types), "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length, "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std, "rope_parameters": rope, "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout_p, "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "output_router_logits": False, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
    }


def plain_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shardlm name, HF name) of every tensor stored one to one (all but the expert matrices and biases)."""
    names = [("wte.weight", "model.embed_tokens.weight"), ("ln_f.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}", f"model.layers.{i}"
        names += [(f"{s}.ln_1.weight", f"{h}.input_layernorm.weight"),
                  (f"{s}.ln_2.weight", f"{h}.post_attention_layernorm.weight"),
                  (f"{s}.attn.sinks", f"{h}.self_attn.sinks"),
                  (f"{s}.mlp.router.weight", f"{h}.mlp.router.weight"),
                  (f"{s}.mlp.router.bias", f"{h}.mlp.router.bias")]
        names += [(f"{s}.attn.{p}.weight", f"{h}.self_attn.{p}_proj.weight") for p in "qkvo"]
        if cfg.attention_bias:
            names += [(f"{s}.attn.{p}.bias", f"{h}.self_attn.{p}_proj.bias") for p in "qkvo"]
    return names


def expert_sources(cfg: ModelConfig, located: dict[str, Path], handles: dict) -> dict:
    """{shardlm name: reader} of every expert's matrices and biases, read one expert at a time; MXFP4 blocks
    where the directory holds them, plain tensors otherwise."""
    sources = {}
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}.mlp.experts", f"model.layers.{i}.mlp.experts"
        for e in range(cfg.moe_num_experts):
            for ours, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                if f"{h}.gate_up_proj_blocks" in located:
                    sources[f"{s}.{ours}.{e}"] = MXFP4Expert(handles, located, f"{h}.gate_up_proj", e, rows)
                else:  # (h, 2f) x @ W -> the gate's or up's (f, h) rows
                    sources[f"{s}.{ours}.{e}"] = HFTensor(handles, located[f"{h}.gate_up_proj"], f"{h}.gate_up_proj",
                                                          lambda w, rows=rows: w[:, rows].t(), select=e)
                sources[f"{s}.{ours}_bias.{e}"] = HFTensor(handles, located[f"{h}.gate_up_proj_bias"],
                                                           f"{h}.gate_up_proj_bias", lambda b, rows=rows: b[rows],
                                                           select=e)
            if f"{h}.down_proj_blocks" in located:
                sources[f"{s}.down.{e}"] = MXFP4Expert(handles, located, f"{h}.down_proj", e, slice(None))
            else:
                sources[f"{s}.down.{e}"] = HFTensor(handles, located[f"{h}.down_proj"], f"{h}.down_proj",
                                                    lambda w: w.t(), select=e)
            sources[f"{s}.down_bias.{e}"] = HFTensor(handles, located[f"{h}.down_proj_bias"], f"{h}.down_proj_bias",
                                                     select=e)
    return sources


class MXFP4Expert:
    """One expert's matrix from MXFP4 `{name}_blocks` / `{name}_scales`, dequantized to fp32 (rows, in) and cut
    to `rows` (the gate's or up's interleaved rows of gate_up_proj); read like an `HFTensor`."""

    def __init__(self, handles: dict, located: dict[str, Path], name: str, expert: int, rows: slice):
        self.parts = [HFTensor(handles, located[f"{name}_{kind}"], f"{name}_{kind}") for kind in ("blocks", "scales")]
        self.expert, self.rows = expert, rows

    def __call__(self) -> torch.Tensor:
        blocks, scales = (p._file().get_slice(p.name)[self.expert] for p in self.parts)
        return dequantize_mxfp4(blocks, scales)[self.rows].contiguous()

    def shape(self) -> None:
        return None

    def part(self, dim: int, start: int, end: int) -> torch.Tensor:
        return self().narrow(dim, start, end - start).contiguous()


def sources_for(cfg: ModelConfig, located: dict[str, Path], hf_dir: Path) -> dict:
    """{shardlm name: reader} of a gpt-oss directory whose tensors are `located` (HF name -> file)."""
    handles: dict = {}
    sources = {}
    for ours, theirs in plain_names(cfg):
        if theirs not in located:
            raise UserError(f"{hf_dir} has no tensor {theirs}")
        sources[ours] = HFTensor(handles, located[theirs], theirs)
    try:
        return sources | expert_sources(cfg, located, handles)
    except KeyError as missing:
        raise UserError(f"{hf_dir} has no tensor {missing.args[0]}") from None


def tensors_to_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{HF name: tensor} of a consolidated checkpoint's `model/...` tensors, experts stacked in transformers'
    layout (gate and up interleaved in gate_up_proj, x @ W)."""
    hf = {theirs: tensors[f"model/{ours}"] for ours, theirs in plain_names(cfg)}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in hf:
            hf[name] = hf[name][: cfg.vocab_size]
    for i in range(cfg.num_layers):
        s, h = f"model/layers.{i}.mlp.experts", f"model.layers.{i}.mlp.experts"
        experts = range(cfg.moe_num_experts)
        pair = lambda a, b: torch.stack((a, b), dim=1).flatten(0, 1)  # noqa: E731  rows a0 b0 a1 b1 ...
        hf[f"{h}.gate_up_proj"] = torch.stack([pair(tensors[f"{s}.gate.{e}"], tensors[f"{s}.up.{e}"]).t()
                                               for e in experts])
        hf[f"{h}.gate_up_proj_bias"] = torch.stack([pair(tensors[f"{s}.gate_bias.{e}"], tensors[f"{s}.up_bias.{e}"])
                                                    for e in experts])
        hf[f"{h}.down_proj"] = torch.stack([tensors[f"{s}.down.{e}"].t() for e in experts])
        hf[f"{h}.down_proj_bias"] = torch.stack([tensors[f"{s}.down_bias.{e}"] for e in experts])
    return {name: value.contiguous() for name, value in hf.items()}
