"""Save and load a Trainer's whole state, at any TP x DP layout.

What a checkpoint holds: model shards and AdamW moments (fp32, safetensors; never pickle), the weight copies a run
keeps beside its weights (the reference TR-DPO's syncs move, BEMA's average: `kept_copies`), the loss scaler, step,
skipped steps and consumed samples (the data position), every rank's generator states (`rng.py`), the config and a
manifest of files with sizes and sha256. Loading at another layout reshards the tensors (see `sharded.py`);
generator states are restored only on the same layout, where they make the resumed run bitwise identical.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardlm.checkpoint import files
from shardlm.checkpoint.compatibility import check_base, check_compatible, shared_fingerprint
from shardlm.checkpoint.rng import restore_rng, rng_file, rng_tensors
from shardlm.checkpoint.sharded import ShardedReader, expert_key, model_file, model_files
from shardlm.config import RunConfig, from_dict
from shardlm.errors import CheckpointWriteError, UserError
from shardlm.lora.nf4 import quantized, stored_name
from shardlm.parallel import ParallelContext

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""The optimizer state a checkpoint keeps beside each parameter: AdamW's two moments, Muon's momentum."""


def split_dim(param: torch.Tensor) -> int | None:
    return getattr(param, "tensor_parallel_dim", None)


def is_expert(param: torch.Tensor) -> bool:
    """A stack of MoE experts (E / ep, ...), stored as one tensor per expert under its global index."""
    return getattr(param, "expert_parallel", False)


def _stored_names(name: str, param: torch.Tensor) -> list[str]:
    """The checkpoint names of a parameter: its own, or one per expert of a stack under its global index.
    Read from the shape alone: under FSDP an expert stack is a DTensor sharded over its expert rows, which
    cannot be iterated without gathering it."""
    if not is_expert(param):
        return [name]
    return [expert_key(name, param.first_expert + i) for i in range(param.shape[0])]


def _stored(name: str, param: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor} of a parameter's value (a plain tensor): itself, or one tensor per expert."""
    if not is_expert(param):
        return {name: value}
    return {key: v.contiguous() for key, v in zip(_stored_names(name, param), value, strict=True)}


def is_stage_copy(param: torch.Tensor) -> bool:
    """The last pipeline stage's copy of the word embedding (`pipeline_tied_copy`, GPT's tied output layer or
    the multi-token-prediction depths' input): bitwise the first stage's, so only the first stage saves it."""
    return getattr(param, "pipeline_tied_copy", False)


def is_saved(param: torch.Tensor, lora: bool) -> bool:
    """Whether a checkpoint holds a parameter: all but the last stage's tied copy; in a LoRA run (`lora`) only
    what trains (adapters, `modules_to_save`), never the frozen base (the checkpoint names it instead:
    `compatibility.py`)."""
    return not is_stage_copy(param) and (not lora or param.requires_grad)


def _tensor_table(model, dense: bool, lora: bool = False) -> dict[str, dict]:
    """{checkpoint name: shape and split dim} of the tensors this rank writes (experts one by one)."""
    table = {}
    for name, p in model.named_parameters():
        if not is_saved(p, lora):
            continue
        if is_expert(p):
            for key in _stored_names(name, p):
                dim = split_dim(p)  # None: whole on every TP rank (gpt-oss's expert down bias)
                table[key] = {"shape": list(p.shape[1:]), "split_dim": None if dim is None else dim - 1}
        elif dense:
            table[name] = {"shape": list(p.shape), "split_dim": split_dim(p)}
    return table


# ------------------------------------------------------------------------------------------- save

def _model_tensors(trainer, full: dict | None = None, dense: bool = True) -> dict[str, torch.Tensor]:
    """"model/NAME", "exp_avg/NAME", "exp_avg_sq/NAME" of this rank's TP shard. `full`: the master-weight
    optimizer's layout-free state (fp32 master weights, moments gathered over DP), used when given.
    `dense=False` (ranks that write only their experts): expert stacks only, one tensor per expert."""
    out = {}
    lora, states = bool(trainer.config.lora.rank), trainer.optimizer.state
    for name, param in trainer.model.named_parameters():
        if not (dense or is_expert(param)) or not is_saved(param, lora):
            continue
        state = states.get(param, {})
        if full is not None:  # parameters without gradient (expert biases) are not the optimizer's
            state = full.get(name, {"model": param})
        else:
            state = {"model": param, **{key: state[key] for key in MOMENTS if key in state}}
        for key, value in state.items():
            for stored, tensor in _stored(name, param, value.detach()).items():
                out[f"{key}/{stored}"] = tensor.cpu().contiguous()
    return out


def kept_copies(trainer) -> dict:
    """{checkpoint prefix: `ReferenceWeights`} of the weight copies a run keeps beside its weights: TR-DPO's synced
    reference ("reference", sync_ref_model) and BEMA's three ("bema", "bema_theta0", "bema_ema")."""
    copies = {}
    if getattr(trainer, "synced_reference", None) is not None:
        copies["reference"] = trainer.synced_reference
    if getattr(trainer, "bema", None) is not None:
        copies |= trainer.bema.copies()
    return copies


def reference_tensors(trainer, dense: bool = True) -> dict[str, torch.Tensor]:
    """"PREFIX/NAME" of each weight copy the run keeps (`kept_copies`), as `_model_tensors` names the model's: this
    rank's TP shard, FSDP's shards gathered over DP (collective: every rank calls it). Empty without any."""
    out = {}
    for prefix, copy in kept_copies(trainer).items():
        saved = {id(p): r for p, r in zip(copy.params, copy.saved)}
        for name, param in trainer.model.named_parameters():
            value = saved.get(id(param))
            if value is None or not is_saved(param, lora=False):
                continue
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            if dense or is_expert(param):
                for stored, tensor in _stored(name, param, value.detach()).items():
                    out[f"{prefix}/{stored}"] = tensor.cpu().contiguous()
    return out


def _optimizer_step(trainer) -> int:
    for state in trainer.optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _write_failure(path: Path, exc: Exception) -> str:
    """"PATH: OS error" of a failed write; safetensors reports the OS error inside its own message."""
    found = re.search(r"(?:I/O error: )?([^:]+) \(os error (\d+)\)", str(exc))
    if found:
        reason = f"[Errno {found[2]}] {found[1]}"
    else:
        reason = f"[Errno {exc.errno}] {exc.strerror}" if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{path}: {reason}"


def _agree_on_failures(ctx: ParallelContext, failure: str | None, tmp: Path, step: int, directory: Path) -> None:
    """Collective: when any rank failed to write, remove the unfinished folder and raise the first failure on
    every rank, naming the last checkpoint that is intact."""
    failures = [f for f in ctx.world.all_gather_object(failure) if f]
    if not failures:
        return
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    ctx.world.barrier()
    latest = None
    try:
        latest = files.latest_in(directory)
    except (OSError, UserError):
        pass
    last = f"step {files.read_meta(latest)['step']} ({latest})" if latest else "none"
    raise CheckpointWriteError(f"could not save the checkpoint of step {step}: {failures[0]}; nothing was "
                               f"published; the last good checkpoint is {last}: free space or fix the folder, "
                               "then run again to resume from it")


def save_checkpoint(trainer, directory: str | Path, keep_last: int = 2) -> Path:
    """Write the trainer's state as `directory/step_XXXXXXXX` on every rank (collective). A write that fails on
    any rank (disk full, file too large, permission denied) removes the unfinished folder and raises
    `CheckpointWriteError` on every rank; `latest` still names the previous checkpoint."""
    from safetensors import SafetensorError

    ctx = trainer.ctx
    directory = Path(directory)
    final = directory / files.step_name(trainer.step)
    tmp = directory / f".tmp-{final.name}"
    failure = None
    if ctx.is_main:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            tmp.mkdir()
        except OSError as exc:
            failure = _write_failure(tmp, exc)
    _agree_on_failures(ctx, failure, tmp, trainer.step, directory)
    records = {}
    optimizer = trainer.optimizer
    full = optimizer.full_state() if hasattr(optimizer, "full_state") else None  # collective over DP
    # data x context rank 0 (CP ranks hold the same parameters), and under expert parallelism (EP carved out of
    # DP x CP) the other ranks of its EP group, their experts only; `expert_dp` is `dp_cp` without EP
    writes = ctx.expert_dp.rank == 0
    first = ctx.dp_cp.rank == 0
    reference = reference_tensors(trainer, dense=first)  # (collective under FSDP)
    path = tmp
    try:
        if writes:
            name = model_file(ctx.tp_rank, ctx.pp_rank if ctx.pp_size > 1 else None, ctx.ep_rank)
            path = tmp / name
            save_file(_model_tensors(trainer, full, dense=first) | reference, str(path))
            records[name] = files.file_record(path)
        tensors, metadata = rng_tensors(ctx)
        path = tmp / rng_file(ctx.rank)
        save_file(tensors, str(path), metadata=metadata)
        records[rng_file(ctx.rank)] = files.file_record(path)
    except (OSError, SafetensorError) as exc:
        failure = _write_failure(path, exc)
    _agree_on_failures(ctx, failure, tmp, trainer.step, directory)
    tensors_table = _tensor_table(trainer.model, dense=first, lora=bool(trainer.config.lora.rank))
    base = lora_base(trainer)  # collective
    gathered = ctx.world.all_gather_object((records, tensors_table if writes and ctx.tp_rank == 0 else {}))
    manifest = {k: v for part, _ in gathered for k, v in part.items()}
    tensors_table = {k: v for _, table in gathered for k, v in table.items()}
    if ctx.is_main:
        meta = {
            "format": "shardlm-checkpoint-v1", "step": trainer.step, "consumed_samples": trainer.consumed_samples,
            "skipped_steps": trainer.skipped_steps, "optimizer_step": _optimizer_step(trainer),
            "tensor_parallel": ctx.tp_size, "pipeline_parallel": ctx.pp_size, "data_parallel": ctx.dp_size,
            "expert_parallel": ctx.ep_size, "context_parallel": ctx.cp_size,
            "world_size": ctx.world_size,
            "padded_vocab_size": trainer.model.padded_vocab_size,
            "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
            **({"loss": trainer.loss.state_dict()} if hasattr(trainer.loss, "state_dict") else {}),
            "config": dataclasses.asdict(trainer.config), "tensors": tensors_table, "files": manifest,
            **({"lora": base} if base else {}),
        }
        try:
            path = tmp / files.META
            files.write_json_atomic(path, meta)
            path = final
            files.publish(tmp, final, keep_last)
        except OSError as exc:
            failure = _write_failure(path, exc)
    _agree_on_failures(ctx, failure, tmp, trainer.step, directory)
    return final


# ------------------------------------------------------------------------------------------- load

def reader_of(checkpoint: Path, meta: dict) -> ShardedReader:
    """A reader of every model shard of a checkpoint directory (all TP ranks and pipeline stages)."""
    return ShardedReader([[checkpoint / name for name in row] for row in model_files(meta)])


def lora_base(trainer) -> dict | None:
    """The LoRA run's base (`compatibility.fingerprint`, hashed once on the main rank and cached on the
    trainer); None without LoRA. Collective the first time."""
    if not trainer.config.lora.rank:
        return None
    if getattr(trainer, "lora_base", None) is None:
        trainer.lora_base = shared_fingerprint(trainer.config, trainer.ctx)
    return trainer.lora_base


def load_weights(model, reader: ShardedReader, ctx: ParallelContext, optimizer=None, optimizer_step: int = 0,
                 names: set[str] | None = None) -> None:
    """Copy this rank's slice of every parameter (of `names` only, when given) and its Adam moments from `reader`
    into place (through the master-weight optimizer's `load_full_state` when it has one)."""
    keys = reader.keys()
    full = {}
    nf4 = quantized(model)
    for name, param in model.named_parameters():
        if names is not None and name not in names:
            continue
        if name != stored_name(name):  # a QLoRA weight stored in NF4: read whole, quantized again on assignment
            if stored_name(name) is not None:
                _load_quantized(model, stored_name(name), nf4[stored_name(name)], reader)
            continue
        stored = _stored_names(name, param)
        if f"model/{stored[0]}" not in keys:
            raise UserError(f"checkpoint has no tensor for parameter {stored[0]}")
        dim = split_dim(param)
        start = 0 if dim is None else ctx.tp_rank * param.shape[dim]
        end = None if dim is None else start + param.shape[dim]
        if dim is None and not is_expert(param) and reader.shape(f"model/{name}") != list(param.shape):
            dim = 0  # split when saved, replicated now (Llama's KV heads at a TP above num_kv_heads): all rows
        wanted = ("model",) if optimizer is None or optimizer_step == 0 else ("model", *MOMENTS)
        if is_expert(param):  # this rank's experts, each read by its global index
            split = None if dim is None else dim - 1  # an expert's down bias is whole on every TP rank
            local = {prefix: torch.stack([reader.read(f"{prefix}/{key}", split, start, end) for key in stored])
                     .to(param.device) for prefix in wanted if f"{prefix}/{stored[0]}" in keys}
        else:
            local = {prefix: reader.read(f"{prefix}/{name}", dim, start, end).to(param.device)
                     for prefix in wanted if f"{prefix}/{name}" in keys}
        if list(local["model"].shape) != list(param.shape):
            raise UserError(f"checkpoint tensor {stored[0]} has shape {list(local['model'].shape)} where the model's "
                            f"parameter (this rank's slice) has {list(param.shape)}: another model shape")
        if hasattr(optimizer, "load_full_state") and param.requires_grad:
            full[name] = local
            continue
        with torch.no_grad():
            if hasattr(param, "to_local"):  # an FSDP shard outside the optimizer (a LoRA run's frozen base)
                from shardlm.training.fsdp import copy_to_shard

                copy_to_shard(param, local["model"])
            else:
                param.copy_(local["model"])
        if optimizer is not None and optimizer_step > 0 and "exp_avg" in local:
            # the fused kernel keeps `step` beside the parameter, the others on the CPU
            step_device = param.device if optimizer.defaults.get("fused") else "cpu"
            optimizer.state[param] = {"step": torch.tensor(float(optimizer_step), device=step_device),
                                      "exp_avg": local["exp_avg"], "exp_avg_sq": local["exp_avg_sq"]}
        elif optimizer is not None and optimizer_step > 0 and "momentum_buffer" in local:  # Muon's matrices
            optimizer.state[param] = {"momentum_buffer": local["momentum_buffer"]}
    if full:
        optimizer.load_full_state(full, optimizer_step)


@torch.no_grad()
def _load_quantized(model, name: str, weight, reader) -> None:
    """Weight `name`, stored in NF4 (`weight`: its parametrization), read whole from `reader` (each expert's
    matrix of a stack by its global index) and quantized whole; this rank keeps its blocks."""
    from shardlm.lora.nf4 import assign_whole

    keys = [name] if not weight.stacked else [expert_key(name, weight.marks["first_expert"] + i)
                                              for i in range(weight.shape[0])]
    whole = []
    for key in keys:
        if f"model/{key}" not in reader.keys():
            raise UserError(f"checkpoint has no tensor for parameter {key}")
        shape = weight.whole_shape[-2:]
        saved = reader.shape(f"model/{key}")
        dim = weight.marks.get("tensor_parallel_dim")
        dim = None if dim is None and saved == list(shape) else (0 if dim is None else dim - weight.stacked)
        whole.append(reader.read(f"model/{key}", dim, 0, None if dim is None else shape[dim]))
        if list(whole[-1].shape) != list(shape):
            raise UserError(f"checkpoint tensor {key} has shape {list(whole[-1].shape)} where the model's whole "
                            f"weight has {list(shape)}: another model shape")
    value = torch.stack(whole) if weight.stacked else whole[0]
    module, attribute = name.rsplit(".", 1)
    assign_whole(model.get_submodule(module), attribute, value)


def load_checkpoint(trainer, path: str | Path) -> dict:
    """Restore a trainer from a checkpoint saved at any layout; returns its metadata."""
    ctx = trainer.ctx
    checkpoint = files.resolve(path)
    meta = files.read_meta(checkpoint)
    check_compatible(meta, trainer.config)
    saved_optimizer = meta["config"]["train"].get("optimizer", "adamw")
    if saved_optimizer != trainer.config.train.optimizer:
        raise UserError(f'the checkpoint was trained with train.optimizer="{saved_optimizer}" but this run asks for '
                        f'"{trainer.config.train.optimizer}"; resume with "{saved_optimizer}", or start a new run '
                        "directory from its weights with checkpoint.init_from (fresh optimizer state)")
    shard_names = [name for row in model_files(meta) for name in row]
    same_layout = (meta["world_size"], meta["tensor_parallel"], meta.get("pipeline_parallel", 1),
                   meta.get("expert_parallel", 1)) == (ctx.world_size, ctx.tp_size, ctx.pp_size, ctx.ep_size)
    files.verify(checkpoint, meta, shard_names, world=ctx.world, device=ctx.device)  # each shard hashed once
    if same_layout:
        files.verify(checkpoint, meta, [rng_file(ctx.rank)])
    names = None
    if meta.get("lora") or trainer.config.lora.rank:  # the base from checkpoint.init_from, then what trained
        names = _load_lora_base(trainer, meta)
    load_weights(trainer.model, reader_of(checkpoint, meta), ctx, trainer.optimizer, meta["optimizer_step"], names)
    trainer.step, trainer.consumed_samples = meta["step"], meta["consumed_samples"]
    trainer.skipped_steps = meta["skipped_steps"]
    if trainer.scaler and meta["scaler"]:
        trainer.scaler.load_state_dict(meta["scaler"])
    if meta.get("loss") and hasattr(trainer.loss, "load_state_dict"):  # an RL run's adaptive entropy control
        trainer.loss.load_state_dict(meta["loss"])
    if same_layout:
        restore_rng(ctx, checkpoint / rng_file(ctx.rank))
    return meta


def _load_lora_base(trainer, meta: dict) -> set[str]:
    """A LoRA checkpoint's frozen base: the run's own (`checkpoint.init_from`, or its seeded start), checked
    against the base the checkpoint names and loaded; returns the names the checkpoint itself restores."""
    if not (meta.get("lora") and trainer.config.lora.rank):
        saved, now = ("adapters" if meta.get("lora") else "every weight"), ("adapters" if trainer.config.lora.rank
                                                                            else "every weight")
        raise UserError(f"the checkpoint trained {saved} but this run trains {now}; set [lora] as the checkpoint's "
                        "run did, or start a new run directory")
    check_base(meta["lora"], trainer.config, lora_base(trainer))
    if trainer.config.checkpoint.init_from:
        from shardlm.checkpoint.init import init_weights, open_source

        init_weights(trainer, open_source(trainer.config.checkpoint.init_from))
    return {name for name, param in trainer.model.named_parameters() if param.requires_grad}


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors file; UserError when it cannot be read as one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{path} is not a readable safetensors file ({exc})") from None


def consolidated_config(path: Path) -> RunConfig:
    """The config stored in a consolidated single-file checkpoint's metadata."""
    metadata = safetensors_metadata(path)
    if "config" not in metadata:
        raise UserError(f"{path} is not a consolidated shardlm checkpoint (no config in its metadata)")
    return from_dict(json.loads(metadata["config"]))


def load_consolidated(path: Path) -> tuple[RunConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a consolidated single-file checkpoint."""
    return consolidated_config(path), load_file(str(path))


def consolidate(path: str | Path, out: str | Path, prefix: str = "model") -> Path:
    """Write a checkpoint's model as one TP=1 safetensors file (vocabulary padding removed); `prefix`: a weight copy
    it keeps instead ("bema": the BEMA weights; a tensor the copy lacks, one not trained, is the model's)."""
    checkpoint = files.resolve(path)
    meta = files.read_meta(checkpoint)
    files.verify(checkpoint, meta, [n for row in model_files(meta) for n in row])
    reader = reader_of(checkpoint, meta)
    vocab = meta["config"]["model"]["vocab_size"]
    tensors, keys = {}, reader.keys()
    for name, info in meta["tensors"].items():
        key = f"{prefix}/{name}" if f"{prefix}/{name}" in keys else f"model/{name}"
        full = reader.read(key, info["split_dim"])
        tensors[f"model/{name}"] = (full[:vocab] if name in ("wte.weight", "lm_head.weight") else full).contiguous()
    return files.write_consolidated(Path(out), tensors, meta["config"], meta["step"])
