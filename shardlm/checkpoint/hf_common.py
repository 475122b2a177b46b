"""What every Hugging Face converter of shardlm shares: the tensors of an HF directory read on demand
(`HFTensor`), which file holds each (`weight_files`), the rotary and YaRN settings both ways, dropping the
multi-token-prediction layers a directory does not hold, and writing a directory (`write_directory`). The
converters themselves: `hf` (GPT-2, and the entry points that pick a family), `hf_llama` (Llama, Qwen3, Mixtral,
Qwen3-MoE, GLM-4.5, gpt-oss with `hf_gpt_oss`, OLMo 3 with `hf_olmo3`, MiniMax-M2 with `hf_minimax_m2`), `hf_deepseek`
(DeepSeek-V2/V3, Kimi K2)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardlm.checkpoint import files
from shardlm.config import DataConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")
"""What travels with a `tokenizer.json`: its settings, special tokens, chat template and generation defaults."""


class HFTensor:
    """One tensor of an HF directory in shardlm's layout, read on demand. `convert` (GPT-2's transposes and QKV
    reordering) needs the whole tensor; without it (Llama-family names map one to one) `shape()` reads only the
    header and `part(dim, start, end)` only the rows asked for. Calling it returns the whole fp32 tensor.
    `select`: read only entry `select` of the first dimension (one expert of a stacked expert tensor) before
    `convert`."""

    def __init__(self, handles: dict, path: Path, name: str, convert: Callable | None = None,
                 select: int | None = None):
        self.handles, self.path, self.name, self.convert, self.select = handles, path, name, convert, select

    def _file(self):
        if self.path not in self.handles:
            self.handles[self.path] = safe_open(str(self.path), framework="pt")
        return self.handles[self.path]

    def __call__(self) -> torch.Tensor:
        if self.select is None:
            value = self._file().get_tensor(self.name).float()
        else:
            value = self._file().get_slice(self.name)[self.select].float()
        return (value if self.convert is None else self.convert(value)).contiguous()

    def shape(self) -> list[int] | None:
        """The shape, or None when it is known only after converting the whole tensor."""
        if self.convert is not None or self.select is not None:
            return None
        return list(self._file().get_slice(self.name).get_shape())

    def part(self, dim: int, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) along `dim`, fp32 (only those are read when there is no conversion)."""
        if self.convert is not None or self.select is not None:
            return self().narrow(dim, start, end - start).contiguous()
        index = [slice(None)] * len(self.shape())
        index[dim] = slice(start, end)
        return self._file().get_slice(self.name)[tuple(index)].float().contiguous()


MIXTRAL_EXPERTS = (("gate", "w1"), ("up", "w3"), ("down", "w2"))
"""Mixtral's names of an expert's SwiGLU weights (shardlm's, HF's); MiniMax-M2 stores its experts so too."""


def rope_theta_and_type(hf: dict) -> tuple[float, str]:
    """(theta, rope type) from either config style (transformers 5's rope_parameters, or rope_theta + rope_scaling)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), kind


def rope_parameters(hf: dict) -> dict:
    """A HF config's rotary settings in either style (transformers 5's rope_parameters, or rope_theta +
    rope_scaling), merged into one dict."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def yarn_keys(params: dict, max_positions: int) -> dict:
    """The `model.rope_yarn_*` keys of a yarn `rope_parameters` dict (factor: max_positions over the original
    length when it is not given); UserError when the original length is missing."""
    original = params.get("original_max_position_embeddings")
    if not original:
        raise UserError(f"the HF model's yarn rotary ({params}) has no original_max_position_embeddings; set it to "
                        "the pretraining context length")
    return {"rope_yarn_factor": float(params.get("factor") or max_positions / original),
            "rope_yarn_original_positions": int(original),
            "rope_yarn_beta_fast": float(params.get("beta_fast") or 32),
            "rope_yarn_beta_slow": float(params.get("beta_slow") or 1),
            "rope_yarn_truncate": bool(params.get("truncate", True)),
            "rope_yarn_mscale": float(params.get("mscale") or 0.0),
            "rope_yarn_mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
            "rope_yarn_attention_factor": float(params.get("attention_factor") or 0.0)}


PIECES = {
    "norm_placement": ("pre", "post-norms"),
    "norm_zero_centered": (False, "zero-centred norms"),
    "qk_norm_scope": ("head", "QK-norm over whole projections"),
    "mla_nope": (False, "MLA without RoPE"),
    "attention_sinks": (False, "attention sinks"),
    "attention_output_gate": (False, "attention output gate"),
    "query_scale_beta": (0.0, "Llama 4's query scaling"),
    "rope_yarn_factor": (0.0, "YaRN rotary embeddings"),
    "rope_llama3_factor": (0.0, "Llama 3.1's rope scaling"),
    "rope_fraction": (1.0, "partial rotary embeddings"),
    "sliding_window": (0, "sliding windows"),
    "swiglu_clip": (0.0, "DeepSeek-V4's clipped SwiGLU"),
    "swiglu_limit": (0.0, "gpt-oss's clamped SwiGLU experts"),
    "moe_shared_expert_gate": (False, "gate on the shared expert"),
    "moe_layer_interval": (1, "MoE layers at an interval"),
    "moe_routed_scaling": (1.0, "scale on the routed experts' weights"),
}
"""Pieces of shardlm's models that most Hugging Face classes do not compute: model key -> (the value that leaves the
piece out, what it is). A class that loads weights without computing a piece computes another model, so an exporter
refuses every piece away from its neutral value that its class does not have (`check_pieces`). The `moe_*` pieces and
swiglu_limit (an expert's) matter only with experts."""


def check_pieces(cfg: ModelConfig, class_name: str, has: tuple[str, ...] = ()) -> None:
    """UserError (one line) for the first of `PIECES` that `cfg` sets and `class_name` does not compute (`has`: the
    pieces it does)."""
    for key, (neutral, what) in PIECES.items():
        value = getattr(cfg, key)
        relevant = cfg.moe_num_experts > 0 or not (key.startswith("moe_") or key == "swiglu_limit")
        if key == "qk_norm_scope":
            relevant = cfg.qk_norm
        if key == "rope_fraction":  # MLA rotates its own qk_rope_head_dim channels
            relevant = cfg.attention == "mha"
        if key == "sliding_window":  # a window that no layer uses changes nothing
            relevant = any(cfg.is_sliding_layer(i) for i in range(cfg.num_layers))
        if key not in has and relevant and value != neutral:
            raise UserError(f"{class_name} has no {what} (model.{key} = {value!r}); this model does not convert to it")


def check_shared_width(cfg: ModelConfig, class_name: str) -> None:
    """UserError (one line) when the shared experts' MLP is not `moe_shared_experts` experts wide, the only width an
    HF config of DeepSeek's shape states (n_shared_experts x moe_intermediate_size)."""
    if cfg.moe_num_experts and cfg.shared_ffn_size != cfg.moe_shared_experts * cfg.moe_ffn_size:
        raise UserError(f"{class_name} has no shared-expert width of its own (model.moe_shared_ffn_hidden_size = "
                        f"{cfg.moe_shared_ffn_hidden_size}, not moe_shared_experts x the expert width); this model "
                        "does not convert to it")


def llama3_keys(params: dict) -> dict:
    """The `model.rope_llama3_*` keys of a "llama3" `rope_parameters` dict (Llama 3.1's scaling); UserError when one is
    missing."""
    names = {"factor": "rope_llama3_factor", "low_freq_factor": "rope_llama3_low_freq_factor",
             "high_freq_factor": "rope_llama3_high_freq_factor",
             "original_max_position_embeddings": "rope_llama3_original_positions"}
    missing = [name for name in names if params.get(name) is None]
    if missing:
        raise UserError(f"the HF model's llama3 rotary ({params}) has no {', '.join(missing)}; set them as Llama 3.1's "
                        "config.json does")
    return {ours: (int if ours.endswith("positions") else float)(params[theirs]) for theirs, ours in names.items()}


def rope_parameters_of(cfg: ModelConfig) -> dict:
    """The HF `rope_parameters` of a model config: default, yarn with every `rope_yarn_*` key (attention_factor
    when one is set), or llama3 with the `rope_llama3_*` keys."""
    if cfg.rope_llama3_factor:
        return {"rope_theta": cfg.rope_theta, "rope_type": "llama3", "factor": cfg.rope_llama3_factor,
                "low_freq_factor": cfg.rope_llama3_low_freq_factor,
                "high_freq_factor": cfg.rope_llama3_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_llama3_original_positions}
    if not cfg.rope_yarn_factor:
        return {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    return {"rope_theta": cfg.rope_theta, "rope_type": "yarn", "factor": cfg.rope_yarn_factor,
            "original_max_position_embeddings": cfg.rope_yarn_original_positions,
            "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow,
            "truncate": cfg.rope_yarn_truncate, "mscale": cfg.rope_yarn_mscale,
            "mscale_all_dim": cfg.rope_yarn_mscale_all_dim,
            **({"attention_factor": cfg.rope_yarn_attention_factor} if cfg.rope_yarn_attention_factor else {})}


def rows_reader(rows, conv: bool):
    """The conversion of an HF tensor to shardlm's (Qwen3-Next's and Nemotron-H's fused projections): the rows asked
    for (a tensor of indices, or None for all), conv1d's (C, 1, K) as (C, K); None when there is nothing to do."""
    def convert(value: torch.Tensor) -> torch.Tensor:
        value = value[:, 0] if conv else value
        return value if rows is None else value.index_select(0, rows)
    return convert if conv or rows is not None else None


def use_tokenizer(config, hf_dir: Path) -> None:
    """Point a run read from an HF directory at the directory's tokenizer.json, when it has one."""
    if (hf_dir / "tokenizer.json").is_file():
        config.data.tokenizer, config.data.vocab_file = "json", str(hf_dir / "tokenizer.json")


def drop_missing_mtp(model: ModelConfig, located: dict, hf_dir: Path, marker: str | None = None) -> None:
    """Set `model.mtp_layers` to 0, with a note, when the config asks for multi-token-prediction layers that the
    directory's weights (`located`) do not hold: transformers saves the main model only. `marker`: the first depth's
    tensor that tells (default DeepSeek-V3's, layer num_hidden_layers' eh_proj)."""
    marker = marker or f"model.layers.{model.num_layers}.eh_proj.weight"
    if model.mtp_layers and marker not in located:
        print(f"note: num_nextn_predict_layers={model.mtp_layers} but {hf_dir} has no multi-token "
              "prediction weights; converted without them (model.mtp_layers = 0)", file=sys.stderr)
        model.mtp_layers = 0


def weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (model.safetensors or the files its index names); a
    directory with neither is refused."""
    if not (hf_dir / "model.safetensors").is_file() and not (hf_dir / INDEX).is_file():
        raise UserError(f"{hf_dir} must hold model.safetensors or {INDEX} (save_pretrained with safetensors)")
    if (hf_dir / INDEX).is_file():
        weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def write_directory(out_dir: Path, tensors: dict[str, torch.Tensor], hf_config: dict, data: DataConfig) -> Path:
    """Write an HF model directory: `tensors` as model.safetensors, `hf_config` as config.json, and the run's
    tokenizer (a `tokenizer.json` with the `TOKENIZER_FILES` beside it; GPT-2's encoder.json / vocab.bpe as
    vocab.json / merges.txt). Built in a temporary sibling and renamed into place, so a failed write leaves
    no half directory."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    files.ordinary_permissions(tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    if data.tokenizer == "json" and Path(data.vocab_file).is_file():
        shutil.copy(data.vocab_file, tmp / "tokenizer.json")
        for name in TOKENIZER_FILES:  # the chat template and special tokens beside it, when there are any
            if (Path(data.vocab_file).parent / name).is_file():
                shutil.copy(Path(data.vocab_file).parent / name, tmp / name)
    if data.tokenizer == "gpt2":  # encoder.json / vocab.bpe are HF's vocab.json / merges.txt
        from shardlm.paths import shared_data_dir

        vocab = Path(data.vocab_file or shared_data_dir() / "vocab" / "gpt2" / "encoder.json")
        merges = Path(data.merges_file or shared_data_dir() / "vocab" / "gpt2" / "vocab.bpe")
        if vocab.is_file() and merges.is_file():
            shutil.copy(vocab, tmp / "vocab.json")
            shutil.copy(merges, tmp / "merges.txt")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir


def text_config(hf: dict) -> dict:
    """The language model's config of a directory's config.json (a multimodal Qwen3.5 nests it as text_config)."""
    return {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings", hf["text_config"].get(
        "tie_word_embeddings", False))} if "text_config" in hf else hf


def stacked_expert(handles: dict, located: dict, cfg: ModelConfig, ours: str, theirs: str, hf_dir: Path) -> HFTensor:
    """An expert's matrix from the stacked `experts.gate_up_proj` (E, 2 f, h) / `experts.down_proj` (E, h, f)."""
    head, _, tail = theirs.partition(".experts.")
    expert, projection = tail.split(".")[:2] if tail else ("", "")
    if not tail or not expert.isdigit():
        raise UserError(f"{hf_dir} has no tensor {theirs}")
    width = cfg.moe_ffn_size
    stacked = f"{head}.experts.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"
    if stacked not in located:
        raise UserError(f"{hf_dir} has no tensor {theirs} (nor {stacked})")
    part = {"gate_proj": lambda v: v[:width], "up_proj": lambda v: v[width:]}.get(projection)
    return HFTensor(handles, located[stacked], stacked, part, select=int(expert))
