"""Llama's shapes and rules: which KV heads a TP rank reads, config errors that name the sizes, the FLOP
formula, the planner's parameter and activation counts against built models, the shipped configs, and
the pieces a pipeline stage runs."""

from __future__ import annotations

import pytest
import torch
from test_llama import PROBE, rank_model, tiny_config
from test_training import VOCAB

from shardlm.errors import UserError
from shardlm.models import build_model
from shardlm.models.config import ModelConfig
from shardlm.models.llama import kv_head_range
from shardlm.parallel import ParallelContext
from shardlm.plan.flops import flops_per_token
from shardlm.validation import validate


def test_kv_heads_split_or_replicated_by_tensor_parallel_size():
    assert [kv_head_range(6, 2, 2, r) for r in range(2)] == [(0, 1), (1, 2)]  # split
    assert [kv_head_range(6, 2, 3, r) for r in range(3)] == [(0, 1), (0, 2), (1, 2)]  # rank 1 reads both
    assert [kv_head_range(4, 2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_config_errors_name_the_sizes():
    def check(**model):
        config = tiny_config()
        for key, value in model.items():
            setattr(config.model, key, value)
        validate(config, world_size=config.parallel.tensor, check_paths=False)

    with pytest.raises(UserError, match="num_heads=4 is not divisible by model.num_kv_heads=3"):
        check(num_kv_heads=3)
    with pytest.raises(UserError, match="num_heads=4 is not divisible by parallel.tensor=3"):
        config = tiny_config(tp=3)
        validate(config, world_size=3, check_paths=False)
    with pytest.raises(UserError, match="llama settings"):
        check(arch="gpt", num_kv_heads=2)
    with pytest.raises(UserError, match="head size 5"):
        check(hidden_size=20)


def test_flop_formula_counts_swiglu_and_gqa():
    """Forward matmul FLOPs per token derived from the built model's own weight shapes: 2 per weight of
    every layer matrix and of the output layer, plus 4 s h per layer for QK^T and AV."""
    cfg = tiny_config().model
    model = build_model(cfg, ParallelContext.single(), seed=0)
    layer_weights = sum(p.numel() for n, p in model.layers.named_parameters() if p.ndim == 2)
    forward = 2 * layer_weights + cfg.num_layers * 4 * cfg.seq_length * cfg.hidden_size + 2 * cfg.hidden_size * VOCAB
    assert flops_per_token(cfg) == pytest.approx(3 * forward)
    gpt = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=VOCAB)
    assert flops_per_token(gpt) == pytest.approx(72 * 2 * 32 * 32 * (1 + 16 / (6 * 32) + VOCAB / (12 * 2 * 32)))


@pytest.mark.parametrize("tp,tie", [(1, False), (2, False), (4, False), (4, True)])
def test_planner_counts_the_parameters_each_rank_holds(tp, tie):
    from shardlm.plan.parameters import parameter_count

    cfg = tiny_config(tie=tie).model
    model = rank_model(cfg, tp, 0)
    sharded = sum(p.numel() for p in model.parameters() if hasattr(p, "tensor_parallel_dim"))
    replicated = sum(p.numel() for p in model.parameters() if not hasattr(p, "tensor_parallel_dim"))
    counted = parameter_count(cfg, tp)
    tensors = len(list(model.parameters()))
    assert (counted.sharded, counted.replicated, counted.tensors) == (sharded, replicated, tensors)


def test_llama3_presets_have_the_published_parameter_counts():
    from shardlm.plan.models import MODEL_PRESETS
    from shardlm.plan.parameters import parameter_count

    assert parameter_count(MODEL_PRESETS["llama3-8b"], 1).total == 8_030_261_248
    assert parameter_count(MODEL_PRESETS["llama3-70b"], 1).total == 70_553_706_496


@pytest.mark.parametrize("name,tp", [("llama-tiny", 1), ("llama-tiny", 2), ("llama-tiny", 4), ("llama3-8b", 8),
                                     ("llama3-70b", 8)])
def test_shipped_llama_configs_are_valid(name, tp):
    from pathlib import Path

    from shardlm.config import load_config

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / f"{name}.toml", [f"parallel.tensor={tp}"])
    assert config.model.arch == "llama" and config.model.kv_heads < config.model.num_heads
    validate(config, world_size=tp * 2, check_paths=False)


def test_stage_pieces_compose_to_the_forward():
    """embed, run_layers over consecutive blocks of layers, head: what a pipeline stage runs, with every layer
    rotating its own positions; the composition is the model's forward."""
    model = build_model(tiny_config().model, ParallelContext.single(), seed=0).eval()
    tokens = PROBE
    with torch.no_grad():
        x = model.embed(tokens)
        for name in model.layers:
            x = model.run_layers(x, [model.layers[name]])
        assert torch.equal(model.head(x), model(tokens))
    assert model.FIRST_STAGE == ("wte",) and model.LAST_STAGE == ("ln_f", "lm_head")


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_planner_activation_bytes_equal_what_autograd_saves(kv_heads):
    from shardlm.plan.measure import saved_activation_bytes
    from shardlm.plan.memory import layer_activation_bytes, numeric_format

    cfg = tiny_config(kv_heads=kv_heads).model
    model = build_model(cfg, ParallelContext.single(), seed=0)
    tokens = torch.randint(0, VOCAB, (3, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    saved = saved_activation_bytes(model, lambda: model(tokens, tokens).mean(), list(model.layers.values()))
    predicted = layer_activation_bytes(cfg, 1, 3, numeric_format("fp32"), backend="cpu")
    assert set(saved.by_layer.values()) == {predicted}
