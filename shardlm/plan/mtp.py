"""Multi-token prediction (DeepSeek-V3's MTP depths, `ModelConfig.mtp_layers`) in the planner.

Each depth k (`shardlm.models.mtp.MTPLayer`) is one more transformer layer of the kind of layer index L + k (MLA,
MoE or dense, as `is_moe_layer` says), a 2h -> h projection `eh_proj` and three RMSNorms (enorm, hnorm,
post_norm), all replicated over TP but the layer's own split weights; it shares the embedding and the output head
with the model, and runs one more pass through that head and its loss. FLOPs: `plan.flops.flops_per_token`
counts each depth already (projection, layer, head).

On a pipeline the depths live on the last stage, which then also needs the input embedding to look up the
rolled tokens: the planner gives it a copy of the embedding (as GPT's last stage keeps the tied word
embedding), so the last stage carries the depths' weights, gradients and optimizer state, that copy, and
per micro-batch the depths' activations. shardlm itself refuses pipeline stages with MTP today (the last
stage would need that copy); the planner counts what such a last stage holds, as DeepSeek-V3 trained
(its report puts the MTP module on the last pipeline stage, beside the output head).
"""

from __future__ import annotations

from dataclasses import replace

from shardlm.models.config import ModelConfig
from shardlm.plan.memory import ActivationMemory, NumericFormat


def mtp_activation_bytes(cfg: ModelConfig, acts: ActivationMemory, tp: int, micro_batch: int,
                         fmt: NumericFormat, sequence_parallel: bool, recompute_full: bool = False) -> int:
    """What the depths save for one micro-batch on one TP rank of the last stage (derived from `MTPLayer`, not
    measured): per depth the layer (`acts.per_layer`, the larger of a dense and an MoE layer in a mixed model;
    under full recomputation only its input, `acts.layer_input`, as the model's layers keep; the one layer being
    rebuilt is already in the peak), the embedding lookup's ids, the two input norms' inputs and
    statistics and eh_proj's 2h input, post_norm's input and statistic, and the head: its input and the logits'
    gradient over the rank's vocabulary rows with its mask, as the main head's fused loss keeps them (each of h
    elements split over TP with sequence parallelism)."""
    if not cfg.mtp_layers:
        return 0
    tokens = micro_batch * cfg.seq_length
    split = tp if sequence_parallel else 1
    h, vocab_local = cfg.hidden_size, cfg.padded_vocab_size(tp) // tp
    norms = tokens * h * (3 * fmt.residual_bytes) // split + 3 * tokens * 4 // split
    projection = tokens * 2 * h * fmt.matmul_bytes // split
    head = tokens * h * fmt.matmul_bytes + tokens * vocab_local * fmt.matmul_bytes + tokens
    layer = acts.layer_input if recompute_full else acts.per_layer
    return cfg.mtp_layers * (layer + tokens * 8 + norms + projection + head)


def with_mtp(acts: ActivationMemory, cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
             sequence_parallel: bool, recompute_full: bool = False) -> ActivationMemory:
    """`acts` with the depths' activations on the last stage (its part of `outside_layers`)."""
    extra = mtp_activation_bytes(cfg, acts, tp, micro_batch, fmt, sequence_parallel, recompute_full)
    return replace(acts, outside_layers=acts.outside_layers + extra) if extra else acts


def busiest_rank_layers(cfg: ModelConfig, pp: int, virtual: int, end_trim: bool,
                        v_shaped: bool = False) -> tuple[int, int]:
    """(layers, MoE layers) of the busiest pipeline rank, MTP depths counted as layers of their kind on the last
    rank: ceil(L / P) (Llama 3's trimmed split: ceil((L + 2) / P)) and ceil(MoE layers / P) without depths.
    `v_shaped` (ZB-V, DualPipeV): the last stage, and with it the depths, is rank 0's second stage."""
    from shardlm.plan.experts import moe_layer_count
    from shardlm.plan.stages import pipeline_layers, rank_stages, trimmed_layers

    layers = -(-(cfg.num_layers + (2 if end_trim else 0)) // pp)
    moe_layers = -(-moe_layer_count(cfg) // pp)
    if not cfg.mtp_layers:
        return layers, moe_layers
    depths = range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)
    if pp == 1:
        indices = range(cfg.num_layers)
    else:
        split = trimmed_layers if end_trim else pipeline_layers
        indices = rank_stages(split(cfg.num_layers, pp, virtual), pp, 0 if v_shaped else pp - 1,
                              v_shaped).layer_indices
    last_moe = sum(cfg.is_moe_layer(i) for i in (*indices, *depths))
    return max(layers, len(indices) + cfg.mtp_layers), max(moe_layers, last_moe)
