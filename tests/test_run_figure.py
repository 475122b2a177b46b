"""The run's figure (loss_curve.png): the loss curve, for MoE runs the expert load and balancing loss, which show
routing collapse, and for sparse attention the indexers' KL divergence, drawn from the metrics.jsonl records a run
writes."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt

from shardlm.training.logging import plot_loss_curve, run_figure

DENSE = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 6)] + [{"step": 5, "val_loss": 4.7, "val_ppl": 110.0}]
MOE = [{"step": s, "loss": 5.0 - 0.1 * s, "moe_aux_loss": 0.02 - 0.001 * s, "expert_load_min": 0.5 + 0.05 * s,
        "expert_load_max": 2.0 - 0.1 * s} for s in range(1, 6)]


def lines(ax) -> dict[str, list]:
    return {line.get_label(): [list(line.get_xdata()), list(line.get_ydata())] for line in ax.get_lines()}


def test_a_dense_run_draws_its_train_and_validation_loss_in_one_panel():
    fig = run_figure(DENSE, "run")
    assert len(fig.axes) == 1
    drawn = lines(fig.axes[0])
    assert drawn["train loss"] == [[1, 2, 3, 4, 5], [r["loss"] for r in DENSE[:5]]]
    assert drawn["validation loss"] == [[5], [4.7]]
    plt.close(fig)


def test_an_moe_run_adds_the_expert_load_and_balancing_loss():
    fig = run_figure(MOE, "run")
    loss, load, aux = fig.axes  # the loss panel, the load panel and its right axis
    assert lines(loss)["train loss"][1] == [r["loss"] for r in MOE]
    drawn = lines(load)
    assert drawn["least loaded expert"] == [[1, 2, 3, 4, 5], [r["expert_load_min"] for r in MOE]]
    assert drawn["most loaded expert"][1] == [r["expert_load_max"] for r in MOE]
    assert lines(aux)["balancing loss (right)"][1] == [r["moe_aux_loss"] for r in MOE]
    plt.close(fig)


def test_a_sparse_attention_run_draws_the_indexer_kl_beside_the_loss():
    records = [{"step": s, "loss": 5.0 - 0.1 * s, "indexer_kl": 0.3 / s} for s in range(1, 6)]
    fig = run_figure(records, "run")
    loss, kl = fig.axes  # the loss panel and its right axis
    assert lines(loss)["train loss"][1] == [r["loss"] for r in records]
    assert lines(kl)["indexer KL (right)"] == [[1, 2, 3, 4, 5], [r["indexer_kl"] for r in records]]
    plt.close(fig)


def test_the_png_is_written_from_metrics_jsonl(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in MOE))
    out = plot_loss_curve(metrics, tmp_path / "loss_curve.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
