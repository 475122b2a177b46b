"""DeepSeek-V3's stack in the planner, piece by piece: DualPipe's two stages a rank (`plan.dualpipe`), the FP8
storage and the casts around the FP8 GEMMs (`plan.fp8`), the values padded for the attention kernel and the BF16
moments (`plan.kernels`). The run they add up to is checked in `test_plan_deepseek.py`."""

import dataclasses

import pytest

from shardlm.models.config import ModelConfig
from shardlm.plan import dualpipe
from shardlm.plan.deepseek import DEEPSEEK_V3_TRAINED, as_run, request
from shardlm.plan.evaluate import Evaluator
from shardlm.plan.flops import flops_per_token
from shardlm.plan.fp8 import E5M6_BYTES, FP8_BYTES, cast_bytes_per_token, fp8_layer_bytes
from shardlm.plan.kernels import DEEPSEEK_KERNELS
from shardlm.plan.memory import state_memory
from shardlm.plan.parameters import parameter_count
from shardlm.plan.stages import pipeline_layers, rank_parameter_count

pytestmark = pytest.mark.timeout(120)


def test_a_rank_holds_its_stage_and_the_mirror_stage():
    """DualPipe's example.py: rank r holds stage r and stage P - 1 - r; the first rank holds the embedding and
    the head; in flight P - r forwards of the first and r + 1 of the second, P + 1 in all (the README's PP + 1),
    each capped at its direction's half of the micro-batches."""
    layers = pipeline_layers(61, 16, 1)
    first, middle = dualpipe.rank_stages(layers, 16, 0), dualpipe.rank_stages(layers, 16, 5)
    assert first.layer_indices == (*layers[0], *layers[15]) and first.first and first.last
    assert middle.layer_indices == (*layers[5], *layers[10]) and not (middle.first or middle.last)
    assert list(dualpipe.mirrored_ranks(16)) == list(range(8)) and list(dualpipe.mirrored_ranks(5)) == [0, 1, 2]
    for rank in range(8):
        chunks = dualpipe.forwards_in_flight(16, 120, rank)
        assert (chunks.count(0), chunks.count(1)) == (16 - rank, rank + 1)
    assert dualpipe.forwards_in_flight(16, 6, 0) == [0, 0, 0, 1]  # 3 micro-batches a direction


def test_two_copies_of_the_parameters_with_one_shared_embedding():
    """Over all ranks DualPipe holds each parameter twice (the README's 2x); the MTP depth needs no embedding copy
    where the head and the embedding share a rank (the report, 3.2.3): rank 0's pair holds the whole model's end
    pieces once."""
    cfg, tp, ep = DEEPSEEK_V3_TRAINED, 1, 64
    layers = pipeline_layers(cfg.num_layers, 16, 1)
    pairs = [rank_parameter_count(cfg, tp, dualpipe.rank_stages(layers, 16, r), ep) for r in range(8)]
    assert sum(p.total for p in pairs) == parameter_count(cfg, tp, ep).total  # ranks 8-15 mirror ranks 0-7


def test_stage_flops_add_up_to_the_model_count_and_set_the_pace():
    """The stages' forward FLOPs (layers, heads, depth) sum to a third of `flops_per_token` (training = 3x
    forward); the busiest pair is rank 0's (3 dense layers and the embedding; 4 MoE layers, the depth and two
    heads), 1.31 times the average stage, with 4 layers a micro-batch."""
    cfg = DEEPSEEK_V3_TRAINED
    layers = pipeline_layers(cfg.num_layers, 16, 1)
    flops = [dualpipe.stage_flops(cfg, stage, s == 15) for s, stage in enumerate(layers)]
    assert 3 * sum(flops) == pytest.approx(flops_per_token(cfg), rel=1e-12)
    pace_layers, moe_layers, imbalance = dualpipe.pace(cfg, 16)
    assert imbalance == pytest.approx((flops[0] + flops[15]) / 2 / (sum(flops) / 16), rel=1e-12)
    assert imbalance == pytest.approx(1.312, abs=5e-4)
    assert (pace_layers, moe_layers) == (4, 3)  # (3 + 4 + 1) / 2 layers, (0 + 4 + 1) / 2 MoE, rounded up


def test_fp8_layer_bytes_of_deepseek_v3():
    """Per token of an MoE layer at TP 1: the two residuals and MLA's latents in BF16, the attention output in
    E5M6 with its fp32 log-sum-exp, the router's 256 fp32 scores, each of the 8 routed rows' FP8 input and SwiGLU
    input and the shared expert's SwiGLU input, scales included; under SP the sequence-split parts divide by t;
    full recomputation keeps the layer input."""
    cfg, tokens = DEEPSEEK_V3_TRAINED, 4096
    per_token = (2 * 2 * 7168 + 2 * (1536 + 512 + 64) + 128 * 128 * E5M6_BYTES + 4 * 128 + 4 * 256
                 + 8 * (7168 + 2 * 2048) * FP8_BYTES + 2 * 2048 * FP8_BYTES)
    assert fp8_layer_bytes(cfg, 1, 1, False, "none") == pytest.approx(tokens * per_token, abs=1)
    split = (2 * 2 * 7168 + 2 * (1536 + 512 + 64) + 4 * 256) / 2 + 128 // 2 * (128 * E5M6_BYTES + 4) \
        + 8 * (7168 + 2048) * FP8_BYTES + 2048 * FP8_BYTES
    assert fp8_layer_bytes(cfg, 2, 1, True, "none") == pytest.approx(tokens * split, abs=1)
    assert fp8_layer_bytes(cfg, 2, 1, True, "full") == tokens * 2 * 7168 // 2
    assert fp8_layer_bytes(cfg, 1, 1, False, "none") / 1e6 == pytest.approx(641.7, abs=0.05)


def test_cast_bytes_of_a_dense_layer_and_of_the_routed_rows():
    """A dense Llama layer's FP8 casts by hand (qkv, o, gate/up, down): each input cast once forward (2 + FP8
    bytes) and re-tiled once backward (2 FP8), each output gradient cast twice (2 x (2 + FP8)). The routed
    experts' input is cast once a token before the dispatch, whatever top-k: only the per-row terms grow."""
    small = ModelConfig(arch="llama", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                        seq_length=32, vocab_size=100)
    h, a, kv, f = 64, 64, 32, 96
    gemms = [(h, a + 2 * kv), (a, h), (h, 2 * f), (f, h)]
    assert cast_bytes_per_token(small) == pytest.approx(
        sum(k * (2 + FP8_BYTES) + 2 * k * FP8_BYTES + 2 * n * (2 + FP8_BYTES) for k, n in gemms))
    moe = dataclasses.replace(DEEPSEEK_V3_TRAINED, num_layers=4, moe_first_dense_layers=3, mtp_layers=0)
    more = dataclasses.replace(moe, moe_top_k=9)
    per_row = 2 * 7168 * FP8_BYTES + 2 * 4096 * (2 + FP8_BYTES) + 2048 * ((2 + FP8_BYTES) + 2 * FP8_BYTES) \
        + 2 * 7168 * (2 + FP8_BYTES)
    assert cast_bytes_per_token(more) - cast_bytes_per_token(moe) == pytest.approx(per_row)


def test_padded_values_and_bf16_moments():
    """The attention kernel with MLA's values padded to 192 channels executes 384 / 320 of the core's FLOPs (the
    count stays); grouped-query attention is untouched. AdamW's moments in BF16 leave 8 of the 12 optimizer bytes
    a parameter."""
    cfg = DEEPSEEK_V3_TRAINED
    args = (1, False, 1e15, 0.3, 0.3)
    padded = dataclasses.replace(DEEPSEEK_KERNELS, fp8_gemms=False).attention_seconds(cfg, *args)
    plain = dataclasses.replace(DEEPSEEK_KERNELS, pad_values=False).attention_seconds(cfg, *args)
    assert padded / plain == pytest.approx(384 / 320)
    llama = dataclasses.replace(cfg, attention="mha")
    assert DEEPSEEK_KERNELS.attention_seconds(llama, *args) == \
        dataclasses.replace(DEEPSEEK_KERNELS, pad_values=False).attention_seconds(llama, *args)
    evaluator = Evaluator(request())
    choice = evaluator.choice(as_run())
    params = evaluator.rank_params(16, 1, 1, choice.busiest_stage, 64, False, True)[1]
    fp32_moments = state_memory(params, evaluator.fmt, 128, True, ep=64).optimizer
    assert choice.state.optimizer == fp32_moments * 2 // 3
