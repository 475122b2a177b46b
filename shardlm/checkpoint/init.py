"""Start a run from weights only (`checkpoint.init_from`): fresh optimizer, step 0, data from the start.

The source is any of
  - a consolidated single-file shardlm checkpoint (`shardlm convert --from-hf`, `shardlm checkpoint convert`);
  - a Hugging Face model directory (config.json + safetensors) of an architecture `shardlm convert --from-hf`
    supports (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE), read in place: no converted copy is written;
  - a sharded shardlm checkpoint (a step directory or the folder holding `latest`): its weights only.
Every rank reads its own slice of each tensor at the run's layout through `state.load_weights`, as a
resume does; of an HF tensor only the rank's rows are read (`hf_common.HFTensor`; GPT-2's, which are transposed
and reordered, are converted whole, one at a time).

The run's [model] section must describe the checkpoint's model (`resolve_model`): a key left at its
default takes the checkpoint's value, a key set to another value than the checkpoint's is a one-line
error naming it; training-only keys (dropout, init, vocabulary padding, MoE loss coefficients, and a
Llama's seq_length, which has no tensor) keep the run's value when it sets one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shardlm.checkpoint import files
from shardlm.checkpoint.compatibility import check_base, shared_fingerprint
from shardlm.checkpoint.hf import open_hf
from shardlm.checkpoint.sharded import ShardedReader, model_files
from shardlm.checkpoint.state import (
    _stored_names,
    consolidated_config,
    is_expert,
    load_weights,
    reader_of,
    split_dim,
)
from shardlm.config import DataConfig, RunConfig, from_dict
from shardlm.errors import UserError
from shardlm.lora.apply import add_adapters, is_adapter, quantize_base
from shardlm.models.config import ModelConfig
from shardlm.parallel import ParallelContext

SCORE_WEIGHT = "score.weight"  # a reward model's head (`shardlm.reward.head`)
VOCABULARY = ("model/wte.weight", "model/lm_head.weight")  # rows padded to a multiple of the TP size and more
FREE_KEYS = ("dropout", "attention_dropout", "init_std", "make_vocab_size_divisible_by", "moe_aux_loss_coeff",
             "moe_z_loss_coeff")


class MappedReader:
    """`ShardedReader`'s reading interface over {key: `hf_common.HFTensor`} (an HF directory): `read` takes a rank's
    rows (reading only those when the tensor needs no conversion), fills rows past the end with zeros (the
    padded vocabulary) and, after `expect`, checks each tensor's shape against the model's."""

    def __init__(self, sources: dict, where: Path | None = None):
        self.sources = sources
        self.where = where
        self.expected: dict[str, list[int]] = {}  # set by `expect`: the full shapes the model wants
        self._last: tuple[str, torch.Tensor] | None = None  # the last converted tensor (shape, then read)

    def expect(self, model, tp_size: int) -> None:
        """Check each tensor, when read, against the full (TP=1) shape of the parameter it fills in `model`
        (config.json and the weights of an HF directory could disagree; slicing would then hide it)."""
        for name, param in model.named_parameters():
            expert = is_expert(param)
            shape, dim = list(param.shape[1:] if expert else param.shape), split_dim(param)
            if dim is not None:
                shape[dim - 1 if expert else dim] *= tp_size
            for key in _stored_names(name, param):
                self.expected[f"model/{key}"] = shape

    def keys(self) -> set[str]:
        return set(self.sources)

    def _converted(self, key: str) -> torch.Tensor:
        if self._last is None or self._last[0] != key:
            self._last = (key, self.sources[key]())
        return self._last[1]

    def shape(self, key: str) -> list[int]:
        """The full shape of `key`, checked against the model's (`expect`)."""
        got = self.sources[key].shape()
        got = list(self._converted(key).shape) if got is None else got
        want = self.expected.get(key)
        vocab = key in VOCABULARY and want is not None and got[1:] == want[1:] and got[0] <= want[0]  # padding
        if want is not None and got != want and not vocab:
            raise UserError(f"{self.where}: tensor {key.split('/', 1)[1]} has shape {got} but its config.json "
                            f"describes a model whose tensor has {want}")
        return got

    def read(self, key: str, split_dim: int | None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) along `split_dim` of the full tensor `key` (all of it when split_dim is None)."""
        shape, source = self.shape(key), self.sources[key]
        if split_dim is None:
            return self._converted(key) if source.shape() is None else source()
        size = shape[split_dim]
        end = size if end is None else end
        lo, hi = min(start, size), min(end, size)
        if source.shape() is None:
            part = self._converted(key).narrow(split_dim, lo, hi - lo)
        else:
            part = source.part(split_dim, lo, hi)
        if end > size:
            pad = list(shape)
            pad[split_dim] = end - max(start, size)
            part = torch.cat([part, torch.zeros(pad, dtype=part.dtype)], dim=split_dim)
        return part


@dataclasses.dataclass
class WeightSource:
    """What `checkpoint.init_from` names: its config (model shape, tokenizer) and a reader of its tensors."""

    path: Path
    kind: str  # "huggingface", "consolidated" or "sharded"
    config: RunConfig
    reader: object  # ShardedReader or MappedReader
    meta: dict | None = None  # a sharded checkpoint's meta.json (its files are verified before reading)


def open_source(path: str | Path) -> WeightSource:
    """The weights `path` names (module docstring); UserError (one line) for anything else."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint.init_from={path} does not exist")
    if path.is_file():
        return WeightSource(path, "consolidated", consolidated_config(path), ShardedReader([path]))
    if (path / "config.json").is_file():
        config, sources = open_hf(path)
        reader = MappedReader({f"model/{k}": v for k, v in sources.items()}, path)
        return WeightSource(path, "huggingface", config, reader)
    if (path / files.META).is_file() or (path / files.LATEST).is_file():
        checkpoint = files.resolve(path)
        meta = files.read_meta(checkpoint)
        return WeightSource(checkpoint, "sharded", from_dict(meta["config"]), reader_of(checkpoint, meta), meta)
    raise UserError(f"checkpoint.init_from={path} is neither a shardlm checkpoint nor a Hugging Face model "
                    "directory (no config.json)")


def resolve_model(config: RunConfig, source: RunConfig, where: Path) -> None:
    """Give `config.model` the checkpoint's shape (module docstring), in place; UserError naming the first key
    the run sets to another value than the checkpoint's. The tokenizer is the checkpoint's (an HF directory's
    tokenizer.json) when the run leaves data.tokenizer and data.vocab_file at their defaults."""
    defaults, saved = dataclasses.asdict(ModelConfig()), dataclasses.asdict(source.model)
    free = FREE_KEYS + (("seq_length",) if saved["arch"] == "llama" else ())
    for key, value in dataclasses.asdict(config.model).items():
        if value == defaults[key] or value == saved[key]:
            setattr(config.model, key, saved[key])
        elif key not in free:
            raise UserError(f"model.{key}={value!r} but checkpoint.init_from={where} has {saved[key]!r}; leave "
                            f"model.{key} out (it is taken from the checkpoint) or set it to {saved[key]!r}")
    data_defaults = DataConfig()
    if ((config.data.tokenizer, config.data.vocab_file) == (data_defaults.tokenizer, data_defaults.vocab_file)
            and source.data.vocab_file):  # a tokenizer file since removed is a one-line error, not another tokenizer
        config.data.tokenizer, config.data.vocab_file = source.data.tokenizer, source.data.vocab_file
        config.data.merges_file = source.data.merges_file


def resolve_init(config: RunConfig, run_dir: Path | None = None) -> WeightSource | None:
    """The source of `config.checkpoint.init_from` with `config.model` resolved against it (None when unset).
    Called before validation, by `shardlm train` and by every rank; repeatable (a resolved config is unchanged).
    When the run's checkpoint folder (checkpoint.dir, else RUN_DIR/checkpoints) already has `latest`, the run
    resumes from it: [model] is resolved against that checkpoint and None is returned, so a restart neither
    reads the weights again nor needs them to still be there."""
    load = Path(config.checkpoint.load) if config.checkpoint.load else None
    if load is not None and (load.is_file() or (load / "config.json").is_file()):
        raise UserError(f"checkpoint.load={load} resumes a sharded shardlm checkpoint (weights, optimizer, step); "
                        "start from a consolidated file or a Hugging Face directory with checkpoint.init_from")
    if not config.checkpoint.init_from:
        return None
    if config.checkpoint.load:
        raise UserError("checkpoint.load (resume a run: weights, optimizer, step, data position) and "
                        "checkpoint.init_from (weights only, step 0) exclude each other; set one")
    folder = Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints" if run_dir else None
    latest = files.latest_in(folder) if folder is not None else None
    if latest is not None:
        resolve_model(config, from_dict(files.read_meta(latest)["config"]), latest)
        return None
    source = open_source(config.checkpoint.init_from)
    resolve_model(config, source.config, source.path)
    return source


def init_weights(trainer, source: WeightSource) -> None:
    """Load `source`'s weights into a fresh trainer at its layout (every rank); the optimizer stays fresh."""
    ctx = trainer.ctx
    if source.meta is not None:  # sizes and sha256 of the shards, each hashed on one rank
        names = [name for row in model_files(source.meta) for name in row]
        files.verify(source.path, source.meta, names, world=ctx.world, device=ctx.device)
    base = None
    if trainer.config.lora.rank:  # the base under the adapters: every parameter but the adapters themselves
        base = {name for name, _ in trainer.model.named_parameters() if not is_adapter(name)}
    if has_new_head(trainer.model, source):  # a reward model started from a language model: its head stays new
        base = {name for name, _ in trainer.model.named_parameters() if name != SCORE_WEIGHT
                and (base is None or name in base)}
    if isinstance(source.reader, MappedReader):
        source.reader.expect(trainer.model, ctx.tp_size)
    load_weights(trainer.model, source.reader, ctx, trainer.optimizer, optimizer_step=0, names=base)


def has_new_head(model, source: WeightSource) -> bool:
    """Whether `model` has a reward model's score head that `source` (a language model) has no weights for."""
    names = {name for name, _ in model.named_parameters()}
    return SCORE_WEIGHT in names and f"model/{SCORE_WEIGHT}" not in source.reader.keys()


def describe(source: WeightSource) -> str:
    """One line for the run's log."""
    m = source.config.model
    return (f"initialized from {source.kind} weights {source.path} ({m.arch}, {m.num_layers} layers, hidden "
            f"{m.hidden_size}, vocabulary {m.vocab_size}); fresh optimizer, step 0, data from the start")


def load_model(path: str | Path, ctx: ParallelContext):
    """(model, config) from a checkpoint directory, a consolidated file or a Hugging Face model directory
    (read in place, `open_source`), sharded for `ctx`, in eval mode."""
    from shardlm.models import build_model

    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        source = open_source(path)
        config = source.config
        config.parallel.tensor, config.parallel.pipeline = ctx.tp_size, 1
        model = with_head(build_model(config.model, ctx, seed=config.train.seed), config, source.reader)
        source.reader.expect(model, ctx.tp_size)
        load_weights(model, source.reader, ctx)
        return model.eval(), config
    if path.is_file():
        config, paths = consolidated_config(path), [path]
    else:
        checkpoint = files.resolve(path)
        meta = files.read_meta(checkpoint)
        files.verify(checkpoint, meta, [n for row in model_files(meta) for n in row], world=ctx.world,
                     device=ctx.device)
        config = from_dict(meta["config"])
    config.parallel.tensor, config.parallel.pipeline = ctx.tp_size, 1
    reader = ShardedReader(paths) if path.is_file() else reader_of(checkpoint, meta)
    model = with_head(build_model(config.model, ctx, seed=config.train.seed), config, reader)
    names = None
    if not path.is_file() and meta.get("lora"):  # the base from its source, checked, then the adapters
        names = load_lora_base(model, config, meta["lora"], ctx)
    load_weights(model, reader, ctx, names=names)
    return model.eval(), config


def with_head(model, config: RunConfig, reader):
    """`model` with a reward model's score head when the weights have one (a reward run's checkpoint, a Hugging
    Face `XForSequenceClassification`)."""
    if config.reward.loss or f"model/{SCORE_WEIGHT}" in reader.keys():
        from shardlm.reward.head import add_score_head

        add_score_head(model, config.train.seed)
    return model


def load_lora_base(model, config: RunConfig, saved: dict, ctx: ParallelContext) -> set[str]:
    """A LoRA checkpoint's model for evaluation, generation or export: adapters put on `model` as the run put them,
    the base (`checkpoint.init_from`, or the seeded start) checked against the checkpoint's fingerprint and loaded;
    returns the names the checkpoint restores (adapters, `modules_to_save`)."""
    add_adapters(model, config.lora, ctx, config.train.seed)
    if config.lora.quantize:  # the base the adapters trained on: NF4 as in the run
        quantize_base(model, ctx)
    check_base(saved, config, shared_fingerprint(config, ctx))
    if config.checkpoint.init_from:
        source = open_source(config.checkpoint.init_from)
        if isinstance(source.reader, MappedReader):
            source.reader.expect(model, ctx.tp_size)
        new_head = {SCORE_WEIGHT} if has_new_head(model, source) else set()  # (trained: in the checkpoint)
        load_weights(model, source.reader, ctx,
                     names={n for n, _ in model.named_parameters() if not is_adapter(n)} - new_head)
    return {name for name, param in model.named_parameters() if param.requires_grad}
