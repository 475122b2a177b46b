"""peft's names of the newer families' adapters (`shardlm.checkpoint.peft.module_names`): every module an adapter or
`modules_to_save` names is a module of the family's transformers model (Gemma 4's text model under `model.`,
Nemotron-H's under `model.`; a Mamba-2 layer's in_proj is one fused matrix, so its parts have no peft name, and peft
refuses its out_proj; Kimi Linear's and DeepSeek-V4's in transformers' in-memory names, not its files'), and models
whose adapters do not convert refuse in one line instead of writing names peft would not find."""

from __future__ import annotations

import pytest
import torch

from shardlm.checkpoint.peft import module_names
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig


def family_model(family: str, shape: str):
    """(shardlm's config, transformers' model on the meta device) of a tiny random config of the tests."""
    if family == "gemma4":
        from test_hf_gemma4 import hf_config
        from transformers import Gemma4ForCausalLM

        from shardlm.checkpoint.hf_gemma4 import model_config_from_hf
        config, causal_lm = hf_config(shape), Gemma4ForCausalLM
    elif family == "kimi_linear":
        from test_hf_kimi_linear import CONFIG
        from transformers import KimiLinearConfig, KimiLinearForCausalLM

        from shardlm.checkpoint.hf_kimi_linear import model_config_from_hf
        config, causal_lm = KimiLinearConfig(**CONFIG), KimiLinearForCausalLM
    elif family == "deepseek_v4":
        from test_hf_deepseek_v4 import hf_config
        from transformers import DeepseekV4ForCausalLM

        from shardlm.checkpoint.hf_deepseek_v4 import model_config_from_hf
        config, causal_lm = hf_config(num_nextn_predict_layers=0), DeepseekV4ForCausalLM
    else:
        from test_hf_nemotron_h import CONFIG, MOE
        from transformers import NemotronHConfig, NemotronHForCausalLM

        from shardlm.checkpoint.hf_nemotron_h import model_config_from_hf
        config, causal_lm = NemotronHConfig(**(CONFIG | (MOE if shape == "moe" else {}))), NemotronHForCausalLM
    with torch.device("meta"):
        model = causal_lm(config)
    return model_config_from_hf(config.to_dict()), model


@pytest.mark.parametrize("family,shape", [("gemma4", "dense"), ("gemma4", "moe"), ("nemotron_h", "dense"),
                                          ("nemotron_h", "moe"), ("kimi_linear", "moe"), ("deepseek_v4", "moe")])
def test_every_peft_module_is_a_module_of_the_hf_model(family, shape):
    cfg, model = family_model(family, shape)
    hf_modules = dict(model.named_modules())
    names = module_names(cfg)
    projections = [ours for ours in names
                   if ours.rsplit(".", 1)[-1] in ("q", "k", "v", "o", "up", "down", "gate", "q_b", "o_b")]
    assert projections, names
    for ours, (hf, _) in names.items():
        assert hf in hf_modules, f"{family} {shape}: {ours} -> {hf}, which {type(model).__name__} has not"


def test_models_without_peft_names_refuse_in_one_line():
    with pytest.raises(UserError, match="GPT and Llama-family models; this checkpoint's model is bert") as error:
        module_names(ModelConfig(arch="bert"))
    assert "\n" not in str(error.value)
