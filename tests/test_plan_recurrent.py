"""`shardlm plan` counts Kimi Linear (Kimi Delta Attention beside MLA) and Nemotron-H (Mamba-2, attention, MLP and
MoE blocks): parameters, FLOPs, recurrent state and what a layer saves for its backward (`shardlm.plan.recurrent`).

The presets' totals equal what transformers builds from the published configs on the meta device; the FLOPs are
the matmuls torch's FLOP counter sees the tiny models run (plus the triangular solves it does not count); the state
is what decoding keeps; the activation bytes are what autograd saves on the CPU in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlm.models.config import ModelConfig
from shardlm.plan.flops import flops_per_token
from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.recurrent import (
    KDA_BLOCK,
    KDA_CHUNK,
    kda_layer_activation_bytes,
    kda_rule_flops_per_token,
    kda_state_bytes,
    kda_weights,
    mamba_block_activation_bytes,
    mamba_state_bytes,
    mamba_weights,
    recurrent_parameter_count,
    ssd_flops_per_token,
)

FULL = (4, 8, 12, 16, 20, 24, 27)
# The published config.json values (their model ids in shardlm/plan/models.py), as transformers reads them
HF_CONFIGS = {
    "kimi-linear-48b-a3b": ("kimi_linear", dict(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=27, num_attention_heads=32,
        num_key_value_heads=32, head_dim=72, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, hidden_act="silu", first_k_dense_replace=1,
        moe_layer_freq=1, num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
        moe_renormalize=True, moe_router_activation_func="sigmoid", num_expert_group=1, topk_group=1,
        routed_scaling_factor=2.446, rms_norm_eps=1e-5, model_max_length=1048576, tie_word_embeddings=False,
        linear_attn_config={"full_attn_layers": list(FULL), "kda_layers": [i for i in range(1, 28) if i not in FULL],
                            "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4})),
    "nemotron-h-8b": ("nemotron_h", dict(
        vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=52,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
        conv_kernel=4, chunk_size=128, use_conv_bias=True, mamba_proj_bias=False, tie_word_embeddings=False,
        layer_norm_epsilon=1e-5, max_position_embeddings=8192)),
    "nemotron-3-nano-30b-a3b": ("nemotron_h", dict(
        vocab_size=131072, hidden_size=2688, intermediate_size=1856, num_hidden_layers=52,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
        conv_kernel=4, chunk_size=128, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False, layer_norm_epsilon=1e-5,
        max_position_embeddings=262144)),
}
BILLIONS = {"kimi-linear-48b-a3b": 49.12, "nemotron-h-8b": 8.10, "nemotron-3-nano-30b-a3b": 31.58}


def hf_config(kind: str, values: dict):
    if kind == "kimi_linear":
        from transformers import KimiLinearConfig as Config
    else:
        from transformers import NemotronHConfig as Config
    return Config(**values)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_presets_count_what_transformers_builds(name):
    """The planner's total at TP = 1 equals transformers' model built on the meta device from the published shape
    (49.12B, 8.10B and 31.58B), with the score-correction biases transformers holds as buffers and shardlm as
    parameters."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(*HF_CONFIGS[name]))
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    expected = sum(p.numel() for p in model.parameters()) + biases
    assert recurrent_parameter_count(MODEL_PRESETS[name], 1).total == expected
    assert expected == pytest.approx(BILLIONS[name] * 1e9, rel=1e-3)
    cfg = MODEL_PRESETS[name]
    if cfg.moe_num_experts:  # the activated count skips E - k of each MoE layer's routed experts, as transformers
        # stacks them (Kimi's SwiGLU: gate, up, down; Nemotron's ReLU^2: up, down)
        from shardlm.plan.experts import activated_parameter_count, moe_layer_count

        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        per_expert = routed // (moe_layer_count(cfg) * cfg.moe_num_experts)
        skipped = moe_layer_count(cfg) * (cfg.moe_num_experts - cfg.moe_top_k) * per_expert
        assert activated_parameter_count(cfg) == expected - skipped


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_presets_are_what_the_converter_reads_from_the_published_config(name):
    """The Hugging Face conversion (`model_config_from_hf`) reads the preset's shape from the same config.json; the
    presets train on shorter sequences than the published windows (and leave the attention dropout unset: the
    model's dropout, 0)."""
    kind, values = HF_CONFIGS[name]
    if kind == "kimi_linear":
        from shardlm.checkpoint.hf_kimi_linear import model_config_from_hf
    else:
        from shardlm.checkpoint.hf_nemotron_h import model_config_from_hf
    preset = MODEL_PRESETS[name]
    read = model_config_from_hf({"model_type": kind, **values})
    assert dataclasses.replace(read, seq_length=preset.seq_length, attention_dropout=-1.0) == preset


def tiny_kimi(**changes) -> ModelConfig:
    """Kimi Linear at test size: a KDA layer (4 heads of 8) with a dense SwiGLU, then an MLA (NoPE) layer with an MoE
    of 4 experts and a shared one."""
    base = dict(arch="llama", attention="mla", mla_nope=True, num_layers=2, hidden_size=32, num_heads=4,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, seq_length=128,
                vocab_size=512, ffn_hidden_size=48, dropout=0.0, layer_types=["linear_attention", "full_attention"],
                linear_attention_rule="kimi_delta", linear_num_key_heads=4, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, moe_num_experts=4, moe_top_k=2,
                moe_ffn_hidden_size=16, moe_first_dense_layers=1, moe_shared_experts=1, moe_score="sigmoid",
                moe_expert_bias=True)
    return ModelConfig(**{**base, **changes})


def tiny_nemotron(**changes) -> ModelConfig:
    """Nemotron-H at test size: Mamba-2 (4 heads of 8, 2 groups of 16, chunks of 32), attention (4 heads, 2 KV
    heads), a ReLU^2 MLP and an MoE layer of 4 experts and a shared one of its own width."""
    base = dict(arch="llama", num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, seq_length=128,
                vocab_size=512, ffn_hidden_size=48, dropout=0.0, layer_pattern="M*-E", mamba_num_heads=4,
                mamba_head_dim=8, mamba_state_size=16, mamba_groups=2, mamba_chunk_size=32, moe_num_experts=4,
                moe_top_k=2, moe_ffn_hidden_size=16, moe_shared_experts=1, moe_shared_ffn_hidden_size=24,
                moe_score="sigmoid", moe_expert_bias=True)
    return ModelConfig(**{**base, **changes})


def built(cfg: ModelConfig, **kwargs):
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    return build_model(cfg, ParallelContext.single(), seed=0, **kwargs)


@pytest.mark.parametrize("make", [tiny_kimi, tiny_nemotron])
def test_parameter_count_is_the_built_models(make):
    """Elements and tensors of `build_model` at TP = 1; at TP = 2 the shards and the replicated weights add up to
    the same total, and EP = 2 holds half the experts."""
    cfg = make()
    params = list(built(cfg).parameters())
    count = recurrent_parameter_count(cfg, 1)
    assert count.total == sum(p.numel() for p in params) and count.tensors == len(params)
    halves = recurrent_parameter_count(cfg, 2)
    assert 2 * halves.sharded + halves.replicated == count.total
    experts = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    assert count.expert == experts and count.total - recurrent_parameter_count(cfg, 1, ep=2).total == experts // 2


def solves(cfg: ModelConfig, tokens: int) -> int:
    """The KDA rule's two unit-triangular solves (U and W) per chunk and head, C^2 per right-hand column, d columns
    each; torch's FLOP counter does not count triangular solves."""
    return cfg.linear_num_value_heads * (tokens // KDA_CHUNK) * KDA_CHUNK ** 2 * 2 * cfg.linear_key_head_dim


def counted(module, *inputs) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(*inputs)
    return counter.get_total_flops()


def test_mixer_flops_are_the_matmuls_each_layer_runs():
    """One KDA layer's and one Mamba-2 layer's forward, counted by torch's FLOP counter, is 2 FLOPs per weight of
    their projections (the low-rank gates included) plus the chunked rule's and scan's matmuls per token."""
    from shardlm.models.delta_rule import CHUNK
    from shardlm.models.kda_rule import BLOCK
    from shardlm.models.kimi_delta import KimiDeltaAttention
    from shardlm.models.mamba import Mamba2
    from shardlm.parallel import ParallelContext

    assert (KDA_CHUNK, KDA_BLOCK) == (CHUNK, BLOCK)
    ctx, tokens = ParallelContext.single(), 2 * 128
    kimi, nemotron = tiny_kimi(), tiny_nemotron()
    x = torch.randn(2, 128, 32)
    kda = counted(KimiDeltaAttention(kimi, ctx, 0, "kda"), x)
    assert kda + solves(kimi, tokens) == (2 * kda_weights(kimi) + kda_rule_flops_per_token(kimi)) * tokens
    mamba = counted(Mamba2(nemotron, ctx, 0, "mamba"), x)
    assert mamba == (2 * mamba_weights(nemotron) + ssd_flops_per_token(nemotron)) * tokens
    # counting a KDA layer as Gated DeltaNet (no low-rank gates), the scan at chunks of 64 or its C B^T per head
    # (B and C repeated to the heads) would fail
    H, d = kimi.linear_num_value_heads, kimi.linear_key_head_dim
    assert kda_rule_flops_per_token(kimi) == H * (8 * 64 * d + 6 * d * d)
    H, G, P, N, L = 4, 2, 8, 16, 32
    assert ssd_flops_per_token(nemotron) == 2 * L * N * G + H * (2 * L * P + 4 * P * N)


@pytest.mark.parametrize("make", [tiny_kimi, tiny_nemotron])
def test_flops_per_token_is_what_the_model_runs(make):
    """A whole model's forward (KDA and MLA layers, dense and MoE; or Mamba-2, attention, MLP and MoE blocks, by
    `layer_pattern`), counted by torch's FLOP counter (attention as its score and value products over every key,
    the routed experts as the rows they get), is a third of `flops_per_token` per token; doubling the sequence
    adds only the attention layers' 4 s a (MLA: 2 s H (qk + v))."""
    cfg = make()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = built(cfg).eval()
    for module in model.modules():  # the experts' GEMMs one by one, over the routed rows only (what it counts)
        if hasattr(module, "pad_rows"):
            module.grouped, module.pad_rows = False, 0
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH):  # attention as matmuls the counter sees (the CPU's fused kernel it does not)
        seen = counted(model, tokens)
    kda_layers = sum(cfg.is_linear_layer(i) for i in range(cfg.num_layers))
    assert seen + kda_layers * solves(cfg, tokens.numel()) == flops_per_token(cfg) / 3 * tokens.numel()
    longer = flops_per_token(dataclasses.replace(cfg, seq_length=2 * cfg.seq_length)) - flops_per_token(cfg)
    if cfg.layer_pattern:
        attention = 4 * cfg.num_heads * cfg.head_dim * cfg.layer_pattern.count("*")
    else:
        attention = 2 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) \
            * (cfg.num_layers - kda_layers)
    assert longer == 3 * attention * cfg.seq_length


@pytest.mark.parametrize("make", [tiny_kimi, tiny_nemotron])
def test_recurrent_state_is_what_decoding_keeps(make):
    """Per sequence and recurrent layer: the fp32 state (KDA: H x d x d; Mamba-2: H x P x N) and the convolution's
    last kernel - 1 inputs, as the decoding cache holds them, whatever the length. Nemotron-H-8B: 4 MiB of state a
    Mamba-2 layer; Kimi Linear: 2 MiB a KDA layer."""
    cfg = make()
    model = built(cfg).eval()
    cache = model.new_kv_cache(64)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (3, 40)), cache=cache)
    layer = cache.layers[0]
    state = mamba_state_bytes if cfg.layer_pattern else kda_state_bytes
    assert layer.state.nbytes + layer.conv.nbytes == 3 * state(cfg, 1, layer.conv.element_size())
    assert mamba_state_bytes(MODEL_PRESETS["nemotron-h-8b"], 1, 2) == 128 * 64 * 128 * 4 + 3 * (8192 + 2048) * 2
    assert kda_state_bytes(MODEL_PRESETS["kimi-linear-48b-a3b"], 2, 2) == 16 * 128 * 128 * 4 + 3 * 3 * 2048 * 2


def saved_by_layer(model, forward) -> dict[int, int]:
    """`tests/test_plan_linear_attention.saved_by_layer`: bytes autograd holds for the backward, by layer."""
    from test_plan_linear_attention import saved_by_layer as measure

    return measure(model, forward)


@pytest.mark.parametrize("make,precision,batch,seq,recompute", [
    (tiny_kimi, "fp32", 1, 64, "none"), (tiny_kimi, "fp32", 2, 192, "none"), (tiny_kimi, "fp32", 1, 128, "selective"),
    (tiny_kimi, "bf16", 1, 64, "none"), (tiny_kimi, "bf16", 1, 128, "none"), (tiny_kimi, "bf16", 2, 192, "none"),
    (tiny_kimi, "bf16", 2, 128, "selective"),
    (tiny_nemotron, "fp32", 1, 32, "none"), (tiny_nemotron, "fp32", 2, 96, "none"),
    (tiny_nemotron, "fp32", 1, 128, "selective"), (tiny_nemotron, "bf16", 1, 32, "none"),
    (tiny_nemotron, "bf16", 1, 96, "none"), (tiny_nemotron, "bf16", 2, 96, "none"),
    (tiny_nemotron, "bf16", 1, 128, "selective"),
])
def test_layer_activation_bytes_equal_what_autograd_saves(make, precision, batch, seq, recompute):
    """On the CPU, in fp32 and under bf16 autocast, what a KDA layer (with its dense SwiGLU) and a Mamba-2 block keep
    for the backward equals the planner's bytes, one chunk or several, one sequence or several (the rule's and
    scan's batched products then copy each chunk), and with the core recomputed (selective)."""
    from shardlm.plan.measure import autocast_context
    from shardlm.plan.memory import numeric_format

    cfg = make(seq_length=seq)
    model = built(cfg, recompute=recompute).train()
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    saved = saved_by_layer(model, forward)
    planned = kda_layer_activation_bytes if cfg.layer_types else mamba_block_activation_bytes
    assert saved[0] == planned(cfg, 1, batch, numeric_format(precision), "cpu", recompute == "selective")


@pytest.mark.parametrize("precision,recompute", [("fp32", "none"), ("bf16", "selective")])
def test_nemotron_blocks_save_what_the_planner_counts(precision, recompute):
    """Nemotron-H's Mamba-2, attention (no RoPE: no cos and sin) and ReLU^2 MLP blocks keep for the backward what
    `pattern_block_activation_bytes` counts, on the CPU, with the cores recomputed (selective) too; MoE blocks are
    not modelled and say so."""
    from shardlm.plan.measure import autocast_context
    from shardlm.plan.memory import numeric_format
    from shardlm.plan.recurrent import pattern_block_activation_bytes

    cfg = tiny_nemotron(seq_length=96, num_layers=3, layer_pattern="M*-", moe_num_experts=0)
    model = built(cfg, recompute=recompute).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))

    def forward():
        with autocast_context(precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    saved, fmt = saved_by_layer(model, forward), numeric_format(precision)
    planned = [pattern_block_activation_bytes(cfg, i, 1, 2, fmt, "cpu", recompute == "selective") for i in range(3)]
    assert [saved[i] for i in range(3)] == planned
    with pytest.raises(ValueError, match="MoE blocks"):
        pattern_block_activation_bytes(tiny_nemotron(), 3, 1, 2, fmt)


def test_the_planner_counts_the_presets():
    """The planner's layer shares and a plan for each preset on 64 H100s: the K/V ring runs in the attention layers
    only (7 of Kimi Linear's 27, 4 of Nemotron-H-8B's 52, 6 of Nemotron 3 Nano's 52), and the model FLOPs are
    `flops_per_token`'s."""
    from shardlm.plan.evaluate import Evaluator
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.linear_attention import attention_layer_share
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.planner import PlanRequest
    from shardlm.plan.timing import Layout

    shares = {"kimi-linear-48b-a3b": 7 / 27, "nemotron-h-8b": 4 / 52, "nemotron-3-nano-30b-a3b": 6 / 52}
    for name, share in shares.items():
        cfg = MODEL_PRESETS[name]
        assert attention_layer_share(cfg) == share
        request = PlanRequest(PlannedModel(name, cfg), gpu_preset("h100"), 64, 256)
        choice = Evaluator(request).choice(Layout(tp=2, dp=32, micro_batch=1, checkpointing=False))
        padded = dataclasses.replace(cfg, vocab_size=cfg.padded_vocab_size(2))
        assert choice.time.model_flops == pytest.approx(flops_per_token(padded) * 256 * cfg.seq_length, rel=1e-12)


def preset_choice(name: str, **layout):
    """The planner's row for the preset on 64 H100s, global batch 256, at `layout` (`timing.Layout`'s fields)."""
    from shardlm.plan.evaluate import Evaluator
    from shardlm.plan.hardware import gpu_preset
    from shardlm.plan.models import PlannedModel
    from shardlm.plan.planner import PlanRequest
    from shardlm.plan.timing import Layout

    request = PlanRequest(PlannedModel(name, MODEL_PRESETS[name]), gpu_preset("h100"), 64, 256)
    return Evaluator(request).choice(Layout(**{"tp": 2, "dp": 32, "micro_batch": 1, "checkpointing": False, **layout}))


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_the_plan_holds_the_presets_parameters(name):
    """`parameter_count` is `recurrent_parameter_count` (the total transformers builds: 49.12B, 8.10B, 31.58B), the
    plan's row holds a TP rank's of it, and at PP = 2 the two stages' (every Nemotron-H block by its own kind)
    add up to it, as do the layers one by one with the end pieces."""
    from shardlm.plan.parameters import ParameterCount, add_counts, layers_parameter_count, parameter_count
    from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages

    cfg = MODEL_PRESETS[name]
    assert parameter_count(cfg, 1) == recurrent_parameter_count(cfg, 1)
    assert parameter_count(cfg, 1).total == pytest.approx(BILLIONS[name] * 1e9, rel=1e-3)
    ep = 4 if cfg.moe_num_experts else 1
    whole = recurrent_parameter_count(cfg, 2, ep)
    assert parameter_count(cfg, 2, ep) == whole
    assert preset_choice(name, ep=ep).state.parameters == 4 * whole.total  # fp32 weights (shardlm-bf16)
    layers = pipeline_layers(cfg.num_layers, 2, 1)
    stages = [rank_parameter_count(cfg, 2, rank_stages(layers, 2, rank), ep) for rank in range(2)]
    assert add_counts(*stages) == whole
    ends = add_counts(whole, layers_parameter_count(cfg, range(cfg.num_layers), 2, ep), sign=-1)
    assert ends == ParameterCount(2 * cfg.padded_vocab_size(2) // 2 * cfg.hidden_size, cfg.hidden_size, 3, 0)


@pytest.mark.parametrize("recompute,sp", [("none", False), ("selective", True)])
def test_the_plan_charges_the_recurrent_layers_activations(recompute, sp):
    """The plan's row charges every layer the largest of the model's layer kinds: Nemotron-H-8B's Mamba-2,
    attention or MLP block (`pattern_block_activation_bytes`), Kimi Linear's KDA layer
    (`kda_layer_activation_bytes`) beside its MLA layer (its MoE layers' extra over a dense MLP added to both), with
    each norm's input and statistic split over TP under sequence parallelism; Nemotron 3 Nano's MoE blocks by the
    estimate `moe_block_activation_bytes`."""
    from shardlm.plan.activations import LayerSetting, shardlm_memory
    from shardlm.plan.memory import layer_activation_bytes, numeric_format
    from shardlm.plan.recurrent import moe_block_activation_bytes, pattern_block_activation_bytes

    fmt, selective, tokens = numeric_format("bf16"), recompute == "selective", 4096
    setting = LayerSetting(sequence_parallel=sp, recompute=recompute)

    def split_off(norms: int, cfg: ModelConfig) -> int:
        nbytes = norms * (tokens * cfg.hidden_size * 4 + tokens * 4)  # RMSNorm: one fp32 statistic a token
        return nbytes - nbytes // 2 if sp else 0

    nemotron = dataclasses.replace(MODEL_PRESETS["nemotron-h-8b"], seq_length=tokens)
    blocks = [pattern_block_activation_bytes(nemotron, i, 2, 1, fmt, "cuda", selective) for i in (0, 1, 7)]
    assert nemotron.layer_pattern[0] + nemotron.layer_pattern[1] + nemotron.layer_pattern[7] == "M-*"
    row = preset_choice("nemotron-h-8b", sequence_parallel=sp, selective=selective, cp=2, dp=16)
    assert row.activations.per_layer == max(blocks) - split_off(1, nemotron)
    nano = dataclasses.replace(MODEL_PRESETS["nemotron-3-nano-30b-a3b"], seq_length=tokens)
    moe = moe_block_activation_bytes(nano, 2, 4, 1, fmt, sp)
    largest = max(moe, *(pattern_block_activation_bytes(nano, i, 2, 1, fmt, "cuda", selective) for i in (0, 5)))
    assert shardlm_memory(nano, 2, 1, fmt, setting, ep=4).per_layer == largest - split_off(1, nano)
    dense_kimi = dataclasses.replace(MODEL_PRESETS["kimi-linear-48b-a3b"], moe_num_experts=0)
    kda = kda_layer_activation_bytes(dense_kimi, 2, 1, fmt, "cuda", selective) - split_off(2, dense_kimi)
    mla = shardlm_memory(dataclasses.replace(dense_kimi, layer_types=[]), 2, 1, fmt, setting).per_layer
    assert kda > mla and shardlm_memory(dense_kimi, 2, 1, fmt, setting).per_layer == kda
    kimi = MODEL_PRESETS["kimi-linear-48b-a3b"]
    moe_extra = shardlm_memory(dataclasses.replace(kimi, layer_types=[]), 2, 1, fmt, setting, ep=4).per_layer - mla
    assert moe_extra > 0 and preset_choice("kimi-linear-48b-a3b", sequence_parallel=sp, selective=selective,
                                           ep=4).activations.per_layer == kda + moe_extra
    assert layer_activation_bytes(nemotron, 2, 1, fmt) != row.activations.per_layer


def test_pipeline_stages_and_selective_recomputation_count_the_recurrent_flops():
    """DualPipe's stages count each Nemotron-H block's own mixer (`pattern_layer_flops`: the stages' FLOPs make
    `flops_per_token`), and selective recomputation adds each Mamba-2 block's scan again and the attention blocks'
    cores (4 s a per token), not a core in every block."""
    from shardlm.plan.dualpipe import stage_flops
    from shardlm.plan.recurrent import mamba_layer_count, pattern_layer_flops

    for name in ("nemotron-h-8b", "nemotron-3-nano-30b-a3b"):
        cfg = MODEL_PRESETS[name]
        half = cfg.num_layers // 2
        stages = stage_flops(cfg, list(range(half)), False) + stage_flops(cfg, list(range(half, cfg.num_layers)), True)
        assert 3 * stages == pytest.approx(flops_per_token(cfg), rel=1e-12)
        assert stage_flops(cfg, [0], False) == pattern_layer_flops(cfg, 0)
    cfg = MODEL_PRESETS["nemotron-h-8b"]
    plain = preset_choice("nemotron-h-8b").time.model_flops
    again = preset_choice("nemotron-h-8b", selective=True).time.model_flops - plain
    s, a = cfg.seq_length, cfg.num_heads * cfg.attention_head_dim
    rerun = 256 * s * (mamba_layer_count(cfg) * ssd_flops_per_token(cfg) + 4 * cfg.layer_pattern.count("*") * s * a)
    assert again == pytest.approx(rerun, rel=1e-12)


def test_shardlm_plan_plans_the_presets(capsys):
    """`shardlm plan --model <preset> --gpu h100 --gpus 64 --global-batch 256` exits 0 for each preset and reports
    the preset's total and a recommended layout that fits (the search narrowed to PP = 2 without CP, micro-batches
    of 1 and ZeRO-1, to keep the test short: the whole search takes about 10 s a preset)."""
    from shardlm.cli import main

    narrowed = ["--pipeline", "2", "--context", "1", "--micro-batch", "1", "--data-sharding", "optimizer"]
    for name in HF_CONFIGS:
        experts = ["--expert", "8"] if MODEL_PRESETS[name].moe_num_experts else []
        args = ["plan", "--model", name, "--gpu", "h100", "--gpus", "64", "--global-batch", "256"]
        assert main(args + narrowed + experts) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"{BILLIONS[name]:.3g}B parameters" in out and "Recommended: PP=2 x " in out
        recommended = out.split("Recommended: ")[1]
        assert float(recommended.split(" GB per GPU")[0].split()[-1]) < 80
        from shardlm.plan.recurrent import MOE_BLOCK_NOTE  # said where the MoE blocks' activations are estimated

        assert (" ".join(MOE_BLOCK_NOTE.split()) in out) == ("E" in MODEL_PRESETS[name].layer_pattern), name
