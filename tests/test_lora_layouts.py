"""LoRA adapters train the same adapters at every layout as on one process.

Data and model: the packed SFT rows of `test_sft_layouts` (conversations of 4-24 tokens in rows of 32,
prompts not trained), a 4-layer GPT (fused qkv, tied embedding) or Llama (grouped-query attention); adapters
of rank 4 on every attention and MLP projection (`lora.targets = ["all-linear"]`), alpha 8, dropout 0. The base
is random (seeded), the adapters' A drawn as peft draws it and B zero, so step 1 moves B only and later steps both.

Checks, each against one process within 1e-5 (fp32: 4 steps' losses and gradient norms, the validation loss, and
every parameter on every rank - adapters trained, the base bitwise unchanged from its start):
- world 2: TP=2 with SP (GPT; Llama with its 2 KV heads split; Llama with 1 KV head, replicated on both ranks,
  whose k/v adapters are "replicated rows"; Llama with the output layer and final norm trained in full,
  `modules_to_save`), PP=2 x 2 virtual stages (Llama; GPT with its tied embedding trained in full, so both
  stages' copies get the summed gradient), CP=2 (Llama), DP=2 (GPT), FSDP DP=2 (Llama: frozen and trainable
  parameters sharded in one module); MoE at EP=2, TP=2 with SP; MLA at TP=2, TP=2 with SP, CP=2; adapter dropout
  0.1 at TP=2 with SP, against one process whose row adapters draw their masks as TP=2's ranks do (the documented
  rule: each rank's model-parallel generator; a plain one-process run ends more than 1e-3 off); DeepSeek-V3
  routing at EP=2 with its expert biases started non-zero and kept bitwise (a LoRA run's router is frozen); the
  Qwen3-Next / Qwen3.5 hybrid (Gated DeltaNet and gated full attention) at TP=2 with SP with q and k adapted too,
  its parameters within `HYBRID_TOL` (2e-5; why there);
- world 4: TP=2 x DP=2 with SP and the distributed optimizer (ZeRO-1), PP=2 x DP=2 (GPT), CP=2 x TP=2 with SP;
- the control: TP=2 with SP with the adapters' replicated factors no longer summed over TP (column layers' A,
  row layers' B) trains, and ends more than 1e-3 away;
- one process: selective and full recomputation are bitwise the plain run; the frozen base has no gradient and
  no optimizer state, and the run counts what it trains.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_linear_attention_layouts import hybrid_sft_config
from test_moe_parallel import ROUTING, stage_parameters
from test_sft_layouts import SEQ, train_data, valid_data

from shardlm.lora import LoRA, count_parameters
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_same_run, assert_trained_but_off
from layouts import MLA, counting, layout, layout_config, layout_context, selected_cases, spawn_layouts, tiny_model
from multiproc import check_result

STEPS, TOL, SCHEDULE = 4, 1e-5, 4
"""The runs train STEPS steps (B alone moves in the first, A and B in the later ones) of a SCHEDULE-step run
(`lora_config`'s default, which `test_lora_checkpoint` and `test_lora_qlora` build too). Not fewer: the adapters' B
start at zero, and the less they have moved the nearer the layouts' rounding comes to 1e-5 of them (`trained_rel`):
after 2 steps 1.4e-5, after 3 steps 1.27e-5 with PyTorch's plain (`ATEN_CPU_CAPABILITY=default`) kernels at CP=2 x
TP=2."""
LORA = {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]}


def lora_config(arch: str = "gpt", micro: int = 2, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                sp: bool = False, virtual: int = 1, kv_heads: int = 2, save: tuple = (), moe: bool = False,
                mla: bool = False, lora: dict | None = None, routing: str = "mixtral", hybrid: bool = False, **train):
    if hybrid:  # Gated DeltaNet and gated full attention (`test_linear_attention.HYBRID`), every projection adapted
        config = hybrid_sft_config(lora=LORA["rank"], micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, **train)
        config.lora.alpha, config.lora.targets = LORA["alpha"], LORA["targets"]
        return config
    model = tiny_model(arch, SEQ)
    if arch == "llama":
        model["num_kv_heads"] = kv_heads
    if mla:  # DeepSeek-V3's latent attention: adapters on q_a, q_b, kv_a, kv_b and o
        model |= MLA
        del model["num_kv_heads"]
    if moe:  # a Mixtral-shaped model: 4 experts top-2 on every layer, adapters on the experts too (Qwen3-MoE's q/k
        # norms, which `test_lora_peft` covers, make some adapter gradients cancel to rounding noise: 1e-5 would then
        # measure the CPU kernels' summation order, as on AVX2 it does)
        model |= {"num_layers": 2, **ROUTING[routing]}
        lora = {"targets": ["all-linear", "experts"], **(lora or {})}
    sections = {"data": {"text_file": "unused"}, "lora": {**LORA, "modules_to_save": list(save), **(lora or {})}}
    return layout_config(model, micro=micro, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, virtual=virtual,
                         sections=sections, **{"steps": SCHEDULE, "eval_iters": 64, **train})


def unsum_replicated_factors(model) -> None:
    """The control's bug: the adapters' replicated factors keep each rank's partial gradient."""
    for module in model.modules():
        if isinstance(module, LoRA):
            for param in (module.A, module.B):
                if getattr(param, "sequence_parallel", False):
                    del param.sequence_parallel


def start_expert_biases(trainer) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing as a base would bring it: every expert bias non-zero."""
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if name.endswith("router.expert_bias"):
                param.copy_(torch.linspace(-0.2, 0.2, param.numel()))


def draw_row_masks_as_tp2(trainer) -> None:
    """One process drawing its row adapters' dropout masks as TP=2 does by the documented rule
    (`shardlm.parallel.random`): rank r's half of the input columns from rank r's model-parallel generator,
    seeded seed + 2718 + r, in the order the adapters run. Column adapters keep the default generator."""
    seed = trainer.config.train.seed
    states = [torch.Generator().manual_seed(seed + 2718 + rank).get_state() for rank in range(2)]

    def dropped_for(adapter: LoRA):
        def dropped(x: torch.Tensor) -> torch.Tensor:
            if not (adapter.training and adapter.dropout > 0):
                return x
            halves = []
            for rank, half in enumerate(x.chunk(2, dim=-1)):
                outside = torch.get_rng_state()
                torch.set_rng_state(states[rank])
                try:
                    halves.append(F.dropout(half.contiguous(), adapter.dropout, True))
                finally:
                    states[rank] = torch.get_rng_state()
                    torch.set_rng_state(outside)
            return torch.cat(halves, dim=-1)
        return dropped

    rows = [module for module in trainer.model.modules() if isinstance(module, LoRA) and module.kind == "row"]
    assert rows
    for adapter in rows:
        adapter._dropped = dropped_for(adapter)


PREPARE = {"expert bias": start_expert_biases, "tp2 row masks": draw_row_masks_as_tp2}


def train_layout(ctx: ParallelContext, config, broken: bool = False, prepare: str | None = None) -> dict:
    """Curve (loss, gradient norm) of STEPS steps, the validation loss, every parameter (all stages) before and
    after, and which of them trained. `prepare`: a `PREPARE` step run on the trainer before the first step."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, train_data(), valid_data())
    if broken:
        unsum_replicated_factors(trainer.model)
    if prepare:
        PREPARE[prepare](trainer)
    start = stage_parameters(trainer.model)
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
    trained = sorted({n for n, p in trainer.model.named_parameters() if p.requires_grad})
    return {"curve": curve, "valid": trainer.evaluate(), "start": start, "params": stage_parameters(trainer.model),
            "trained": ctx.world.all_gather_object(trained), "count": count_parameters(trainer.model, ctx)}


def run_layout(tp: int, pp: int, cp: int, ep: int, broken: bool = False, prepare: str | None = None,
               **config) -> dict:
    config = lora_config(tp=tp, pp=pp, cp=cp, ep=ep, **config)
    return train_layout(layout_context(tp, pp, cp, ep), config, broken, prepare)


WORLD2 = {  # name: (the one-process reference it equals, the layout)
    "tp2 sp gpt": ("gpt", layout(tp=2, sp=True)),
    "tp2 sp llama": ("llama", layout(tp=2, sp=True, arch="llama")),
    "tp2 sp llama kv1": ("llama kv1", layout(tp=2, sp=True, arch="llama", kv_heads=1)),
    "tp2 sp llama save output norm": ("llama save", layout(tp=2, sp=True, arch="llama", save=("output", "norm"))),
    "pp2 virtual2 llama": ("llama", layout(pp=2, virtual=2, micro=1, arch="llama")),
    "pp2 virtual2 gpt save embedding": ("gpt save", layout(pp=2, virtual=2, micro=1, save=("embedding",))),
    "cp2 llama": ("llama", layout(cp=2, arch="llama")),
    "dp2 gpt": ("gpt", layout()),
    "fsdp dp2 llama": ("llama", layout(arch="llama", data_sharding="full")),
    "ep2 moe": ("moe", layout(arch="llama", moe=True, ep=2)),
    "tp2 sp moe": ("moe", layout(arch="llama", moe=True, tp=2, sp=True)),
    "tp2 sp mla": ("mla", layout(arch="llama", mla=True, tp=2, sp=True)),
    "tp2 mla": ("mla", layout(arch="llama", mla=True, tp=2)),
    "cp2 mla": ("mla", layout(arch="llama", mla=True, cp=2)),
    "tp2 sp llama dropout": ("llama dropout", layout(tp=2, sp=True, arch="llama", lora={"dropout": 0.1})),
    "ep2 moe expert bias": ("moe bias", layout(arch="llama", moe=True, ep=2, routing="deepseek",
                                               prepare="expert bias")),
}
HYBRID = {"tp2 sp hybrid": ("hybrid", layout(tp=2, sp=True, hybrid=True))}
CONTROL = {"control tp2 sp llama unsummed": ("llama", layout(tp=2, sp=True, arch="llama", broken=True))}
WORLD4 = {
    "zero tp2 dp2 sp llama": ("llama", layout(tp=2, sp=True, arch="llama", distributed_optimizer=True)),
    "pp2 dp2 gpt": ("gpt", layout(pp=2, micro=1)),
    "cp2 tp2 sp llama": ("llama", layout(cp=2, tp=2, sp=True, arch="llama")),
    "ep2 tp2 sp moe": ("moe", layout(arch="llama", moe=True, ep=2, tp=2, sp=True)),
    "fsdp ep2 dp4 moe": ("moe", layout(arch="llama", moe=True, ep=2, data_sharding="full")),
}
REFERENCES = {"gpt": {}, "llama": {"arch": "llama"}, "llama kv1": {"arch": "llama", "kv_heads": 1},
              "llama save": {"arch": "llama", "save": ("output", "norm")}, "gpt save": {"save": ("embedding",)},
              "moe": {"arch": "llama", "moe": True, "micro": 2}, "mla": {"arch": "llama", "mla": True},
              "llama dropout": {"arch": "llama", "micro": 2, "lora": {"dropout": 0.1}, "prepare": "tp2 row masks"},
              "moe bias": {"arch": "llama", "moe": True, "micro": 2, "routing": "deepseek", "prepare": "expert bias"},
              "hybrid": {"hybrid": True}}


@pytest.fixture(scope="module")
def world2(request):
    return spawn_layouts(2, run_layout, selected_cases(request, WORLD2 | CONTROL | HYBRID))


@pytest.fixture(scope="module")
def world4(request):
    return spawn_layouts(4, run_layout, selected_cases(request, WORLD4))


@pytest.fixture(scope="module")
def reference(request):
    """One process for each model kind the selected cases compare with, at micro-batch 8 (one micro-batch per step);
    the MoE at the layouts' micro-batch 2, since its load-balancing loss is a function of each micro-batch's
    routing."""
    ctx = ParallelContext.single()
    kinds = {case[0] for case in selected_cases(request, WORLD2 | WORLD4 | HYBRID | CONTROL).values()}
    return {kind: train_layout(ctx, lora_config(**({"micro": 8} | without(spec, "prepare"))),
                               prepare=spec.get("prepare")) for kind, spec in REFERENCES.items() if kind in kinds}


def without(spec: dict, key: str) -> dict:
    return {k: v for k, v in spec.items() if k != key}


def assert_matches(value: dict, ref: dict, where: str, tol: float = TOL) -> None:
    """The run equals one process (`assert_same_run`: curve and validation within TOL, parameters within `tol`),
    counts what it trains as one process does, and leaves the frozen base bitwise where it started."""
    assert_same_run(value, ref, where, steps=STEPS, tol=TOL, params_tol=tol)
    assert (value["count"].trainable, value["count"].total) == (ref["count"].trainable, ref["count"].total), where
    frozen = [n for n in value["params"] if ".lora." not in n and not any(n in t for t in value["trained"])]
    assert frozen and all(torch.equal(value["params"][n], value["start"][n]) for n in frozen), f"{where}: base moved"


@pytest.mark.parametrize("name", list(WORLD2))
def test_lora_at_two_ranks_equals_one_process(world2, reference, name):
    for rank, value in enumerate(check_result(world2, name)):
        assert_matches(value, reference[WORLD2[name][0]], f"{name} rank {rank}")


@pytest.mark.parametrize("name", list(WORLD4))
def test_lora_at_four_ranks_equals_one_process(world4, reference, name):
    for rank, value in enumerate(check_result(world4, name)):
        assert_matches(value, reference[WORLD4[name][0]], f"{name} rank {rank}")


HYBRID_TOL = 2e-5
"""The hybrid's final parameters: its q and k adapters feed L2 norms (Gated DeltaNet) and RMS norms (gated
attention's q/k norms), whose backward removes the gradient's part along the normed vector, so some of those
adapters' gradient elements cancel to rounding noise that AdamW still moves by a whole step. Measured worst
(`trained_rel`, layers.2.attn.k.lora.B or the MLP's): 3.9e-6 with AVX-512 kernels, 1.9e-6 with
ATEN_CPU_CAPABILITY=avx2; the bound leaves 5x for other CPUs' summation orders. A real error (a missing TP sum,
a wrong shard) is 1e-3 or more."""


@pytest.mark.timeout(600)
def test_hybrid_lora_with_q_and_k_at_two_ranks_equals_one_process(world2, reference):
    """Qwen3-Next / Qwen3.5's Gated DeltaNet and gated full attention with adapters on every projection, q and k
    of both kinds of layer included: TP=2 with SP equals one process (losses, gradient norms, validation within
    1e-5; parameters within `HYBRID_TOL`)."""
    ref = reference["hybrid"]
    # layers 0 and 2 are Gated DeltaNet, 1 and 3 gated full attention: q and k adapted in each
    assert {f"layers.{i}.attn.{p}.lora.{f}" for i in range(4) for p in "qk" for f in "AB"} <= ref["params"].keys()
    for rank, value in enumerate(check_result(world2, "tp2 sp hybrid")):
        assert_matches(value, ref, f"tp2 sp hybrid rank {rank}", HYBRID_TOL)


@pytest.mark.timeout(600)
def test_dropout_at_tp2_is_the_documented_masks(world2, reference):
    """Adapter dropout 0.1 at TP=2 with SP equals one process (within 1e-5) whose row adapters (o, down) draw
    rank r's half of their input columns from rank r's model-parallel generator, as TP=2 does; its column adapters
    (q, k, v, gate, up) draw from the default generator as TP=2's do, the same mask on both ranks. A plain
    one-process run cannot be equal: its row adapters draw one mask over all columns from one generator. The TP=2
    run trains and ends more than 1e-3 off that plain run."""
    plain = train_layout(ParallelContext.single(), lora_config(arch="llama", micro=2, lora={"dropout": 0.1}))
    for value in check_result(world2, "tp2 sp llama dropout"):
        assert_trained_but_off(value["curve"], value["params"], plain["params"], STEPS, ".lora.")


@pytest.mark.timeout(600)
def test_lora_keeps_the_expert_biases_of_aux_loss_free_routing(world2, reference):
    """DeepSeek-V3's routing (sigmoid scores, groups, a shared expert, expert biases moved after each step in full
    training) with adapters on every projection and expert: the biases, started non-zero, stay bitwise as they
    started on every rank and in one process (a LoRA run's router is the frozen base's), and EP=2 equals one
    process within 1e-5 (`test_lora_at_two_ranks_equals_one_process`)."""
    ref = reference["moe bias"]
    biases = [n for n in ref["params"] if n.endswith("router.expert_bias")]
    assert biases and all(ref["start"][n].abs().min() > 0 for n in biases)
    for value in [ref, *check_result(world2, "ep2 moe expert bias")]:
        moved = [n for n in biases if not torch.equal(value["params"][n], value["start"][n])]
        assert not moved, f"expert biases moved in a LoRA run: {moved}"
        assert all(torch.equal(value["start"][n], ref["start"][n]) for n in biases)
        assert not any(n in trained for n in biases for trained in value["trained"])


def test_unsummed_replicated_factors_fail(world2, reference):
    """Without the TP sum of the replicated factors' gradients the run trains, and ends off one process."""
    ref = reference["llama"]
    for value in check_result(world2, "control tp2 sp llama unsummed"):
        assert_trained_but_off(value["curve"], value["params"], ref["params"], STEPS, ".lora.")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_is_bitwise(monkeypatch, mode):
    """Recomputed layers (adapter dropout 0.1 on) give the plain run's curve and parameters bitwise: the rerun
    draws the same adapter dropout masks. The rerun happened: every attention core runs once more per layer and
    micro-batch, and with full recomputation every adapter too."""
    from shardlm.models.llama import LlamaAttention

    calls = {"core": 0, "adapter": 0}
    monkeypatch.setattr(LlamaAttention, "core", counting(LlamaAttention.core, calls, "core"))
    monkeypatch.setattr(LoRA, "forward", counting(LoRA.forward, calls, "adapter"))
    runs, counts = {}, {}
    for r in ("none", mode):
        calls.update(core=0, adapter=0)
        runs[r] = train_layout(ParallelContext.single(), lora_config(arch="llama", micro=4, recompute=r,
                                                                     lora={"dropout": 0.1}))
        counts[r] = dict(calls)
    reruns = STEPS * 2 * 4  # steps x micro-batches x layers
    assert counts[mode]["core"] - counts["none"]["core"] == reruns
    assert counts[mode]["adapter"] - counts["none"]["adapter"] == (reruns * 7 if mode == "full" else 0)
    assert runs[mode]["curve"] == runs["none"]["curve"] and runs[mode]["valid"] == runs["none"]["valid"]
    assert all(torch.equal(runs[mode]["params"][n], p) for n, p in runs["none"]["params"].items())


def test_the_base_has_no_gradient_and_no_optimizer_state():
    """Only the adapters require gradients and own AdamW moments; the run counts them (the vocabulary's padding
    left out): 4 layers x (q, k, v, o, gate, up, down) adapters of rank 4."""
    trainer = Trainer(lora_config(arch="llama", micro=8), ParallelContext.single(), train_data())
    trainer.train_step()
    named = dict(trainer.model.named_parameters())
    adapters = {n for n, p in named.items() if p.requires_grad}
    assert adapters == {n for n in named if ".lora." in n}
    assert {id(p) for p in trainer.optimizer.state} == {id(named[n]) for n in adapters}
    cfg = trainer.config.model
    h, f, kv = cfg.hidden_size, cfg.ffn_size, cfg.kv_heads * cfg.attention_head_dim
    per_layer = 4 * sum(i + o for i, o in [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)])
    count = count_parameters(trainer.model, ParallelContext.single())
    assert count.trainable == cfg.num_layers * per_layer
    assert count.total == count.trainable + sum(p.numel() for n, p in named.items() if n not in adapters) - (
        trainer.model.padded_vocab_size - cfg.vocab_size) * h * (1 + (not cfg.tie_embeddings))
