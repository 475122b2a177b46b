"""HuggingFace GPT-2 interop: `GPT2LMHeadModel` safetensors <-> shardlm's consolidated checkpoint.

HF stores GPT-2's linears as `Conv1D` with weights (in, out), and its fused attention input as
columns [q | k | v], each over all heads. shardlm stores (out, in) like nn.Linear, and its fused QKV
rows head by head, (heads, 3, head_dim), so that a contiguous TP split keeps each head's q, k, v
together. The conversion transposes and permutes; it is exact (a round trip is bitwise lossless).
No network: the HF directory must be local (config.json + model.safetensors).
Every other family converts through its own module, chosen by the directory's model_type (`MODEL_TYPES`):
Llama-family directories through `shardlm.checkpoint.hf_llama` (gpt-oss's experts through
`shardlm.checkpoint.hf_gpt_oss`), DeepSeek-V3's MLA and its relatives through `shardlm.checkpoint.hf_deepseek`,
Qwen3.5 / Qwen3-Next, Kimi Linear, Nemotron-H, Gemma 4 and DeepSeek-V4 through their own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from shardlm.checkpoint import (
    files,
    hf_deepseek,
    hf_deepseek_v4,
    hf_gemma4,
    hf_kimi_linear,
    hf_llama,
    hf_nemotron_h,
    hf_qwen3_next,
    hf_reward,
)
from shardlm.checkpoint.hf_common import HFTensor, write_directory
from shardlm.config import RunConfig, from_dict
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

LLAMA_FAMILY = hf_llama.MODEL_TYPES  # HF model types that `shardlm.checkpoint.hf_llama` converts
DEEPSEEK = hf_deepseek.MODEL_TYPES  # HF model types that `shardlm.checkpoint.hf_deepseek` converts

CONVERTERS = ((LLAMA_FAMILY, hf_llama), (hf_qwen3_next.KINDS, hf_qwen3_next), (DEEPSEEK, hf_deepseek),
              (hf_nemotron_h.KINDS, hf_nemotron_h), (hf_kimi_linear.KINDS, hf_kimi_linear),
              (hf_gemma4.MODEL_TYPES, hf_gemma4), (hf_deepseek_v4.KINDS, hf_deepseek_v4))
"""(HF model types, the module whose `open_hf` converts them) of every family but GPT-2 (this module's own)."""
MODEL_TYPES = ("gpt2",) + sum((kinds for kinds, _ in CONVERTERS), ())
"""Every HF model_type that converts (`open_hf`)."""
FAMILIES = ("GPT-2, Llama 3, Qwen3, Qwen3-MoE, Qwen3.5 / Qwen3-Next, Mixtral, GLM-4.5, GLM-5, gpt-oss, OLMo 2 / 3, "
            "MiniMax-M2, DeepSeek-V2 / V3 / V3.2 / V4, Kimi K2, Kimi Linear, Mistral 3 / 4, Gemma 4, Nemotron-H")
"""The families of `MODEL_TYPES` in words (the CLI's help)."""

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def qkv_from_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF c_attn (h, 3h) [q|k|v] columns -> shardlm (3h, h) rows ordered (heads, 3, head_dim).
    Also works on the bias (3h,)."""
    if weight.ndim == 1:
        return weight.view(3, heads, -1).transpose(0, 1).reshape(-1).contiguous()
    hidden = weight.shape[0]
    return weight.t().reshape(3, heads, -1, hidden).transpose(0, 1).reshape(-1, hidden).contiguous()


def qkv_to_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `qkv_from_hf`."""
    if weight.ndim == 1:
        return weight.view(heads, 3, -1).transpose(0, 1).reshape(-1).contiguous()
    hidden = weight.shape[1]
    return weight.reshape(heads, 3, -1, hidden).transpose(0, 1).reshape(-1, hidden).t().contiguous()


def _layer_map(i: int) -> list[tuple[str, str, str]]:
    """(shardlm name, HF name, kind) for layer i; kind: copy, linear (transpose) or qkv."""
    s, h = f"layers.{i}", f"transformer.h.{i}"
    return [
        (f"{s}.ln_1.weight", f"{h}.ln_1.weight", "copy"), (f"{s}.ln_1.bias", f"{h}.ln_1.bias", "copy"),
        (f"{s}.attn.qkv.weight", f"{h}.attn.c_attn.weight", "qkv"),
        (f"{s}.attn.qkv.bias", f"{h}.attn.c_attn.bias", "qkv"),
        (f"{s}.attn.proj.weight", f"{h}.attn.c_proj.weight", "linear"),
        (f"{s}.attn.proj.bias", f"{h}.attn.c_proj.bias", "copy"),
        (f"{s}.ln_2.weight", f"{h}.ln_2.weight", "copy"), (f"{s}.ln_2.bias", f"{h}.ln_2.bias", "copy"),
        (f"{s}.mlp.fc.weight", f"{h}.mlp.c_fc.weight", "linear"), (f"{s}.mlp.fc.bias", f"{h}.mlp.c_fc.bias", "copy"),
        (f"{s}.mlp.proj.weight", f"{h}.mlp.c_proj.weight", "linear"),
        (f"{s}.mlp.proj.bias", f"{h}.mlp.c_proj.bias", "copy"),
    ]


def name_map(num_layers: int) -> list[tuple[str, str, str]]:
    top = [("wte.weight", "transformer.wte.weight", "copy"), ("wpe", "transformer.wpe.weight", "copy"),
           ("ln_f.weight", "transformer.ln_f.weight", "copy"), ("ln_f.bias", "transformer.ln_f.bias", "copy")]
    return top + [m for i in range(num_layers) for m in _layer_map(i)]


def model_config_from_hf(hf: dict) -> ModelConfig:
    """shardlm's GPT of a GPT2Config dict; UserError (one line) for what shardlm's GPT does not compute: another
    activation, an output layer of its own, attention without the 1 / sqrt(d) scale or scaled by the layer index."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise UserError(f"HF activation_function={activation!r} is not supported; use gelu or gelu_new")
    for bad, what in ((hf.get("tie_word_embeddings", True) is False, "tie_word_embeddings = false (an output layer "
                       "of its own; shardlm's GPT ties it to the embedding)"),
                      (hf.get("scale_attn_weights", True) is False, "scale_attn_weights = false"),
                      (bool(hf.get("scale_attn_by_inverse_layer_idx")), "scale_attn_by_inverse_layer_idx = true")):
        if bad:
            raise UserError(f"the HF GPT-2 has {what}, which shardlm's GPT does not compute")
    return ModelConfig(arch="gpt", num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_heads=hf["n_head"],
                       seq_length=hf["n_positions"], vocab_size=hf["vocab_size"],
                       ffn_hidden_size=hf.get("n_inner") or 0,
                       dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                       layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=ACTIVATIONS[activation])


def hf_config_from_model(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_length, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
        "n_inner": cfg.ffn_hidden_size or None,
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": cfg.layernorm_epsilon, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attention_dropout_p, "initializer_range": cfg.init_std, "tie_word_embeddings": True,
        "scale_attn_weights": True, "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1,
    }


def open_hf(hf_dir: str | Path) -> tuple[RunConfig, dict[str, HFTensor]]:
    """(config, {shardlm name: its `HFTensor`, fp32 in shardlm's layout}) of a local HF GPT-2 or Llama-family
    directory; nothing is read until a tensor is asked for. A reward model (`XForSequenceClassification`, one
    label) is its language model plus `score.weight` (`hf_reward`). UserError (one line) for a missing directory,
    config.json or weights, and for an architecture that does not convert."""
    config, sources = _open_language_model(Path(hf_dir))
    score = hf_reward.score_source(Path(hf_dir), json.loads((Path(hf_dir) / "config.json").read_text()))
    return config, sources | ({hf_reward.SCORE: score} if score is not None else {})


def _open_language_model(hf_dir: Path) -> tuple[RunConfig, dict[str, HFTensor]]:
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir} does not exist or is not a directory")
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise UserError(f"{hf_dir} has no config.json (not a Hugging Face model directory)")
    hf_config = json.loads(config_file.read_text())
    kind = hf_config.get("model_type")
    if kind is None and {"model", "train", "checkpoint"} <= hf_config.keys():  # what `shardlm train` writes
        raise UserError(f"{hf_dir} is a shardlm run directory, not a Hugging Face model; name its checkpoints "
                        f"folder ({hf_dir / 'checkpoints'}) or a consolidated file")
    for kinds, converter in CONVERTERS:
        if kind in kinds:  # Gemma 4's multimodal directory's language model too
            return converter.open_hf(hf_dir)
    if kind != "gpt2":
        raise UserError(f"{hf_dir} holds a {kind!r} model; only gpt2 and {', '.join(MODEL_TYPES[1:])} convert")
    weights = hf_dir / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{hf_dir} must hold config.json and model.safetensors (save_pretrained with "
                        "safe_serialization=True)")
    config = RunConfig(model=model_config_from_hf(hf_config))
    if (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        config.data.vocab_file, config.data.merges_file = str(hf_dir / "vocab.json"), str(hf_dir / "merges.txt")
    handles: dict = {}
    with safe_open(str(weights), framework="pt") as f:
        available = set(f.keys())
    heads = config.model.num_heads
    convert = {"copy": None, "linear": lambda v: v.t(), "qkv": lambda v: qkv_from_hf(v, heads)}
    sources = {}
    for ours, theirs, kind in name_map(config.model.num_layers):
        if theirs not in available and theirs.startswith("transformer.") and theirs[12:] in available:
            theirs = theirs[12:]  # GPT2Model checkpoints have no "transformer." prefix
        if theirs not in available:
            raise UserError(f"{weights} has no tensor {theirs}")
        sources[ours] = HFTensor(handles, weights, theirs, convert[kind])
    return config, sources


def from_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Convert a local HF GPT-2 (or Llama-family, or DeepSeek-V3) directory into a consolidated shardlm
    checkpoint file."""
    config, sources = open_hf(hf_dir)
    tensors = {f"model/{ours}": read() for ours, read in sources.items()}
    return files.write_consolidated(Path(out), tensors, dataclasses.asdict(config))


def _family(cfg: ModelConfig):
    """The module that writes `cfg` as a Hugging Face directory (its `hf_config_from_model` and `to_hf`, and
    `check_exportable` where it has one); None for GPT-2 (this module)."""
    if cfg.arch != "llama":
        return None
    if cfg.linear_attention_rule == "kimi_delta":
        return hf_kimi_linear
    if cfg.sandwich_norms:  # Gemma 4
        return hf_gemma4
    if cfg.hc_mult:  # DeepSeek-V4
        return hf_deepseek_v4
    if cfg.attention == "mla":
        return hf_deepseek
    if cfg.layer_pattern:
        return hf_nemotron_h
    if cfg.attention_output_gate or cfg.layer_types and any(cfg.is_linear_layer(i) for i in range(cfg.num_layers)):
        return hf_qwen3_next
    return hf_llama


def check_convertible(cfg: ModelConfig) -> dict:
    """The HF config.json that `to_hf` writes for `cfg`; UserError (one line) for a model its HF class does not
    compute (a piece it would load the weights without: `hf_common.check_pieces`). Reads no weights."""
    family = _family(cfg)
    if family is None:
        if cfg.arch != "gpt" or cfg.moe_num_experts:
            what = "experts" if cfg.arch == "gpt" else f'model.arch="{cfg.arch}"'
            raise UserError(f"GPT2LMHeadModel has no {what}; this model does not convert to Hugging Face (GPT, the "
                            "Llama family and the other listed families do)")
        return hf_config_from_model(cfg)
    if hasattr(family, "check_exportable"):
        family.check_exportable(cfg)
    return family.hf_config_from_model(cfg)


def to_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a shardlm checkpoint (directory or consolidated file) as a HF directory: GPT2LMHeadModel for GPT, the
    family's class for a llama checkpoint (`_family`). The model is checked (`check_convertible`) before any weight is
    read or anything written."""
    from shardlm.checkpoint.state import consolidate, consolidated_config, load_consolidated

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if checkpoint.is_dir():  # consolidated beside the output first, removed whether or not the conversion succeeds
        check_convertible(from_dict(files.read_meta(files.resolve(checkpoint))["config"]).model)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        single = out_dir.with_name(f".{out_dir.name}.consolidated.tmp.safetensors")
        try:
            return to_hf(consolidate(checkpoint, single), out_dir)
        finally:
            single.unlink(missing_ok=True)
    check_convertible(consolidated_config(checkpoint).model)
    config, tensors = load_consolidated(checkpoint)
    score = tensors.pop(f"model/{hf_reward.SCORE}", None)
    if score is not None:  # a reward model: its language model without an output layer, then the head
        config.model.tie_embeddings = True  # (its untied output layer was dropped: the class has none)
        return hf_reward.write_reward_model(lambda directory: _write_language_model(config, tensors, directory),
                                            score, out_dir)
    return _write_language_model(config, tensors, out_dir)


def _write_language_model(config: RunConfig, tensors: dict, out_dir: Path) -> Path:
    family = _family(config.model)
    if family is not None:
        return family.to_hf(config, tensors, out_dir)
    cfg = config.model
    hf = {}
    for ours, theirs, kind in name_map(cfg.num_layers):
        value = tensors[f"model/{ours}"]
        if ours == "wte.weight":
            value = value[: cfg.vocab_size]
        if kind == "linear":
            value = value.t()
        elif kind == "qkv":
            value = qkv_to_hf(value, cfg.num_heads)
        hf[theirs] = value.contiguous()
    return write_directory(out_dir, hf, hf_config_from_model(cfg), config.data)
