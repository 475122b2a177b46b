"""Conversations longer than a row split into pieces (`sft.overflow = "split"`) as TRL's `packing_strategy="bfd_split"`
splits them: the same loss and gradient.

The random two-layer Qwen3 of `tests/test_sft_trl_training.py` beside the shared Qwen3 tokenizer; the first 8 Dolly
records, tokenized once with shardlm's `ChatTemplate` (TRL's own ids: `tests/test_sft_trl.py`), several longer than a
row of 128 tokens. shardlm cuts each long one into pieces of 128 tokens and a last shorter one, each a document of
its own (positions from 0, its first token no target), and packs them best-fit-decreasing; TRL's SFTTrainer packs the
same ids with `bfd_split` (padding-free). Each step takes every row at once (the loss is a mean over the batch's
trained tokens, whatever the rows' order): 2 steps' losses and the first gradient norm agree within 1e-5 relative
(measured: both losses and the first gradient norm equal to the last bit); truncating instead (`"truncate"`, TRL's
`"bfd"`) trains on fewer tokens and misses the first gradient norm (1.74 against 0.755).
"""

from __future__ import annotations

import shutil

import pytest
import test_sft_trl_training as base
import torch
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.sft.packing import PackedRows  # noqa: E402
from shardlm.sft.records import load_conversations  # noqa: E402
from shardlm.sft.template import ChatTemplate, tokenize_conversations  # noqa: E402

RECORDS, STEPS = 8, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("sft_split")
    torch.manual_seed(0)
    base.hf_model("qwen3").save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "chat" / "qwen3" / name, root / "hf" / name)
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()[:RECORDS]
    (root / "records.jsonl").write_text("\n".join(lines) + "\n")
    docs = tokenize_conversations(ChatTemplate.from_dir(root / "hf"), load_conversations(root / "records.jsonl"))
    rows = PackedRows(docs, base.SEQ, "bfd", "split", seed=None)
    assert rows.stats.split >= 3, rows.stats  # (pieces of a long prompt alone, with no target, are left out)
    return {"root": root, "hf": root / "hf", "records": root / "records.jsonl", "docs": docs,
            "rows": len(rows.plan(0))}


def trl_steps(setup, strategy: str) -> list[dict]:
    """TRL's SFTTrainer on the tokenized records packed with `strategy`, every row a step (its pieces without a
    target too, which shardlm leaves out: they change no loss or gradient)."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    model = AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False  # else transformers skips the packed-document mask
    dataset = datasets.Dataset.from_dict({"input_ids": [d.input_ids for d in setup["docs"]],
                                          "assistant_masks": [d.loss_mask for d in setup["docs"]]})
    args = trl.SFTConfig(output_dir=str(setup["root"] / f"trl_{strategy}"), max_length=base.SEQ, packing=True,
                         packing_strategy=strategy, padding_free=True, per_device_train_batch_size=64,
                         max_steps=STEPS, learning_rate=base.LR, lr_scheduler_type="constant", warmup_steps=0,
                         weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                         logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                         dataloader_num_workers=0, disable_tqdm=True, bf16=False)
    logs: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append(dict(logs))

    records = logs
    with uncached_datasets():
        trainer = base.InOrder(model=model, args=args, train_dataset=dataset, callbacks=[Record()])
        trainer.train()
    return logs


def shardlm_steps(setup, overflow: str, steps: int = STEPS) -> list[dict]:
    return base.shardlm_sft(setup, f"shardlm_{overflow}", f"sft.overflow=\"{overflow}\"",
                            f"train.micro_batch_size={setup['rows']}", f"train.global_batch_size={setup['rows']}",
                            f"train.steps={steps}")


def test_split_conversations_follow_trls_bfd_split(setup):
    theirs, ours = trl_steps(setup, "bfd_split"), shardlm_steps(setup, "split")
    assert len(theirs) == len(ours) == STEPS, (theirs, ours)
    for mine, trls in zip(ours, theirs):
        assert abs(mine["loss"] - trls["loss"]) <= base.TOL * trls["loss"], (ours, theirs)
    assert abs(ours[0]["grad_norm"] - theirs[0]["grad_norm"]) <= base.TOL * theirs[0]["grad_norm"], (ours, theirs)
    truncated = shardlm_steps(setup, "truncate", steps=1)
    assert abs(truncated[0]["grad_norm"] - theirs[0]["grad_norm"]) > 100 * base.TOL * theirs[0]["grad_norm"]


def test_split_is_refused_for_preference_pairs(tmp_path, capsys):
    from shardlm.cli import main

    code = main(["train", "configs/dpo-tiny-qwen3.toml", 'sft.overflow="split"', "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and 'sft.overflow="split" cuts a long conversation into pieces' in err, err
