"""Mixture-of-Experts under context parallelism gives the one-process answer (gloo; fp32, dropout 0).

Each layout trains a tiny MoE model (4 experts, top-2, 16 tokens per sequence) for 2 steps of 4 sequences; the loss,
gradient norm, reported aux loss and least / most loaded expert share at every step and every final
parameter (experts gathered over EP and TP, expert biases included) must be within 1e-5 (relative) of
one process running the same micro-batches. The routing losses and expert loads are those of each
micro-batch's whole token set, so the CP ranks' routing statistics must be summed over CP.
One world of 4: CP=2 x TP=2 with and without sequence parallelism (DP=1); CP=2 x TP=2 x EP=2, the
experts split over the two CP ranks (DP=1); CP=4 x EP=4; CP=2 x DP=2 x EP=2 (EP inside each CP group,
expert-DP over DP) with the distributed optimizer, and its checkpoint read back by one process;
CP=2 x DP=2 x EP=4 (EP over DP x CP, expert-DP of one rank); DeepSeek-style routing (sigmoid, expert
bias, shared experts, group-limited top-k) at CP=2 x DP=2 x EP=2 with the distributed optimizer; CP=2 x
PP=2; CP=2 x DP=2 x EP=2 with full recomputation (the routing and its CP sums rerun); and a CP=2 run
whose routing statistics are deliberately not summed over CP, which must not match.
The references and the one-line errors run in this process.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_parallel import ROUTING, curve_of, full_parameters
from test_training import ADAM_EPS, VOCAB, synthetic_data

from shardlm.checkpoint import load_model, save_checkpoint
from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.models.moe import moe_layers
from shardlm.parallel import ParallelContext
from shardlm.parallel.layout import context_grid, expert_data_parallel_groups, expert_parallel_groups
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

import agreement
from agreement import assert_trained_but_off
from multiproc import check_result, merge_copies, run_checks, run_workers

STEPS, TOL, MICRO, BATCH = 2, 1e-5, 2, 4


def cp_moe_config(arch: str, routing: str, cp: int = 1, tp: int = 1, ep: int = 1, sp: bool = False, pp: int = 1,
                  **train):
    return from_dict({
        "model": {"arch": arch, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                  "vocab_size": VOCAB, "dropout": 0.0} | ROUTING[routing],
        "parallel": {"tensor": tp, "context": cp, "expert": ep, "sequence_parallel": sp, "pipeline": pp},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": MICRO, "global_batch_size": BATCH, "steps": STEPS,
                  "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 7, **train},
    })


def curve_and_loads(metrics: list[dict]) -> list[tuple[float, ...]]:
    """(loss, grad norm, aux loss, least and most loaded expert's share) of each step."""
    return [(*row, m["expert_load_min"], m["expert_load_max"]) for row, m in zip(curve_of(metrics), metrics)]


def train_layout(ctx: ParallelContext, config, tamper=None):
    """(curve of `curve_and_loads`, final parameters in one process's layout, trainer) of STEPS steps."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, synthetic_data())
    if tamper:
        tamper(trainer)
    curve = curve_and_loads([trainer.train_step() for _ in range(STEPS)])
    return curve, full_parameters(trainer.model), trainer


def run(config, tamper=None, save: str | None = None):
    """A check: train `config` on the whole world (its parallel sizes), then save a checkpoint to `save`."""
    def check():
        p = config.parallel
        ctx = ParallelContext.from_process_group(p.tensor, context_parallel=p.context, expert_parallel=p.expert,
                                                 pipeline_parallel=p.pipeline)
        curve, params, trainer = train_layout(ctx, config, tamper)
        if save:
            save_checkpoint(trainer, save)
        if p.pipeline > 1:  # every stage's parameters
            params = merge_copies(ctx.world.all_gather_object(params))
        return curve, params, (ctx.ep.size, ctx.expert_dp.size, ctx.dp_cp.size)
    return check


def without_cp_routing_sums(trainer):
    """Wrong on purpose: each CP rank's routing losses of its own tokens only (no sum over CP)."""
    for layer in moe_layers(trainer.model):
        layer.token_groups = tuple(group for group in layer.token_groups if group is not trainer.ctx.cp)


def world4_checks(directory: str):
    return run_checks({
        "cp2_tp2_gpt": run(cp_moe_config("gpt", "mixtral", cp=2, tp=2)),
        "cp2_tp2_sp_llama": run(cp_moe_config("llama", "mixtral", cp=2, tp=2, sp=True)),
        "cp2_tp2_ep2_sp_gpt": run(cp_moe_config("gpt", "mixtral", cp=2, tp=2, ep=2, sp=True)),
        "cp4_ep4_llama": run(cp_moe_config("llama", "mixtral", cp=4, ep=4)),
        "cp2_dp2_ep2_gpt_zero": run(cp_moe_config("gpt", "mixtral", cp=2, ep=2, distributed_optimizer=True),
                                    save=directory),
        "cp2_dp2_ep4_llama": run(cp_moe_config("llama", "mixtral", cp=2, ep=4)),
        "cp2_dp2_ep2_llama_deepseek_zero": run(cp_moe_config("llama", "deepseek", cp=2, ep=2,
                                                             distributed_optimizer=True)),
        "cp2_pp2_gpt": run(cp_moe_config("gpt", "mixtral", cp=2, pp=2)),
        "cp2_dp2_ep2_llama_full_recompute": run(cp_moe_config("llama", "mixtral", cp=2, ep=2, recompute="full")),
        "cp2_tp2_gpt_no_cp_sums": run(cp_moe_config("gpt", "mixtral", cp=2, tp=2), tamper=without_cp_routing_sums),
    })


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cp_moe_ckpt")


@pytest.fixture(scope="module")
def world4(checkpoint_dir):
    return run_workers(4, world4_checks, str(checkpoint_dir), timeout=600)


_REFERENCES = {}


def reference(arch: str, routing: str):
    """One process, the same micro-batches: (curve, parameters), cached per module."""
    if (arch, routing) not in _REFERENCES:
        _REFERENCES[arch, routing] = train_layout(ParallelContext.single(), cp_moe_config(arch, routing))[:2]
    return _REFERENCES[arch, routing]


CP_MOE_CURVE = ("loss", "grad norm", "aux loss", "least expert load", "most expert load")
"""What `curve_and_loads` records at each step."""


def assert_same_run(curve, params, ref, where: str = ""):
    """A run's curve (losses and expert loads) and parameters equal the reference's STEPS steps within TOL
    (`agreement.assert_same_run`)."""
    ref_curve, ref_params = ref
    agreement.assert_same_run((curve, params), (ref_curve[:STEPS], ref_params), where, steps=STEPS, tol=TOL,
                              columns=CP_MOE_CURVE)


@pytest.mark.parametrize("name,arch,routing,groups", [
    ("cp2_tp2_gpt", "gpt", "mixtral", (1, 2, 2)),
    ("cp2_tp2_sp_llama", "llama", "mixtral", (1, 2, 2)),  # statistics summed over TP (SP) and CP
    ("cp2_tp2_ep2_sp_gpt", "gpt", "mixtral", (2, 1, 2)),  # EP over the two CP ranks, DP=1
    ("cp4_ep4_llama", "llama", "mixtral", (4, 1, 4)),
    ("cp2_dp2_ep2_gpt_zero", "gpt", "mixtral", (2, 2, 4)),  # EP inside each CP group, expert-DP over DP
    ("cp2_dp2_ep4_llama", "llama", "mixtral", (4, 1, 4)),  # EP over DP x CP
    ("cp2_dp2_ep2_llama_deepseek_zero", "llama", "deepseek", (2, 2, 4)),  # expert biases from the global counts
    ("cp2_pp2_gpt", "gpt", "mixtral", (1, 2, 2)),  # two pipeline stages, each CP=2
    ("cp2_dp2_ep2_llama_full_recompute", "llama", "mixtral", (2, 2, 4)),  # reruns counted: test_recompute_layouts
])
def test_moe_with_context_parallelism_equals_one_process(world4, name, arch, routing, groups):
    """Every rank reports the one-process losses, aux loss and expert loads, and ends on its parameters;
    (EP, expert-DP, DP x CP) group sizes are those of the layout."""
    for rank, (curve, params, sizes) in enumerate(check_result(world4, name)):
        assert sizes == groups
        assert_same_run(curve, params, reference(arch, routing), f"{name} rank {rank}")


def test_deepseek_reference_moves_the_expert_biases():
    """What the DeepSeek-style comparison covers: biases that moved (from counts summed over every rank)."""
    _, params = reference("llama", "deepseek")
    assert params["layers.1.mlp.router.expert_bias"].abs().max() > 0


def test_routing_statistics_not_summed_over_cp_do_not_match(world4):
    """The comparison catches a CP rank that balances only its own tokens: the broken run trains every step to
    finite losses, and its routers end more than 1e-3 from one process's (100 times the bound), on every rank."""
    ref_params = reference("gpt", "mixtral")[1]
    for curve, params, _ in check_result(world4, "cp2_tp2_gpt_no_cp_sums"):
        assert_trained_but_off(curve, params, ref_params, STEPS, ".mlp.router.")


def test_checkpoint_saved_at_cp2_dp2_ep2_loads_in_one_process(world4, checkpoint_dir):
    """Each expert is written once (by the first data x context rank of its EP position, some on CP rank 1):
    one process reads every dense weight and every expert of the CP=2 x DP=2 x EP=2 run."""
    saved = check_result(world4, "cp2_dp2_ep2_gpt_zero")[0][1]
    loaded = full_parameters(load_model(checkpoint_dir, ParallelContext.single())[0])
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)


def test_expert_groups_fold_over_data_and_context_ranks_cp_first():
    """Megatron's folding on PP=1 x DP=2 x CP=2 x TP=2 (ranks d C T + c T + t): EP=2 pairs the CP ranks of one
    (DP, TP) position, expert-DP the DP ranks; EP=4 takes all four DP x CP ranks of a TP rank."""
    grid = context_grid(8, 2, 1, 2)
    assert expert_parallel_groups(grid, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert expert_data_parallel_groups(grid, 2) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert expert_parallel_groups(grid, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert expert_data_parallel_groups(grid, 4) == [[0], [2], [4], [6], [1], [3], [5], [7]]


@pytest.mark.parametrize("parallel,world,message", [
    ({"context": 2, "expert": 4}, 2, "parallel.expert=4 does not divide the data-parallel x context-parallel "
                                     "size 1 x 2 = 2"),
    ({"context": 2, "expert": 8}, 4, "parallel.expert=8 does not divide the data-parallel x context-parallel "
                                     "size 2 x 2 = 4"),
])
def test_expert_size_not_dividing_dp_x_cp_is_a_one_line_error(parallel, world, message):
    config = cp_moe_config("gpt", "mixtral")
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    config.model.moe_num_experts = 8
    with pytest.raises(UserError) as error:
        validate(config, world, check_paths=False)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_moe_with_context_parallelism_validates():
    """MoE with parallel.context > 1 is accepted, experts split over DP x CP ranks beyond DP."""
    for parallel, world in (({"context": 2}, 2), ({"context": 2, "expert": 2}, 2), ({"context": 4, "expert": 4}, 4)):
        config = cp_moe_config("gpt", "mixtral")
        for key, value in parallel.items():
            setattr(config.parallel, key, value)
        validate(config, world, check_paths=False)
