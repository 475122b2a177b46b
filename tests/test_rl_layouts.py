"""Online RL (GRPO's family) gives the one-process answer at every layout, and packing changes nothing.

The completions are fixed (`SyntheticCompletions`: 1-10 tokens, some ending with the end-of-turn id, some truncated
at the maximum length), so every layout trains the same tokens; 4 prompts x 4 completions a round, packed
best-fit-decreasing into 8 rows of 48 tokens, so rows and micro-batches hold different numbers of sequences and
tokens and a mean of per-micro-batch means would differ from the global batch's. The reward depends on the
completion's ids (and a record column: one prompt's group is rewarded alike, zero std).

Settings that reach every part of the loss: DAPO's token mean, clip-higher (epsilon 0.02, epsilon_high 0.03, small
enough that the second iteration clips), num_iterations 2 (the old log-probabilities from a scoring pass), beta 0.04
(the reference: the starting weights swapped in, moved halfway to the policy after steps 2 and 4 by TR-DPO's sync;
or a LoRA run's base), masked truncated completions, temperature 0.9. Checks, each against one process within 1e-5
over 4 steps (2 rounds): loss, gradient norm, KL, entropy, the three clip ratios, the reward, every final parameter
on every rank:
- world 2: DP=2, TP=2 with SP, PP=2, DP=2 with ZeRO-1, FSDP, an MoE at EP=2, LoRA at DP=2 and PP=2, the hybrid
  linear-attention model (Qwen3.5's Gated DeltaNet) at TP=2 and CP=2 (its parameters within
  `agreement.LINEAR_ATTENTION_PARAMS_TOL`), CP=2 (also with GSPO's sequence-level ratio, whose per-sequence means
  span the CP ranks, in one generation round of two steps taken twice: GRPO's loss, against a one-process GSPO run),
  VESPO with the off-policy mask at CP=2 (both read sums over a sequence's CP ranks), LUSPO with INTELLECT-2's cap
  at CP=2, SAPO at PP=2 (rounds of two steps), RLOO (truncation masked) at DP=2, PP=2 and CP=2, DAPO under the
  entropy mask (its quantile over the global batch, gathered over DP x CP) with the adaptive entropy bonus at CP=2,
  PP=2 and TP=2 with SP (the bonus's gradient through the vocabulary output layer), each against a one-process run;
- world 4: TP=2 x DP=2, PP=2 x DP=2, CP=2 x DP=2 (GSPO, its two-step round), CP=2 x TP=2 with SP, CP=2 x PP=2,
  FSDP CP=2 x DP=2, an MoE at EP=2 x CP=2;
- one process: micro-batch 2 equals micro-batch 8 and packed rows equal one sequence a row; the control:
  normalizing each micro-batch by its own tokens (a mean of micro-batch means) moves the loss.
Sampling (`InProcessGenerator`, prompts of different lengths in one batch): TP=2 (with SP; also under min-p and the
repetition penalty), PP=2, EP=2, FSDP, CP=2, CP=2 x DP=2 (each rank its share of whole sequences), an MoE at EP=2 x
CP=2 and PP=2 x FSDP DP=2 give one process's tokens, and their log-probabilities within 1e-5. Under batch-invariant
numerics the rollout's log-probabilities equal the training forward's bitwise over 2 rounds of sampling and training,
in one process (dense, MoE, LoRA) and at TP=2 with SP, PP=2, EP=2, FSDP, CP=2, CP=2 x TP=2 with SP and PP=2 x FSDP
DP=2; without, they differ by round-off (the control).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gemma4_layouts import GEMMA
from test_linear_attention import HYBRID
from test_moe_parallel import stage_parameters
from test_training import VOCAB

from shardlm.errors import UserError
from shardlm.eval.generate import SamplingConfig
from shardlm.parallel import ParallelContext
from shardlm.rl import loss as loss_module
from shardlm.rl.loop import RLRun
from shardlm.rl.loss import loss_metrics
from shardlm.rl.prompts import Prompt
from shardlm.rl.rewards import Reward
from shardlm.rl.rollout import InProcessGenerator, Rollout, gather_samples, sampling_share
from shardlm.training.reference import ReferenceWeights
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import LINEAR_ATTENTION_PARAMS_TOL, assert_every_rank, assert_same_run
from layouts import MIXTRAL, layout, layout_config, layout_context, spawn_layouts, tiny_model
from multiproc import check_result

SEQ, STEPS, GROUP, MAX, EOD, TOL = 48, 4, 4, 10, VOCAB - 1, 1e-5
COLUMNS = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "reward")
VARIANTS = {"vespo": {"loss": "vespo", "off_policy_mask_threshold": 0.005},
            "luspo": {"loss": "luspo", "delta": 1.04},
            "sapo": {"loss": "sapo", "sapo_temperature_neg": 2.0, "generation_batch_size": 32, "num_iterations": 1},
            "rloo": {"loss": "rloo", "mask_truncated_completions": True, "normalize_advantages": True, "epsilon": 0.2,
                     "reward_clip_range": [0.0, 0.8]},
            "gmpo": {"loss": "gmpo", "epsilon": 0.1, "mask_truncated_completions": False},
            "entropy": {"top_entropy_quantile": 0.3, "entropy_coef": 0.02, "use_adaptive_entropy": True,
                        "entropy_coef_delta": 0.05, "entropy_target": 100.0}}
"""Other losses in place of DAPO in `rl_config`: VESPO's weight of a sequence's log-ratio total and the off-policy
mask's mean log-ratio (sums over a sequence's CP ranks), LUSPO's per-sequence sums with INTELLECT-2's cap (each
option reaching the run: `test_the_variants_options_reach_the_run`), SAPO's gate in place of the clip with
generation rounds of two steps (32 completions a round, split between them: the second against the old
log-probabilities of a scoring pass over both steps' rows), DAPO on the top 30% of tokens by entropy (the quantile
over the global batch's tokens, gathered over DP x CP, or on the last pipeline stage) with the entropy bonus on them
(its gradient through the vocabulary-parallel output layer; the adaptive coefficient 0.02, then raised by 0.05 a
step, applied from the second step), and RLOO (TRL's RLOOTrainer:
leave-one-out baselines of rewards clamped to [0, 0.8], less the KL to the synced reference summed over each
sequence from the scoring passes (summed over DP, sent from the last pipeline stage), normalized; the clipped
surrogate on each sequence's whole ratio, summed over its CP ranks; truncated completions masked, each still
counting its constant -A in the mean as TRL's does (`masked_share`, on its CP ranks' tokens: without it steps 3 and
4's losses move by 2e-3), at TRL's clip range 0.2 (at 0.02 the second iteration clipped nearly every token, its
gradient norm 3e-3 rounding at PP=2 and CP=2 to 2.4e-5 relative), and GMPO (TRL's
GMPOTrainer: each sequence's weight the geometric mean of its token ratios clipped in log space to 0.1 each way, the
mean over its CP ranks; truncation unmasked)."""
PENALIZED = {"min_p": 0.03, "repetition_penalty": 1.2}
"""Sampling with min-p and the repetition penalty (over each row's prompt and completion so far)."""
PROMPTS = [Prompt([int(x) for x in np.random.default_rng(i).integers(1, VOCAB - 1, size=3 + i)], f"prompt {i}",
                  {"kind": "constant" if i == 0 else "varied"}) for i in range(6)]


class SyntheticCompletions:
    """Completions fixed by (round, sequence): 1 to MAX ids, ended by EOD when shorter than MAX, else truncated
    (one in three of the full-length ones ends with EOD)."""

    def generate(self, prompts, seeds, round_index=0, sequences=None):
        out = []
        for prompt, j in zip(prompts, sequences):
            rng = np.random.default_rng([round_index, j, 3])
            n = int(rng.integers(1, MAX + 1))
            ids = [int(x) for x in rng.integers(1, VOCAB - 1, size=n)]
            if n < MAX or rng.random() < 1 / 3:
                ids[-1] = EOD
            out.append(Rollout(prompt, ids, [float("nan")] * n, ids[-1] != EOD))
        return out


def by_ids(prompts, completions, completion_ids, kind, **columns):
    return [1.0 if k == "constant" else (sum(ids) % 7) / 6 for ids, k in zip(completion_ids, kind)]


class IdsTemplate:
    class tokenizer:  # noqa: N801 - the template's tokenizer, as `ChatTemplate.tokenizer`
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return " ".join(map(str, ids))


def rl_config(micro: int = 2, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False, moe: bool = False,
              hybrid: bool = False, gemma: bool = False, lora: int = 0, gspo: bool = False, rows: int = 8,
              packing: str = "bfd", variant: str = "", sampling: dict | None = None, **train):
    model = tiny_model("llama", SEQ, layers=2, num_kv_heads=2)
    if hybrid:
        model = {**HYBRID, "seq_length": SEQ, "vocab_size": VOCAB, "dropout": 0.0}
    if gemma:  # Gemma 4's block, its last layer reading layer 1's keys and values (one stage holds both)
        model |= GEMMA | {"num_layers": 4, "kv_shared_layers": 1, "tie_embeddings": False}
    if moe:
        model |= MIXTRAL
    sections = {"sft": {"data": ["unused.jsonl"], "packing": packing},
                "rl": {"loss": "dapo", "num_generations": GROUP, "prompts_per_step": 4, "max_completion_length": MAX,
                       "beta": 0.04, "epsilon": 0.02, "epsilon_high": 0.03, "num_iterations": 2,
                       "mask_truncated_completions": True, "temperature": 0.9,
                       # TR-DPO's reference syncs after steps 2 and 4 (a LoRA run's reference is its base)
                       "sync_ref_model": not lora, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5,
                       **({"loss": "grpo", "importance_sampling": "sequence", "generation_batch_size": 32}
                          if gspo else {}),
                       **VARIANTS.get(variant, {}), **(sampling or {})},
                "lora": {"rank": lora, "targets": ["q", "v", "o", "gate", "up", "down"]}}
    config = layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, sections=sections,
                           **{"steps": STEPS, "global_batch_size": rows, **train})
    if gemma and pp > 1:
        config.parallel.first_stage_layers = 1  # layers 1-3 on the last stage
    return config


def rl_run(ctx, config, sample: bool = False) -> tuple[Trainer, RLRun]:
    """The trainer and the RL loop of `config` on `ctx`: the fixed completions, or (`sample`) the policy's own
    (top-k 50, top-p 0.95, and the run's rl.min_p and rl.repetition_penalty)."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, None, None)
    reference = ReferenceWeights.of(trainer) if not config.lora.rank else None
    if config.rl.sync_ref_model:  # the trainer's steps move it (as `shardlm.training.run` sets it)
        trainer.synced_reference = reference
    generator = SyntheticCompletions()
    if sample:
        sampling = SamplingConfig(max_new_tokens=MAX, temperature=config.rl.temperature, top_k=50, top_p=0.95,
                                  min_p=config.rl.min_p, repetition_penalty=config.rl.repetition_penalty)
        generator = InProcessGenerator(trainer.model, ctx, sampling, EOD, lockstep=ctx.world_size > 1,
                                       pipeline=trainer.pipeline)  # as `shardlm.rl.setup` builds it
    rewards = [Reward("by_ids", by_ids, 1.0)]
    return trainer, RLRun(trainer, PROMPTS, IdsTemplate, generator, rewards, 0, reference)


def columns(loss: str) -> tuple[str, ...]:
    """The curve's columns for `loss`: COLUMNS with the loss type's own metrics in place of the clip ratios."""
    return (*COLUMNS[:4], *loss_metrics(loss), "reward")


def train_layout(ctx, config) -> dict:
    trainer, run = rl_run(ctx, config)
    curve = []
    for _ in range(STEPS):
        metrics = run.train_step()
        curve.append(tuple(metrics[k] for k in columns(config.rl.loss)))
    return {"curve": curve, "params": stage_parameters(trainer.model)}


def sample_layout(ctx, config) -> dict:
    """Rollouts of 8 sequences (prompts of 3 to 8 tokens) by the starting weights (init_std 0.3: peaked but not
    degenerate distributions), each data-parallel rank its share, gathered."""
    config.model.init_std = 0.3
    generator = rl_run(ctx, config, sample=True)[1].generator
    sequences = sampling_share(8, ctx)  # each data x context-parallel rank's share, as the loop deals them
    local = generator.generate([PROMPTS[j % 6].ids for j in sequences], [100 + j for j in sequences], 0, sequences)
    gathered = gather_samples(local, ctx)
    return {"tokens": [r.completion for r in gathered], "logps": [r.logps for r in gathered],
            "truncated": [r.truncated for r in gathered]}


def parity_layout(ctx, config, invariant: bool = True) -> list[float]:
    """Each step's largest |rollout log-probability - training log-probability| over 2 steps whose completions the
    policy samples (one iteration a round), under batch-invariant numerics (`invariant`)."""
    config.model.init_std = 0.3
    config.rl.batch_invariant, config.rl.num_iterations = invariant, 1
    config.rl.mask_truncated_completions = False  # every sampled token compared
    run = rl_run(ctx, config, sample=True)[1]
    return [run.train_step()["logprob_diff_max"] for _ in range(2)]  # before and after an update


def run_layout(tp: int, pp: int, cp: int, ep: int, sample: bool = False, parity: bool = False, **config) -> dict:
    ctx = layout_context(tp, pp, cp, ep)
    config = rl_config(tp=tp, pp=pp, cp=cp, ep=ep, **config)
    if parity:
        return {"diffs": parity_layout(ctx, config)}
    if sample:
        try:
            return sample_layout(ctx, config)
        except UserError as exc:
            return {"refused": str(exc)}
    return train_layout(ctx, config)


WORLD2 = {
    "dp2": layout(),
    "tp2 sp": layout(tp=2, sp=True),
    "pp2": layout(pp=2),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "ep2 moe": layout(ep=2, moe=True),
    "dp2 lora": layout(lora=4),
    "pp2 lora": layout(pp=2, lora=4),
    "tp2 hybrid": layout(tp=2, hybrid=True),
    "cp2": layout(cp=2),
    "cp2 gspo": layout(cp=2, gspo=True),
    "cp2 hybrid": layout(cp=2, hybrid=True),
    "cp2 vespo": layout(cp=2, variant="vespo"),
    "cp2 luspo": layout(cp=2, variant="luspo"),
    "pp2 sapo": layout(pp=2, variant="sapo"),
    "dp2 rloo": layout(variant="rloo"),
    "pp2 rloo": layout(pp=2, variant="rloo"),
    "cp2 rloo": layout(cp=2, variant="rloo"),
    "cp2 gmpo": layout(cp=2, variant="gmpo"),
    "cp2 entropy": layout(cp=2, variant="entropy"),
    "pp2 entropy": layout(pp=2, variant="entropy"),
    "tp2 sp entropy": layout(tp=2, sp=True, variant="entropy"),
}
SAMPLES2 = {
    "sample ep2 moe": layout(ep=2, moe=True, sample=True),
    "sample fsdp dp2": layout(data_sharding="full", sample=True),
    "sample pp2": layout(pp=2, sample=True),
    "sample tp2 sp": layout(tp=2, sp=True, sample=True),
    "sample tp2 sp penalized": layout(tp=2, sp=True, sample=True, sampling=PENALIZED),
    "sample pp2 gemma4": layout(pp=2, gemma=True, sample=True),
    "parity pp2": layout(pp=2, parity=True),
    "parity tp2 sp": layout(tp=2, sp=True, parity=True),
    "parity ep2 moe": layout(ep=2, moe=True, parity=True),
    "parity fsdp dp2": layout(data_sharding="full", parity=True),
    "sample cp2": layout(cp=2, sample=True),
    "parity cp2": layout(cp=2, parity=True),
}
WORLD4 = {"tp2 dp2": layout(tp=2), "pp2 dp2": layout(pp=2), "cp2 dp2 gspo": layout(cp=2, gspo=True),
          "tp2 cp2 sp": layout(tp=2, cp=2, sp=True), "pp2 cp2": layout(pp=2, cp=2),
          "fsdp cp2 dp2": layout(cp=2, data_sharding="full"), "ep2 cp2 moe": layout(ep=2, cp=2, moe=True)}
SAMPLES4 = {"sample pp2 fsdp dp2": layout(pp=2, data_sharding="full", sample=True),
            "parity pp2 fsdp dp2": layout(pp=2, data_sharding="full", parity=True),
            "sample cp2 dp2": layout(cp=2, sample=True), "parity tp2 cp2 sp": layout(tp=2, cp=2, sp=True, parity=True),
            "sample ep2 cp2 moe": layout(ep=2, cp=2, moe=True, sample=True)}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | SAMPLES2)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4 | SAMPLES4)


def kind_of(name: str) -> str:
    return next((kind for kind in ("moe", "lora", "hybrid", "gspo", *VARIANTS) if kind in name), "dense")


@pytest.fixture(scope="module")
def reference():
    """One process at the layouts' micro-batch 2 (the MoE's load-balancing loss is per micro-batch)."""
    ctx = ParallelContext.single()
    return {kind: train_layout(ctx, rl_config(**({kind: 4} if kind == "lora" else {kind: True})))
            for kind in ("moe", "lora", "hybrid", "gspo")} | {"dense": train_layout(ctx, rl_config())} | {
            kind: train_layout(ctx, rl_config(variant=kind)) for kind in VARIANTS}


@pytest.fixture(scope="module")
def samples():
    ctx = ParallelContext.single()
    return {"dense": sample_layout(ctx, rl_config()), "moe": sample_layout(ctx, rl_config(moe=True)),
            "gemma4": sample_layout(ctx, rl_config(gemma=True)),
            "penalized": sample_layout(ctx, rl_config(sampling=PENALIZED))}


SAME_RUN = {"steps": STEPS, "tol": TOL, "columns": COLUMNS,
            "absolute": ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")}
"""Losses, gradient norms, entropy and reward within TOL relative; the KL (0 at the first step, where the policy is
its reference) and the clip ratios (shares of tokens) within TOL absolute; every parameter by `trained_rel`."""


def same_run(name: str) -> dict:
    """`SAME_RUN` with the loss type's columns, the hybrid's parameters within
    `agreement.LINEAR_ATTENTION_PARAMS_TOL`; RLOO's and GMPO's losses absolute (at a round's first iteration each is
    minus the mean advantage, and the advantages sum to 0 in each group: a rounding error around 0)."""
    kind = kind_of(name)
    loss = VARIANTS.get(kind, {}).get("loss", "grpo" if kind == "gspo" else "dapo")
    logged = columns(loss)
    absolute = tuple(k for k in SAME_RUN["absolute"] if k in logged) + (("loss",) if loss in ("rloo", "gmpo") else ())
    return SAME_RUN | {"columns": logged, "absolute": absolute} | (
        {"params_tol": LINEAR_ATTENTION_PARAMS_TOL} if kind == "hybrid" else {})


@pytest.mark.parametrize("name", list(WORLD2))
def test_rl_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], **same_run(name))


@pytest.mark.parametrize("name", list(WORLD4))
def test_rl_at_four_ranks_equals_one_process(world4, reference, name):
    assert_every_rank(world4, name, reference[kind_of(name)], **same_run(name))


def test_the_run_clips_and_penalizes(reference):
    """The settings reach the loss's branches: the second iteration of a round clips tokens on both sides, and the
    KL is 0 at the first step and positive after the first update."""
    curve = reference["dense"]["curve"]
    column = {k: [step[i] for step in curve] for i, k in enumerate(COLUMNS)}
    assert column["kl"][0] == 0.0 and all(k > 0 for k in column["kl"][1:]), column["kl"]
    assert column["clip_ratio/low_mean"][1] > 0 and column["clip_ratio/high_mean"][1] > 0, column
    assert column["clip_ratio/region_mean"][0] == 0.0, column  # the first iteration's ratio is exactly 1


@pytest.mark.parametrize("name", ["sample tp2 sp", "sample pp2", "sample ep2 moe", "sample fsdp dp2",
                                  "sample pp2 gemma4", "sample cp2", "sample tp2 sp penalized"])
def test_rollouts_at_two_ranks_equal_one_process(world2, samples, name):
    """Each layout's rollouts are one process's, token for token; under pipeline stages the model's per-forward
    carry (Gemma 4's shared keys and values) goes through the stage's layers as through the whole model's; with
    min-p and the repetition penalty too (which change the one-process tokens: they reach the sampler)."""
    if "penalized" in name:
        assert samples["penalized"]["tokens"] != samples["dense"]["tokens"]
    ref = samples[next((kind for kind in ("moe", "gemma4", "penalized") if kind in name), "dense")]
    if "gemma4" not in name and "penalized" not in name:  # (Gemma's soft-capped logits at init std 0.3 never pick
        # the end token; min-p drops its small probability)
        assert any(not t for t in ref["truncated"]) and any(ref["truncated"]), ref  # some stop, some run out
    for rank, value in enumerate(check_result(world2, name)):
        assert value["tokens"] == ref["tokens"], f"{name} rank {rank}"
        for got, want in zip(value["logps"], ref["logps"]):
            assert np.allclose(got, want, rtol=0, atol=TOL), f"{name} rank {rank}: {got} vs {want}"


@pytest.mark.parametrize("kind, option, off", [("vespo", "off_policy_mask_threshold", 0.0), ("luspo", "delta", 0.0),
                                               ("sapo", "generation_batch_size", 0), ("dense", "sync_ref_model", False),
                                               ("entropy", "top_entropy_quantile", 1.0),
                                               ("entropy", "use_adaptive_entropy", False), ("gmpo", "loss", "dapo")])
def test_the_variants_options_reach_the_run(reference, kind, option, off):
    """The controls: without its off-policy mask (VESPO), its cap (LUSPO), its two-step generation rounds (SAPO),
    the entropy mask or the adaptive entropy bonus (a constant 0.02), or with DAPO's loss in GMPO's place, the
    one-process run's gradient norms move by
    more than 1e-3 (the mask from the second step, the cap at the fourth), and without the reference's syncs its KL
    at steps 3 and 4 by more than 100 x TOL, so the layouts above check them."""
    config = rl_config(variant=kind)
    setattr(config.rl, option, off)
    got = train_layout(ParallelContext.single(), config)["curve"]
    want = reference[kind]["curve"]
    column, bound = (COLUMNS.index("kl"), 100 * TOL) if option == "sync_ref_model" else (1, 1e-3)
    assert max(abs(a[column] - b[column]) for a, b in zip(got, want)) > bound, (got, want)


def test_the_held_out_prompts_are_scored_on_their_own_completions():
    """`RLRun.evaluate` (rl.eval_prompts): rl.num_generations_eval completions of each held-out prompt, their rewards
    and lengths logged as the round's metrics are, with "val_"; checked against the fixed completions scored by
    hand."""
    config = rl_config()
    config.rl.num_generations_eval = 3
    run = rl_run(ParallelContext.single(), config)[1]
    run.eval_prompts = PROMPTS[4:]
    got = run.evaluate()
    owners = [4, 4, 4, 5, 5, 5]
    rollouts = SyntheticCompletions().generate([PROMPTS[i].ids for i in owners], None, 0, list(range(6)))
    rewards = by_ids(None, None, [r.completion for r in rollouts], [PROMPTS[i].columns["kind"] for i in owners])
    lengths = [len(r.completion) for r in rollouts]
    assert got["val_reward"] == pytest.approx(np.mean(rewards)) and got["val_reward_std"] > 0
    assert got["val_rewards/by_ids/mean"] == pytest.approx(np.mean(rewards))
    assert got["val_completions/mean_length"] == pytest.approx(np.mean(lengths))
    assert got["val_completions/clipped_ratio"] == pytest.approx(np.mean([r.truncated for r in rollouts]))


def test_micro_batches_and_packing_change_nothing(reference):
    """One process: micro-batch 8 (one micro-batch a step) and one sequence a row (16 rows of 4 micro-batches)
    equal the layouts' reference (packed rows, micro-batch 2); so does micro-batch 8 under the entropy mask (its
    quantile the global batch's, not each micro-batch's)."""
    ctx = ParallelContext.single()
    ref = reference["dense"]
    assert_same_run(train_layout(ctx, rl_config(micro=8, variant="entropy")), reference["entropy"],
                    "entropy mask at micro-batch 8", **same_run("entropy"))
    assert_same_run(train_layout(ctx, rl_config(micro=8)), ref, "micro-batch 8", **SAME_RUN)
    assert_same_run(train_layout(ctx, rl_config(micro=4, rows=16, packing="pad")), ref, "one sequence a row",
                    **SAME_RUN)


def test_a_mean_of_micro_batch_means_is_caught(reference, monkeypatch):
    """The control: each micro-batch normalized by its own completion tokens (and the micro-batches averaged), the
    per-micro-batch mean that the global weights replace, moves the first loss away from the reference."""
    parts = loss_module.rl_parts

    def per_micro_batch(batches, ctx):
        out = parts(batches, ctx)
        for part in out:
            tokens = (part["weight"] > 0).sum().clamp(min=1)
            part["weight"] = (part["weight"] > 0).double() / tokens / len(out)
        return out

    monkeypatch.setattr(loss_module, "rl_parts", per_micro_batch)
    monkeypatch.setattr("shardlm.rl.loss.rl_parts", per_micro_batch)
    got = train_layout(ParallelContext.single(), rl_config())["curve"]
    want = reference["dense"]["curve"]
    assert abs(got[0][1] - want[0][1]) > 1e-3 * abs(want[0][1]), (got[0], want[0])


@pytest.mark.parametrize("name", ["sample cp2 dp2", "sample ep2 cp2 moe", "sample pp2 fsdp dp2"])
def test_rollouts_at_four_ranks_equal_one_process(world4, samples, name):
    """CP=2 x DP=2 (also with an MoE's experts over EP=2, exchanged in every decoding step): each of the four ranks
    samples its own share of whole sequences; together, one process's. PP=2 x FSDP DP=2: each stage an FSDP root
    whose layers and end pieces the decoding calls one by one, the stage's DP ranks in lockstep."""
    ref = samples["moe" if "moe" in name else "dense"]
    for rank, value in enumerate(check_result(world4, name)):
        assert value["tokens"] == ref["tokens"], f"{name} rank {rank}"
        for got, want in zip(value["logps"], ref["logps"]):
            assert np.allclose(got, want, rtol=0, atol=TOL), f"{name} rank {rank}: {got} vs {want}"


@pytest.mark.parametrize("name", ["parity tp2 sp", "parity pp2", "parity ep2 moe", "parity fsdp dp2", "parity cp2",
                                  "parity tp2 cp2 sp", "parity pp2 fsdp dp2"])
def test_rollout_and_training_log_probabilities_are_bitwise_equal(world2, world4, name):
    """Under batch-invariant numerics the log-probabilities the rollout computed while sampling (KV cache, the
    generation batch) are the training forward's (packed rows, micro-batches, sequence parallelism; under context
    parallelism the rows split over the CP ranks, the keys gathered), bit for bit."""
    for rank, value in enumerate(check_result(world4 if name in SAMPLES4 else world2, name)):
        assert value["diffs"] == [0.0, 0.0], f"{name} rank {rank}: {value['diffs']}"


@pytest.mark.parametrize("kind", ["dense", "moe", "lora"])
def test_one_process_rollouts_are_bitwise_its_training_forward(kind):
    config = rl_config(**({"lora": 4} if kind == "lora" else {kind: True} if kind != "dense" else {}))
    assert parity_layout(ParallelContext.single(), config) == [0.0, 0.0]


def test_without_batch_invariance_they_differ_by_round_off():
    """The control: the default numerics (the cache's one-row products, SDPA's tiles) give the same tokens
    log-probabilities that differ in their last bits, 1e-7 to 1e-4."""
    diffs = parity_layout(ParallelContext.single(), rl_config(), invariant=False)
    assert all(0 < d < 1e-4 for d in diffs), diffs
