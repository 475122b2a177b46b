"""Expert parallelism gives the one-process answer (gloo; fp32, dropout 0).

Each layout trains a tiny MoE model for 3 steps (2 of warm-up, 1 of decay: after 4 the DeepSeek routing's expert
biases happen to be back at 0); loss, gradient norm and the reported aux loss at every step and every final
parameter (experts gathered over EP and TP, expert biases included) must be within
1e-5 (relative) of one process running the same micro-batches. World of 2: DP=2 (EP=1); EP=2 (DP=2)
with Mixtral-style routing, both dispatchers, full recomputation, DeepSeek-style routing (sigmoid,
expert bias, shared experts, group-limited top-k, first layer dense); PP=2 with MoE on the second stage
only; a run saved and resumed at EP=2; a checkpoint saved at EP=2 with the distributed optimizer and
loaded in one process (and at EP=4); an fp16 overflow in EP rank 1's experts only; the dispatchers' own
checks. World of 4: EP=2 x DP=4 (expert-DP
2), EP=4, EP=2 x TP=2, EP=2 x TP=2 with sequence parallelism, the distributed optimizer sharding
expert state over expert-DP, EP=2 x PP=2 (and its checkpoint), and two deliberately wrong
expert-gradient reductions (over the dense DP group; divided by expert-DP instead of DP), which must
not match.
"""

from __future__ import annotations

import pytest
import torch
from test_training import ADAM_EPS, VOCAB, synthetic_data

from shardlm.checkpoint import consolidate, load_checkpoint, load_model, save_checkpoint
from shardlm.config import from_dict
from shardlm.parallel import ParallelContext
from shardlm.parallel.experts import AllGatherDispatcher, AllToAllDispatcher
from shardlm.training import trainer as trainer_module
from shardlm.training.gradients import _reduce_in_place
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

import agreement
from agreement import assert_every_rank, assert_trained_but_off, assert_trained_parameters
from layouts import MIXTRAL, MOE
from multiproc import check_result, merge_copies, run_checks, run_workers

STEPS, TOL = 3, 1e-5
DEEPSEEK = {"moe_num_experts": 8, "moe_score": "sigmoid", "moe_expert_bias_rate": 0.01, "moe_shared_experts": 1,
            "moe_first_dense_layers": 1, "moe_groups": 4, "moe_topk_groups": 2, "moe_routed_scaling": 2.0,
            "moe_aux_loss_coeff": 0.001}
ROUTING = {"mixtral": MIXTRAL, "deepseek": MOE | DEEPSEEK,
           "mixtral_first_dense": MIXTRAL | {"moe_first_dense_layers": 1}}


def moe_config(arch: str, routing: str, micro: int, tp: int = 1, ep: int = 1, sp: bool = False,
               dispatcher: str = "all_to_all", pp: int = 1, **train):
    return from_dict({
        "model": {"arch": arch, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                  "vocab_size": VOCAB, "dropout": 0.0} | ROUTING[routing],
        "parallel": {"tensor": tp, "expert": ep, "sequence_parallel": sp, "expert_dispatcher": dispatcher,
                     "pipeline": pp},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": micro, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 7, **train},
    })


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter in the one-process layout: TP shards concatenated, expert stacks gathered over EP,
    vocabulary padding removed."""
    ctx, out = model.ctx, {}
    for name, param in model.named_parameters():
        value = param.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP: gathered over DP
        if hasattr(param, "tensor_parallel_dim"):
            value = torch.cat(ctx.tp.all_gather(value.contiguous()), dim=param.tensor_parallel_dim)
        if getattr(param, "expert_parallel", False):
            value = torch.cat(ctx.ep.all_gather(value.contiguous()))
        out[name] = value[:VOCAB].clone() if name in ("wte.weight", "lm_head.weight") else value.clone()
    return out


def stage_parameters(model) -> dict[str, torch.Tensor]:
    """`full_parameters` of every pipeline stage on every rank, merged with `merge_copies` (a tied copy that
    differs between stages fails); without pipeline stages, this rank's `full_parameters`."""
    params = full_parameters(model)
    return merge_copies(model.ctx.world.all_gather_object(params)) if model.ctx.pp_size > 1 else params


def curve_of(metrics: list[dict]) -> list[tuple[float, float, float]]:
    return [(m["loss"], m["grad_norm"], m["moe_aux_loss"]) for m in metrics]


def train_layout(ctx: ParallelContext, config, steps: int = STEPS):
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, synthetic_data())
    return curve_of([trainer.train_step() for _ in range(steps)]), full_parameters(trainer.model), trainer


def run(config, tp: int = 1, ep: int = 1, pp: int = 1, save: str | None = None):
    """A check: train `config` on the whole world as PP x DP x TP with expert size `ep` (rank 0 returns
    the parameters of every pipeline stage), then save a checkpoint to `save` when given."""
    def check():
        ctx = ParallelContext.from_process_group(tp, pipeline_parallel=pp, expert_parallel=ep)
        curve, params, trainer = train_layout(ctx, config)
        if save:
            save_checkpoint(trainer, save)
        if pp > 1:
            params = merge_copies(ctx.world.all_gather_object(params))
        return curve, params
    return check


# ------------------------------------------------------------------------------------------- dispatch

def dispatch_checks():
    """On EP = world: round trips of random tokens through each dispatcher (identity experts; the
    all-to-all with a different token count on every rank), and the two dispatchers' outputs and input
    gradients with a nonlinear function of each expert's global index."""
    ctx = ParallelContext.from_process_group(1, expert_parallel=torch.distributed.get_world_size())
    g = torch.Generator().manual_seed(10 + ctx.rank)
    E, k, h = 4, 2, 8

    def inputs(n: int):
        return torch.randn(n, h, generator=g), torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])

    dispatchers = {"all_to_all": AllToAllDispatcher(E, ctx.ep), "all_gather": AllGatherDispatcher(E, ctx.ep)}
    out = {}
    for kind, n in (("all_to_all", 12 + 3 * ctx.rank), ("all_gather", 12)):
        x, indices = inputs(n)
        x.requires_grad_()
        rows, _, plan = dispatchers[kind].dispatch(x, indices)
        back = dispatchers[kind].combine(rows, plan)
        upstream = torch.randn(n * k, h, generator=g)
        back.backward(upstream)
        out[f"{kind}_round_trip_exact"] = (torch.equal(back, x.detach().repeat_interleave(k, 0))
                                           and torch.equal(x.grad, upstream.view(n, k, h).sum(1)))
    x, indices = inputs(12)
    upstream = torch.randn(12 * k, h, generator=g)
    expected = torch.tanh(x.repeat_interleave(k, 0) * (indices.reshape(-1, 1) + 1))
    for kind, dispatcher in dispatchers.items():
        xi = x.clone().requires_grad_()
        ctx.comm.reset()
        rows, counts, plan = dispatcher.dispatch(xi, indices)
        out[f"{kind}_dispatch_bytes"] = ctx.comm.snapshot()
        expert_of_row = torch.arange(len(counts)).repeat_interleave(counts) + ctx.ep.rank * len(counts)
        result = dispatcher.combine(torch.tanh(rows * (expert_of_row + 1).unsqueeze(1)), plan)
        result.backward(upstream)
        out[f"{kind}_expert_function"] = (result.detach(), xi.grad, torch.equal(result.detach(), expected))
    return out


# ------------------------------------------------------------------------------------------- worlds

def checkpoint_check(directory: str):
    """EP=2 DeepSeek-style with the distributed optimizer: STEPS steps, save, then one more step."""
    ctx = ParallelContext.from_process_group(1, expert_parallel=2)
    config = moe_config("llama", "deepseek", 4, ep=2, distributed_optimizer=True)
    curve, params, trainer = train_layout(ctx, config)
    save_checkpoint(trainer, directory)
    after = trainer.train_step()
    return {"curve": curve, "params": params, "next_step": curve_of([after])[0],
            "next_params": full_parameters(trainer.model), "num_parameters": trainer.num_parameters()}


def resume_check(directory: str):
    """EP=2 with plain AdamW under DDP: half the steps, save, a fresh trainer loads and runs the rest."""
    config = moe_config("gpt", "mixtral", 4, ep=2)
    ctx = ParallelContext.from_process_group(1, expert_parallel=2)
    first, _, trainer = train_layout(ctx, config, steps=STEPS // 2)
    save_checkpoint(trainer, directory)
    ctx.rng = None
    trainer = Trainer(config, ctx, synthetic_data())
    load_checkpoint(trainer, directory)
    rest = curve_of([trainer.train_step() for _ in range(STEPS - STEPS // 2)])
    return first + rest, full_parameters(trainer.model)


def fp16_overflow_in_one_ranks_experts():
    """EP=2 (DP=2) in fp16 with plain AdamW: one clean step, then a step where only EP rank 1 finds an inf in
    the gradient of its experts (which no other rank holds). Whether that step was skipped, whether this
    rank's parameters are unchanged, and the loss scale after it."""
    ctx = ParallelContext.from_process_group(1, expert_parallel=2)
    config = moe_config("gpt", "mixtral", 4, ep=2, precision="fp16", initial_loss_scale=1024.0)
    trainer = Trainer(config, ctx, synthetic_data())
    trainer.train_step()
    if ctx.ep.rank == 1:
        reduce = trainer.reduce_gradients

        def reduce_then_overflow():
            reduce()
            expert = next(p for p in trainer.params if getattr(p, "expert_parallel", False))
            expert.grad.view(-1)[0] = float("inf")
        trainer.reduce_gradients = reduce_then_overflow
    before = full_parameters(trainer.model)
    skipped = trainer.train_step()["skipped"]
    unchanged = all(torch.equal(value, before[name]) for name, value in full_parameters(trainer.model).items())
    return skipped, unchanged, trainer.scaler.scale


def world2_checks(directory: str):
    checks = {
        "dp2_gpt_mixtral": run(moe_config("gpt", "mixtral", 4)),  # EP=1: experts are plain DDP parameters
        "ep2_gpt_mixtral": run(moe_config("gpt", "mixtral", 4, ep=2), ep=2),
        "ep2_gpt_mixtral_all_gather": run(moe_config("gpt", "mixtral", 4, ep=2, dispatcher="all_gather"), ep=2),
        "ep2_gpt_mixtral_full_recompute": run(moe_config("gpt", "mixtral", 4, ep=2, recompute="full"), ep=2),
        "ep2_llama_deepseek": run(moe_config("llama", "deepseek", 4, ep=2), ep=2),
        "checkpoint": lambda: checkpoint_check(directory),
        "resume_ep2_gpt_mixtral": lambda: resume_check(f"{directory}/resume"),
        "pp2_gpt_mixtral_first_dense": run(moe_config("gpt", "mixtral_first_dense", 4, pp=2), pp=2),
        "dispatch": dispatch_checks,
        "fp16_overflow_ep2": fp16_overflow_in_one_ranks_experts,
    }
    return run_checks(checks)


def reduce_over_dense_dp(params, ctx):
    """Wrong on purpose (Megatron-LM #1628): expert gradients averaged over the dense DP group."""
    grads = [p.grad for p in params if getattr(p, "expert_parallel", False) and p.grad is not None]
    _reduce_in_place(grads, ctx.dp, divide=ctx.dp_size)


def reduce_not_scaled_by_dp(params, ctx):
    """Wrong on purpose (Megatron-LM PR #5956): the expert-DP sum divided by expert-DP, not DP."""
    grads = [p.grad for p in params if getattr(p, "expert_parallel", False) and p.grad is not None]
    _reduce_in_place(grads, ctx.expert_dp, divide=ctx.expert_dp.size)


def broken(reduction):
    """A check: EP=2 x DP=4 with `reduction` in place of the trainer's expert-gradient reduction."""
    def check():
        original = trainer_module.reduce_expert_gradients
        trainer_module.reduce_expert_gradients = reduction
        try:
            return run(moe_config("gpt", "mixtral", 2, ep=2), ep=2)()
        finally:
            trainer_module.reduce_expert_gradients = original
    return check


def load_at_ep4(directory: str):
    """The EP=2 checkpoint's model read at EP=4 (two of the 8 experts per rank), in one process's layout."""
    return full_parameters(load_model(directory, ParallelContext.from_process_group(1, expert_parallel=4))[0])


def world4_checks(directory: str):
    checks = {
        "ep4_loads_ep2_checkpoint": lambda: load_at_ep4(directory),
        "ep2_dp4_gpt_mixtral": run(moe_config("gpt", "mixtral", 2, ep=2), ep=2),
        "ep4_dp4_gpt_mixtral": run(moe_config("gpt", "mixtral", 2, ep=4), ep=4),
        "ep2_tp2_llama_deepseek": run(moe_config("llama", "deepseek", 4, tp=2, ep=2), tp=2, ep=2),
        "ep2_tp2_sp_llama_mixtral": run(moe_config("llama", "mixtral", 4, tp=2, ep=2, sp=True), tp=2, ep=2),
        "ep2_dp4_llama_deepseek_zero": run(moe_config("llama", "deepseek", 2, ep=2, distributed_optimizer=True),
                                           ep=2),
        "ep2_pp2_llama_deepseek": run(moe_config("llama", "deepseek", 2, ep=2, pp=2), ep=2, pp=2,
                                      save=f"{directory}/ep2_pp2"),
        "wrong_group": broken(reduce_over_dense_dp),
        "wrong_scale": broken(reduce_not_scaled_by_dp),
    }
    return run_checks(checks)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_ckpt")


@pytest.fixture(scope="module")
def world2(checkpoint_dir):
    return run_workers(2, world2_checks, str(checkpoint_dir), timeout=600)


@pytest.fixture(scope="module")
def world4(world2, checkpoint_dir):  # after world2, which writes the checkpoint
    return run_workers(4, world4_checks, str(checkpoint_dir), timeout=600)


_REFERENCES = {}


def reference(arch: str, routing: str, micro: int):
    """One process, the same micro-batches (cached per module)."""
    key = (arch, routing, micro)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_layout(ParallelContext.single(), moe_config(arch, routing, micro))[:2]
    return _REFERENCES[key]


MOE_CURVE = ("loss", "grad norm", "aux loss")
"""What `curve_of` records at each step."""


def assert_same_run(run_result, ref, where: str = ""):
    """A (curve, parameters) run equals the reference's STEPS steps within TOL, its auxiliary loss included
    (`agreement.assert_same_run`)."""
    (curve, params), (ref_curve, ref_params) = run_result, ref
    agreement.assert_same_run((curve, params), (ref_curve[:STEPS], ref_params), where, steps=STEPS, tol=TOL,
                              columns=MOE_CURVE)


@pytest.mark.parametrize("name,arch,routing,micro", [
    ("dp2_gpt_mixtral", "gpt", "mixtral", 4),
    ("ep2_gpt_mixtral", "gpt", "mixtral", 4),
    ("ep2_gpt_mixtral_all_gather", "gpt", "mixtral", 4),
    ("ep2_gpt_mixtral_full_recompute", "gpt", "mixtral", 4),  # reruns counted: test_recompute_layouts
    ("ep2_llama_deepseek", "llama", "deepseek", 4),
    ("pp2_gpt_mixtral_first_dense", "gpt", "mixtral_first_dense", 4),  # stage 0 holds no MoE layer
    ("resume_ep2_gpt_mixtral", "gpt", "mixtral", 4),  # saved after STEPS // 2 steps, resumed by a fresh trainer
])
def test_world2_expert_parallel_equals_one_process(world2, name, arch, routing, micro):
    # every rank: its data replicas and pipeline stages
    assert_every_rank(world2, name, reference(arch, routing, micro), steps=STEPS, tol=TOL, columns=MOE_CURVE)


@pytest.mark.parametrize("name,arch,routing,micro", [
    ("ep2_dp4_gpt_mixtral", "gpt", "mixtral", 2),
    ("ep4_dp4_gpt_mixtral", "gpt", "mixtral", 2),
    ("ep2_tp2_llama_deepseek", "llama", "deepseek", 4),
    ("ep2_tp2_sp_llama_mixtral", "llama", "mixtral", 4),
    ("ep2_dp4_llama_deepseek_zero", "llama", "deepseek", 2),
    ("ep2_pp2_llama_deepseek", "llama", "deepseek", 2),  # stage 0 holds no MoE layer
])
def test_world4_expert_parallel_equals_one_process(world4, name, arch, routing, micro):
    assert_every_rank(world4, name, reference(arch, routing, micro), steps=STEPS, tol=TOL, columns=MOE_CURVE)


def test_deepseek_reference_moves_the_expert_biases_and_has_an_aux_loss():
    """What the DeepSeek-style comparisons cover: biases that moved, a non-zero aux loss, a dense first layer."""
    curve, params = reference("llama", "deepseek", 4)
    assert params["layers.1.mlp.router.expert_bias"].abs().max() > 0
    assert "layers.0.mlp.router.weight" not in params and "layers.1.mlp.shared.up.weight" in params
    assert all(aux > 0 for _, _, aux in curve)


@pytest.mark.parametrize("name", ["wrong_group", "wrong_scale"])
def test_wrong_expert_gradient_reductions_do_not_match(world4, name):
    """The comparison catches both Megatron-LM bugs: the broken run trains every step to finite losses (a crash
    is not the mismatch we look for), and its experts end more than 1e-3 from one process's, 100 times the
    bound, on every rank."""
    ref_params = reference("gpt", "mixtral", 2)[1]
    for curve, params in check_result(world4, name):
        assert_trained_but_off(curve, params, ref_params, STEPS, ".mlp.experts.")


def test_fp16_overflow_in_one_ranks_experts_skips_the_step_everywhere(world2):
    """Split experts differ between the ranks of a DP group, so an inf in EP rank 1's expert gradients only
    must reach the overflow check of every rank: both skip the step, keep their parameters and halve nothing
    differently (the same loss scale)."""
    results = check_result(world2, "fp16_overflow_ep2")
    for skipped, unchanged, _ in results:
        assert skipped and unchanged
    assert results[0][2] == results[1][2]


def test_dispatch_round_trip_is_exact(world2):
    for result in check_result(world2, "dispatch"):
        assert result["all_to_all_round_trip_exact"] and result["all_gather_round_trip_exact"]


def test_all_to_all_sends_each_rank_exactly_its_rows(world2):
    """Dispatch bytes of the all-to-all = the E per-expert counts (int64) + N k rows of h fp32 values
    (12 tokens, k = 2, h = 8 here; own rows included, as all_to_all_single takes them)."""
    for result in check_result(world2, "dispatch"):
        stats = result["all_to_all_dispatch_bytes"]["all_to_all/ep"]
        assert stats["calls"] == 2 and stats["bytes"] == 4 * 8 + 12 * 2 * 8 * 4


def test_all_to_all_and_all_gather_dispatchers_agree(world2):
    """Same outputs and input gradients, both equal to the per-expert function applied token by token."""
    for result in check_result(world2, "dispatch"):
        (a2a, a2a_grad, a2a_ok), (ag, ag_grad, ag_ok) = result["all_to_all_expert_function"], \
            result["all_gather_expert_function"]
        assert a2a_ok and ag_ok
        torch.testing.assert_close(a2a, ag, rtol=0, atol=0)
        torch.testing.assert_close(a2a_grad, ag_grad, rtol=1e-6, atol=1e-7)


def test_checkpoint_saved_at_ep2_loads_in_one_process(world2, checkpoint_dir, tmp_path):
    """Experts stored per global index: one process loads the EP=2 checkpoint (weights, expert biases, sharded
    Adam moments; also consolidated into one file) and its next step equals the EP=2 run's next step."""
    result = check_result(world2, "checkpoint")[0]
    assert_same_run((result["curve"], result["params"]), reference("llama", "deepseek", 4))
    config = moe_config("llama", "deepseek", 4)
    consolidated = consolidate(checkpoint_dir, tmp_path / "moe.safetensors")
    for path in (checkpoint_dir, consolidated):
        loaded = full_parameters(load_model(path, ParallelContext.single())[0])
        assert loaded.keys() == result["params"].keys()
        for name, value in result["params"].items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    trainer = Trainer(config, ParallelContext.single(), synthetic_data())
    assert trainer.num_parameters() == result["num_parameters"]  # every EP rank's experts counted
    load_checkpoint(trainer, checkpoint_dir)
    after = curve_of([trainer.train_step()])[0]
    for a, b in zip(after, result["next_step"]):
        assert abs(a - b) <= TOL * abs(b)
    assert_trained_parameters(full_parameters(trainer.model), result["next_params"], STEPS + 1, TOL)


def test_checkpoint_saved_at_ep2_loads_at_ep4(world2, world4):
    """Each EP=4 rank reads its two experts by global index: gathered, they are the EP=2 run's weights."""
    saved = check_result(world2, "checkpoint")[0]["params"]
    loaded = check_result(world4, "ep4_loads_ep2_checkpoint")[0]
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)


def test_checkpoint_saved_at_ep2_pp2_loads_in_one_process(world4, checkpoint_dir):
    """Files per (stage, TP rank, EP rank): one process reads every stage's dense weights and every expert."""
    saved = check_result(world4, "ep2_pp2_llama_deepseek")[0][1]
    loaded = full_parameters(load_model(checkpoint_dir / "ep2_pp2", ParallelContext.single())[0])
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
