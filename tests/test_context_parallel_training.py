"""Context-parallel training gives the one-process answer (gloo; fp32, dropout 0).

Each layout trains a tiny GPT or Llama (grouped-query attention: 4 query heads, 2 KV heads) on
sequences of 32 tokens for the first 2 steps of an 8-step schedule; the loss and gradient norm at every step and
every final parameter, and the validation loss after training (evaluation runs split over CP too), must be within
1e-5 (relative) of one process running the same micro-batches. The loss compared is the one the
trainer reports (and logs), so a missing reduction over the CP group, which would report one CP
rank's share of the tokens, fails it.
World of 2: CP=2 (ring and all-gather exchange), CP=2 with the distributed optimizer, CP=2 with
selective and with full recomputation, CP=2 in bf16, in fp16 and with bf16 parameters (near, not
equal), a run saved after 1 step at CP=2 that one process (CP=1) resumes for 3, the activation bytes
each layer saves per rank, and the KV cache's refusal at CP=2.
World of 4: CP=4, CP=2 x TP=2 with and without sequence parallelism (and with Llama's one KV head
replicated over TP), CP=2 x DP=2 (and with the distributed optimizer), CP=2 x PP=2 (and interleaved).
One-line config errors and the MFU check run in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_llama import full_parameters
from test_training import ADAM_EPS, VOCAB

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.config import from_dict
from shardlm.data.gpt_dataset import TokenArrayDataset
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.plan.flops import flops_per_step
from shardlm.training.logging import RunLogger
from shardlm.training.trainer import Trainer, model_flops_utilization
from shardlm.validation import validate

from agreement import assert_same_curve, assert_same_run
from multiproc import check_result, merge_copies, run_checks, run_workers

STEPS, TOL, SEQ, LAYERS, HEADS, KV_HEADS, HIDDEN = 2, 1e-5, 32, 2, 4, 2, 32
SCHEDULE = 8
"""`cp_config`'s train.steps (the learning-rate schedule) and `synthetic_data`'s default length (SCHEDULE steps of 8
sequences): `test_resume_layouts` trains all 8 with them; the runs here the first STEPS."""
SAVED, RESUMED = 1, 3
"""The steps of the CP=2 run that one process resumes, and the steps it resumes for."""
# name: (arch, train keys, relative tolerances against one process in the same precision: losses and gradient
# norms, final bias tensors, the other final parameters), about 3x the worst error measured over 8 steps. Curves
# (losses and gradient norms together) on a 2-core Xeon with AMX: 1.5e-4 (bf16), 1.8e-4 (fp16), 1.7e-4 (bf16
# parameters); on a 2-core EPYC with AVX-512-BF16: 1.0e-4, 1.1e-4, 2.8e-4 (gradient norms; losses 2.4e-5,
# 3.6e-5, 2.1e-5). Parameters (EPYC): bf16 4.5e-3 (layers.0.attn.v.weight); fp16 3.2e-3 (layers.0.attn.qkv.bias),
# 1.2e-3 for the rest (layers.0.mlp.proj.weight); bf16 parameters 5.7e-3 (layers.1.attn.o.weight).
HALF_RUNS = {
    "cp2_llama_bf16": ("llama", {"precision": "bf16"}, {"curve": 5e-4, "biases": 1.5e-2, "parameters": 1.5e-2}),
    "cp2_gpt_fp16": ("gpt", {"precision": "fp16", "initial_loss_scale": 2.0**16},
                     {"curve": 5.5e-4, "biases": 1e-2, "parameters": 4e-3}),
    "cp2_llama_bf16_params": ("llama", {"precision": "bf16", "param_dtype": "half"},
                              {"curve": 1e-3, "biases": 2e-2, "parameters": 2e-2}),
}


def cp_config(arch: str, micro: int, cp: int = 1, tp: int = 1, pp: int = 1, sp: bool = False,
              exchange: str = "ring", kv_heads: int = KV_HEADS, layers: int = LAYERS, virtual: int = 1, **train):
    model = {"arch": arch, "num_layers": layers, "hidden_size": HIDDEN, "num_heads": HEADS, "seq_length": SEQ,
             "vocab_size": VOCAB, "dropout": 0.0}
    if arch == "llama":
        model["num_kv_heads"] = kv_heads
    schedule = {"pipeline_schedule": "interleaved-1f1b", "virtual_stages": virtual} if virtual > 1 else {}
    return from_dict({
        "model": model,
        "parallel": {"tensor": tp, "pipeline": pp, "context": cp, "sequence_parallel": sp, "cp_comm": exchange,
                     **schedule},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": micro, "global_batch_size": 8, "steps": SCHEDULE, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 7, "eval_iters": 8, **train},
    })


def synthetic_data(seed: int = 0, samples: int = SCHEDULE * 8) -> TokenArrayDataset:
    """A learnable stream of sequences of SEQ tokens: each token a fixed function of the previous one, 10% noise."""
    rng = np.random.default_rng(seed)
    successor, tokens = rng.permutation(VOCAB), [0]
    for noise, noisy in zip(rng.random(4000), rng.integers(0, VOCAB, 4000)):
        tokens.append(noisy if noise < 0.1 else successor[tokens[-1]])
    return TokenArrayDataset(np.asarray(tokens), SEQ, seed=3, num_samples=samples)


def train_layout(ctx: ParallelContext, config, steps: int = STEPS, trainer: Trainer | None = None):
    """(loss and gradient norm of each step, final parameters, trainer) of `steps` steps of `config`."""
    validate(config, ctx.world_size, check_paths=False)
    # 8 validation samples, all of them read (eval_iters 8) whatever the micro-batch and DP sizes
    trainer = trainer or Trainer(config, ctx, synthetic_data(), valid_data=synthetic_data(seed=1, samples=8))
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]
    return curve, full_parameters(trainer.model), trainer


def run(config, cp: int, tp: int = 1, pp: int = 1):
    """A check: train `config` on the whole world as PP x DP x CP x TP; returns the curve, the parameters
    (every pipeline stage's), the communication statistics of training and the validation loss after it."""
    def check():
        ctx = ParallelContext.from_process_group(tp, pipeline_parallel=pp, context_parallel=cp)
        curve, params, trainer = train_layout(ctx, config)
        stats = ctx.comm.snapshot()
        if pp > 1:
            params = merge_copies(ctx.world.all_gather_object(params))
        return curve, params, stats, trainer.evaluate()
    return check


def save_after_steps(directory: str):
    """CP=2 GPT: SAVED steps, then a checkpoint (resumed at CP=1 by the test)."""
    ctx = ParallelContext.from_process_group(1, context_parallel=2)
    curve, _, trainer = train_layout(ctx, cp_config("gpt", 4, cp=2), steps=SAVED)
    save_checkpoint(trainer, directory)
    return curve


def saved_per_layer(ctx: ParallelContext) -> dict:
    """Bytes each layer saves for backward in one forward + backward of this rank's part of 4 sequences, per arch."""
    from shardlm.models import build_model
    from shardlm.plan.measure import saved_activation_bytes
    from shardlm.training.data import context_parallel_part

    batch = torch.from_numpy(np.stack([synthetic_data()[i] for i in range(4)]))
    out = {}
    for arch in ("gpt", "llama"):
        ctx.rng = None
        model = build_model(cp_config(arch, 4, cp=ctx.cp_size).model, ctx)
        inputs, targets = context_parallel_part(batch, ctx.cp_size, ctx.cp_rank)
        def step(model=model, inputs=inputs, targets=targets):
            model(inputs, targets).mean().backward()

        out[arch] = saved_activation_bytes(model, step, list(model.layers.values())).by_layer
    return out


def one_step_metrics():
    """The metrics of one CP=2 GPT step (what the trainer logs)."""
    ctx = ParallelContext.from_process_group(1, context_parallel=2)
    return Trainer(cp_config("gpt", 4, cp=2), ctx, synthetic_data()).train_step()


def kv_cache_errors() -> dict:
    """At CP=2: the error GPT and Llama raise when a forward is handed a KV cache, per arch."""
    from shardlm.models import build_model

    ctx = ParallelContext.from_process_group(1, context_parallel=2)
    out = {}
    for arch in ("gpt", "llama"):
        ctx.rng = None
        model = build_model(cp_config(arch, 4, cp=2).model, ctx)
        try:
            model.hidden_states(torch.zeros(1, 4, dtype=torch.long), cache=model.new_kv_cache())
            out[arch] = None
        except ValueError as error:
            out[arch] = str(error)
    return out


def world2_checks(directory: str):
    return run_checks({
        "cp2_gpt": run(cp_config("gpt", 4, cp=2), cp=2),
        "cp2_llama": run(cp_config("llama", 4, cp=2), cp=2),
        "cp2_gpt_allgather": run(cp_config("gpt", 4, cp=2, exchange="allgather"), cp=2),
        "cp2_gpt_zero": run(cp_config("gpt", 4, cp=2, distributed_optimizer=True), cp=2),
        "cp2_llama_zero": run(cp_config("llama", 4, cp=2, distributed_optimizer=True), cp=2),
        "cp2_llama_selective": run(cp_config("llama", 4, cp=2, recompute="selective"), cp=2),
        "cp2_gpt_full_recompute": run(cp_config("gpt", 4, cp=2, recompute="full"), cp=2),
        "cp2_llama_bf16": run(cp_config("llama", 4, cp=2, precision="bf16"), cp=2),
        "cp2_gpt_fp16": run(cp_config("gpt", 4, cp=2, **HALF_RUNS["cp2_gpt_fp16"][1]), cp=2),
        "cp2_llama_bf16_params": run(cp_config("llama", 4, cp=2, **HALF_RUNS["cp2_llama_bf16_params"][1]), cp=2),
        "save_cp2": lambda: save_after_steps(directory),
        "saved_per_layer": lambda: saved_per_layer(ParallelContext.from_process_group(1, context_parallel=2)),
        "metrics_cp2": one_step_metrics,
        "kv_cache_cp2": kv_cache_errors,
    })


def world4_checks():
    return run_checks({
        "cp4_gpt": run(cp_config("gpt", 4, cp=4), cp=4),
        "cp4_llama": run(cp_config("llama", 4, cp=4), cp=4),
        "cp2_tp2_gpt": run(cp_config("gpt", 4, cp=2, tp=2), cp=2, tp=2),
        "cp2_tp2_sp_gpt": run(cp_config("gpt", 4, cp=2, tp=2, sp=True), cp=2, tp=2),
        "cp2_tp2_llama": run(cp_config("llama", 4, cp=2, tp=2), cp=2, tp=2),
        "cp2_tp2_sp_llama": run(cp_config("llama", 4, cp=2, tp=2, sp=True), cp=2, tp=2),
        "cp2_dp2_gpt": run(cp_config("gpt", 2, cp=2), cp=2),
        "cp2_dp2_llama_zero": run(cp_config("llama", 2, cp=2, distributed_optimizer=True), cp=2),
        "cp2_pp2_gpt": run(cp_config("gpt", 2, cp=2, pp=2), cp=2, pp=2),
        "cp2_pp2_llama": run(cp_config("llama", 2, cp=2, pp=2), cp=2, pp=2),
        # one KV head, replicated on both TP ranks (only it travels around the ring)
        "cp2_tp2_llama_one_kv_head": run(cp_config("llama", 2, cp=2, tp=2, kv_heads=1), cp=2, tp=2),
        "cp2_pp2_gpt_interleaved": run(cp_config("gpt", 2, cp=2, pp=2, layers=4, virtual=2), cp=2, pp=2),
    })


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cp_ckpt")


@pytest.fixture(scope="module")
def world2(checkpoint_dir):
    return run_workers(2, world2_checks, str(checkpoint_dir), timeout=600)


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, world4_checks, timeout=600)


_REFERENCES = {}


def reference(arch: str, micro: int, steps: int = STEPS, **train):
    """One process, the same micro-batches: (curve, parameters, validation loss) of `steps` steps, cached per
    module."""
    key = (arch, micro, steps, *sorted(train.items()))
    if key not in _REFERENCES:
        curve, params, trainer = train_layout(ParallelContext.single(), cp_config(arch, micro, **train), steps=steps)
        _REFERENCES[key] = curve, params, trainer.evaluate()
    return _REFERENCES[key]


def named(curve: list, params: dict, valid: float) -> dict:
    """A run's (curve, parameters, validation loss) as `agreement.assert_same_run` reads it."""
    return {"curve": curve, "params": params, "valid": valid}


@pytest.mark.parametrize("name,arch,micro", [
    ("cp2_gpt", "gpt", 4),
    ("cp2_llama", "llama", 4),
    ("cp2_gpt_allgather", "gpt", 4),
    ("cp2_gpt_zero", "gpt", 4),
    ("cp2_llama_zero", "llama", 4),
    ("cp2_llama_selective", "llama", 4),
    ("cp2_gpt_full_recompute", "gpt", 4),
])
def test_world2_context_parallel_equals_one_process(world2, name, arch, micro):
    """Loss and gradient norm of every step, final parameters and the validation loss after training."""
    ref = named(*reference(arch, micro))
    for rank, (curve, params, _, valid_loss) in enumerate(check_result(world2, name)):  # every data and CP replica
        assert_same_run(named(curve, params, valid_loss), ref, f"{name} rank {rank}", steps=STEPS, tol=TOL)


@pytest.mark.parametrize("name,arch,micro,shape", [
    ("cp4_gpt", "gpt", 4, {}),
    ("cp4_llama", "llama", 4, {}),
    ("cp2_tp2_gpt", "gpt", 4, {}),
    ("cp2_tp2_sp_gpt", "gpt", 4, {}),
    ("cp2_tp2_llama", "llama", 4, {}),
    ("cp2_tp2_sp_llama", "llama", 4, {}),
    ("cp2_dp2_gpt", "gpt", 2, {}),
    ("cp2_dp2_llama_zero", "llama", 2, {}),
    ("cp2_pp2_gpt", "gpt", 2, {}),
    ("cp2_pp2_llama", "llama", 2, {}),
    ("cp2_tp2_llama_one_kv_head", "llama", 2, {"kv_heads": 1}),
    ("cp2_pp2_gpt_interleaved", "gpt", 2, {"layers": 4}),
])
def test_world4_context_parallel_equals_one_process(world4, name, arch, micro, shape):
    """Loss and gradient norm of every step, final parameters and the validation loss after training."""
    ref = named(*reference(arch, micro, **shape))
    for rank, (curve, params, _, valid_loss) in enumerate(check_result(world4, name)):  # every data and CP replica
        assert_same_run(named(curve, params, valid_loss), ref, f"{name} rank {rank}", steps=STEPS, tol=TOL)


@pytest.mark.parametrize("name", list(HALF_RUNS))
def test_half_precision_context_parallel_stays_near_one_process(world2, name):
    """bf16 autocast, fp16 autocast with dynamic loss scaling, bf16 parameters with fp32 master weights (the
    ring's blocks in half precision, merged in fp32): CP=2's losses and gradient norms stay within the stated
    tolerance of one process's run in the same precision (not bitwise: the blocks round differently from one
    whole attention), and skip the same fp16 steps; so do the final parameters (biases and the rest bounded
    separately, HALF_RUNS)."""
    from test_fsdp import assert_parameters_near

    arch, train, tol = HALF_RUNS[name]
    ref_curve, ref_params = reference(arch, 4, **train)[:2]
    for curve, params, _, _ in check_result(world2, name):  # both CP ranks
        assert len(curve) == len(ref_curve)
        for step, (got, want) in enumerate(zip(curve, ref_curve), 1):
            assert (got[1] != got[1]) == (want[1] != want[1]), f"step {step}: skipped differently"  # NaN: skipped
            for what, a, b in zip(("loss", "grad norm"), got, want):
                assert a != a or abs(a - b) <= tol["curve"] * abs(b), f"step {step}: {what} {a} vs {b}"
        assert_parameters_near(params, ref_params, tol)


@pytest.mark.parametrize("world_name,name", [("world2", "cp2_gpt"), ("world4", "cp4_gpt")])
def test_reported_loss_is_the_same_on_every_rank_and_equals_one_process(request, world_name, name):
    """The loss every rank reports (rank 0 logs it) is the whole batch's, not one CP rank's tokens' loss."""
    results = check_result(request.getfixturevalue(world_name), name)
    ref_losses = [loss for loss, _ in reference("gpt", 4)[0]]
    for curve, _, _, _ in results:
        losses = [loss for loss, _ in curve]
        assert all(abs(a - b) <= TOL * b for a, b in zip(losses, ref_losses)), (losses, ref_losses)


def test_ring_sends_the_formula_of_kv_bytes_per_layer_and_micro_batch(world2):
    """Per layer and micro-batch at C = 2: K and V of this rank's 2L = T / C tokens (b samples, 4 heads of 8
    channels, fp32) go once around the ring forward and once backward (C - 1 = 1 hop each), and the dK/dV
    accumulators once backward. GPT: K/V have all 4 heads; Llama (GQA): only its 2 KV heads travel."""
    micro_batches = 8 // 4
    for name, kv_heads in (("cp2_gpt", HEADS), ("cp2_llama", KV_HEADS)):
        stats = check_result(world2, name)[0][2]
        block = 2 * 4 * kv_heads * (SEQ // 2) * (HIDDEN // HEADS) * 4  # (K, V) x b x Hkv x 2L x d x fp32
        per_pass = STEPS * micro_batches * LAYERS
        assert stats["ring_kv/cp"] == {"calls": 2 * per_pass, "bytes": 2 * per_pass * block,
                                       "elements": 2 * per_pass * block // 4}
        assert stats["ring_dkv/cp"]["calls"] == per_pass and stats["ring_dkv/cp"]["bytes"] == per_pass * block


def test_throughput_metrics_count_every_token_once(world2):
    """At CP=2 each rank holds half of every sequence, yet tokens/s x step time is the global batch's
    8 x 32 tokens and TFLOP/s x step time the FLOPs of the whole step (not halved, not doubled), on both ranks;
    TFLOP/s per device divides by the 2 ranks."""
    flops = flops_per_step(cp_config("gpt", 4).model, 8)
    for metrics in check_result(world2, "metrics_cp2"):
        seconds = metrics["step_time_s"]
        assert metrics["tokens_per_sec"] * seconds == pytest.approx(8 * SEQ, rel=1e-9)
        assert metrics["tflops"] * 1e12 * seconds == pytest.approx(flops, rel=1e-9)
        assert metrics["tflops_per_device"] == pytest.approx(metrics["tflops"] / 2, rel=1e-12)


def test_a_cp2_rank_saves_half_of_each_layers_activations(world2):
    """Each layer of a CP=2 rank keeps for backward exactly half the bytes one process keeps (everything it
    saves is per token; the ring's output is laid out so the output projection's input is a view of it)."""
    whole = saved_per_layer(ParallelContext.single())
    for rank_result in check_result(world2, "saved_per_layer"):
        for arch in ("gpt", "llama"):
            assert {i: 2 * n for i, n in rank_result[arch].items()} == whole[arch], arch


def test_the_kv_cache_is_refused_under_context_parallelism(world2):
    """A forward given a KV cache at CP=2 raises on both ranks, GPT and Llama, instead of caching half of
    each sequence's keys (generation builds its own C = 1 context)."""
    for errors in check_result(world2, "kv_cache_cp2"):
        assert errors == {arch: "the KV cache works without context parallelism; generate with parallel.context=1"
                          for arch in ("gpt", "llama")}


def test_checkpoint_saved_at_cp2_resumes_at_cp1_on_the_same_curve(world2, checkpoint_dir):
    """A run saved after 1 step at CP=2 (in the learning rate's warm-up) and resumed by one process (CP=1) for 3
    gives the one-process run's steps 2-4 and final parameters; the saved step is the one-process run's too."""
    saved_curve = check_result(world2, "save_cp2")[0]
    ref_curve, ref_params, _ = reference("gpt", 4, steps=SAVED + RESUMED)
    assert_same_curve(saved_curve, ref_curve[:SAVED], "saved at CP=2", TOL)
    config = cp_config("gpt", 4)
    trainer = Trainer(config, ParallelContext.single(), synthetic_data())
    load_checkpoint(trainer, checkpoint_dir)
    assert trainer.step == SAVED
    curve, params, _ = train_layout(ParallelContext.single(), config, steps=RESUMED, trainer=trainer)
    assert_same_run((curve, params), (ref_curve, ref_params), "resumed at CP=1", steps=SAVED + RESUMED, tol=TOL,
                    first_step=SAVED + 1)


@pytest.mark.parametrize("parallel,model,world,message", [
    ({"context": 3}, {}, 3, "model.seq_length=32 is not a multiple of 2 x parallel.context = 6"),
    ({"context": 2, "tensor": 4, "sequence_parallel": True}, {"seq_length": 36}, 8,
     "model.seq_length=36 is not a multiple of 2 x parallel.context x parallel.tensor (sequence parallelism) = 16"),
    ({"context": 2}, {}, 3, "world size 3 is not divisible by parallel.tensor x parallel.context = 1 x 2"),
    ({"context": 2, "tensor": 2, "pipeline": 2}, {}, 12,
     "world size 12 is not divisible by parallel.tensor x parallel.context x parallel.pipeline = 2 x 2 x 2"),
    ({"context": 2}, {"dropout": 0.1}, 2, "model.attention_dropout=0.1 is not supported with parallel.context=2"),
    ({"context": 2, "cp_comm": "p2p"}, {}, 2, 'parallel.cp_comm="p2p" must be "ring" or "allgather"'),
    ({"context": 0}, {}, 2, "parallel.context=0 must be at least 1"),
    ({"context": 2}, {"arch": "bert"}, 2, 'parallel.context=2 supports model.arch="gpt" and "llama"'),
])
def test_bad_context_parallel_settings_are_one_line_errors(parallel, model, world, message):
    config = cp_config("gpt", 4)
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    for key, value in model.items():
        setattr(config.model, key, value)
    with pytest.raises(UserError) as error:
        validate(config, world, check_paths=False)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_trainer_refuses_a_context_setting_its_process_groups_do_not_have():
    """parallel.context=2 on a context without a CP group is an error, not a silent CP=1 run."""
    with pytest.raises(UserError, match="parallel.context=2 but the process groups have 1"):
        Trainer(cp_config("gpt", 4, cp=2), ParallelContext.single(), synthetic_data())


def test_mfu_above_100_percent_is_named_not_logged(tmp_path, capsys):
    """An MFU measured above 100% (a FLOP count or peak that is wrong, e.g. a parallel setting silently off)
    is reported as an error in metrics.jsonl and on the console, never as a number; below 100% it is the ratio."""
    assert model_flops_utilization(494.5, 989.0) == (0.5, None)
    assert model_flops_utilization(1.0, None) == (None, None)
    mfu, error = model_flops_utilization(1978.0, 989.0)
    assert mfu is None and "measured MFU 200% is above 100%" in error
    logger = RunLogger(tmp_path, 1, True, progress=False, tensorboard=False)
    logger.step({"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "tokens_per_sec": 1.0,
                 "tflops_per_device": 1978.0, "mfu": mfu, "mfu_error": error}, total_steps=1)
    logger.close()
    assert "measured MFU 200% is above 100%" in capsys.readouterr().out
    assert '"mfu": null' in (tmp_path / "metrics.jsonl").read_text()
