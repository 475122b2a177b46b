"""The DPO example learns: the pairs `scripts/dolly_pairs.py` writes from the shared Dolly records, trained with
`configs/dpo-tiny-qwen3.toml` for a few steps, rank each held-out pair's chosen answer above its rejected one (the
rewards beta (log pi - log pi_ref), computed here from the trained model and the run's saved reference table) and
bring the held-out loss below ln 2. With the pairs the script made before (each record's response rejected for
the previous record and chosen for its own), no answer is ever only rejected, and the loss rises instead."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
import torch

from shardlm.config import load_config
from shardlm.preference.loss import sequence_logps
from shardlm.training.data import micro_batches
from shardlm.training.run import train

pytestmark = pytest.mark.learning  # a training run to a measured result: `make test-learning`

ROOT = Path(__file__).resolve().parents[1]
# the first Dolly records: 119 pairs, of which those whose two sequences fit 256 tokens are kept, a fifth held out
# (the run's reference pass covers every pair, most of the test's time)
RECORDS = 120


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, data_dir) -> Path:
    root = tmp_path_factory.mktemp("preference_example")
    source = root / "dolly.jsonl"
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()[:RECORDS]
    source.write_text("\n".join(lines) + "\n")
    records = root / "pairs.jsonl"
    assert runpy.run_path(str(ROOT / "scripts" / "dolly_pairs.py"))["main"]([str(source), str(records)]) == 0
    return records


def test_no_rejected_answer_is_chosen_anywhere(pairs):
    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    chosen = {r["chosen"][0]["content"] for r in records}
    assert len(records) == RECORDS - 1
    assert not [r for r in records if r["rejected"][0]["content"] in chosen]


@pytest.mark.timeout(300)
def test_the_tiny_dpo_config_learns_the_held_out_pairs(pairs, tmp_path):
    config = load_config(str(ROOT / "configs" / "dpo-tiny-qwen3.toml"), [
        f'sft.data=["{pairs}"]', "model.seq_length=256", "sft.valid_fraction=0.2", "train.steps=6", "train.lr=3e-3",
        "train.warmup_steps=1", "train.eval_interval=0", "train.eval_iters=8", "log.progress=false",
        "log.plot=false", "log.tensorboard=false", "checkpoint.save=false"])
    result = train(config, run_dir=tmp_path / "run")
    trainer = result.trainer
    valid, rows = trainer.valid_data, len(trainer.valid_data.rows.plan(0))
    assert 2 * config.train.eval_iters >= rows, "the final validation covers every held-out row"
    margins = []
    trainer.model.eval()
    with torch.no_grad():
        for start in range(0, rows, 2):
            part = trainer.local_part([micro_batches(valid, start, 2, 2, 0, 1, torch.device("cpu"))[0]], "valid")[0]
            token_losses = trainer.model(part["inputs"], part["targets"], documents=part["documents"])
            ratio = sequence_logps(token_losses, part, trainer.ctx.cp)[0] - part["reference"]
            margins += (ratio[:, 0] - ratio[:, 1]).tolist()
    accuracy = sum(m > 0 for m in margins) / len(margins)
    val_loss = result.metrics["val_loss"]
    # chance is 0.5 and ln 2 = 0.693; measured a held-out loss of 0.386 (0.405 and 16 of 18 pairs from the first 240
    # records, fp32, 2 threads); the pairs the script made before: 9 of 19 and 0.834
    assert len(margins) >= 10 and accuracy >= 0.7 and val_loss < math.log(2) - 0.1, (len(margins), accuracy,
                                                                                     val_loss)
