"""`shardlm plan` counts the hybrid linear-attention models (Qwen3-Next, Qwen3.5): parameters, FLOPs and memory.

The presets' totals equal what transformers builds from the published configs (on the meta device; like
transformers, the presets leave out the multi-token-prediction layer, and Qwen3.5's vision tower), their activated
parameters the total less the routed experts a token skips; a Gated DeltaNet layer's FLOPs grow linearly in the
sequence, not as attention's s^2, and what its backward keeps is what autograd saves.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from shardlm.models.config import ModelConfig
from shardlm.plan.experts import activated_parameter_count
from shardlm.plan.flops import flops_per_token
from shardlm.plan.linear_attention import (
    CHUNK,
    linear_activation_bytes,
    linear_weights,
    recurrent_state_bytes,
    rule_flops_per_token,
)
from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.parameters import parameter_count

LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2
# The published config.json values (text_config for Qwen3.5), with their sources in shardlm/plan/models.py
HF_CONFIGS = {
    "qwen3-next-80b-a3b": ("qwen3_next", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        intermediate_size=5120, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=151936, tie_word_embeddings=False,
        full_attention_interval=4, max_position_embeddings=262144, partial_rotary_factor=0.25)),
    "qwen3.5-27b": ("qwen3_5_text", dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, tie_word_embeddings=False,
        full_attention_interval=4, max_position_embeddings=262144, partial_rotary_factor=0.25)),
    "qwen3.5-35b-a3b": ("qwen3_5_moe_text", dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, vocab_size=248320, tie_word_embeddings=False, full_attention_interval=4,
        max_position_embeddings=262144, partial_rotary_factor=0.25)),
    "qwen3.5-397b-a17b": ("qwen3_5_moe_text", dict(
        hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024, vocab_size=248320, tie_word_embeddings=False, full_attention_interval=4,
        max_position_embeddings=262144, partial_rotary_factor=0.25)),
}
PUBLISHED_BILLIONS = {"qwen3-next-80b-a3b": 80, "qwen3.5-27b": 27, "qwen3.5-35b-a3b": 35, "qwen3.5-397b-a17b": 397}


def transformers_model(kind: str, config: dict):
    if kind == "qwen3_next":
        from transformers.models.qwen3_next import Qwen3NextConfig as Config
        from transformers.models.qwen3_next import Qwen3NextForCausalLM as Model
    elif kind == "qwen3_5_text":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM as Model
        from transformers.models.qwen3_5 import Qwen3_5TextConfig as Config
    else:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as Model
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig as Config
    with torch.device("meta"):
        return Model(Config(**config))


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_presets_count_what_transformers_builds(name):
    """The planner's total at TP=1 equals transformers' model built from the published shape (79.7B, 26.9B,
    34.7B and 396.3B: the published names round up, and count the MTP layer and Qwen3.5's vision tower); the
    activated parameters are that total less, in each MoE layer, the experts a token does not visit (Qwen3-Next:
    3.87B, 10 of 512 experts and the gated shared one)."""
    kind, hf = HF_CONFIGS[name]
    model = transformers_model(kind, hf)
    expected = sum(p.numel() for p in model.parameters())
    cfg = MODEL_PRESETS[name]
    assert parameter_count(cfg, 1).total == expected
    assert expected == pytest.approx(PUBLISHED_BILLIONS[name] * 1e9, rel=0.015)
    assert sum(cfg.is_linear_layer(i) for i in range(cfg.num_layers)) == 3 * cfg.num_layers // 4
    if "num_experts" not in hf:
        assert activated_parameter_count(cfg) == expected
        return
    moe_layers = [layer.mlp for layer in model.model.layers]
    per_expert = sum(p.numel() for p in moe_layers[0].experts.parameters()) // hf["num_experts"]
    skipped = hf["num_experts"] - hf["num_experts_per_tok"]
    assert activated_parameter_count(cfg) == expected - len(moe_layers) * skipped * per_expert


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_presets_are_what_the_converter_reads_from_the_published_config(name):
    """`model_config_from_hf` (the Hugging Face conversion) reads the same shape from the same config.json."""
    from shardlm.checkpoint.hf_qwen3_next import model_config_from_hf

    kind, hf = HF_CONFIGS[name]
    read = model_config_from_hf({"model_type": kind, **hf})
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith(("linear_", "moe_num", "moe_top",
                                                                                   "moe_ffn", "moe_shared"))]
    fields += ["num_layers", "hidden_size", "num_heads", "num_kv_heads", "attention_head_dim", "ffn_size", "qk_norm",
               "attention_output_gate", "norm_zero_centered", "rope_fraction", "tie_embeddings", "vocab_size"]
    preset = MODEL_PRESETS[name]
    assert {f: getattr(preset, f) for f in fields} == {f: getattr(read, f) for f in fields}
    assert [preset.is_linear_layer(i) for i in range(preset.num_layers)] == \
        [read.is_linear_layer(i) for i in range(read.num_layers)]


def tiny(**changes) -> ModelConfig:
    """A hybrid model at test size: three linear layers before a gated full-attention one, twice; two value heads
    per key head; a routed MoE with a gated shared expert of its own width."""
    base = dict(arch="llama", num_layers=8, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                seq_length=128, vocab_size=100, ffn_hidden_size=48, dropout=0.0, layer_types=LAYER_TYPES,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                attention_output_gate=True, norm_zero_centered=True, rope_fraction=0.5, moe_num_experts=4,
                moe_top_k=2, moe_ffn_hidden_size=24, moe_shared_experts=1, moe_shared_ffn_hidden_size=40,
                moe_shared_expert_gate=True)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("mtp_layers", [0, 1])
def test_parameter_count_is_the_built_models(mtp_layers):
    """Elements and tensors of `build_model` at TP=1 (linear layers, gated attention, the gated shared expert of its
    own width, and a multi-token-prediction depth, which is a full-attention layer); the shards of TP=2 and the
    experts of EP=2 split as the heads and experts do."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    cfg = tiny(num_layers=4, layer_types=LAYER_TYPES[:4], mtp_layers=mtp_layers, vocab_size=256)  # padded alike
    params = list(build_model(cfg, ParallelContext.single(), seed=1).parameters())
    count = parameter_count(cfg, 1)
    assert count.total == sum(p.numel() for p in params) and count.tensors == len(params)
    halves = parameter_count(cfg, 2)
    assert 2 * halves.sharded + halves.replicated == count.total
    experts = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    assert count.total - parameter_count(cfg, 1, ep=2).total == experts // 2


def test_linear_layer_flops_grow_linearly_in_the_sequence():
    """Per token, a full-attention layer's FLOPs grow with the keys it attends to (4 s a forward) and a linear
    layer's do not: from s = 128 to 4096 only the two full layers add 3 x 4 a (4096 - 128). The all-linear model's
    per-token FLOPs stay the same, and a linear layer costs its projections and the rule's 5 C d_k + 3 C d_v +
    6 d_k d_v per value head (counting the linear layers as attention would fail all three)."""
    cfg = tiny()
    a = cfg.num_heads * cfg.head_dim
    short, long = flops_per_token(cfg), flops_per_token(dataclasses.replace(cfg, seq_length=4096))
    assert long - short == 3 * 4 * a * (4096 - 128) * 2
    linear = tiny(layer_types=["linear_attention"])
    assert flops_per_token(linear) == flops_per_token(dataclasses.replace(linear, seq_length=4096))
    one_more = flops_per_token(dataclasses.replace(linear, num_layers=9)) - flops_per_token(linear)
    # top-2 experts and the shared one (SwiGLU: 3 matrices each), the router (4 experts) and the shared expert's gate
    moe = 3 * (2 * cfg.moe_ffn_size + 40) * cfg.hidden_size + cfg.hidden_size * (4 + 1)
    assert one_more == 3 * (2 * linear_weights(cfg) + rule_flops_per_token(cfg) + 2 * moe)
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    assert rule_flops_per_token(cfg) == nv * (5 * 64 * dk + 3 * 64 * dv + 6 * dk * dv)


def test_rule_flops_are_the_chunked_rules_matmuls_and_solves():
    """The rule's count is what `chunk_gated_delta_rule` runs: its batched matmuls as torch's FLOP counter counts
    them, and the two unit-triangular solves per chunk (C^2 per right-hand column, d_k + d_v columns)."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardlm.models.delta_rule import CHUNK as RULE_CHUNK
    from shardlm.models.delta_rule import chunk_gated_delta_rule

    assert CHUNK == RULE_CHUNK
    cfg, tokens = tiny(), 256
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q, k = torch.randn(1, nv, tokens, dk), torch.randn(1, nv, tokens, dk)
    with FlopCounterMode(display=False) as counter:
        chunk_gated_delta_rule(q, k, torch.randn(1, nv, tokens, dv), -torch.rand(1, nv, tokens),
                               torch.rand(1, nv, tokens))
    solves = nv * (tokens // CHUNK) * CHUNK * CHUNK * (dk + dv)
    assert counter.get_total_flops() + solves == rule_flops_per_token(cfg) * tokens


def test_dualpipe_stages_count_the_linear_layers_as_flops_per_token_does():
    """The stages' forward FLOPs (layers, head, the MTP depth) sum to a third of `flops_per_token`."""
    from shardlm.plan.dualpipe import stage_flops
    from shardlm.plan.stages import pipeline_layers

    cfg = tiny(mtp_layers=1)
    stages = pipeline_layers(cfg.num_layers, 4, 1)
    total = sum(stage_flops(cfg, stage, s == len(stages) - 1) for s, stage in enumerate(stages))
    assert 3 * total == pytest.approx(flops_per_token(cfg), rel=1e-12)


def saved_by_layer(model, forward) -> dict[int, int]:
    """Bytes autograd holds for the backward after `forward()`, by layer: each storage once, parameters excluded, and
    only those still alive (the rule drops its end state, and with it what only that state's graph saved)."""
    layers = list(model.layers.values())
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live, current = {}, [None]

    def pack(tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameters and pointer not in live and storage.nbytes() > 0:
            live[pointer] = (current[0], storage.nbytes())
            weakref.finalize(storage, live.pop, pointer, None)
        return tensor

    hooks = [hook for i, layer in enumerate(layers) for hook in (
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i)),
        layer.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None)))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    for hook in hooks:
        hook.remove()
    result: dict[int, int] = {}
    for layer, nbytes in live.values():
        result[layer] = result.get(layer, 0) + nbytes
    del output
    return result


@pytest.mark.parametrize("precision,batch,seq,recompute,moe", [
    ("fp32", 1, 128, "none", False), ("fp32", 2, 192, "none", True), ("fp32", 2, 128, "selective", False),
    ("bf16", 2, 128, "none", False), ("bf16", 1, 192, "selective", True),
])
def test_linear_layer_activation_bytes_equal_what_autograd_saves(precision, batch, seq, recompute, moe):
    """On the CPU, what a Gated DeltaNet layer and a gated full-attention layer keep for the backward equals
    the planner's per-layer bytes of each kind (`activations.shardlm_memory` of an all-linear and an all-full model),
    MoE layers with the gated shared expert included, with the core recomputed (selective) too. Under bf16
    autocast a norm's input GEMMs (GDN: six; attention: q, k and v; the SwiGLU's gate and up) share one copy of its
    output (`decoder.autocast_copies`), which the planner counts."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext
    from shardlm.plan.activations import LayerSetting, shardlm_memory
    from shardlm.plan.measure import autocast_context
    from shardlm.plan.memory import numeric_format

    cfg = tiny(num_layers=2, layer_types=["linear_attention", "full_attention"], seq_length=seq,
               **({} if moe else dict(moe_num_experts=0)))
    model = build_model(cfg, ParallelContext.single(), seed=0, recompute=recompute)
    for module in model.modules():  # the formula counts the routed rows (bf16 on the CPU pads them)
        if hasattr(module, "pad_rows"):
            module.pad_rows = 0
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    saved = saved_by_layer(model.train(), forward)
    fmt, setting = numeric_format(precision), LayerSetting(recompute=recompute)
    for index, kind in enumerate(["linear_attention", "full_attention"]):
        planned = shardlm_memory(dataclasses.replace(cfg, layer_types=[kind]), 1, batch, fmt, setting, backend="cpu")
        assert saved[index] == planned.per_layer


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("changes", [dict(head_dim=12), dict(head_dim=12, qk_norm=True),
                                     dict(head_dim=12, qk_norm=True, attention_output_gate=True),
                                     dict(qk_norm=True, attention_output_gate=True, norm_zero_centered=True)])
def test_full_attention_layer_activation_bytes_equal_what_autograd_saves(precision, changes):
    """The full-attention layers of these models: heads wider than h / heads (a != h), q/k norms (in fp32 under
    autocast), the output gate (sigmoid and the gated output), zero-centred norms; on the CPU what autograd
    keeps equals `memory.layer_activation_bytes`."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext
    from shardlm.plan.measure import autocast_context
    from shardlm.plan.memory import layer_activation_bytes, numeric_format

    cfg = ModelConfig(**{**dict(arch="llama", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2,
                                seq_length=64, vocab_size=100, ffn_hidden_size=48, dropout=0.0), **changes})
    model = build_model(cfg, ParallelContext.single(), seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    fmt = numeric_format(precision)
    assert saved_by_layer(model, forward)[0] == layer_activation_bytes(cfg, 1, 2, fmt, backend="cpu")


def test_hybrid_layers_are_charged_the_larger_kind_and_selective_recomputation_shrinks_the_linear_ones():
    """Qwen3-Next at s = 4096 in bf16: a linear layer keeps several times what a full layer's attention keeps (the
    rule's C-wide products per token and head), so every layer is charged a linear layer's bytes; recomputing the
    core keeps only its inputs."""
    from shardlm.plan.activations import LayerSetting, shardlm_memory
    from shardlm.plan.memory import attention_activation_bytes, numeric_format

    cfg, fmt = MODEL_PRESETS["qwen3-next-80b-a3b"], numeric_format("bf16", "shardlm")
    linear, attention = linear_activation_bytes(cfg, 1, 1, fmt), attention_activation_bytes(cfg, 1, 1, fmt)
    assert linear > 4 * attention
    plain = shardlm_memory(cfg, 1, 1, fmt, LayerSetting(), ep=8).per_layer
    full_only = shardlm_memory(dataclasses.replace(cfg, layer_types=[]), 1, 1, fmt, LayerSetting(), ep=8).per_layer
    assert plain - full_only == linear - attention
    selective = shardlm_memory(cfg, 1, 1, fmt, LayerSetting(recompute="selective"), ep=8).per_layer
    assert plain - selective == linear - linear_activation_bytes(cfg, 1, 1, fmt, selective=True)


def test_recurrent_state_is_what_decoding_keeps_per_linear_layer():
    """Per sequence and linear layer: the fp32 state (value heads x d_k x d_v) and the convolution's last
    kernel - 1 inputs, as the decoding cache holds them, whatever the length; Qwen3-Next: 2 MiB of state a layer."""
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    cfg = tiny(num_layers=4, layer_types=LAYER_TYPES[:4], moe_num_experts=0)
    model = build_model(cfg, ParallelContext.single(), seed=0).eval()
    cache = model.new_kv_cache(64)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (3, 40)), cache=cache)
    for index in range(3):
        layer = cache.layers[index]
        held = layer.state.nbytes + layer.conv.nbytes
        assert held == 3 * recurrent_state_bytes(cfg, 1, layer.conv.element_size())
    next_80b = MODEL_PRESETS["qwen3-next-80b-a3b"]
    assert recurrent_state_bytes(next_80b, 1, 2) == 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2


def _choice(cfg: ModelConfig, layout):
    """The planner's evaluation of one layout of `cfg` on 64 H100s, 256 sequences a step."""
    from shardlm.plan.evaluate import Evaluator
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.planner import PlanRequest

    return Evaluator(PlanRequest(PlannedModel("qwen3.5-27b", cfg), gpu_preset("h100"), 64, 256)).choice(layout)


def test_step_time_rings_and_recomputes_only_what_each_layer_kind_has():
    """Qwen3.5-27B at 32,768 tokens, TP 8 x CP 8, selective recomputation: the K/V ring runs in the 16 full-attention
    layers only (1/4 of the same model with full attention everywhere), and the recomputed cores add the
    recurrence of the 48 linear layers, not their attention; the TP traffic is the same, the memory less than
    without recomputation."""
    from shardlm.plan.linear_attention import linear_layer_count
    from shardlm.plan.timing import Layout

    cfg = dataclasses.replace(MODEL_PRESETS["qwen3.5-27b"], seq_length=32768)
    full = dataclasses.replace(cfg, layer_types=[])
    layout = Layout(tp=8, dp=1, micro_batch=1, checkpointing=False, cp=8, selective=True, sequence_parallel=True)
    hybrid, dense = _choice(cfg, layout), _choice(full, layout)
    assert hybrid.time.cp_ring_s == pytest.approx(dense.time.cp_ring_s / 4, rel=1e-12)
    assert hybrid.time.tp_comm_s == dense.time.tp_comm_s
    plain = _choice(cfg, dataclasses.replace(layout, selective=False))
    again = hybrid.time.model_flops - plain.time.model_flops
    s = cfg.seq_length
    attention = 4 * 256 * s * s * cfg.hidden_size * cfg.num_layers / 4  # `timing`'s 4 b s^2 h, full layers only
    assert again == attention + 256 * s * rule_flops_per_token(cfg) * linear_layer_count(cfg)
    assert hybrid.total_bytes < plain.total_bytes


def test_planner_refuses_what_it_cannot_count_for_linear_attention():
    """Megatron's activation formulas have no Gated DeltaNet layer; a TP size must divide the linear heads."""
    from shardlm.errors import UserError
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.planner import PlanRequest, invalid_reason, plan

    cfg = MODEL_PRESETS["qwen3.5-27b"]
    request = PlanRequest(PlannedModel("qwen3.5-27b", cfg), gpu_preset("h100"), 48, 48)
    with pytest.raises(UserError, match="no activation model for linear-attention"):
        plan(dataclasses.replace(request, implementation="megatron-core"))
    assert invalid_reason(request, 8) is None
    fewer = dataclasses.replace(request, model=PlannedModel("fewer heads", dataclasses.replace(
        cfg, linear_num_key_heads=4, linear_num_value_heads=12)))
    assert invalid_reason(fewer, 8) == "linear-attention heads (4 key, 12 value) are not divisible by TP=8"
