"""DeepSeek-V3's DualPipe schedule in the planner: which stages a rank holds, what it keeps in flight, its pace.

DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.2.1, and github.com/deepseek-ai/DualPipe)
runs the pipeline in both directions at once. The model is cut into P stages as usual, and rank r holds two of
them: stage r for the micro-batches that enter at rank 0 and stage P - 1 - r for those that enter at rank P - 1
(the repository's `example.py` builds each rank's modules as `full_modules[rank]` and
`full_modules[pp_size - 1 - rank]`, and sums each copy's gradient with its mirror's). So a rank keeps the
parameters, gradients and optimizer state of two stages (the README's "2x" parameters), and the first and the
last rank both hold the embedding, the output head and the multi-token-prediction depths, which there share the
one embedding (the report, 3.2.3: "the shallowest layers (including the embedding layer) and deepest layers
(including the output head) ... on the same PP rank").

In flight: each direction carries half of the m micro-batches, and a stage keeps as many forwards in flight as
1F1B would, P - r for stage r counted from its direction's start. Rank r holds P - r micro-batches of stage r and
r + 1 of stage P - 1 - r: P + 1 in all, the README's "PP + 1". The ranks r and P - 1 - r hold the same two stages
with the counts swapped, so the first P / 2 ranks (rounded up) are all there is to check.

Pace: each rank runs half the micro-batches through each of its two stages, so its work per micro-batch is the
mean of its two stages' FLOPs (`stage_flops`), the output head, its loss and the depths included (the heads of
DeepSeek-V3 weigh about 1.2 layers each); the busiest pair sets the pace.

Bubble (the report's Table 2): (PP/2 - 1)(F&B + B - 3W) (`bubble_fraction`).
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig
from shardlm.plan.linear_attention import attention_weights, rule_flops_per_token
from shardlm.plan.sparse_attention import sparse_attention_flops
from shardlm.plan.stages import RankStages, pipeline_layers
from shardlm.plan.windows import attended_keys, attention_flops_per_key


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """DualPipe's idle time over the ideal (the report's Table 2): (PP/2 - 1)(F&B + B - 3W), F the forward of a
    stage, B twice it and W half of B (by their FLOPs), F&B a forward and a backward overlapped counted as F + B:
    (PP/2 - 1) F against a rank's 3 F per micro-batch and m micro-batches, (PP/2 - 1) / (3 m)."""
    return max(0, pp // 2 - 1) / (3 * micro_batches)


def mirrored_ranks(pp: int) -> range:
    """The ranks whose memory covers all: r and P - 1 - r hold the same stages (the first ceil(P / 2))."""
    return range(-(-pp // 2))


def rank_stages(layers: list[list[int]], pp: int, rank: int) -> RankStages:
    """Rank `rank`'s two stages of the P-stage split `layers`: chunk 0 is stage `rank` (its direction's P - rank
    forwards in flight), chunk 1 the mirror stage P - 1 - rank (rank + 1 in flight). For rank < P / 2 only
    (`mirrored_ranks`), where chunk 0 holds the embedding when the rank holds stage 0 and chunk 1 the head."""
    mirror = pp - 1 - rank
    return RankStages(rank, [len(layers[rank]), len(layers[mirror])], rank == 0, mirror == pp - 1,
                      (*layers[rank], *layers[mirror]))


def forwards_in_flight(pp: int, micro_batches: int, rank: int) -> list[int]:
    """Local chunks (`rank_stages`) of the forwards rank `rank` holds at its peak: P - rank of chunk 0 and
    rank + 1 of chunk 1, each at most its direction's half of the micro-batches."""
    half = -(-micro_batches // 2)
    return [0] * min(pp - rank, half) + [1] * min(rank + 1, half)


def layer_flops(cfg: ModelConfig, index: int) -> float:
    """Forward FLOPs per token of layer `index` (MTP depths past the layers included), counted as
    `flops_per_token` counts them: its attention matrices (MLA's, a linear-attention layer's or q, k, v, o:
    `linear_attention.attention_weights`), its MLP (dense, or the top-k routed and the shared experts with the
    router and the shared experts' gate), the score and value products over its keys, or a linear layer's
    recurrence (`linear_attention.rule_flops_per_token`). A sparse-attention layer counts a third of its core's and
    indexer's training FLOPs (`sparse_attention.sparse_attention_flops`: the indexer trains at less than 3x its
    forward), so 3x the layers still make `flops_per_token`. Nemotron-H's blocks (`layer_pattern`): one mixer
    each, `recurrent.pattern_layer_flops`."""
    if cfg.layer_pattern and index < cfg.num_layers:
        from shardlm.plan.recurrent import pattern_layer_flops

        return pattern_layer_flops(cfg, index)
    h = cfg.hidden_size
    matrices = 3 if cfg.arch == "llama" else 2
    if cfg.is_moe_layer(index):
        shared = cfg.shared_ffn_size if cfg.moe_shared_experts else 0
        gate = h if cfg.moe_shared_experts and cfg.moe_shared_expert_gate else 0
        mlp = matrices * (cfg.moe_top_k * cfg.moe_ffn_size + shared) * h + h * cfg.moe_num_experts + gate
    else:
        mlp = matrices * cfg.ffn_size * h
    recurrence = rule_flops_per_token(cfg) if cfg.is_linear_layer(index) else 0
    sparse = sparse_attention_flops(cfg, index) if cfg.attention == "mla" else None
    core = sparse.training / 3 if sparse else attention_flops_per_key(cfg) * attended_keys(cfg, index)
    return 2 * (attention_weights(cfg, index) + mlp) + core + recurrence


def stage_flops(cfg: ModelConfig, layers: list[int], last: bool) -> float:
    """Forward FLOPs per token of one stage: its layers, and on the last stage the output head (2 h V) and each
    multi-token-prediction depth (its layer, the 2h x h eh_proj and one more pass through the head)."""
    total = sum(layer_flops(cfg, i) for i in layers)
    if last:
        head = 2 * cfg.hidden_size * cfg.vocab_size
        total += head + sum(layer_flops(cfg, cfg.num_layers + k) + 4 * cfg.hidden_size ** 2 + head
                            for k in range(cfg.mtp_layers))
    return total


def pace(cfg: ModelConfig, pp: int) -> tuple[float, float, float]:
    """(layers, MoE layers, imbalance) of the busiest rank under DualPipe on shardlm's P-stage split: the mean
    layer counts (depths included) of the busiest pair of stages, rounded up (they price its per-layer
    collectives and passes), and the pair's mean FLOPs over the average stage's (the compute's pace)."""
    layers = pipeline_layers(cfg.num_layers, pp, 1)
    flops = [stage_flops(cfg, stage, s == pp - 1) for s, stage in enumerate(layers)]
    busiest = max(mirrored_ranks(pp), key=lambda r: flops[r] + flops[pp - 1 - r])
    pair = (*layers[busiest], *layers[pp - 1 - busiest])
    depths = cfg.mtp_layers if busiest == 0 else 0
    moe = sum(cfg.is_moe_layer(i) for i in pair) + sum(cfg.is_moe_layer(cfg.num_layers + k) for k in range(depths))
    imbalance = (flops[busiest] + flops[pp - 1 - busiest]) / 2 / (sum(flops) / pp)
    return -(-(len(pair) + depths) // 2), -(-moe // 2), imbalance
