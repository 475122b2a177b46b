"""`shardlm plan` counts DeepSeek-V4 (`shardlm.plan.deepseek_v4`): the preset's parameters are what transformers'
DeepseekV4ForCausalLM builds on the meta device from its default config (V4-Flash), the tiny model's are what
shardlm builds, at TP = 1, 2 and EP = 2; the FLOPs are the matmuls torch's FLOP counter sees a tiny model run,
forward and training step; `shardlm plan --model deepseek-v4` plans at 128K tokens.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from shardlm.models.config import ModelConfig
from shardlm.plan.deepseek_v4 import hyper_connection_bytes, v4_forward_flops, v4_layer_flops, v4_parameter_count
from shardlm.plan.flops import flops_per_token
from shardlm.plan.models import MODEL_PRESETS
from shardlm.plan.parameters import parameter_count

TINY = dict(arch="llama", num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=1, head_dim=16, seq_length=32,
            vocab_size=256, ffn_hidden_size=16, dropout=0.0, q_lora_rank=16, qk_rope_head_dim=8, sliding_window=32,
            attention_sinks=True, global_rope_theta=160000.0, hc_mult=2, compress_ratios=[8, 4, 0], output_groups=2,
            output_rank=8, index_topk=16, index_heads=2, index_head_dim=8, moe_num_experts=4, moe_top_k=2,
            moe_ffn_hidden_size=16, moe_shared_experts=1, moe_score="sqrtsoftplus", moe_routed_scaling=1.5,
            moe_expert_bias=True, moe_hash_layers=1, swiglu_clip=10.0)
"""Three layers: HCA (ratio 8, hash-routed MoE), CSA (ratio 4 with an indexer), sliding window only; 2 streams,
4 heads of 16, 2 output groups, 4 experts top-2 and a shared one. The window (32) covers the sequence and the
top-k (16) every entry, so the dense-masked attention computes exactly the keys the planner counts."""


def tiny_v4(**changes) -> ModelConfig:
    """`TINY` with `changes`."""
    return ModelConfig(**{**TINY, **changes})


def built(cfg: ModelConfig):
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    return build_model(cfg, ParallelContext.single(), seed=0)


def test_preset_counts_what_transformers_builds():
    """deepseek-v4 at TP = 1 is transformers' default DeepseekV4Config (V4-Flash) built on the meta device: its
    parameters plus the expert-bias and tid2eid buffers, which shardlm holds as (frozen) parameters; 284.3B."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from shardlm.checkpoint.hf_deepseek_v4 import model_config_from_hf

    hf = DeepseekV4Config()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf)
    held = ("e_score_correction_bias", "tid2eid")
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith(held))
    cfg = MODEL_PRESETS["deepseek-v4"]
    assert parameter_count(cfg, 1).total == sum(p.numel() for p in model.parameters()) + buffers == 284328206295
    converted = model_config_from_hf(hf.to_dict())  # the converter reads this shape, and the upstream's MTP depth
    assert converted.mtp_layers == 1 and cfg.mtp_layers == 0  # which transformers does not build
    assert dataclasses.replace(converted, seq_length=cfg.seq_length, attention_dropout=cfg.attention_dropout,
                               mtp_layers=0) == cfg
    assert MODEL_PRESETS["deepseek-v4-flash"] == cfg


def test_parameter_count_is_the_built_models():
    """Elements and tensors of the tiny model at TP = 1; at TP = 2 the shards and the replicated weights add up to
    the same total; EP = 2 holds half the experts. Counting CSA's compressor without its overlap, or the hash
    layer with an expert bias, would fail."""
    cfg = tiny_v4()
    params = list(built(cfg).parameters())
    count = parameter_count(cfg, 1)
    assert count.total == sum(p.numel() for p in params) and count.tensors == len(params)
    halves = v4_parameter_count(cfg, 2)
    assert 2 * halves.sharded + halves.replicated == count.total
    experts = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    assert count.expert == experts and count.total - v4_parameter_count(cfg, 1, ep=2).total == experts // 2


def test_each_layer_counts_its_own_kind():
    """`layer_parameter_count` of each layer (hash-routed HCA, CSA with its indexer, sliding) and
    `layers_parameter_count` of any set of them (what pipeline stages and FSDP units hold) are the built layers'."""
    from shardlm.plan.parameters import layer_parameter_count, layers_parameter_count

    cfg = tiny_v4()
    model = built(cfg)
    sizes = [sum(p.numel() for p in model.layers[str(i)].parameters()) for i in range(cfg.num_layers)]
    assert len(set(sizes)) == 3
    assert [layer_parameter_count(cfg, i, 1).total for i in range(cfg.num_layers)] == sizes
    assert layers_parameter_count(cfg, [2, 1], 1).total == sizes[1] + sizes[2]


@pytest.mark.parametrize("depth_ratios", [[], [4]], ids=["sliding depth", "csa depth"])
def test_multi_token_prediction_depths_count_what_the_model_builds(depth_ratios):
    """With one depth (DeepSeek's sliding one, or a CSA one with its indexer) the count is the built model's, at
    TP = 1 and 2; `v4_depth_count` is the depth's own share."""
    from shardlm.plan.deepseek_v4 import v4_depth_count

    cfg = tiny_v4(mtp_layers=1, compress_ratios=[8, 4, 0] + depth_ratios)
    model = built(cfg)
    params = list(model.parameters())
    count = parameter_count(cfg, 1)
    assert count.total == sum(p.numel() for p in params) and count.tensors == len(params)
    assert v4_depth_count(cfg, 1).total == sum(p.numel() for p in model.mtp.parameters())
    halves = parameter_count(cfg, 2)
    assert 2 * halves.sharded + halves.replicated == count.total


def counted(run) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def _plain_experts(model):
    """The experts' GEMMs one by one over the routed rows only (what the planner counts)."""
    for module in model.modules():
        if hasattr(module, "pad_rows"):
            module.grouped, module.pad_rows = False, 0
    return model


def test_flops_are_what_the_model_runs():
    """The tiny model's forward, counted by torch's FLOP counter, is `v4_forward_flops` per token; a training
    step (forward and backward) is `flops_per_token`: 3 x the forward less what the indexer's backward skips (each
    row's attention is one chunk of `compressed_core`, kept for the backward, not recomputed). A
    trained indexer reads detached inputs (its matrices get weight gradients only; its choice, scoring every entry,
    none; its loss pass over the chosen entries, `sparse_attention.indexer_divergence`, 3 x its forward); a
    frozen one (index_loss_coeff 0) runs no backward."""
    cfg = tiny_v4()
    model = _plain_experts(built(cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        forward = counted(lambda: model(tokens))
    assert forward == v4_forward_flops(cfg) * tokens.numel()

    def step():
        model(tokens).float().sum().backward()

    assert counted(step) == flops_per_token(cfg) * tokens.numel()
    indexer = v4_layer_flops(cfg, 1).indexer
    choice = 2 * cfg.index_heads * (cfg.index_head_dim + 1) * (cfg.seq_length // cfg.compress_ratios[1])
    divergence = 2 * cfg.index_heads * (cfg.index_head_dim + 1) * min(cfg.index_topk, cfg.seq_length // 4)
    assert indexer > 0 and flops_per_token(cfg) == 3 * v4_forward_flops(cfg) - indexer - choice + 3 * divergence
    frozen = dataclasses.replace(cfg, index_loss_coeff=0.0)  # forward only
    model = _plain_experts(built(frozen))
    assert counted(step) == flops_per_token(frozen) * tokens.numel()
    assert flops_per_token(frozen) == 3 * v4_forward_flops(frozen) - 2 * indexer


def test_multi_token_prediction_flops_are_what_the_model_runs():
    """With a CSA depth: the forward of the next-token and depth losses (the fused output layer and loss) is
    `v4_forward_flops` per token, a training step `flops_per_token`, less the output layer at the depth's ignored
    targets (the last position of each row), which the fused loss skips."""
    from shardlm.models.mtp import rolled_targets

    cfg = tiny_v4(mtp_layers=1, compress_ratios=[8, 4, 0, 4])
    model = _plain_experts(built(cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    rolled = [part[None] for part in rolled_targets(inputs, labels, 1)]

    def losses():
        return model(inputs, labels, mtp=rolled)

    skipped = int((rolled[1] == -100).sum()) * 2 * cfg.hidden_size * cfg.vocab_size
    with torch.no_grad():
        assert counted(losses) == v4_forward_flops(cfg) * inputs.numel() - skipped
    assert v4_forward_flops(cfg) > v4_forward_flops(dataclasses.replace(cfg, mtp_layers=0, compress_ratios=[8, 4, 0]))
    assert counted(lambda: losses().sum().backward()) == flops_per_token(cfg) * inputs.numel() - 3 * skipped
    # under full recomputation the layers run their forward once more, the depth (not checkpointed) does not: what
    # recomputation adds is the same with and without it, measured and planned
    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext

    plain = dataclasses.replace(cfg, mtp_layers=0, compress_ratios=[8, 4, 0])
    added = []
    for config, depths in ((cfg, rolled), (plain, None)):
        steps = []
        for recompute in ("none", "full"):
            model = _plain_experts(build_model(config, ParallelContext.single(), seed=0, recompute=recompute).train())
            steps.append(counted(lambda model=model, depths=depths: model(inputs, labels, mtp=depths).sum().backward()))
        added.append(steps[1] - steps[0])
    assert added[0] == added[1] > 0
    assert flops_per_token(cfg, True) - flops_per_token(cfg) == flops_per_token(plain, True) - flops_per_token(plain)


def test_long_sequences_pay_the_window_and_the_compressed_entries():
    """At 128K tokens a query of deepseek-v4 attends to the window (128) plus 1024 entries on HCA layers (128:1)
    and its 512 chosen ones on CSA layers (4:1 and top-k), while CSA's indexer scores all 32,768 entries at its
    width; doubling the sequence adds only HCA's entries and the indexer's scoring."""
    cfg = dataclasses.replace(MODEL_PRESETS["deepseek-v4"], seq_length=131072)
    kinds = [v4_layer_flops(cfg, i) for i in range(cfg.num_layers)]
    assert kinds[0].keys == 128 + 1024 and kinds[3].keys == 128 + 512 and kinds[0].indexer == 0
    longer = dataclasses.replace(cfg, seq_length=2 * cfg.seq_length)
    grown = v4_forward_flops(longer) - v4_forward_flops(cfg)
    hca, csa = cfg.compress_ratios.count(128), cfg.compress_ratios.count(4)
    heads, dim = cfg.num_heads, cfg.head_dim
    assert grown == hca * 4 * heads * dim * 1024 + csa * 2 * cfg.index_heads * (cfg.index_head_dim + 1) * 32768
    # docs/sparse-attention.md's figures: 42.5 GFLOP forward and 106.0 of training a token with the indexers
    # trained (105.0 frozen); dense keys add 734
    assert (round(v4_forward_flops(cfg) / 1e9, 1), round(flops_per_token(cfg) / 1e9, 1)) == (42.5, 106.0)
    assert round(flops_per_token(dataclasses.replace(cfg, index_loss_coeff=0.0)) / 1e9, 1) == 105.0
    dense = sum(4 * heads * dim * (cfg.seq_length - kind.keys) for kind in kinds)
    assert round(dense / 1e9) == 734 and round(kinds[3].indexer / 1e9, 2) == 0.56


def test_shardlm_plan_plans_deepseek_v4(capsys):
    """`shardlm plan --model deepseek-v4` at 128K tokens prints a plan with the preset's 284B parameters."""
    from shardlm.cli import main

    args = ["plan", "--model", "deepseek-v4", "--gpu", "h100", "--gpus", "256", "--global-batch", "64",
            "--seq-length", "131072", "--pipeline", "4", "--micro-batch", "1", "--expert", "16"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "284B parameters" in out and "Recommended: " in out


def test_a_config_with_a_depth_and_qlora_plans_skipping_what_its_output_groups_cannot_split(tmp_path, capsys):
    """A V4 config (2 output groups, an MTP depth, QLoRA on all-linear and the experts) plans on 8 GPUs: TP=4 and 8,
    which 2 groups do not divide, are skipped with the reason, not the whole plan refused."""
    from shardlm.cli import main

    model = TINY | {"mtp_layers": 1, "compress_ratios": [8, 4, 0, 4], "num_heads": 8}
    lines = ["[model]"] + [f"{key} = {json.dumps(value)}" for key, value in model.items()]
    lines += ["[lora]", "rank = 4", 'quantize = "nf4"', 'targets = ["all-linear", "experts"]']
    (tmp_path / "v4.toml").write_text("\n".join(lines) + "\n")
    assert main(["plan", "--model", str(tmp_path / "v4.toml"), "--gpu", "h100", "--gpus", "8",
                 "--global-batch", "16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 output groups are not divisible by TP=4" in out and "Recommended: " in out and "QLoRA" in out


def _saved(run, exclude) -> int:
    """Bytes of the storages autograd saves while `run()` builds its graph (each once, `exclude`'s not)."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        kept = run()
    del kept
    return sum(seen.values())


@pytest.mark.parametrize("n,iters,batch,seq,hidden", [(2, 20, 1, 32, 32), (4, 3, 2, 16, 64), (3, 5, 1, 8, 16)])
def test_a_hyper_connection_saves_what_the_planner_counts(n, iters, batch, seq, hidden):
    """One branch's `HyperConnection` and `expand` in fp32 save `hyper_connection_bytes` (streams, output, the
    normalized streams, the mixes and every Sinkhorn round)."""
    from shardlm.models.hyper_connections import HyperConnection, expand
    from shardlm.parallel import ParallelContext

    cfg = tiny_v4(hc_mult=n, hc_sinkhorn_iters=iters, hidden_size=hidden)
    hc = HyperConnection(cfg, ParallelContext.single(), 0, "hc", False)
    streams = torch.randn(batch, seq, n, hidden, requires_grad=True)
    output = torch.randn(batch, seq, hidden, requires_grad=True)

    def run():
        post, comb, _ = hc(streams)
        return expand(output, post, comb, streams)

    assert _saved(run, hc.parameters()) == hyper_connection_bytes(cfg, batch * seq, 4)


def test_the_plan_keeps_the_streams_and_the_hyper_connections():
    """Under full recomputation a layer keeps its input, the n streams (B, T, n, h): the tiny model's checkpointed
    layers save exactly the planner's layer_input each (n h fp32 values a token) beyond what the model without
    recomputation saves outside its layers (a layer's own: `test_each_layer_kind_saves_what_the_planner_counts`)."""
    from test_plan_linear_attention import saved_by_layer

    from shardlm.models import build_model
    from shardlm.parallel import ParallelContext
    from shardlm.plan.activations import LayerSetting, shardlm_memory
    from shardlm.plan.memory import numeric_format

    cfg, fp32 = tiny_v4(), numeric_format("fp32")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    outside = {}
    for checkpointing in (False, True):
        model = build_model(cfg, ParallelContext.single(), seed=0, activation_checkpointing=checkpointing).train()
        outside[checkpointing] = saved_by_layer(model, lambda m=model: m(tokens, tokens).mean())[None]
    acts = shardlm_memory(cfg, 1, 2, fp32, LayerSetting(), backend="cpu")
    assert acts.layer_input == 2 * cfg.seq_length * cfg.hc_mult * cfg.hidden_size * 4
    assert outside[True] - outside[False] == cfg.num_layers * acts.layer_input


KINDS = [  # (case, changes, micro-batch, recompute the core)
    ("one chunk", dict(seq_length=32), 2, False),
    ("chunks kept", dict(seq_length=256, sliding_window=64), 2, False),
    ("chunks kept, CSA gathered", dict(seq_length=64, sliding_window=16, index_topk=2), 2, False),
    ("recomputed, entries not dividing the row", dict(seq_length=203, sliding_window=48), 1, True),
    ("recomputed, CSA gathered", dict(seq_length=64, sliding_window=16, index_topk=2), 2, True),
    ("recomputed, frozen indexer, chunks of one query", dict(seq_length=256, sliding_window=64, index_loss_coeff=0.0),
     1, True),
]
"""Each case runs the tiny model's three layer kinds (HCA with hash routing, CSA, sliding). "recomputed": the core's
CHUNK_ELEMENTS lowered to 1,024, so that it recomputes its chunks (as every layer of a real model does at 4,096
tokens and more); the last case's chunks are then one query each (a view of q, not a copy)."""


def _layer_saves(cfg: ModelConfig, micro: int, recompute: bool, monkeypatch, precision: str = "fp32",
                 attention_only: bool = False) -> list[int]:
    """What each of the tiny model's layers (or only their attention) keeps for the backward, in `precision` ("half":
    bf16 weights, no autocast)."""
    from test_plan_linear_attention import saved_by_layer

    from shardlm.models import build_model, compressed_core
    from shardlm.parallel import ParallelContext
    from shardlm.plan.measure import autocast_context

    if recompute:
        monkeypatch.setattr(compressed_core, "CHUNK_ELEMENTS", 1024)
    model = build_model(cfg, ParallelContext.single(), seed=0).train()
    model = model.to(torch.bfloat16) if precision == "half" else model
    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_length), generator=torch.Generator().manual_seed(0))

    def forward():
        with autocast_context("fp32" if precision == "half" else precision, torch.device("cpu")):
            return model(tokens, tokens).mean()

    watched = model
    if attention_only:
        watched = types.SimpleNamespace(layers={i: layer.attn for i, layer in model.layers.items()},
                                        parameters=model.parameters)
    saved = saved_by_layer(watched, forward)
    return [saved[i] for i in range(cfg.num_layers)]


def _attention_bytes(cfg: ModelConfig, micro: int, fmt, recompute: bool, monkeypatch) -> list[int]:
    from shardlm.models import compressed_core
    from shardlm.plan.v4_activations import v4_attention_bytes

    if recompute:
        monkeypatch.setattr(compressed_core, "CHUNK_ELEMENTS", 1024)
    return [v4_attention_bytes(cfg, i, 1, micro, fmt) for i in range(cfg.num_layers)]


@pytest.mark.parametrize("case,changes,micro,recompute", KINDS, ids=[k[0] for k in KINDS])
def test_each_layer_kind_saves_what_the_planner_counts(case, changes, micro, recompute, monkeypatch):
    """fp32 on the CPU: each layer of each kind keeps for the backward exactly the planner's bytes: the Llama layer's
    norms, the MoE (`experts.moe_layer_activation_bytes`, with V4's clip and score sum), the two hyper-connections,
    and its attention (`v4_attention_bytes`: the projections, the norms, the rotations, the compressors, the trained
    indexer's gradients, and the core's kept scores or its recomputed inputs). The planner's layer is the largest."""
    from shardlm.plan.activations import LayerSetting, shardlm_memory
    from shardlm.plan.memory import numeric_format

    cfg, fp32 = tiny_v4(**changes), numeric_format("fp32")
    saved = _layer_saves(cfg, micro, recompute, monkeypatch)
    attention = _attention_bytes(cfg, micro, fp32, recompute, monkeypatch)
    largest = shardlm_memory(cfg, 1, micro, fp32, LayerSetting(), backend="cpu").per_layer
    assert saved == [largest - max(attention) + a for a in attention]
    assert max(saved) == largest and len(set(attention)) == 3


@pytest.mark.parametrize("precision", ["bf16", "half"])
@pytest.mark.parametrize("case,changes,micro,recompute", KINDS[1:5], ids=[k[0] for k in KINDS[1:5]])
def test_the_attention_in_half_precision_saves_what_the_planner_counts(case, changes, micro, recompute, precision,
                                                                       monkeypatch):
    """Under bf16 autocast (its copies of each linear's input and weight; the fp32 norms' copies of their inputs;
    the scores in bf16) and with bf16 weights (the norms' fp32 copies of their weights), each layer's attention keeps
    `v4_attention_bytes` plus its input (the norm's output, which the Llama layer counts). The rest of the layer is
    not compared: on the CPU the MoE's bf16 grouped GEMMs pad each expert's rows by the routing."""
    from shardlm.plan.memory import numeric_format

    cfg = tiny_v4(**changes)
    fmt = numeric_format("bf16", param_dtype="half" if precision == "half" else "fp32")
    saved = _layer_saves(cfg, micro, recompute, monkeypatch, precision, attention_only=True)
    x = micro * cfg.seq_length * cfg.hidden_size * fmt.matmul_bytes
    assert saved == [x + a for a in _attention_bytes(cfg, micro, fmt, recompute, monkeypatch)]


def test_the_key_projections_are_the_planned_width():
    """What each layer's key_inputs hold per token (what a CP rank projects, and gathers for packed rows) is the
    planner's `key_projection_width`: HCA kv and gate, CSA's overlapping ones and its indexer's, sliding kv only."""
    from shardlm.plan.deepseek_v4 import key_projection_width

    cfg = tiny_v4()
    model = built(cfg)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size)
    widths = [sum(p.shape[-1] for p in layer.attn.key_inputs([x] * 3)) for layer in model.layers.values()]
    assert widths == [key_projection_width(cfg, i) for i in range(3)] == [48, 112, 16]


def test_context_parallel_gathers_cost_their_bytes():
    """`context.compressed_gather_seconds`: each layer's collectives (`compressed_gathers`, checked against the
    model's in `test_deepseek_v4_layouts`) move (C - 1) / C of their bytes, forward and backward, and the forward's
    again under full recomputation, with C - 1 latencies each."""
    from shardlm.plan.context import compressed_gather_seconds, compressed_gathers

    wide = tiny_v4()  # a window of 32 reaches past a CP=2 rank's chunks of 8: every position's projections
    assert [compressed_gathers(wide, 2, i) for i in range(3)] == [(1, 32 * 48), (1, 32 * 112), (1, 32 * 16)]
    cfg = tiny_v4(seq_length=64, sliding_window=8)  # chunks of 16: halos of 7, and the entries (HCA 8, CSA 16)
    assert [compressed_gathers(cfg, 2, i) for i in range(3)] == [
        (2, 4 * 7 * 48 + 8 * 16), (2, 4 * 7 * 112 + 16 * (16 + 8)), (1, 4 * 7 * 16)]
    one = sum(3 / 4 * 2 * elements * 2 / 1e9 + collectives * 3 * 1e-5
              for collectives, elements in (compressed_gathers(cfg, 4, i) for i in range(3))) / 3
    assert compressed_gather_seconds(cfg, 4, 2, 2, False, 1e9, 1e-5) == pytest.approx(2 * one)
    assert compressed_gather_seconds(cfg, 4, 2, 2, True, 1e9, 1e-5) == pytest.approx(3 * one)
