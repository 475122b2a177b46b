"""The plumbing of the layout tests: a table of cases, one world per size, every rank against one process.

A layout test names its cases in a table, trains each on a world spawned once per module, and compares every
rank with a one-process run (`agreement.assert_every_rank`):

    WORLD2 = {"tp2 sp gpt": layout(tp=2, sp=True), "cp2 llama": layout(cp=2, arch="llama")}

    def run_layout(tp, pp, cp, ep, **config):  # module level: each worker finds it by name
        return train(layout_context(tp, pp, cp, ep), my_config(tp=tp, pp=pp, cp=cp, ep=ep, **config))

    @pytest.fixture(scope="module")
    def world2():
        return spawn_layouts(2, run_layout, WORLD2)

    @pytest.mark.parametrize("name", list(WORLD2))
    def test_two_ranks_equal_one_process(world2, reference, name):
        assert_every_rank(world2, name, reference, steps=STEPS)

A case is `layout(...)`'s dict, or a pair (the name of the reference it equals, that dict): the pair lets one
table say both what runs and what it must equal.
"""

from __future__ import annotations

from multiproc import run_checks, run_workers

MLA = {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 12}
"""DeepSeek-V3's latent attention at the tests' size (a [model] section's keys): queries through a rank-16 latent,
keys and values through another, 8 + 4 (RoPE) key channels, values of 12 (a test that needs them narrower than the
keys overrides `v_head_dim`)."""

MOE = {"moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32}
"""A mixture of experts at the tests' size (a [model] section's keys): 4 experts of hidden 32, top-2, on every layer;
a routing's keys go on top (`MIXTRAL`, `test_moe_parallel.ROUTING`)."""

MIXTRAL = MOE | {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
"""Mixtral's MoE at the tests' size: `MOE` routed by softmax with the load-balancing (0.01) and router z (0.001)
losses; a test that needs a variation writes `MIXTRAL | {...}`."""


TRAIN = {"precision": "fp32", "global_batch_size": 8, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "clip_grad": 0.5,
         "adam_eps": 1e-6, "seed": 7}
"""The [train] section every layout test's AdamW run shares (fp32, 8 samples a step, peak learning rate
`agreement.LR`); a test adds its micro-batch, steps and what else it needs."""


def tiny_model(arch: str, seq: int, layers: int = 4, dropout: float = 0.0, **model) -> dict:
    """A [model] section at the layout tests' size: `layers` layers of hidden 32 and 4 heads over `seq` tokens of
    `test_training.VOCAB`, and `model`'s further keys."""
    from test_training import VOCAB

    return {"arch": arch, "num_layers": layers, "hidden_size": 32, "num_heads": 4, "seq_length": seq,
            "vocab_size": VOCAB, "dropout": dropout, **model}


def layout_config(model: dict, *, micro: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                  sp: bool = False, virtual: int = 1, sections: dict | None = None, **train):
    """A layout test's `RunConfig`: `model`, the parallel sizes (interleaved 1F1B when `virtual` > 1), `sections`
    (by default a placeholder [data] section) and `TRAIN` with the micro-batch and `train`'s keys (`steps` among
    them)."""
    from shardlm.config import from_dict

    schedule = {"pipeline_schedule": "interleaved-1f1b", "virtual_stages": virtual} if virtual > 1 else {}
    return from_dict({
        "model": model,
        "parallel": {"tensor": tp, "pipeline": pp, "context": cp, "expert": ep, "sequence_parallel": sp, **schedule},
        **(sections if sections is not None else {"data": {"text_file": "unused"}}),
        "train": {**TRAIN, "micro_batch_size": micro, **train},
    })


def counting(run, counts: dict, key: str, when=None):
    """`run` (a function, a bound method, a hook or a class's method) wrapped to add 1 to `counts[key]` at each call
    (at each call for which `when(*args, **kwargs)` holds, if given) before running it."""
    def call(*args, **kwargs):
        if when is None or when(*args, **kwargs):
            counts[key] += 1
        return run(*args, **kwargs)
    return call


def count_forwards(model) -> dict[str, int]:
    """Live counters of the calls of every transformer layer ("layer", a forward pre-hook) and of its attention core
    softmax(QK^T)V ("core", a wrapper of the bound method): a forward recomputed in the backward counts again.
    Pre-hooks, because a recomputation may stop early, once it has rebuilt what the backward needs."""
    counts = {"layer": 0, "core": 0}
    for layer in model.layers.values():
        layer.register_forward_pre_hook(counting(lambda *_: None, counts, "layer"))
        layer.attn.core = counting(layer.attn.core, counts, "core")
    return counts


def layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, **config) -> dict:
    """One case: the tensor, pipeline, context and expert parallel sizes (data parallel takes the rest of the
    world) and the keyword arguments the test's run function takes besides them (model, schedule, controls)."""
    return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, **config}


_CONTEXTS: dict = {}
"""This worker's context of each (tp, pp, cp, ep) that `layout_context` built: the cases of one layout share its
process groups (tens of milliseconds to build, at every rank), as the processes of a run do."""


def layout_context(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1):
    """The `ParallelContext` of a case on the world this process is in (torch.distributed initialized): built once
    per layout and world, handed to each later case with its traffic counts cleared and no generators (each
    trainer seeds its own)."""
    from shardlm.parallel import ParallelContext

    key = (tp, pp, cp, ep)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = ParallelContext.from_process_group(tp, pipeline_parallel=pp, context_parallel=cp,
                                                            expert_parallel=ep)
    ctx = _CONTEXTS[key]
    ctx.comm.reset()
    ctx.rng = None
    return ctx


def case_spec(case) -> dict:
    """The `layout` dict of a case, a dict or a (reference name, dict) pair."""
    return case[1] if isinstance(case, tuple) else case


def layout_checks(run, cases: dict, more=None, more_args: tuple = ()) -> dict:
    """Worker body: `run(**spec)` for every case, each result or traceback kept by name (`multiproc.run_checks`),
    so one failing case fails only its own tests; `more`: a module-level function returning further named checks
    ({name: callable}) to run in the same world after the cases, called with `more_args` (a folder, say)."""
    specs = {name: case_spec(case) for name, case in cases.items()}
    checks = {name: (lambda spec=spec: fresh_after_failure(run, spec)) for name, spec in specs.items()}
    return run_checks(checks | (more(*more_args) if more else {}))


def fresh_after_failure(run, spec: dict):
    """`run(**spec)` on every rank, then whether any rank failed (one all-reduce): if one did, every rank drops its
    cached contexts (a rank may have left a collective half done on their groups), so that the next case builds
    its groups afresh, all ranks alike."""
    import torch
    import torch.distributed as dist

    failure = None
    try:
        result = run(**spec)
    except Exception as exc:  # noqa: BLE001 - raised again below, once the ranks agree
        failure = exc
    failed = torch.tensor([failure is not None], dtype=torch.int32)
    dist.all_reduce(failed)
    if failed.item():
        _CONTEXTS.clear()
    if failure is not None:
        raise failure
    return result


def spawn_layouts(world_size: int, run, cases: dict, timeout: float = 600, more=None, more_args: tuple = ()) -> list:
    """Every case of `cases` on one gloo world of `world_size` ranks: per rank, {name: ("ok", value) or ("error",
    traceback)}, read with `multiproc.check_result` or `agreement.assert_every_rank`. `run` (and `more`, the
    further checks of `layout_checks`, given `more_args`) must be module-level functions (the workers import them
    by name)."""
    return run_workers(world_size, layout_checks, run, cases, more, more_args, timeout=timeout)


def selected_cases(request, cases: dict, param: str = "name") -> dict:
    """The cases of `cases` that the session's selected tests read through the fixture asking (`request`): those a
    selected test of this module names by its `param`, or every case as soon as one selected test takes the fixture
    without naming a case of the table (a check that reads several). A run of the whole module thus spawns every
    case; a run of a few named cases (the AVX2 rerun of `test_cpu_kinds.py`) only theirs."""
    names = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or request.fixturename not in item.fixturenames:
            continue
        name = item.callspec.params.get(param) if hasattr(item, "callspec") else None
        if name not in cases:
            return cases
        names.add(name)
    return {name: case for name, case in cases.items() if name in names}
