"""DeepSeek-V3's multi-token prediction: transformers' MTP module's logits, and every layout equal to one process.

- `rolled_targets` by hand: depth k's inputs are the tokens k places ahead, its targets the labels k places
  ahead, both cut at the row's end and at document boundaries.
- A random DeepSeek-V3 (MLA, q-LoRA) from transformers with one MTP depth: shardlm's main logits and MTP
  logits equal transformers' `DeepseekV3ForCausalLM` and `MtpModel.forward_layer` + shared head on the same
  weights within 1e-5 (transformers' MTP layer takes the main model's final-norm output, as shardlm's does).
- Training with 2 depths (weight 0.3): TP=2 with SP, DP=2, EP=2 and CP=2 (the rolls made on whole rows before the
  zigzag split) give one process's losses, MTP losses, gradient norms and parameters within 1e-5; the depths
  change the training (the curve differs from the same run without them), and the logged "loss" stays the
  next-token loss (the MTP term enters the gradient only).
- Export and import keep the MTP layer under DeepSeek's naming (layer num_hidden_layers), bitwise.
Pipeline parallelism (the depths on the last stage) is tested in `test_mtp_pipeline.py`.
"""

from __future__ import annotations

import pytest
import torch
from llama_reference import spread_norm_weights
from test_mla_parallel import mla_config
from test_moe_parallel import full_parameters
from test_moe_parallel import synthetic_data as moe_data

from shardlm.checkpoint.hf_deepseek import (
    hf_config_from_model,
    model_config_from_hf,
    name_map,
    tensor_from_hf,
    tensor_to_hf,
)
from shardlm.models import build_model
from shardlm.models.mtp import rolled_targets
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank
from layouts import layout, layout_context, spawn_layouts

STEPS, TOL = 6, 1e-5


def test_rolled_targets_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    labels = torch.tensor([[11, 12, -100, 14, 15, 16]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]])
    inputs, targets = rolled_targets(ids, labels, 1, segments)
    assert inputs.tolist() == [[11, 12, 0, 14, 15, 0]] and targets.tolist() == [[12, -100, -100, 15, 16, -100]]
    inputs, targets = rolled_targets(ids, labels, 2)
    assert inputs.tolist() == [[12, 13, 14, 15, 0, 0]] and targets.tolist() == [[-100, 14, 15, 16, -100, -100]]


# ------------------------------------------------------------------------------------ transformers

def hf_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64, num_mtp_layers=1,
                            tie_word_embeddings=False)


def mtp_state_for_transformers(cfg, params: dict) -> dict:
    """shardlm's depth-0 MTP weights as transformers' `MtpLayer` state dict (experts fused as it keeps them)."""
    state, experts = {}, {}
    for name, hf_name in name_map(cfg):
        if not name.startswith("mtp.0."):
            continue
        key = hf_name.split(".", 3)[3].replace("shared_head.norm", "post_norm")
        key = key if key.split(".")[0] in ("enorm", "hnorm", "eh_proj", "post_norm") else f"mtp_block.{key}"
        if ".experts." in name:  # mtp.0.block.mlp.experts.{gate,up,down}.{e}
            stack, expert = name.rsplit(".", 2)[1:]
            experts.setdefault(stack, {})[int(expert)] = params[name.rsplit(".", 1)[0]][int(expert)].detach()
            continue
        state[key] = tensor_to_hf(cfg, name, params[name].detach())
    count = cfg.moe_num_experts
    state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat((experts["gate"][e], experts["up"][e])) for e in range(count)])
    state["mtp_block.mlp.experts.down_proj"] = torch.stack([experts["down"][e] for e in range(count)])
    return state


def test_mtp_logits_equal_transformers_mtp_module(tmp_path):
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    from shardlm.checkpoint import load_model
    from shardlm.checkpoint.hf import from_hf

    torch.manual_seed(0)
    main = DeepseekV3ForCausalLM(hf_config()).eval()
    spread_norm_weights(main)  # norms away from 1, so a swapped pair shows
    with torch.no_grad():  # a visible expert bias, as a trained checkpoint has
        for layer in main.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    mtp = MtpModel(main, 1).eval()
    main.save_pretrained(tmp_path / "hf")
    converted, _ = load_model(from_hf(tmp_path / "hf", tmp_path / "main.safetensors"), ParallelContext.single())
    cfg = model_config_from_hf(hf_config().to_dict())
    assert cfg.mtp_layers == 1
    model = build_model(cfg, ParallelContext.single(), seed=5).eval()
    missing, _ = model.load_state_dict(converted.state_dict(), strict=False)
    assert missing and all(name.startswith("mtp.") for name in missing)
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight"} <= set(spread_norm_weights(model, seed=1, prefix="mtp."))
    with torch.no_grad():
        model.mtp[0].block.mlp.router.expert_bias.normal_(0, 0.1)
    missing, unexpected = mtp.layers[0].load_state_dict(mtp_state_for_transformers(cfg, dict(model.named_parameters()))
                                                        | {"mtp_block.mlp.gate.e_score_correction_bias":
                                                           model.mtp[0].block.mlp.router.expert_bias.detach()},
                                                        strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        out = main(ids, output_hidden_states=True)
        hidden = model.hidden_states(ids)
        torch.testing.assert_close(model.full_logits(model.output_layer(hidden)), out.logits, atol=1e-5, rtol=1e-5)
        next_ids = torch.cat((ids[:, 1:], ids[:, :1]), dim=1)  # the last position's input is not compared
        ours_mtp = model.full_logits(model.output_layer(model.mtp[0](model.embed(next_ids), hidden)))
        theirs_mtp = mtp._project_to_logits(mtp.forward_layer(0, out.hidden_states[-1], positions, None,
                                                              input_ids=next_ids))
    torch.testing.assert_close(ours_mtp[:, :-1], theirs_mtp[:, :-1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours_mtp, model.full_logits(model.output_layer(hidden)), atol=1e-3)


def test_mtp_layer_round_trips_under_deepseek_names():
    cfg = model_config_from_hf(hf_config().to_dict())
    model = build_model(cfg, ParallelContext.single(), seed=5)
    params = dict(model.named_parameters())
    names = dict(name_map(cfg))
    assert names["mtp.0.eh_proj"] == "model.layers.2.eh_proj.weight"
    assert names["mtp.0.post_norm.weight"] == "model.layers.2.shared_head.norm.weight"
    assert names["mtp.0.block.attn.kv_a.weight"] == "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    stacks = {n.rsplit(".", 1)[0] if ".experts." in n else n for n in names}  # experts: one name per expert
    assert stacks == set(params), stacks ^ set(params)
    for name in names:
        if name in params:
            value = params[name].detach()[: cfg.vocab_size] if name.startswith(("wte", "lm_head")) else params[name]
            back = tensor_from_hf(cfg, name, tensor_to_hf(cfg, name, value.detach()), True)
            assert torch.equal(back, value), name
    assert hf_config_from_model(cfg)["num_nextn_predict_layers"] == 1


# ------------------------------------------------------------------------------------------ layouts

def mtp_config(tp: int = 1, cp: int = 1, sp: bool = False, depths: int = 2, ep: int = 1):
    return mla_config(tp=tp, cp=cp, sp=sp, ep=ep, mtp_layers=depths, mtp_loss_weight=0.3)


def train(ctx: ParallelContext, config) -> tuple:
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, moe_data())
    metrics = [trainer.train_step() for _ in range(STEPS)]
    return [(m["loss"], m["grad_norm"], m.get("mtp_loss", 0.0)) for m in metrics], full_parameters(trainer.model)


WORLD2 = {"tp2_sp": layout(tp=2, sp=True), "dp2": layout(), "cp2": layout(cp=2), "ep2": layout(ep=2)}
"""The layouts of a world of 2, each against one process."""


def run_layout(tp: int, pp: int, cp: int, ep: int, sp: bool = False) -> tuple:
    """One case on this rank: (curve, full parameters) of `mtp_config`'s run at the case's layout."""
    return train(layout_context(tp, pp, cp, ep), mtp_config(tp, cp, sp, ep=ep))


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2)


@pytest.fixture(scope="module")
def reference():
    return train(ParallelContext.single(), mtp_config())


@pytest.mark.parametrize("name", list(WORLD2))
def test_mtp_trains_as_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference, steps=STEPS, tol=TOL, columns=("loss", "grad norm", "mtp loss"))


def test_mtp_changes_training_but_not_the_logged_loss_of_step_one(reference):
    curve, _ = reference
    plain, _ = train(ParallelContext.single(), mla_config())
    assert abs(curve[0][0] - plain[0][0]) <= 1e-6 * plain[0][0]  # the same next-token loss at step 1
    assert curve[0][1] != pytest.approx(plain[0][1], rel=1e-4)  # the gradient has the MTP term
    assert all(mtp > 0 for _, _, mtp in curve)
