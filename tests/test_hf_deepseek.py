"""DeepSeek-V3 (MLA + DeepSeek routing) against transformers: conversion both ways, logits and greedy tokens.

Two random `DeepseekV3ForCausalLM`s, 3 layers (the first dense), 8 routed experts in 4 groups (top-2 of the
best 2 groups), one shared expert, routed_scaling_factor 2.5, non-zero e_score_correction_bias, v_head_dim
12 against a q/k head of 16 + 8, interleaved rotary channels (transformers' default): "qlora" with the
query low-rank path (q_a -> RMSNorm -> q_b) and the default rotary embedding; "yarn" with a plain q_proj
and YaRN scaling (factor 4, mscale 1 and mscale_all_dim 0.7, so both the cos/sin factor and the softmax
scale move). shardlm's logits equal transformers' within 1e-4 at TP=1, TP=2 and EP=2, greedy generation
with the KV cache gives transformers' tokens, and converting back gives bitwise the saved tensors.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_layout_matches,
    assert_round_trip,
    hf_reference,
    layout_worker,
    variant_logits,
)

from shardlm.checkpoint.hf import to_hf
from shardlm.checkpoint.hf_deepseek import _permute_rope_rows, model_config_from_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext

from multiproc import run_workers

VOCAB = 300
KINDS = ("qlora", "yarn")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}


def hf_config(kind: str):
    from transformers import DeepseekV3Config

    rope = YARN if kind == "yarn" else {"rope_type": "default", "rope_theta": 500.0}
    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24 if kind == "qlora" else None,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Per kind: the saved HF directory, the converted file, reference logits and greedy tokens (`hf_reference`)."""
    from transformers import DeepseekV3ForCausalLM

    out = {}
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    for kind in KINDS:
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(hf_config(kind)).eval()
        with torch.no_grad():  # sharp attention and routing, so a slip in either moves the logits
            for layer in model.model.layers:
                attn = layer.self_attn
                (attn.q_b_proj if attn.q_b_proj is not None else attn.q_proj).weight.mul_(8.0)
                attn.kv_a_proj_with_mqa.weight.mul_(4.0)
                attn.kv_b_proj.weight.mul_(4.0)
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.normal_(0, 0.6)
                    layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
        # (norm seed 1: with seed 0's norms, YaRN's second greedy row repeats one token)
        out[kind] = hf_reference(model, tmp_path_factory.mktemp(kind), tokens, norm_seed=1)
    out["tokens"] = tokens
    return out


@pytest.fixture(scope="module")
def world2(hf_models):
    """TP=2 and EP=2 logits and greedy tokens of each converted model (`layout_checks`)."""
    paths = {kind: hf_models[kind]["converted"] for kind in KINDS}
    return run_workers(2, layout_worker, paths, hf_models["tokens"], timeout=300)


@pytest.mark.parametrize("kind", KINDS)
def test_conversion_reads_attention_and_routing(hf_models, kind):
    config, tensors = load_consolidated(hf_models[kind]["converted"])
    m = config.model
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == ("mla", 24 if kind == "qlora" else 0, 16, 12)
    assert (m.moe_num_experts, m.moe_groups, m.moe_topk_groups, m.moe_routed_scaling) == (8, 4, 2, 2.5)
    assert (m.moe_first_dense_layers, m.moe_shared_experts, m.moe_score, m.moe_expert_bias) == (1, 1, "sigmoid", True)
    assert m.rope_yarn_factor == (4.0 if kind == "yarn" else 0.0)
    assert tensors["model/layers.1.mlp.router.expert_bias"].abs().min() > 0
    assert tensors["model/layers.0.attn.kv_b.weight"].shape == (4 * (16 + 12), 16)


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_logits_and_greedy_tokens_match_transformers(hf_models, kind):
    assert_converted_matches(hf_models[kind])


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("kind", KINDS)
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, hf_models, layout, kind):
    assert_layout_matches(world2, f"{layout} {kind}", hf_models[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(hf_models, kind, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    assert_round_trip(hf_models[kind], tmp_path / "back", DeepseekV3ForCausalLM)


def test_interleaved_rotary_rows_are_permuted(hf_models, tmp_path):
    """Control: a converter that kept DeepSeek's interleaved rotary rows as the checkpoint stores them (q_b's and
    kv_a's rows put back in their HF order) moves the logits by more than 100 times the tolerance."""
    ref = hf_models["qlora"]
    config, _ = load_consolidated(ref["converted"])

    def interleaved(tensors):
        for name, value in tensors.items():
            kind = name.rsplit(".", 2)[-2]
            if ".attn." in name and kind in ("q", "q_b", "kv_a"):
                tensors[name] = _permute_rope_rows(value, config.model, kind, inverse=True)
        return tensors

    logits = variant_logits(ref, tmp_path / "interleaved.safetensors", change_tensors=interleaved)
    moved = (logits - ref["logits"]).abs().max().item()
    assert moved > 100 * LOGIT_TOL, moved


def test_unsupported_configs_are_refused_in_one_line():
    base = hf_config("qlora").to_dict()
    for change, words in (({"scoring_func": "softmax"}, "scoring_func"), ({"attention_bias": True}, "bias"),
                          ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type"),
                          ({"quantization_config": {"quant_method": "fp8"}}, "quantized")):
        with pytest.raises(UserError, match=words) as error:
            model_config_from_hf(base | change)
        assert "\n" not in str(error.value)
    assert model_config_from_hf(base | {"num_nextn_predict_layers": 1, "model_type": "kimi_k2"}).mtp_layers == 1


def test_remote_code_style_config_reads_yarn_from_rope_scaling():
    """DeepSeek-V3 / Kimi K2 config.json files (written for their own modeling code) keep rope_theta and a
    rope_scaling dict with "type": "yarn", n_group 1 (Kimi K2) and no rope_interleave key."""
    hf = {k: v for k, v in hf_config("qlora").to_dict().items() if k not in ("rope_parameters", "rope_interleave")}
    hf |= {"model_type": "kimi_k2", "rope_theta": 50000.0, "n_group": 1, "topk_group": 1, "scoring_func": "sigmoid",
           "topk_method": "noaux_tc", "moe_layer_freq": 1,
           "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    m = model_config_from_hf(hf)
    assert (m.rope_theta, m.rope_yarn_factor, m.rope_yarn_original_positions) == (50000.0, 32.0, 4096)
    assert (m.rope_yarn_beta_fast, m.rope_yarn_mscale_all_dim, m.moe_groups, m.moe_topk_groups) == (1.0, 1.0, 0, 0)


@pytest.mark.parametrize("q_lora_rank,groups", [(16, 4), (0, 0)])
def test_a_trained_shardlm_model_exports_to_transformers(tmp_path, q_lora_rank, groups):
    """A shardlm-native MLA model (3 training steps, its expert biases moved, then sharpened) saved as a sharded
    checkpoint and written with --to-hf: transformers' logits equal shardlm's within 1e-4 (with and without
    q-LoRA and expert groups; without groups, n_group = topk_group = 1)."""
    from test_mla_parallel import mla_config
    from test_training import synthetic_data
    from transformers import DeepseekV3ForCausalLM

    from shardlm.checkpoint import save_checkpoint
    from shardlm.training.trainer import Trainer

    config = mla_config(q_lora_rank=q_lora_rank, moe_groups=groups, moe_topk_groups=2 if groups else 0)
    trainer = Trainer(config, ParallelContext.single(), synthetic_data())
    for _ in range(3):
        trainer.train_step()
    model = trainer.model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("attn.q_b.weight", "attn.q.weight", "attn.kv_a.weight", "attn.kv_b.weight")):
                param.mul_(8.0)
            elif name.endswith("router.weight"):
                param.mul_(30.0)
    assert model.layers["1"].mlp.router.expert_bias.abs().max() > 0
    save_checkpoint(trainer, tmp_path / "ckpt")
    out = to_hf(tmp_path / "ckpt", tmp_path / "hf")
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        ours = model.full_logits(model(tokens))
        theirs = DeepseekV3ForCausalLM.from_pretrained(out).eval()(tokens).logits
    assert theirs.std() > 0.1
    assert (ours - theirs).abs().max() < LOGIT_TOL


def test_convert_and_inspect_commands(hf_models, tmp_path, capsys):
    """`shardlm convert --from-hf` writes the same file as the function; `checkpoint inspect` names MLA."""
    from shardlm.cli import main

    assert main(["convert", "--from-hf", str(hf_models["qlora"]["root"] / "hf"), "--output",
                 str(tmp_path / "cli.safetensors")]) == 0
    assert main(["checkpoint", "inspect", str(tmp_path / "cli.safetensors")]) == 0
    out = capsys.readouterr()
    assert "attention: multi-head latent (q_lora_rank 24, kv_lora_rank 16" in out.out
    # transformers writes num_nextn_predict_layers 1 but saves no MTP weights
    assert "has no multi-token prediction weights; converted without them" in out.err
    ours = load_consolidated(tmp_path / "cli.safetensors")[1]
    theirs = load_consolidated(hf_models["qlora"]["converted"])[1]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
