"""Pipeline arithmetic of the planner: the layers and parameters each pipeline rank holds, the
micro-batches it keeps in flight under each schedule, and the bubble.

A run with P pipeline ranks and V virtual stages per rank cuts the layers into P x V contiguous
stages with `shardlm.parallel.pipeline.stage_layers` (the same split shardlm trains with); stage `s`
lives on rank `s % P`. Stage 0 also holds the embeddings, the last stage the final norm and the
output layer (GPT: the tied copy of the word embedding). In an MoE model a rank's parameters depend on
which layers it holds: dense layers (DeepSeek's first k, or between every k-th MoE layer) are counted
as dense, the others with their router and 1/E of the experts.

In-flight micro-batches are those of PyTorch's schedules, which shardlm runs (and which match
Megatron's when the micro-batch count is a multiple of P): GPipe runs all m forwards first; 1F1B
lets rank r run P - r forwards before its first backward; interleaved 1F1B lets rank r run
(V - 1) x m_round + 2 (P - 1 - r) forwards (m_round = micro-batches per round, P when P divides m),
then one more forward before each backward. The bubble is (P - 1) / (V m) of the ideal time
(Narayanan et al. 2021, eqs. 1 and 2).

The zero-bubble schedules ("interleaved-zb", "zbv", "dualpipev": `schedule_sim.SPLIT_BACKWARD`) take both their
bubble and their in-flight micro-batches from a replay of PyTorch's own action order (`schedule_sim`). ZB-V and
DualPipeV place 2P stages in a V (`schedule_sim.V_SHAPED`): rank r holds stage r and stage 2P - 1 - r, so rank 0
holds the embedding and the output layer, with one word embedding and no tied copy elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.plan.parameters import (
    ParameterCount,
    _with_layers,
    add_counts,
    layer_parameter_counts,
    layers_parameter_count,
    mtp_parameter_count,
    parameter_count,
)
from shardlm.plan.schedule_sim import SPLIT_BACKWARD, V_SHAPED, in_flight, simulate  # noqa: F401 (re-exported)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")


def bubble_fraction(pp: int, virtual: int, micro_batches: int, schedule: str = "1f1b",
                    recompute: bool = False) -> float:
    """Idle time of a pipeline flush over the ideal time: (P - 1) / (V m) for GPipe and (interleaved) 1F1B; for
    the zero-bubble schedules the replay of PyTorch's order (`schedule_sim.simulate`) with a stage's forward f = 1,
    its input-gradient backward i = 1 (2 with full recomputation, which reruns the forward there) and its
    weight-gradient backward w = 1 (a backward is twice a forward, split evenly)."""
    if pp > 1 and schedule in SPLIT_BACKWARD:
        return simulate(schedule, pp, virtual, micro_batches, 1.0, 2.0 if recompute else 1.0, 1.0)["bubble"]
    return (pp - 1) / (virtual * micro_batches)


def schedule_name(pp: int, virtual: int) -> str:
    """The schedule the planner pairs with a layout: 1F1B, interleaved with V > 1 (GPipe only on request)."""
    return "interleaved-1f1b" if pp > 1 and virtual > 1 else "1f1b"


def forwards_in_flight(schedule: str, pp: int, virtual: int, micro_batches: int, rank: int) -> list[int]:
    """The local chunk (0 .. V-1) of every micro-batch forward whose activations pipeline rank `rank`
    holds at its peak, i.e. just before its first backward starts freeing them."""
    m = micro_batches
    if pp == 1:
        return [0]
    if schedule in SPLIT_BACKWARD:  # PyTorch's order, a micro-batch held from its F until its W
        counts = in_flight(schedule, pp, virtual, m)[rank]
        return [chunk for chunk, count in enumerate(counts) for _ in range(count)]
    if schedule == "gpipe":
        return [0] * m
    if schedule == "1f1b":
        return [0] * min(m, pp - rank)
    per_round = m // max(1, m // pp)
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), m * virtual)
    return [(i // per_round) % virtual for i in range(min(warmup + 1, m * virtual))]


def pipeline_layers(num_layers: int, pp: int, virtual: int, first: int = 0, last: int = 0) -> list[list[int]]:
    """Layer indices of each of the P x V stages, as shardlm splits them."""
    from shardlm.parallel.pipeline import stage_layers  # imports torch: only when a pipeline is planned

    return stage_layers(num_layers, pp * virtual, first, last)


def trimmed_split(num_layers: int, pp: int, virtual: int) -> bool:
    """Whether Llama 3's split applies (`trimmed_layers`): P > 1 and L + 2 a multiple of the P x V stages."""
    return pp > 1 and (num_layers + 2) % (pp * virtual) == 0


def trimmed_layers(num_layers: int, pp: int, virtual: int) -> list[list[int]]:
    """Layer indices of the P x V stages of Llama 3's split (its paper, section 3.3.2): the first and the last
    stage hold one layer fewer than the others, n = (L + 2) / (P V) each, so that the embedding and the output
    layer with the loss take a layer's place; at n = 1 the first stage holds only the embedding and the last
    only the output layer."""
    per_stage = (num_layers + 2) // (pp * virtual)
    counts = [per_stage - 1] + [per_stage] * (pp * virtual - 2) + [per_stage - 1]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(range(start, start + n)) for start, n in zip(starts, counts)]


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank holds."""

    rank: int
    layers_per_chunk: list[int]
    """Layers of each of its V stages (chunk v is stage rank + v P; V-shaped: chunk 0 stage r, chunk 1 stage
    2P - 1 - r)."""
    first: bool
    """Holds stage 0 (the embeddings), in chunk 0."""
    last: bool
    """Holds the last stage (final norm, output layer, loss), in its last chunk."""
    layer_indices: tuple[int, ...] = ()
    """Global indices of its layers, which say which of them are MoE layers (empty when built by hand:
    then every layer of an MoE model counts as an MoE layer)."""

    @property
    def layers(self) -> int:
        return sum(self.layers_per_chunk)


def rank_stages(layers: list[list[int]], pp: int, rank: int, v_shaped: bool = False) -> RankStages:
    """Rank `rank`'s chunks of the stage split `layers` (P x V stages): stages rank, rank + P, ...; `v_shaped`
    (ZB-V, DualPipeV: 2P stages) stage rank and stage 2P - 1 - rank, so rank 0 holds both ends."""
    own = [rank, len(layers) - 1 - rank] if v_shaped else list(range(rank, len(layers), pp))
    chunks = [len(layers[s]) for s in own]
    indices = tuple(i for s in own for i in layers[s])
    return RankStages(rank, chunks, rank == 0, own[-1] == len(layers) - 1, indices)


def _end_pieces(cfg: ModelConfig, tp: int, ep: int = 1) -> tuple[ParameterCount, ParameterCount, ParameterCount]:
    """(first stage's, last stage's, both share) parameters outside the layers, per TP rank; the last stage's
    include the multi-token-prediction depths (`parameters.mtp_parameter_count`) and their embedding copy."""
    if cfg.arch == "bert":
        raise UserError('pipeline parallelism is planned for model.arch "gpt" and "llama"; use --pipeline 1 for BERT')
    h = cfg.hidden_size
    vocab_local = cfg.padded_vocab_size(tp) // tp
    embedding = ParameterCount(vocab_local * h, 0, 1, 0)
    if cfg.arch == "llama":
        output = embedding if cfg.tie_embeddings else ParameterCount(vocab_local * h, 0, 1, 0)
        first, norm = embedding, ParameterCount(0, h, 1, 0)
    else:  # GPT: word + learned positions first; final LayerNorm and the tied word embedding last
        first, output, norm = ParameterCount(vocab_local * h, cfg.seq_length * h, 2, 0), embedding, \
            ParameterCount(0, 2 * h, 2, 0)
    last = add_counts(norm, output)
    shared = output if output is embedding else ParameterCount(0, 0, 0, 0)
    if cfg.mtp_layers:  # the depths and, when the head is not the embedding, a copy of it to embed their tokens
        last = add_counts(last, mtp_parameter_count(cfg, tp, ep))
        if output is not embedding:
            last, shared = add_counts(last, embedding), add_counts(shared, embedding)
    return first, last, shared


def rank_parameter_count(cfg: ModelConfig, tp: int, stages: RankStages, ep: int = 1) -> ParameterCount:
    """Parameters one (pipeline rank, TP rank, EP rank) holds: its layers (dense or MoE, linear or full attention,
    by index: `parameters.layers_parameter_count`), plus the end pieces of the first and last stage (both, the tied
    embedding once, when one rank holds both). Equal to `parameters.parameter_count` without a pipeline."""
    if stages.first and stages.last and len(stages.layers_per_chunk) == 1:
        return parameter_count(_with_layers(cfg, stages.layers), tp, ep)  # the whole model (also BERT's)
    if stages.layer_indices:
        total = layers_parameter_count(cfg, stages.layer_indices, tp, ep)
    else:  # built by hand: every layer of an MoE model an MoE layer
        count = layer_parameter_counts(cfg, tp, ep)[1 if cfg.moe_num_experts else 0]
        total = ParameterCount(*(stages.layers * getattr(count, f) for f in
                                 ("sharded", "replicated", "tensors", "matrix", "expert")))
    first, last, shared = _end_pieces(cfg, tp, ep)
    if stages.first:
        total = add_counts(total, first)
    if stages.last:
        total = add_counts(total, last)
    if stages.first and stages.last:
        total = add_counts(total, shared, sign=-1)
    return total
