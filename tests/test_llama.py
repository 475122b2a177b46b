"""Llama: every TP x DP layout equal to one process, and transformers' logits at TP=2 and 3.

The reference `LlamaForCausalLM` is `llama_reference`'s (single-process interop: `test_llama_hf.py`).
shardlm's logits equal transformers' within 1e-4 at TP=2 and 3 (3 > 2 KV heads: KV weights
replicated) and greedy generation with the KV cache gives transformers' tokens. A tiny Llama with
grouped-query attention trains for 10 steps equal to one process at TP x DP 2x1, 1x2, 2x2 and 4x1
(TP=4 > 2 KV heads), each with and without gradient accumulation, and with sequence parallelism at TP=2
and TP=4; with dropout on, selective and full recomputation run the forward again in the backward and
give the run without recomputation, bitwise; a checkpoint saved at TP=4 loads at TP=1 and TP=2, one
saved at TP=2 loads at TP=4. Worlds: one of 2 processes, one of 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from llama_reference import LOGIT_TOL, hf_llama, logits_and_greedy
from test_memory import assert_recomputation_is_bitwise
from test_training import ADAM_EPS, STEPS, VOCAB, assert_same_run, synthetic_data

from shardlm.checkpoint import load_model, save_checkpoint
from shardlm.checkpoint.hf import to_hf
from shardlm.config import RunConfig, from_dict
from shardlm.models import build_model
from shardlm.models.config import ModelConfig
from shardlm.parallel import CommStats, Communicator, ParallelContext
from shardlm.training.trainer import Trainer

from layouts import count_forwards
from multiproc import merge_copies, run_workers


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The HF model, its saved directory, the converted shardlm file, and reference logits and tokens."""
    return hf_llama(tmp_path_factory.mktemp("llama"))


def tiny_config(tp: int = 1, micro: int = 8, tie: bool = False, checkpointing: bool = False,
                kv_heads: int = 2, pp: int = 1, sp: bool = False, recompute: str = "none", dropout: float = 0.0,
                **train) -> RunConfig:
    return from_dict({
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": kv_heads,
                  "ffn_hidden_size": 64, "seq_length": 16, "vocab_size": VOCAB, "dropout": dropout,
                  "tie_embeddings": tie},
        "parallel": {"tensor": tp, "pipeline": pp, "sequence_parallel": sp},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": micro, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 3, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 7,
                  "recompute": "full" if checkpointing else recompute, **train},
    })


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter in the TP=1 layout: shards gathered over TP, vocabulary padding removed."""
    out = {}
    for name, param in model.named_parameters():
        value = param.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP: gathered over DP
        if hasattr(param, "tensor_parallel_dim"):
            value = torch.cat(model.ctx.tp.all_gather(value.contiguous()), dim=param.tensor_parallel_dim)
        out[name] = value[:VOCAB].clone() if name in ("wte.weight", "lm_head.weight") else value.clone()
    return out


def whole_parameters(model) -> dict[str, torch.Tensor]:
    """Every pipeline stage's parameters in the TP=1 layout, on every rank; a name several ranks hold (the tied
    embedding's first- and last-stage copies, data replicas) must be bitwise equal on all (`merge_copies`)."""
    return merge_copies(model.ctx.world.all_gather_object(full_parameters(model)))


def train_run(ctx: ParallelContext, config: RunConfig):
    trainer = Trainer(config, ctx, synthetic_data())
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    params = whole_parameters(trainer.model) if ctx.pp_size > 1 else full_parameters(trainer.model)
    return (curve, params), trainer


PROBE = torch.arange(30).view(2, 15) % VOCAB  # tokens whose logits compare checkpoints


def tensor_parallel_all_reduces(ctx: ParallelContext, config: RunConfig) -> tuple[int, int]:
    """(forward, backward) sum all-reduces over TP of one training forward and backward of a fresh model."""
    model = build_model(config.model, ctx, seed=7)
    batch = torch.stack([torch.as_tensor(synthetic_data()[i]) for i in range(4)])
    ctx.comm.reset()
    loss = model(batch[:, :-1], batch[:, 1:]).mean()
    forward = ctx.comm.count("all_reduce", "tp")
    loss.backward()
    return forward, ctx.comm.count("all_reduce", "tp") - forward


# At TP=2, rank 0's 6 query heads read KV heads 0, 0, 0, 0, 1, 1 (not SDPA's even grouping).
UNEVEN = ModelConfig(arch="llama", num_layers=2, hidden_size=96, num_heads=12, num_kv_heads=3, ffn_hidden_size=64,
                     seq_length=16, vocab_size=VOCAB, dropout=0.0)


def uneven_logits(ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of PROBE, the same logits decoded through the KV cache in three pieces) of the UNEVEN model."""
    model = build_model(UNEVEN, ctx, seed=3).eval()
    cache = model.new_kv_cache()
    with torch.no_grad():
        cached = [model(PROBE[:, :7], cache=cache), model(PROBE[:, 7:8], cache=cache), model(PROBE[:, 8:], cache=cache)]
        return model.full_logits(model(PROBE)), model.full_logits(torch.cat(cached, dim=1))


def sequence_parallel_forward(model) -> dict:
    """One training forward of a batch of 4: the embedding output's shape (a sequence chunk per rank under
    sequence parallelism), then the reduce-scatters and all-gathers over TP of the whole forward."""
    batch = torch.stack([torch.as_tensor(synthetic_data()[i]) for i in range(4)])
    with torch.no_grad():
        embedded = tuple(model.embed(batch[:, :-1]).shape)
        model.ctx.comm.reset()
        model(batch[:, :-1], batch[:, 1:])
    comm = model.ctx.comm
    return {"flag": model.sequence_parallel, "embedded": embedded,
            "reduce_scatter": comm.count("reduce_scatter", "tp"), "all_gather": comm.count("all_gather", "tp")}


RECOMPUTE_STEPS = 3


def recompute_runs() -> dict:
    """TP=2 with sequence parallelism and dropout 0.1 (embedding, attention, residuals), the same seed, in each
    recompute mode: the curve, the final parameters and the forward calls of layers and attention cores."""
    ctx = ParallelContext.from_process_group(2)
    out = {}
    for mode in ("none", "selective", "full"):
        ctx.rng = None
        trainer = Trainer(tiny_config(2, 8, sp=True, recompute=mode, dropout=0.1), ctx, synthetic_data())
        counts = count_forwards(trainer.model)
        curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(RECOMPUTE_STEPS))]
        out[mode] = {"curve": curve, "params": full_parameters(trainer.model), "counts": dict(counts)}
    return out


def rank_model(cfg: ModelConfig, tp: int, rank: int):
    """TP rank `rank`'s Llama of a TP=`tp` layout, built without a process group (construction communicates nothing)."""
    stats = CommStats()
    ctx = ParallelContext(rank=rank, world_size=tp, tp=Communicator("tp", None, tp, rank, stats),
                          dp=Communicator("dp", None, 1, 0, stats), device=torch.device("cpu"), comm=stats)
    return build_model(cfg, ctx, seed=0)


def probe_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.full_logits(model.eval()(PROBE))


# -------------------------------------------------------------------------------------- in workers

def worker_world2(hf: dict):
    """Layouts 2x1 (untied and tied) and 1x2, with and without accumulation; TP=2 logits, greedy tokens and the
    KV cache of the HF model."""
    out = {}
    for label, tp, micro, tie in (("2x1", 2, 8, False), ("1x2", 1, 4, False), ("2x1-tied", 2, 8, True),
                                  ("2x1-accum", 2, 4, False), ("1x2-accum", 1, 2, False)):
        out[label] = train_run(ParallelContext.from_process_group(tp), tiny_config(tp, micro, tie))[0]
    zero = tiny_config(1, 4, distributed_optimizer=True)
    out["1x2-zero"] = train_run(ParallelContext.from_process_group(1), zero)[0]
    ctx = ParallelContext.from_process_group(2)
    out["2x1-sp-selective"], trainer = train_run(ctx, tiny_config(2, 4, sp=True, recompute="selective"))
    out["sp_engaged"] = trainer.model.sequence_parallel and trainer.model.layers["0"].attn.selective_recompute
    out["sp_forward_tp2"] = sequence_parallel_forward(trainer.model)
    for label, tie in (("pp2", False), ("pp2-tied", True)):
        ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
        out[label] = train_run(ctx, tiny_config(1, 2, tie, pp=2))[0]
    out["recompute"] = recompute_runs()
    ctx = ParallelContext.from_process_group(2)
    out["all_reduces_tp2"] = tensor_parallel_all_reduces(ctx, tiny_config(2))
    ctx.rng = None
    out["uneven_tp2"] = uneven_logits(ctx)
    out["hf_tp2"] = logits_and_greedy(hf["converted"], ctx, hf["tokens"])
    model, _ = load_model(hf["converted"], ctx)
    cache = model.new_kv_cache()
    with torch.no_grad():
        model(hf["tokens"][:, :10], cache=cache)
    out["cache_shape_tp2"] = tuple(cache.layers[0].keys.shape)
    return out


def sub_context(ranks: list[int]) -> ParallelContext | None:
    """A TP group of `ranks` (DP=1) inside the running world, for a TP size the world size is not a
    multiple of; None on the other ranks. Collective: every rank calls it."""
    group = dist.new_group(ranks)
    rank = dist.get_rank()
    if rank not in ranks:
        return None
    stats = CommStats()
    tp = Communicator("tp", group, len(ranks), ranks.index(rank), stats)
    return ParallelContext(rank=ranks.index(rank), world_size=len(ranks), tp=tp, device=torch.device("cpu"),
                           dp=Communicator("dp", None, 1, 0, stats), comm=stats,
                           world=Communicator("world", group, len(ranks), ranks.index(rank), stats))


def worker_world4(hf: dict, checkpoints: str):
    """Layouts 2x2 and 4x1 (KV replicated), with and without accumulation; checkpoints across TP 4 <-> 2; TP=3
    logits and greedy tokens."""
    out = {}
    out["2x2"], trainer_2x2 = train_run(ParallelContext.from_process_group(2), tiny_config(2, 4))
    out["4x1"], trainer_4x1 = train_run(ParallelContext.from_process_group(4), tiny_config(4, 8))
    out["2x2-accum"] = train_run(ParallelContext.from_process_group(2), tiny_config(2, 2))[0]
    out["4x1-accum"] = train_run(ParallelContext.from_process_group(4), tiny_config(4, 4))[0]
    out["2x2-one-kv-head"] = train_run(ParallelContext.from_process_group(2), tiny_config(2, 4, kv_heads=1))[0]
    zero = tiny_config(2, 4, kv_heads=1, distributed_optimizer=True)
    out["2x2-one-kv-head-zero"] = train_run(ParallelContext.from_process_group(2), zero)[0]
    out["4x1-sp"], trainer_4x1_sp = train_run(ParallelContext.from_process_group(4), tiny_config(4, 8, sp=True))
    out["sp_forward_tp4"] = sequence_parallel_forward(trainer_4x1_sp.model)
    ctx = ParallelContext.from_process_group(2, pipeline_parallel=2)
    out["tp2-pp2-one-kv-head"] = train_run(ctx, tiny_config(2, 2, kv_heads=1, pp=2))[0]
    out["kv_replicated_tp4"] = not hasattr(trainer_4x1.model.layers["0"].attn.k.weight, "tensor_parallel_dim")
    out["all_reduces_tp4"] = tensor_parallel_all_reduces(trainer_4x1.ctx, tiny_config(4))
    out["logits_4x1"] = probe_logits(trainer_4x1.model)
    out["logits_2x2"] = probe_logits(trainer_2x2.model)
    save_checkpoint(trainer_4x1, f"{checkpoints}/tp4")
    save_checkpoint(trainer_2x2, f"{checkpoints}/tp2")
    out["tp4_loaded_at_tp2"] = probe_logits(load_model(f"{checkpoints}/tp4", ParallelContext.from_process_group(2))[0])
    out["tp2_loaded_at_tp4"] = probe_logits(load_model(f"{checkpoints}/tp2", ParallelContext.from_process_group(4))[0])
    ctx3 = sub_context([0, 1, 2])
    if ctx3 is not None:
        out["hf_tp3"] = logits_and_greedy(hf["converted"], ctx3, hf["tokens"])
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    runs = {tie: train_run(ctx, tiny_config(tie=tie))[0] for tie in (False, True)}
    return {**runs, "one-kv-head": train_run(ctx, tiny_config(kv_heads=1))[0]}


def assert_every_rank(world: dict, layout: str, ref) -> None:
    """`layout`'s run equals `ref` on every rank of `world` (TP shards gathered, each DP replica on its own)."""
    for rank, results in enumerate(world["ranks"]):
        try:
            assert_same_run(results[layout], ref)
        except AssertionError as error:
            raise AssertionError(f"rank {rank}: {error}") from None


def shared(hf_model) -> dict:
    return {k: hf_model[k] for k in ("converted", "tokens")}


@pytest.fixture(scope="module")
def world2(hf_model):
    results = run_workers(2, worker_world2, shared(hf_model))
    return {**results[0], "ranks": results}


@pytest.fixture(scope="module")
def world4(hf_model, tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    results = run_workers(4, worker_world4, shared(hf_model), str(checkpoints))
    return {**results[0], "ranks": results, "checkpoints": checkpoints}


@pytest.mark.slow
def test_tp2_and_tp3_logits_and_greedy_tokens_match_transformers(hf_model, world2, world4):
    for logits, tokens in (world2["hf_tp2"], world4["hf_tp3"]):
        assert (logits - hf_model["logits"]).abs().max() < LOGIT_TOL
        assert tokens == hf_model["greedy"]


@pytest.mark.slow
def test_gqa_cache_holds_only_this_ranks_kv_heads(world2):
    assert world2["cache_shape_tp2"][:3] == (2, 1, 64)  # 2 KV heads over TP=2: one each


# -------------------------------------------------------------------------------------- training

@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2x1", "1x2", "2x1-tied", "2x1-accum", "1x2-accum"])
def test_world2_layouts_train_like_one_process(world2, reference, layout):
    assert_every_rank(world2, layout, reference[layout.endswith("tied")])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2x2", "4x1", "2x2-accum", "4x1-accum"])
def test_world4_layouts_train_like_one_process(world4, reference, layout):
    assert_every_rank(world4, layout, reference[False])


@pytest.mark.slow
def test_tp4_replicates_the_two_kv_heads_and_still_matches(world4):
    assert world4["kv_replicated_tp4"]


@pytest.mark.slow
def test_replicated_kv_heads_with_data_parallelism_train_like_one_process(world4, reference):
    """One KV head at TP=2 x DP=2: the replicated k/v gradients are summed over TP, then averaged over DP."""
    assert_every_rank(world4, "2x2-one-kv-head", reference["one-kv-head"])


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,ref", [("world2", "1x2-zero", False),
                                              ("world4", "2x2-one-kv-head-zero", "one-kv-head")])
def test_distributed_optimizer_trains_like_one_process(request, reference, world, layout, ref):
    """ZeRO-1 over DP=2, also with a replicated KV head (summed over TP before the DP reduce-scatter)."""
    assert_every_rank(request.getfixturevalue(world), layout, reference[ref])


def test_half_parameters_train(reference):
    """bf16 parameters with fp32 master weights: the tiny Llama learns (one process)."""
    (curve, _), trainer = train_run(ParallelContext.single(), tiny_config(precision="bf16", param_dtype="half"))
    assert trainer.model.layers["0"].attn.k.weight.dtype == torch.bfloat16
    assert curve[-1][0] < curve[0][0] - 0.1 and abs(curve[-1][0] - reference[False][0][-1][0]) < 0.1


@pytest.mark.slow
def test_kv_groups_straddling_ranks_unevenly(world2):
    """12 query heads on 3 KV heads at TP=2: each rank reads two KV heads for 4 and 2 of its query heads (one
    KV copy per query head); logits, with and without the KV cache, equal one process's."""
    reference, _ = uneven_logits(ParallelContext.single())
    logits, cached = world2["uneven_tp2"]
    assert (logits - reference).abs().max() < 1e-5 and (cached - reference).abs().max() < 1e-5
    assert build_model(UNEVEN, ParallelContext.single(), seed=3).layers["0"].attn.kv_index is None
    assert rank_model(UNEVEN, 2, 0).layers["0"].attn.kv_index.tolist() == [0, 0, 0, 0, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "pp2-tied"])
def test_pipeline_stages_train_like_one_process(world2, reference, layout):
    """PP=2: each stage holds one layer (rotating its own positions); the tied embedding's two copies add up."""
    assert_every_rank(world2, layout, reference[layout.endswith("tied")])


@pytest.mark.slow
def test_pipeline_with_replicated_kv_heads_trains_like_one_process(world4, reference):
    assert_every_rank(world4, "tp2-pp2-one-kv-head", reference["one-kv-head"])


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,tp", [("world2", "2x1-sp-selective", 2), ("world4", "4x1-sp", 4)])
def test_sequence_parallelism_trains_like_one_process(request, reference, world, layout, tp):
    """Norms, dropouts and residuals on sequence chunks (RoPE after the all-gather sees every position), at
    TP=2 with selective recomputation and at TP=4 with replicated KV heads. Sequence parallelism is engaged
    at both sizes: the embedding hands each rank (4, 16 / tp, 32) of a (4, 16) batch, and a forward makes
    2 reduce-scatters per layer plus the embedding's and 2 all-gathers per layer plus the output layer's
    (where TP alone all-reduces)."""
    results = request.getfixturevalue(world)
    assert_every_rank(results, layout, reference[False])
    layers = tiny_config().model.num_layers
    assert results[f"sp_forward_tp{tp}"] == {"flag": True, "embedded": (4, 16 // tp, 32),
                                             "reduce_scatter": 2 * layers + 1, "all_gather": 2 * layers + 1}
    assert request.getfixturevalue("world2")["sp_engaged"]


@pytest.mark.slow
def test_recomputation_with_dropout_gives_the_same_run_bitwise(world2):
    """Dropout 0.1 at TP=2 with sequence parallelism: selective and full recomputation give the losses,
    gradient norms and final parameters of no recomputation, to the bit, which holds only when the
    recomputed dropout masks equal the original ones."""
    assert_recomputation_is_bitwise(world2["recompute"])


@pytest.mark.slow
def test_recomputation_runs_the_forward_again_in_the_backward(world2):
    """Forward calls over 3 steps of one micro-batch through 2 layers: once per micro-batch without
    recomputation; selective recomputation runs every attention core again in the backward, full
    recomputation every layer (and so its core)."""
    once = RECOMPUTE_STEPS * tiny_config().model.num_layers
    counts = {mode: run["counts"] for mode, run in world2["recompute"].items()}
    assert counts == {"none": {"layer": once, "core": once}, "selective": {"layer": once, "core": 2 * once},
                      "full": {"layer": 2 * once, "core": 2 * once}}


@pytest.mark.slow
def test_a_layer_does_two_all_reduces_forward_and_backward(world2, world4):
    """Per layer 2 forward (attention and SwiGLU outputs) and 2 backward (their inputs, one `f` each), plus the
    embedding's forward, the cross-entropy's sum and the output layer's backward; replicated KV heads
    (TP=4 > 2 KV heads) add the k and v weight-gradient sums, 2 per layer."""
    layers = tiny_config().model.num_layers
    assert world2["all_reduces_tp2"] == (2 * layers + 2, 2 * layers + 1)
    assert world4["all_reduces_tp4"] == (2 * layers + 2, 4 * layers + 1)


@pytest.mark.slow
def test_checkpoints_reshard_between_replicated_and_split_kv_heads(world4):
    """Saved at TP=4 (KV weights replicated) and loaded at TP=2 and TP=1 (split / whole); saved at TP=2
    (split) and loaded at TP=4 (replicated): the same logits."""
    assert (world4["tp4_loaded_at_tp2"] - world4["logits_4x1"]).abs().max() < 1e-5
    assert (world4["tp2_loaded_at_tp4"] - world4["logits_2x2"]).abs().max() < 1e-5
    single, _ = load_model(world4["checkpoints"] / "tp4", ParallelContext.single())
    assert (probe_logits(single) - world4["logits_4x1"]).abs().max() < 1e-5


def test_training_reduces_loss(reference):
    losses = [loss for loss, _ in reference[False][0]]
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.slow
def test_a_checkpoint_trained_at_tp4_exports_to_transformers(world4, tmp_path):
    """Sharded TP=4 checkpoint (KV heads replicated) -> `convert --to-hf` -> LlamaForCausalLM: same logits."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(to_hf(world4["checkpoints"] / "tp4", tmp_path / "hf")).eval()
    with torch.no_grad():
        assert (hf(PROBE).logits - world4["logits_4x1"]).abs().max() < LOGIT_TOL
