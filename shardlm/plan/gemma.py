"""The parameters one rank of Gemma 4's text model holds (`shardlm.models.gemma.Gemma4`, `sandwich_norms =
true`), layer by layer: its two kinds of attention (sliding and full, each with its own head size and KV heads,
no k, v or k_norm on the KV-sharing layers, no v on full layers with k = v), the twice-as-wide MLPs of the sharing
layers, the experts beside the MLP, the per-layer inputs and the layer scalars. `shardlm.plan.parameters` counts a
Gemma 4 config here."""

from __future__ import annotations

from shardlm.models.config import ModelConfig
from shardlm.models.gemma_config import FULL, kv_source, layer_kind, layer_shape
from shardlm.plan.parameters import ParameterCount, _kv_rows, _split, add_counts


def gemma_layer_count(cfg: ModelConfig, index: int, tp: int, ep: int = 1) -> ParameterCount:
    """Layer `index` on one (TP, EP) rank: q (H d_i x h) and o split, q_norm (d_i) replicated; unless it shares
    another layer's keys and values, k (and v, but on a full layer with k = v) split or replicated as in Llama and
    k_norm (d_i); the GeGLU's three matrices split (twice as wide on a sharing layer with `kv_shared_double_mlp`);
    four norms (h each) and the layer scalar replicated; with experts beside the MLP the router (E x h, h scales, E
    expert scales) and three more norms replicated, E / ep experts split over TP; with per-layer inputs the gate
    (d x h), the projection (h x d) and a norm (h), replicated."""
    h, shape = cfg.hidden_size, layer_shape(cfg, index)
    d = shape.attention_head_dim
    a_local = _split(cfg.num_heads * d, tp, "attention width")
    sharded, replicated, tensors, matrix = 2 * a_local * h, d + 4 * h + 1, 8, 2 * a_local * h
    if kv_source(cfg, index) is None:
        held, used = _kv_rows(shape, tp)
        projections = 1 if cfg.attention_k_eq_v and layer_kind(cfg, index) == FULL else 2
        split = held == used and shape.kv_heads % tp == 0
        sharded += projections * held * h if split else 0
        replicated += (0 if split else projections * held * h) + d
        tensors, matrix = tensors + projections + 1, matrix + projections * used * h
    wide = 2 if cfg.kv_shared_double_mlp and kv_source(cfg, index) is not None else 1
    f_local = _split(cfg.ffn_size * wide, tp, "ffn size")
    count = ParameterCount(sharded + 3 * f_local * h, replicated, tensors + 3, matrix + 3 * f_local * h)
    if cfg.moe_beside_mlp:
        experts = 3 * (cfg.moe_num_experts // ep) * _split(cfg.moe_ffn_size, tp, "expert ffn size") * h
        router = cfg.moe_num_experts * h + h + cfg.moe_num_experts
        count = add_counts(count, ParameterCount(experts, router + 3 * h, 9, experts, experts))
    if cfg.per_layer_input_size:
        count = add_counts(count, ParameterCount(0, 2 * cfg.per_layer_input_size * h + h, 3, 0))
    return count


def gemma_parameter_count(cfg: ModelConfig, tp: int, ep: int = 1) -> ParameterCount:
    """Every layer (`gemma_layer_count`) and the ends: the word embedding (and an untied output layer) split by
    vocabulary rows, the final norm; with per-layer inputs their table (vocab x L d, split by rows, unpadded), its
    projection (L d x h) and norm (d) replicated."""
    h = cfg.hidden_size
    vocab_local = _split(cfg.padded_vocab_size(tp), tp, "padded vocabulary")
    outputs = 1 if cfg.tie_embeddings else 2
    total = ParameterCount(outputs * vocab_local * h, h, 1 + outputs, 0)
    if cfg.per_layer_input_size:
        width = cfg.num_layers * cfg.per_layer_input_size
        table = _split(cfg.per_layer_vocab_size or cfg.vocab_size, tp, "per-layer vocabulary") * width
        total = add_counts(total, ParameterCount(table, width * h + cfg.per_layer_input_size, 3, 0))
    for index in range(cfg.num_layers):
        total = add_counts(total, gemma_layer_count(cfg, index, tp, ep))
    return total


def gemma_pipeline_problem(cfg: ModelConfig, pp: int) -> str | None:
    """Why Gemma 4 cannot run on `pp` pipeline stages: never (None). A stage hands the keys and values its producers
    share with layers of later stages, and the per-layer inputs the first stage makes, on beside the hidden state
    (`Gemma4.stage_handoff`). The plan's pipeline traffic counts the hidden state only: the handed tensors are not
    in it yet (gemma-4-e4b's per-layer inputs alone are 42 x 256 values a token, four times its hidden state)."""
    return None
