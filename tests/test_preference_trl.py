"""TRL's `DPOTrainer` as an external oracle for shardlm's DPO: the same losses, rewards and gradient norm.

A random two-layer Qwen3 with the real Qwen3 vocabulary is saved as a Hugging Face directory beside the shared
Qwen3 tokenizer. The shared data has no preference set, so the pairs are built from the first Dolly records: the
instruction (and its context) as the user's prompt, the record's own response as the chosen answer and the next
record's response as the rejected one (conversational records, rendered with the chat template on both sides).

TRL (1.16) gets the records as a dataset and tokenizes them itself; its reference model is a frozen copy of the
starting weights, run in each step. shardlm trains with `shardlm.training.run.train` from the same directory
(`checkpoint.init_from`), the records through `[sft]` with one pair a row (`sft.packing="pad"`) in order
(`sft.shuffle=false`, 2 steps an epoch), so both read the same 2 pairs a step, and its reference log-probabilities
precomputed by the same starting weights. Matched: AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay), a constant
learning rate, clipping at 1.0, beta 0.1, fp32 (`bf16=False`: DPOConfig would turn bf16 autocast on where the CPU has
it). Each of 3 steps' loss, chosen and rejected rewards and margin, and the first step's gradient norm agree within
1e-5 relative (the rewards within 1e-5 absolute, or 1e-6 of the log-probabilities they come from where that is
larger: `assert_follows`); the first loss is ln 2.

LD-DPO (`ld_alpha` 0.5) with WPO's weights (`use_weighting`) follows TRL's `DPOTrainer` with both the same way
(each option's effect on shardlm's run: `tests/test_preference_layouts.py`); so does TR-DPO (`sync_ref_model`: the
reference a copy of the weights run in each step, moved halfway to the policy after each).

The other losses: at the end of those 3 steps (the policy off its reference, the two sides' weights equal to
rounding), shardlm's IPO, hinge, robust, EXO, DiscoPOP, length-normalized DPO, NCA, BCO, SPPO-hard, APO-zero and
APO-down losses of the first step's pairs, DPO's (IPO's) over f-DPO's forward-KL, Jensen-Shannon and alpha
scores, and MPO's weighted sum (sigmoid + bco_pair + the chosen tokens' NLL), equal TRL's `DPOTrainer` loss with
that `loss_type` on the same trained trainer, within 3e-5 relative (`LOSS_TOL`; the forward KL's within 1e-4).
ORPO's odds-ratio term equals TRL's `ORPOTrainer.odds_ratio_loss` on the two pairs of
`tests/test_preference_losses.py`.

The reference-free SimPO against TRL's `CPOTrainer` with `loss_type="simpo"` and `cpo_alpha=0` (TRL's SimPO, in
`trl.experimental.cpo`): the same pairs as plain text (the prompt rendered by the chat template with its generation
prompt, the answers' text, which both sides end with the end-of-turn token), beta 2, gamma 0.5: the same losses,
rewards (beta times the length-normalized log-probability) and margin at each step, and the first gradient norm.
CPO the same way against `CPOTrainer`'s defaults (loss_type "sigmoid", its NLL term at cpo_alpha 1; shardlm's
"cpo+sft"), with label smoothing 0.1; at its trained weights CPO's hinge and IPO and AlphaPO's reward shape equal
`CPOTrainer`'s losses.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from llama_reference import spread_norm_weights
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")
transformers = import_or_skip("transformers")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.preference.dolly import dolly_pairs  # noqa: E402
from shardlm.preference.loss import PreferenceLoss  # noqa: E402
from shardlm.sft.template import ChatTemplate  # noqa: E402
from shardlm.training.data import micro_batches  # noqa: E402
from shardlm.training.run import train  # noqa: E402

# rows of 128 tokens: the first 4 pairs whose two sequences fit one (one pair a padded row on shardlm's side, so
# the row length sets the cost of its logits over the 151,936-token vocabulary), 2 a step: the third step sees the
# first step's pairs again, whose margin the first update moved (new pairs' margins were negative at steps 2 and 3)
SEQ, PAIRS_PER_STEP, PAIRS, STEPS, LR, BETA, TOL = 128, 2, 4, 3, 1e-3, 0.1, 1e-5


def model_directory(root, data_dir):
    """(root, its `hf` directory): a random two-layer Qwen3 with the real Qwen3 vocabulary, saved beside the shared
    Qwen3 tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=SEQ, tie_word_embeddings=True))
    assert spread_norm_weights(model)  # every RMSNorm weight away from its initial 1.0: a swapped or dropped norm shows
    model.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "chat" / "qwen3" / name, root / "hf" / name)
    return root, root / "hf"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root, hf = model_directory(tmp_path_factory.mktemp("preference_trl"), data_dir)
    template = ChatTemplate.from_dir(hf)
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()
    pairs = [pair for pair in dolly_pairs(lines[:121])  # pairs whose two sequences fit one row
             if sum(len(template.encode(template.render(pair["prompt"] + pair[side])))
                    for side in ("chosen", "rejected")) <= SEQ]
    pairs = pairs[:PAIRS]  # two steps an epoch: the third step reads the first one's pairs again
    assert len(pairs) == PAIRS
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    return {"root": root, "hf": root / "hf", "records": root / "pairs.jsonl", "pairs": pairs}


def trl_logs(trainer_class, args, records: list[dict], hf, model=None, callbacks=()) -> dict:
    """Train `trainer_class` (a TRL trainer, with `callbacks`) on `records` in order, as `sft.shuffle=false` reads
    them, from the directory `hf` (its causal LM, or `model`): {"steps": its logged steps, "trainer": the trainer}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    class InOrder(trainer_class):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    collected: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                collected.append(dict(logs))

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with uncached_datasets():
        trainer = InOrder(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                          processing_class=AutoTokenizer.from_pretrained(hf), callbacks=[Record(), *callbacks])
        trainer.train()
    return {"steps": collected, "trainer": trainer}


def shardlm_metrics(setup, records, name: str, loss: list[str], per_step: int = PAIRS_PER_STEP,
                    micro: int | None = None) -> dict:
    """shardlm's run from the same directory on `records` (one pair a row, in order, `per_step` rows a step in
    micro-batches of `micro` rows, default one), with the matched optimizer settings and the `loss` overrides:
    {"steps": its logged steps, "trainer": its trainer}."""
    overrides = [f"checkpoint.init_from={setup['hf']}", "checkpoint.save=false", f"sft.data=[\"{records}\"]",
                 "sft.shuffle=false", "sft.valid_fraction=0.0", "sft.packing=\"pad\"", *loss,
                 f"model.seq_length={SEQ}", f"train.micro_batch_size={micro or per_step}",
                 f"train.global_batch_size={per_step}", f"train.steps={STEPS}", f"train.lr={LR}",
                 f"train.min_lr={LR}", "train.decay_style=\"constant\"", "train.warmup_steps=0",
                 "train.weight_decay=0.0", "train.adam_beta2=0.999", "train.adam_eps=1e-8", "train.clip_grad=1.0",
                 "train.device=\"cpu\"", "train.precision=\"fp32\"", "log.interval=1", "log.progress=false",
                 "log.plot=false",
                 "log.tensorboard=false"]
    run_dir = setup["root"] / name
    result = train(load_config(None, overrides), run_dir=run_dir)
    return {"steps": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                      if '"loss"' in line and '"val_loss"' not in line], "trainer": result.trainer}


def dpo_args(setup, name: str, **options):
    """TRL's DPOConfig of the matched runs (sigmoid DPO; `options` on top)."""
    options = {"loss_type": ["sigmoid"], "per_device_train_batch_size": PAIRS_PER_STEP, "max_length": None} | options
    return trl.DPOConfig(output_dir=str(setup["root"] / name), beta=BETA,
                         max_steps=STEPS, learning_rate=LR,
                         lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                         adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                         bf16=False, **options)


@pytest.fixture(scope="module")
def trl_run(setup):
    return trl_logs(trl.DPOTrainer, dpo_args(setup, "trl"), setup["pairs"], setup["hf"])


@pytest.fixture(scope="module")
def shardlm_run(setup):
    return shardlm_metrics(setup, setup["records"], "shardlm", ["preference.loss=\"sigmoid\"",
                                                                f"preference.beta={BETA}"])


SIMPO_BETA, SIMPO_GAMMA = 2.0, 0.5


@pytest.fixture(scope="module")
def text_pairs(setup):
    """The pairs as text records: the prompt rendered with the generation prompt, each answer's content."""
    template = ChatTemplate.from_dir(setup["hf"])
    records = [{"prompt": template.render(p["prompt"], add_generation_prompt=True),
                "chosen": p["chosen"][0]["content"], "rejected": p["rejected"][0]["content"]} for p in setup["pairs"]]
    path = setup["root"] / "text_pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return {"records": records, "path": path}


def cpo_run(setup, text_pairs, name: str, **options) -> dict:
    """TRL's `CPOTrainer` (`trl.experimental.cpo`) on the text pairs with the matched settings and `options` (its
    loss_type, cpo_alpha, beta, ...): `trl_logs`'s {"steps", "trainer"}."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(output_dir=str(setup["root"] / name), max_length=SEQ, per_device_train_batch_size=PAIRS_PER_STEP,
                     max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1,
                     report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                     disable_tqdm=True, bf16=False, **options)
    return trl_logs(CPOTrainer, args, text_pairs["records"], setup["hf"])


@pytest.fixture(scope="module")
def trl_simpo_run(setup, text_pairs):
    return cpo_run(setup, text_pairs, "cpo", loss_type="simpo", cpo_alpha=0.0, beta=SIMPO_BETA,
                   simpo_gamma=SIMPO_GAMMA)


@pytest.fixture(scope="module")
def shardlm_simpo_run(setup, text_pairs):
    return shardlm_metrics(setup, text_pairs["path"], "shardlm_simpo",
                           ["preference.loss=\"simpo\"", f"preference.beta={SIMPO_BETA}",
                            f"preference.simpo_gamma={SIMPO_GAMMA}"])


CPO_SMOOTHING, ALPHAPO = 0.1, 0.05


@pytest.fixture(scope="module")
def cpo_runs(setup, text_pairs):
    """CPO as TRL's `CPOTrainer` trains it by default (loss_type "sigmoid", cpo_alpha 1: the chosen tokens' NLL
    added), with label smoothing 0.1, beta 0.1, on the text pairs: {"trl": TRL's run, "shardlm": shardlm's
    "cpo+sft"}."""
    return {"trl": cpo_run(setup, text_pairs, "cpo_sigmoid", loss_type="sigmoid", cpo_alpha=1.0, beta=BETA,
                           label_smoothing=CPO_SMOOTHING),
            "shardlm": shardlm_metrics(setup, text_pairs["path"], "shardlm_cpo",
                                       ["preference.loss=\"cpo+sft\"", f"preference.beta={BETA}",
                                        f"preference.label_smoothing={CPO_SMOOTHING}"])}


def test_cpo_follows_trls_cpo_trainer_step_by_step(cpo_runs):
    """CPO (reference-free DPO on the summed log-probabilities, smoothed, plus the NLL of the batch's chosen tokens)
    follows `CPOTrainer`'s loss, rewards (beta x the summed log-probability) and margin at each step, and its first
    gradient norm."""
    assert_follows(cpo_runs["shardlm"]["steps"], cpo_runs["trl"]["steps"], BETA)


CPO_NOW = {"cpo_hinge": ("hinge", {}), "cpo_ipo": ("ipo", {}),
           "simpo alphapo": ("simpo", {"alpha": ALPHAPO, "simpo_gamma": 0.5}),
           "cpo_ipo alphapo": ("ipo", {"alpha": ALPHAPO})}
"""shardlm's name: (CPOTrainer's loss_type, options on both sides). AlphaPO on the length-normalized losses only:
on summed log-probabilities (near -350 nats) TRL's fp32 exp(logp) underflows to 0 and its reward shape to NaN, where
shardlm computes exp(-alpha s) directly (`test_preference_losses.py` checks those by hand)."""


@pytest.mark.parametrize("name", list(CPO_NOW))
def test_the_other_cpo_losses_equal_trls_after_training(cpo_runs, name):
    """At the end of the CPO runs (their weights equal to rounding), shardlm's CPO hinge and IPO losses and AlphaPO's
    reward shape on SimPO and CPO's IPO (alpha 0.05) of the first step's pairs equal `CPOTrainer`'s with that loss_type
    and alpha (its NLL term off) within `LOSS_TOL`; each loss is away from 0 (the hinge not clipped)."""
    loss_type, options = CPO_NOW[name]
    trainer, theirs = cpo_runs["shardlm"]["trainer"], cpo_runs["trl"]["trainer"]
    part = trainer.local_part(micro_batches(trainer.train_data, 0, PAIRS_PER_STEP, PAIRS_PER_STEP, 0, 1,
                                            trainer.ctx.device))[0]
    inputs = next(iter(theirs.get_train_dataloader()))
    trainer.model.eval()
    theirs.model.eval()
    loss = name.split()[0]
    cfg = replace(trainer.config.preference, loss=loss, loss_weights=[], label_smoothing=0.0, **options)
    trl_options = {"loss_type": loss_type, "cpo_alpha": 0.0, "label_smoothing": 0.0, "alpha": 0.0} | options
    for key, value in trl_options.items():
        setattr(theirs, key, value)
    with torch.no_grad():
        ours = PreferenceLoss(cfg, trainer.ctx, trainer.model)(trainer.model, part).item()
        trls = theirs.compute_loss(theirs.model, inputs).item()
    assert abs(ours - trls) <= LOSS_TOL * abs(trls) and abs(trls) > 1e-3, (ours, trls)


def assert_follows(ours_runs: list[dict], trl_runs: list[dict], beta: float) -> None:
    """Each step's loss and the first gradient norm within TOL relative; rewards and margin within TOL absolute, or
    where larger within 1e-6 relative of the log-probabilities they are differences of (beta x |logp|, TRL's logged
    logps: sums of hundreds of fp32 token values, whose rounding after some updates differs between AVX2 and
    AVX-512 kernels by about 1e-7 of them)."""
    assert len(trl_runs) == len(ours_runs) == STEPS, (trl_runs, ours_runs)
    for step, (ours, theirs) in enumerate(zip(ours_runs, trl_runs), 1):
        assert abs(ours["loss"] - theirs["loss"]) <= TOL * theirs["loss"], f"step {step}: {ours} vs {theirs}"
        bound = max(TOL, 1e-6 * beta * max(abs(theirs["logps/chosen"]), abs(theirs["logps/rejected"])))
        for mine, trls in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                           ("reward_margin", "rewards/margins")):
            assert abs(ours[mine] - theirs[trls]) <= bound, f"step {step}: {mine} {ours[mine]} vs {theirs[trls]}"
    assert abs(ours_runs[0]["grad_norm"] - trl_runs[0]["grad_norm"]) <= TOL * trl_runs[0]["grad_norm"]


def test_simpo_follows_trls_cpo_trainer_step_by_step(trl_simpo_run, shardlm_simpo_run):
    ours = shardlm_simpo_run["steps"]
    assert_follows(ours, trl_simpo_run["steps"], SIMPO_BETA)
    # the margin moves by far more than the bound, so the later steps check the updates
    assert abs(ours[-1]["reward_margin"] - ours[0]["reward_margin"]) > 100 * TOL


def test_dpo_follows_trl_step_by_step(trl_run, shardlm_run):
    assert abs(shardlm_run["steps"][0]["loss"] - math.log(2)) < 1e-6
    assert_follows(shardlm_run["steps"], trl_run["steps"], BETA)
    # the run learns the preference (a margin a hundred times the bound), so the later steps check the updates
    assert shardlm_run["steps"][-1]["reward_margin"] > 100 * TOL


LD_ALPHA = 0.5
LD_WPO = ["preference.loss=\"sigmoid\"", f"preference.beta={BETA}", f"preference.ld_alpha={LD_ALPHA}",
          "preference.use_weighting=true"]


@pytest.fixture(scope="module")
def ld_wpo_runs(setup):
    """LD-DPO at ld_alpha 0.5 with WPO's weights: (TRL's logged steps, shardlm's). Each answer's tokens past the
    shorter answer of its pair count 0.5 in the policy's and the reference's log-probabilities (shardlm's reference
    table too), and each pair's loss is weighted by its answers' exp(mean(log p - log sum p^2))."""
    theirs = trl_logs(trl.DPOTrainer, dpo_args(setup, "trl_ld_wpo", ld_alpha=LD_ALPHA, use_weighting=True),
                      setup["pairs"], setup["hf"])
    return theirs["steps"], shardlm_metrics(setup, setup["records"], "shardlm_ld_wpo", LD_WPO)["steps"]


def test_ld_dpo_with_wpo_weights_follows_trl_step_by_step(ld_wpo_runs, trl_run):
    """LD-DPO with WPO's weights follows TRL's steps (`ld_alpha`, `use_weighting`; measured: losses within 1.4e-6
    relative, the margins within 1.6e-6); they move TRL's first gradient norm and rewards from DPO's by far more
    than the bound, so a shardlm run without both (DPO's, which follows `trl_run`) would miss it. (Without either
    alone, shardlm missed this run by 0.11 and 0.14 relative, checked once by hand; `tests/test_preference_layouts.py`
    shows each moves shardlm's own run.)"""
    theirs, ours = ld_wpo_runs
    assert_follows(ours, theirs, BETA)
    dpo = trl_run["steps"]
    assert abs(theirs[0]["grad_norm"] - dpo[0]["grad_norm"]) > 100 * TOL * dpo[0]["grad_norm"]
    assert abs(theirs[-1]["rewards/chosen"] - dpo[-1]["rewards/chosen"]) > 100 * TOL


TR_DPO = ["preference.loss=\"sigmoid\"", f"preference.beta={BETA}", "preference.sync_ref_model=true",
          "preference.ref_model_mixup_alpha=0.5", "preference.ref_model_sync_steps=1"]


def test_tr_dpo_follows_trl_step_by_step(setup, trl_run):
    """TR-DPO: the reference moves halfway to the policy after each step (`sync_ref_model`, alpha 0.5), shardlm's a
    copy of the starting weights run in each step (preference.reference "weights", which "auto" resolves to), as
    TRL's reference model is. Its steps follow TRL's; from the second step TRL's rewards move off plain DPO's by far
    more than the bound, so shardlm's DPO (which follows `trl_run`) would miss them."""
    theirs = trl_logs(trl.DPOTrainer, dpo_args(setup, "trl_tr_dpo", sync_ref_model=True, ref_model_mixup_alpha=0.5,
                                               ref_model_sync_steps=1), setup["pairs"], setup["hf"])["steps"]
    ours = shardlm_metrics(setup, setup["records"], "shardlm_tr_dpo", TR_DPO)["steps"]
    assert_follows(ours, theirs, BETA)
    dpo = trl_run["steps"]
    assert abs(theirs[1]["rewards/chosen"] - dpo[1]["rewards/chosen"]) > 100 * TOL, (theirs[1], dpo[1])


def test_aot_unpaired_follows_trl_step_by_step(setup):
    """AOT's unpaired form: the step's chosen log-ratios and its rejected ones sorted each on its own. TRL sorts its
    batch of the 4 pairs (each step the same 4); shardlm trains them in 4 micro-batches of one pair, its ranks
    spanning all (from a pass before the step). Its steps follow TRL's. The pairs' ranks disagree after the first
    update: shardlm with each micro-batch ranked on its own (TRL's sort were its batches single pairs: DPO's loss)
    missed TRL's losses by 1.4e-3 relative at step 3 (140 times the bound) and its second gradient norm by 1%
    (checked once by hand; the layouts test keeps that control: `test_aot_sorts_the_global_batch`)."""
    theirs = trl_logs(trl.DPOTrainer, dpo_args(setup, "trl_aot", loss_type=["aot_unpaired"],
                                               per_device_train_batch_size=PAIRS), setup["pairs"], setup["hf"])["steps"]
    options = ["preference.loss=\"aot_unpaired\"", f"preference.beta={BETA}"]
    ours = shardlm_metrics(setup, setup["records"], "shardlm_aot", options, per_step=PAIRS, micro=1)["steps"]
    assert_follows(ours, theirs, BETA)


LN2, EXO_EPS = math.log(2), 1e-3
AT_THE_REFERENCE = {  # name: (loss type, options on both sides, the loss at r = 0: the policy is the reference)
    "ipo": ("ipo", {}, (1 / (2 * BETA)) ** 2),
    "hinge": ("hinge", {}, 1.0),
    "robust": ("robust", {"label_smoothing": 0.2}, LN2),
    "exo_pair": ("exo_pair", {"label_smoothing": EXO_EPS},
                 0.5 * (math.log(0.5) - math.log1p(-EXO_EPS)) + 0.5 * (math.log(0.5) - math.log(EXO_EPS))),
    "discopop": ("discopop", {}, 0.5 * LN2 + 0.5),
    "sigmoid_norm": ("sigmoid_norm", {}, LN2),
    "nca_pair": ("nca_pair", {}, 2 * LN2),
    "bco_pair": ("bco_pair", {}, 2 * LN2),
    "sppo_hard": ("sppo_hard", {}, 2 * (0.5 / BETA) ** 2),
    "apo_zero": ("apo_zero", {}, 1.0),
    "apo_down": ("apo_down", {}, 1.0),
    "aot": ("aot", {"label_smoothing": 0.1}, LN2),
    "sigmoid forward_kl": ("sigmoid", {"f_divergence_type": "forward_kl"}, LN2),
    "sigmoid js_divergence": ("sigmoid", {"f_divergence_type": "js_divergence"}, LN2),
    "ipo alpha_divergence": ("ipo", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
                             (1 / (2 * BETA)) ** 2),
    # MPO: the sft term is the chosen tokens' NLL (near ln V = 11.9 a token), no value to compare at the reference
    "mpo": ("sigmoid+bco_pair+sft", {"loss_weights": [0.8, 0.2, 1.0]}, None),
}
TRL_DEFAULTS = {"label_smoothing": 0.0, "f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": 0.5}
LOSS_TOL, CASE_TOL = 3e-5, {"sigmoid forward_kl": 1e-4}
"""Each loss is a function of log-ratios of sequence log-probabilities near -350 nats, which TRL sums in fp32: their
rounding, times the loss's slope, is what separates the two sides. Measured relative differences, on the AVX-512
and the AVX2 kernels: at most 1.1e-5 (SPPO-hard's squares, 2 |r -+ 1 / (2 beta)| = 6 to 10 times the rounding),
8.0e-6 (robust), 6.8e-6 (hinge), the others below 4.4e-6; the forward KL's scores 1 - exp(-r) multiply it by
exp(-r), about 9 at this run's rejected answers (r near -2.2): 3.3e-5."""


@pytest.fixture(scope="module")
def losses_now(trl_run, shardlm_run) -> dict:
    """{loss type: (shardlm's, TRL's)} loss of the first step's pairs at each trainer's weights at the end of its
    run: shardlm's against the run's reference table, TRL's `DPOTrainer` (its `loss_types` set) against its
    reference model, the starting weights."""
    trainer = shardlm_run["trainer"]
    part = trainer.local_part(micro_batches(trainer.train_data, 0, PAIRS_PER_STEP, PAIRS_PER_STEP, 0, 1,
                                            trainer.ctx.device))[0]
    theirs = trl_run["trainer"]
    inputs = next(iter(theirs.get_train_dataloader()))
    trainer.model.eval()
    theirs.model.eval()
    values = {}
    with torch.no_grad():
        for name, (loss, options, _) in AT_THE_REFERENCE.items():
            ours = PreferenceLoss(replace(trainer.config.preference, loss=loss, **options), trainer.ctx, trainer.model)
            theirs.loss_types = loss.split("+")
            theirs.loss_weights = [1.0] * len(theirs.loss_types)
            for key, value in (TRL_DEFAULTS | options).items():
                setattr(theirs, key, value)
            ours.prepare(trainer.model, [part])  # AOT: the pairs' ranks (nothing for the others)
            values[name] = (ours(trainer.model, part).item(), theirs.compute_loss(theirs.model, inputs).item())
    return values


@pytest.mark.parametrize("name", list(AT_THE_REFERENCE))
def test_the_other_losses_equal_trls_after_training(losses_now, name):
    """Each of TRL's other paired losses (and f-DPO's divergences): at the end of the DPO runs above (the same
    weights to rounding on both sides, the policy off its reference), shardlm's loss of the first step's pairs
    equals TRL's `DPOTrainer` loss with that `loss_type` (and label smoothing, f-divergence) within `LOSS_TOL`,
    and differs from the loss at the reference by far more, so the sign and the scale of the log-ratios show (the
    formulas by hand on both sides of each loss: `tests/test_preference_losses.py`)."""
    ours, theirs = losses_now[name]
    tol = CASE_TOL.get(name, LOSS_TOL)
    assert abs(ours - theirs) <= tol * theirs, (ours, theirs)
    if AT_THE_REFERENCE[name][2] is not None:
        assert abs(theirs - AT_THE_REFERENCE[name][2]) > 100 * tol * theirs, theirs


def test_orpo_odds_ratio_term_equals_trls():
    """ORPO's loss less its NLL term is TRL's odds-ratio term (`ORPOTrainer.odds_ratio_loss`, which returns
    lambda log sigmoid(log odds ratio), the loss's negative) on the two pairs of `test_preference_losses`, from
    their per-token log-probabilities; fp32 on TRL's side, so within 1e-6. (TRL's ORPO averages the NLL over the
    batch's chosen tokens, shardlm over each pair's, so only the odds-ratio term is compared.)"""
    from test_preference_losses import BETA as ORPO_BETA
    from test_preference_losses import COUNTS, LOGPS, shardlm_losses
    from trl.experimental.orpo import ORPOTrainer

    means = torch.tensor(LOGPS, dtype=torch.float64) / torch.tensor(COUNTS, dtype=torch.float64)
    trainer = SimpleNamespace(beta=ORPO_BETA, accelerator=SimpleNamespace(device=torch.device("cpu")))
    theirs = ORPOTrainer.odds_ratio_loss(trainer, means[:, 0], means[:, 1])[0].double()
    ours = shardlm_losses("orpo")[0] + means[:, 0]
    assert torch.allclose(ours, -theirs, rtol=1e-6, atol=0), (ours, theirs)
