"""Activation memory per GPU under sequence parallelism, recomputation and pipeline schedules.

Two accountings of one transformer layer's saved activations for one micro-batch (b sequences of
s tokens, hidden h, a heads, TP size t):

- "shardlm": exactly what autograd saves in shardlm's layer (`memory.layer_activation_bytes`, fused
  SDPA, shardlm's dtypes). Sequence parallelism divides LayerNorm inputs and statistics and the
  dropout masks by t (the QKV and fc GEMMs save the all-gathered LayerNorm outputs, so those stay
  whole: 2 b s h e_m per layer more than Korthikanti's 34/t); selective recomputation drops what
  the attention core saves beyond its input and output (with the fused kernel only the log-sum-exp:
  the s x s scores are never stored, so it buys little here);
- "megatron": Korthikanti et al. 2022 (Megatron's fp16 layer with the unfused softmax, 2-byte
  activations, 1-byte masks), per layer:
      no parallelism            s b h (34 + 5 a s / h)
      TP                        s b h (10 + 24/t + 5 a s / (h t))
      TP + SP                   s b h / t (34 + 5 a s / h)
      TP + selective            s b h (10 + 24/t)
      TP + SP + selective       34 s b h / t
      full recomputation        2 s b h (/ t with SP) kept per layer.
  Outside the layers: the embedding's dropout mask s b h (/t with SP) on the first stage; the final
  LayerNorm and output layer 4 s b h (/t with SP) and the fp32 logits 4 s b V / t on the last.

Multi-head latent attention (shardlm only): `memory.mla_activation_bytes` replaces the attention's share; under
sequence parallelism its down-projections run on the rank's 1/t of the sequence, so what they save is split too.

MoE layers (shardlm only): `experts.moe_layer_activation_bytes` replaces the dense MLP's share; in a
model that mixes dense and MoE layers every layer is charged the larger of the two.

Linear-attention layers (shardlm only; Qwen3-Next, Qwen3.5): `linear_attention.linear_activation_bytes` replaces
the attention's share (`memory.attention_activation_bytes`), under selective recomputation what the recomputed core
keeps; in a hybrid model every layer is charged the larger of the two kinds, as for dense and MoE layers.

Kimi Linear (KDA beside MLA): a KDA layer is `recurrent.kda_layer_activation_bytes` (with its MoE layer's extra over
a dense MLP where it has one); every layer is charged the largest of its layer kinds. Nemotron-H (`layer_pattern`):
every block is charged the largest block kind (`pattern_layer_bytes`); its MoE blocks are estimated
(`recurrent.MOE_BLOCK_NOTE`). DeepSeek-V4 (`hc_mult`): the largest of its layer kinds, its attention, clipped MoE and
hyper-connections (`v4_activations.v4_activation_change`), its layer input the n streams.

`rank_activation_peak` multiplies them by the micro-batches a pipeline rank keeps in flight
(`stages.forwards_in_flight`): the first stage of 1F1B holds P micro-batches of L/P layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.models.config import ModelConfig
from shardlm.plan import dualpipe, recurrent
from shardlm.plan.experts import moe_layer_activation_bytes, moe_layer_count
from shardlm.plan.linear_attention import linear_activation_bytes, linear_layer_count
from shardlm.plan.memory import (
    ActivationMemory,
    NumericFormat,
    activation_memory,
    attention_activation_bytes,
    norm_normalized_bytes,
)
from shardlm.plan.stages import RankStages, forwards_in_flight

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class LayerSetting:
    """How the layers run: the memory-relevant switches of a layout."""

    sequence_parallel: bool = False
    recompute: str = "none"
    """"none", "selective" (the attention core) or "full" (whole layers)."""


def korthikanti_layer_bytes(cfg: ModelConfig, tp: int, micro_batch: int, setting: LayerSetting) -> int:
    """Bytes one layer saves for one micro-batch in Megatron's fp16 layer (Korthikanti et al. 2022)."""
    s, b, h, a = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.num_heads
    sbh = s * b * h
    scores = 5 * a * s / h
    if setting.recompute == "full":
        return round(2 * sbh / (tp if setting.sequence_parallel else 1))
    if setting.sequence_parallel:
        return round(sbh / tp * (34 + (0 if setting.recompute == "selective" else scores)))
    return round(sbh * (10 + 24 / tp + (0 if setting.recompute == "selective" else scores / tp)))


def korthikanti_memory(cfg: ModelConfig, tp: int, micro_batch: int, setting: LayerSetting) -> ActivationMemory:
    """`ActivationMemory` of Megatron's fp16 GPT by Korthikanti et al.'s formulas (see the module doc)."""
    s, b, h = cfg.seq_length, micro_batch, cfg.hidden_size
    sbh = s * b * h
    split = tp if setting.sequence_parallel else 1
    saved = korthikanti_layer_bytes(cfg, tp, micro_batch, replace(setting, recompute="none"))
    if setting.recompute == "selective":
        saved = korthikanti_layer_bytes(cfg, tp, micro_batch, setting)
    embedding = sbh // split
    head = 4 * sbh // split + 4 * s * b * cfg.padded_vocab_size(tp) // tp
    return ActivationMemory(per_layer=saved, layer_input=2 * sbh // split, outside_layers=embedding + head,
                            transient=0, num_layers=cfg.num_layers, embedding=embedding)


def flash_layer_bytes(cfg: ModelConfig, tp: int, micro_batch: int, setting: LayerSetting) -> int:
    """Bytes one layer saves for one micro-batch in Megatron-Core's half-precision layer with flash attention:
    Korthikanti et al.'s accounting without the s x s scores (the flash kernel keeps its output and the
    log-sum-exp, 4 bytes per query head and token). GPT: their TP + selective formula, s b h (10 + 24/t) (SP:
    34 s b h / t). Llama, no dropout: the two RMSNorm inputs and the two GEMM inputs they feed, 8 s b h,
    unsplit without SP; split over t: q, k, v (2 (a + 2 kv)), the attention output (2 a), SwiGLU's gate and
    up outputs and their product (3 x 2 f) per token. Full recomputation keeps the layer input."""
    s, b, h = cfg.seq_length, micro_batch, cfg.hidden_size
    split = tp if setting.sequence_parallel else 1
    if setting.recompute == "full":
        return round(2 * s * b * h / split)
    lse = 4 * s * b * cfg.num_heads // tp
    if cfg.arch != "llama":
        return korthikanti_layer_bytes(cfg, tp, micro_batch, replace(setting, recompute="selective")) + lse
    a, kv = cfg.num_heads * cfg.attention_head_dim, cfg.kv_heads * cfg.attention_head_dim
    return round(s * b * (8 * h / split + 2 * (2 * a + 2 * kv + 3 * cfg.ffn_size) / tp)) + lse


def flash_memory(cfg: ModelConfig, tp: int, micro_batch: int, setting: LayerSetting) -> ActivationMemory:
    """`korthikanti_memory` with `flash_layer_bytes` per layer (`--implementation megatron-core`)."""
    acts = korthikanti_memory(cfg, tp, micro_batch, setting)
    return replace(acts, per_layer=flash_layer_bytes(cfg, tp, micro_batch, replace(setting, recompute="none")))


def shardlm_memory(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat, setting: LayerSetting,
                   backend: str = "cuda", rank: int | None = None, ep: int = 1, context: int = 1) -> ActivationMemory:
    """`memory.activation_memory` (what shardlm's layer saves) with sequence parallelism and selective
    recomputation applied, and MoE layers at expert-parallel size `ep` (see the module doc). `cfg.seq_length` is the
    rank's tokens; `context` the CP size (DeepSeek-V4's layers compute the keys of the whole row)."""
    base = activation_memory(cfg, tp, micro_batch, fmt, backend, rank)
    tokens = micro_batch * cfg.seq_length
    per_layer, layer_input, embedding = base.per_layer, base.layer_input, base.embedding
    head = base.outside_layers - base.embedding
    if setting.sequence_parallel and tp > 1:
        h = cfg.hidden_size
        mask_bytes = 0 if cfg.dropout <= 0 else 1 if backend == "cuda" else fmt.residual_bytes

        def unsplit(nbytes: int) -> int:  # what splitting `nbytes` over the sequence saves
            return nbytes - nbytes // tp

        # per layer: the two LayerNorm inputs, their statistics and the two dropout masks are split; the
        # GEMMs save the all-gathered LayerNorm outputs (full sequence), as shardlm's f-twin returns them
        per_layer -= _norms_split_off(cfg, tp, micro_batch, fmt, setting, backend, norms=2)
        if cfg.arch == "llama" and cfg.attention == "mla":  # the down-projections run on the rank's sequence chunk
            per_layer -= _mla_split_off(cfg, tp, tokens, fmt, backend)
        layer_input //= tp
        embedding -= unsplit(tokens * h * mask_bytes)
        head -= unsplit(tokens * (h * fmt.residual_bytes + norm_statistics(cfg) * 4))  # final norm's input, stats
    recomputed = 0  # what selective recomputation drops of a full-attention layer
    if setting.recompute == "selective":
        recomputed = micro_batch * (cfg.num_heads // tp) * cfg.seq_length * 4  # SDPA's log-sum-exp
        if cfg.arch == "llama" and cfg.attention == "mha" and cfg.rope_fraction < 1 and backend != "cuda":
            # and the CPU kernel's output, of which o keeps the copy its (b, heads, s, d) layout makes (`memory`)
            recomputed += tokens * cfg.num_heads * cfg.attention_head_dim // tp * fmt.matmul_bytes
        per_layer -= recomputed
    dense, moe = per_layer, None
    if cfg.moe_num_experts and not cfg.layer_pattern:
        moe = per_layer - base.per_layer + moe_layer_activation_bytes(
            cfg, tp, ep, micro_batch, fmt, setting.sequence_parallel, backend)
        per_layer = moe if moe_layer_count(cfg) == cfg.num_layers else max(per_layer, moe)
    if cfg.layer_pattern:  # Nemotron-H: one mixer a block
        per_layer = pattern_layer_bytes(cfg, tp, micro_batch, fmt, setting, backend, ep)
    elif cfg.linear_attention_rule == "kimi_delta" and linear_layer_count(cfg):  # Kimi Linear: KDA beside MLA
        kda = recurrent.kda_layer_activation_bytes(cfg, tp, micro_batch, fmt, backend, setting.recompute == "selective")
        kda -= _norms_split_off(cfg, tp, micro_batch, fmt, setting, backend, norms=2)
        moe_extra = 0 if moe is None else moe - dense
        per_layer = max((kda if cfg.is_linear_layer(i) else dense) + (moe_extra if cfg.is_moe_layer(i) else 0)
                        for i in range(cfg.num_layers))
    elif linear_layer_count(cfg):  # a Gated DeltaNet layer in place of the attention
        attention = attention_activation_bytes(cfg, tp, micro_batch, fmt, backend) - recomputed
        linear = per_layer - attention + linear_activation_bytes(cfg, tp, micro_batch, fmt,
                                                                  setting.recompute == "selective")
        per_layer = linear if linear_layer_count(cfg) == cfg.num_layers else max(per_layer, linear)
    if cfg.attention == "mla" and cfg.index_topk and cfg.index_stage == "sparse":  # DSA: its sparse core and indexer
        from shardlm.plan.dsa_activations import dsa_activation_change

        per_layer += recomputed + dsa_activation_change(cfg, tp, micro_batch, fmt, backend, context,
                                                        setting.sequence_parallel)
    if cfg.hc_mult:  # DeepSeek-V4: its attention, clipped MoE and hyper-connections, n residual streams a layer input
        from shardlm.plan.v4_activations import v4_activation_change

        extra, streams = v4_activation_change(cfg, tp, micro_batch, fmt, backend, setting.sequence_parallel, context)
        per_layer, layer_input = per_layer + recomputed + extra, streams * layer_input  # (no selective core there)
    return replace(base, per_layer=per_layer, layer_input=layer_input, outside_layers=embedding + head,
                   embedding=embedding)


def norm_statistics(cfg: ModelConfig) -> int:
    """fp32 statistics a norm keeps a token: RMSNorm (Llama) its reciprocal root mean square, LayerNorm (GPT,
    BERT) its mean too."""
    return 1 if cfg.arch == "llama" else 2


def _mla_split_off(cfg: ModelConfig, tp: int, tokens: int, fmt: NumericFormat, backend: str) -> int:
    """What sequence parallelism takes off an MLA layer (`memory.mla_activation_bytes`) of `tokens` tokens: q_a and
    kv_a run on the rank's chunk, so its share of what they save is 1/t: the first norm's output (under autocast the
    copy they share), the latent norms' inputs (q_a's output and kv_a's with its RoPE channels; under autocast
    their fp32 copies, without them), their normalized values where they keep them (`memory.norm_normalized_bytes`)
    and statistics. Without q_lora_rank, q reads the gathered input: its copy stays
    whole, and in fp32 (or with half weights) kv_a's chunk of the input is kept beside it."""
    h, e, autocast = cfg.hidden_size, fmt.matmul_bytes, fmt.weight_cast_bytes > 0
    latents = cfg.q_lora_rank + cfg.kv_lora_rank
    norm_inputs = latents * 4 if autocast else (latents + cfg.qk_rope_head_dim) * e
    norm_inputs += latents * norm_normalized_bytes(e, backend)
    stats = (2 if cfg.q_lora_rank else 1) * 4
    split = tokens * (norm_inputs + stats)
    if cfg.q_lora_rank:  # (one autocast copy of it, shared: `decoder.autocast_copies`)
        split += tokens * h * e
    elif autocast:  # kv_a's copy of the input is the chunk's; q's is the gathered input's
        split += tokens * h * e
    else:  # q keeps the gathered input, kv_a the chunk beside it
        return split - split // tp - tokens // tp * h * e
    return split - split // tp


def _norms_split_off(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat, setting: LayerSetting,
                     backend: str, norms: int) -> int:
    """What sequence parallelism takes off a layer with `norms` norms (b s tokens): their inputs (residual dtype),
    the dropout masks after them and their fp32 statistics (`norm_statistics` a token each) are split over t; 0
    without SP."""
    if not setting.sequence_parallel or tp == 1:
        return 0
    tokens = micro_batch * cfg.seq_length
    mask_bytes = 0 if cfg.dropout <= 0 else 1 if backend == "cuda" else fmt.residual_bytes
    nbytes = norms * tokens * (cfg.hidden_size * (fmt.residual_bytes + mask_bytes) + norm_statistics(cfg) * 4)
    return nbytes - nbytes // tp


def pattern_layer_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat, setting: LayerSetting,
                        backend: str = "cuda", ep: int = 1) -> int:
    """What the largest of Nemotron-H's blocks (`layer_pattern`) saves for one micro-batch on one rank, every block
    charged it: `recurrent.pattern_block_activation_bytes` of the first block of each kind among Mamba-2 ("M"),
    attention ("*") and the ReLU^2 MLP ("-"), the core recomputed under selective recomputation; the MoE blocks
    ("E") by `recurrent.moe_block_activation_bytes`, an estimate (`recurrent.MOE_BLOCK_NOTE`); each block's one norm
    split over t with sequence parallelism."""
    selective = setting.recompute == "selective"
    first = {kind: cfg.layer_pattern.index(kind) for kind in set(cfg.layer_pattern)}
    sizes = [recurrent.pattern_block_activation_bytes(cfg, index, tp, micro_batch, fmt, backend, selective)
             for kind, index in first.items() if kind != "E"]
    if "E" in first:
        sizes.append(recurrent.moe_block_activation_bytes(cfg, tp, ep, micro_batch, fmt, setting.sequence_parallel,
                                                          backend))
    return max(sizes) - _norms_split_off(cfg, tp, micro_batch, fmt, setting, backend, norms=1)


def rank_activation_peak(acts: ActivationMemory, stages: RankStages, schedule: str, pp: int,
                         micro_batches: int, recompute: str, transient: bool = True,
                         keeps_received: bool = False, frees_stage_input: bool = False) -> int:
    """Most activation bytes alive at once on pipeline rank `stages.rank`: every in-flight micro-batch's
    saved layers (only layer inputs under full recomputation, plus one layer being rebuilt), its
    embedding pieces on the first stage and its head and loss on the last (with the logits of the
    latest micro-batch; `transient=False` counts only what autograd saves). Without a pipeline:
    `acts.peak(recompute == "full") + acts.transient`.

    `keeps_received` (shardlm, on PyTorch's schedules): a stage other than the first keeps each
    micro-batch's received activation (its first layer's input, b s h in the residual dtype, split
    with SP) until the step ends, not just until that micro-batch's backward; at the peak those of
    the micro-batches already finished are alive too: m per such stage, less the ones in flight.

    `frees_stage_input` (Meta's Llama 3 stack, `--implementation megatron-core`): a stage frees the activation it
    received once its forward is done (the Llama 3 paper, section 3.3.2: it "proactively deallocate[s]" the
    input and output tensors of each pipeline stage, which with its other pipeline changes let the 405B model
    train on 8K tokens without activation checkpointing), so each in-flight chunk that received its input keeps
    one `layer_input` less than its layers save (its first norm's input: a norm can take its backward from its
    output, as Apex's memory-efficient norms do). Not under full recomputation, where that input is the
    checkpoint."""
    virtual = len(stages.layers_per_chunk)
    chunks = (dualpipe.forwards_in_flight(pp, micro_batches, stages.rank) if schedule == "dualpipe" else
              forwards_in_flight(schedule, pp, virtual, micro_batches, stages.rank))
    full = recompute == "full"
    per_layer_kept = acts.layer_input if full else acts.per_layer
    total = sum(stages.layers_per_chunk[c] for c in chunks) * per_layer_kept
    if full:
        total += acts.per_layer - acts.layer_input
    if stages.first:
        total += chunks.count(0) * acts.embedding
    if stages.last:
        total += chunks.count(virtual - 1) * (acts.outside_layers - acts.embedding)
        total += acts.transient if transient else 0
    if frees_stage_input and pp > 1 and not full:
        received = [c for c in chunks if not (stages.first and c == 0) and stages.layers_per_chunk[c]]
        total -= len(received) * acts.layer_input
    if keeps_received and pp > 1:
        receiving = [c for c in range(virtual) if not (stages.first and c == 0)]
        finished = len(receiving) * micro_batches - sum(chunks.count(c) for c in receiving)
        total += finished * acts.layer_input
    return total
