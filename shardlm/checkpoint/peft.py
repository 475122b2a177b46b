"""peft's adapter directories both ways, and adapters merged into the base.

- `write_peft(checkpoint, out)`: a LoRA run's checkpoint (any layout) -> `adapter_model.safetensors` and
  `adapter_config.json`, which `peft.PeftModel.from_pretrained(base, out)` loads onto the Hugging Face base.
- `read_peft(folder, cfg)`: such a directory -> {shardlm name: tensor} of the adapters (and modules_to_save),
  whole (TP=1), which `checkpoint.init_adapter` loads into a run at its layout.
- `write_merged(checkpoint, out)`: the base with every adapter folded in, W + scale B A, as a plain Hugging
  Face directory (`shardlm convert --to-peft OUT --merge`, or `--to-hf` of a LoRA checkpoint).
- MoE experts' adapters, on transformers' fused expert tensors: `shardlm.checkpoint.peft_experts`.

Names: peft calls the adapter of HF module M `base_model.model.M.lora_A.weight` (r, in) and `...lora_B.weight`
(out, r), a module trained in full `base_model.model.M.weight`. shardlm's adapters are `X.lora.A` and `X.lora.B`
beside projection X, whose HF name the converters give (`shardlm.checkpoint.hf_llama.name_map`, GPT-2's
`shardlm.checkpoint.hf.name_map`). Llama-family tensors map as they are; GPT-2's fused c_attn has its q|k|v
rows where shardlm keeps (heads, 3, head_dim), so the B of `attn.qkv` is reordered as the weight is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardlm.checkpoint.peft_experts import (
    PREFIX,
    expert_keys,
    expert_layers_of,
    expert_layout,
    expert_parameters,
    experts_from_peft,
    experts_to_peft,
)
from shardlm.config import LoraConfig, RunConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
WHOLE = {"wte", "lm_head", "ln_f", "score"}  # modules_to_save's modules, and a reward model's head (SEQ_CLS)
SEQ_CLS_HEAD = "score"  # a reward model's head: shardlm's module and transformers' (not in the causal LM's names)


def module_names(cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """{shardlm module: (HF module, conversion)} of every projection an adapter can go on and of the modules
    `modules_to_save` trains; conversion "qkv" for GPT-2's fused c_attn, "copy" otherwise."""
    if cfg.hc_mult:  # DeepSeek-V4: transformers' in-memory names; not its grouped o_a_proj (`_why_not_peft`), nor the
        from shardlm.checkpoint import hf_deepseek_v4  # final norm, which is part of its hyper-head

        pairs = [(ours, hf_deepseek_v4.in_memory(theirs), "copy") for ours, theirs in hf_deepseek_v4.name_map(cfg)
                 if not ours.endswith(".attn.o_a.weight") and not ours.startswith("ln_f.")]
    elif cfg.arch == "gpt":
        from shardlm.checkpoint.hf import name_map

        pairs = [(ours, theirs, "qkv" if kind == "qkv" else "copy") for ours, theirs, kind in name_map(cfg.num_layers)]
    elif cfg.arch == "llama" and cfg.layer_pattern:  # Nemotron-H: a Mamba-2 layer's in_proj is one fused matrix
        from shardlm.checkpoint import hf_nemotron_h  # (and peft refuses adapters on its out_proj)

        pairs = [(ours, theirs, "copy") for ours, theirs, rows in hf_nemotron_h.name_map(cfg)
                 if rows is None and not theirs.endswith(".mixer.out_proj.weight")]
    elif cfg.arch == "llama" and cfg.sandwich_norms:  # Gemma 4: the text model's names under `model.`
        from shardlm.checkpoint import hf_gemma4

        pairs = [(ours, theirs if ours == "lm_head.weight" else f"model.{theirs}", "copy")
                 for ours, theirs in hf_gemma4.name_map(cfg)]
    elif cfg.arch == "llama" and cfg.linear_attention_rule == "kimi_delta":  # transformers' in-memory module names
        from shardlm.checkpoint import hf_kimi_linear  # (its MLA rotates nothing: no rows to reorder)

        pairs = [(ours, hf_kimi_linear.in_memory(theirs), "copy") for ours, theirs in hf_kimi_linear.name_map(cfg)]
    elif cfg.arch == "llama" and cfg.attention == "mla":  # DeepSeek: the rotary rows of q (q_b) and kv_a interleave
        from shardlm.checkpoint.hf_deepseek import name_map

        pairs = [(ours, theirs, "rope" if ours.split(".")[-2] in ("q", "q_b", "kv_a") and ".attn." in ours else "copy")
                 for ours, theirs in name_map(cfg)]
    elif cfg.arch == "llama" and any(cfg.is_linear_layer(i) for i in range(cfg.num_layers)):
        from shardlm.checkpoint import hf_qwen3_next  # rows of a fused HF matrix (in_proj_qkv) have no peft module

        pairs = [(ours, theirs, "copy") for ours, theirs, rows in hf_qwen3_next.name_map(cfg) if rows is None]
    elif cfg.arch == "llama":
        from shardlm.checkpoint.hf_llama import name_map

        pairs = [(ours, theirs, "copy") for ours, theirs in name_map(cfg)]
    else:
        raise UserError(f"peft adapters convert for GPT and Llama-family models; this checkpoint's model is {cfg.arch}")
    return {ours.rsplit(".", 1)[0]: (theirs.rsplit(".", 1)[0], kind)
            for ours, theirs, kind in pairs if ours.endswith(".weight")}


def _to_hf(value: torch.Tensor, kind: str, cfg: ModelConfig, module: str) -> torch.Tensor:
    """A B factor (the projection's output rows) in HF's row order: GPT-2's q|k|v, DeepSeek's interleaved rotary
    rows (`rope_interleave`, as shardlm's DeepSeek export writes it)."""
    from shardlm.checkpoint.hf import qkv_to_hf
    from shardlm.checkpoint.hf_deepseek import tensor_to_hf

    if kind == "qkv":
        return qkv_to_hf(value, cfg.num_heads).t().contiguous()
    return tensor_to_hf(cfg, f"{module}.weight", value).contiguous() if kind == "rope" else value.contiguous()


def _from_hf(value: torch.Tensor, kind: str, cfg: ModelConfig, module: str) -> torch.Tensor:
    from shardlm.checkpoint.hf import qkv_from_hf
    from shardlm.checkpoint.hf_deepseek import tensor_from_hf

    if kind == "qkv":
        return qkv_from_hf(value.t(), cfg.num_heads)
    return tensor_from_hf(cfg, f"{module}.weight", value, True) if kind == "rope" else value.contiguous()


def stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert adapters stored one tensor per expert (`X.e`, as checkpoints hold them) stacked back into (E, ...)."""
    import re

    out, experts = {}, {}
    for name, value in tensors.items():
        found = re.fullmatch(r"(.*\.experts\.lora\.\w+)\.(\d+)", name)
        if found:
            experts.setdefault(found[1], {})[int(found[2])] = value
        else:
            out[name] = value
    return out | {name: torch.stack([per[e] for e in sorted(per)]) for name, per in experts.items()}


def peft_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """shardlm's whole adapter (and modules_to_save) tensors {name: tensor} -> peft's names and layout."""
    modules, out = module_names(cfg), {}
    tensors = stacked(tensors)
    layers = sorted({int(n.split(".")[1]) for n in tensors if ".experts.lora." in n})
    layout = expert_layout(cfg) if layers else None
    for layer in layers:
        prefix = f"layers.{layer}.{layout.module}.lora."
        out |= experts_to_peft(layer, {n.removeprefix(prefix): v for n, v in tensors.items() if n.startswith(prefix)},
                               layout)
    for name, value in tensors.items():
        if ".experts.lora." in name:
            continue
        module, _, leaf = name.rpartition(".lora.")
        if module:  # an adapter factor: A is (r, in) as is; B has the projection's output rows
            if module not in modules:
                raise UserError(f"the adapter on {module} has no peft equivalent: {_why_not_peft(module, cfg)}; "
                                "train without it (lora.targets) to export to peft")
            hf, kind = modules[module]
            out[f"{PREFIX}{hf}.lora_{leaf}.weight"] = (_to_hf(value, kind, cfg, module) if leaf == "B"
                                                       else value.contiguous())
            continue
        module, _, leaf = name.rpartition(".")
        hf, _ = (SEQ_CLS_HEAD, None) if module == SEQ_CLS_HEAD else modules.get(module, (None, None))
        if hf is None or module not in WHOLE:
            raise UserError(f"tensor {name} of the checkpoint has no peft name")
        out[f"{PREFIX}{hf}.{leaf}"] = (value[:cfg.vocab_size] if module in ("wte", "lm_head") else value).contiguous()
        if module == "wte" and tied(cfg):  # peft's tied copy (`ensure_weight_tying`) is saved as well
            out[f"{PREFIX}lm_head.weight"] = out[f"{PREFIX}{hf}.{leaf}"].clone()
    return out


def _why_not_peft(module: str, cfg: ModelConfig) -> str:
    """Why an adapted projection of shardlm's has no module in peft's model."""
    if cfg.layer_pattern and module.endswith(".mixer.o"):  # Nemotron-H: a Mamba-2 layer's (lora.targets' "out")
        return "peft refuses adapters on a Mamba-2 layer's out_proj (lora.targets' \"out_proj\", in \"all-linear\")"
    if cfg.hc_mult and module.endswith(".attn.o_a"):
        return ("transformers' o_a_proj is a grouped linear, on which peft would put one dense update, not shardlm's "
                "adapter applied group by group (lora.targets' \"o_a\", in \"all-linear\"); --merge exports it")
    return "Hugging Face stores that projection inside a fused matrix (a linear-attention layer's in_proj_qkv)"


def tied(cfg: ModelConfig) -> bool:
    """Whether the output layer is the embedding (GPT always; Llama-family with `tie_embeddings`)."""
    return cfg.arch == "gpt" or cfg.tie_embeddings


def adapter_config(config: RunConfig, base: str) -> dict:
    """peft's adapter_config.json for the run's [lora] on `base` (the HF model path the adapters were trained on)."""
    from shardlm.lora.apply import target_names

    modules, wanted = module_names(config.model), target_names(config.lora)
    targets = sorted({_peft_target(hf, config.model) for ours, (hf, _) in modules.items()
                      if ours.startswith("layers.") and ours.rsplit(".", 1)[-1] in wanted})
    saved = sorted({modules[name][0] for name in _saved_modules(config.lora)})
    if config.reward.loss:  # a reward model: its head trained whole, as peft's SEQ_CLS task lists it
        saved = sorted(set(saved) | {"classifier", "score"})
    experts = "experts" in wanted and config.model.moe_num_experts > 0
    task = "SEQ_CLS" if config.reward.loss else "CAUSAL_LM"
    return {"peft_type": "LORA", "task_type": task, "base_model_name_or_path": base, "r": config.lora.rank,
            "target_parameters": (expert_parameters(config.lora.expert_layers, expert_layout(config.model))
                                  if experts else None),
            "lora_alpha": config.lora.alpha, "lora_dropout": config.lora.dropout, "use_rslora": config.lora.rslora,
            "target_modules": targets, "modules_to_save": saved or None, "bias": "none",
            "fan_in_fan_out": config.model.arch == "gpt", "init_lora_weights": True, "inference_mode": True,
            # a tied embedding trained in full stays tied to the output layer, as in shardlm
            "ensure_weight_tying": tied(config.model) and "embedding" in config.lora.modules_to_save}


def _peft_target(hf: str, cfg: ModelConfig) -> str:
    """peft's target_modules entry (a suffix of module paths) for HF module `hf`: its last name, or for DeepSeek-V4
    its last two (its compressors' gate_proj and indexers' q_b_proj, which take no adapters, end alike)."""
    return ".".join(hf.split(".")[-2:]) if cfg.hc_mult else hf.rsplit(".", 1)[-1]


def _saved_modules(lora: LoraConfig) -> list[str]:
    from shardlm.lora.apply import SAVED_MODULES

    return [module for name in lora.modules_to_save for module in SAVED_MODULES[name]]


def _lora_checkpoint(checkpoint: str | Path) -> tuple[Path, dict]:
    from shardlm.checkpoint import files
    from shardlm.checkpoint.sharded import model_files

    path = files.resolve(checkpoint)
    meta = files.read_meta(path)
    if not meta.get("lora"):
        raise UserError(f"{checkpoint} holds every weight of its run, not LoRA adapters; write it with --to-hf")
    files.verify(path, meta, [n for row in model_files(meta) for n in row])
    return path, meta


def write_peft(checkpoint: str | Path, out: str | Path) -> Path:
    """A LoRA checkpoint's adapters as a peft directory `out` (module docstring); returns `out`."""
    from shardlm.checkpoint import files
    from shardlm.checkpoint.state import reader_of
    from shardlm.config import from_dict

    path, meta = _lora_checkpoint(checkpoint)
    config, reader = from_dict(meta["config"]), reader_of(path, meta)
    tensors = {name: reader.read(f"model/{name}", info["split_dim"]) for name, info in meta["tensors"].items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files.write_atomically(out / ADAPTER_FILE, lambda tmp: save_file(peft_tensors(tensors, config.model), str(tmp),
                                                                      metadata={"format": "pt"}))
    files.write_json_atomic(out / CONFIG_FILE, adapter_config(config, meta["lora"]["base"]))
    return out


def read_peft(folder: str | Path, cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, {shardlm name: whole tensor}) of a peft adapter directory; UserError (one line) for
    a missing file, another kind of adapter, or a tensor this model has no place for."""
    folder = Path(folder)
    if not (folder / ADAPTER_FILE).is_file():
        raise UserError(f"checkpoint.init_adapter={folder} has no {ADAPTER_FILE}; point it at a peft adapter directory")
    settings = adapter_settings(folder)
    theirs = {}
    for ours, (hf, kind) in (module_names(cfg) | {SEQ_CLS_HEAD: (SEQ_CLS_HEAD, "copy")}).items():
        theirs[f"{PREFIX}{hf}.lora_A.weight"] = (f"{ours}.lora.A", None)
        theirs[f"{PREFIX}{hf}.lora_B.weight"] = (f"{ours}.lora.B", kind if kind != "copy" else None)
        if ours in WHOLE:
            theirs[f"{PREFIX}{hf}.weight"] = (f"{ours}.weight", None)
            theirs[f"{PREFIX}{hf}.bias"] = (f"{ours}.bias", None)
    tensors, expert_layers, layout = {}, {}, None
    if settings.get("target_parameters"):
        layout = expert_layout(cfg)
        named = expert_layers_of(list(settings["target_parameters"]), folder, (layout,))
        expert_layers = {key: layer for layer in named or range(cfg.num_layers) if cfg.is_moe_layer(layer)
                         for key in expert_keys(layer, layout).values()}
    with safe_open(str(folder / ADAPTER_FILE), framework="pt") as f:
        for key in f.keys():
            if key == f"{PREFIX}lm_head.weight" and tied(cfg):  # the tied embedding's copy: the embedding is read
                continue
            if key in expert_layers:
                tensors[key] = f.get_tensor(key).float()
                continue
            if key not in theirs:
                raise UserError(f"{folder / ADAPTER_FILE} holds {key}, which this model has no place for; "
                                "was the adapter trained on another model?")
            name, kind = theirs[key]
            value = f.get_tensor(key).float()
            tensors[name] = _from_hf(value, kind, cfg, name.rsplit(".lora.", 1)[0]) if kind else value
    missing = next((key for key in expert_layers if key not in tensors), None)
    if missing:
        raise UserError(f"{folder / ADAPTER_FILE} has no {missing}, which its target_parameters adapt")
    for layer in sorted(set(expert_layers.values())):
        tensors |= experts_from_peft(layer, {k: tensors.pop(k) for k in expert_keys(layer, layout).values()}, cfg,
                                     layout)
    return settings, tensors


def adapter_settings(folder: str | Path) -> dict:
    """A peft adapter directory's adapter_config.json; UserError (one line) where it is missing or describes
    adapters shardlm does not train: another peft type, DoRA, per-module ranks or alphas."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"checkpoint.init_adapter={folder} has no {CONFIG_FILE}; point it at a peft adapter directory")
    settings = json.loads(path.read_text())
    if settings.get("peft_type") != "LORA" or settings.get("use_dora"):
        raise UserError(f"checkpoint.init_adapter={folder} is a {settings.get('peft_type')}"
                        f"{' (DoRA)' if settings.get('use_dora') else ''} adapter; shardlm reads LoRA adapters")
    patterns = [key for key in ("rank_pattern", "alpha_pattern") if settings.get(key)]
    if patterns:
        raise UserError(f"checkpoint.init_adapter={folder} sets {' and '.join(patterns)} (per-module ranks or alphas); "
                        "shardlm trains one r and lora_alpha for every adapter")
    return settings


SAVED_NAMES = {"embed_tokens": "embedding", "wte": "embedding", "lm_head": "output", "norm": "norm", "ln_f": "norm"}
SEQ_CLS_HEADS = {"classifier", "score"}
"""What peft's SEQ_CLS task lists in modules_to_save: a reward model's head, which a reward run trains anyway."""
SCALARS = ("rank", "alpha", "dropout", "rslora")
"""[lora] keys that always take the adapter's value: its tensors' shapes and scale are those it was trained with."""


def _lora_of(settings: dict, folder) -> dict:
    """The [lora] keys an adapter_config.json gives (peft's defaults where it leaves one out)."""
    targets = settings.get("target_modules") or []
    experts = list(settings.get("target_parameters") or [])
    if isinstance(targets, list):  # suffixes of module paths ("self_attn.q_b_proj"): the projection's own name
        targets = sorted({target.rsplit(".", 1)[-1] for target in targets})
    targets = (targets if isinstance(targets, list) else [targets]) + (["experts"] if experts else [])
    return {"rank": settings.get("r", 8), "alpha": float(settings.get("lora_alpha", 8)),
            "dropout": float(settings.get("lora_dropout", 0.0)), "rslora": bool(settings.get("use_rslora", False)),
            "targets": targets, "expert_layers": expert_layers_of(experts, folder) if experts else [],
            "modules_to_save": sorted({SAVED_NAMES.get(m.rsplit(".", 1)[-1], m)
                                       for m in settings.get("modules_to_save") or []} - SEQ_CLS_HEADS)}


def _adapted(targets: list, cfg: ModelConfig) -> set[str]:
    """The projections `targets` (lora.targets) put adapters on in this model ("experts": its MoE experts)."""
    from shardlm.lora.apply import target_names
    from shardlm.plan.lora import projection_names

    return target_names(LoraConfig(targets=list(targets))) & projection_names(cfg)


def _same(key: str, ours, theirs, cfg: ModelConfig) -> bool:
    if key == "targets":  # "all-linear" or names: the same adapters on this model
        return _adapted(ours, cfg) == _adapted(theirs, cfg)
    return sorted(ours) == theirs if key in ("modules_to_save", "expert_layers") else ours == theirs


def resolve_adapter(config: RunConfig) -> str | None:
    """With `checkpoint.init_adapter`, [lora] as the adapter was trained, in place; returns one line for the run's
    log naming the keys taken from it (None when none changed). rank, alpha, dropout and rslora always take the
    adapter's values, over the config's; targets and modules_to_save left at their defaults take its own, and set
    to adapt other modules of this model are a one-line error naming the override that fits. Reads
    adapter_config.json only; called before validation on every rank, repeatable (a resolved config is unchanged)."""
    folder = config.checkpoint.init_adapter
    if not folder:
        return None
    cfg, defaults = config.model, LoraConfig()
    taken, given_way = [], []
    for key, value in _lora_of(adapter_settings(folder), folder).items():
        ours = getattr(config.lora, key)
        if _same(key, ours, value, cfg):
            continue
        set_here = ours != getattr(defaults, key)
        if key not in SCALARS and set_here:  # other adapters than the file's: nothing to load them from, or into
            fix = f"'lora.{key}={json.dumps(value, separators=(',', ':'))}'"
            have = f"adapters on {', '.join(sorted(_adapted(value, cfg)))}" if key == "targets" else repr(value)
            raise UserError(f"lora.{key}={ours!r} but checkpoint.init_adapter={folder} has {have}; pass {fix} to "
                            "start from it")
        taken.append(f"{key}={value!r}")
        given_way += [f"{key}={ours!r}"] if set_here else []
        setattr(config.lora, key, value)
    if not taken:
        return None
    over = f" (over the config's {', '.join(given_way)})" if given_way else ""
    return f"lora: {', '.join(taken)} taken from checkpoint.init_adapter={folder}{over}"


def load_adapter(trainer, folder: str | Path) -> str:
    """Load a peft adapter directory's adapters (and modules_to_save) into a LoRA trainer at its layout, after
    the base; returns a line for the run's log. A rank's expert stacks are read expert by expert, by global index
    (`read_peft` names them so)."""
    from shardlm.checkpoint.sharded import TensorReader
    from shardlm.checkpoint.state import _stored_names, load_weights

    settings, tensors = read_peft(folder, trainer.config.model)
    trained = {name: param for name, param in trainer.model.named_parameters() if param.requires_grad}
    missing = sorted(key for name, param in trained.items() for key in _stored_names(name, param)
                     if key not in tensors)
    local_missing = trainer.ctx.world.all_gather_object(missing)
    if any(local_missing):
        raise UserError(f"checkpoint.init_adapter={folder} has no tensor for {next(m for m in local_missing if m)[0]}; "
                        "was it trained with other target modules?")
    load_weights(trainer.model, TensorReader({f"model/{k}": v for k, v in tensors.items()}), trainer.ctx,
                 trainer.optimizer, names=set(trained))
    targets = ", ".join(_lora_of(settings, folder)["targets"])
    return f"adapters from peft directory {folder} (r={settings.get('r')}, targets {targets})"


def write_merged(checkpoint: str | Path, out: str | Path) -> Path:
    """A LoRA checkpoint with its adapters folded into the base, as a plain Hugging Face directory `out`."""
    from shardlm.checkpoint import files
    from shardlm.checkpoint.hf import check_convertible, to_hf
    from shardlm.checkpoint.init import load_model
    from shardlm.checkpoint.state import _stored
    from shardlm.config import from_dict
    from shardlm.lora.merge import merge_adapters
    from shardlm.parallel import ParallelContext

    path, meta = _lora_checkpoint(checkpoint)
    check_convertible(from_dict(meta["config"]).model)  # before the base is loaded
    model, config = load_model(path, ParallelContext.single())
    merge_adapters(model)  # QLoRA's NF4 base dequantized, expert adapters folded into their experts
    config.lora.rank = 0
    vocab = config.model.vocab_size
    tensors = {}
    for name, p in model.named_parameters():  # expert stacks one tensor per expert, as checkpoints store them
        value = (p[:vocab] if name in ("wte.weight", "lm_head.weight") else p).detach().contiguous()
        tensors |= {f"model/{key}": v for key, v in _stored(name, p, value).items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)  # beside the output, so a refused conversion leaves nothing
    merged = files.write_consolidated(out.with_name(f".{out.name}.merged.tmp.safetensors"), tensors, config.to_dict(),
                                      meta["step"])
    try:
        return to_hf(merged, out)
    finally:
        merged.unlink(missing_ok=True)
