"""TRL's `SFTTrainer` as an external oracle for shardlm's SFT training: the same losses, step by step.

A random two-layer Qwen3 (and a Qwen3-MoE) with the real Qwen3 vocabulary is saved as a Hugging Face
directory beside the shared Qwen3 tokenizer. The first 64 Dolly records are tokenized once with shardlm's
`ChatTemplate` (that these ids and masks are TRL's own is `tests/test_sft_trl.py`'s business) and handed to
both trainers:

- TRL gets them as a processed dataset (`input_ids`, `assistant_masks`) and packs them itself
  (`packing_strategy="bfd"`, padding-free), 2 rows per step, in order (a sequential sampler);
- shardlm trains with `shardlm.training.run.train` from the same directory (`checkpoint.init_from`), the
  records through `[sft]` with `sft.shuffle=false` (the same rows in the same order, as test_sft_trl shows).

Matched: AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay), a constant learning rate without warmup,
clipping at 1.0, fp32. Each of 3 steps' loss (the sum over the batch's trained tokens over their count)
and the first step's gradient norm agree within 1e-5 relative, so later steps also check the updates. The
first step's loss is also the forward of TRL's padding-free batch through transformers (attention kept
inside each packed document from the position ids) against shardlm's packed rows.

Set against TRL's defaults: `bf16=False` (SFTConfig turns bf16 autocast on by default where the CPU
supports it; the comparison is in fp32). A trap this test keeps visible: transformers (5.x) derives the
packed-document mask from the position ids only when the forward has no key/value cache. TRL's training
forward turns the cache off, but a plain `model(input_ids, position_ids=...)` with the config's default
`use_cache=True` builds one, and the sdpa and eager attentions then let every packed document attend to
the ones before it in the row (the first step's loss moves by 2e-4 and the first layer's q-projection
gradient norm by a third on this model). The forward check below therefore runs with the cache off, and
asserts that with it on the loss moves beyond the check's bound and that gradient by more than 10 times it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from multiproc import import_or_skip

# a missing oracle skips these tests on a developer's machine and fails them under CI (multiproc.import_or_skip)
trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")
transformers = import_or_skip("transformers")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.sft.records import load_conversations  # noqa: E402
from shardlm.sft.template import ChatTemplate, tokenize_conversations  # noqa: E402
from shardlm.training.run import train  # noqa: E402

# rows of 128 tokens: several of the 35 conversations that fit one are packed into each (26 to 122 tokens), and
# the batch's logits over the 151,936-token vocabulary, most of a step's time, stay small; the learning rate of
# 3e-3 moves the loss by more than 0.01 within the 3 steps (at 1e-3 Qwen3-MoE's third step was no lower)
SEQ, ROWS_PER_STEP, STEPS, LR, RECORDS, TOL = 128, 2, 3, 3e-3, 64, 1e-5


def hf_model(kind: str):
    """A random two-layer Qwen3, or Qwen3-MoE (4 experts, top 2; its load-balancing loss is off on both sides:
    transformers computes it over all layers' tokens at once, shardlm per layer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                              norm_topk_prob=True, output_router_logits=False,
                                              router_aux_loss_coef=0.0, **common))


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def setup(request, tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp(f"sft_trl_training_{request.param}")
    torch.manual_seed(0)
    hf_model(request.param).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "chat" / "qwen3" / name, root / "hf" / name)
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()[:RECORDS]
    (root / "all.jsonl").write_text("\n".join(lines) + "\n")
    template = ChatTemplate.from_dir(root / "hf")
    docs = tokenize_conversations(template, load_conversations(root / "all.jsonl"))
    # conversations that fit a row: TRL cuts longer ones into pieces, shardlm truncates them (docs/sft.md)
    fits = [i for i, d in enumerate(docs) if len(d.input_ids) <= SEQ]
    assert len(fits) >= 30
    (root / "records.jsonl").write_text("\n".join(lines[i] for i in fits) + "\n")
    docs = [docs[i] for i in fits]
    return {"root": root, "hf": root / "hf", "records": root / "records.jsonl", "docs": docs}


class InOrder(trl.SFTTrainer):
    """SFTTrainer reading its packed rows in order, as `sft.shuffle=false` does."""

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


def trl_sft(setup, name: str, **options) -> tuple[list[dict], InOrder, dict]:
    """TRL's SFTTrainer on the tokenized records, packed (bfd, padding-free), in order, with the matched settings
    and `options` (its loss_type): (the logged steps, the trainer before `train()` has run, its first batch). Call
    `trainer.train()` to run it."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    model = AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False  # else transformers skips the packed-document mask (module docstring)
    dataset = datasets.Dataset.from_dict({"input_ids": [d.input_ids for d in setup["docs"]],
                                          "assistant_masks": [d.loss_mask for d in setup["docs"]]})
    args = trl.SFTConfig(output_dir=str(setup["root"] / name), max_length=SEQ, packing=True, packing_strategy="bfd",
                         padding_free=True, per_device_train_batch_size=ROWS_PER_STEP, max_steps=STEPS,
                         learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                         adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1,
                         report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                         disable_tqdm=True, bf16=False, **options)
    logs: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append(dict(logs) | {"step": state.global_step})

    records = logs
    with uncached_datasets():
        trainer = InOrder(model=model, args=args, train_dataset=dataset, callbacks=[Record()])
        first_batch = next(iter(trainer.get_train_dataloader()))
    return logs, trainer, first_batch


@pytest.fixture(scope="module")
def trl_run(setup):
    logs, trainer, first_batch = trl_sft(setup, "trl")
    inputs = {k: v for k, v in first_batch.items() if k in ("input_ids", "position_ids", "labels")}
    forward_loss, q_grad = loss_and_first_q_grad(trainer.model, inputs, use_cache=False)
    leaking_loss, leaking_q_grad = loss_and_first_q_grad(trainer.model, inputs, use_cache=True)
    with uncached_datasets():
        trainer.train()
    return {"logs": logs, "forward_loss": forward_loss, "leaking_loss": leaking_loss, "q_grad": q_grad,
            "leaking_q_grad": leaking_q_grad}


def loss_and_first_q_grad(model, inputs: dict, use_cache: bool) -> tuple[float, float]:
    """The loss of `inputs` and the norm of its gradient of the first layer's q-projection (gradients cleared
    after)."""
    loss = model(**inputs, use_cache=use_cache).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.norm().item()
    model.zero_grad(set_to_none=True)
    return loss.item(), grad


def shardlm_sft(setup, name: str, *more: str) -> list[dict]:
    """shardlm's logged steps from the same directory and records in order, the matched settings, `more`
    overrides."""
    overrides = [f"checkpoint.init_from={setup['hf']}", "checkpoint.save=false",
                 f"sft.data=[\"{setup['records']}\"]", "sft.shuffle=false", "sft.valid_fraction=0.0",
                 f"model.seq_length={SEQ}", f"train.micro_batch_size={ROWS_PER_STEP}",
                 f"train.global_batch_size={ROWS_PER_STEP}", f"train.steps={STEPS}", f"train.lr={LR}",
                 f"train.min_lr={LR}", "train.decay_style=\"constant\"", "train.warmup_steps=0",
                 "train.weight_decay=0.0", "train.adam_beta2=0.999", "train.adam_eps=1e-8", "train.clip_grad=1.0",
                 "train.device=\"cpu\"", "train.precision=\"fp32\"", "log.interval=1", "log.progress=false",
                 "log.plot=false", "log.tensorboard=false", *more]
    run_dir = setup["root"] / name
    train(load_config(None, overrides), run_dir=run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"val_loss"' not in line]


@pytest.fixture(scope="module")
def shardlm_run(setup):
    return shardlm_sft(setup, "shardlm")


def test_first_batch_forward_equals_transformers_on_trls_padding_free_batch(trl_run, shardlm_run):
    ours, theirs = shardlm_run[0]["loss"], trl_run["forward_loss"]
    assert abs(ours - theirs) <= TOL * theirs, (ours, theirs)
    # the control: with a cache, transformers lets packed documents attend to each other: the loss moves beyond
    # the check's bound, and the first layer's q-projection gradient by more than 10 times it
    assert abs(trl_run["leaking_loss"] - theirs) > TOL * theirs, trl_run
    assert abs(trl_run["leaking_q_grad"] - trl_run["q_grad"]) > 10 * TOL * trl_run["q_grad"], trl_run


def assert_follows(ours: list[dict], logs: list[dict]) -> None:
    """Each step's loss and the first gradient norm within TOL relative of TRL's logged ones."""
    theirs = [log["loss"] for log in logs]
    assert len(theirs) == len(ours) == STEPS, (theirs, ours)
    for step, (a, b) in enumerate(zip([m["loss"] for m in ours], theirs), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: shardlm {a} vs TRL {b}"
    first_norm = logs[0]["grad_norm"]
    assert abs(ours[0]["grad_norm"] - first_norm) <= TOL * first_norm


def test_losses_follow_trl_step_by_step(trl_run, shardlm_run):
    assert_follows(shardlm_run, trl_run["logs"])
    assert shardlm_run[0]["loss"] - shardlm_run[-1]["loss"] > 0.01, "the run must train for the later steps to count"


def test_dft_follows_trl_step_by_step(request, setup, trl_run):
    """Dynamic Fine-Tuning (`sft.loss_type = "dft"`, TRL's loss_type "dft": each token's NLL times its probability,
    no gradient through the weight) follows `SFTTrainer`'s steps; on this random model every probability is near
    1 / 151,936, so DFT's losses are far below the NLL run's (the weights reach the loss)."""
    if request.node.callspec.params["setup"] != "qwen3":
        pytest.skip("the dense model's run is enough: the weighting is per token, after the output layer")
    logs, trainer, _ = trl_sft(setup, "trl_dft", loss_type="dft")
    with uncached_datasets():
        trainer.train()
    ours = shardlm_sft(setup, "shardlm_dft", 'sft.loss_type="dft"')
    assert_follows(ours, logs)
    assert ours[0]["loss"] < 1e-3 * trl_run["logs"][0]["loss"], (ours[0], trl_run["logs"][0])


