"""Run configuration: typed sections loaded from TOML, overridable with dotted KEY=VALUE.

Each section is a dataclass whose fields carry a docstring line (see `describe()`, which prints the
reference). Loading checks names and types; `shardlm.validation.validate()` checks the arithmetic of
the layout. Both raise `UserError` with one line naming the key and the fix, before any process group
or data work.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.post_training_config import (
    DistillConfig,
    LoraConfig,
    PreferenceConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@dataclass
class ParallelConfig:
    """The `[parallel]` section. Data-parallel size = world size / (tensor x context x pipeline)."""

    tensor: int = 1
    """Tensor-parallel size: ranks that split every layer (consecutive ranks, inside one node)."""
    pipeline: int = 1
    """Pipeline stages: ranks that each hold a contiguous block of layers (the outermost rank dimension)."""
    pipeline_schedule: str = "1f1b"
    """"gpipe", "1f1b", "interleaved-1f1b", or the zero-bubble "interleaved-zb", "zbv", "dualpipev" (PyTorch's
    schedules; the last two place 2 stages a rank in a V); micro-batches per step = accumulation steps."""
    virtual_stages: int = 1
    """Layer blocks per pipeline rank: >= 2 with "interleaved-1f1b", any with "interleaved-zb" (1 = ZB-H1); "zbv"
    and "dualpipev" always run 2."""
    first_stage_layers: int = 0
    """Layers on the first pipeline stage (it also runs the embeddings); 0: balanced."""
    last_stage_layers: int = 0
    """Layers on the last pipeline stage (it also runs the output layer and loss); 0: balanced."""
    sequence_parallel: bool = False
    """Split LayerNorm, dropout and residual activations along the sequence over the TP group (needs tensor > 1)."""
    expert: int = 1
    """Expert-parallel size E: each MoE layer's experts split over E data-parallel ranks (must divide DP)."""
    expert_dispatcher: str = "all_to_all"
    """How tokens reach their experts' ranks: "all_to_all" (uneven splits) or "all_gather" (small E)."""
    context: int = 1
    """Context-parallel size C: every sequence split over C ranks (zigzag chunks), attention as a ring (next to TP)."""
    cp_comm: str = "ring"
    """How keys and values reach the other context-parallel ranks: "ring" (point to point) or "allgather"."""


@dataclass
class DataConfig:
    """The `[data]` section: where training tokens come from."""

    text_file: str = ""
    """A plain UTF-8 text file, tokenized in memory (small corpora)."""
    prefixes: list = field(default_factory=list)
    """Indexed datasets (`PREFIX.bin/.idx` from `shardlm preprocess`): [prefix] or [w1, p1, w2, p2, ...]."""
    split: str = "949,50,1"
    """Train/valid/test weights; for text_file only the first two count."""
    tokenizer: str = "gpt2"
    """Tokenizer kind: "gpt2" (encoder.json + vocab.bpe), "bert" (vocab.txt) or "json" (tokenizer.json)."""
    vocab_file: str = ""
    """Vocabulary file; empty uses the shared GPT-2 files ($SHARDLM_DATA/vocab/gpt2/encoder.json)."""
    merges_file: str = ""
    """BPE merges file for "gpt2"; empty uses $SHARDLM_DATA/vocab/gpt2/vocab.bpe."""
    cache_dir: str = ""
    """Where sample indices are cached; empty: beside the data."""
    next_sentence_prediction: bool = False
    """BERT: next-sentence prediction instead of the paper's sentence-order prediction."""
    whole_word_masking: bool = True
    """BERT: mask every WordPiece of a word together, in n-grams of up to 3 words (else single tokens)."""
    document_mask: bool = False
    """GPT / Llama pretraining: each document of a sample (cut at end-of-document tokens) attends only to
    itself and its positions restart at 0, as Llama 3 trained."""


@dataclass
class TrainConfig:
    """The `[train]` section: batch, schedule, optimizer, precision."""

    micro_batch_size: int = 4
    """Sequences per forward/backward on one data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all DP ranks; micro_batch x DP x accumulation steps."""
    steps: int = 100
    """Optimizer steps."""
    seed: int = 1234
    """Seed for initialization, data order and dropout."""
    lr: float = 1.5e-4
    """Peak learning rate."""
    min_lr: float = 1e-5
    """Learning rate at the end of the decay."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr."""
    decay_steps: int = 0
    """Steps of decay after warmup; 0 decays over all remaining steps."""
    decay_style: str = "cosine"
    """"cosine", "linear" or "constant"."""
    weight_decay: float = 0.01
    """AdamW weight decay (never on biases and LayerNorm)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables."""
    precision: str = "auto"
    """"auto" (bf16 where the GPU or CPU multiplies bf16 natively, else fp32), "fp32", "bf16" or "fp16" (fp32 master
    weights; fp16 uses dynamic loss scaling)."""
    cast_lm_head_to_fp32: bool = False
    """Under bf16 or fp16 precision, run the output layer in fp32 (TRL's name; ScaleRL's fp32 head): the logits of
    the loss, an RL run's log-probabilities and entropies, and the sampler's, from fp32 copies of the final hidden
    states and the output weight (a distillation's divergence keeps its own precision); no effect in fp32."""
    recompute: str = "none"
    """Activation recomputation: "none", "selective" (the attention core) or "full" (whole layers)."""
    activation_checkpointing: bool = False
    """Deprecated: true means recompute = "full"."""
    param_dtype: str = "fp32"
    """Parameter storage: "fp32", or "half" (train.precision's bf16/fp16, with fp32 gradients and master weights)."""
    distributed_optimizer: bool = False
    """Shard master weights and AdamW moments over DP (ZeRO-1); older name of data_sharding = "optimizer"."""
    data_sharding: str = "none"
    """Sharded over DP: "none" (DDP), "optimizer" (master weights, moments) or "full" (FSDP2: all state)."""
    fsdp_reshard_after_forward: bool = True
    """data_sharding="full": free gathered layers after the forward (false: keep them, 1 all-gather less)."""
    fsdp_shard_size: int = 0
    """data_sharding="full": shard within groups of this many DP x CP ranks (a node's), replicate across; 0: all."""
    initial_loss_scale: float = 4294967296.0
    """fp16: starting loss scale (2^32)."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale halves."""
    min_loss_scale: float = 1.0
    """fp16: the scale never drops below this."""
    eval_interval: int = 0
    """Validate every N steps (and at the end); 0: only at the end."""
    eval_iters: int = 10
    """Micro-batches per validation."""
    timeout_s: float = 600.0
    """Collective timeout: a peer that stops responding ends the run with an error after this long."""
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    compile: bool = False
    """Each transformer layer under `torch.compile` (on the CPU it needs a C++ compiler); a slower first step."""
    optimizer: str = "adamw"
    """"adamw", or "muon": Muon for the transformer layers' weight matrices, AdamW for the rest (docs/optimizers.md)."""
    muon_momentum: float = 0.95
    """Muon's momentum m."""
    muon_nesterov: bool = True
    """Muon's Nesterov update."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations of Muon's orthogonalization."""
    muon_adjust_lr: str = "original"
    """Muon's learning-rate scale per matrix: "original" (sqrt(max(1, rows / cols))) or "match_rms_adamw"
    (0.2 sqrt(max(rows, cols)), Moonlight's, so AdamW's learning rate and weight decay carry over)."""
    muon_ns_dtype: str = "bf16"
    """Newton-Schulz in "bf16" (as torch.optim.Muon) or "fp32"."""
    muon_split: str = "parts"
    """What of GPT's fused qkv is orthogonalized as one: "parts" (q, k and v), "heads" (each head's), "whole"."""
    qk_clip: float = 0.0
    """QK-clip's threshold tau (Kimi K2's MuonClip): after each step, the query and key weights of every head whose
    largest attention logit exceeded tau are scaled so it would be tau; 0: off (docs/optimizers.md)."""


@dataclass
class CheckpointConfig:
    """The `[checkpoint]` section."""

    save_interval: int = 0
    """Save every N steps (and always at the end and on SIGTERM); 0: only at the end and on SIGTERM."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a successful save."""
    dir: str = ""
    """Where checkpoints go; empty: RUN_DIR/checkpoints. A run finding one there resumes from it."""
    load: str = ""
    """Start from this checkpoint (any TP x DP layout) instead; its step, optimizer and data position continue."""
    init_from: str = ""
    """Start from these weights only (fresh optimizer, step 0, data from the start), at any layout: a
    consolidated .safetensors file, a Hugging Face model directory (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, GLM-4.5,
    gpt-oss, Qwen3-Next, Qwen3.5) or a sharded checkpoint. [model] keys left at their defaults take the
    checkpoint's values. A run directory that already holds a checkpoint resumes from it instead."""
    init_adapter: str = ""
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors) whose adapters start a [lora]
    run on checkpoint.init_from's base, at any layout."""
    save: bool = True
    """Save checkpoints at all."""


@dataclass
class BEMAConfig:
    """The `[bema]` section: a bias-corrected exponential moving average of the weights (BEMA, Block and Zhang 2025,
    TRL's `BEMACallback`), kept beside the training at its layout, in its checkpoints, and written at the end to
    RUN_DIR/bema.safetensors (`docs/bema.md`). Every update_freq steps after update_after, with t the step and
    theta_0 the weights at update_after: EMA <- (1 - beta_t) EMA + beta_t theta_t and the BEMA weights are
    EMA + alpha_t (theta_t - theta_0), beta_t = max((lag + multiplier t)^-ema_power, min_ema_multiplier) and
    alpha_t = (lag + multiplier t)^-bias_power."""

    enabled: bool = False
    """Keep the BEMA weights (two more copies of the trained weights and the BEMA weights themselves, each rank
    its own shards)."""
    update_freq: int = 400
    """Update the average every this many steps (TRL's update_freq, the paper's phi)."""
    ema_power: float = 0.5
    """The EMA's decay power kappa; 0 disables the EMA (the BEMA weights then follow theta_0 + alpha x the drift)."""
    bias_power: float = 0.2
    """The bias correction's power eta; 0 keeps alpha at 1, a large value (8) drives it to 0 (plain EMA)."""
    lag: int = 10
    """The schedules' starting offset rho (a virtual age of the first update)."""
    update_after: int = 0
    """Steps of burn-in tau: theta_0 and the EMA are the weights at this step."""
    multiplier: float = 1.0
    """gamma, the schedules' multiplier of the step."""
    min_ema_multiplier: float = 0.0
    """The least the EMA's factor beta_t becomes."""
    update_ref_model: bool = False
    """Set the run's reference (a preference run's live reference, an RL run's KL reference) to the BEMA weights
    every ref_model_update_freq steps after ref_model_update_after (TRL's bema_for_ref_model)."""
    ref_model_update_freq: int = 400
    """Steps between the reference's updates."""
    ref_model_update_after: int = 0
    """The first step the reference may be updated at."""

    def problem(self, lora: bool, live_reference: bool) -> str | None:
        """A one-line problem with these settings (the schedule; a [lora] run's adapters, not averaged yet; a
        reference to update where the run has no `live_reference`, a copy of its weights), or None."""
        schedule = self.lag + self.multiplier > 0 and self.multiplier >= 0 and min(self.ema_power, self.bias_power) >= 0
        checks = [(self.update_freq >= 1 and self.update_after >= 0,
                   f"bema.update_freq={self.update_freq} must be at least 1 and bema.update_after={self.update_after} "
                   ">= 0"),
                  (self.ref_model_update_freq >= 1 and self.ref_model_update_after >= 0,
                   f"bema.ref_model_update_freq={self.ref_model_update_freq} must be at least 1 and "
                   f"bema.ref_model_update_after={self.ref_model_update_after} >= 0"),
                  (schedule, "bema.lag + bema.multiplier must be > 0, bema.multiplier, bema.ema_power and "
                             "bema.bias_power >= 0"),
                  (not lora, "bema averages every trained weight; a [lora] run trains adapters only: set "
                             "bema.enabled=false (BEMA of adapters is not done yet)"),
                  (not self.update_ref_model or live_reference,
                   "bema.update_ref_model moves a reference that is a copy of the weights: a [preference] run with "
                   'preference.reference="weights" (or "auto") or an [rl] run with rl.beta > 0')]
        return next((message for ok, message in checks if not ok), None)


@dataclass
class LogConfig:
    """The `[log]` section."""

    interval: int = 10
    """Log every N steps (metrics.jsonl, console, TensorBoard)."""
    tensorboard: bool = True
    """Write TensorBoard events when tensorboard is installed."""
    progress: bool = True
    """Progress bar with ETA on rank 0."""
    plot: bool = True
    """Write loss_curve.png at the end."""


@dataclass
class RunConfig:
    """A whole run: one field per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    bema: BEMAConfig = field(default_factory=BEMAConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}


def _coerce(value, expected: type, key: str):
    """Check a TOML value against a field's type (int is accepted for float)."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise UserError(f"{key}={value!r} must be true or false")
    if expected in (int, float) and isinstance(value, bool):
        raise UserError(f"{key}={value!r} must be a number")
    if not isinstance(value, expected):
        raise UserError(f"{key}={value!r} must be of type {expected.__name__}")
    return value


def _field_types(section_cls) -> dict[str, type]:
    hints = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}
    return {f.name: hints[f.type] if isinstance(f.type, str) else f.type for f in dataclasses.fields(section_cls)}


def from_dict(raw: dict) -> RunConfig:
    """Build a RunConfig from nested dicts, rejecting unknown sections/keys and wrong types."""
    config = RunConfig()
    for section, values in raw.items():
        if section not in SECTIONS:
            raise UserError(f"unknown config section [{section}]; known sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise UserError(f"config section [{section}] must be a table")
        target = getattr(config, section)
        types = _field_types(type(target))
        for key, value in values.items():
            if key not in types:
                raise UserError(f"unknown config key {section}.{key}; known keys: {', '.join(types)}")
            setattr(target, key, _coerce(value, types[key], f"{section}.{key}"))
    if config.train.activation_checkpointing and config.train.recompute == "none":
        config.train.recompute = "full"  # the deprecated boolean's meaning
    if config.train.distributed_optimizer and config.train.data_sharding == "none":
        config.train.data_sharding = "optimizer"  # the older key's meaning
    if config.train.data_sharding == "optimizer":
        config.train.distributed_optimizer = True  # what the trainer reads
    return config


def parse_override(text: str) -> tuple[str, str, object]:
    """"train.lr=3e-4" -> ("train", "lr", 0.0003). Values are TOML; bare words are strings."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"override {text!r} must look like section.key=value, e.g. train.lr=3e-4")
    dotted, value_text = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text
    return section, key, value


PATH_KEYS = ("text_file", "vocab_file", "merges_file", "cache_dir", "load", "dir", "init_from", "init_adapter",
             "tokenizer", "template", "teacher")


def expand_path(value: str) -> str:
    """Expand `~`, environment variables, and `$SHARDLM_DATA` (defaulting to ../shared/data)."""
    from shardlm.paths import DATA_ENV, shared_data_dir

    for token in ("${" + DATA_ENV + "}", "$" + DATA_ENV):
        value = value.replace(token, str(shared_data_dir()))
    return os.path.expanduser(os.path.expandvars(value))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file (or defaults when None), apply dotted overrides, expand paths."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} not found")
        try:
            raw = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})[key] = value
    config = from_dict(raw)
    for section in (config.data, config.checkpoint, config.sft):
        for key in PATH_KEYS:
            if hasattr(section, key) and getattr(section, key):
                setattr(section, key, expand_path(getattr(section, key)))
    config.data.prefixes = [expand_path(p) if isinstance(p, str) else p for p in config.data.prefixes]
    config.sft.data = [expand_path(p) for p in config.sft.data]
    if "activation_checkpointing" in raw.get("train", {}) and os.environ.get("RANK", "0") == "0":
        print('shardlm: train.activation_checkpointing is deprecated; use train.recompute = "full" '
              '(or "selective")', file=sys.stderr)
    return config


def describe() -> str:
    """The config reference as Markdown: every section, key, default and docstring."""
    lines = []
    for section, factory in SECTIONS.items():
        cls = factory()
        lines.append(f"### [{section}]\n\n{inspect.getdoc(type(cls)).splitlines()[0]}\n")
        lines.append("| key | default | meaning |\n|---|---|---|")
        docs = _field_docs(type(cls))
        for f in dataclasses.fields(cls):
            lines.append(f"| `{f.name}` | `{getattr(cls, f.name)!r}` | {docs.get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            # one line: a docstring's line breaks would end the Markdown table's row
            docs[node.target.id] = " ".join(str(nxt.value.value).split()).replace("|", "\\|")
    return docs
