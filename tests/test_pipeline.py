"""Pipeline parallelism: every PP x TP x DP layout trains exactly as one process does.

A tiny 8-layer GPT trains the first 4 steps (TRAINED) of an 8-step schedule on the synthetic stream of
`test_training` at the 1x1x1
reference and at PP x TP x DP = 2x1x1 (world 2), 4x1x1, 2x2x1, 2x1x2 (world 4) and 2x2x2 (world 8),
with GPipe, 1F1B and interleaved 1F1B, with several micro-batch counts and with activation
checkpointing. Losses and gradient norms at every step and the final parameters must agree within
1e-5 (fp32, dropout 0). Parameters are gathered from every rank: data-parallel replicas and the tied
embedding's two copies must be bitwise equal wherever they are compared. The same worlds also check
the point-to-point traffic against the schedule's formula (2 and 4 stages, 1F1B and interleaved), an fp16
overflow on one stage, bitwise
resume with dropout on under every schedule, and checkpoints that move between pipeline layouts.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_training import TOL, assert_same_run, synthetic_data

from shardlm.checkpoint import load_checkpoint, load_model, save_checkpoint
from shardlm.config import RunConfig, from_dict
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from agreement import assert_trained_parameters, rel
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result, merge_copies

VOCAB, STEPS, LAYERS, SEQ, HIDDEN, GLOBAL = 100, 8, 8, 16, 32, 8
TRAINED, STOP = 4, 2
"""This file's runs train the first TRAINED steps of the configs' STEPS-step schedule (warm-up and decay both
reached); its resumed runs save after STOP and train the rest. `train` and `resume_run` default to all STEPS for
the files that import them (`test_pipeline_zero_bubble`)."""


def pp_config(tp: int = 1, pp: int = 1, micro: int = 4, schedule: str = "1f1b", virtual: int = 1,
              checkpointing: bool = False, precision: str = "fp32", **parallel) -> RunConfig:
    """The tiny GPT's run at TP=tp x PP=pp (fp16 starts at a loss scale of 2^10, which does not overflow)."""
    return from_dict({
        "model": {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": 4, "seq_length": SEQ,
                  "vocab_size": VOCAB, "dropout": 0.0},
        "parallel": {"tensor": tp, "pipeline": pp, "pipeline_schedule": schedule, "virtual_stages": virtual,
                     **parallel},
        "data": {"text_file": "unused"},
        "train": {"micro_batch_size": micro, "global_batch_size": GLOBAL, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4, "warmup_steps": 3, "clip_grad": 0.5, "adam_eps": 1e-6, "seed": 7,
                  "precision": precision, "activation_checkpointing": checkpointing, "initial_loss_scale": 1024.0},
    })


def stage_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This stage's parameters in the TP=1 layout (shards gathered over TP, vocabulary padding removed)."""
    out = {}
    for name, param in trainer.model.named_parameters():
        value = param.detach()
        if hasattr(param, "tensor_parallel_dim"):
            value = torch.cat(trainer.ctx.tp.all_gather(value), dim=param.tensor_parallel_dim)
        out[name] = value[:VOCAB].clone() if name == "wte.weight" else value.clone()
    return out


def whole_model(ctx: ParallelContext, trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every stage's parameters, gathered on every rank. Each name is held by several ranks (its
    data-parallel replicas, its TP ranks after the gather, the tied embedding's first- and last-stage
    copies): every copy must be bitwise equal to the first, else this raises naming the tensor."""
    return merge_copies(ctx.world.all_gather_object(stage_parameters(trainer)))


def resume_run(ctx: ParallelContext, config: RunConfig, path: str, stop: int = 3, steps: int = STEPS) -> dict:
    """Train `config` for `steps` steps uninterrupted; then again for `stop` steps, save, load the
    checkpoint into a new trainer and train the remaining steps. The curves and final parameters of
    both, for the test to compare bitwise."""
    ctx.rng = None
    uninterrupted, trainer = train(ctx, config, steps)
    final = whole_model(ctx, trainer)
    ctx.rng = None
    first, trainer = train(ctx, config, steps=stop)
    saved = save_checkpoint(trainer, path)
    ctx.rng = None
    resumed = Trainer(config, ctx, synthetic_data())
    load_checkpoint(resumed, saved)
    rest = [(m["loss"], m["grad_norm"]) for m in (resumed.train_step() for _ in range(steps - stop))]
    return {"uninterrupted": uninterrupted, "final": final, "interrupted": first + rest,
            "resumed_final": whole_model(ctx, resumed)}


def with_dropout(config: RunConfig, dropout: float = 0.1, **train_keys) -> RunConfig:
    config.model.dropout = dropout
    for key, value in train_keys.items():
        setattr(config.train, key, value)
    return config


def train(ctx: ParallelContext, config: RunConfig, steps: int = STEPS):
    trainer = Trainer(config, ctx, synthetic_data())
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]
    return curve, trainer


def run_layout(tp: int, pp: int, cp: int, ep: int, micro: int, schedule: str, virtual: int = 1,
               checkpointing: bool = False) -> tuple:
    """One case on this rank: (curve, whole model) of TRAINED steps at TP=tp x PP=pp (DP the rest of the world),
    `micro` samples a micro-batch under `schedule` with `virtual` stages a rank. The cases of one layout share
    its context (`layout_context`), seeded again by each trainer."""
    ctx = layout_context(tp, pp, cp, ep)
    curve, trainer = train(ctx, pp_config(tp, pp, micro, schedule, virtual, checkpointing), TRAINED)
    return curve, whole_model(ctx, trainer)


def pipe(micro: int, schedule: str, tp: int = 1, pp: int = 2, ckpt: bool = False) -> dict:
    """A case of the tables below: `schedule` ("interleaved" with 2 virtual stages a rank) at `micro`, with
    activation checkpointing if `ckpt`."""
    virtual = 2 if schedule == "interleaved" else 1
    schedule = "interleaved-1f1b" if schedule == "interleaved" else schedule
    return layout(tp=tp, pp=pp, micro=micro, schedule=schedule, virtual=virtual, checkpointing=ckpt)


WORLD2 = {"gpipe-m1": pipe(8, "gpipe"), "gpipe-m2": pipe(4, "gpipe"), "gpipe-m8": pipe(1, "gpipe"),
          "1f1b-m4": pipe(2, "1f1b"), "1f1b-m8": pipe(1, "1f1b"), "interleaved-m8": pipe(1, "interleaved"),
          "interleaved-m4": pipe(2, "interleaved"), "1f1b-checkpointing": pipe(1, "1f1b", ckpt=True)}
"""PP=2 (GPipe, 1F1B, interleaved 1F1B over m micro-batches), each against one process at its micro-batch size."""
WORLD4 = {"pp4-gpipe": pipe(2, "gpipe", pp=4), "pp4-1f1b": pipe(1, "1f1b", pp=4),
          "pp4-interleaved": pipe(2, "interleaved", pp=4), "pp2tp2-gpipe": pipe(2, "gpipe", tp=2),
          "pp2tp2-1f1b": pipe(1, "1f1b", tp=2), "pp2tp2-interleaved-ckpt": pipe(1, "interleaved", tp=2, ckpt=True),
          "pp2dp2-gpipe": pipe(2, "gpipe"), "pp2dp2-1f1b": pipe(2, "1f1b"),
          "pp2dp2-interleaved": pipe(1, "interleaved")}
"""A world of 4: PP=4 x TP=1, PP=2 x TP=2 and PP=2 x TP=1 x DP=2."""
WORLD8 = {"gpipe": pipe(2, "gpipe", tp=2), "1f1b": pipe(1, "1f1b", tp=2), "interleaved": pipe(1, "interleaved", tp=2)}
"""PP=2 x TP=2 x DP=2 under each schedule."""


def traffic_of_a_step(ctx: ParallelContext, config: RunConfig) -> dict:
    """The collectives and point-to-point transfers of one train step (after a first one), from `ctx.comm`."""
    ctx.rng = None
    trainer = Trainer(config, ctx, synthetic_data())
    trainer.train_step()
    ctx.comm.reset()
    trainer.train_step()
    return ctx.comm.snapshot()


# -------------------------------------------------------------------------------------- in workers

def pp2_stages(tmp: str) -> dict:
    """PP=2 after the layouts: tied copies, traffic, fp16 overflow and a checkpoint round trip (one check: they
    share a context and trainers)."""
    out = {}
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)

    ctx.rng = None
    _, trainer = train(ctx, pp_config(pp=2, micro=2), steps=3)
    out["tied"] = trainer.model.wte.weight.detach().clone()
    ctx.comm.reset()
    trainer.train_step()
    out["traffic"] = ctx.comm.snapshot()

    # fp16: an inf gradient on the last stage only must skip the step on both stages
    ctx.rng = None
    trainer = Trainer(pp_config(pp=2, micro=2, precision="fp16"), ctx, synthetic_data())
    trainer.train_step()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    hook = None
    if ctx.is_last_stage:
        hook = trainer.model.ln_f.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    metrics = trainer.train_step()
    if hook:
        hook.remove()
    unchanged = all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    out["overflow"] = (metrics["skipped"], unchanged, trainer.train_step()["skipped"])

    # exact resume with dropout on, one case per schedule and recomputation mode
    out["resume"] = {
        name: resume_run(ctx, with_dropout(pp_config(pp=2, micro=micro, schedule=schedule, virtual=virtual),
                                           recompute=recompute), f"{tmp}/resume-{name}", STOP, TRAINED)
        for name, micro, schedule, virtual, recompute in [
            ("1f1b", 2, "1f1b", 1, "none"), ("interleaved", 1, "interleaved-1f1b", 2, "none"),
            ("gpipe-full-recompute", 2, "gpipe", 1, "full"), ("1f1b-selective-recompute", 2, "1f1b", 1, "selective")]}
    ctx.rng = None
    out["parameters"] = Trainer(pp_config(pp=2, micro=2), ctx, synthetic_data()).num_parameters()
    return out


def pp4_stages(tmp: str) -> dict:
    """A world of 4 after the layouts: the traffic of 4 stages, and checkpoints moved between pipeline layouts
    (one check: they share contexts and a checkpoint)."""
    out = {}
    # PP=4, m = 8 / 2 = 4: the middle stages send both ways; interleaved, each rank runs 2 of 8 stages
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=4)
    out["traffic"] = {virtual: traffic_of_a_step(ctx, pp_config(1, 4, micro=2, schedule=schedule, virtual=virtual))
                      for schedule, virtual in (("1f1b", 1), ("interleaved-1f1b", 2))}
    out["pp_rank"] = ctx.pp_rank
    # PP=2 x DP=2 with the distributed optimizer and dropout: resume is bitwise
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=2)
    out["resume_pp2dp2_distributed_optimizer"] = resume_run(
        ctx, with_dropout(pp_config(1, 2, micro=2), distributed_optimizer=True), f"{tmp}/resume-pp2dp2", STOP, TRAINED)
    # a PP=2 x TP=2 checkpoint, then it loaded at PP=4 x TP=1 and trained on: equals the uninterrupted run
    ctx = ParallelContext.from_process_group(2, pipeline_parallel=2)
    _, trainer = train(ctx, pp_config(2, 2, micro=1), steps=STOP)
    saved = save_checkpoint(trainer, f"{tmp}/pp2tp2")
    out["saved_pp2tp2"] = (str(saved), whole_model(ctx, trainer))
    ctx = ParallelContext.from_process_group(1, pipeline_parallel=4)
    resumed = Trainer(pp_config(1, 4, micro=1), ctx, synthetic_data())
    load_checkpoint(resumed, saved)
    out["pp2tp2_to_pp4"] = [(m["loss"], m["grad_norm"]) for m in (resumed.train_step() for _ in range(TRAINED - STOP))]
    out["pp2tp2_to_pp4_params"] = whole_model(ctx, resumed)
    # a checkpoint of one process (PP=1) loaded at PP=4
    resumed = Trainer(pp_config(1, 4, micro=1), ctx, synthetic_data())
    load_checkpoint(resumed, f"{tmp}/single")
    out["single_to_pp4"] = whole_model(ctx, resumed)
    return out


def stages_check(tmp: str, world: int) -> dict:
    """A world's further check after its layouts: "stages", `pp2_stages` or (world 4) `pp4_stages`."""
    return {"stages": lambda: (pp2_stages if world == 2 else pp4_stages)(tmp)}


# ------------------------------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def reference():
    """1x1x1 runs at every micro-batch size used below."""
    ctx = ParallelContext.single()
    out = {}
    for micro in (8, 4, 2, 1):
        ctx.rng = None
        curve, trainer = train(ctx, pp_config(micro=micro), TRAINED)
        out[micro] = (curve, {n: p for n, p in whole_model(ctx, trainer).items()})
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def world2(workdir):
    return spawn_layouts(2, run_layout, WORLD2, timeout=400, more=stages_check, more_args=(str(workdir), 2))


@pytest.fixture(scope="module")
def world4(workdir):
    """{"ranks": every rank's results of `world4_checks`, "single": the parameters of the one-process
    checkpoint (STOP steps) that the world loaded at PP=4}."""
    ctx = ParallelContext.single()
    _, trainer = train(ctx, pp_config(micro=1), steps=STOP)
    save_checkpoint(trainer, workdir / "single")
    return {"ranks": spawn_layouts(4, run_layout, WORLD4, timeout=500, more=stages_check, more_args=(str(workdir), 4)),
            "single": whole_model(ctx, trainer)}


@pytest.fixture(scope="module")
def stages2(world2) -> list[dict]:
    """Every rank's `pp2_stages`."""
    return check_result(world2, "stages")


@pytest.fixture(scope="module")
def stages4(world4) -> list[dict]:
    """Every rank's `pp4_stages`."""
    return check_result(world4["ranks"], "stages")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_pp2_matches_single_process(world2, reference, name):
    for run in check_result(world2, name):
        assert_same_run(run, reference[WORLD2[name]["micro"]], TRAINED)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_layouts_match_single_process(world4, reference, name):
    """A world of 4: PP=4 x TP=1, PP=2 x TP=2, PP=2 x TP=1 x DP=2; every rank's curve."""
    for run in check_result(world4["ranks"], name):
        assert_same_run(run, reference[WORLD4[name]["micro"]], TRAINED)


@pytest.mark.slow
def test_pp2_tp2_dp2_matches_single_process(reference):
    """PP=2 x TP=2 x DP=2 under each schedule (GPipe, 1F1B, interleaved 1F1B), on every rank."""
    results = spawn_layouts(8, run_layout, WORLD8, timeout=500)
    assert {case["schedule"] for case in WORLD8.values()} == {"gpipe", "1f1b", "interleaved-1f1b"}
    for name, case in WORLD8.items():
        for run in check_result(results, name):
            assert_same_run(run, reference[case["micro"]], TRAINED)


@pytest.mark.slow
def test_tied_embedding_copies_stay_bitwise_equal(stages2):
    first, last = stages2[0]["tied"], stages2[1]["tied"]
    assert torch.equal(first, last)


@pytest.mark.slow
def test_dropout_under_the_pipeline_is_reproducible(stages2, reference):
    """Two runs from the same seed draw the same masks (the first steps of the interrupted run equal
    the uninterrupted run's), and the masks act: the gradient norms differ from the dropout-0 run's."""
    run = stages2[0]["resume"]["1f1b"]
    assert run["interrupted"][:STOP] == run["uninterrupted"][:STOP]
    no_dropout = reference[2][0]
    assert any(norm != pytest.approx(ref, rel=1e-3) for (_, norm), (_, ref) in zip(run["uninterrupted"], no_dropout))


@pytest.mark.slow
def test_parameter_count_sums_the_stages_and_counts_the_tied_embedding_once(stages2):
    single = Trainer(pp_config(micro=2), ParallelContext.single(), synthetic_data())
    assert all(rank["parameters"] == single.num_parameters() == single.model.num_parameters() for rank in stages2)


@pytest.mark.slow
def test_point_to_point_traffic_follows_the_schedule(stages2):
    """1F1B, 2 stages, m = 8 / 2 = 4 micro-batches of 2 x 16 x 32 fp32 activations: stage 0 sends m
    activations forward and receives m gradients; stage 1 the reverse. The tied embedding adds one
    all-reduce of the (padded) table over the embedding group on both stages; the gradient norm and
    the loss one scalar each over PP."""
    m, activation = 4, 2 * SEQ * HIDDEN * 4
    for rank in stages2:
        traffic = rank["traffic"]
        assert traffic["send/pp"] == {"calls": m, "bytes": m * activation, "elements": m * activation // 4}
        assert traffic["recv/pp"] == traffic["send/pp"]
        assert traffic["all_reduce/embedding"]["calls"] == 1
        assert traffic["all_reduce/embedding"]["elements"] == 128 * HIDDEN
        assert traffic["all_reduce/pp"]["calls"] == 1 and traffic["broadcast/pp"]["calls"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [1, 2], ids=["1f1b", "interleaved"])
def test_point_to_point_traffic_of_every_stage_follows_the_formula(stages4, virtual):
    """PP=4, m = 4 micro-batches of 2 x 16 x 32 fp32 activations, S = 4 V stages, rank p running stages
    p, p + 4, ...: each local stage s sends m x ([s < S-1] + [s > 0]) tensors and receives as many, so a
    middle stage sends both ways (1F1B: 4, 8, 8, 4 per rank; interleaved with V = 2: 12, 16, 16, 12)."""
    m, pp, activation = 4, 4, 2 * SEQ * HIDDEN * 4
    stages = pp * virtual
    for rank in stages4:
        local = range(rank["pp_rank"], stages, pp)
        sends = m * sum((s < stages - 1) + (s > 0) for s in local)
        traffic = rank["traffic"][virtual]
        assert traffic["send/pp"] == {"calls": sends, "bytes": sends * activation, "elements": sends * activation // 4}
        assert traffic["recv/pp"] == traffic["send/pp"]


@pytest.mark.slow
def test_fp16_overflow_on_one_stage_skips_the_step_everywhere(stages2):
    for rank in stages2:
        skipped, unchanged, next_skipped = rank["overflow"]
        assert skipped and unchanged and not next_skipped


def assert_resume_is_bitwise(run: dict) -> None:
    """Losses and gradient norms of the resumed steps, and every final parameter, bitwise equal to the
    uninterrupted run's."""
    assert run["interrupted"] == run["uninterrupted"]
    assert run["final"].keys() == run["resumed_final"].keys()
    for name, value in run["final"].items():
        assert torch.equal(run["resumed_final"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("case", ["1f1b", "interleaved", "gpipe-full-recompute", "1f1b-selective-recompute"])
def test_resume_with_dropout_on_the_same_pipeline_layout_is_bitwise(stages2, case):
    """PP=2, dropout 0.1, 2 steps (STOP), save, a new trainer loads and runs 2 more == 4 uninterrupted steps.
    The schedule's shape inference in the resumed trainer's first step must not move the RNG."""
    for rank in stages2:
        assert_resume_is_bitwise(rank["resume"][case])


@pytest.mark.slow
def test_resume_with_dropout_at_pp2_dp2_with_the_distributed_optimizer_is_bitwise(stages4):
    for rank in stages4:
        assert_resume_is_bitwise(rank["resume_pp2dp2_distributed_optimizer"])


@pytest.mark.slow
def test_checkpoint_moves_between_pipeline_layouts(world4, stages4, reference):
    """PP=2 x TP=2 saved after STOP steps -> PP=4 x TP=1 continues the single-process curve (every rank's) to the
    same final
    parameters; PP=1 -> PP=4 loads every tensor."""
    ref_curve, ref_params = reference[1]
    for rank in stages4:
        assert len(rank["pp2tp2_to_pp4"]) == TRAINED - STOP
        for (loss, norm), (ref_loss, ref_norm) in zip(rank["pp2tp2_to_pp4"], ref_curve[STOP:]):
            assert loss == pytest.approx(ref_loss, rel=TOL) and norm == pytest.approx(ref_norm, rel=TOL)
        assert_trained_parameters(rank["pp2tp2_to_pp4_params"], ref_params, TRAINED, TOL)
        for name, value in world4["single"].items():
            assert torch.equal(rank["single_to_pp4"][name], value), name


@pytest.mark.slow
def test_pipeline_checkpoint_serves_one_process_tools(stages4, workdir, tmp_path):
    """A PP=2 x TP=2 checkpoint (STOP steps) loads as a plain one-process model (`load_model`, as `shardlm eval`
    and `generate` load it) with the trained tensors, whose logits and greedy tokens equal those of the
    one-process run's checkpoint after the same steps; `shardlm checkpoint convert` consolidates it to
    one file holding exactly the trained tensors, `shardlm convert --to-hf` exports them (read back with
    `from_hf`, bitwise), and `shardlm checkpoint inspect` reads it."""
    from safetensors.torch import load_file

    from shardlm.checkpoint.hf import from_hf
    from shardlm.cli import main
    from shardlm.eval.generate import SamplingConfig, generate_tokens

    path, params = stages4[0]["saved_pp2tp2"]
    model, _ = load_model(path, ParallelContext.single())
    for name, value in model.named_parameters():
        expected = params[name]
        assert torch.equal(value.detach()[: expected.shape[0]], expected), name
    single, _ = load_model(workdir / "single", ParallelContext.single())
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, ref_logits = model(tokens)[..., :VOCAB], single(tokens)[..., :VOCAB]
    assert logits.shape == (2, SEQ, VOCAB)
    assert rel(logits, ref_logits) <= TOL
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    assert ([g.tokens for g in generate_tokens(model, prompts, greedy)]
            == [g.tokens for g in generate_tokens(single, prompts, greedy)])

    assert main(["checkpoint", "convert", str(path), "--output", str(tmp_path / "model.safetensors")]) == 0
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored.keys() == {f"model/{name}" for name in params}
    for name, value in params.items():
        assert torch.equal(stored[f"model/{name}"], value), name
    assert main(["convert", "--to-hf", str(tmp_path / "hf"), "--checkpoint", str(path)]) == 0
    back = load_file(str(from_hf(tmp_path / "hf", tmp_path / "back.safetensors")))
    assert back.keys() == stored.keys()
    for name, value in params.items():
        assert torch.equal(back[f"model/{name}"][: value.shape[0]], value), name
    assert main(["checkpoint", "inspect", str(path), "--json"]) == 0


@pytest.mark.slow
def test_inspect_reports_the_pipeline_layout(stages4, capsys):
    from shardlm.cli import main

    main(["checkpoint", "inspect", stages4[0]["saved_pp2tp2"][0], "--json"])
    info = json.loads(capsys.readouterr().out)
    assert (info["pipeline_parallel"], info["tensor_parallel"], info["data_parallel"]) == (2, 2, 1)
    assert any(name.startswith("layers.7.") for name in info["tensors"]) and "wpe" in info["tensors"]
