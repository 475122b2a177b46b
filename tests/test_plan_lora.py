"""The planner's LoRA and QLoRA (`[lora]` in a config, `shardlm.plan.lora`) against the models and trainer shardlm
builds. One process, no process groups (a TP > 1 rank is built with size-N communicators that nothing calls).

- Adapters: the trainable parameters the planner counts on a (TP, EP) rank (elements, tensors, routed experts')
  are those `add_adapters` leaves trainable on the model shardlm builds for that rank, for GQA Llama (K/V split at
  TP=2, replicated at TP=4), GPT, a Mixtral-shaped MoE with expert adapters (EP=2), MLA with and without the
  query's low rank, a Gated DeltaNet hybrid, Nemotron-H, Kimi Linear, GLM-5 and DeepSeek-V4 (with a
  multi-token-prediction depth), with several target sets and `modules_to_save`; the frozen rest too.
  Llama 3 8B's all-linear r=16 count is peft's published 41,943,040 (derived by hand below).
- NF4: at TP=1 the planner's bytes are `nf4.quantized_bytes` of every projection weight (each expert's matrices
  one by one) and what `quantize_base` stores; a TP shard keeps the blocks its values lie in (counted here by
  brute force) and the whole matrix's statistics.
- State bytes: a real `Trainer` with `[lora]` (fp32, QLoRA fp32, QLoRA with half parameters, ZeRO-1, GPT with its
  embedding trained, an MoE with expert adapters, DeepSeek-V4 with its depth in NF4) holds exactly the planner's
  parameters (trainable and frozen), gradients and optimizer state after a step.
- Activations: in fp32 a QLoRA layer run without `nf4.dequantize_again` (a recomputed one) saves its dequantized
  weights (the difference to LoRA of a layer whose input needs a gradient); LoRA's half base
  (`test_lora_half_base.py`).
- FSDP at DP=2 halves the sharded parts (parameters, gradients, moments; not the steps); the plan's rows use these
  figures; the command line prints the QLoRA line and the JSON its numbers; one-line errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardlm.config import LoraConfig, from_dict
from shardlm.lora import nf4
from shardlm.lora.apply import adaptable, add_adapters, quantize_base
from shardlm.models import build_model
from shardlm.models.config import ModelConfig
from shardlm.models.moe import GroupedExperts
from shardlm.parallel import ParallelContext
from shardlm.parallel.comm import CommStats, Communicator
from shardlm.plan.lora import BASE_BYTES, lora_count, nf4_rank_bytes
from shardlm.plan.lora_memory import (
    lora_fsdp_gathered_bytes,
    lora_fsdp_state_memory,
    lora_state_memory,
    saved_weight_bytes,
    working_copy_bytes,
)
from shardlm.plan.measure import measure_trainer_memory, saved_activation_bytes
from shardlm.plan.memory import numeric_format
from shardlm.plan.models import MODEL_PRESETS
from shardlm.training.trainer import Trainer

from layouts import MLA as LAYOUT_MLA

VOCAB, SEQ, MICRO = 100, 16, 2
BASE = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": SEQ, "vocab_size": VOCAB, "dropout": 0.0}
MOE = {"moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 24}
SHAPES = {  # name: [model] section
    "llama-gqa": {"arch": "llama", "num_kv_heads": 2},
    "gpt": {"arch": "gpt"},
    "mixtral": {"arch": "llama", "num_kv_heads": 2, **MOE, "moe_first_dense_layers": 1},
    "gpt-moe-shared": {"arch": "gpt", **MOE, "moe_shared_experts": 1},
    "mla": {"arch": "llama", **LAYOUT_MLA},
    "mla-no-q-lora": {"arch": "llama", **LAYOUT_MLA, "q_lora_rank": 0},
    "mla-depth": {"arch": "llama", **LAYOUT_MLA, **MOE, "mtp_layers": 1},  # DeepSeek-V3's shape with its depth
    "hybrid": {"arch": "llama", "num_kv_heads": 2, "head_dim": 8, "qk_norm": True, "attention_output_gate": True,
               "norm_zero_centered": True, "layer_types": ["linear_attention", "full_attention"],
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
               "linear_value_head_dim": 8},
    # Nemotron-H's blocks (Mamba-2, attention, ReLU^2 MLP, MoE with ReLU^2 experts), with and without the routers'
    # score-correction bias and a shared expert
    "nemotron-h": {"arch": "llama", "num_layers": 4, "num_kv_heads": 2, "layer_pattern": "M*-E", "mamba_num_heads": 4,
                   "mamba_head_dim": 8, "mamba_state_size": 8, "mamba_groups": 2, **MOE, "moe_score": "sigmoid",
                   "moe_expert_bias": True, "moe_shared_experts": 1, "moe_shared_ffn_hidden_size": 16},
    "nemotron-h-plain": {"arch": "llama", "num_layers": 4, "num_kv_heads": 2, "layer_pattern": "ME*M",
                         "mamba_num_heads": 4, "mamba_head_dim": 8, "mamba_state_size": 8, "mamba_groups": 2, **MOE},
    "kimi-linear": {"arch": "llama", "attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 0, "mla_nope": True, "v_head_dim": 8, "linear_attention_rule": "kimi_delta",
                    "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 4,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, **MOE},
    # GLM-5: layer 1 reuses layer 0's sparse-attention choice and holds no indexer
    "glm-5": {"arch": "llama", **LAYOUT_MLA, **MOE, "index_topk": 4, "index_heads": 2, "index_head_dim": 8,
              "index_layer_types": ["full", "shared"]},
    # DeepSeek-V4: a hash-routed HCA layer, a CSA one, a sliding one, then a CSA multi-token-prediction depth; the
    # adapters go on q_b, the grouped o_a, o_b and the shared expert's MLP
    "deepseek-v4": {"arch": "llama", "num_layers": 3, "num_kv_heads": 1, "head_dim": 16, "q_lora_rank": 16,
                    "qk_rope_head_dim": 4, "sliding_window": 5, "attention_sinks": True, "global_rope_theta": 1000.0,
                    "hc_mult": 2, "compress_ratios": [8, 4, 0, 4], "mtp_layers": 1, "output_groups": 2,
                    "output_rank": 8, "index_topk": 3, "index_heads": 2, "index_head_dim": 8, **MOE,
                    "moe_shared_experts": 1, "moe_score": "sqrtsoftplus", "moe_expert_bias": True,
                    "moe_hash_layers": 1, "swiglu_clip": 0.5},
}
LORAS = {
    "all-linear": LoraConfig(rank=4),
    "q-v-norm": LoraConfig(rank=3, targets=["q_proj", "v"], modules_to_save=["norm"]),
    "experts-embedding": LoraConfig(rank=2, targets=["all-linear", "experts"], modules_to_save=["embedding"]),
    "one-layer-experts": LoraConfig(rank=2, targets=["all-linear", "experts"], expert_layers=[1]),
}
COUNT_CASES = [  # (shape, lora, tp, ep)
    ("llama-gqa", "all-linear", 1, 1), ("llama-gqa", "all-linear", 2, 1), ("llama-gqa", "all-linear", 4, 1),
    ("llama-gqa", "q-v-norm", 2, 1), ("llama-gqa", "experts-embedding", 4, 1),
    ("gpt", "all-linear", 1, 1), ("gpt", "experts-embedding", 2, 1),
    ("mixtral", "experts-embedding", 1, 1), ("mixtral", "experts-embedding", 2, 2), ("mixtral", "all-linear", 2, 2),
    ("gpt-moe-shared", "one-layer-experts", 2, 2),  # both layers MoE: the experts of layer 1 only
    ("gpt-moe-shared", "experts-embedding", 2, 2),
    ("mla", "all-linear", 2, 1), ("mla-no-q-lora", "experts-embedding", 2, 1),
    ("hybrid", "all-linear", 2, 1), ("hybrid", "q-v-norm", 1, 1),
    ("nemotron-h", "experts-embedding", 1, 1), ("nemotron-h", "experts-embedding", 2, 2),
    ("nemotron-h", "q-v-norm", 2, 1), ("nemotron-h-plain", "one-layer-experts", 2, 2),
    ("kimi-linear", "experts-embedding", 2, 2), ("glm-5", "experts-embedding", 2, 1),
    ("deepseek-v4", "all-linear", 2, 1), ("deepseek-v4", "experts-embedding", 2, 2),
]


def model_config(name: str) -> ModelConfig:
    return ModelConfig(**(BASE | SHAPES[name]))


def rank_context(tp: int, tp_rank: int = 0, ep: int = 1, ep_rank: int = 0) -> ParallelContext:
    """One (TP, EP) rank's context in this process: communicators of the layout's sizes, never called."""
    stats = CommStats()
    return ParallelContext(rank=0, world_size=1, tp=Communicator("tp", None, tp, tp_rank, stats),
                           dp=Communicator("dp", None, 1, 0, stats), device=torch.device("cpu"), comm=stats,
                           ep=Communicator("ep", None, ep, ep_rank, stats))


def built(cfg: ModelConfig, lora: LoraConfig, ctx: ParallelContext):
    model = build_model(cfg, ctx, seed=1)
    add_adapters(model, lora, ctx, seed=1)
    return model


# ------------------------------------------------------------------------------------------------- adapters

@pytest.mark.parametrize("name,lora,tp,ep", COUNT_CASES)
def test_trainable_and_frozen_parameters_are_the_built_models(name, lora, tp, ep):
    cfg, config = model_config(name), LORAS[lora]
    model = built(cfg, config, rank_context(tp, 0, ep, 0))
    named = list(model.named_parameters())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    count = lora_count(cfg, config, tp, ep=ep)
    assert count.trainable.total == sum(p.numel() for _, p in trainable)
    assert count.trainable.tensors == len(trainable)
    assert count.trainable.expert == sum(p.numel() for _, p in trainable if getattr(p, "expert_parallel", False))
    assert count.adapters == sum(p.numel() for n, p in trainable if ".lora." in n)
    assert count.frozen == sum(p.numel() for _, p in named if not p.requires_grad)
    assert count.frozen_expert == sum(p.numel() for _, p in named
                                      if not p.requires_grad and getattr(p, "expert_parallel", False))
    assert count.quantized == count.nf4_bytes == 0
    assert count.root_frozen + count.root_trainable == sum(p.numel() for n, p in named if not n.startswith("layers."))


def test_llama3_8b_all_linear_rank_16_is_pefts_count():
    """Per layer (h 4096, 8 KV heads of 128, f 14,336), A (r, in) + B (out, r) = 16 (in + out):
    q, o 16 x 8,192 = 131,072 each; k, v 16 x 5,120 = 81,920 each; gate, up, down 16 x 18,432 = 294,912 each:
    1,310,720 a layer, x 32 = 41,943,040 (peft's print_trainable_parameters for Llama-3-8B, r=16, all-linear)."""
    count = lora_count(MODEL_PRESETS["llama3-8b"], LoraConfig(rank=16), 1)
    assert count.adapters == count.trainable.total == 32 * (2 * 131_072 + 2 * 81_920 + 3 * 294_912) == 41_943_040
    assert count.trainable.tensors == 32 * 7 * 2
    # TP=8: B of q, k, v, gate, up and A of o, down split; the whole factors r x (in of a column projection, out
    # of a row one) on every rank: 16 x (4096 x 5 + 4096 x 2) per layer
    split = 16 * (4096 + 1024 + 1024 + 14336 + 14336 + 4096 + 14336)
    assert lora_count(MODEL_PRESETS["llama3-8b"], LoraConfig(rank=16), 8).adapters == 32 * (split // 8 + 16 * 4096 * 7)


@pytest.mark.parametrize("name,lora", [("gpt", LoraConfig(rank=2, modules_to_save=["embedding", "norm"])),
                                       ("llama-gqa", LoraConfig(rank=2, modules_to_save=["embedding", "output"])),
                                       ("mla", LoraConfig(rank=2, modules_to_save=["embedding"]))])
def test_pipeline_ranks_hold_their_stages_adapters_and_ends(name, lora):
    """PP=2: each rank its layer's adapters; the first the embedding, the last the final norm and the output layer,
    which for GPT is a tied copy of the embedding that trains too (`LAST_STAGE = ("ln_f", "wte")`), so the ranks
    together train GPT's embedding twice and Llama's (untied) output layer once; the frozen rest adds up to what
    each rank holds (`stages.rank_parameter_count`)."""
    from shardlm.plan.stages import pipeline_layers, rank_parameter_count, rank_stages

    cfg = model_config(name)
    whole = lora_count(cfg, lora, 1)
    ranks = []
    for rank in range(2):
        stages = rank_stages(pipeline_layers(cfg.num_layers, 2, 1), 2, rank)
        held = rank_parameter_count(cfg, 1, stages, 1)
        count = lora_count(cfg, lora, 1, stages.layer_indices, stages.first, stages.last, 1, held)
        assert count.frozen + count.trainable.total - count.adapters == held.total
        ranks.append(count)
    assert ranks[0].adapters == ranks[1].adapters == whole.adapters // 2
    embedding = cfg.padded_vocab_size(1) * cfg.hidden_size
    copy = embedding if name == "gpt" else 0  # GPT's last stage trains its tied copy too
    assert ranks[0].trainable.total + ranks[1].trainable.total == whole.trainable.total + copy
    assert ranks[0].root_trainable == embedding


# ------------------------------------------------------------------------------------------------------ NF4

def stored(model) -> tuple[int, int]:
    """(bytes of the NF4 tensors, their weights' elements) of a quantized model."""
    weights = nf4.quantized(model)
    nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".parametrizations." in n)
    return nbytes, sum(w.shape.numel() for w in weights.values())


@pytest.mark.parametrize("name", ["llama-gqa", "gpt", "mixtral", "mla", "hybrid", "nemotron-h", "kimi-linear",
                                  "deepseek-v4"])
def test_nf4_bytes_at_tp1_are_quantized_bytes_of_every_projection_and_what_quantize_base_stores(name):
    cfg, lora = model_config(name), LoraConfig(rank=2, quantize="nf4")
    ctx = ParallelContext.single()
    model = built(cfg, lora, ctx)
    # the brief's formula, weight by weight: each projection's (out, in) and each expert's matrices one by one (those
    # of the layers and of DeepSeek-V4's multi-token-prediction depth)
    every = adaptable(model, within_layers=False)
    projections = [m for key, m in every.items() if key.startswith(("layers.", "mtp."))]
    assert any(key.startswith("mtp.") for key in every) == (name == "deepseek-v4")
    expected = sum(nf4.quantized_bytes(m.weight.shape) for m in projections)
    elements = sum(m.weight.numel() for m in projections)
    for module in model.modules():
        if isinstance(module, GroupedExperts):  # Nemotron-H's ReLU^2 experts too
            for stack in ([module.gate, module.up, module.down] if module.gated else [module.fc, module.proj]):
                expected += stack.shape[0] * nf4.quantized_bytes(stack.shape[1:])
                elements += stack.numel()
    count = lora_count(cfg, lora, 1)
    assert (count.nf4_bytes, count.quantized) == (expected, elements)
    frozen_before = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    quantize_base(model, ctx)
    assert stored(model) == (expected, elements)
    fp32 = [p for n, p in model.named_parameters() if not p.requires_grad and ".parametrizations." not in n]
    assert count.frozen == frozen_before - elements == sum(p.numel() for p in fp32)
    assert count.frozen_expert == sum(p.numel() for p in fp32 if getattr(p, "expert_parallel", False))
    assert 4.12 < count.bits_per_weight < 4.4  # tiny weights pay more for their offset and maxima than 4.127


def kept_blocks_by_brute_force(rows: int, cols: int, dim: int, tp: int, rank: int) -> int:
    """The blocks of 64 (row-major over the whole matrix) that rank's slice has a value in."""
    flat = np.arange(rows * cols).reshape(rows, cols)
    part = np.split(flat, tp, axis=dim)[rank]
    return len(set((part // 64).ravel().tolist()))


@pytest.mark.parametrize("rows,cols,dim,tp", [(3, 40, 0, 3), (2, 96, 1, 2), (24, 32, 0, 2), (32, 24, 1, 2),
                                              (20, 32, 0, 4), (48, 40, 1, 4), (128, 256, 1, 4), (512, 64, 0, 8)])
def test_a_tp_shard_keeps_the_blocks_its_values_lie_in(rows, cols, dim, tp):
    blocks = -(-rows * cols // 64)
    statistics = 4 * -(-blocks // 256) + 4  # the whole matrix's second-level maxima and offset, on every rank
    for rank in range(tp):
        kept = kept_blocks_by_brute_force(rows, cols, dim, tp, rank)
        assert nf4_rank_bytes(rows, cols, dim, tp, rank) == 33 * kept + statistics
    # by hand: rows (3, 40) over 3 ranks, rank 1 holds values 40..79, in blocks 0 and 1 of the 2
    assert nf4_rank_bytes(3, 40, 0, 3, 1) == 2 * 33 + 4 + 4
    # aligned shards split the blocks evenly: a 1/tp share of quantized_bytes' codes and statistics codes; 128 x 256
    # has 512 blocks, so 2 second-level maxima (8 bytes) and the offset (4) on every rank
    whole = nf4.quantized_bytes(torch.Size((128, 256)))
    assert nf4_rank_bytes(128, 256, 1, 4) == (whole - 12) // 4 + 12


def test_nf4_bytes_of_a_tp_rank_sum_its_projections_shards():
    """Llama GQA at TP=2 (K/V split): every projection's rank-0 shard (q, k, v, gate, up by rows, o, down by
    columns), counted by brute force over the built rank's weights."""
    cfg, lora, tp = model_config("llama-gqa"), LoraConfig(rank=2, quantize="nf4"), 2
    model = built(cfg, lora, rank_context(tp))
    expected = 0
    for module in adaptable(model).values():
        dim = getattr(module.weight, "tensor_parallel_dim", None)
        rows, cols = module.weight.shape
        if dim is None:
            expected += nf4.quantized_bytes(module.weight.shape)
            continue
        rows, cols = (rows * tp, cols) if dim == 0 else (rows, cols * tp)
        blocks = -(-rows * cols // 64)
        expected += 33 * kept_blocks_by_brute_force(rows, cols, dim, tp, 0) + 4 * -(-blocks // 256) + 4
    assert lora_count(cfg, lora, tp).nf4_bytes == expected


# ------------------------------------------------------------------------------------------------ state bytes

def run_config(name: str, lora: dict, **train) -> object:
    return from_dict({"model": BASE | SHAPES[name], "data": {"text_file": "unused"},
                      "train": {"precision": "fp32", "micro_batch_size": MICRO, "global_batch_size": MICRO,
                                "steps": 2, "seed": 5, **train}, "lora": lora})


def batches() -> list[np.ndarray]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (SEQ + 1,), generator=generator).numpy() for _ in range(8)]


def measured_memory(config) -> tuple[dict, int, Trainer]:
    """`measure_trainer_memory` of a trainer of `config` and the bytes of its frozen parameters' storages."""
    trainer = Trainer(config, ParallelContext.single(), batches())
    batch = torch.from_numpy(np.stack(batches()[:MICRO]))
    measured = measure_trainer_memory(trainer, batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
    frozen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in trainer.model.parameters() if not p.requires_grad}
    return measured, sum(frozen.values()), trainer


STATE_CASES = {
    "lora fp32": ("llama-gqa", {"rank": 4, "modules_to_save": ["norm"]}, {}),
    "qlora fp32": ("llama-gqa", {"rank": 4, "quantize": "nf4"}, {}),
    "qlora half": ("llama-gqa", {"rank": 4, "quantize": "nf4"}, {"precision": "bf16", "param_dtype": "half"}),
    # under bf16 autocast the projections of the layers and the depth, experts included, stored in bf16
    "lora half": ("llama-gqa", {"rank": 4, "modules_to_save": ["norm"]}, {"precision": "bf16", "param_dtype": "half"}),
    "lora bf16": ("mixtral", {"rank": 2, "targets": ["all-linear", "experts"]}, {"precision": "bf16"}),
    "v4 lora half depth": ("deepseek-v4", {"rank": 2, "targets": ["all-linear", "experts"]},
                           {"precision": "bf16", "param_dtype": "half"}),
    "lora zero1": ("llama-gqa", {"rank": 4, "targets": ["q", "v"]}, {"data_sharding": "optimizer"}),
    "gpt qlora embedding": ("gpt", {"rank": 3, "quantize": "nf4", "modules_to_save": ["embedding"]}, {}),
    "moe qlora experts": ("mixtral", {"rank": 2, "quantize": "nf4", "targets": ["all-linear", "experts"]}, {}),
    # the multi-token-prediction depth's projections and experts in NF4 too, trained through (no adapters of its own)
    "v4 qlora depth": ("deepseek-v4", {"rank": 2, "quantize": "nf4", "targets": ["all-linear", "experts"]}, {}),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_state_bytes_equal_a_lora_trainers(case):
    name, lora, train = STATE_CASES[case]
    config = run_config(name, lora, **train)
    measured, frozen, trainer = measured_memory(config)
    if config.lora.quantize and getattr(trainer.model, "mtp", None) is not None:  # a depth's block dequantizes
        # again in the backward too
        assert all(getattr(depth.block, "nf4_hooks", False) for depth in trainer.model.mtp)
    t = config.train
    count = lora_count(config.model, config.lora, 1, half_base=t.precision == "bf16")
    assert frozen == count.base_bytes() == BASE_BYTES * count.frozen + 2 * count.halved + count.nf4_bytes
    assert (count.halved > 0) == (t.precision == "bf16" and not config.lora.quantize)
    predicted = lora_state_memory(count, numeric_format(t.precision, "shardlm", t.param_dtype), 1,
                                  t.distributed_optimizer)
    assert (measured["parameters"] + frozen, measured["gradients"], measured["optimizer"]) == \
        (predicted.parameters, predicted.gradients, predicted.optimizer)


# ------------------------------------------------------------------------------------------------ activations

def test_an_fp32_qlora_layer_run_without_dequantize_again_saves_its_dequantized_weights():
    """What a layer recomputed under full recomputation saves (shardlm installs `nf4.dequantize_again` only without
    it): in layer 1 (its input needs a gradient, so every GEMM saves its weight operand) QLoRA saves what LoRA
    saves plus the dequantized fp32 weights, 4 bytes an NF4 element: `saved_weight_bytes` with recompute "full",
    nothing otherwise. (Layer 0's q, k and v see the frozen embedding's output, which needs no gradient: they save
    nothing; the plan's figure is an upper bound there.)"""
    cfg, ctx = model_config("llama-gqa"), ParallelContext.single()
    tokens = torch.from_numpy(np.stack(batches()[:MICRO]))[:, :SEQ]
    saved = {}
    for quantize in ("", "nf4"):
        lora = LoraConfig(rank=4, quantize=quantize)
        model = built(cfg, lora, ctx)
        if quantize:
            quantize_base(model, ctx)

        def step(model=model):
            loss = model(tokens, tokens).mean()
            loss.backward()
            return loss

        saved[quantize] = saved_activation_bytes(model, step, list(model.layers.values())).by_layer[1]
    fp32 = numeric_format("fp32")
    extra = saved_weight_bytes(cfg, lora, 1, 1, fp32, recompute="full")
    assert saved["nf4"] - saved[""] == extra == 4 * lora_count(cfg, lora, 1).layer_quantized > 0
    assert saved_weight_bytes(cfg, lora, 1, 1, fp32, recompute="none") == 0
    assert working_copy_bytes(lora_count(cfg, lora, 1), fp32, "full") == 0  # the saved ones are the working copy
    assert working_copy_bytes(lora_count(cfg, lora, 1), fp32, "none") == extra


# ------------------------------------------------------------------------------------------------------- FSDP

def test_fsdp_at_dp2_halves_the_sharded_parts():
    cfg, lora = model_config("mixtral"), LoraConfig(rank=4, quantize="nf4", targets=["all-linear", "experts"])
    count = lora_count(cfg, lora, 1)
    one, two = lora_fsdp_state_memory(count, 1), lora_fsdp_state_memory(count, 2)
    steps = 4 * count.trainable.tensors  # one AdamW step a tensor on every rank, sharded or not
    halve = lambda n: -(-n // 2)  # noqa: E731
    assert two.parameters == 4 * halve(count.trainable.total) + 4 * halve(count.frozen) + halve(count.nf4_bytes)
    assert one.parameters == 4 * count.trainable.total + 4 * count.frozen + count.nf4_bytes
    assert two.gradients == 4 * halve(count.trainable.total) and one.gradients == 4 * count.trainable.total
    assert two.optimizer - steps == 8 * halve(count.trainable.total) and one.optimizer - steps == \
        8 * count.trainable.total
    # EP=2: the experts' frozen and NF4 parts over the expert-DP ranks (DP 4 / EP 2)
    count2 = lora_count(cfg, lora, 1, ep=2)
    split = lora_fsdp_state_memory(count2, 4, 2)
    trained = count2.trainable
    assert split.parameters - 4 * (-(-(trained.total - trained.expert) // 4) + -(-trained.expert // 2)) == \
        4 * -(-(count2.frozen - count2.frozen_expert) // 4) + 4 * -(-count2.frozen_expert // 2) + \
        -(-(count2.nf4_bytes - count2.nf4_expert_bytes) // 4) + -(-count2.nf4_expert_bytes // 2)


def test_fsdp_gathers_the_root_two_layers_with_their_nf4_and_the_trainables_gradients():
    cfg, lora = model_config("llama-gqa"), LoraConfig(rank=4, quantize="nf4", modules_to_save=["norm"])
    count = lora_count(cfg, lora, 1)
    floats, nf4_bytes, trainable = count.gathered_layer
    # a layer: its 2 norms (32 each) fp32 and 7 adapters' elements, its 7 projections in NF4
    assert floats == 2 * 32 + count.adapters // 2 and trainable == count.adapters // 2
    assert nf4_bytes == count.nf4_bytes // 2
    root = count.root_frozen + count.root_trainable  # embedding, output layer, final norm (trained: 32)
    assert count.root_trainable == 32 and root == 2 * 128 * 32 + 32
    w = 2
    assert lora_fsdp_gathered_bytes(count, w, 1) == root * w + 2 * (floats * w + nf4_bytes) + 32 * w + 4 * trainable
    assert lora_fsdp_gathered_bytes(count, w, 4) == root * w + 2 * (floats * w + nf4_bytes) + \
        4 * count.trainable.total
    assert lora_fsdp_gathered_bytes(count, w, 4, pipeline=True) == \
        (count.frozen + count.trainable.total) * w + count.nf4_bytes + 4 * count.trainable.total


@pytest.mark.parametrize("name", ["deepseek-v4", "mla-depth"])
def test_the_depths_blocks_are_finished_as_they_are_built(name):
    """`build_model`'s per-layer step (QLoRA's quantization as each layer is built, so that a base larger than
    memory never stands whole in fp32) runs on each multi-token-prediction depth's block too, DeepSeek-V3's and
    V4's, after the layers'."""
    cfg = model_config(name)
    seen = []
    model = build_model(cfg, ParallelContext.single(), seed=1, finish_layer=seen.append)
    assert seen == [*model.layers.values(), *(depth.block for depth in model.mtp)] and len(model.mtp) == 1
