"""Packed SFT rows train the same model at every layout, and packing changes nothing.

Data: synthetic conversations (a learnable token stream; the first ~40% of each one a prompt that is not
trained), tokenized shapes only, packed best-fit-decreasing by the real `PackedRows` into rows of 32 tokens,
read through `PackedDataset` as an `[sft]` run reads them. Documents cross the CP chunks and the
micro-batch boundaries, and rows hold very different numbers of trained tokens, so a mean of per-micro-batch
or per-rank means would differ from the global mean over trained tokens that the trainer computes.

Checks, each against one process within 1e-5 (fp32: losses, gradient norms, validation loss over the
held-out rows and every final parameter, on every rank):
- one process at micro-batch 1 (8 micro-batches) equals micro-batch 8 (the loss is normalized over the
  global batch's trained tokens, not per micro-batch);
- world 2: DP=2, TP=2 with SP (GPT, Llama with grouped-query attention, MLA), PP=2 x 2 virtual stages
  (middle stages need the documents too), CP=2 (GPT, Llama, MLA with values narrower than keys; the ring
  masks blocks by document; MLA with 2 multi-token-prediction depths, rolled within documents on the whole
  rows before the split), FSDP DP=2; gpt-oss's attention (sinks, a window on alternate layers, biases) at
  CP=2, TP=2 with SP and PP=2 x 2 virtual stages; Dynamic Fine-Tuning (`sft.loss_type = "dft"`: each token's loss
  times its probability) at TP=2 with SP (the vocabulary-parallel loss) and PP=2 x 2 virtual stages (the last
  stage's loss), its first loss checked against p x (-log p) of the one-process model's tokens;
- world 4: TP=2 x DP=2 with the distributed optimizer, PP=2 x DP=2, CP=2 x DP=2, CP=2 x TP=2 with SP, and an
  MoE (Mixtral-style, 4 experts) at EP=2 over DP=4 against its own one-process run;
- one process: the packed forward and its gradients equal the documents run one by one, unpacked, for GPT,
  Llama, MLA and gpt-oss's attention (windows and sinks per document), and differ from attention across
  documents (the control);
- a run resumed mid-epoch (the epoch ends inside a step) continues bitwise.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_moe_parallel import full_parameters, stage_parameters
from test_training import VOCAB

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.models import build_model
from shardlm.models.documents import Documents
from shardlm.parallel import ParallelContext
from shardlm.sft.dataset import PackedDataset
from shardlm.sft.packing import PackedRows
from shardlm.sft.template import TokenizedConversation
from shardlm.training.data import DocumentSamples, micro_batches
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank, assert_same_run, assert_trained_but_off, rel
from layouts import MIXTRAL, MLA, counting, layout, layout_config, layout_context, spawn_layouts, tiny_model
from multiproc import check_result, disturb_generators

SEQ, STEPS, TOL = 32, 4, 1e-5
TRAINED = 3
"""The steps this file's runs train: the first 3 of the configs' STEPS-step schedule (not 2: after 2 steps a bias
that started at zero, `ln_f.bias` at TP=2 with SP, is so small that the AVX2 kernels' rounding reaches 1.01e-5 of
it by `trained_rel`). The other layout tests that import `train_layout` train all STEPS."""
OSS = {"attention_sinks": True, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"] * 2,
       "attention_bias": True, "attention_output_bias": True}


def conversations(seed: int, count: int) -> list[TokenizedConversation]:
    """`count` conversations of 4-24 tokens: each token a fixed function of the previous one (10% noise),
    the first ~40% a prompt (loss mask 0), the rest trained."""
    rng = np.random.default_rng(seed)
    successor = np.random.default_rng(0).permutation(VOCAB)
    docs = []
    for _ in range(count):
        n = int(rng.integers(4, 25))
        ids = [int(rng.integers(VOCAB))]
        for noise in rng.random(n - 1):
            ids.append(int(rng.integers(VOCAB)) if noise < 0.1 else int(successor[ids[-1]]))
        prompt = max(1, int(0.4 * n))
        docs.append(TokenizedConversation(ids, [0] * prompt + [1] * (n - prompt)))
    return docs


def train_data() -> PackedDataset:
    return PackedDataset(PackedRows(conversations(1, 40), SEQ, "bfd", seed=5))


def valid_data() -> PackedDataset:
    return PackedDataset(PackedRows(conversations(2, 16), SEQ, "bfd", seed=None), epochs=1)


def sft_config(arch: str = "gpt", micro: int = 2, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
               sp: bool = False, virtual: int = 1, moe: bool = False, mtp: bool = False, dropout: float = 0.0,
               dft: bool = False, **train):
    model = tiny_model(arch, SEQ, dropout=dropout)
    if arch == "llama":
        model["num_kv_heads"] = 2
    if arch == "mla":  # DeepSeek-V3's latent attention: keys of 12 channels, values of 8
        model |= {"arch": "llama", **MLA, "v_head_dim": 8}
    if arch == "oss":  # gpt-oss's attention: sinks, a window of 5 on alternate layers, q/k/v/o biases
        model |= {"arch": "llama", "num_kv_heads": 2, **OSS}
    if mtp:  # and its multi-token prediction: 2 depths, rolled within each document
        model |= {"mtp_layers": 2, "mtp_loss_weight": 0.3}
    if moe:
        model |= {"num_layers": 2} | MIXTRAL
    sections = {"sft": {"data": ["unused.jsonl"], "loss_type": "dft"}} if dft else None  # (the rows are given)
    return layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, virtual=virtual, sections=sections,
                         **{"steps": STEPS, "eval_iters": 64, **train})


def train_layout(ctx: ParallelContext, config, steps: int = STEPS) -> dict:
    """Curve (loss, gradient norm) of `steps` steps, the validation loss and every final parameter (all stages)."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, train_data(), valid_data())
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]
    return {"curve": curve, "valid": trainer.evaluate(), "params": stage_parameters(trainer.model)}


@contextlib.contextmanager
def broken(control: str | None):
    """Break what a control case shows is needed: "ring mask" gives the CP ring no documents (its blocks then
    attend across them), "first stage" gives the documents to the first pipeline stage only."""
    from shardlm.models import attention
    from shardlm.parallel.pipeline import ShardlmStage

    ring, run_chunk = attention.context_parallel_attention, ShardlmStage.forward_one_chunk

    def maskless_ring(*args, segments=None, **kwargs):
        return ring(*args, **kwargs)

    def first_stage_only(self, *args, **kwargs):
        saved = self.documents
        self.documents = saved if self.is_first else None
        try:
            return run_chunk(self, *args, **kwargs)
        finally:
            self.documents = saved

    patches = {"ring mask": (attention, "context_parallel_attention", maskless_ring),
               "first stage": (ShardlmStage, "forward_one_chunk", first_stage_only)}
    target = patches.get(control)
    if target:
        setattr(*target)
    try:
        yield
    finally:
        if target:
            setattr(target[0], target[1], ring if control == "ring mask" else run_chunk)


def run_layout(tp: int, pp: int, cp: int, ep: int, control: str | None = None, steps: int = TRAINED,
               **config) -> dict:
    with broken(control):
        return train_layout(layout_context(tp, pp, cp, ep), sft_config(tp=tp, pp=pp, cp=cp, ep=ep, **config), steps)


WORLD2 = {
    "dp2 gpt": layout(),
    "tp2 sp gpt": layout(tp=2, sp=True),
    "tp2 sp llama": layout(tp=2, sp=True, arch="llama"),
    "pp2 virtual2 gpt": layout(pp=2, virtual=2, micro=1),
    "pp2 virtual2 llama": layout(pp=2, virtual=2, micro=1, arch="llama"),
    "cp2 gpt": layout(cp=2),
    "cp2 llama": layout(cp=2, arch="llama"),
    "cp2 mla": layout(cp=2, arch="mla"),
    "tp2 sp mla": layout(tp=2, sp=True, arch="mla"),
    "cp2 mla mtp": layout(cp=2, arch="mla", mtp=True),
    "fsdp dp2 llama": layout(arch="llama", data_sharding="full"),
    "cp2 oss": layout(cp=2, arch="oss"),
    "tp2 sp oss": layout(tp=2, sp=True, arch="oss"),
    "pp2 virtual2 oss": layout(pp=2, virtual=2, micro=1, arch="oss"),
    "tp2 sp gpt dft": layout(tp=2, sp=True, dft=True),
    "pp2 virtual2 gpt dft": layout(pp=2, virtual=2, micro=1, dft=True),
}
CONTROLS = {  # the same layouts broken (see `broken`): each must train all STEPS and end off
    "control cp2 gpt ring mask": layout(cp=2, control="ring mask", steps=STEPS),
    "control cp2 llama ring mask": layout(cp=2, arch="llama", control="ring mask", steps=STEPS),
    "control pp2 virtual2 gpt first stage": layout(pp=2, virtual=2, micro=1, control="first stage", steps=STEPS),
    "control pp2 virtual2 llama first stage": layout(pp=2, virtual=2, micro=1, arch="llama", control="first stage",
                                                     steps=STEPS),
}
WORLD4 = {
    "zero tp2 dp2 sp llama": layout(tp=2, sp=True, arch="llama", distributed_optimizer=True),
    "pp2 dp2 gpt": layout(pp=2, micro=1),
    "cp2 dp2 llama": layout(cp=2, arch="llama"),
    "cp2 tp2 sp gpt": layout(cp=2, tp=2, sp=True),
    "ep2 dp4 moe": layout(ep=2, moe=True),
}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4)


@pytest.fixture(scope="module")
def reference():
    """One process, for each model kind: dense at micro-batch 8 (one micro-batch per step); the MoE at the
    layouts' micro-batch 2, since its load-balancing loss is a function of each micro-batch's routing. The
    controls' ("gpt control", "llama control") train all STEPS: 2 steps of a broken run may still end within 1e-3."""
    ctx = ParallelContext.single()
    kinds = {"gpt": ("gpt", 8, False), "llama": ("llama", 8, False), "mla": ("mla", 8, False),
             "oss": ("oss", 8, False), "moe": ("gpt", 2, True)}
    return {kind: train_layout(ctx, sft_config(arch, micro=micro, moe=moe), TRAINED) for kind, (arch, micro, moe) in
            kinds.items()} | {"mtp": train_layout(ctx, sft_config("mla", micro=8, mtp=True), TRAINED),
                              "dft": train_layout(ctx, sft_config(micro=8, dft=True), TRAINED)} | {
        f"{arch} control": train_layout(ctx, sft_config(arch, micro=8)) for arch in ("gpt", "llama")}


def kind_of(name: str) -> str:
    return next((kind for kind in ("moe", "llama", "mtp", "mla", "oss", "dft") if kind in name), "gpt")


@pytest.mark.parametrize("name", list(WORLD2))
def test_packed_rows_at_two_ranks_equal_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], steps=TRAINED, tol=TOL)


@pytest.mark.parametrize("name", list(WORLD4))
def test_packed_rows_at_four_ranks_equal_one_process(world4, reference, name):
    assert_every_rank(world4, name, reference[kind_of(name)], steps=TRAINED, tol=TOL)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_controls_without_the_documents_fail(world2, reference, name):
    """The CP cases need the ring's document mask and the PP cases need the documents on every stage: broken,
    they train to finite losses and end more than 1e-3 away from one process (attention weights included)."""
    ref = reference[f"{kind_of(name)} control"]
    for value in check_result(world2, name):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], STEPS, ".attn.")
        assert max(abs(loss - r) / r for (loss, _), (r, _) in zip(value["curve"][1:], ref["curve"][1:])) > 1e-3


def test_dft_weighs_each_token_by_its_probability(reference):
    """Dynamic Fine-Tuning (`sft.loss_type = "dft"`): the first step's loss is the mean over the trained tokens of
    p x (-log p), p = exp(-token loss), computed here from the one-process model's own token losses, and the run is
    not the NLL run (its gradient norms move)."""
    config = sft_config(micro=8, dft=True)
    trainer = Trainer(config, ParallelContext.single(), train_data(), valid_data())
    [batch] = trainer.local_part(micro_batches(trainer.train_data, 0, 8, 8, 0, 1, torch.device("cpu")))
    with torch.no_grad():
        losses = trainer.model(batch["inputs"], batch["targets"], documents=batch["documents"])
    trained = batch["targets"] != -100
    want = (losses * torch.exp(-losses))[trained].double().mean().item()
    assert abs(reference["dft"]["curve"][0][0] - want) <= 1e-6 * want, (reference["dft"]["curve"][0], want)
    plain = reference["gpt"]["curve"]
    assert max(abs(a[1] - b[1]) for a, b in zip(plain, reference["dft"]["curve"])) > 1e-3


def test_loss_is_the_mean_over_all_trained_tokens_not_a_mean_of_means(reference):
    """Micro-batch 1 (8 micro-batches of different trained-token counts) equals micro-batch 8; the mean of the
    per-row means is another number (so the test could tell)."""
    ctx = ParallelContext.single()
    assert_same_run(train_layout(ctx, sft_config(micro=1), TRAINED), reference["gpt"], "micro 1", steps=TRAINED,
                    tol=TOL)
    rows = [train_data()[i] for i in range(8)]
    per_row = [(r["labels"] != -100).sum() for r in rows]
    assert len(set(per_row)) > 2, per_row


# ------------------------------------------------------------------------- packed equals unpacked

def packed_and_unpacked(arch: str, documents: bool = True, batch: list[dict] | None = None) -> tuple[dict, dict]:
    """(loss, gradients) of 4 packed rows (`batch`, by default SFT rows) in one forward, and of their documents
    one by one unpacked (each a row of its own length), both the sum of trained-token losses over their count."""
    ctx = ParallelContext.single()
    model = build_model(sft_config(arch).model, ctx, seed=3)
    batch = batch or [train_data()[i] for i in range(4)]
    inputs, labels, positions = (torch.from_numpy(np.stack([r[k] for r in batch]))
                                 for k in ("input_ids", "labels", "position_ids"))
    count = (labels != -100).sum()
    docs = Documents.from_positions(positions) if documents else None
    packed = model(inputs, labels, documents=docs).sum() / count
    packed_grads = torch.autograd.grad(packed, list(model.parameters()))
    total = 0.0
    for b, offsets in enumerate(Documents.from_positions(positions).offsets):
        for start, end in zip(offsets, offsets[1:]):
            total = total + model(inputs[b:b + 1, start:end], labels[b:b + 1, start:end]).sum()
    unpacked = total / count
    unpacked_grads = torch.autograd.grad(unpacked, list(model.parameters()))
    names = [n for n, _ in model.named_parameters()]
    return ({"loss": packed.item(), **dict(zip(names, packed_grads))},
            {"loss": unpacked.item(), **dict(zip(names, unpacked_grads))})


@pytest.mark.parametrize("arch", ["gpt", "llama", "mla", "oss"])
def test_packed_rows_equal_documents_one_by_one(arch):
    packed, unpacked = packed_and_unpacked(arch)
    assert abs(packed["loss"] - unpacked["loss"]) <= TOL * unpacked["loss"]
    for name in packed:
        if name != "loss":
            assert rel(packed[name], unpacked[name]) <= TOL, name
    crossed, _ = packed_and_unpacked(arch, documents=False)  # plain causal attention over the whole row
    assert abs(crossed["loss"] - unpacked["loss"]) > 2 * TOL * unpacked["loss"]
    assert max(rel(crossed[n], unpacked[n]) for n in unpacked if n != "loss") > 1e-2


def pretraining_rows() -> list[dict]:
    """4 samples of `data.document_mask` pretraining (`DocumentSamples`): a token stream cut into documents of
    1-14 tokens by an end-of-document token (runs of two included), every next token trained."""
    rng, eod = np.random.default_rng(11), VOCAB - 1
    stream = rng.integers(0, eod, size=4 * (SEQ + 1))
    cuts = np.cumsum(rng.integers(1, 15, size=4 * SEQ))
    stream[cuts[cuts < len(stream)]] = eod
    stream[[9, 10]] = eod
    samples = DocumentSamples([stream[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in range(4)], eod)
    rows = [samples[i] for i in range(4)]
    positions = torch.from_numpy(np.stack([r["position_ids"] for r in rows]))
    for row, offsets in zip(rows, Documents.from_positions(positions).offsets):  # each document ends at its eod
        ends = [i + 1 for i, token in enumerate(row["input_ids"][:-1]) if token == eod]
        assert list(offsets) == [0, *ends, SEQ] and len(ends) > 2, (offsets, ends)
    return rows


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_pretraining_document_mask_equals_documents_one_by_one(arch):
    """`data.document_mask=true`: each sample's documents (each ending with its end-of-document token, whose
    label is the next document's first token) train as if each ran alone; without the documents they do not."""
    rows = pretraining_rows()
    packed, unpacked = packed_and_unpacked(arch, batch=rows)
    assert abs(packed["loss"] - unpacked["loss"]) <= TOL * unpacked["loss"]
    assert max(rel(packed[n], unpacked[n]) for n in unpacked if n != "loss") <= TOL
    crossed, _ = packed_and_unpacked(arch, documents=False, batch=rows)
    assert max(rel(crossed[n], unpacked[n]) for n in unpacked if n != "loss") > 1e-2


# ------------------------------------------------------------------------------- resume mid-epoch

def test_resume_mid_epoch_is_bitwise(tmp_path):
    """The rows of one epoch run out inside step 2 (9 rows, 8 per step): 3 steps at dropout 0.1, save, 3 more,
    against a fresh trainer, both its generators disturbed, that loads the save and runs the same 3 steps:
    losses, gradient norms and every parameter bitwise."""
    ctx = ParallelContext.single()
    rows = PackedRows(conversations(1, 40), SEQ, "bfd", seed=5)
    assert len(rows.plan(0)) % 8, "the epoch must end inside a step"
    trainer = Trainer(sft_config(micro=4, steps=6, dropout=0.1), ctx, train_data())
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(trainer, str(tmp_path))
    straight = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(3))]
    ctx.rng = None
    resumed_trainer = Trainer(sft_config(micro=4, steps=6, dropout=0.1), ctx, train_data())
    disturb_generators(ctx)
    load_checkpoint(resumed_trainer, str(tmp_path))
    assert [(m["loss"], m["grad_norm"]) for m in (resumed_trainer.train_step() for _ in range(3))] == straight
    resumed, uninterrupted = full_parameters(resumed_trainer.model), full_parameters(trainer.model)
    assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items())


# ------------------------------------------------------------------------------------ recomputation

@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_reruns_attention_with_the_documents(monkeypatch, mode):
    """Selective (the attention core) and full (whole layers) recomputation on packed rows: every attention
    core runs twice per micro-batch instead of once (the rerun happened), and the curve and parameters are
    bitwise those of no recomputation (the rerun saw the same documents)."""
    from shardlm.models.gpt import ParallelAttention

    calls = {"core": 0, "with documents": 0}

    def with_documents(self, q, k, v, documents=None):
        return documents is not None

    monkeypatch.setattr(ParallelAttention, "core", counting(counting(ParallelAttention.core, calls, "core"), calls,
                                                            "with documents", with_documents))
    runs = {}
    for recompute in ("none", mode):
        calls.update({"core": 0, "with documents": 0})
        runs[recompute] = train_layout(ParallelContext.single(), sft_config(micro=4, recompute=recompute), TRAINED)
        runs[recompute]["calls"] = dict(calls)
    plain, rerun = runs["none"]["calls"], runs[mode]["calls"]
    assert rerun["with documents"] == rerun["core"] > plain["core"]
    trained_calls = TRAINED * 2 * 4  # steps x micro-batches x layers
    assert rerun["core"] - plain["core"] == trained_calls
    plain, rerun = runs["none"], runs[mode]
    assert rerun["curve"] == plain["curve"] and rerun["valid"] == plain["valid"]
    assert all(torch.equal(rerun["params"][n], p) for n, p in plain["params"].items())
