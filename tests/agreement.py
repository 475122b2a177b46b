"""How the layout tests measure agreement with one process, on every kind of CPU.

A layout sums in another order than one process, and so does every kind of CPU kernel (AVX2's and
AVX-512's vector widths; `ATEN_CPU_CAPABILITY` picks them), so fp32 results agree to a few units in the
last place per operation, never bit for bit. The measures here stay meaningful for every tensor:

- `rel`: ||a - b|| / ||b||, for outputs and gradients of one step.
- `trained_rel`: for a parameter after `steps` AdamW steps. AdamW moves each element by about the
  learning rate per step whatever the gradient's size, so an element whose gradient nearly cancels (a sum
  of many terms near zero: its rounding is the kernels' summation order) still takes a full-sized step,
  in a direction the rounding decides. Relative to ||b|| alone, a tensor that started at zero (a bias)
  and moved a few steps has a small norm, and that noise crosses 1e-5 of it on one kind of CPU and not
  on another (a packed SFT run's `layers.2.mlp.fc.bias`: 1.1e-5 at TP=2 on an AVX2-only
  EPYC, 0.7e-5 at CP=2 on an AVX-512 one). So the
  error is measured against the larger of ||b|| and the distance AdamW can move the tensor,
  `LR * steps * sqrt(numel)`: for weights and norms ||b|| is the larger and nothing changes; for a
  tensor near zero the bound is the same fraction of its training movement as for every other tensor.
  A real error (a missing reduction, a wrong shard) moves elements by a whole step: 1e-2 to 1 of it.
"""

from __future__ import annotations

import torch

LR = 3e-3
"""The peak learning rate of every layout test's AdamW run."""
LINEAR_ATTENTION_PARAMS_TOL = 5e-5
"""`trained_rel` bound on the final parameters of models with linear-attention layers (Gated DeltaNet, KDA), whose
gated, L2- and RMS-normed paths leave some weight elements with gradients that are rounding noise: AdamW still moves
each by a fraction of its step, in a direction the summation order decides. Measured on a 2-core AMD EPYC
(AVX-512): GRPO's hybrid at TP=2 ends layer 0's Gated DeltaNet o projection 1.88e-5 off one process (one element of
1,024 is 7.2e-6 off, the other 1,023 within 2.3e-7); Kimi Linear at CP=2 x TP=2 with SP its KDA o projection
1.12e-5 (a few elements at most 2.4e-6 off); on Intel Xeons both below 1e-5. A real error is 1e-3 or more."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a tensor: ||a - b|| / ||b|| (L2 over all its elements)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def trained_rel(a: torch.Tensor, b: torch.Tensor, steps: int, lr: float = LR) -> float:
    """Error of a parameter after `steps` AdamW steps of at most `lr`: ||a - b|| over the larger of ||b||
    and AdamW's reach, lr * steps * sqrt(numel) (see the module docstring for why)."""
    a, b = a.float(), b.float()
    scale = max(b.norm().item(), lr * steps * b.numel() ** 0.5, 1e-12)
    return (a - b).norm().item() / scale


def trained_errors(params: dict, ref_params: dict, steps: int, lr: float = LR) -> dict[str, float]:
    """`trained_rel` of every parameter of the reference, by name (`lr`: the run's peak learning rate)."""
    return {name: trained_rel(params[name], ref_params[name], steps, lr) for name in ref_params}


def assert_trained_but_off(curve: list, params: dict, ref_params: dict, steps: int, part: str,
                           bound: float = 1e-3) -> None:
    """A control's broken run: it trained all `steps` steps to finite losses (a crash is not the mismatch looked
    for), and the parameters whose names contain `part` end more than `bound` (`trained_rel`) from the reference."""
    import math

    assert len(curve) == steps and all(math.isfinite(step[0]) for step in curve), curve
    errors = trained_errors(params, ref_params, steps)
    assert max(error for name, error in errors.items() if part in name) > bound, errors


def assert_trained_parameters(params: dict, ref_params: dict, steps: int, tol: float = 1e-5,
                              where: str = "", lr: float = LR) -> None:
    """The same parameter names, and every one within `tol` of the reference by `trained_rel` (`lr`: the run's
    peak learning rate, where it is not LR); the message names the worst."""
    assert params.keys() == ref_params.keys(), f"{where}: {sorted(params.keys() ^ ref_params.keys())}"
    errors = trained_errors(params, ref_params, steps, lr)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{where} final parameter {worst} differs by {errors[worst]:.2e}"


CURVE = ("loss", "grad norm")
"""What a layout test's curve holds at each step, in order; runs that record more (an auxiliary loss, expert
loads, the MTP loss) name their columns with `columns=`."""


def assert_same_curve(curve: list, ref_curve: list, where: str = "", tol: float = 1e-5,
                      columns: tuple[str, ...] = CURVE, first_step: int = 1, absolute: tuple[str, ...] = (),
                      column_tols: dict[str, float] | None = None, from_step_2: tuple[str, ...] = ()) -> None:
    """A training curve equals the reference's: as many steps as the reference has from `first_step` on (a
    resumed run's curve starts there), and at each step every one of `columns` (the first len(columns) numbers of
    each step's tuple) within `tol` relative, |a - b| <= tol * |b|; the message names the step and the column.

    `absolute`: the columns bounded by |a - b| <= tol instead (a metric that crosses zero, such as DPO's rewards,
    where a relative bound would measure rounding); `column_tols`: a column's own `tol` (a quantity the layouts'
    rounding reaches magnified), never looser than the test says why; `from_step_2`: columns compared from step 2
    on (DPO's reward accuracy counts the pairs whose margin is positive, and at step 1, where the policy is its
    reference, every margin is rounding noise around 0: the margins themselves are compared there)."""
    ref_curve = ref_curve[first_step - 1:]
    assert len(curve) == len(ref_curve), f"{where}: {len(curve)} steps, the reference {len(ref_curve)}"
    assert set(absolute) | set(column_tols or {}) <= set(columns), (absolute, column_tols, columns)
    for step, (got, want) in enumerate(zip(curve, ref_curve), first_step):
        for what, a, b in zip(columns, got, want):
            if step == 1 and what in from_step_2:
                continue
            bound = (column_tols or {}).get(what, tol) * (1.0 if what in absolute else abs(b))
            assert abs(a - b) <= bound, f"{where} step {step}: {what} {a} vs {b}"


def assert_same_run(run, ref, where: str = "", *, steps: int, tol: float = 1e-5, params_tol: float | None = None,
                    columns: tuple[str, ...] = CURVE, first_step: int = 1, absolute: tuple[str, ...] = (),
                    column_tols: dict[str, float] | None = None, from_step_2: tuple[str, ...] = (),
                    lr: float = LR) -> None:
    """A layout's run equals the one-process run: its curve (`assert_same_curve`, `tol` relative; `absolute`,
    `column_tols` and `from_step_2` as there), its validation loss within `tol` relative where the reference has
    one (a list of them, one per evaluation, each so), and every final parameter within `params_tol` (default `tol`)
    by `trained_rel` after `steps` steps at most `lr` (the run's peak learning rate), the same names on both sides.

    `run` and `ref` are dicts {"curve", "params", optionally "valid"} or tuples (curve, params, ...); a reference
    whose "valid" is None (or a tuple run) skips the validation loss. `where` (the case and the rank) leads every
    message."""
    run, ref = as_run(run), as_run(ref)
    assert_same_curve(run["curve"], ref["curve"], where, tol, columns, first_step, absolute, column_tols,
                      from_step_2)
    if ref.get("valid") is not None:
        many = isinstance(ref["valid"], (list, tuple))
        got, want = (run["valid"], ref["valid"]) if many else ([run["valid"]], [ref["valid"]])
        assert len(got) == len(want), f"{where}: {len(got)} validation losses, the reference {len(want)}"
        for when, (a, b) in enumerate(zip(got, want)):
            assert abs(a - b) <= tol * abs(b), f"{where}: validation{f' {when}' if many else ''} {a} vs {b}"
    assert_trained_parameters(run["params"], ref["params"], steps, tol if params_tol is None else params_tol, where,
                              lr)


def as_run(run) -> dict:
    """A run as a dict {"curve", "params", ...}: a dict stays as it is, a tuple (curve, params, ...) is named."""
    return run if isinstance(run, dict) else {"curve": run[0], "params": run[1]}


def assert_every_rank(results: list, name: str, ref, **same_run) -> list:
    """`assert_same_run` for check `name` on every rank of `results` (from `layouts.spawn_layouts` or
    `run_workers(..., run_checks, ...)`), each message naming the case and the rank; returns the ranks' values
    for the test's own further checks. `same_run`: `steps=` and the tolerances of `assert_same_run`."""
    from multiproc import check_result

    values = check_result(results, name)
    for rank, value in enumerate(values):
        assert_same_run(value, ref, f"{name} rank {rank}", **same_run)
    return values
