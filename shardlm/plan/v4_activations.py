"""What DeepSeek-V4's attention (`shardlm.models.compressed_attention`) saves for the backward, per layer kind.

For one micro-batch of b rows on one TP rank: T queries (s, or s / C on a context-parallel rank), S = s positions a
row (a CP rank's keys: below), N = b T and N_S = b S tokens, H = heads / t query
heads of D channels, r_q = q_lora_rank, R = qk_rope_head_dim, g = output_groups / t of r_o = output_rank; e the
GEMM dtype's bytes:

    queries     q_a's output in fp32 (q_a_norm's input) N r_q and its statistic; q_res (q_b's input) N r_q; q_b's
                output (the per-head norm's input) N H D and a statistic per head; the rotated q N H D (the core's
                input, or its copies chunk by chunk when it keeps its scores: the same bytes)
    keys        kv's output in fp32 N_S D and its statistic; the rotated kv N_S D
    output      the rotated-back output as o_a's einsum reads it (a copy, N H D); o_b's input N g r_o
    RoPE        each rotation's repeated cos and sin (fp32, positions x R each): the queries', the keys', the output's
    a compressor of ratio m (W = S // m entries; CSA's windows overlap, o = 1): its kv (HCA: a view of its
                projection, b S D; CSA: the overlapping windows, b W 2 m D) and its softmax gate b W m (1 + o) D in
                fp32, its norm's input b W D and statistic, cos and sin W R each, the entries b W D (the core's input)
    CSA         the chosen entries (b, T, k) int64 (k = min(index_topk, W)); a trained indexer (index_loss_coeff > 0,
                not frozen) also its compressor at D_i = index_head_dim as above without the entries, its queries'
                cos and sin, and the gradients its loss computed in the forward (fp32): N H_i D_i + N H_i + b W D_i
    the core    (`compressed_core.attend`): a layer of more than CHUNK_ELEMENTS scores recomputes each group of
                chunks in the backward and keeps the positions (T int64) besides its inputs; a smaller one keeps each
                chunk's probabilities (b H c x (band + entries + sink)) and its boolean masks (`_kept_core_bytes`)
    half        under autocast its weights' copies (not the indexer's, whose inputs need no gradient; its GEMMs
                share one copy of the input, `decoder.autocast_copies`, which the Llama layer counts); the fp32 norms'
                copies of half inputs (q_b's output in both dtypes and its statistic in both); the compressors' gates
                in both dtypes; with half weights, the fp32 norms' copies of their weights
    CP          plain rows whose chunks hold whole windows (`halo_gathers`): the keys of the rank's chunks and of the
                window before each (`key_pieces`), each compressor over the rank's chunks, the gathered entries (with
                the indexer's); otherwise the whole row's keys and compressors, and the gathered key projections
                where a view of them is kept
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.config import ModelConfig
from shardlm.plan.deepseek_v4 import hyper_connection_bytes, key_projection_width, layer_kinds, layer_ratios
from shardlm.plan.formats import NumericFormat
from shardlm.plan.memory import attention_activation_bytes


@dataclass(frozen=True)
class CoreChunks:
    """How `compressed_core.attend` runs a layer (`compressed_core.chunking`): `step` queries a chunk, `per_group`
    chunks a product, and whether it recomputes them in the backward (`recompute`) or keeps their scores."""

    step: int
    per_group: int
    recompute: bool


def core_chunks(batch: int, heads: int, queries: int, window: int, others: int) -> CoreChunks:
    """`compressed_core.attend`'s choice for `batch` rows of `heads` heads and `queries` queries attending to their
    window and `others` entries each (0 sliding, W HCA, k CSA), in training."""
    from shardlm.models.compressed_core import chunking

    return CoreChunks(*chunking(batch, heads, queries, window, others))


def _query_groups(length: int, context: int, rank: int, chunks: CoreChunks) -> list[tuple[int, int, int]]:
    """(first position, queries, chunk size) of each group of CP rank `rank`'s queries in a row of `length`
    positions, as `compressed_core.attend` cuts them (`chunk_groups` over the rank's zigzag positions)."""
    import torch

    from shardlm.data.zigzag import zigzag_positions
    from shardlm.models.compressed_core import chunk_groups

    positions = torch.arange(length) if context == 1 else zigzag_positions(length, context, rank)
    return [(int(positions[start]), end - start, size)
            for start, end, size in chunk_groups(positions, chunks.step, chunks.per_group)]


def _kept_core_bytes(cfg: ModelConfig, kind: str, batch: int, heads: int, groups: list[tuple[int, int, int]],
                     entries: int, count: int, ratio: int, e: int) -> int:
    """What the core keeps for `batch` rows whose queries run in `groups` (`_query_groups`) when it does not
    recompute, per group of G chunks
    of c queries: the softmax's output b G H c (n + e + 1) in the GEMM dtype, n the band (c + window - 1 keys; in a
    group of one, the positions from max(0, first - window + 1) to its last query) and e the entries it scores (HCA
    those complete for its last query; CSA those too when they are at most DENSE_SPAN k, else each query's k
    gathered); the window mask G c n, HCA's completeness mask G c e or CSA's b G c e unchosen mask; a gathering group's
    picked entries b G c k D with their indices and its einsums' copies of the queries and the probabilities; the
    entries (`count` of their elements a row) when a group reads them whole. Its copies of the queries are the rotated
    q's bytes."""
    from shardlm.models.compressed_core import DENSE_SPAN

    window, dim = cfg.sliding_window, cfg.head_dim
    total, reads_entries = 0, kind == "hca"
    for first, size, c in groups:
        last = first + size - 1
        band = c + window - 1 if size > c else last + 1 - max(0, first - window + 1)
        seen, masks = 0, size * band
        if kind == "hca":
            seen = (last + 1) // ratio
            masks += size * seen
        elif kind == "csa":
            complete = (last + 1) // ratio
            if complete <= DENSE_SPAN * entries:
                seen, reads_entries = complete, True
                masks += batch * size * complete
            else:  # gathered: the picked entries, their batch and entry indices, the mask of -1s, the einsums' copies
                seen = entries
                masks += batch * size * entries
                total += batch * size * (entries * (dim * e + 8) + heads * (dim + entries) * e) + batch * 8
        total += batch * heads * size * (band + seen + 1) * e + masks
    return total + (batch * count * e if reads_entries else 0)


def v4_attention_bytes(cfg: ModelConfig, index: int, tp: int, micro_batch: int, fmt: NumericFormat,
                       context: int = 1, rank: int = 0) -> int:
    """Bytes layer `index`'s attention saves for one micro-batch on TP rank and CP rank `rank` beyond its input
    norm's output (`cfg.seq_length` the rank's T tokens a row; the module docstring)."""
    kind, ratio = layer_kinds(cfg)[index], layer_ratios(cfg)[index]
    b, T, D, R, h = micro_batch, cfg.seq_length, cfg.head_dim, cfg.qk_rope_head_dim, cfg.hidden_size
    S = T * context
    N, heads, groups = b * T, cfg.num_heads // tp, cfg.output_groups // tp
    e, r_q, half = fmt.matmul_bytes, cfg.q_lora_rank, fmt.matmul_bytes != 4
    autocast = fmt.weight_cast_bytes
    W, others = S // ratio if ratio else 0, _entries_seen(cfg, index, S)
    halo = context > 1 and halo_gathers(cfg, index, T)
    K = sum(key_pieces(cfg, context, rank, T)) if halo else S  # the key positions it holds
    # q_a's output in fp32 and q_res; q_b's output, normalized per head (in half precision its fp32 copy and its
    # statistic in both dtypes); the rotated q; kv in fp32 and rotated; the rotated-back output's copy, o_b's input
    saved = N * (r_q * (4 + e) + 4 + heads * (D + 1) * (4 + (e if half else 0)) + heads * D * e)
    saved += b * K * (D * (4 + e) + 4) + N * (heads * D + groups * cfg.output_rank) * e
    saved += 2 * (2 * T + K) * R * 4  # cos and sin: the queries', the keys', the output's
    norms = r_q + D  # the widths its fp32 norms normalize
    # each span of positions a compressor pools at once: the whole row, or a halo rank's chunks (CSA's after the
    # first with the window before it)
    L = T // 2
    spans = [S] if not halo else [L + (ratio if kind == "csa" and j > 0 else 0)
                                  for j in (rank, 2 * context - 1 - rank)]
    if kind != "sliding":
        saved += sum(_compressor_bytes(b, span, ratio, D, kind == "csa", e, R) for span in spans)
        if kind == "hca":  # its kv, a view of the projections: the whole row's, or the rank's own (all P of them)
            saved += b * (T * key_projection_width(cfg, index) if halo else S * D) * e
        norms += D
    if kind == "csa" and cfg.index_loss_coeff > 0:  # the trained indexer, from detached inputs (no weight copies)
        heads_i, dim_i = cfg.index_heads, cfg.index_head_dim
        saved += sum(_compressor_bytes(b, span, ratio, dim_i, True, e, R) for span in spans) + 2 * T * R * 4
        norms += dim_i
        saved += (N * heads_i * (dim_i + 1) + b * W * dim_i) * 4  # its loss's gradients, taken in the forward
    if autocast:  # its weights' copies (its GEMMs share one copy of the input, which the Llama layer counts)
        width = (2 if kind == "csa" else 1) * D
        saved += autocast * (h * (r_q + D) + r_q * heads * D + cfg.output_rank * (heads * D + groups * h)
                             + (2 * width * h if kind != "sliding" else 0))
    if context > 1 and not halo:  # the gathered projections of every position (`key_inputs`): kept whole where a
        # view of them is saved, kv's norm input in fp32 or HCA's kv, in place of those views' bytes counted above
        views = (D if not half else 0) + (D if kind == "hca" else 0)
        saved += b * S * (key_projection_width(cfg, index) - views) * e if views else 0
    if fmt.weight_bytes != 4:  # half weights: the fp32 norms' copies of their weights
        saved += 4 * norms
    # the entries the core reads: a halo rank's are a view of the gathered entries and the indexer's
    entries = W * (D + (cfg.index_head_dim if halo and kind == "csa" else 0))
    chunks = core_chunks(b, heads, T, cfg.sliding_window, others)
    if chunks.recompute:  # its inputs: q, kv (counted above), the entries, the positions, the choice
        return saved + b * entries * e + T * 8 + (N * others * 8 if kind == "csa" else 0)
    return saved + _kept_core_bytes(cfg, kind, b, heads, _query_groups(S, context, rank, chunks), others, entries,
                                    ratio, e)


def _compressor_bytes(batch: int, positions: int, ratio: int, dim: int, overlap: bool, e: int, rope: int) -> int:
    """A `Compressor`'s saves over a span of `positions` (W = positions // m windows) beyond its input, its output
    entries and (HCA) its kv, a view of its input: CSA's overlapping windows' kv b W 2 m dim, its softmax gate
    b W m (1 + o) dim in fp32 (and in the GEMM dtype under half precision), its norm's fp32 input b W dim and
    statistic, the entries' cos and sin (fp32, W R each)."""
    width, entries = (2 if overlap else 1) * dim, positions // ratio
    gate = 4 + (e if e != 4 else 0)
    kv = entries * ratio * width * e if overlap else 0
    return batch * (kv + entries * (ratio * width * gate + dim * 4 + 4)) + 2 * entries * rope * 4


def key_pieces(cfg: ModelConfig, context: int, rank: int, tokens: int) -> list[int]:
    """The lengths of the key pieces a halo-gathering CP rank holds (`compressed_context.halo_sources`): each run of
    its chunks (`compressed_context.chunk_runs`) with the window - 1 positions before it."""
    from shardlm.models.compressed_context import chunk_runs

    chunk = tokens // 2
    return [min(cfg.sliding_window - 1, run[0] * chunk) + len(run) * chunk for run in chunk_runs(context, rank)]


def halo_gathers(cfg: ModelConfig, index: int, tokens: int) -> bool:
    """Whether a CP rank of `tokens` a row gathers layer `index`'s entries and halos
    (`compressed_context.holds_whole_windows`, plain rows)."""
    from shardlm.models.compressed_context import holds_whole_windows

    kind, ratio = layer_kinds(cfg)[index], layer_ratios(cfg)[index]
    return holds_whole_windows(tokens, cfg.sliding_window, ratio, kind == "csa")


def busiest_rank_bytes(cfg: ModelConfig, index: int, tp: int, micro_batch: int, fmt: NumericFormat,
                       context: int) -> int:
    """`v4_attention_bytes` of layer `index` on its busiest CP rank: ranks differ in the runs of their queries, which
    matter only where the core keeps its scores, and in CSA's first chunk (rank 0's has no window before it), so
    ranks 0 and 1 decide unless the core keeps them."""
    S = cfg.seq_length * context
    kept = not core_chunks(micro_batch, cfg.num_heads // tp, cfg.seq_length, cfg.sliding_window,
                           _entries_seen(cfg, index, S)).recompute
    return max(v4_attention_bytes(cfg, index, tp, micro_batch, fmt, context, rank)
               for rank in range(context if kept else min(context, 2)))


def _entries_seen(cfg: ModelConfig, index: int, row: int) -> int:
    """Entries a query of layer `index` scores beside its window in a row of `row` positions: none (sliding), every
    complete one (HCA's W), or its indexer's k (CSA)."""
    kind, ratio = layer_kinds(cfg)[index], layer_ratios(cfg)[index]
    W = row // ratio if ratio else 0
    return 0 if kind == "sliding" else W if kind == "hca" else min(cfg.index_topk, W)


def v4_moe_extra_bytes(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat,
                       sequence_parallel: bool) -> int:
    """What a DeepSeek-V4 MoE layer saves beyond `experts.moe_layer_activation_bytes`' SwiGLU MoE: the clip's inputs
    (`swiglu_clip`: gate and up before their clamps, in the GEMM dtype) of each routed (token, slot) row (2 f_e / t)
    and of the shared expert (2 f_s / t a token), and the sqrt-softplus scores' sum per routed token (fp32), which
    normalizes them into the balance loss's probabilities."""
    tokens = micro_batch * cfg.seq_length
    routed = tokens // tp if sequence_parallel and tp > 1 else tokens
    clip = 2 * (cfg.moe_top_k * cfg.moe_ffn_size + cfg.moe_shared_experts * cfg.shared_ffn_size) // tp
    return (tokens * clip * fmt.matmul_bytes if cfg.swiglu_clip > 0 else 0) + routed * 4


def v4_activation_change(cfg: ModelConfig, tp: int, micro_batch: int, fmt: NumericFormat, backend: str,
                         sequence_parallel: bool, context: int = 1) -> tuple[int, int]:
    """(bytes the largest DeepSeek-V4 layer saves beyond the Llama layer of its attention width and MoE
    (`activations.shardlm_memory`), the factor of its layer input): its attention (`v4_attention_bytes`) in place of
    the Llama attention's, the MoE's clip and score sum (`v4_moe_extra_bytes`) and the two hyper-connection branches
    (`deepseek_v4.hyper_connection_bytes`); the n streams (B, T, n, h) a layer takes instead of one residual (kept per
    layer under full recomputation)."""
    tokens = micro_batch * cfg.seq_length // (tp if sequence_parallel and tp > 1 else 1)
    llama = attention_activation_bytes(cfg, tp, micro_batch, fmt, backend)
    kinds = {kind: i for i, kind in reversed(list(enumerate(zip(layer_kinds(cfg), layer_ratios(cfg)))))}
    attention = max(busiest_rank_bytes(cfg, i, tp, micro_batch, fmt, context) for i in kinds.values())
    extra = (attention - llama + v4_moe_extra_bytes(cfg, tp, micro_batch, fmt, sequence_parallel)
             + 2 * hyper_connection_bytes(cfg, tokens, fmt.residual_bytes))
    return extra, cfg.hc_mult
