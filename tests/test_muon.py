"""Muon (`train.optimizer = "muon"`): equal to torch.optim.Muon on one process, and every layout equal to one process.

- The Newton-Schulz iteration in bf16 is bitwise `torch.optim.Muon`'s, wide and tall matrices.
- The Muon / AdamW split is the test's own, by parameter name (`split_by_name`): on one process shardlm's optimizer
  takes exactly it, and in every layout each rank's Muon optimizers hold exactly the test's matrices, each once.
- One process: a 4-layer Llama, a DeepSeek-V3-shaped MLA model, a Qwen3-MoE-shaped model (QK-norm, experts:
  torch.optim.Muon steps each expert's matrix as a parameter of its own) and GPT (its fused qkv cut by its
  (heads, 3, head_dim) rows into q, k, v; each head's q, k, v; or whole), 4 steps of shardlm's trainer with Muon
  (bf16 Newton-Schulz, "original" and "match_rms_adamw" scales) against the same trainer stepping
  `torch.optim.Muon` over the test's matrices and `torch.optim.AdamW` over the rest: losses and every parameter
  within 1e-6 (no clipping, constant learning rate, weight decay 0.01 on both).
- Layouts (fp32 Newton-Schulz, so only the layout's fp32 rounding differs): TP=2 with SP (GPT, whose fused qkv is
  orthogonalized as its q, k and v parts; Llama with grouped-query attention), PP=2, CP=2 and DP=2 equal one
  process within 1e-5 (4 steps' losses and gradient norms, every parameter on every rank).
- EP=2 and EP=2 x TP=2 with SP (each expert's matrices on their own), and LoRA runs whose adapters' A and B Muon
  trains (TP=2 with SP; EP=2 x TP=2 with expert adapters), equal one process within 1e-5 too.
- ZeRO-1 and FSDP (DP=2: Llama, LoRA under FSDP, EP=2 MoE; DP=2 x TP=2 with SP) equal one process, each DP rank
  orthogonalizing its matrices i mod d, each step one all-gather and one reduce-scatter per data group whose bytes
  the matrices' sizes (summed by the test) bound; a ZeRO-1 save resumed under FSDP; bf16 parameters' fp32 masters
  step bitwise as torch.optim.Muon.
- Controls: TP=2 with each rank orthogonalizing its shard alone, and FSDP at DP=2 with each rank its own rows,
  end more than 1e-3 off.
- A resumed run continues bitwise (Muon's momentum is in the checkpoint); resuming it with AdamW is one line.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_moe_parallel import stage_parameters
from test_training import VOCAB

from shardlm.checkpoint import load_checkpoint, save_checkpoint
from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.muon import Muon, MuonWithAdamW, is_muon_matrix, newton_schulz
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import assert_every_rank, assert_trained_but_off
from layouts import MIXTRAL, layout, layout_context, spawn_layouts
from layouts import MLA as LAYOUT_MLA
from multiproc import check_result, disturb_generators

SEQ, STEPS, TOL = 16, 4, 1e-5
MLA = LAYOUT_MLA | {"v_head_dim": 8}  # values narrower than keys


def muon_config(arch: str = "llama", tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False,
                micro: int = 2, mla: bool = False, moe: bool = False, lora: bool = False, **train):
    model = {"arch": arch, "num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": SEQ, "vocab_size": VOCAB,
             "dropout": 0.0}
    if arch == "llama" and not mla:
        model["num_kv_heads"] = 2
    if mla:
        model |= MLA
    if moe:  # Mixtral-shaped: 4 experts top-2 on both layers, each expert's matrices orthogonalized on their own
        model |= {"num_layers": 2, **MIXTRAL}
    return from_dict({
        "model": model,
        "parallel": {"tensor": tp, "pipeline": pp, "context": cp, "expert": ep, "sequence_parallel": sp},
        "data": {"text_file": "unused"},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear", *(["experts"] if moe else [])]} if lora else {},
        "train": {"precision": "fp32", "micro_batch_size": micro, "global_batch_size": 8, "steps": STEPS, "lr": 2e-2,
                  "warmup_steps": 0,
                  "decay_style": "constant", "clip_grad": 0.0, "weight_decay": 0.01, "adam_eps": 1e-6, "seed": 5,
                  "optimizer": "muon", "eval_iters": 4, **train},
    })


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (SEQ + 1,), generator=generator).numpy() for _ in range(8 * 8)]


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (64, 64)])
def test_newton_schulz_is_torch_muons(shape):
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

    update = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    theirs = _zeropower_via_newtonschulz(update, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS)
    assert torch.equal(newton_schulz(update), theirs)


MUON_NAMES = re.compile(r"layers\.\d+\.(attn\.(q|k|v|o|qkv|proj|q_a|q_b|kv_a|kv_b)\.weight"
                        r"|mlp\.(gate|up|down|fc|proj)\.weight|mlp\.experts\.(gate|up|down)|.+\.lora\.[AB]\w*)")
"""The hidden matrices Muon takes, by name: the attention's projections (Llama's q, k, v, o; GPT's qkv and proj;
MLA's q_a, q_b, kv_a, kv_b), the MLP's (gate, up, down; GPT's fc and proj), MoE experts' stacks, LoRA's factors."""
ADAMW_NAMES = re.compile(r"wte\.weight|wpe|lm_head\.weight|ln_f\.(weight|bias)"
                         r"|layers\.\d+\.(ln_[12]\.(weight|bias)|attn\.\w+_norm\.weight|mlp\.router\.weight|.+\.bias)")
"""What AdamW takes, by name: the embeddings (wte, GPT's wpe), the output head, the norms, the biases, routers."""


def split_by_name(model: torch.nn.Module) -> tuple[dict, dict]:
    """The test's own Muon / AdamW split of `model`'s trainable parameters ({name: parameter} each), written from
    the names alone (`MUON_NAMES`, `ADAMW_NAMES`): every trainable parameter must match exactly one side."""
    muon, adamw = {}, {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            hidden, rest = MUON_NAMES.fullmatch(name), ADAMW_NAMES.fullmatch(name)
            assert bool(hidden) != bool(rest), f"{name}: the test's split names it {'twice' if hidden else 'nowhere'}"
            (muon if hidden else adamw)[name] = param
    return muon, adamw


def torch_muon_matrices(name: str, param: torch.Tensor, heads: int, split: str) -> list[tuple[tuple, tuple]]:
    """How torch.optim.Muon sees one Muon parameter: a list of (view shape, index), each `param.view(shape)[index]`
    one matrix. A stack of experts (E, rows, cols) is E matrices; GPT's fused qkv, rows (heads, 3, head_dim), is
    its q, k and v ("parts"), each head's q, k and v ("heads"), or one matrix ("whole")."""
    if param.ndim == 3:
        return [(tuple(param.shape), (e,)) for e in range(param.shape[0])]
    rows, cols = param.shape
    view = (heads, 3, rows // (3 * heads), cols)
    if not name.endswith("attn.qkv.weight") or split == "whole":
        return [((rows, cols), ())]
    if split == "parts":
        return [(view, (slice(None), part)) for part in range(3)]
    return [(view, (head, part)) for part in range(3) for head in range(heads)]


class TorchMuonAndAdamW:
    """The reference optimizer: torch.optim.Muon over the test's Muon matrices (`split_by_name`), cut as
    `torch_muon_matrices` says, torch.optim.AdamW over the rest. Each matrix torch.optim.Muon steps is a parameter
    of its own, whose value and gradient are its slice of the model's parameter before the step and whose value
    goes back after it."""

    def __init__(self, trainer: Trainer, adjust: str):
        t, heads = trainer.config.train, trainer.config.model.num_heads
        muon, rest = split_by_name(trainer.model)
        self.matrices = [(p, shape, index, torch.nn.Parameter(p.detach().view(shape)[index].reshape(-1, p.shape[-1])))
                         for name, p in muon.items() for shape, index in torch_muon_matrices(name, p, heads,
                                                                                             t.muon_split)]
        self.muon = torch.optim.Muon([m for *_, m in self.matrices], lr=t.lr, weight_decay=t.weight_decay,
                                     momentum=t.muon_momentum, adjust_lr_fn=adjust)
        self.adamw = torch.optim.AdamW([{"params": [p for p in rest.values() if p.ndim >= 2],
                                         "weight_decay": t.weight_decay},
                                        {"params": [p for p in rest.values() if p.ndim < 2], "weight_decay": 0.0}],
                                       lr=t.lr, eps=t.adam_eps, betas=(t.adam_beta1, t.adam_beta2), fused=True)
        self.param_groups, self.state, self.defaults = self.muon.param_groups + self.adamw.param_groups, {}, {}

    @torch.no_grad()
    def step(self):
        for param, shape, index, matrix in self.matrices:
            matrix.copy_(param.view(shape)[index].reshape(matrix.shape))
            matrix.grad = param.grad.view(shape)[index].reshape(matrix.shape).clone()
        self.muon.step()
        for param, shape, index, matrix in self.matrices:
            target = param.view(shape)[index]
            target.copy_(matrix.view(target.shape))
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)
        for param, *_ in self.matrices:
            param.grad = None


def one_process_config(kind: str, adjust: str, split: str = "parts"):
    """A Llama, GPT (its fused qkv orthogonalized as `split` says), a DeepSeek-V3-shaped MLA model, or a
    Qwen3-MoE-shaped one (QK-norm, 4 experts top-2 on both layers)."""
    config = muon_config(arch="gpt" if kind == "gpt" else "llama", mla=kind == "mla", moe=kind == "qwen3-moe",
                         muon_adjust_lr=adjust, muon_split=split)
    config.model.qk_norm = kind == "qwen3-moe"
    return config


@pytest.mark.parametrize("kind,adjust,split", [
    ("llama", "original", "parts"), ("llama", "match_rms_adamw", "parts"), ("mla", "original", "parts"),
    ("qwen3-moe", "original", "parts"), ("gpt", "original", "parts"), ("gpt", "original", "heads"),
    ("gpt", "original", "whole")])
def test_one_process_equals_torch_muon(kind, adjust, split):
    """shardlm's Muon / AdamW split is the test's, by name; 4 steps equal torch.optim.Muon over the test's
    matrices (GPT's qkv cut by its (heads, 3, head_dim) rows) and torch.optim.AdamW over the rest."""
    ours = Trainer(one_process_config(kind, adjust, split), ParallelContext.single(), batches())
    theirs = Trainer(one_process_config(kind, adjust, split), ParallelContext.single(), batches())
    theirs.optimizer = TorchMuonAndAdamW(theirs, adjust)
    muon, rest = split_by_name(ours.model)
    assert {name for m in ours.optimizer.muons for name in m.names.values()} == muon.keys()
    assert {id(p) for g in ours.optimizer.adamw.param_groups for p in g["params"]} == {id(p) for p in rest.values()}
    assert {n for n, p in ours.model.named_parameters() if is_muon_matrix(n, p)} == muon.keys()
    layers, heads = ours.config.model.num_layers, ours.config.model.num_heads
    per_layer = {"llama": 7, "mla": 8, "qwen3-moe": 4 + 3 * 4, "gpt": 3 + {"parts": 3, "heads": 3 * heads,
                                                                           "whole": 1}[split]}[kind]
    assert len(theirs.optimizer.matrices) == per_layer * layers
    for step in range(STEPS):
        a, b = ours.train_step()["loss"], theirs.train_step()["loss"]
        assert abs(a - b) <= 1e-6 * b, (step, a, b)
    ref = dict(theirs.model.named_parameters())
    for name, param in ours.model.named_parameters():
        assert torch.allclose(param, ref[name], rtol=1e-6, atol=1e-7), name


def muons_of(trainer: Trainer) -> list[Muon]:
    """The Muon optimizers of a trainer: MuonWithAdamW's (replicated, FSDP) or the master-weight parts' (ZeRO-1)."""
    optimizer = trainer.fsdp.inner if trainer.fsdp else trainer.optimizer
    if isinstance(optimizer, MuonWithAdamW):
        return optimizer.muons
    return [part.optimizer for part in getattr(optimizer, "parts", [optimizer]) if isinstance(part.optimizer, Muon)]


def watch_muons(trainer: Trainer) -> dict:
    """What this rank's Muon steps do, beside what the test expects of them from the model's Muon matrices as the
    test names them (`split_by_name`) and sizes them: the matrices it orthogonalizes, and per data group a matrix
    is sharded over (split experts: expert-DP; the rest: DP x CP) the calls and bytes of the steps' all-gathers and
    reduce-scatters over it (the trainer's other collectives are not counted)."""
    ctx, stats = trainer.ctx, trainer.ctx.comm
    matrices, _ = split_by_name(trainer.model)
    groups = {}
    for name, param in matrices.items():
        group = ctx.expert_dp if ".experts." in name else ctx.dp_cp
        groups.setdefault(group.name, (group, []))[1].append(param)
    held = [m.name for muon in muons_of(trainer) for m in muon.matrices]
    seen = {"owned": 0, "matrices": len(matrices), "groups": {},
            "owned_expected": sum(STEPS * len(range(g.rank, len(ps), g.size)) for g, ps in groups.values()),
            "split_mismatch": sorted(set(held) ^ matrices.keys()) + sorted({n for n in held if held.count(n) > 1})}
    for name, (group, params) in groups.items():
        if group.size > 1:  # elements: N; rows: one dim-0 slice of each matrix, what an uneven split can add
            seen["groups"][name] = {"size": group.size, "elements": sum(p.numel() for p in params),
                                    "rows": sum(p.numel() // p.shape[0] for p in params),
                                    "all_gather": [0, 0], "reduce_scatter": [0, 0]}  # calls, bytes
    for muon in muons_of(trainer):
        def orthogonalized(m, update, original=muon._orthogonalized_matrix):
            seen["owned"] += 1
            return original(m, update)

        def step(original=muon.step):
            keys = [(kind, name) for name in seen["groups"] for kind in ("all_gather", "reduce_scatter")]
            before = [(stats.calls[key], stats.bytes[key]) for key in keys]
            original()
            for (kind, name), (calls, size) in zip(keys, before):
                counted = seen["groups"][name][kind]
                counted[0] += stats.calls[(kind, name)] - calls
                counted[1] += stats.bytes[(kind, name)] - size

        muon._orthogonalized_matrix, muon.step = orthogonalized, step
    return seen


def rows_alone(muon: Muon) -> None:
    """The control's bug under FSDP: each DP rank orthogonalizes its own rows of each matrix, nothing exchanged."""
    def exchange(updates):
        return {i: newton_schulz(u.view(-1, muon.matrices[i].shape[-1]), steps=muon.settings.ns_steps,
                                 dtype=muon.ns_dtype).reshape(-1) for i, u in updates.items()}

    muon._exchange = exchange


def train_layout(ctx: ParallelContext, config, per_shard: bool = False, resume: str | None = None,
                 per_dp_piece: bool = False) -> dict:
    """4 steps of `config` (`resume`: a checkpoint directory, saved after 2 steps by a ZeRO-1 run and resumed by
    this one for the last 2; `per_shard`, `per_dp_piece`: the controls' bugs)."""
    validate(config, ctx.world_size, check_paths=False)
    trainer = Trainer(config, ctx, batches())
    if per_shard:  # the control's bug: each TP rank orthogonalizes its shard alone
        muon = muons_of(trainer)[0]
        muon._orthogonalized = lambda name, update, dim: Muon._orthogonalized(muon, name, update, None)
    if per_dp_piece:
        for muon in muons_of(trainer):
            rows_alone(muon)
    curve = []
    if resume:
        first = Trainer(muon_config(muon_ns_dtype="fp32", data_sharding="optimizer"), ctx, batches())
        curve = [(m["loss"], m["grad_norm"]) for m in (first.train_step() for _ in range(STEPS // 2))]
        save_checkpoint(first, resume)
        load_checkpoint(trainer, resume)
    seen = watch_muons(trainer)
    curve += [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS - len(curve)))]
    return {"curve": curve, "params": stage_parameters(trainer.model), "muon": seen}


def run_layout(tp: int, pp: int, cp: int, ep: int, per_shard: bool = False, resume: str | None = None,
               per_dp_piece: bool = False, **config) -> dict:
    return train_layout(layout_context(tp, pp, cp, ep),
                        muon_config(tp=tp, pp=pp, cp=cp, ep=ep, muon_ns_dtype="fp32", **config), per_shard,
                        resume, per_dp_piece)


WORLD2 = {  # name: (reference kind, layout)
    "tp2 sp gpt": ("gpt", layout(tp=2, sp=True, arch="gpt")),
    "tp2 sp llama": ("llama", layout(tp=2, sp=True)),
    "pp2 llama": ("llama", layout(pp=2, micro=1)),
    "cp2 llama": ("llama", layout(cp=2)),
    "dp2 llama": ("llama", layout()),
    "ep2 moe": ("moe", layout(ep=2, moe=True)),
    "tp2 sp llama lora": ("lora", layout(tp=2, sp=True, lora=True)),
    "dp2 zero1 llama": ("llama", layout(data_sharding="optimizer")),
    "dp2 fsdp llama": ("llama", layout(data_sharding="full")),
    "dp2 fsdp llama lora": ("lora", layout(data_sharding="full", lora=True)),
    "ep2 zero1 moe": ("moe", layout(ep=2, moe=True, data_sharding="optimizer")),
    "ep2 fsdp moe": ("moe", layout(ep=2, moe=True, data_sharding="full")),
    "dp2 zero1 saved, fsdp resumed llama": ("llama", layout(data_sharding="full", resume="RESUME")),
    "control tp2 sp llama per shard": ("llama", layout(tp=2, sp=True, per_shard=True)),
    "control dp2 fsdp llama rows alone": ("llama", layout(data_sharding="full", per_dp_piece=True)),
}
WORLD4 = {"ep2 tp2 sp moe": ("moe", layout(ep=2, tp=2, sp=True, moe=True)),
          "dp2 tp2 sp zero1 gpt": ("gpt", layout(tp=2, sp=True, arch="gpt", data_sharding="optimizer")),
          "dp2 tp2 sp fsdp llama": ("llama", layout(tp=2, sp=True, data_sharding="full")),
          "ep2 tp2 sp moe lora": ("moe lora", layout(ep=2, tp=2, sp=True, moe=True, lora=True))}
REFERENCES = {"gpt": {"arch": "gpt", "micro": 8}, "llama": {"micro": 8}, "moe": {"moe": True},
              "lora": {"lora": True, "micro": 8}, "moe lora": {"moe": True, "lora": True}}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    resume = str(tmp_path_factory.mktemp("muon-resume"))
    cases = {name: (kind, {k: resume if v == "RESUME" else v for k, v in spec.items()})
             for name, (kind, spec) in WORLD2.items()}
    return spawn_layouts(2, run_layout, cases, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return spawn_layouts(4, run_layout, WORLD4, timeout=300)


@pytest.fixture(scope="module")
def reference():
    """One process per model kind: dense at micro-batch 8, the MoE at the layouts' micro-batch 2 (its balancing
    loss is a function of each micro-batch's routing)."""
    ctx = ParallelContext.single()
    return {kind: train_layout(ctx, muon_config(muon_ns_dtype="fp32", **spec)) for kind, spec in REFERENCES.items()}


@pytest.mark.parametrize("name", [n for n in WORLD2 if not n.startswith("control")])
def test_muon_at_two_ranks_equals_one_process(world2, reference, name):
    assert_holds_the_split(assert_every_rank(world2, name, reference[WORLD2[name][0]], steps=STEPS, tol=TOL), name)


@pytest.mark.parametrize("name", list(WORLD4))
def test_muon_at_four_ranks_equals_one_process(world4, reference, name):
    assert_holds_the_split(assert_every_rank(world4, name, reference[WORLD4[name][0]], steps=STEPS, tol=TOL), name)


def assert_holds_the_split(values: list, name: str) -> None:
    """The matrices each rank's Muon optimizers hold are the test's split of its parameters, each once."""
    for rank, value in enumerate(values):
        assert not value["muon"]["split_mismatch"], (name, rank, value["muon"]["split_mismatch"])


SHARDED = [("world2", n) for n in WORLD2 if ("zero1" in n or "fsdp" in n) and "resumed" not in n
           and not n.startswith("control")] + \
    [("world4", n) for n in WORLD4 if "zero1" in n or "fsdp" in n]


@pytest.mark.parametrize("world,name", SHARDED)
def test_sharded_muon_spreads_the_matrices_and_bounds_its_traffic(request, world, name):
    """ZeRO-1 and FSDP: each DP rank orthogonalizes the matrices i with i mod d its rank (every matrix by
    exactly one rank of the group), and a Muon step's collectives over a data group of d ranks are one all-gather
    and one reduce-scatter. With N the fp32 elements of this rank's Muon matrices sharded over that group and R one
    dim-0 slice of each (both summed by the test from the parameters), a rank's share is N / d, plus at most R for
    an uneven split: the all-gather's input (counted bytes) is 4 x [N / d, N / d + R], the reduce-scatter's d
    times that."""
    values = check_result(request.getfixturevalue(world), name)
    for rank, value in enumerate(values):
        seen = value["muon"]
        assert seen["owned"] == seen["owned_expected"] > 0, (name, rank, seen)
        assert seen["groups"], (name, rank, "no data group shards a Muon matrix")
        for group, counted in seen["groups"].items():
            d, n, rows = counted["size"], counted["elements"], counted["rows"]
            share = (4 * STEPS * n / d, 4 * STEPS * (n / d + rows))
            (gathers, gathered), (scatters, scattered) = counted["all_gather"], counted["reduce_scatter"]
            assert gathers == scatters == STEPS, (name, rank, group, counted)
            assert share[0] <= gathered <= share[1], (name, rank, group, counted, share)
            assert d * share[0] <= scattered <= d * share[1], (name, rank, group, counted, share)
    if "tp2" not in name and "ep2" not in name:  # the DP ranks together orthogonalize each matrix once per step
        assert sum(v["muon"]["owned"] for v in values) == STEPS * values[0]["muon"]["matrices"]


def test_orthogonalizing_each_shard_alone_fails(world2, reference):
    """Controls: at TP=2 each rank orthogonalizing its shard alone, and under FSDP at DP=2 each rank its own rows
    of each matrix (no exchange), train and end more than 1e-3 off one process."""
    for name in ("control tp2 sp llama per shard", "control dp2 fsdp llama rows alone"):
        for value in check_result(world2, name):
            assert_trained_but_off(value["curve"], value["params"], reference["llama"]["params"], STEPS, ".attn.q.")


def dropout_config(**train):
    config = muon_config(steps=6, **train)
    config.model.dropout = 0.1
    return config


def test_resume_is_bitwise_and_another_optimizer_is_one_line(tmp_path):
    """Dropout 0.1 on: 3 steps, save, 3 more, against a fresh trainer (both generators disturbed) loading the save."""
    ctx = ParallelContext.single()
    trainer = Trainer(dropout_config(), ctx, batches())
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(trainer, tmp_path)
    straight = [trainer.train_step()["loss"] for _ in range(3)]
    ctx.rng = None
    resumed = Trainer(dropout_config(), ctx, batches())
    disturb_generators(ctx)
    load_checkpoint(resumed, tmp_path)
    assert [resumed.train_step()["loss"] for _ in range(3)] == straight
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), trainer.model.parameters()))
    adamw = Trainer(dropout_config(optimizer="adamw"), ctx, batches())
    with pytest.raises(UserError, match='trained with train.optimizer="muon" but this run asks for "adamw"'):
        load_checkpoint(adamw, tmp_path)


def test_half_parameters_update_their_fp32_master_weights_as_torch_muon():
    """bf16 parameters (`param_dtype = "half"`): Muon steps the fp32 master weights from the fp32 gradients
    bitwise as torch.optim.Muon steps an fp32 copy of them given the same gradients (3 steps, momentum carried)."""
    trainer = Trainer(muon_config(precision="bf16", param_dtype="half", steps=3), ParallelContext.single(), batches())
    (muon,) = muons_of(trainer)
    pieces = [m.piece for m in muon.matrices]
    copies = [torch.nn.Parameter(p.detach().clone().view(m.shape)) for p, m in zip(pieces, muon.matrices)]
    t = trainer.config.train
    theirs = torch.optim.Muon(copies, lr=t.lr, weight_decay=t.weight_decay, momentum=t.muon_momentum)
    step = muon.step

    def checked():
        for copy, piece in zip(copies, pieces):
            assert torch.equal(copy.detach().view(-1), piece.detach())  # bitwise the same before each step
            copy.grad = piece.grad.view_as(copy).clone()
        step()
        theirs.step()

    muon.step = checked
    for _ in range(3):
        trainer.train_step()
    assert pieces[0].dtype == torch.float32 and next(trainer.model.parameters()).dtype == torch.bfloat16
    for copy, piece in zip(copies, pieces):
        assert torch.equal(copy.detach().view(-1), piece)
