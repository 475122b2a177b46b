"""TRL's `RewardTrainer` as an external oracle for shardlm's reward modeling: the same losses, accuracies, margins,
rewards and gradient norm, step by step, and the same trained model through a Hugging Face export.

A random two-layer `Qwen3ForSequenceClassification` (one label) with the real Qwen3 vocabulary is saved beside the
shared Qwen3 tokenizer. The pairs are the preference tests' (`tests/test_preference_trl.py`): the first Dolly records'
prompts with their own response chosen and the next record's rejected (conversational, rendered with the chat
template on both sides), 2 of the 4 with a `margin` (TRL's optional column). TRL (1.16) tokenizes them itself and
pools each sequence at its last token that is not the pad token (here `<|endoftext|>`, which the template's turns
never end with); shardlm packs one pair a row (`sft.packing="pad"`) in order (`sft.shuffle=false`), 2 pairs a step,
and reads each sequence's last token. Matched: AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay), a constant
learning rate, clipping at 1.0, `center_rewards_coefficient` 0.01, fp32 (`bf16=False`).

Each of 3 steps' loss, accuracy, margin, mean, minimum and maximum reward and the first step's gradient norm agree
within 1e-5 relative (1e-5 absolute for the rewards and margins, which cross 0); the run's export
(`shardlm convert --to-hf`) loads as transformers' `Qwen3ForSequenceClassification` whose rewards of the pairs equal
TRL's trained model's within 1e-5; a run without the margins misses TRL's second-step loss by more than 100 x the
bound (the margin is read). With LoRA (peft's SEQ_CLS task: the head trained whole beside the adapters) from the same
peft adapter directory, the same step by step, and the `--to-peft` export, and the `--to-hf` export with the adapters
folded in, score as TRL's trained PeftModel.
"""

from __future__ import annotations

import json

import pytest
import torch
from llama_reference import tiny_qwen3_reward_model
from test_preference_trl import trl_logs

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
transformers = import_or_skip("transformers")

from shardlm.checkpoint.hf import to_hf  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.preference.dolly import dolly_pairs  # noqa: E402
from shardlm.sft.template import ChatTemplate  # noqa: E402
from shardlm.training.run import train  # noqa: E402

SEQ, PAIRS_PER_STEP, PAIRS, STEPS, LR, CENTER, TOL = 128, 2, 4, 3, 1e-3, 0.01, 1e-5
MARGINS = (0.5, None, 1.5, None)  # the pairs' margins (None: the record has no `margin`); TRL reads 0 for those


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):

    root = tmp_path_factory.mktemp("reward_trl")
    tiny_qwen3_reward_model(root / "hf", data_dir, SEQ, head_std=0.1)  # a head that separates the sequences at step 0
    template = ChatTemplate.from_dir(root / "hf")
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()
    pairs = [pair for pair in dolly_pairs(lines[:121])
             if sum(len(template.encode(template.render(pair["prompt"] + pair[side])))
                    for side in ("chosen", "rejected")) <= SEQ][:PAIRS]
    assert len(pairs) == PAIRS
    records = [pair | ({"margin": margin} if margin is not None else {}) for pair, margin in zip(pairs, MARGINS)]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (root / "no_margins.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    return {"root": root, "hf": root / "hf", "records": records}


def trl_run(setup, adapter=None) -> dict:
    """TRL's RewardTrainer on the records in order (every record given a margin, 0 where it has none: a dataset's
    column is all or nothing), the model with the peft `adapter` directory's adapters when given: {"steps": its
    logged steps, "trainer": the trainer}."""
    from transformers import AutoModelForSequenceClassification

    args = trl.RewardConfig(output_dir=str(setup["root"] / "trl"), max_length=None, per_device_train_batch_size=2,
                            center_rewards_coefficient=CENTER, max_steps=STEPS, learning_rate=LR,
                            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                            adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, report_to=[],
                            save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                            bf16=False, gradient_checkpointing=False)
    records = [r | {"margin": r.get("margin", 0.0)} for r in setup["records"]]
    model = AutoModelForSequenceClassification.from_pretrained(setup["hf"], dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    return trl_logs(trl.RewardTrainer, args, records, setup["hf"], model)


def shardlm_run(setup, name: str, records: str, *extra: str) -> dict:
    """shardlm's reward run from the same directory (one pair a row, in order, 2 a step; `extra` overrides):
    {"steps": its logged steps, "run": its directory}."""
    overrides = [*extra, f"checkpoint.init_from={setup['hf']}", f"sft.data=[\"{setup['root'] / records}\"]",
                 "sft.shuffle=false", "sft.valid_fraction=0.0", "sft.packing=\"pad\"", "reward.loss=\"bradley_terry\"",
                 f"reward.center_rewards_coefficient={CENTER}", f"model.seq_length={SEQ}",
                 f"train.micro_batch_size={PAIRS_PER_STEP}", f"train.global_batch_size={PAIRS_PER_STEP}",
                 f"train.steps={STEPS}", f"train.lr={LR}", f"train.min_lr={LR}", "train.decay_style=\"constant\"",
                 "train.warmup_steps=0", "train.weight_decay=0.0", "train.adam_beta2=0.999", "train.adam_eps=1e-8",
                 "train.clip_grad=1.0", "train.device=\"cpu\"", "train.precision=\"fp32\"", "log.interval=1",
                 "log.progress=false", "log.plot=false", "log.tensorboard=false"]
    run_dir = setup["root"] / name
    train(load_config(None, overrides), run_dir=run_dir)
    return {"steps": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                      if '"loss"' in line and '"val_loss"' not in line], "run": run_dir}


@pytest.fixture(scope="module")
def runs(setup):
    return {"trl": trl_run(setup), "shardlm": shardlm_run(setup, "shardlm", "pairs.jsonl")}


def close(ours: float, theirs: float, absolute: bool = False) -> bool:
    return abs(ours - theirs) <= TOL * (1.0 if absolute else max(abs(theirs), 1e-12))


def test_reward_model_follows_trl_step_by_step(runs):
    theirs, ours = runs["trl"]["steps"], runs["shardlm"]["steps"]
    assert len(theirs) == len(ours) == STEPS
    for step, (t, o) in enumerate(zip(theirs, ours), start=1):
        assert close(o["loss"], t["loss"]), (step, o["loss"], t["loss"])
        assert o["accuracy"] == pytest.approx(t["accuracy"], abs=1e-12), step
        for key in ("margin", "mean_reward", "min_reward", "max_reward"):
            assert close(o[key], t[key], absolute=True), (step, key, o[key], t[key])
    assert close(ours[0]["grad_norm"], theirs[0]["grad_norm"]), (ours[0]["grad_norm"], theirs[0]["grad_norm"])
    assert len({round(s["loss"], 4) for s in ours}) == STEPS  # the loss moves: the steps train


def test_exported_reward_model_scores_as_trls_trained_model(setup, runs, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = to_hf(runs["shardlm"]["run"] / "checkpoints", tmp_path / "exported")
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == ["Qwen3ForSequenceClassification"] and hf_config["pad_token_id"] == 151643
    exported = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    trained = runs["trl"]["trainer"].model.eval()
    tokenizer = AutoTokenizer.from_pretrained(setup["hf"])
    texts = [tokenizer.apply_chat_template(r["prompt"] + r[side], tokenize=False)
             for r in setup["records"] for side in ("chosen", "rejected")]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ours, theirs = exported(**batch).logits.squeeze(-1), trained(**batch).logits.squeeze(-1)
        start = AutoModelForSequenceClassification.from_pretrained(setup["hf"], dtype=torch.float32)(**batch).logits
    assert torch.allclose(ours, theirs, rtol=TOL, atol=TOL), (ours, theirs)
    assert (ours - start.squeeze(-1)).abs().max() > 100 * TOL  # trained away from the start


def test_the_margin_is_read(setup, runs):
    plain = shardlm_run(setup, "no_margins", "no_margins.jsonl")["steps"]
    theirs = runs["trl"]["steps"]
    assert abs(plain[1]["loss"] - theirs[1]["loss"]) > 100 * TOL * abs(theirs[1]["loss"])


def test_a_lora_reward_model_follows_trl_with_peft(setup, runs, tmp_path):
    """LoRA (r 4 on q, v and the MLP's up projection, B drawn non-zero so every adapter counts) with the head trained
    whole, as peft's SEQ_CLS task does: TRL's RewardTrainer on the PeftModel and shardlm's run from the same peft
    directory (`checkpoint.init_adapter`) agree step by step as the full runs do; the run's `--to-peft` export
    loads with `PeftModel.from_pretrained` (task SEQ_CLS, the head in modules_to_save) to TRL's trained scores."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from shardlm.checkpoint.peft import write_merged, write_peft

    base = AutoModelForSequenceClassification.from_pretrained(setup["hf"], dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "up_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    peft_model.save_pretrained(tmp_path / "adapter")
    theirs = trl_run(setup, tmp_path / "adapter")
    ours = shardlm_run(setup, "shardlm_lora", "pairs.jsonl", "lora.rank=4",
                       f"checkpoint.init_adapter={tmp_path / 'adapter'}")
    assert len(theirs["steps"]) == len(ours["steps"]) == STEPS
    for step, (t, o) in enumerate(zip(theirs["steps"], ours["steps"]), start=1):
        assert close(o["loss"], t["loss"]), (step, o["loss"], t["loss"])
        for key in ("margin", "mean_reward"):
            assert close(o[key], t[key], absolute=True), (step, key, o[key], t[key])
    assert close(ours["steps"][0]["grad_norm"], theirs["steps"][0]["grad_norm"])
    full = runs["shardlm"]["steps"][0]  # (the adapters and the head alone train: another gradient than all weights')
    assert abs(ours["steps"][0]["grad_norm"] - full["grad_norm"]) > 0.1 * full["grad_norm"]

    out = write_peft(ours["run"] / "checkpoints", tmp_path / "exported")
    settings = json.loads((out / "adapter_config.json").read_text())
    assert settings["task_type"] == "SEQ_CLS" and "score" in settings["modules_to_save"]
    loaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(setup["hf"],
                                                                                          dtype=torch.float32), out)
    tokenizer = AutoTokenizer.from_pretrained(setup["hf"])
    texts = [tokenizer.apply_chat_template(r["prompt"] + r[side], tokenize=False)
             for r in setup["records"] for side in ("chosen", "rejected")]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        mine = loaded.eval()(**batch).logits.squeeze(-1)
        trained = theirs["trainer"].model.eval()(**batch).logits.squeeze(-1)
    assert torch.allclose(mine, trained, rtol=TOL, atol=TOL), (mine, trained)
    merged = write_merged(ours["run"] / "checkpoints", tmp_path / "merged")  # `--to-hf` of a LoRA checkpoint
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Qwen3ForSequenceClassification"]
    with torch.no_grad():
        folded = AutoModelForSequenceClassification.from_pretrained(merged, dtype=torch.float32).eval()(**batch)
    assert torch.allclose(folded.logits.squeeze(-1), trained, rtol=TOL, atol=TOL)
