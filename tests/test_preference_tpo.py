"""TRL's `TPOTrainer` (`trl.experimental.tpo`, Triple Preference Optimization) as an external oracle for shardlm's
"gold" term: the NLL of each record's gold answer (its `reference`) beside a reference-free preference loss.

The model and records of `tests/test_preference_trl.py` (a random two-layer Qwen3 with the real Qwen3 vocabulary,
pairs from the first Dolly records, as plain text: the prompt rendered by the chat template with its generation
prompt), each with a gold answer: the first sentence of its chosen answer. TRL tokenizes the three sequences itself
(its prompt the shortest common prefix of the three); shardlm packs them as three documents of one row (one pair a
row, in order). Matched as the CPO comparison: AdamW, constant learning rate, clipping at 1.0, fp32.

- TPO's default sigmoid loss with label smoothing 0.1, beta 0.1 and tpo_alpha 0.5 (shardlm: "cpo+gold" with
  loss_weights [1, 0.5]): each of 3 steps' loss, rewards (beta x the summed log-probability) and margin, and the first
  gradient norm, within the DPO comparison's bounds (`assert_follows`). The same run without the gold term (CPO alone)
  misses the first gradient norm by far more.
- At the trained weights, the first step's pairs: TPO's hinge and IPO losses and TPO-L (the length-normalized
  sigmoid with its target margin gamma / beta) equal shardlm's "cpo_hinge+gold", "cpo_ipo+gold" and "simpo+gold"
  (simpo_gamma = tpo_l_gamma) within 3e-5 relative.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import test_preference_trl as base
import torch

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")

from shardlm.preference.dolly import dolly_pairs  # noqa: E402
from shardlm.preference.loss import PreferenceLoss  # noqa: E402
from shardlm.sft.template import ChatTemplate  # noqa: E402
from shardlm.training.data import micro_batches  # noqa: E402

setup = base.setup
BETA, SMOOTHING, TPO_ALPHA, TPO_L_GAMMA, LOSS_TOL = 0.1, 0.1, 0.5, 0.5, 3e-5


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0]


@pytest.fixture(scope="module")
def triples(setup, data_dir):
    """Text records with a gold answer (`reference`) whose three sequences fit one row of `base.SEQ` tokens: the first
    `base.PAIRS`."""
    template = ChatTemplate.from_dir(setup["hf"])
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()
    records = []
    for pair in dolly_pairs(lines):
        prompt = template.render(pair["prompt"], add_generation_prompt=True)
        chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        record = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "reference": first_sentence(chosen)}
        if record["reference"] != chosen and sum(len(template.encode(prompt + record[key] + "<|im_end|>"))
                                                 for key in ("chosen", "rejected", "reference")) <= base.SEQ:
            records.append(record)
    records = records[:base.PAIRS]
    assert len(records) == base.PAIRS
    path = setup["root"] / "triples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return {"records": records, "path": path}


def tpo_run(setup, triples, name: str, **options) -> dict:
    """TRL's `TPOTrainer` on the triples with the matched settings and `options`: `trl_logs`'s {"steps", "trainer"}."""
    from trl.experimental.tpo import TPOConfig, TPOTrainer

    args = TPOConfig(output_dir=str(setup["root"] / name), max_length=base.SEQ,
                     per_device_train_batch_size=base.PAIRS_PER_STEP, max_steps=base.STEPS, learning_rate=base.LR,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                     adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no",
                     use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
                     activation_checkpointing=False, **options)
    return base.trl_logs(TPOTrainer, args, triples["records"], setup["hf"])


@pytest.fixture(scope="module")
def tpo_runs(setup, triples):
    """TPO's sigmoid loss (label smoothing, tpo_alpha 0.5): {"trl": TRL's run, "shardlm": shardlm's "cpo+gold"}."""
    return {"trl": tpo_run(setup, triples, "tpo", loss_type="sigmoid", beta=BETA, label_smoothing=SMOOTHING,
                           tpo_alpha=TPO_ALPHA),
            "shardlm": base.shardlm_metrics(setup, triples["path"], "shardlm_tpo",
                                            ["preference.loss=\"cpo+gold\"", f"preference.beta={BETA}",
                                             f"preference.loss_weights=[1.0, {TPO_ALPHA}]",
                                             f"preference.label_smoothing={SMOOTHING}"])}


def test_tpo_follows_trls_tpo_trainer_step_by_step(tpo_runs, setup, triples):
    """TPO (CPO's smoothed sigmoid on the summed log-probabilities, plus tpo_alpha x the mean NLL of the batch's gold
    tokens) follows `TPOTrainer` step by step; CPO alone, on the same records, misses its first gradient norm."""
    base.assert_follows(tpo_runs["shardlm"]["steps"], tpo_runs["trl"]["steps"], BETA)
    alone = base.shardlm_metrics(setup, triples["path"], "shardlm_tpo_without_gold",
                                 ["preference.loss=\"cpo\"", f"preference.beta={BETA}",
                                  f"preference.label_smoothing={SMOOTHING}", "train.steps=1"])
    first = tpo_runs["trl"]["steps"][0]["grad_norm"]
    assert abs(alone["steps"][0]["grad_norm"] - first) > 0.05 * first, (alone["steps"][0], first)


TPO_NOW = {"cpo_hinge+gold": ("hinge", {}), "cpo_ipo+gold": ("ipo", {}),
           "simpo+gold": ("tpo-l", {"simpo_gamma": TPO_L_GAMMA})}
"""shardlm's loss: (TPOTrainer's loss_type, shardlm's options; TRL's tpo_l_gamma is shardlm's simpo_gamma)."""


@pytest.mark.parametrize("loss", list(TPO_NOW))
def test_the_other_tpo_losses_equal_trls_after_training(tpo_runs, loss):
    """At the end of the TPO runs (their weights equal to rounding), shardlm's loss of the first step's pairs with each
    other TPO loss type (its gold term at tpo_alpha 0.5, no label smoothing) equals `TPOTrainer`'s within 3e-5; each
    loss is away from 0 (the hinge not clipped)."""
    loss_type, options = TPO_NOW[loss]
    trainer, theirs = tpo_runs["shardlm"]["trainer"], tpo_runs["trl"]["trainer"]
    part = trainer.local_part(micro_batches(trainer.train_data, 0, base.PAIRS_PER_STEP, base.PAIRS_PER_STEP, 0, 1,
                                            trainer.ctx.device))[0]
    inputs = next(iter(theirs.get_train_dataloader()))
    trainer.model.eval()
    theirs.model.eval()
    cfg = replace(trainer.config.preference, loss=loss, loss_weights=[1.0, TPO_ALPHA], label_smoothing=0.0, **options)
    theirs.loss_type, theirs.label_smoothing, theirs.tpo_l_gamma = loss_type, 0.0, TPO_L_GAMMA
    with torch.no_grad():
        ours = PreferenceLoss(cfg, trainer.ctx, trainer.model)(trainer.model, part).item()
        trls = theirs.compute_loss(theirs.model, inputs).item()
    assert abs(ours - trls) <= LOSS_TOL * abs(trls) and abs(trls) > 1e-3, (ours, trls)
