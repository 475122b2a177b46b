"""Importance-weighted on-policy distillation (`distill.loss = "iw_opd"`) against TRL's own IW-OPD loss and at every
layout.

- The loss of a packed row: a row of three documents (a prompt, then answer tokens; the middle one's advantages all
  zero, so its sum is clamped by epsilon) gives, per document, the value and the gradient TRL 1.16's
  `IWOPDTrainer._compute_iw_opd_loss` computes on that document alone (its own row, completion only), and
  `Tally` the metrics it logs for that row (one row: its per-batch means are the row's); weighting each token
  by the row's sums instead (one document a row) misses.
- Layouts (the distillation layouts' student, teacher and rows: `test_distill_layouts`; every step on-policy, the
  student's completions of up to 8 tokens sampled at the layout): CP=2 (a document's tokens on both CP ranks, the
  zigzag split: the |a| gathered over CP before the prefix sums), CP=2 under FSDP, TP=2 with SP, PP=2 and DP=2 with
  ZeRO-1 equal one process within 1e-5 (3 steps of 8 rows, AdamW's epsilon `ADAM_EPS`: losses, gradient norms, the
  IW-OPD metrics, validation loss, every parameter; measured: curves within 2.4e-7, parameters 9.3e-7 on the AVX2
  kernels and AVX-512). The control: at CP=2 each rank summing the |a| of its own part alone trains, and ends off
  (0.15).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_distill_layouts import STEPS, TOL, WIDE_BATCH, distill_config, train_distill, write_teacher

from shardlm.distill import iw_opd
from shardlm.models.documents import Documents
from shardlm.parallel import ParallelContext

from agreement import assert_same_run, assert_trained_but_off
from layouts import layout, layout_context, spawn_layouts
from multiproc import check_result, import_or_skip

GAMMA, EPSILON, TEMPERATURE = 0.5, 1e-8, 2.0
ADAM_EPS = 1e-4
"""The layouts' AdamW epsilon (the other layout tests' 1e-6): a sampled-token objective leaves some weight elements with
gradients near 0 (layers.1.attn.o.weight's smallest 2.6e-7 of a largest 1.2e-2 at step 1), which an epsilon of 1e-6
turns into near-whole AdamW steps whose direction the summation order decides: at TP=2 with SP that tensor ended
1.15e-5 off one process (AVX2 kernels; 9.2e-6 AVX-512) with every loss and gradient norm within 3.6e-7."""


def trl_iw_opd(student_logits, tokens, labels, teacher_logprobs):
    """TRL's `IWOPDTrainer._compute_iw_opd_loss` on a (1, T) completion: (loss, its logged metrics)."""
    from trl.experimental.iw_opd import IWOPDTrainer

    fake = SimpleNamespace(temperature=TEMPERATURE, iw_opd_gamma=GAMMA, iw_opd_epsilon=EPSILON,
                           model=SimpleNamespace(training=True), _metrics={"train": _Lists()})
    loss = IWOPDTrainer._compute_iw_opd_loss(fake, student_logits, tokens, labels, teacher_logprobs)
    return loss, {name: values[0] for name, values in fake._metrics["train"].items()}


class _Lists(dict):
    """TRL's metric store: a list per name, made on first use."""

    def __missing__(self, key):
        self[key] = []
        return self[key]


def test_packed_documents_weigh_as_trls_rows_alone():
    import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
    from shardlm.distill.divergence import token_log_probs

    ctx = ParallelContext.single()
    generator = torch.Generator().manual_seed(3)
    lengths, prompts, vocab = (9, 6, 11), (3, 2, 4), 17
    total = sum(lengths)
    logits = (torch.randn(total, vocab, generator=generator) * 3).requires_grad_()
    teacher = torch.randn(total, vocab, generator=generator) * 3
    tokens = torch.randint(0, vocab, (total,), generator=generator)
    answer = torch.ones(total, dtype=torch.bool)
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    for start, prompt in zip(starts, prompts):
        answer[start:start + prompt] = False
    middle = slice(starts[1], starts[2])
    teacher[middle] = logits.detach()[middle]  # the middle document: the teacher agrees, every a is 0
    logp, teacher_logp = token_log_probs(logits, teacher, tokens, ctx.tp, vocab, TEMPERATURE)
    a = torch.where(answer, teacher_logp - logp.detach(), 0.0)
    documents = Documents.from_offsets([[*starts, total]], total)
    weights = iw_opd.prefix_weights(a.abs()[None], documents, ctx.cp, GAMMA, EPSILON)[0]
    ours = torch.where(answer, -(weights * a) * logp, 0.0)
    tally = iw_opd.Tally()
    for start, length, prompt in zip(starts, lengths, prompts):
        part = slice(start + prompt, start + length)
        labels = tokens[part][None]
        given = teacher_logp[part]
        if start == starts[1]:  # the teacher agrees: its log-probabilities as TRL computes the student's, a = 0 there
            given = torch.log_softmax(logits.detach()[part] / TEMPERATURE, -1).gather(-1, labels.T).squeeze(-1)
        loss, metrics = trl_iw_opd(logits[part][None], labels, labels, given[None])
        mine = ours[part].sum() / (length - prompt)
        assert torch.allclose(mine, loss, rtol=1e-6, atol=1e-7), (start, mine, loss)
        (theirs_grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        (our_grad,) = torch.autograd.grad(mine, logits, retain_graph=True)
        assert torch.allclose(our_grad, theirs_grad, rtol=1e-5, atol=1e-7), start
        tally.add(a[part], weights[part])
        figures = tally.take(ctx)
        for name, value in metrics.items():
            assert figures[name] == pytest.approx(value, rel=1e-6, abs=1e-9), (start, name)
    assert torch.equal(weights[middle][prompts[1]:], torch.full((lengths[1] - prompts[1],), 1 + GAMMA))
    # the control: one document a row (the whole row's sums) weighs the second and third documents otherwise
    row = iw_opd.prefix_weights(a.abs()[None], None, ctx.cp, GAMMA, EPSILON)[0]
    assert (row[starts[2]:] - weights[starts[2]:]).abs().max() > 0.1


def run_iw_opd(tp: int, pp: int, cp: int, ep: int, teacher: str, ungathered: bool = False, **spec) -> dict:
    if ungathered:  # the control: each CP rank sums the |a| of its own zigzag part only
        iw_opd.gather_zigzag_rows, iw_opd.zigzag_split = (lambda x, cp: x), (lambda x, size, rank: x)
    try:
        return train_distill(layout_context(tp, pp, cp, ep), distill_config(teacher, tp=tp, pp=pp, cp=cp, ep=ep,
                                                                            loss="iw_opd", lmbda=1.0, adam_eps=ADAM_EPS,
                                                                            **spec))
    finally:
        if ungathered:
            del iw_opd.gather_zigzag_rows, iw_opd.zigzag_split
            from shardlm.data.zigzag import zigzag_split
            from shardlm.parallel.mappings import gather_zigzag_rows

            iw_opd.gather_zigzag_rows, iw_opd.zigzag_split = gather_zigzag_rows, zigzag_split


WORLD2 = {
    "cp2": layout(cp=2),
    "fsdp cp2": layout(cp=2, data_sharding="full"),
    "tp2 sp": layout(tp=2, sp=True),
    "pp2": layout(pp=2, micro=1),
    "dp2 zero1": layout(distributed_optimizer=True),
    "control cp2 ungathered": layout(cp=2, ungathered=True),
}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return write_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def world2(teacher):
    return spawn_layouts(2, run_iw_opd, {name: {**spec, "teacher": teacher} for name, spec in WORLD2.items()})


@pytest.fixture(scope="module")
def reference(teacher):
    return train_distill(ParallelContext.single(), distill_config(teacher, micro=WIDE_BATCH, loss="iw_opd", lmbda=1.0,
                                                                 adam_eps=ADAM_EPS))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in WORLD2 if not n.startswith("control")])
def test_iw_opd_at_two_ranks_equals_one_process(world2, reference, name):
    for rank, value in enumerate(check_result(world2, name)):
        assert_same_run(value, reference, f"{name} rank {rank}", steps=STEPS, tol=TOL)
        for step, (mine, one) in enumerate(zip(value["iw_opd"], reference["iw_opd"], strict=True)):
            assert mine.keys() == one.keys() and len(one) == 5, (name, rank, mine)
            assert all(mine[k] == pytest.approx(one[k], rel=TOL, abs=1e-7) for k in one), (name, rank, step, mine)


@pytest.mark.timeout(600)
def test_the_sums_must_gather_over_cp(world2, reference):
    for value in check_result(world2, "control cp2 ungathered"):
        assert_trained_but_off(value["curve"], value["params"], reference["params"], STEPS, "layers.")


def test_the_weights_run_from_one_plus_gamma_down(reference):
    """Every step's weights lie in [1, 1 + gamma], the largest 1 + gamma (each document's first answer token);
    the distillation moves the student (the loss changes over the steps)."""
    for figures in reference["iw_opd"]:
        assert figures["iw_opd/max_weight"] == pytest.approx(1 + GAMMA)
        assert 1.0 <= figures["iw_opd/min_weight"] < figures["iw_opd/mean_weight"] < 1 + GAMMA
        assert figures["iw_opd/mean_abs_advantage"] > 0
    assert len({round(loss, 6) for loss, _ in reference["curve"]}) == STEPS
