"""Pipeline settings checked before any process starts: balanced contiguous stages, and one-line errors for
layouts that do not divide, schedules that cannot run and models the pipeline does not take."""

from __future__ import annotations

import pytest
from test_pipeline import pp_config

from shardlm.errors import UserError
from shardlm.parallel.pipeline import stage_layers
from shardlm.validation import validate


def test_stage_layers_are_balanced_contiguous_and_adjustable():
    assert stage_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stage_layers(7, 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert stage_layers(8, 4, first=1) == [[0], [1, 2], [3, 4], [5, 6, 7]]
    assert stage_layers(8, 3, first=2, last=2) == [[0, 1], [2, 3, 4, 5], [6, 7]]
    with pytest.raises(UserError, match="every stage needs at least one layer"):
        stage_layers(3, 4)


@pytest.mark.parametrize("world,overrides,message", [
    (6, {"pipeline": 4}, "world size 6 is not divisible by parallel.tensor x parallel.pipeline = 1 x 4"),
    (8, {"pipeline": 4, "pipeline_schedule": "interleaved-1f1b", "virtual_stages": 4}, "cannot fill 16"),
    (8, {"pipeline": 4}, 'fewer than 4, which "1f1b" needs at parallel.pipeline=4'),
    (2, {"pipeline": 2, "pipeline_schedule": "interleaved-1f1b"}, "needs parallel.virtual_stages >= 2"),
    (2, {"pipeline": 2, "virtual_stages": 2}, 'needs parallel.pipeline_schedule="interleaved-1f1b" or'),
    (2, {"pipeline": 2, "pipeline_schedule": "zero-bubble"}, "must be one of"),
    # m = 8 / 2 = 4 micro-batches: DualPipeV needs 2P
    (4, {"pipeline": 4, "pipeline_schedule": "dualpipev"}, 'fewer than 8, which "dualpipev" needs'),
    (2, {"pipeline": 2, "pipeline_schedule": "zbv", "virtual_stages": 3}, "always runs 2 stages per rank"),
    # the V needs 2P stages of at least one layer each: 8 layers fill 8 stages at P = 4, not 10 at P = 5
    (5, {"pipeline": 5, "pipeline_schedule": "zbv"}, "cannot fill 10 pipeline stages"),
    (4, {"pipeline": 4, "pipeline_schedule": "interleaved-zb", "virtual_stages": 3}, "cannot fill 12"),
])
def test_bad_pipeline_layouts_get_one_line_errors(world, overrides, message):
    config = pp_config(micro=2)
    config.train.global_batch_size = 8 if world != 5 else 10
    for key, value in overrides.items():
        setattr(config.parallel, key, value)
    with pytest.raises(UserError, match=message) as error:
        validate(config, world, check_paths=False)
    assert "\n" not in str(error.value)


def test_bert_under_pipeline_is_refused():
    config = pp_config(micro=2)
    config.model.arch, config.parallel.pipeline = "bert", 2
    with pytest.raises(UserError, match='supports model.arch="gpt" and "llama"') as error:
        validate(config, 2, check_paths=False)
    assert "\n" not in str(error.value)


def test_the_planner_knows_the_schedules_the_runtime_runs():
    """The planner keeps its own light copy of the schedule names (it plans without importing torch): the same
    names, the same V-shaped ones, the same stages a rank."""
    from shardlm.parallel import pipeline
    from shardlm.plan import schedule_sim, stages

    assert stages.SCHEDULES == pipeline.SCHEDULES and schedule_sim.V_SHAPED == pipeline.V_SHAPED
    for schedule in pipeline.SCHEDULES:
        for virtual in (1, 2, 3):
            assert schedule_sim.stages_per_rank(schedule, virtual) == pipeline.stages_per_rank(schedule, virtual)
