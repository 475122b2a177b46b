"""Preference optimization on packed pairs gives the one-process answer at every layout, and packing changes nothing.

Data: 40 synthetic pairs (a learnable token stream as prompt, a 3-12-token chosen answer that continues it and a
rejected one that does not), packed best-fit-decreasing into rows of 48 tokens, so rows hold different numbers
of pairs and a mean of per-micro-batch means would differ from the mean over the global batch's pairs.

Checks, each against one process within 1e-5 (fp32: losses, gradient norms, the rewards, margin and accuracy,
the validation loss on 12 held-out pairs before and after training, every final parameter on every rank), for
sigmoid DPO with the reference precomputed by the starting weights (for the training and the held-out pairs):
- the first step's loss and the first validation loss are exactly ln 2 (the policy is the reference) at every
  layout;
- world 2: DP=2, TP=2 with SP, CP=2 (each sequence's log-probability summed over the CP ranks' chunks), PP=2 (the
  last stage's sequence losses, the reference precomputed through the stages), DP=2 with ZeRO-1, FSDP, an MoE at
  EP=2, and a LoRA run whose reference is its base (adapters off), against its own one-process run, at DP=2 and
  at PP=2 (the base's forward pass through the stages before each step);
- the control at CP=2: each sequence's sum over CP all-reduced forward only (`sum_over` without its backward
  all-reduce) keeps the loss but halves the first gradient norm;
- world 2 also: length-normalized DPO over f-DPO's Jensen-Shannon scores with WPO's weights at CP=2, TP=2 with SP
  and PP=2 (each answer's token count summed over the CP ranks too; WPO's log sum p^2 over the vocabulary slices),
  and MPO's sum under LD-DPO's weights at DP=2 and CP=2 (the chosen tokens' NLL a mean over the global batch's
  chosen tokens; the weights from whole rows), each against its own one-process run (without WPO's or LD-DPO's
  weights, that run's gradient norms move);
- world 2 also: AOT (its margins ranked over the global batch: a pass before the step, the ranks gathered over DP)
  at PP=2, AOT's unpaired form with label smoothing at DP=2 and CP=2; at one process micro-batch 2 equals
  micro-batch 8, and each micro-batch ranked on its own (TRL's per-device sort) moves the run; CPO with its NLL term
  and TPO's gold answers' NLL (reference-free: no table, no reference pass) at DP=2, PP=2 and CP=2;
- world 4: CP=2 x TP=2 with SP, TP=2 x DP=2;
- one process: micro-batch 1 equals micro-batch 8; packed rows give each pair's losses and gradients run alone;
  a LoRA run's recorded reference, after the adapters have moved, equals a plain model's on the base weights, and
  its loss leaves ln 2; SimPO, ORPO, IPO, hinge, BCO and APO-zero train to finite, falling losses (their values:
  `tests/test_preference_losses.py`).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from test_moe_parallel import stage_parameters
from test_training import VOCAB

from shardlm.models import build_model
from shardlm.parallel import ParallelContext, reduce_from_tensor_parallel
from shardlm.preference import aot, reference_mode
from shardlm.preference import loss as loss_module
from shardlm.preference.data import PairDataset, PairRows
from shardlm.preference.loss import METRICS, PreferenceLoss, gold_logps, preference_parts, sequence_logps
from shardlm.preference.pairs import TokenizedPair
from shardlm.preference.reference import precompute_reference
from shardlm.training.data import micro_batches
from shardlm.training.reference import ReferenceWeights
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import CURVE, assert_every_rank, assert_same_run, rel
from layouts import MIXTRAL, layout, layout_config, layout_context, spawn_layouts, tiny_model
from multiproc import check_result

SEQ, STEPS, TOL = 48, 4, 1e-5


def synthetic_pairs(count: int = 40, seed: int = 1, gold: bool = False) -> list[TokenizedPair]:
    """`count` pairs (module docstring); with `gold`, each with TPO's gold answer: the chosen answer's first 1-3
    tokens (drawn apart, so the pairs are those without it)."""
    rng, gold_rng = np.random.default_rng(seed), np.random.default_rng(seed + 100)
    successor = np.random.default_rng(0).permutation(VOCAB)
    pairs = []
    for i in range(count):
        prompt = [int(rng.integers(VOCAB))]
        for _ in range(int(rng.integers(2, 8)) - 1):
            prompt.append(int(successor[prompt[-1]]))
        chosen = [int(successor[prompt[-1]])]
        for _ in range(int(rng.integers(3, 13)) - 1):
            chosen.append(int(successor[chosen[-1]]))
        rejected = [int(x) for x in rng.integers(0, VOCAB, size=int(rng.integers(3, 13)))]
        pairs.append(TokenizedPair(prompt, chosen, rejected, f"pair {i}",
                                   gold=chosen[:int(gold_rng.integers(1, 4))] if gold else None))
    return pairs


def train_data(gold: bool = False) -> PairDataset:
    return PairDataset(PairRows(synthetic_pairs(gold=gold), SEQ, seed=5))


def valid_data(gold: bool = False) -> PairDataset:
    return PairDataset(PairRows(synthetic_pairs(12, seed=2, gold=gold), SEQ, seed=None), epochs=1)


def preference_config(micro: int = 2, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, sp: bool = False,
                      moe: bool = False, loss: str = "sigmoid", lora: int = 0, divergence: str = "reverse_kl",
                      loss_weights: tuple = (), ld_alpha: float = 1.0, use_weighting: bool = False,
                      sync_ref_model: bool = False, label_smoothing: float = 0.0, **train):
    model = tiny_model("llama", SEQ, layers=2, num_kv_heads=2)
    if moe:
        model |= MIXTRAL
    sections = {"sft": {"data": ["unused.jsonl"]},
                "preference": {"loss": loss, "beta": 0.5, "f_divergence_type": divergence,
                               "loss_weights": list(loss_weights), "ld_alpha": ld_alpha,
                               "use_weighting": use_weighting, "sync_ref_model": sync_ref_model,
                               "label_smoothing": label_smoothing,
                               "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5},
                "lora": {"rank": lora, "targets": ["v", "o", "gate", "up", "down"]}}
    return layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, sections=sections,
                         **{"steps": STEPS, "eval_iters": 8, **train})


def train_layout(ctx: ParallelContext, config, data: tuple | None = None, metrics: tuple = METRICS) -> dict:
    """STEPS steps from the same starting weights on `data` ((training, validation) datasets; the synthetic pairs by
    default, with gold answers where the loss trains on them), the reference precomputed where the run uses one: the
    curve (loss, gradient norm, `metrics`), the validation loss before and after, and every parameter."""
    validate(config, ctx.world_size, check_paths=False)
    gold = "gold" in config.preference.loss.split("+")
    trainer = Trainer(config, ctx, *(data or (train_data(gold), valid_data(gold))))
    if reference_mode(config) == "weights":  # as `shardlm.training.run` sets it up
        trainer.loss.weights = ReferenceWeights.of(trainer)
        trainer.synced_reference = trainer.loss.weights if config.preference.sync_ref_model else None
    if reference_mode(config) == "precomputed":
        trainer.loss.tables = {"train": precompute_reference(trainer, trainer.train_data),
                               "valid": precompute_reference(trainer, trainer.valid_data)}
    valid = [trainer.evaluate()]
    curve = []
    for _ in range(STEPS):
        m = trainer.train_step()
        curve.append((m["loss"], m["grad_norm"], *(m[k] for k in metrics)))
    valid.append(trainer.evaluate())
    return {"curve": curve, "valid": valid, "params": stage_parameters(trainer.model)}


@contextlib.contextmanager
def broken(control: str | None):
    """"forward-only CP sum": each sequence's log-probability summed over CP by the forward all-reduce alone
    (`reduce_from_tensor_parallel`, the backward all-reduce of `sum_over`'s `copy_to_tensor_parallel` dropped)."""
    sum_over = loss_module.sum_over
    if control == "forward-only CP sum":
        loss_module.sum_over = reduce_from_tensor_parallel
    try:
        yield
    finally:
        loss_module.sum_over = sum_over


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, **config) -> dict:
    with broken(control):
        return train_layout(layout_context(tp, pp, cp, ep), preference_config(tp=tp, cp=cp, ep=ep, pp=pp, **config))


NORM_JS = {"loss": "sigmoid_norm", "divergence": "js_divergence", "use_weighting": True}
"""Length-normalized DPO over f-DPO's Jensen-Shannon scores with WPO's weights: each answer's token count, like its
log-probability, summed over the CP ranks' chunks; WPO's per-token log sum p^2 reduced over the TP ranks' vocabulary
slices and its means over the CP ranks."""
MPO = {"loss": "sigmoid+bco_pair+sft", "loss_weights": (0.8, 0.2, 1.0), "ld_alpha": 0.3}
"""MPO's sum: its chosen tokens' NLL a mean over the global batch's chosen tokens, counted over DP (and from whole
rows under CP), under LD-DPO's weights (each answer's tokens past its pair's shorter answer times 0.3, their
positions found on the whole rows before the CP split; the NLL unweighted)."""
TR_DPO = {"sync_ref_model": True}
"""TR-DPO: the reference a copy of the starting weights (preference.reference "weights", "auto" under the sync) run
in each step and evaluation (swapped in through the pipeline's stages; FSDP's shards copied in and back), moved
halfway to the policy after steps 2 and 4 (each rank its shards)."""
CPO = {"loss": "cpo+sft+gold", "loss_weights": (1.0, 0.5, 0.7), "label_smoothing": 0.1}
"""CPO (TRL's CPOTrainer, cpo_alpha 0.5) with TPO's gold term (TRL's TPOTrainer, tpo_alpha 0.7): reference-free, no
reference pass or table at any layout; each pair's third sequence, its gold answer, trained by a mean over the global
batch's gold tokens (counted over DP, summed over CP)."""
AOT = {"loss": "aot"}
AOT_UNPAIRED = {"loss": "aot_unpaired", "label_smoothing": 0.1}
"""AOT: the global batch's margins (aot_unpaired: its chosen and rejected log-ratios) ranked after a pass before the
step (through the stages under PP), gathered over DP; each micro-batch's pairs matched by those ranks."""

WORLD2 = {
    "dp2": layout(),
    "tp2 sp": layout(tp=2, sp=True),
    "cp2": layout(cp=2),
    "pp2": layout(pp=2),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2 moe": layout(ep=2, moe=True),
    "dp2 lora": layout(lora=4),
    "pp2 lora": layout(pp=2, lora=4),
    "cp2 norm js": layout(cp=2, **NORM_JS),
    "tp2 sp norm js": layout(tp=2, sp=True, **NORM_JS),
    "pp2 norm js": layout(pp=2, **NORM_JS),
    "dp2 mpo": layout(**MPO),
    "cp2 mpo": layout(cp=2, **MPO),
    "pp2 tr dpo": layout(pp=2, **TR_DPO),
    "fsdp dp2 tr dpo": layout(data_sharding="full", **TR_DPO),
    "tp2 sp tr dpo": layout(tp=2, sp=True, **TR_DPO),
    "pp2 aot": layout(pp=2, **AOT),
    "dp2 aot unpaired": layout(**AOT_UNPAIRED),
    "cp2 aot unpaired": layout(cp=2, **AOT_UNPAIRED),
    "dp2 cpo": layout(**CPO),
    "pp2 cpo": layout(pp=2, **CPO),
    "cp2 cpo": layout(cp=2, **CPO),
}
CONTROL = "control cp2 forward-only sum"
WORLD4 = {
    "cp2 tp2 sp": layout(cp=2, tp=2, sp=True),
    "tp2 dp2": layout(tp=2),
}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | {CONTROL: layout(cp=2, control="forward-only CP sum")})


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def reference():
    """One process at the layouts' micro-batch 2 (the MoE's load-balancing loss is per micro-batch)."""
    ctx = ParallelContext.single()
    return {"dense": train_layout(ctx, preference_config()), "moe": train_layout(ctx, preference_config(moe=True)),
            "lora": train_layout(ctx, preference_config(lora=4)),
            "norm js": train_layout(ctx, preference_config(**NORM_JS)),
            "mpo": train_layout(ctx, preference_config(**MPO)),
            "tr dpo": train_layout(ctx, preference_config(**TR_DPO)),
            "aot": train_layout(ctx, preference_config(**AOT)),
            "aot unpaired": train_layout(ctx, preference_config(**AOT_UNPAIRED)),
            "cpo": train_layout(ctx, preference_config(**CPO))}


SAME_RUN = {"steps": STEPS, "tol": TOL, "columns": CURVE + METRICS, "absolute": METRICS,
            "from_step_2": ("reward_accuracy",)}
"""The harness's bounds for a preference run: losses, gradient norms, the validation losses before and after, and
every parameter within TOL relative; rewards, margin and accuracy within TOL absolute (rewards are beta x
differences of log-probabilities of tens of nats: near 0 a relative bound would measure rounding). The accuracy
from step 2: at step 1 every margin is rounding noise around 0 and the share of positive ones is the kernels' sums
(0.1 against 0.0 at CP=2 x TP=2 on the AVX2 kernels)."""


def assert_starts_at_ln2(value: dict, where: str) -> None:
    """Step 1's loss and the first validation loss are ln 2 within 1e-6: the policy is its reference."""
    assert abs(value["curve"][0][0] - math.log(2)) <= 1e-6, f"{where}: step 1 loss {value['curve'][0][0]} is not ln 2"
    assert abs(value["valid"][0] - math.log(2)) <= 1e-6, f"{where}: first validation loss {value['valid'][0]}"


def assert_matches(value: dict, ref: dict, where: str) -> None:
    """One rank's preference run equals one process's (`SAME_RUN`) and starts at ln 2."""
    assert_same_run(value, ref, where, **SAME_RUN)
    assert_starts_at_ln2(value, where)


def kind_of(name: str) -> str:
    return next((kind for kind in ("moe", "lora", "norm js", "mpo", "tr dpo", "aot unpaired", "aot", "cpo")
                 if kind in name), "dense")


@pytest.mark.parametrize("name", list(WORLD2))
def test_preference_at_two_ranks_equals_one_process(world2, reference, name):
    for rank, value in enumerate(assert_every_rank(world2, name, reference[kind_of(name)], **SAME_RUN)):
        if kind_of(name) not in ("mpo", "norm js", "cpo"):  # (MPO's and CPO's add the chosen NLL; WPO weighs it)
            assert_starts_at_ln2(value, f"{name} rank {rank}")


@pytest.mark.parametrize("kind, variant, option, off", [("mpo", MPO, "ld_alpha", 1.0),
                                                        ("norm js", NORM_JS, "use_weighting", False),
                                                        ("tr dpo", TR_DPO, "sync_ref_model", False),
                                                        ("aot", AOT, "loss", "sigmoid"),
                                                        ("aot unpaired", AOT_UNPAIRED, "loss", "sigmoid")])
def test_the_weights_reach_their_runs(reference, kind, variant, option, off):
    """The controls: MPO without LD-DPO's weights, length-normalized DPO without WPO's, DPO without TR-DPO's syncs
    (the reference the starting weights throughout), DPO in AOT's place (the pairs unmatched), moves the one-process
    gradient norms, so the layouts check them."""
    plain = train_layout(ParallelContext.single(), preference_config(**(variant | {option: off})))["curve"]
    assert max(abs(a[1] - b[1]) for a, b in zip(plain, reference[kind]["curve"])) > 1e-3


@pytest.mark.parametrize("name", list(WORLD4))
def test_preference_at_four_ranks_equals_one_process(world4, reference, name):
    for rank, value in enumerate(assert_every_rank(world4, name, reference[kind_of(name)], **SAME_RUN)):
        assert_starts_at_ln2(value, f"{name} rank {rank}")


def test_the_cp_sum_needs_its_backward_all_reduce(world2, reference):
    """The control: with each sequence's CP sum all-reduced forward only, every CP rank still computes the same
    pair losses (step 1 is ln 2, the one-process loss), but each rank's tokens get the gradient of their own rank's
    copy only, and the trainer's mean over DP x CP halves the gradient: the first gradient norm is half the
    one-process norm (within 1e-5), where `cp2` above gives the whole."""
    ref = reference["dense"]["curve"][0]
    for rank, value in enumerate(check_result(world2, CONTROL)):
        curve = value["curve"]
        assert len(curve) == STEPS and all(math.isfinite(step[0]) for step in curve), curve
        assert abs(curve[0][0] - ref[0]) <= TOL * ref[0], f"rank {rank}: step 1 loss {curve[0][0]} vs {ref[0]}"
        assert abs(curve[0][1] - ref[1] / 2) <= TOL * ref[1], f"rank {rank}: grad norm {curve[0][1]} vs {ref[1]}"


def test_the_one_process_run_starts_at_ln2_and_learns_the_preference(reference):
    """ln 2 at step 1 and on the held-out pairs before training (their own reference table: the training pairs'
    would give another number), and the preference learned, held-out pairs included."""
    curve, valid = reference["dense"]["curve"], reference["dense"]["valid"]
    assert abs(curve[0][0] - math.log(2)) < 1e-7 and curve[0][2:] == (0.0, 0.0, 0.0, 0.0)
    assert abs(valid[0] - math.log(2)) < 1e-7 and valid[1] < valid[0]
    assert curve[-1][0] < curve[0][0] - 0.01 and curve[-1][4] > 0 and curve[-1][5] > 0.5


def test_micro_batch_one_equals_micro_batch_eight(reference):
    """Eight micro-batches of different pair counts equal one micro-batch of the 8 rows: the loss is the mean over
    the global batch's pairs, not a mean of micro-batch means."""
    ones = train_layout(ParallelContext.single(), preference_config(micro=1))
    assert_matches(ones, train_layout(ParallelContext.single(), preference_config(micro=8)), "micro 1")
    counts = [len(set(train_data()[i]["pair"].tolist()) - {-1}) for i in range(8)]
    assert len(set(counts)) > 1, counts


def test_aot_sorts_the_global_batch(reference, monkeypatch):
    """AOT at micro-batch 2 (4 micro-batches a step) equals micro-batch 8 (the global batch in one); the control:
    each micro-batch ranked on its own (TRL's per-device sort) moves the gradient norms."""
    one = train_layout(ParallelContext.single(), preference_config(micro=8, **AOT_UNPAIRED))
    assert_matches(reference["aot unpaired"], one, "aot unpaired micro 2")
    match = aot.match
    monkeypatch.setattr(aot, "match", lambda batches, loss, dp: [match([b], loss, dp) for b in batches])
    alone = train_layout(ParallelContext.single(), preference_config(**AOT_UNPAIRED))["curve"]
    assert max(abs(a[1] - b[1]) for a, b in zip(alone, reference["aot unpaired"]["curve"])) > 1e-3


def test_packed_pairs_equal_each_pair_alone():
    """The log-probabilities and their gradients of 8 packed rows equal each pair's sequences run alone: the chosen
    and rejected ones (`sequence_logps`) and TPO's gold one (`gold_logps`), each its own sum."""
    ctx = ParallelContext.single()
    config = preference_config()
    model = build_model(config.model, ctx, seed=3)
    data = train_data(gold=True)
    batch = micro_batches(data, 0, 8, 8, 0, 1, torch.device("cpu"))[0]
    part = preference_parts([batch], ctx)[0]
    token_losses = model(part["inputs"], part["targets"], documents=part["documents"])
    logps = torch.cat([sequence_logps(token_losses, part, ctx.cp)[0], gold_logps(token_losses, part, ctx.cp)[:, None]],
                      dim=1)
    packed = torch.autograd.grad(logps.sum(), list(model.parameters()))
    alone = []
    for index in part["pairs"].tolist():
        pair = data.rows.pairs[index]
        for answer in (pair.chosen, pair.rejected, pair.gold):
            ids = torch.tensor([pair.prompt + answer])
            targets = ids[:, 1:].clone()
            targets[:, :len(pair.prompt) - 1] = -100
            alone.append(-model(ids[:, :-1], targets).sum())
    alone = torch.stack(alone).view(-1, 3)
    assert rel(logps.float(), alone) < 1e-6
    alone_grads = torch.autograd.grad(alone.sum(), list(model.parameters()))
    assert max(rel(a, b) for a, b in zip(packed, alone_grads)) < 1e-5


def test_the_lora_reference_is_the_base_after_the_adapters_moved(reference):
    """A LoRA run's reference (adapters off) equals a plain model's log-probabilities once the adapters' B have
    moved away from zero (at step 1, B = 0, the base and the policy agree whether or not the adapters are off, so
    ln 2 there shows nothing): the run's recorded reference on a batch after STEPS steps equals the base weights'
    loaded into a model without adapters, within 1e-9 (the same fp32 forward), while the policy is off by far
    more; and the run's loss leaves ln 2 (an adapters-on reference keeps the policy's, and ln 2, every step)."""
    ctx = ParallelContext.single()
    trainer = Trainer(preference_config(lora=4), ctx, train_data())
    for _ in range(STEPS):
        trainer.train_step()
    adapters = {k: v for k, v in trainer.model.state_dict().items() if k.endswith(".lora.B")}
    assert adapters and min(v.abs().max().item() for v in adapters.values()) > 1e-4
    batch = trainer.local_part(micro_batches(trainer.train_data, trainer.consumed_samples, 8, 8, 0, 1,
                                             torch.device("cpu")))[0]
    recorded = trainer.loss.reference_logps(trainer.model, batch)
    plain = build_model(preference_config().model, ctx, seed=0)
    plain.load_state_dict({k: v for k, v in trainer.model.state_dict().items() if ".lora." not in k})
    with torch.no_grad():
        base = sequence_logps(plain(batch["inputs"], batch["targets"], documents=batch["documents"]), batch,
                              ctx.cp)[0]
        policy = sequence_logps(trainer.model(batch["inputs"], batch["targets"], documents=batch["documents"]),
                                batch, ctx.cp)[0]
    assert (recorded - base).abs().max().item() <= 1e-9 * base.abs().max().item(), (recorded, base)
    assert (policy - base).abs().max().item() > 1e-2, "the adapters did not move the policy off its base"
    curve = reference["lora"]["curve"]
    assert curve[-1][0] < math.log(2) - 0.01 and curve[-1][5] > 0.5, curve


@pytest.mark.parametrize("loss", ["simpo", "orpo", "ipo", "hinge", "bco_pair", "apo_zero"])
def test_the_other_losses_train(loss):
    curve = train_layout(ParallelContext.single(), preference_config(loss=loss))["curve"]
    assert all(math.isfinite(c[0]) for c in curve) and curve[-1][0] < curve[0][0]


def test_preference_loss_is_the_trainers_loss():
    trainer = Trainer(preference_config(), ParallelContext.single(), train_data())
    assert isinstance(trainer.loss, PreferenceLoss)


def test_a_pair_twice_in_a_micro_batch_is_two_occurrences():
    """A micro-batch across an epoch's end on a small data set can hold one pair in two rows: each row's sequences
    are their own occurrence (each the log-probabilities of the row alone, counted twice in the mean), not one sum
    of both rows' tokens."""
    ctx = ParallelContext.single()
    model = build_model(preference_config().model, ctx, seed=3)
    row = micro_batches(train_data(), 0, 1, 1, 0, 1, torch.device("cpu"))[0]
    once, twice = (preference_parts([batch], ctx)[0] for batch in (row, {k: torch.cat([v, v]) for k, v in row.items()}))
    with torch.no_grad():
        logps = [sequence_logps(model(p["inputs"], p["targets"], documents=p["documents"]), p, ctx.cp)[0]
                 for p in (once, twice)]
    assert torch.equal(twice["pairs"], torch.cat([once["pairs"], once["pairs"]]))
    assert twice["divisor"] == 2 * once["divisor"]
    assert rel(logps[1], torch.cat([logps[0], logps[0]])) < 1e-6
