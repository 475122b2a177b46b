"""Distillation is the same run at every layout: a frozen teacher's distributions at the student's layout.

Teacher: a random transformers Qwen3 (4 layers, hidden 48, q/k norms, untied output layer, norm weights spread,
its output layer scaled up so its distributions are far from uniform), saved as a Hugging Face directory and read
by shardlm at each layout (`distill.teacher`). Student: the 4-layer Llama of `test_sft_layouts` on its packed SFT
rows (prompts not trained), the generalized JSD with beta 0.5 and temperature 2. Each layout against one process
within 1e-5 (fp32: 3 steps' losses and gradient norms (of 4 rows; 8 with LoRA or the per-token KL), the validation
loss, every parameter on every rank):
- world 2: TP=2 with SP (the vocabulary split, where the divergence's reductions count; also with the divergence
  computed in chunks of 5 rows, against one chunk in the reference), PP=2 and PP=2 x 2 virtual
  stages (the teacher's 4 layers over the same stages, its hidden states handed to the last), DP=2 with ZeRO-1, FSDP
  DP=2, CP=2, EP=2 (a MoE student; also with a Qwen3-MoE teacher, whose experts split over EP too), a LoRA student
  at TP=2 with SP, FSDP CP=2 and FSDP EP=2 with the Qwen3-MoE teacher;
- world 4: TP=2 x DP=2 with SP, CP=2 x TP=2 with SP, PP=2 x TP=2 with SP, FSDP TP=2 x DP=2 with SP, hybrid FSDP in
  groups of 2 of DP=4, FSDP PP=2 x DP=2;
- under FSDP the teacher is sharded over the student's mesh (`shardlm.training.frozen.shard_frozen`): after the
  run every teacher parameter is a DTensor again (each rank 1/2 of each tensor whose first dimension DP divides;
  under PP the ends too), the log line's MiB is the rank's bytes, and every rank ran as many teacher
  layers (their all-gathers are collectives); under ZeRO-1 each rank holds the whole teacher;
- the control: at TP=2 the student's sum of exponentials reduced without summing its gradient over the ranks
  (the backward of a plain all-reduce) trains, and ends more than 1e-3 off (with beta 0, the forward KL, whose
  upstream gradients sum to -1 over the vocabulary; under beta 0.5 their sum is (1 - beta) KL(student ||
  mixture), so the same bug moves the run by less);
- on-policy (GKD's lambda 0.2: steps 1 and 2 of the 3 are drawn on-policy and train on the student's own
  completions of each conversation's prompt, sampled at the layout; step 3 on the records' answers): TP=2 with
  SP, DP=2, FSDP DP=2, PP=2 x 2 virtual stages (each decoding step through the stages), CP=2 and CP=2 x TP=2 with
  SP (each CP rank samples its share of whole sequences) and FSDP PP=2 x DP=2 equal one process; so does the
  per-token reverse KL of the student's samples (`loss = "token_kl"`, every step on-policy) at TP=2 with SP;
- seq_kd (GKD's sequence-level KD: the steps that are not on-policy, step 3 here, train on the teacher's
  completions, sampled at the layout through the teacher's own stages): PP=2 x 2 virtual stages, FSDP
  DP=2 and FSDP PP=2 x DP=2 (the teacher DTensors again after the run) equal one process, with top-k, top-p, min-p
  and the repetition penalty; the teacher's sampler at temperature 0 decodes as transformers' greedy `generate`
  of the teacher's directory;
- one process: a packed row's loss and gradients equal its documents' alone, and the teacher has no gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_distill_top_k import own_supports
from test_moe_parallel import stage_parameters
from test_sft_layouts import SEQ, train_data, valid_data

from shardlm.distill import divergence
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_same_run, assert_trained_but_off
from layouts import MIXTRAL, layout, layout_config, layout_context, spawn_layouts, tiny_model
from multiproc import check_result

STEPS, TOL, BATCH, WIDE_BATCH = 3, 1e-5, 4, 8
"""3 steps (the learning check's curve; both kinds of on-policy step) of 4 rows; those of the LoRA student and of the
per-token KL and IW-OPD of 8: on 4 rows some elements' gradients nearly cancel (LoRA's B, zero at the start; at
TP=2 the token KL's layers.1.attn.o.weight ends 9e-6 off one process, on 8 rows 2e-6), where a layout's rounding
turns them into whole AdamW steps."""
VOCAB = 300
"""Both models' vocabulary (the rows use its first 100 tokens): padded to 512 at TP=2, so each rank holds real
entries (256 and 44) and the divergence's reductions over the split vocabulary count."""
DISTILL = {"beta": 0.5, "temperature": 2.0}
FILTERS = {"top_k": 40, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.3}
"""The seq_kd cases' sampling filters (TRL's DistillationConfig names): the vocabulary's top 40, nucleus 0.95, min-p,
the penalty on the row's ids so far."""
LORA = {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]}
TOP_K = {"loss_top_k": 50}
"""The JSD (beta 0.5) on the union of the teacher's and the student's 50 most likely tokens, with the tail bucket: at
TP=2 the second rank's slice holds 44 real entries, fewer than k."""
TOP_1 = {"loss_top_k": 1, "loss_add_tail": False}
"""The JSD on the teacher's top token and the sampled one, renormalized; TOP_1_ARGMAX the reverse KL (beta 1) on
the student's top token and the tail."""
TOP_1_ARGMAX = {"loss_top_k": 1, "reverse_kl_top_1_mode": "argmax"}


def write_teacher(root, moe: bool = False):
    """The module docstring's teacher in `root` (`moe`: a Qwen3-MoE, 2 layers of 4 experts, top-2); its path as text."""
    from test_lora_peft import save_random
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=12, max_position_embeddings=64, tie_word_embeddings=False)
    moe_sizes = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    model, config = ((Qwen3MoeForCausalLM, Qwen3MoeConfig(num_hidden_layers=2, **moe_sizes, **common)) if moe
                     else (Qwen3ForCausalLM, Qwen3Config(num_hidden_layers=4, **common)))
    save_random(model, config, root, prepare=lambda model: model.lm_head.weight.mul_(8.0))
    return str(root)


def distill_config(teacher: str, micro: int = 2, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False,
                   virtual: int = 1,
                   moe: bool = False, lora: bool = False, beta: float = DISTILL["beta"], lmbda: float = 0.0,
                   loss: str = "jsd", seq_kd: bool = False, filters: bool = False, top_k: dict | None = None,
                   **train):
    model = tiny_model("llama", SEQ) | {"num_kv_heads": 2, "vocab_size": VOCAB}
    if moe:
        model |= {"num_layers": 2} | MIXTRAL
    sections = {"sft": {"data": ["records.jsonl"]},
                "distill": {"teacher": teacher, **DISTILL, "beta": beta, "lmbda": lmbda, "max_new_tokens": 8,
                            "loss": loss, "seq_kd": seq_kd} | (FILTERS if filters else {}) | (top_k or {})}
    if lora:
        sections["lora"] = LORA
    return layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, virtual=virtual, sections=sections,
                         **{"steps": STEPS, "global_batch_size": WIDE_BATCH if lora or loss != "jsd" else BATCH,
                            "eval_iters": 64, **train})


def on_policy_run(trainer):
    """`shardlm.distill.on_policy` on the synthetic rows: completions of up to 8 tokens, stopped at id 0 (the
    student's, and under seq_kd the teacher's)."""
    from shardlm.distill.on_policy import OnPolicyDistill, samplers, sampling_of

    student, teacher = samplers(trainer, sampling_of(trainer.config.distill), {0})
    return OnPolicyDistill(trainer, student, pad_id=0, teacher_generator=teacher)


def train_distill(ctx: ParallelContext, config) -> dict:
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, train_data(), valid_data())
    assert not any(p.requires_grad for p in trainer.teacher.parameters())
    calls = []  # the teacher's layer forwards on this rank (under pipeline stages its forward is never called)
    for layer in trainer.teacher.layers.values():
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    step = on_policy_run(trainer).train_step if config.distill.lmbda or config.distill.seq_kd else trainer.train_step
    metrics = [step() for _ in range(STEPS)]
    curve = [(m["loss"], m["grad_norm"]) for m in metrics]
    assert all(p.grad is None for p in trainer.teacher.parameters())
    # the parameters before the evaluation: after it an FSDP student's root stays gathered, its plain tensors
    # without the TP marks `stage_parameters` reads
    params = stage_parameters(trainer.model)
    return {"curve": curve, "valid": trainer.evaluate(), "params": params,
            "on_policy": [m.get("on_policy") for m in metrics], "seq_kd": [m.get("seq_kd") for m in metrics],
            "iw_opd": [{k: v for k, v in m.items() if k.startswith("iw_opd/")} for m in metrics],
            "teacher": teacher_memory(trainer, len(calls))}


def teacher_memory(trainer, calls: int) -> dict:
    """What the teacher's parameters hold on this rank after the run: the names of those not (or no longer) FSDP
    DTensors, the bytes of their local parts and of the whole (all, and the layers'), the shard count of the dim 0
    divisible ones (local elements x that == whole), the run's log line and the layers' forward calls."""
    from torch.distributed.tensor import DTensor

    from shardlm.distill.teacher import describe_teacher, local_bytes

    named = list(trainer.teacher.named_parameters())
    layers = [p for n, p in named if n.startswith("layers.")]
    params, dp = [p for _, p in named], trainer.ctx.dp_size
    return {"plain": [n for n, p in named if not isinstance(p, DTensor)], "count": len(named),
            "held": sum(local_bytes(p) for p in params), "full": sum(p.numel() * p.element_size() for p in params),
            "layers_held": sum(local_bytes(p) for p in layers),
            "layers_full": sum(p.numel() * p.element_size() for p in layers), "calls": calls,
            "divisible_shards": {p.numel() // p.to_local().numel() for p in params
                                 if isinstance(p, DTensor) and p.shape[0] % dp == 0},
            "line": describe_teacher(trainer.teacher, "teacher"),
            "ends": sorted({n.split(".")[0] for n, _ in named if not n.startswith("layers.")}),
            "pp_rank": trainer.ctx.pp_rank}


def plain_sum(x, tp):
    """The control's bug: the student's sum of exponentials all-reduced with a plain backward (each rank keeps its
    own gradient)."""
    from shardlm.parallel.mappings import reduce_from_tensor_parallel

    return reduce_from_tensor_parallel(x, tp)


def run_distill(tp: int, pp: int, cp: int, ep: int, teacher: str, broken: bool = False, chunk: int = 0,
                own_support: bool = False, **spec) -> dict:
    from shardlm.distill import loss

    if broken:
        divergence._SharedSum.apply = plain_sum
    loss.CHUNK = chunk or 1 << 22  # (the default: one chunk at these sizes)
    try:
        with own_supports(own_support):
            return train_distill(layout_context(tp, pp, cp, ep),
                                 distill_config(teacher, tp=tp, pp=pp, cp=cp, ep=ep, **spec))
    finally:
        if broken:  # the cases after it in this world use the real one again
            del divergence._SharedSum.apply


WORLD2 = {
    "tp2 sp": ("dense", layout(tp=2, sp=True)),
    "tp2 sp chunks of 5 rows": ("dense", layout(tp=2, sp=True, chunk=5 * 256)),
    "dp2 zero1": ("dense", layout(distributed_optimizer=True)),
    "pp2": ("dense", layout(pp=2, micro=1)),
    "pp2 virtual2": ("dense", layout(pp=2, virtual=2, micro=1)),
    "fsdp dp2": ("dense", layout(data_sharding="full")),
    "cp2": ("dense", layout(cp=2)),
    "ep2 moe": ("moe", layout(ep=2, moe=True)),
    "ep2 moe teacher": ("moe teacher", layout(ep=2, moe=True)),
    "fsdp ep2 moe teacher": ("moe teacher", layout(ep=2, moe=True, data_sharding="full")),
    "fsdp cp2": ("dense", layout(cp=2, data_sharding="full")),
    "lora tp2 sp": ("lora", layout(tp=2, sp=True, lora=True)),
    "control tp2 unsummed": ("forward kl", layout(tp=2, broken=True, beta=0.0)),
    "on-policy tp2 sp": ("on-policy", layout(tp=2, sp=True, lmbda=0.2)),
    "on-policy dp2": ("on-policy", layout(lmbda=0.2)),
    "on-policy fsdp dp2": ("on-policy", layout(lmbda=0.2, data_sharding="full")),
    "on-policy pp2 virtual2": ("on-policy", layout(pp=2, virtual=2, micro=1, lmbda=0.2)),
    "on-policy cp2": ("on-policy", layout(cp=2, lmbda=0.2)),
    "token kl on-policy tp2 sp": ("token kl", layout(tp=2, sp=True, lmbda=1.0, loss="token_kl")),
    "seq kd pp2 virtual2": ("seq kd", layout(pp=2, virtual=2, micro=1, lmbda=0.2, seq_kd=True, filters=True)),
    "seq kd fsdp dp2": ("seq kd", layout(lmbda=0.2, seq_kd=True, data_sharding="full", filters=True)),
    "top-k tp2 sp": ("top k", layout(tp=2, sp=True, top_k=TOP_K)),
    "top-k pp2": ("top k", layout(pp=2, micro=1, top_k=TOP_K)),
    "top-1 on-policy tp2 sp": ("top 1", layout(tp=2, sp=True, lmbda=0.2, top_k=TOP_1)),
    "top-1 argmax reverse kl cp2": ("top 1 argmax", layout(cp=2, beta=1.0, top_k=TOP_1_ARGMAX)),
    "control top-k tp2 own support": ("top k", layout(tp=2, sp=True, top_k=TOP_K, own_support=True)),
}
WORLD4 = {
    "tp2 dp2 sp": ("dense", layout(tp=2, sp=True)),
    "cp2 tp2 sp": ("dense", layout(cp=2, tp=2, sp=True)),
    "pp2 tp2 sp": ("dense", layout(pp=2, tp=2, sp=True, micro=1)),
    "fsdp tp2 dp2 sp": ("dense", layout(tp=2, sp=True, data_sharding="full")),
    "hybrid fsdp dp4 groups of 2": ("dense", layout(micro=1, data_sharding="full", fsdp_shard_size=2)),
    "fsdp pp2 dp2": ("dense", layout(pp=2, micro=1, data_sharding="full")),
    "on-policy cp2 tp2 sp": ("on-policy", layout(cp=2, tp=2, sp=True, lmbda=0.2)),
    "top-k cp2 tp2 sp": ("top k", layout(cp=2, tp=2, sp=True, top_k=TOP_K)),
    "on-policy fsdp pp2 dp2": ("on-policy", layout(pp=2, micro=1, data_sharding="full", lmbda=0.2)),
    "seq kd fsdp pp2 dp2": ("seq kd", layout(pp=2, micro=1, data_sharding="full", lmbda=0.2, seq_kd=True,
                                             filters=True)),
}
REFERENCES = {"dense": {"micro": BATCH}, "moe": {"micro": 2, "moe": True}, "lora": {"micro": WIDE_BATCH, "lora": True},
              "forward kl": {"micro": BATCH, "beta": 0.0}, "on-policy": {"micro": BATCH, "lmbda": 0.2},
              "token kl": {"micro": WIDE_BATCH, "lmbda": 1.0, "loss": "token_kl"},
              "moe teacher": {"micro": 2, "moe": True}, "seq kd": {"micro": BATCH, "lmbda": 0.2, "seq_kd": True,
                                                                        "filters": True},
              "top k": {"micro": BATCH, "top_k": TOP_K}, "top 1": {"micro": BATCH, "lmbda": 0.2, "top_k": TOP_1},
              "top 1 argmax": {"micro": BATCH, "beta": 1.0, "top_k": TOP_1_ARGMAX}}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return write_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def moe_teacher(tmp_path_factory):
    return write_teacher(tmp_path_factory.mktemp("moe-teacher"), moe=True)


def with_teacher(cases: dict, teacher: str, moe_teacher: str) -> dict:
    return {name: (ref, {**spec, "teacher": moe_teacher if "moe teacher" in name else teacher})
            for name, (ref, spec) in cases.items()}


@pytest.fixture(scope="module")
def world2(teacher, moe_teacher):
    return spawn_layouts(2, run_distill, with_teacher(WORLD2, teacher, moe_teacher))


@pytest.fixture(scope="module")
def world4(teacher, moe_teacher):
    return spawn_layouts(4, run_distill, with_teacher(WORLD4, teacher, moe_teacher))


@pytest.fixture(scope="module")
def reference(teacher, moe_teacher):
    return {kind: train_distill(ParallelContext.single(), distill_config(moe_teacher if "moe teacher" in kind
                                                                        else teacher, **spec))
            for kind, spec in REFERENCES.items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in WORLD2 if not n.startswith("control")])
def test_distillation_at_two_ranks_equals_one_process(world2, reference, name):
    for rank, value in enumerate(check_result(world2, name)):
        assert_same_run(value, reference[WORLD2[name][0]], f"{name} rank {rank}", steps=STEPS, tol=TOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(WORLD4))
def test_distillation_at_four_ranks_equals_one_process(world4, reference, name):
    for rank, value in enumerate(check_result(world4, name)):
        assert_same_run(value, reference[WORLD4[name][0]], f"{name} rank {rank}", steps=STEPS, tol=TOL)


TEACHER_SHARDS = {"fsdp dp2": ("world2", {2}), "on-policy fsdp dp2": ("world2", {2}), "fsdp cp2": ("world2", {2}),
                  "fsdp ep2 moe teacher": ("world2", {1, 2}), "fsdp tp2 dp2 sp": ("world4", {2}),
                  "hybrid fsdp dp4 groups of 2": ("world4", {2}), "fsdp pp2 dp2": ("world4", {2}),
                  "dp2 zero1": ("world2", set()), "seq kd fsdp dp2": ("world2", {2}),
                  "seq kd fsdp pp2 dp2": ("world4", {2})}
"""Case: (its world, the shard counts of the teacher's tensors). Under EP=2 of 2 ranks the experts' own FSDP group
(expert-DP) has one rank: they are DTensors of one shard; the hybrid case shards within groups of 2 of its 4 DP
ranks and replicates across them; under pipeline stages the layers and the ends (the root) are sharded too."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(TEACHER_SHARDS))
def test_fsdp_shards_the_teacher(request, name):
    """Under FSDP every teacher parameter is a DTensor again after the run's steps and evaluation (each layer freed
    after its forward, the root after the loss; under pipeline stages after the step's schedule), each rank holding
    1/shards of every tensor's bytes (dim 0 divisible by DP), as the log line says; every rank ran as many teacher
    layers (their all-gathers are collectives). Without FSDP (ZeRO-1) each rank holds the whole teacher."""
    world, shards = TEACHER_SHARDS[name]
    ranks = [value["teacher"] for value in check_result(request.getfixturevalue(world), name)]
    share = max(shards, default=1)
    for rank, held in enumerate(ranks):
        gathered = held["plain"]
        assert len(gathered) == (0 if shards else held["count"]), \
            f"{name} rank {rank}: {len(gathered)} gathered, as {gathered[:3]}"
        assert held["divisible_shards"] == shards, f"{name} rank {rank}"
        if len(shards) < 2:  # one shard count for all: the rank holds that share of the bytes
            assert held["layers_held"] * share == held["layers_full"], f"{name} rank {rank}"
            assert held["held"] * share == held["full"], f"{name} rank {rank}"
        assert f"{held['held'] / 2**20:,.1f} MiB of frozen weights on this rank" in held["line"], held["line"]
        assert held["calls"] == ranks[0]["calls"] > 0, f"{name}: teacher layers run {[r['calls'] for r in ranks]}"


@pytest.mark.parametrize("name", ["pp2", "pp2 virtual2", "fsdp pp2 dp2"])
def test_under_pipeline_stages_the_teacher_keeps_its_stages_ends_only(request, name):
    """The first stage's rank holds the teacher's embedding, the last stage's its final norm and output layer
    (interleaved: rank 0 runs stages 0 and 2 of 4, rank 1 stages 1 and 3); neither holds the other's."""
    world = "world4" if name == "fsdp pp2 dp2" else "world2"
    for rank, value in enumerate(check_result(request.getfixturevalue(world), name)):
        first = value["teacher"]["pp_rank"] == 0
        assert value["teacher"]["ends"] == (["wte"] if first else ["lm_head", "ln_f"]), (name, rank, value["teacher"])


@pytest.mark.timeout(600)
def test_the_students_normalizer_must_sum_its_gradient_over_tp(world2, reference):
    for value in check_result(world2, "control tp2 unsummed"):
        assert_trained_but_off(value["curve"], value["params"], reference["forward kl"]["params"], STEPS, "layers.")


def test_the_top_k_support_is_drawn_over_every_tp_rank(world2, reference):
    """The control: each TP rank's support from its own slice (the ranks then sum divergences of different
    supports) trains, and ends off one process."""
    for value in check_result(world2, "control top-k tp2 own support"):
        assert_trained_but_off(value["curve"], value["params"], reference["top k"]["params"], STEPS, "layers.")


def test_the_run_learns_the_teachers_distributions(reference):
    """The divergence falls over the steps (the teacher's distributions are far from the student's at the start)."""
    curve = reference["dense"]["curve"]
    assert curve[0][0] > 0.05 and curve[-1][0] < curve[0][0]


@pytest.mark.parametrize("loss", ["jsd", "iw_opd"])
def test_a_packed_row_equals_its_documents_alone(teacher, loss):
    """One packed row of several conversations: its divergences, summed over its answer tokens, and the student's
    gradients equal each conversation's computed alone (its own row), summed; IW-OPD's too (each conversation's
    weights from its own sums)."""
    config = distill_config(teacher, micro=1, loss=loss, lmbda=float(loss == "iw_opd"))
    validate(config, 1, check_paths=False)
    trainer = Trainer(config, ParallelContext.single(), train_data())
    model, loss = trainer.model, trainer.loss
    row = next(r for r in (train_data()[i] for i in range(8)) if (r["position_ids"] == 0).sum() >= 3)
    from shardlm.models.documents import Documents

    def batch_of(inputs, labels, positions):
        return {"inputs": torch.from_numpy(inputs)[None], "targets": torch.from_numpy(labels)[None],
                "documents": Documents.from_positions(torch.from_numpy(positions)[None]), "divisor": 1.0}

    packed = loss(model, batch_of(row["input_ids"], row["labels"], row["position_ids"]))
    packed_grads = torch.autograd.grad(packed, [p for p in model.parameters() if p.requires_grad])
    starts = [*np.flatnonzero(row["position_ids"] == 0), len(row["position_ids"])]
    alone, alone_grads = 0.0, None
    for lo, hi in zip(starts[:-1], starts[1:]):
        if (row["labels"][lo:hi] == -100).all():
            continue
        value = loss(model, batch_of(row["input_ids"][lo:hi], row["labels"][lo:hi], row["position_ids"][lo:hi]))
        grads = torch.autograd.grad(value, [p for p in model.parameters() if p.requires_grad])
        alone = alone + value
        alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]
    assert abs(packed.item() - alone.item()) <= TOL * abs(alone.item())
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(packed_grads, alone_grads))


def test_on_policy_steps_train_on_the_students_completions(reference):
    """Each step is on-policy with probability lambda, drawn from the seed and the step as the module says; the first
    on-policy step's loss differs from the offline run's at that step (its tokens are the student's samples, not
    the records' answers), the steps before it are the offline run's bitwise."""
    on_policy, offline = reference["on-policy"], reference["dense"]
    kinds = on_policy["on_policy"]
    seed = distill_config("unused").train.seed
    assert kinds == [float(np.random.default_rng([seed, step, 4639]).random() < 0.2) for step in range(STEPS)]
    assert kinds == [1.0, 1.0, 0.0]  # both kinds, at this seed
    first = kinds.index(1.0)
    assert on_policy["curve"][:first] == offline["curve"][:first]
    assert abs(on_policy["curve"][first][0] - offline["curve"][first][0]) > 1e-4 * offline["curve"][first][0]


def test_seq_kd_steps_train_on_the_teachers_completions(reference, teacher):
    """Under seq_kd the steps that are not on-policy (step 3 at this seed) train on the teacher's completions of
    the same prompts: without the sampling filters the on-policy steps before it are the on-policy run's bitwise,
    step 3's loss is not (that run's step 3 is on the records' answers); with them (the layouts' runs) every step
    samples other tokens."""
    seq_kd, on_policy = reference["seq kd"], reference["on-policy"]
    assert seq_kd["on_policy"] == [1.0, 1.0, 0.0] and seq_kd["seq_kd"] == [0.0, 0.0, 1.0]
    plain = train_distill(ParallelContext.single(), distill_config(teacher, micro=BATCH, lmbda=0.2, seq_kd=True))
    assert plain["curve"][:2] == on_policy["curve"][:2]  # (the filters off: the on-policy run's samples)
    assert abs(plain["curve"][2][0] - on_policy["curve"][2][0]) > 1e-4 * on_policy["curve"][2][0]
    # the control: the sampling filters reach both samplers (another loss from step 1)
    assert all(abs(a[0] - b[0]) > 1e-4 * b[0] for a, b in zip(seq_kd["curve"], plain["curve"]))


def test_the_teachers_sampler_decodes_the_teacher(teacher):
    """The seq_kd sampler at temperature 0 (argmax) completes prompts as transformers' greedy `generate` of the
    teacher's directory does: the teacher's tokens, not the student's (which differ)."""
    from transformers import AutoModelForCausalLM

    from shardlm.distill.on_policy import samplers
    from shardlm.eval.generate import SamplingConfig

    config = distill_config(teacher, seq_kd=True)
    validate(config, 1, check_paths=False)
    trainer = Trainer(config, ParallelContext.single(), train_data())
    student, sampler = samplers(trainer, SamplingConfig(max_new_tokens=6, temperature=0.0), set())
    prompts = [[5, 17, 42, 8], [3, 99, 12, 61, 7, 30]]
    ours = [r.completion for r in sampler.generate(prompts, [0, 1])]
    hf = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    for prompt, completion in zip(prompts, ours):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert completion == expected, (prompt, completion, expected)
    assert [r.completion for r in student.generate(prompts, [0, 1])] != ours


def test_the_prompt_is_cut_before_the_last_answer():
    from shardlm.distill.on_policy import last_answer_prompt

    row = {"input_ids": np.arange(10), "labels": np.array([-100, -100, 3, 4, -100, -100, 7, 8, 9, -100])}
    assert last_answer_prompt(row, 0, 10) == [0, 1, 2, 3, 4, 5, 6]  # position 6 predicts the last answer's first
    assert last_answer_prompt(row, 0, 2) is None


def test_token_kl_is_the_reverse_kl_of_the_sampled_tokens():
    """`token_reverse_kl` at one rank against its definition computed directly: values log p_s(x) - log p_t(x),
    gradient (log p_s(x) - log p_t(x)) grad log p_s(x), with temperature 2."""
    from shardlm.distill.divergence import token_reverse_kl

    ctx = ParallelContext.single()
    generator = torch.Generator().manual_seed(0)
    student = (torch.randn(6, 13, generator=generator) * 3).requires_grad_()
    teacher = torch.randn(6, 13, generator=generator) * 3
    targets = torch.randint(0, 11, (6,), generator=generator)  # the last 2 of 13 columns are padding
    value = token_reverse_kl(student, teacher, targets, ctx.tp, 11, temperature=2.0)
    s = torch.log_softmax(student[:, :11] / 2.0, dim=-1)
    t = torch.log_softmax(teacher[:, :11] / 2.0, dim=-1)
    rows = torch.arange(6)
    kl = (s[rows, targets] - t[rows, targets]).detach()
    assert torch.allclose(value, kl, rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(value.sum(), student)
    (expected,) = torch.autograd.grad((kl * s[rows, targets]).sum(), student)
    assert torch.allclose(grad, expected, rtol=0, atol=1e-6) and grad[:, 11:].abs().max() == 0
