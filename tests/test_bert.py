"""BERT trains the same at every TP x DP layout, masks what it should, and communicates as the paper says.

The references run in this process; layouts 2x1 and 1x2 run in one world of 2 processes, 2x2 and 4x1
in one world of 4, each with and without gradient accumulation (pre-LN; 2x1 also post-LN, and 4x1 without
accumulation is post-LN only). Each run trains a tiny BERT for 8 steps on the same synthetic masked-LM
samples. The MLM loss is a mean over the predicted tokens of each micro-batch (as in Megatron-LM), so a
layout is compared with the single-process run that cuts the global batch into the same micro-batches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_training import assert_same_run

from shardlm.config import RunConfig, from_dict
from shardlm.models.bert import BERT, bert_loss, bert_loss_terms
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from multiproc import run_workers

VOCAB, SEQ, STEPS, LAYERS, HIDDEN = 100, 16, 8, 2, 32
MASK_ID, PAD_ID, CLS_ID, SEP_ID = 4, 0, 2, 3
ADAM_EPS = 1e-6  # see test_training.py: keeps round-off-level gradients (key bias) from being amplified


class SyntheticBertData:
    """Deterministic masked-LM samples: [CLS] A [SEP] B [SEP] [PAD]..., where every token of B is a fixed
    function of the matching token of A, 15% of tokens predicted, SOP label
    1 when A and B are swapped."""

    def __init__(self, num_samples: int, seed: int = 0):
        self.num_samples, self.seed = num_samples, seed
        self.successor = np.random.default_rng(seed).permutation(np.arange(5, VOCAB))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng([self.seed, i])
        half = int(rng.integers(3, (SEQ - 3) // 2 + 1))
        a = rng.integers(5, VOCAB, half)
        b = self.successor[a - 5]
        swapped = int(rng.random() < 0.5)
        if swapped:
            a, b = b, a
        tokens = np.concatenate([[CLS_ID], a, [SEP_ID], b, [SEP_ID]]).astype(np.int64)
        types = np.asarray([0] * (half + 2) + [1] * (half + 1), dtype=np.int64)
        labels = np.full(len(tokens), -100, dtype=np.int64)
        maskable = np.flatnonzero(np.isin(tokens, (CLS_ID, SEP_ID), invert=True))
        chosen = rng.choice(maskable, max(1, round(0.15 * len(maskable))), replace=False)
        labels[chosen] = tokens[chosen]
        tokens[chosen] = MASK_ID
        pad = SEQ - len(tokens)
        return {"tokens": np.pad(tokens, (0, pad), constant_values=PAD_ID), "token_types": np.pad(types, (0, pad)),
                "labels": np.pad(labels, (0, pad), constant_values=-100),
                "padding_mask": np.pad(np.ones(len(tokens), dtype=np.int64), (0, pad)),
                "is_random": np.asarray(swapped, dtype=np.int64)}


def tiny_config(tp: int = 1, micro: int = 8, order: str = "pre", dropout: float = 0.0, **train) -> RunConfig:
    return from_dict({
        "model": {"arch": "bert", "num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": 4, "seq_length": SEQ,
                  "vocab_size": VOCAB, "dropout": dropout, "layernorm_order": order},
        "parallel": {"tensor": tp},
        "data": {"prefixes": ["unused"], "tokenizer": "bert"},
        "train": {"precision": "fp32", "micro_batch_size": micro, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 5, **train},
    })


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter in the TP=1 layout: shards gathered over TP, vocabulary padding removed."""
    out = {}
    for name, param in trainer.model.named_parameters():
        value = param.detach()
        if hasattr(param, "tensor_parallel_dim"):
            value = torch.cat(trainer.ctx.tp.all_gather(value), dim=param.tensor_parallel_dim)
        out[name] = value[:VOCAB].clone() if name in ("wte.weight", "lm_bias") else value.clone()
    return out


def train_run(ctx: ParallelContext, config: RunConfig):
    ctx.rng = None
    trainer = Trainer(config, ctx, SyntheticBertData(STEPS * 8))
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    return curve, full_parameters(trainer)


# -------------------------------------------------------------------------------------- in workers

def worker_layouts(layouts):
    """Train each (tp, micro, order) layout on the whole world; every rank returns its curve and its copy of
    the parameters (TP shards gathered, its data-parallel replica's). Also counts one forward/backward's TP
    collectives at the first layout's TP size."""
    out = {}
    for tp, micro, order in layouts:
        ctx = ParallelContext.from_process_group(tp)
        out[(tp, micro, order)] = train_run(ctx, tiny_config(tp=tp, micro=micro, order=order))
    ctx = ParallelContext.from_process_group(layouts[0][0])
    model = BERT(tiny_config(tp=ctx.tp_size).model, ctx, seed=3)
    batch = {k: torch.from_numpy(np.stack([SyntheticBertData(4)[i][k] for i in range(4)]))
             for k in ("tokens", "token_types", "labels", "padding_mask", "is_random")}
    ctx.comm.reset()
    loss = bert_loss(model, batch)
    forward = ctx.comm.snapshot()
    loss.backward()
    out["comm"] = {"forward": forward, "total": ctx.comm.snapshot()}
    out["predicted_tokens"] = int((batch["labels"] != -100).sum())
    return out


@pytest.fixture(scope="module")
def reference():
    ctx = ParallelContext.single()
    runs = {(micro, "pre"): train_run(ctx, tiny_config(micro=micro)) for micro in (8, 4, 2)}
    runs[(8, "post")] = train_run(ctx, tiny_config(micro=8, order="post"))
    return runs


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, worker_layouts, [(2, 8, "pre"), (2, 8, "post"), (1, 4, "pre"), (2, 4, "pre"), (1, 2, "pre")])


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, worker_layouts, [(2, 4, "pre"), (2, 2, "pre"), (4, 8, "post"), (4, 4, "pre")])


@pytest.mark.parametrize("tp,micro,order", [(2, 8, "pre"), (2, 8, "post"), (1, 4, "pre"), (2, 4, "pre"),
                                            (1, 2, "pre")],
                         ids=["2x1", "2x1-post", "1x2", "2x1-accum", "1x2-accum"])
def test_world2_layouts_match_single_process(world2, reference, tp, micro, order):
    for rank in world2:  # every rank's copy: TP shards gathered, each DP replica on its own
        assert_same_run(rank[(tp, micro, order)], reference[(micro, order)], steps=STEPS)


@pytest.mark.parametrize("tp,micro,order", [(2, 4, "pre"), (2, 2, "pre"), (4, 8, "post"), (4, 4, "pre")],
                         ids=["2x2", "2x2-accum", "4x1-post", "4x1-accum"])
def test_world4_layouts_match_single_process(world4, reference, tp, micro, order):
    for rank in world4:  # every rank's copy: TP shards gathered, each DP replica on its own
        assert_same_run(rank[(tp, micro, order)], reference[(micro, order)], steps=STEPS)


def test_tensor_parallel_collectives_per_pass(world2):
    """Forward: 2 all-reduces per layer + the embedding's + the cross-entropy's SUM, and one MAX.
    Backward: 2 per layer + the tied output layer's input gradient."""
    forward, total = world2[0]["comm"]["forward"], world2[0]["comm"]["total"]
    assert forward["all_reduce/tp"]["calls"] == 2 * LAYERS + 2
    assert forward["all_reduce_max/tp"]["calls"] == 1
    assert total["all_reduce/tp"]["calls"] - forward["all_reduce/tp"]["calls"] == 2 * LAYERS + 1
    layer_bytes = 4 * SEQ * HIDDEN * 4
    predicted = world2[0]["predicted_tokens"]  # only predicted tokens reach the LM head and its cross-entropy
    assert forward["all_reduce/tp"]["bytes"] == (2 * LAYERS + 1) * layer_bytes + 2 * predicted * 4
    assert forward["all_reduce_max/tp"]["bytes"] == predicted * 4


# ------------------------------------------------------------------------------- single process

@pytest.mark.parametrize("order", ["pre", "post"])
def test_padding_changes_no_real_position(order):
    """Keys at [PAD] positions are masked: changing the padding tokens changes nothing elsewhere."""
    model = BERT(tiny_config(order=order).model, ParallelContext.single(), seed=1).eval()
    sample = SyntheticBertData(1)[0]
    tokens = torch.from_numpy(sample["tokens"])[None]
    padding = torch.from_numpy(sample["padding_mask"])[None]
    real = int(padding.sum())
    assert real < SEQ
    other = tokens.clone()
    other[:, real:] = torch.randint(5, VOCAB, (1, SEQ - real))
    with torch.no_grad():
        hidden, pooled = model.encode(tokens, None, padding)
        hidden_other, pooled_other = model.encode(other, None, padding)
        unmasked, _ = model.encode(other)
    assert torch.equal(hidden[:, :real], hidden_other[:, :real]) and torch.equal(pooled, pooled_other)
    assert not torch.allclose(hidden[:, :real], unmasked[:, :real])  # without the mask it would differ


def test_layernorm_orders_differ_and_post_normalizes_the_output():
    ctx = ParallelContext.single()
    tokens = torch.randint(5, VOCAB, (2, SEQ))
    with torch.no_grad():
        pre, _ = BERT(tiny_config(order="pre").model, ctx, seed=1).eval().encode(tokens)
        post_model = BERT(tiny_config(order="post").model, ctx, seed=1).eval()
        post, _ = post_model.encode(tokens)
    assert not torch.allclose(pre, post)
    assert post_model.ln_f is None and post_model.ln_embed is not None
    # the last op of a post-LN layer is a LayerNorm with unit weight at init: per-position mean 0, std 1
    assert post.mean(-1).abs().max() < 1e-5
    assert (post.var(-1, unbiased=False) - 1).abs().max() < 1e-3


def test_initialization_does_not_depend_on_tensor_parallel_size():
    """The replicated heads draw from fixed seeds: two models built at different times are identical."""
    ctx = ParallelContext.single()
    torch.manual_seed(0)
    first = BERT(tiny_config().model, ctx, seed=9).state_dict()
    torch.manual_seed(1)
    second = BERT(tiny_config().model, ctx, seed=9).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


# --------------------------------------------------------------------- masking on real BERT data

@pytest.fixture(scope="module")
def novel_batches(tmp_path_factory, data_dir):
    """Micro-batches of the real BERT dataset over the start of a sentence-split novel."""
    from shardlm.data.bert_dataset import build_bert_datasets
    from shardlm.data.preprocess import PreprocessConfig, preprocess
    from shardlm.data.tokenizers import build_tokenizer
    from shardlm.training.data import micro_batches

    folder = tmp_path_factory.mktemp("bert_novel")
    text = (data_dir / "corpus/pride_and_prejudice_pg1342.txt").read_text(encoding="utf-8")
    (folder / "novel.txt").write_text(text[20_000:220_000], encoding="utf-8")
    vocab = data_dir / "vocab/bert-base-uncased/vocab.txt"
    preprocess(PreprocessConfig(input=folder / "novel.txt", output_prefix=folder / "novel", tokenizer="bert",
                                vocab_file=vocab, split_sentences=True), progress=False)
    tokenizer = build_tokenizer("bert", vocab)
    train, _, _ = build_bert_datasets([str(folder / "novel")], "1", 64, 3, (256, 0, 0), tokenizer)
    return micro_batches(train, 0, 256, 32, 0, 1, torch.device("cpu")), tokenizer


def test_masking_statistics_of_training_batches(novel_batches):
    """About 15% of the real, non-special tokens are predicted; of those 80% are [MASK], 10% random,
    10% unchanged; sentence-order labels are balanced."""
    batches, tokenizer = novel_batches
    labels = torch.cat([b["labels"] for b in batches])
    tokens = torch.cat([b["tokens"] for b in batches])
    real = torch.cat([b["padding_mask"] for b in batches]).sum().item()
    maskable = real - 3 * len(tokens)  # [CLS] and two [SEP] per sample are never predicted
    predicted = labels != -100
    assert predicted.sum().item() / maskable == pytest.approx(0.15, abs=0.01)
    assert (tokens[predicted] == tokenizer.mask).float().mean().item() == pytest.approx(0.8, abs=0.03)
    assert (tokens[predicted] == labels[predicted]).float().mean().item() == pytest.approx(0.1, abs=0.03)
    sop = torch.cat([b["is_random"] for b in batches]).float().mean().item()
    assert sop == pytest.approx(0.5, abs=0.1)


def test_mlm_loss_is_mean_over_predicted_tokens_only(novel_batches):
    """The MLM term equals F.cross_entropy over the gathered logits at predicted positions only."""
    batches, tokenizer = novel_batches
    batch = {k: v[:4] for k, v in batches[0].items()}
    config = tiny_config()
    config.model.vocab_size, config.model.seq_length = tokenizer.vocab_size, 64
    model = BERT(config.model, ParallelContext.single(), seed=2).eval()
    with torch.no_grad():
        mlm, sentence = bert_loss_terms(model, batch)
        logits, sentence_logits = model(batch["tokens"], batch["token_types"], batch["padding_mask"])
    predicted = batch["labels"] != -100
    expected = F.cross_entropy(model.full_logits(logits)[predicted], batch["labels"][predicted])
    assert mlm.item() == pytest.approx(expected.item(), rel=1e-5)
    assert sentence.item() == pytest.approx(F.cross_entropy(sentence_logits, batch["is_random"]).item(), rel=1e-6)
