"""TRL's `KTOTrainer` as an external oracle for shardlm's KTO: the same losses, KL estimates, rewards and gradient
norm, step by step.

The model is `test_preference_trl`'s (`model_directory`: a random two-layer Qwen3 with the real Qwen3 vocabulary,
saved beside the shared Qwen3 tokenizer). The examples are unpaired conversational records built from the first
Dolly records whose sequences are short: the instruction (and its context) as the user's prompt, the record's
response as the completion, labelled desirable or not by a fixed pattern (both labels in every batch).

TRL (1.16) tokenizes the records itself, builds each example's KL sequence by rotating the completions within each
batch of its per-device size, and reads them in order (`train_sampling_strategy="sequential"`); its reference is a
frozen copy of the starting weights. shardlm reads the same records through `[sft]`, one example a row in order,
with its reference precomputed by the same starting weights; both take 4 examples a step (one micro-batch, one
process: the case where TRL's per-micro-batch KL is shardlm's global batch's). Matched as in `test_preference_trl`
(AdamW, constant learning rate, clipping at 1.0, fp32), with beta 0.1 and unequal label weights (1.0, 1.5) so a
swapped weight shows. Each of 3 steps' loss, rewards and margin, and the first gradient norm agree within 1e-5
(`test_preference_trl.assert_follows`), the KL estimate within 2e-7 of the log-probabilities it is a difference
of; step 1's loss is the weighted mean of 0.5 per example and its KL is 0 (the policy is its reference), and the
later steps' KL is positive, so the estimate itself is compared. The same for `apo_zero_unpaired` (TRL's
`loss_type="apo_zero_unpaired"`: no reference point, no KL sequences on either side, z0 logged as 0).
"""

from __future__ import annotations

import json

import pytest
import torch
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
transformers = import_or_skip("transformers")

from test_preference_trl import LR, SEQ, STEPS, TOL, assert_follows, model_directory, shardlm_metrics, trl_logs  # noqa: E402

from shardlm.sft.template import ChatTemplate  # noqa: E402

PER_STEP, EXAMPLES, BETA, WEIGHTS = 4, 8, 0.1, (1.0, 1.5)
LABELS = [True, False, True, True, False, True, False, True]
KL_ROUNDING = 2e-7
"""z0's bound relative to the largest sequence log-probability it is a difference of."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root, hf = model_directory(tmp_path_factory.mktemp("kto_trl"), data_dir)
    return {"root": root, "hf": hf}


@pytest.fixture(scope="module")
def examples(setup, data_dir):
    """EXAMPLES unpaired conversational records whose prompt with any of their completions fits a row."""
    template = ChatTemplate.from_dir(setup["hf"])
    records = []
    for line in (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines():
        record = json.loads(line)
        prompt = [{"role": "user", "content": record["instruction"] + (f"\n\n{record['context']}"
                                                                        if record.get("context") else "")}]
        completion = [{"role": "assistant", "content": record["response"]}]
        if len(template.encode(template.render(prompt + completion))) <= SEQ // 2:
            records.append({"prompt": prompt, "completion": completion, "label": LABELS[len(records)]})
        if len(records) == EXAMPLES:
            break
    assert len(records) == EXAMPLES
    path = setup["root"] / "unpaired.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return {"records": records, "path": path}


@pytest.fixture(scope="module", params=["kto", "apo_zero_unpaired"])
def loss_type(request):
    return request.param


@pytest.fixture(scope="module")
def trl_run(setup, examples, loss_type):
    args = trl.KTOConfig(output_dir=str(setup["root"] / loss_type), max_length=None, beta=BETA, loss_type=loss_type,
                         desirable_weight=WEIGHTS[0], undesirable_weight=WEIGHTS[1],
                         train_sampling_strategy="sequential", per_device_train_batch_size=PER_STEP, max_steps=STEPS,
                         learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                         adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1,
                         report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                         disable_tqdm=True, bf16=False)
    return trl_logs(trl.KTOTrainer, args, examples["records"], setup["hf"])


@pytest.fixture(scope="module")
def shardlm_run(setup, examples, loss_type):
    return shardlm_metrics(setup, examples["path"], f"shardlm_{loss_type}",
                           [f"preference.loss=\"{loss_type}\"", f"preference.beta={BETA}",
                            f"preference.desirable_weight={WEIGHTS[0]}", f"preference.undesirable_weight={WEIGHTS[1]}"],
                           per_step=PER_STEP)


def test_kto_follows_trl_step_by_step(trl_run, shardlm_run, loss_type):
    ours, theirs = shardlm_run["steps"], trl_run["steps"]
    first = LABELS[:PER_STEP]
    at_reference = sum(0.5 * WEIGHTS[0 if label else 1] for label in first) / PER_STEP
    assert abs(ours[0]["loss"] - at_reference) < 1e-6 and ours[0]["kl"] == 0.0, ours[0]
    assert_follows(ours, theirs, BETA)
    for step, (mine, trls) in enumerate(zip(ours, theirs), 1):  # z0: a mean of differences of log-probabilities
        # in the hundreds, their fp32 rounding (5.7e-6 measured at step 2) bounded as assert_follows bounds rewards
        bound = max(TOL, KL_ROUNDING * max(abs(trls["logps/chosen"]), abs(trls["logps/rejected"])))
        assert abs(mine["kl"] - trls["kl"]) <= bound, f"step {step}: kl {mine} vs {trls}"
    if loss_type == "kto":
        assert max(step["kl"] for step in ours[1:]) > 100 * TOL, ours  # the clamp at 0 does not hide the estimate
    else:  # no reference point
        assert all(step["kl"] == 0.0 for step in ours + theirs), (ours, theirs)


def test_kto_run_reads_the_same_tokens_as_trl(setup, examples, trl_run, shardlm_run, loss_type):
    """The examples' and the KL sequences' tokens of shardlm's first rows are TRL's first batch's (prompt + completion,
    prompt + the rotated completion), so the comparison above is of the same sequences; without a reference point,
    neither side makes KL sequences."""
    trainer = shardlm_run["trainer"]
    rows = [trainer.train_data[i] for i in range(PER_STEP)]
    batch = next(iter(trl_run["trainer"].get_train_dataloader()))
    kl = loss_type == "kto"
    assert all(("kl_input_ids" in row) == kl for row in rows) and ("KL_input_ids" in batch) == kl
    for i, row in enumerate(rows):
        for ours, key in ((row["input_ids"][row["pair"] == i], "input_ids"),
                          *([(row["kl_input_ids"][row["kl_pair"] == i], "KL_input_ids")] if kl else [])):
            theirs = batch[key][i][batch[key.replace("input_ids", "attention_mask")][i].bool()]
            assert torch.equal(torch.as_tensor(ours), theirs.cpu()), (i, key)
