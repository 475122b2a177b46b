"""LoRA and QLoRA in the planner (a config's `[lora]` with rank > 0, `shardlm.lora`): what a rank holds when only
adapters train on a frozen base, derived from what `shardlm.lora.apply.add_adapters` and `quantize_base` build
(its bytes: `shardlm.plan.lora_memory`).

- adapters (`layer_projections`, `adapter_count`): each targeted projection of shape (out, in) gets A (r, in) and B
  (out, r), split as the projection is: a column-parallel one (q, k, v, gate, up, qkv, fc, q_b, kv_b) splits B's
  rows, a row-parallel one (o, down, proj) A's columns; replicated projections (MLA's q_a and kv_a, k and v when
  TP does not divide the KV heads) keep both whole. With `"experts"` each routed expert of the rank's E / EP gets
  A_in (r, h), B_gate and B_up (f / t, r), A_down (r, f / t), B_down (h, r) (GPT's experts: A_in, B_fc, A_proj,
  B_proj), five (four) stacks a layer. "all-linear" is every attention and MLP projection, not the experts;
- trainable (`LoraCount.trainable`): the adapters and `modules_to_save` (the word embedding, the untied output
  layer, the final norm, on the stages that hold them);
- frozen: everything else, in fp32 (`BASE_BYTES`): shardlm builds the model in fp32 and `train.param_dtype =
  "half"` moves only the trainable parameters into its half buffer; but under bf16 or fp16 autocast (`half_base`)
  the weights QLoRA would store in NF4 are stored in half instead (`HALF_BYTES`, `shardlm.lora.apply.store_base_in`);
- QLoRA (`quantize = "nf4"`): every projection weight of the transformer layers (targeted or not, each routed
  expert's matrices too) in NF4 (`shardlm.lora.nf4`), quantized whole: a weight that stays whole on a rank costs
  `nf4.quantized_bytes` (4 bits a value, a statistics byte per block of 64, 4 bytes per 256 blocks and a 4-byte
  offset: 4.127 bits a weight); a TP shard keeps the blocks its values lie in, 33 bytes each, and the whole
  matrix's second-level maxima and offset (`nf4_rank_bytes`). The multi-token-prediction depths (on the last
  stage, no adapters) store their layer's projections and experts so too. The embedding, the output layer, norms,
  routers, a Gated DeltaNet layer's z, b and a and a depth's eh_proj (DeepSeek-V4's e_proj and h_proj) stay in fp32;
- the dequantized working copy (`LoraCount.layer_quantized`): a layer's NF4 weights dequantized to fp32 (the
  weights' dtype) while it computes, counted once for the rank's largest layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.config import LoraConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig
from shardlm.plan.parameters import (
    ParameterCount,
    _split,
    add_counts,
    layer_parameter_count,
    parameter_count,
    parameter_kind,
)

BASE_BYTES = 4
"""The frozen base's (and the dequantized NF4 weights') bytes an element: the model is built in fp32."""
HALF_BYTES = 2
"""A frozen projection weight's bytes under bf16 or fp16 autocast."""
NF4_BLOCK, NF4_STATS_BLOCK = 64, 256
"""`shardlm.lora.nf4.BLOCK`, `STATS_BLOCK`: values a block, blocks a second-level block."""
KINDS = ("column", "row", "replicated", "replicated rows")


@dataclass(frozen=True)
class Projection:
    """One projection of a layer as `shardlm.lora.apply` sees it: shardlm's module name, the whole (TP = 1) weight
    (rows = out, cols = in), how TP splits it (`KINDS`, `shardlm.lora.adapter`), and for routed experts the E / EP
    stack of such matrices on the rank (`copies`)."""

    name: str
    rows: int
    cols: int
    kind: str
    copies: int = 1
    expert: bool = False

    def local_shape(self, tp: int) -> tuple[int, int]:
        """(rows, cols) of one matrix on a TP rank."""
        if self.kind == "column":
            return _split(self.rows, tp, f"{self.name}'s rows"), self.cols
        if self.kind == "row":
            return self.rows, _split(self.cols, tp, f"{self.name}'s columns")
        return self.rows, self.cols

    def elements(self, tp: int) -> int:
        rows, cols = self.local_shape(tp)
        return self.copies * rows * cols

    def tp_dim(self) -> int | None:
        """The dimension TP splits (0 rows, 1 columns), None for a replicated weight."""
        return {"column": 0, "row": 1}.get(self.kind)


def _attention(cfg: ModelConfig, tp: int, linear: bool) -> list[Projection]:
    """A layer's attention projections (the shapes `parameters._full_attention_count`, `_mla_count`,
    `_linear_attention_count` and `deepseek_v4._attention_count` count). A Gated DeltaNet layer's z, b and a, and
    DeepSeek-V4's replicated q_a, kv, compressors and indexer, are no adapter targets and stay fp32."""
    from shardlm.models.llama import kv_heads_are_split

    h = cfg.hidden_size
    if cfg.arch != "llama":
        return [Projection("qkv", 3 * h, h, "column"), Projection("proj", h, h, "row")]
    if cfg.hc_mult:  # DeepSeek-V4's compressed attention: q_b, the grouped o_a (one block per group), o_b
        width, groups = cfg.num_heads * cfg.head_dim, cfg.output_groups * cfg.output_rank
        return [Projection("q_b", width, cfg.q_lora_rank, "column"),
                Projection("o_a", groups, width // cfg.output_groups, "column"), Projection("o_b", h, groups, "row")]
    if linear:
        keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        values = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return [Projection("q", keys, h, "column"), Projection("k", keys, h, "column"),
                Projection("v", values, h, "column"), Projection("o", h, values, "row")]
    if cfg.attention == "mla":
        heads, rope, q_rank, kv_rank = cfg.num_heads, cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + rope
        queries = ([Projection("q_a", q_rank, h, "replicated"), Projection("q_b", heads * qk, q_rank, "column")]
                   if q_rank else [Projection("q", heads * qk, h, "column")])
        return queries + [Projection("kv_a", kv_rank + rope, h, "replicated"),
                          Projection("kv_b", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv_rank, "column"),
                          Projection("o", h, heads * cfg.v_head_dim, "row")]
    width = cfg.num_heads * cfg.attention_head_dim
    kv_kind = "column" if kv_heads_are_split(cfg.kv_heads, tp) else "replicated rows"
    kv = cfg.kv_heads * cfg.attention_head_dim
    return [Projection("q", width * (2 if cfg.attention_output_gate else 1), h, "column"),
            Projection("k", kv, h, kv_kind), Projection("v", kv, h, kv_kind), Projection("o", h, width, "row")]


def _mlp(cfg: ModelConfig, index: int, ep: int) -> list[Projection]:
    """A layer's MLP projections: dense (gate, up, down; GPT's fc, proj), or an MoE layer's shared experts' MLP
    and its E / EP routed experts' stacks (`expert`)."""
    h, gated = cfg.hidden_size, cfg.arch == "llama"

    def dense(width: int, copies: int = 1, expert: bool = False) -> list[Projection]:
        names = ("gate", "up", "down") if gated else ("fc", "proj")
        return [Projection(name, width, h, "column", copies, expert) for name in names[:-1]] + \
            [Projection(names[-1], h, width, "row", copies, expert)]

    if not cfg.is_moe_layer(index):
        return dense(cfg.ffn_size)
    experts = dense(cfg.moe_ffn_size, cfg.moe_num_experts // ep, expert=True)
    return experts + (dense(cfg.shared_ffn_size) if cfg.moe_shared_experts else [])


def _block(cfg: ModelConfig, index: int, tp: int, ep: int) -> list[Projection]:
    """A Nemotron-H block's projections (`model.layer_pattern`, one mixer a block): a Mamba-2 mixer's output
    projection "out" (its z, x, B, C and dt, rows of transformers' fused in_proj, are no adapter targets and stay fp32),
    the attention's q, k, v and o, a ReLU^2 MLP's up and down, or an MoE block's routed experts' fc and proj stacks
    and its shared expert's up and down."""
    from shardlm.plan.recurrent import layer_kind

    h, kind = cfg.hidden_size, layer_kind(cfg, index)
    if kind == "M":  # lora.targets' "out" (out_proj)
        return [Projection("out", h, cfg.mamba_num_heads * cfg.mamba_head_dim, "row")]
    if kind == "*":
        return _attention(cfg, tp, False)

    def relu_squared(width: int, names=("up", "down"), copies: int = 1, expert: bool = False) -> list[Projection]:
        return [Projection(names[0], width, h, "column", copies, expert),
                Projection(names[1], h, width, "row", copies, expert)]

    if kind != "E":
        return relu_squared(cfg.ffn_size)
    experts = relu_squared(cfg.moe_ffn_size, ("fc", "proj"), cfg.moe_num_experts // ep, expert=True)
    return experts + (relu_squared(cfg.shared_ffn_size) if cfg.moe_shared_experts else [])


def layer_projections(cfg: ModelConfig, index: int, tp: int, ep: int = 1) -> list[Projection]:
    """Layer `index`'s projections on one (TP, EP) rank: those an adapter can go on and the routed experts'
    stacks, all of which QLoRA stores in NF4 (not the router, a Gated DeltaNet layer's z, b, a, a Mamba-2 layer's
    in_proj rows)."""
    if cfg.layer_pattern:
        return _block(cfg, index, tp, ep)
    return _attention(cfg, tp, cfg.is_linear_layer(index)) + _mlp(cfg, index, ep)


def adapter_count(projection: Projection, rank: int, tp: int) -> ParameterCount:
    """The adapter of `projection` on one TP rank (`shardlm.lora.adapter.LoRA`, `shardlm.lora.experts.ExpertLoRA`):
    sharded = the split factor's elements, replicated = the whole one's. A routed experts' MLP, given as its
    first projection (gate or fc), has E_l x (A_in (r, h), B per input projection (f / t, r), A_down (r, f / t),
    B_down (h, r)) in 5 (GPT: 4) stacks, all of them `expert` elements."""
    if projection.expert:
        raise ValueError("routed experts' adapters are counted per MLP: use `expert_adapter_count`")
    rows, cols = projection.local_shape(tp)
    a, b = rank * cols, rows * rank
    if projection.kind == "column":
        return ParameterCount(b, a, 2, 0)
    if projection.kind == "row":
        return ParameterCount(a, b, 2, 0)
    return ParameterCount(0, a + b, 2, 0)


def expert_adapter_count(cfg: ModelConfig, rank: int, tp: int, ep: int) -> ParameterCount:
    """One MoE layer's expert adapters on a (TP, EP) rank (`shardlm.lora.experts.ExpertLoRA`)."""
    h, local = cfg.hidden_size, cfg.moe_num_experts // ep
    f_local = _split(cfg.moe_ffn_size, tp, "expert ffn size")
    inputs = 2 if cfg.arch == "llama" and not cfg.layer_pattern else 1  # gated (Nemotron-H's: ReLU^2)
    per_expert = rank * h + inputs * f_local * rank + rank * f_local + h * rank
    elements = local * per_expert
    return ParameterCount(elements, 0, inputs + 3, 0, elements)


def _kept_blocks(rows: int, cols: int, dim: int, tp: int, rank: int) -> int:
    """Blocks of 64 (row-major, over the whole (rows, cols) matrix) that TP rank `rank`'s slice touches
    (`shardlm.lora.nf4.Shard.blocks`): a block straddling two ranks' slices is kept by both."""
    if dim == 0:
        lo, hi = rank * rows // tp * cols, (rank + 1) * rows // tp * cols
        return -(-hi // NF4_BLOCK) - lo // NF4_BLOCK
    c0, c1 = rank * cols // tp, (rank + 1) * cols // tp
    if cols % NF4_BLOCK == 0 and c0 % NF4_BLOCK == 0 and c1 % NF4_BLOCK == 0:
        return rows * (c1 - c0) // NF4_BLOCK
    kept, last = 0, -1
    for row in range(rows):  # ascending: a block shared with the previous row's slice counts once
        first, end = (row * cols + c0) // NF4_BLOCK, (row * cols + c1 - 1) // NF4_BLOCK
        kept += end - max(first, last + 1) + 1
        last = end
    return kept


def nf4_rank_bytes(rows: int, cols: int, dim: int | None, tp: int, rank: int = 0) -> int:
    """Bytes TP rank `rank` keeps of one whole (rows, cols) weight stored in NF4: `nf4.quantized_bytes` of it when
    the rank holds it whole (dim None or TP = 1); of a shard split along `dim`, its blocks (32 bytes of codes and a
    statistics byte each) and the whole matrix's second-level maxima (4 bytes per 256 blocks) and offset (4)."""
    import torch

    from shardlm.lora.nf4 import quantized_bytes

    if dim is None or tp == 1:
        return quantized_bytes(torch.Size((rows, cols)))
    blocks = -(-rows * cols // NF4_BLOCK)
    return _kept_blocks(rows, cols, dim, tp, rank) * (NF4_BLOCK // 2 + 1) + 4 * -(-blocks // NF4_STATS_BLOCK) + 4


@dataclass(frozen=True)
class LayerLora:
    """One layer on one (TP, EP) rank under `[lora]`."""

    elements: int
    """Its base parameters (`parameters.layer_parameter_count`)."""
    matrix: int
    """Elements of its GEMM weights (autocast casts them)."""
    adapters: ParameterCount
    quantized: int = 0
    """Elements of its weights stored in NF4 (0 without QLoRA)."""
    quantized_expert: int = 0
    """Routed experts' elements among `quantized`."""
    nf4_bytes: int = 0
    nf4_expert_bytes: int = 0
    halved: int = 0
    """Elements of its weights stored in half (LoRA under autocast: the ones QLoRA stores in NF4)."""
    halved_expert: int = 0
    """Routed experts' elements among `halved`."""


def experts_adapted(lora: LoraConfig, index: int) -> bool:
    """Whether layer `index`'s experts get adapters where "experts" is a target (`lora.expert_layers`)."""
    return not lora.expert_layers or index in lora.expert_layers


def layer_lora(cfg: ModelConfig, lora: LoraConfig, index: int, tp: int, ep: int = 1,
               half_base: bool = False) -> LayerLora:
    """Layer `index` on TP rank 0 of EP rank 0 (`LayerLora`); `half_base`: under bf16 or fp16 autocast."""
    from shardlm.lora.apply import target_names

    wanted = target_names(lora)
    base = layer_parameter_count(cfg, index, tp, ep)
    adapters = ParameterCount(0, 0, 0, 0)
    quantized = quantized_expert = nf4 = nf4_expert = halved = halved_expert = 0
    for p in layer_projections(cfg, index, tp, ep):
        if p.expert and p.name in ("gate", "fc") and "experts" in wanted and experts_adapted(lora, index):
            adapters = add_counts(adapters, expert_adapter_count(cfg, lora.rank, tp, ep))
        elif not p.expert and p.name in wanted:
            adapters = add_counts(adapters, adapter_count(p, lora.rank, tp))
        if lora.quantize:
            nbytes = p.copies * nf4_rank_bytes(p.rows, p.cols, p.tp_dim(), tp)
            quantized, nf4 = quantized + p.elements(tp), nf4 + nbytes
            if p.expert:
                quantized_expert, nf4_expert = quantized_expert + p.elements(tp), nf4_expert + nbytes
        elif half_base:
            halved += p.elements(tp)
            halved_expert += p.elements(tp) if p.expert else 0
    return LayerLora(base.total, base.matrix, adapters, quantized, quantized_expert, nf4, nf4_expert, halved,
                     halved_expert)


def saved_modules_count(cfg: ModelConfig, lora: LoraConfig, tp: int, first: bool = True,
                        last: bool = True) -> ParameterCount:
    """`lora.modules_to_save` on a TP rank holding the first and/or last stage: "embedding" the word embedding
    (V_padded / t x h; on the last stage too when the output layer is tied to it, or for the multi-token-prediction
    depths, once where one rank holds both ends), "output" the untied output layer (V_padded / t x h), "norm" the
    final norm (h; GPT's LayerNorm 2 h)."""
    h = cfg.hidden_size
    vocab = cfg.padded_vocab_size(tp) // tp * h
    names = {"embed_tokens": "embedding", "lm_head": "output"}
    saved = {names.get(n, n) for n in lora.modules_to_save}
    total = ParameterCount(0, 0, 0, 0)
    tied = cfg.arch == "gpt" or cfg.tie_embeddings
    if "embedding" in saved and (first or (last and (tied or cfg.mtp_layers))):
        total = add_counts(total, ParameterCount(vocab, 0, 1, 0))
    if "output" in saved and last and not tied:
        total = add_counts(total, ParameterCount(vocab, 0, 1, 0))
    if "norm" in saved and last:
        total = add_counts(total, ParameterCount(0, 2 * h, 2, 0) if cfg.arch == "gpt" else ParameterCount(0, h, 1, 0))
    return total


@dataclass(frozen=True)
class LoraCount:
    """What one (pipeline, TP, EP) rank holds under `[lora]` (module docstring)."""

    trainable: ParameterCount
    """Adapters and `modules_to_save`: the parameters with gradients and optimizer state."""
    adapters: int
    """Adapter elements among `trainable`."""
    frozen: int
    """Base elements kept in fp32 (not trained, not in NF4, not in half)."""
    frozen_expert: int
    """Routed experts' elements among `frozen` (their biases; with fp32 LoRA their weights too)."""
    quantized: int
    """Base elements stored in NF4."""
    nf4_bytes: int
    nf4_expert_bytes: int
    """Routed experts' bytes among `nf4_bytes`."""
    layer_quantized: int
    """NF4 elements of the rank's largest layer: its dequantized working copy, in fp32."""
    gathered_layer: tuple[int, int, int]
    """FSDP's largest gathered layer: (its other float elements, the bytes of its NF4 tensors and half projection
    weights, which gather as they are stored, its trainable elements)."""
    root_trainable: int
    """Trainable elements outside the layers (`modules_to_save`)."""
    root_frozen: int
    """Frozen fp32 elements outside the layers (FSDP's root unit and the multi-token-prediction depths)."""
    root_nf4_bytes: int = 0
    """NF4 bytes outside the layers: the multi-token-prediction depths' projections and experts under QLoRA."""
    halved: int = 0
    """Base elements stored in half (LoRA under autocast, `half_base`), the depths' included."""
    halved_expert: int = 0
    """Routed experts' elements among `halved`."""
    root_halved: int = 0
    """Elements of `halved` outside the layers (the multi-token-prediction depths')."""

    @property
    def bits_per_weight(self) -> float:
        """The NF4 base's bits a weight (0 without QLoRA)."""
        return 8 * self.nf4_bytes / self.quantized if self.quantized else 0.0

    def base_bytes(self) -> int:
        """The frozen base on this rank, unsharded: fp32 elements, half elements and NF4 tensors."""
        return BASE_BYTES * self.frozen + HALF_BYTES * self.halved + self.nf4_bytes


def projection_names(cfg: ModelConfig) -> set[str]:
    """The lora.targets names of the projections this model's layers have ("experts": its MoE experts)."""
    found = {p.name for i in range(cfg.num_layers) for p in layer_projections(cfg, i, 1) if not p.expert}
    return found | ({"experts"} if cfg.moe_num_experts else set())


def check_lora_model(cfg: ModelConfig, lora: LoraConfig) -> None:
    """The [lora] keys against this model, as a training run checks them (`shardlm.validation`); UserError."""
    from shardlm.lora.apply import check_lora, target_names

    check_lora(lora)
    if cfg.arch == "bert":
        raise UserError("[lora] adapts GPT and Llama-family (MLA included) models; this model is BERT")
    found = projection_names(cfg)
    if "all-linear" not in lora.targets and "all_linear" not in lora.targets:
        missing = sorted(target_names(lora) - found)
        if missing:
            raise UserError(f"lora.targets names {', '.join(missing)}, which this {cfg.arch} model does not have; "
                            f"its projections are {', '.join(sorted(found))} (or \"all-linear\")")
    if "output" in lora.modules_to_save and (cfg.arch == "gpt" or cfg.tie_embeddings):
        raise UserError('lora.modules_to_save names "output", but this model ties its output layer to the '
                        'embedding; name "embedding"')


def lora_count(cfg: ModelConfig, lora: LoraConfig, tp: int, indices=None, first: bool = True, last: bool = True,
               ep: int = 1, held: ParameterCount | None = None, half_base: bool = False) -> LoraCount:
    """`LoraCount` of the rank holding layers `indices` (default all) and the first / last stage's end pieces, at
    (TP, EP); `held`: its base parameters (default the whole model's, `parameters.parameter_count`); `half_base`:
    under bf16 or fp16 autocast (`NumericFormat.half_gemms`), the projection weights stored in half."""
    indices = range(cfg.num_layers) if indices is None else indices
    held = parameter_count(cfg, tp, ep) if held is None else held
    kinds: dict[tuple, LayerLora] = {}
    adapters = ParameterCount(0, 0, 0, 0)
    half_base = half_base and not lora.quantize
    quantized = quantized_expert = nf4 = nf4_expert = layer_elements = halved = halved_expert = 0
    for index in indices:
        if index >= cfg.num_layers:  # a multi-token-prediction depth: outside `layers.`, with the last stage's below
            continue
        # layers alike in what they hold (`parameter_kind`: GLM-5's "shared" layers run no indexer, ...) and in whether
        # their experts are adapted
        key = (experts_adapted(lora, index), *parameter_kind(cfg, index))
        if key not in kinds:
            kinds[key] = layer_lora(cfg, lora, index, tp, ep, half_base)
        layer = kinds[key]
        adapters, layer_elements = add_counts(adapters, layer.adapters), layer_elements + layer.elements
        quantized, quantized_expert = quantized + layer.quantized, quantized_expert + layer.quantized_expert
        nf4, nf4_expert = nf4 + layer.nf4_bytes, nf4_expert + layer.nf4_expert_bytes
        halved, halved_expert = halved + layer.halved, halved_expert + layer.halved_expert
    layers = list(kinds.values())
    root_quantized = root_nf4 = root_halved = largest = 0
    for index in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers) if last and (lora.quantize or half_base) \
            else ():
        depth = layer_lora(cfg, lora, index, tp, ep, half_base)  # its NF4 or half only: a depth takes no adapters
        root_quantized, root_nf4 = root_quantized + depth.quantized, root_nf4 + depth.nf4_bytes
        quantized, quantized_expert = quantized + depth.quantized, quantized_expert + depth.quantized_expert
        nf4, nf4_expert = nf4 + depth.nf4_bytes, nf4_expert + depth.nf4_expert_bytes
        root_halved, halved, halved_expert = root_halved + depth.halved, halved + depth.halved, \
            halved_expert + depth.halved_expert
        largest = max(largest, depth.quantized)
    saved = saved_modules_count(cfg, lora, tp, first, last)
    frozen = held.total - saved.total - quantized - halved
    gathered = max(((k.elements - k.quantized - k.halved + k.adapters.total, k.nf4_bytes + HALF_BYTES * k.halved,
                     k.adapters.total) for k in layers), key=lambda g: BASE_BYTES * g[0] + g[1], default=(0, 0, 0))
    return LoraCount(trainable=add_counts(adapters, saved), adapters=adapters.total, frozen=frozen,
                     frozen_expert=held.expert - quantized_expert - halved_expert, quantized=quantized, nf4_bytes=nf4,
                     nf4_expert_bytes=nf4_expert, layer_quantized=max([k.quantized for k in layers] + [largest]),
                     gathered_layer=gathered, root_trainable=saved.total,
                     root_frozen=held.total - layer_elements - saved.total - root_quantized - root_halved,
                     root_nf4_bytes=root_nf4, halved=halved, halved_expert=halved_expert, root_halved=root_halved)
