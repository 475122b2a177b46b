"""One process, DeepSeek-V4 runs (the layouts' model, `test_deepseek_v4_layouts.V4`): a hash layer off the first
pipeline stage refused in one line, in the model and before the run; LoRA on the grouped o_a equal to its merged
weight; a from-scratch hash table spreading the tokens; the step line and metrics carrying the depth's loss; the
shipped tiny config valid at the layouts it names; the run banner naming what context-parallel ranks exchange.
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_v4_layouts import SEQ, v4_config
from test_sft_layouts import train_data, valid_data
from test_training import VOCAB

from shardlm.errors import UserError
from shardlm.models import compressed_attention
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate


def test_a_hash_layer_off_the_first_stage_is_refused_in_one_line():
    from shardlm.models import build_model

    config = v4_config()
    model = build_model(config.model, ParallelContext.single(), layer_ids=[0, 1])  # stage with layer 0: fine
    model.train()
    stage = build_model(config.model, ParallelContext.single(), layer_ids=[2, 3])
    streams = torch.zeros(1, SEQ, 2, 32)
    config.model.moe_hash_layers = 3
    late = build_model(config.model, ParallelContext.single(), layer_ids=[2, 3])
    assert stage.run_layers(streams, stage.layers.values()).shape == streams.shape
    with pytest.raises(UserError, match="first stage") as error:
        late.run_layers(streams, late.layers.values())
    assert "\n" not in str(error.value)


def test_hash_layers_beyond_the_first_stage_are_refused_before_the_run_in_one_line():
    """Validation (before any model is built) refuses hash layers the first pipeline stage does not hold, naming
    parallel.first_stage_layers; with it raised the layout is valid."""
    config = v4_config(pp=2, micro=1)
    config.model.moe_hash_layers = 3  # layers 0-2; the first of two stages holds 0-1
    with pytest.raises(UserError, match=r"first pipeline stage holds, and it has 2 layers; set "
                                        r"parallel.first_stage_layers >= 3") as error:
        validate(config, 2, check_paths=False)
    assert "\n" not in str(error.value)
    config.parallel.first_stage_layers = 3
    validate(config, 2, check_paths=False)


def test_lora_on_the_grouped_output_projection_equals_its_merged_weight():
    """o_a's adapter, applied group by group (`CompressedAttention.grouped_lora`), gives the logits of o_a with
    scale B A merged into its weight (what `convert --merge` exports and transformers' grouped linear then applies),
    with B drawn nonzero so that the update counts; a control: the logits without the update differ."""
    from shardlm.lora.merge import merge_adapters

    config = v4_config(lora=4, mtp=False)
    config.lora.targets = ["o_a"]
    trainer = Trainer(config, ParallelContext.single(), train_data(), valid_data())
    model = trainer.model.eval()
    generator = torch.Generator().manual_seed(1)
    adapters = [m.o_a.lora for m in model.modules() if isinstance(m, compressed_attention.CompressedAttention)]
    assert adapters and all(a is not None for a in adapters)
    with torch.no_grad():
        for adapter in adapters:
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=generator) * 0.5)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    with torch.no_grad():
        adapted = model(tokens)
        saved = [a.scale for a in adapters]
        for adapter in adapters:
            adapter.scale = 0.0
        plain = model(tokens)
        for adapter, scale in zip(adapters, saved):
            adapter.scale = scale
        merge_adapters(model)
        merged = model(tokens)
    torch.testing.assert_close(adapted, merged, rtol=1e-5, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-3


def test_a_from_scratch_hash_table_spreads_the_tokens():
    """A hash layer built from scratch draws each token's experts (k distinct of them, every expert used), the same
    table for the same seed: not a zero table sending every token to expert 0 twice."""
    from shardlm.models import build_model

    config = v4_config(mtp=False)
    tables = [build_model(config.model, ParallelContext.single(), seed=seed).layers["0"].mlp.router.tid2eid
              for seed in (7, 7, 8)]
    table = tables[0].long()
    assert table.shape == (VOCAB, 2) and bool((table[:, 0] != table[:, 1]).all())
    assert torch.bincount(table.reshape(-1), minlength=4).min() > 0
    assert torch.equal(tables[0], tables[1]) and not torch.equal(tables[0], tables[2])


def test_the_step_line_and_metrics_show_the_depths_loss(tmp_path, capsys):
    """The step's console line and metrics.jsonl carry the multi-token-prediction loss ("mtp loss")."""
    import json

    from shardlm.training.logging import RunLogger

    trainer = Trainer(v4_config(), ParallelContext.single(), train_data(), valid_data())
    metrics = trainer.train_step()
    logger = RunLogger(tmp_path, 1, enabled=True, progress=False, tensorboard=False)
    logger.step(metrics, 1)
    logger.close(plot=False)
    assert metrics["mtp_loss"] > 0 and f"mtp loss {metrics['mtp_loss']:.4f}" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mtp_loss"] == metrics["mtp_loss"]


@pytest.mark.parametrize("nproc,overrides", [(1, {}), (2, {"tensor": 2, "sequence_parallel": True}),
                                             (2, {"context": 2})])
def test_the_shipped_config_is_valid_at_the_layouts_it_names(nproc, overrides):
    """configs/tiny-deepseek-v4.toml (HCA, CSA and sliding layers, a hash layer, an MTP depth) validates at one process
    and at the TP 2 + SP and CP 2 its header names."""
    from pathlib import Path

    from shardlm.config import load_config

    config = load_config(Path(__file__).parent.parent / "configs" / "tiny-deepseek-v4.toml")
    for key, value in overrides.items():
        setattr(config.parallel, key, value)
    m = config.model
    assert (m.hc_mult, m.mtp_layers, m.moe_hash_layers, m.compress_ratios) == (2, 1, 1, [0, 16, 4, 16])
    validate(config, nproc, check_paths=False)


def test_the_run_banner_names_what_context_parallel_ranks_exchange():
    """The banner's CP field: K/V by parallel.cp_comm, V4's gathered entries and halos, DSA's gathered latents."""
    from shardlm.models.config import ModelConfig
    from shardlm.training.run import context_exchange

    assert context_exchange(v4_config(cp=2).model, "ring") == "entries and halos gathered"
    assert context_exchange(ModelConfig(arch="llama", attention="mla", index_topk=4), "ring") == "latents gathered"
    assert context_exchange(ModelConfig(arch="llama"), "allgather") == "allgather"
