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


def layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, **config) -> dict:
    """One case: the tensor, pipeline, context and expert parallel sizes (data parallel takes the rest of the
    world) and the keyword arguments the test's run function takes besides them (model, schedule, controls)."""
    return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, **config}


def layout_context(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1):
    """The `ParallelContext` of a case on the world this process is in (torch.distributed initialized)."""
    from shardlm.parallel import ParallelContext

    return ParallelContext.from_process_group(tp, pipeline_parallel=pp, context_parallel=cp, expert_parallel=ep)


def case_spec(case) -> dict:
    """The `layout` dict of a case, a dict or a (reference name, dict) pair."""
    return case[1] if isinstance(case, tuple) else case


def layout_checks(run, cases: dict, more=None) -> dict:
    """Worker body: `run(**spec)` for every case, each result or traceback kept by name (`multiproc.run_checks`),
    so one failing case fails only its own tests; `more`: a module-level function returning further named checks
    ({name: callable}) to run in the same world after the cases."""
    specs = {name: case_spec(case) for name, case in cases.items()}
    checks = {name: (lambda spec=spec: run(**spec)) for name, spec in specs.items()}
    return run_checks(checks | (more() if more else {}))


def spawn_layouts(world_size: int, run, cases: dict, timeout: float = 600, more=None) -> list:
    """Every case of `cases` on one gloo world of `world_size` ranks: per rank, {name: ("ok", value) or ("error",
    traceback)}, read with `multiproc.check_result` or `agreement.assert_every_rank`. `run` (and `more`, the
    further checks of `layout_checks`) must be module-level functions (the workers import them by name)."""
    return run_workers(world_size, layout_checks, run, cases, more, timeout=timeout)
