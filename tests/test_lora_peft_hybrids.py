"""Adapters of the sparse-attention and hybrid families equal to peft 0.21's, their experts' included (peft's
`target_parameters`), and through peft's files both ways:

- DeepSeek-V3.2 and GLM-5: DeepSeek Sparse Attention (MLA with a lightning indexer choosing 4 of 16 keys) and
  DeepSeek-V3's experts; read converted, as DeepSeek-V3 (their MLA's rotary rows reordered);
- Kimi Linear: Kimi Delta Attention layers (q/k/v/o) and MLA layers without positions, MoE on both; transformers'
  in-memory module names (`forget_gate.`, `mlp.experts`), which differ from its files';
- Nemotron-H: Mamba-2, attention and MoE blocks, its ReLU^2 experts under `mixer.` with `up_proj` and `down_proj`
  (`RELU_SQUARED`); adapters on the attention's q/k/v/o. "o_proj" names the attention's output projection only, as
  in peft; the Mamba-2 layers' is "out_proj", where peft refuses adapters: its export is a one-line error;
- DeepSeek-V4: hyper-connections, a sliding-window layer and an HCA one, DeepSeek-V3's experts (clipped); adapters on
  q_b, o_b and the shared expert, named in peft by their last two names (its compressors' gate_proj takes none). Its
  grouped o_a_proj (one update per group in shardlm, one dense one in peft) exports merged only: a one-line error.

Each base is a random two-layer transformers model (four blocks for Nemotron-H: Mamba-2, MoE, attention, MoE), routers
drawn at std 0.5, every adapter's B drawn non-zero (the experts' too). As tests/test_lora_peft_experts.py checks the
other families: the logits equal peft's within 1e-5 and differ from the base's and, with the experts' adapters left
out of peft's model, from peft's; `shardlm convert --to-peft` reads back bitwise and names the family's
`target_parameters`, and with `--merge` gives a transformers directory of the same logits; the directory peft saves
starts a run (`checkpoint.init_adapter`, its targets and expert layers taken from it) with peft's logits; 3 training
steps equal a plain AdamW loop over peft's trainable parameters (losses within 1e-5).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_lora_peft import (
    TOKENS,
    TOL,
    VOCAB,
    assert_trains_as_peft,
    peft_model,
    save_random,
    shardlm_logits,
    started_from,
    trained,
)
from test_lora_peft_experts import adapted_trainer

from shardlm.checkpoint import load_model, save_checkpoint
from shardlm.checkpoint.hf import from_hf
from shardlm.checkpoint.peft import peft_tensors, read_peft, stacked
from shardlm.checkpoint.peft_experts import EXPERT_PARAMETERS, RELU_SQUARED
from shardlm.cli import main
from shardlm.parallel import ParallelContext

from agreement import rel
from multiproc import import_or_skip

peft = import_or_skip("peft", "peft is the LoRA oracle (the dev extra installs it)")

pytestmark = pytest.mark.timeout(300)

FAMILIES = ("deepseek_v32", "glm_moe_dsa", "kimi_linear", "nemotron_h", "deepseek_v4")
CONVERTED = ("deepseek_v32", "glm_moe_dsa")
"""The families shardlm reads converted (their MLA's rotary rows reordered)."""
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
TARGETS = {"deepseek_v32": MLA, "glm_moe_dsa": MLA,
           "kimi_linear": ["q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa", "kv_b_proj"],
           "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "deepseek_v4": ["q_b_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"]}
"""lora.targets, Hugging Face's names (peft's target_modules)."""
PEFT_TARGETS = {"deepseek_v4": ["self_attn.q_b_proj", "self_attn.o_b_proj", "shared_experts.gate_proj",
                                "shared_experts.up_proj", "shared_experts.down_proj"]}
"""peft's target_modules where a name alone would match modules shardlm does not adapt (DeepSeek-V4's compressors'
gate_proj)."""
PARAMETERS = {"nemotron_h": RELU_SQUARED.targets}
"""peft's target_parameters where they are not `EXPERT_PARAMETERS`."""


def hf_config(family: str):
    import transformers as tf

    if family in CONVERTED:
        config = tf.DeepseekV32Config if family == "deepseek_v32" else tf.GlmMoeDsaConfig
        return config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                      n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                      routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24,
                      qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, index_topk=4, index_n_heads=32,
                      index_head_dim=16, max_position_embeddings=64,
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False)
    if family == "kimi_linear":
        return tf.KimiLinearConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                   qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                   num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                   routed_scaling_factor=2.0, linear_num_heads=4, linear_head_dim=8,
                                   linear_conv_kernel_dim=4, max_position_embeddings=64, tie_word_embeddings=False,
                                   layer_types=["linear_attention", "full_attention"],
                                   mlp_layer_types=["sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    if family == "deepseek_v4":  # a sliding-window layer and an HCA one (entries of 4 tokens, a compressor's gate_proj)
        return tf.DeepseekV4Config(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                                   num_attention_heads=4, head_dim=16, q_lora_rank=24, partial_rotary_factor=0.25,
                                   num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                                   routed_scaling_factor=1.5, max_position_embeddings=64,
                                   layer_types=["sliding_attention", "heavily_compressed_attention"],
                                   compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                                   mlp_layer_types=["moe", "moe"], hc_mult=2, sliding_window=6, o_groups=2,
                                   o_lora_rank=8, rope_theta=500.0, compress_rope_theta=2000.0, swiglu_limit=1.0,
                                   tie_word_embeddings=False, num_nextn_predict_layers=0)
    return tf.NemotronHConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16,
                              n_groups=2, conv_kernel=4, chunk_size=32, max_position_embeddings=64,
                              tie_word_embeddings=False,
                              layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              moe_shared_expert_intermediate_size=24, n_group=1, topk_group=1,
                              routed_scaling_factor=2.5)


def model_class(family: str):
    import transformers as tf

    return {"deepseek_v32": tf.DeepseekV32ForCausalLM, "glm_moe_dsa": tf.GlmMoeDsaForCausalLM,
            "kimi_linear": tf.KimiLinearForCausalLM, "nemotron_h": tf.NemotronHForCausalLM,
            "deepseek_v4": tf.DeepseekV4ForCausalLM}[family]


def sharp_routers(model) -> None:
    """Routers that route and experts whose outputs count (Nemotron-H's MoE is a block's `mixer`), and a sharp
    indexer (`test_hf_sparse_attention.sharpened`'s): at a random init's scores, near-ties flip its choice between
    two programs' roundings."""
    for layer in model.model.layers:
        indexer = getattr(getattr(layer, "self_attn", None), "indexer", None)
        if indexer is not None:
            indexer.wq_b.weight.mul_(4.0)
            indexer.weights_proj.weight.mul_(4.0)
            indexer.k_norm.weight.uniform_(0.5, 2.0)
        moe = getattr(layer, "mlp", None) or getattr(layer, "mixer", None)
        if hasattr(moe, "experts"):
            moe.gate.weight.normal_(0, 0.5)
            for param in moe.experts.parameters():
                param.normal_(0, 0.2)


def peft_without_experts(root, family: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """peft's logits of TOKENS with the attention's adapters (`tensors`, peft's names) and none on the experts."""
    model = peft.get_peft_model(model_class(family).from_pretrained(root), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PEFT_TARGETS.get(family, TARGETS[family])))
    loaded = peft.set_peft_model_state_dict(model, tensors)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora" in k], loaded
    with torch.no_grad():
        return model.eval()(TOKENS).logits


@pytest.fixture(scope="module", params=FAMILIES)
def family_base(request, tmp_path_factory):
    """(family, its transformers directory, what shardlm reads: that directory, or DSA's converted)."""
    root = tmp_path_factory.mktemp(f"peft_{request.param}") / request.param
    save_random(model_class(request.param), hf_config(request.param), root, sharp_routers)
    if request.param in CONVERTED:
        return request.param, root, from_hf(root, root.parent / "model.safetensors")
    return request.param, root, root


def test_logits_round_trip_and_training_equal_peft(family_base, tmp_path):
    family, hf_root, root = family_base
    parameters = PARAMETERS.get(family, EXPERT_PARAMETERS)
    trainer = adapted_trainer(root, TARGETS[family])
    assert any(".experts.lora.B_" in n for n in trained(trainer))
    ours = shardlm_logits(trainer.model, TOKENS)[..., :VOCAB]
    model = peft_model(hf_root, trainer, PEFT_TARGETS.get(family, TARGETS[family]), experts=parameters,
                       model_class=model_class(family))
    assert rel(model.eval()(TOKENS).logits, ours) <= TOL, rel(model(TOKENS).logits, ours)
    plain = shardlm_logits(load_model(root, ParallelContext.single())[0], TOKENS)[..., :VOCAB]
    assert rel(plain, ours) > 1e-2  # the adapters changed the logits
    dense = {n: p for n, p in peft_tensors(trained(trainer), trainer.config.model).items() if ".experts." not in n}
    without = peft_without_experts(hf_root, family, dense)
    assert rel(without, ours) > 1e-3, rel(without, ours)  # the experts' adapters count

    save_checkpoint(trainer, tmp_path / "run")
    assert main(["convert", "--to-peft", str(tmp_path / "adapter"), "--checkpoint", str(tmp_path / "run")]) == 0
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_parameters"] == parameters
    assert written["target_modules"] == sorted(PEFT_TARGETS.get(family, TARGETS[family]))
    _, back = read_peft(tmp_path / "adapter", trainer.config.model)
    saved = trained(trainer)
    assert stacked(back).keys() == stacked(saved).keys()
    assert all(torch.equal(stacked(back)[n], p) for n, p in stacked(saved).items())
    assert main(["convert", "--to-peft", str(tmp_path / "merged"), "--checkpoint", str(tmp_path / "run"),
                 "--merge"]) == 0  # every adapter folded in, the experts' too: a plain transformers directory
    with torch.no_grad():
        assert rel(model_class(family).from_pretrained(tmp_path / "merged").eval()(TOKENS).logits, ours) <= TOL
    model.save_pretrained(tmp_path / "peft")  # peft's own directory starts a run with peft's logits
    assert rel(shardlm_logits(started_from(root, tmp_path / "peft")[0].model, TOKENS)[..., :VOCAB], ours) <= TOL
    assert_trains_as_peft(trainer, model.train(), steps=3)


def test_a_mamba_layers_out_proj_adapter_is_refused_at_export_in_one_line(tmp_path):
    """"out_proj" adapts the Mamba-2 layers' output projection (block 0), "o_proj" the attention's (block 2) only;
    peft refuses adapters on a Mamba-2 layer's out_proj, so their export is one line."""
    from shardlm.errors import UserError

    root = save_random(model_class("nemotron_h"), hf_config("nemotron_h"), tmp_path / "nemotron_h")
    assert {n.split(".lora.")[0] for n in trained(adapted_trainer(root, ["o_proj"])) if ".lora." in n and
            ".experts." not in n} == {"layers.2.mixer.o"}
    trainer = adapted_trainer(root, ["out_proj"])
    assert {n.split(".lora.")[0] for n in trained(trainer) if ".lora." in n and ".experts." not in n} == \
        {"layers.0.mixer.o"}
    with pytest.raises(UserError, match=r"layers\.0\.mixer\.o has no peft equivalent: peft refuses adapters on a "
                                        "Mamba-2 layer's out_proj") as error:
        peft_tensors(trained(trainer), trainer.config.model)
    assert "\n" not in str(error.value)


def test_a_deepseek_v4_grouped_o_a_adapter_is_refused_at_export_in_one_line(tmp_path):
    """transformers' o_a_proj is a grouped linear: peft would put one dense update on it, not shardlm's adapter
    applied group by group, so an adapter on it exports merged only (`--merge`), and `--to-peft` says so in one line."""
    from shardlm.errors import UserError

    root = save_random(model_class("deepseek_v4"), hf_config("deepseek_v4"), tmp_path / "deepseek_v4")
    trainer = adapted_trainer(root, ["o_a_proj"])
    assert {n.split(".lora.")[0] for n in trained(trainer) if ".lora." in n and ".experts." not in n} == \
        {"layers.0.attn.o_a", "layers.1.attn.o_a"}
    with pytest.raises(UserError, match=r"layers\.\d\.attn\.o_a has no peft equivalent: transformers' o_a_proj is a "
                                        "grouped linear") as error:
        peft_tensors(trained(trainer), trainer.config.model)
    assert "\n" not in str(error.value)
