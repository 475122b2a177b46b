"""Multi-head latent attention under tensor, sequence and expert parallelism gives the one-process answer.

A tiny DeepSeek-V3-shaped model (Llama with MLA: q-LoRA rank 16, KV latent 16, q/k heads of 8 + 4 channels
and v heads of 12; a dense first layer, then DeepSeek routing: 8 sigmoid-scored experts in 4 groups, the
best 2 groups per token, a shared expert, routed scaling 2, a moving expert bias) trains 8 steps at TP=2,
at TP=2 with sequence parallelism, at EP=2 (DP=2), at PP=2, at CP=2 (the ring carrying keys of 12 channels
and values of 12, or values of 8 zero-padded to 12), with FSDP and with ZeRO-1 at DP=2 on a gloo world of 2,
and at CP=2 x TP=2 with SP and EP=2 x TP=2 on a world of 4: loss, gradient norm and aux loss at every step
and every final parameter within 1e-5 of one process (fp32, dropout 0). Selective and full recomputation
train bitwise as without.

The replicated down-projections (q_a, kv_a) and their norms receive only their own heads' share of the
gradient on each TP rank; `f` on the latents sums the shares. After one backward at TP=2 their gradients
equal one process's within 1e-5, and with that all-reduce skipped (`f` replaced by the identity) they do not.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_parallel import STEPS, assert_same_run, train_layout
from test_moe_parallel import run as run_layout
from test_training import ADAM_EPS, VOCAB

from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.models import build_model, gpt_loss
from shardlm.parallel import ParallelContext
from shardlm.validation import validate

from agreement import rel
from layouts import MLA
from multiproc import check_result, run_checks, run_workers

DEEPSEEK = {"moe_num_experts": 8, "moe_top_k": 2, "moe_ffn_hidden_size": 32, "moe_score": "sigmoid",
            "moe_expert_bias_rate": 0.01, "moe_shared_experts": 1, "moe_first_dense_layers": 1, "moe_groups": 4,
            "moe_topk_groups": 2, "moe_routed_scaling": 2.0, "moe_aux_loss_coeff": 0.001}
GRADIENT_CHECKED = ("q_a.weight", "q_a_norm.weight", "kv_a.weight", "kv_a_norm.weight")


def mla_config(tp: int = 1, ep: int = 1, sp: bool = False, pp: int = 1, recompute: str = "none", cp: int = 1,
               train: dict | None = None, **model):
    return from_dict({
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                  "vocab_size": VOCAB, "dropout": 0.0, **MLA, **DEEPSEEK, **model},
        "parallel": {"tensor": tp, "expert": ep, "sequence_parallel": sp, "pipeline": pp, "context": cp},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": 4, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 7, "recompute": recompute,
                  **(train or {})},
    })


def run_context(config, tp: int = 1, cp: int = 1, ep: int = 1):
    """A check: train `config` on the whole world as DP x CP x TP with expert size `ep`."""
    def check():
        ctx = ParallelContext.from_process_group(tp, context_parallel=cp, expert_parallel=ep)
        return train_layout(ctx, config)[:2]
    return check


def down_projection_gradients(ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Gradients of every layer's replicated q_a, kv_a and their norms after one forward and backward of a
    fixed batch (no optimizer: the model as built from seed 3)."""
    model = build_model(mla_config(tp=ctx.tp_size).model, ctx, seed=3)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(5))
    gpt_loss(model, tokens).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if name.endswith(GRADIENT_CHECKED)}


def skipped_all_reduce():
    """Wrong on purpose: the latents enter the split heads without `f`, so no rank sums the others' shares."""
    import shardlm.models.mla as mla

    original = mla.enter_parallel_region
    mla.enter_parallel_region = lambda x, tp, sequence_parallel: x
    try:
        return down_projection_gradients(ParallelContext.from_process_group(2))
    finally:
        mla.enter_parallel_region = original


def world2_checks():
    return run_checks({
        "tp2": run_layout(mla_config(tp=2), tp=2),
        "tp2_sp": run_layout(mla_config(tp=2, sp=True), tp=2),
        "ep2": run_layout(mla_config(ep=2), ep=2),
        "pp2": run_layout(mla_config(pp=2), pp=2),  # stage 0: the dense MLA layer, stage 1: the MoE one
        "cp2": run_context(mla_config(cp=2), cp=2),  # keys of 12 channels, values of 12: no padding needed
        "cp2_narrow_values": run_context(mla_config(cp=2, v_head_dim=8), cp=2),  # values padded to 12
        "fsdp_dp2": run_layout(mla_config(train={"data_sharding": "full"})),
        "zero_dp2": run_layout(mla_config(train={"distributed_optimizer": True})),
        "grads_tp2": lambda: down_projection_gradients(ParallelContext.from_process_group(2)),
        "grads_tp2_without_f": skipped_all_reduce,
    })


def world4_checks():
    return run_checks({
        "cp2_tp2_sp": run_context(mla_config(tp=2, cp=2, sp=True), tp=2, cp=2),
        "ep2_tp2": run_layout(mla_config(tp=2, ep=2), tp=2, ep=2),
    })


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, world4_checks, timeout=600)


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, world2_checks, timeout=600)


@pytest.fixture(scope="module")
def reference():
    """One process, the same micro-batches."""
    ctx = ParallelContext.single()
    return train_layout(ctx, mla_config())[:2], down_projection_gradients(ParallelContext.single())


@pytest.fixture(scope="module")
def narrow_reference():
    """One process, values of 8 channels (keys 12)."""
    return train_layout(ParallelContext.single(), mla_config(v_head_dim=8))[:2]


@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "ep2", "pp2", "cp2", "fsdp_dp2", "zero_dp2"])
def test_mla_deepseek_model_trains_as_one_process(world2, reference, name):
    for run_ in check_result(world2, name):
        assert_same_run(run_, reference[0])


def test_mla_context_parallel_with_values_narrower_than_keys(world2, narrow_reference):
    for run_ in check_result(world2, "cp2_narrow_values"):
        assert_same_run(run_, narrow_reference)


@pytest.mark.parametrize("name", ["cp2_tp2_sp", "ep2_tp2"])
def test_mla_deepseek_model_trains_as_one_process_world4(world4, reference, name):
    for run_ in check_result(world4, name):
        assert_same_run(run_, reference[0])


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_trains_bitwise_the_same(reference, recompute):
    """The attention core (selective) or whole layers (full) rerun in the backward: the same curve and
    parameters, bit for bit."""
    curve, params = train_layout(ParallelContext.single(), mla_config(recompute=recompute))[:2]
    (ref_curve, ref_params), _ = reference
    assert curve == ref_curve
    assert all(torch.equal(params[name], ref_params[name]) for name in ref_params)


def test_reference_covers_mla_and_deepseek_routing(reference):
    (curve, params), _ = reference
    assert params["layers.1.mlp.router.expert_bias"].abs().max() > 0 and all(aux > 0 for *_, aux in curve)
    assert params["layers.0.attn.q_b.weight"].shape == (4 * 12, 16)
    assert params["layers.0.attn.kv_b.weight"].shape == (4 * (8 + 12), 16)
    assert params["layers.0.attn.o.weight"].shape == (32, 4 * 12)
    assert "layers.0.mlp.router.weight" not in params


def test_replicated_down_projections_get_the_full_gradient_under_tp(world2, reference):
    expected = reference[1]
    assert len(expected) == 2 * len(GRADIENT_CHECKED)
    for grads in check_result(world2, "grads_tp2"):
        assert grads.keys() == expected.keys()
        for name, value in expected.items():
            assert rel(grads[name], value) <= 1e-5, name


def test_skipping_the_all_reduce_of_the_latents_gives_wrong_gradients(world2, reference):
    expected = reference[1]
    for grads in check_result(world2, "grads_tp2_without_f"):
        assert max(rel(grads[name], expected[name]) for name in expected) > 1e-2


@pytest.mark.parametrize("change,words", [
    ({"kv_lora_rank": 0}, "kv_lora_rank"), ({"num_kv_heads": 2}, "num_kv_heads"),
    ({"qk_rope_head_dim": 3}, "qk_rope_head_dim"), ({"attention": "gqa"}, "attention")])
def test_invalid_mla_configs_fail_in_one_line(change, words):
    with pytest.raises(UserError, match=words) as error:
        validate(mla_config(**change), 1, check_paths=False)
    assert "\n" not in str(error.value)


def test_context_parallel_refuses_values_wider_than_keys():
    config = mla_config(cp=2, v_head_dim=16)
    with pytest.raises(UserError, match="parallel.context"):
        validate(config, 2, check_paths=False)


def cached_and_full(model, prompt: int = 5, length: int = 12) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(logits of a `prompt`-token prompt then token-by-token decoding through the KV cache, the full forward's
    logits, the cache) of two random sequences of `length` tokens, without gradient."""
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model.full_logits(model(tokens))
        cache = model.new_kv_cache()
        steps = [model.full_logits(model(tokens[:, :prompt], cache=cache))]
        steps += [model.full_logits(model(tokens[:, t:t + 1], cache=cache)) for t in range(prompt, length)]
    return torch.cat(steps, dim=1), full, cache


def test_decoding_caches_the_latent_and_equals_the_full_forward():
    """A KV cache of MLA holds per token the latent and the shared RoPE key (kv_lora_rank + rope channels, one
    head), not H x (nope + rope + v) expanded channels; prompt then token-by-token decoding through the absorbed
    weights gives the full forward's logits within 1e-5 (fp32, YaRN and q-LoRA on)."""
    cfg = mla_config(rope_yarn_factor=4.0, rope_yarn_original_positions=8, rope_yarn_mscale=1.0,
                     rope_yarn_mscale_all_dim=1.0).model
    cfg.vocab_size = VOCAB
    model = build_model(cfg, ParallelContext.single(), seed=3).eval()
    cached, full, cache = cached_and_full(model)
    layer = cache.layers[0]
    assert (layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) == (1, 16, 4)  # latent, RoPE key
    assert rel(cached, full) <= 1e-5
