"""The layout tests' shared assertion can fail: one parameter on one rank off by 1e-3, or a curve off at one
step, is caught; the same run within rounding passes."""

from __future__ import annotations

import pytest
import torch

from agreement import assert_every_rank, assert_same_run

STEPS = 4


def one_process() -> dict:
    generator = torch.Generator().manual_seed(0)
    params = {"embedding.weight": torch.randn(16, 8, generator=generator),
              "layers.0.mlp.fc.bias": torch.zeros(8)}
    return {"curve": [(4.0 - 0.5 * step, 1.0 + 0.1 * step) for step in range(STEPS)], "params": params, "valid": 2.5}


def copy(run: dict, curve=None, params=None) -> dict:
    return {"curve": list(curve or run["curve"]), "valid": run["valid"],
            "params": {name: value.clone() for name, value in (params or run["params"]).items()}}


def ranks(*values) -> list:
    """Results as `run_workers(..., run_checks, ...)` returns them, one case "case" per rank."""
    return [{"case": ("ok", value)} for value in values]


def test_a_run_within_rounding_passes():
    ref = one_process()
    near = copy(ref, curve=[(loss * (1 + 1e-7), norm) for loss, norm in ref["curve"]])
    near["params"]["embedding.weight"] += 1e-7
    assert_every_rank(ranks(near, copy(ref)), "case", ref, steps=STEPS)


def test_one_rank_with_a_parameter_off_by_1e_3_fails():
    ref = one_process()
    off = copy(ref)
    off["params"]["embedding.weight"][3, 5] += 1e-3
    with pytest.raises(AssertionError, match="case rank 1 final parameter embedding.weight"):
        assert_every_rank(ranks(copy(ref), off), "case", ref, steps=STEPS)


@pytest.mark.parametrize("column", [0, 1])
def test_a_curve_off_at_one_step_fails(column):
    ref = one_process()
    curve = [list(step) for step in ref["curve"]]
    curve[2][column] *= 1 + 1e-4
    with pytest.raises(AssertionError, match=f"case rank 0 step 3: {('loss', 'grad norm')[column]}"):
        assert_every_rank(ranks(copy(ref, curve=[tuple(s) for s in curve]), copy(ref)), "case", ref, steps=STEPS)


def test_a_missing_step_a_missing_parameter_or_another_validation_fails():
    ref = one_process()
    with pytest.raises(AssertionError, match="3 steps"):
        assert_same_run(copy(ref, curve=ref["curve"][:3]), ref, "case", steps=STEPS)
    fewer = copy(ref)
    del fewer["params"]["layers.0.mlp.fc.bias"]
    with pytest.raises(AssertionError, match="layers.0.mlp.fc.bias"):
        assert_same_run(fewer, ref, "case", steps=STEPS)
    other = copy(ref) | {"valid": ref["valid"] * (1 + 1e-4)}
    with pytest.raises(AssertionError, match="validation"):
        assert_same_run(other, ref, "case", steps=STEPS)


def test_a_tuple_run_and_extra_columns_are_compared():
    ref = one_process()
    extra = [(loss, norm, 0.01) for loss, norm in ref["curve"]]
    off = [(loss, norm, 0.01 * (1 + 1e-3)) for loss, norm in ref["curve"]]
    columns = ("loss", "grad norm", "aux loss")
    assert_same_run((extra, ref["params"]), (extra, ref["params"]), steps=STEPS, columns=columns)
    with pytest.raises(AssertionError, match="step 1: aux loss"):
        assert_same_run((off, ref["params"]), (extra, ref["params"]), steps=STEPS, columns=columns)


def test_absolute_columns_are_bounded_absolutely_and_the_rest_stay_relative():
    """A reward near zero off by 1e-6 passes as an absolute column (relative to it, 1e-6 would be 1e-2), one off by
    2e-5 fails; the loss keeps its relative bound beside it."""
    ref = one_process()
    columns = ("loss", "grad norm", "reward")
    curve = [(loss, norm, 1e-4) for loss, norm in ref["curve"]]
    near = [(loss, norm, 1e-4 + 1e-6) for loss, norm in ref["curve"]]
    assert_same_run((near, ref["params"]), (curve, ref["params"]), steps=STEPS, columns=columns, absolute=("reward",))
    with pytest.raises(AssertionError, match="step 1: reward"):
        assert_same_run((near, ref["params"]), (curve, ref["params"]), steps=STEPS, columns=columns)
    far = [(loss, norm, 1e-4 + 2e-5) for loss, norm in ref["curve"]]
    with pytest.raises(AssertionError, match="step 1: reward"):
        assert_same_run((far, ref["params"]), (curve, ref["params"]), steps=STEPS, columns=columns,
                        absolute=("reward",))
    loss_off = [(loss * (1 + 2e-5), norm, 1e-4) for loss, norm in ref["curve"]]
    with pytest.raises(AssertionError, match="step 1: loss"):
        assert_same_run((loss_off, ref["params"]), (curve, ref["params"]), steps=STEPS, columns=columns,
                        absolute=("reward",))


def test_a_column_tolerance_bounds_its_column_only():
    """A column given 5e-5 passes 3e-5 off and fails 6e-5 off; the loss beside it keeps 1e-5."""
    ref = one_process()
    columns, tols = ("loss", "grad norm", "max logit"), {"max logit": 5e-5}
    curve = [(loss, norm, 5.0) for loss, norm in ref["curve"]]

    def run(loss_error, logit_error):
        return [(loss * (1 + loss_error), norm, 5.0 * (1 + logit_error)) for loss, norm in ref["curve"]], ref["params"]

    assert_same_run(run(0, 3e-5), (curve, ref["params"]), steps=STEPS, columns=columns, column_tols=tols)
    with pytest.raises(AssertionError, match="step 1: max logit"):
        assert_same_run(run(0, 6e-5), (curve, ref["params"]), steps=STEPS, columns=columns, column_tols=tols)
    with pytest.raises(AssertionError, match="step 1: loss"):
        assert_same_run(run(3e-5, 0), (curve, ref["params"]), steps=STEPS, columns=columns, column_tols=tols)


def test_every_validation_loss_of_a_list_is_compared():
    """A run evaluated before and after training: the second loss off by 1e-4 fails, a missing one fails."""
    ref = copy(one_process()) | {"valid": [0.69, 0.6]}
    assert_same_run(copy(ref) | {"valid": [0.69, 0.6 * (1 + 1e-7)]}, ref, "case", steps=STEPS)
    with pytest.raises(AssertionError, match="validation 1"):
        assert_same_run(copy(ref) | {"valid": [0.69, 0.6 * (1 + 1e-4)]}, ref, "case", steps=STEPS)
    with pytest.raises(AssertionError, match="1 validation losses"):
        assert_same_run(copy(ref) | {"valid": [0.69]}, ref, "case", steps=STEPS)
