"""Gemma 4's text model trains at every layout as one process does (fp32, within 1e-5: losses, gradient norms, the
validation loss and every final parameter on every rank, 4 steps on `test_sft_layouts`' packed SFT rows of 32 tokens).

The model (`gemma4_config`): `test_sft_layouts`' 4-layer Llama (hidden 32, 4 query heads) as Gemma 4: sandwich norms
and layer scalars, the embedding scaled by sqrt(h), q/k/v RMS-normalized, a softmax scale of 1, a tanh-GeLU MLP,
layers sliding (window 5, 2 KV heads of 8 channels, base 100) and full (1 KV head of 16 whose values are its keys,
proportional RoPE on half the frequencies at base 1000), logits soft-capped at 10. "dense": per-layer inputs (4
channels) and the last 2 layers sharing layers 0's and 1's keys and values, twice as wide MLPs there; "moe": 2 layers,
4 experts (top 2) beside each MLP; "pp": no per-layer inputs, the last layer sharing layer 1's keys and values.
What each layout puts to the test:
- TP=2 with SP: query heads split, the sliding layers' KV heads split, the full layers' one KV head replicated (its
  k weight and k_norm gradients summed over TP); per-layer inputs made on the sequence chunks (the per-layer table
  reduce-scattered, the replicated projections' gradients summed over TP);
- CP=2: documents and windows across the zigzag chunks, the shared keys and values going round the consumers' ring;
- DP=2 with ZeRO-1 and with FSDP; LoRA on every projection at TP=2 with SP; EP=2 (MoE, its router's scales);
- PP=2 (1 + 3 layers: the sharing layer with its producer); 2 + 2 under 1F1B ("pp": layer 3 on stage 1 reading layer
  1's keys and values; "dense": both sharing layers on stage 1, their producers and the per-layer inputs made on stage
  0, handed on with their gradients back); ZB-V's 4 stages of one layer ("pp": layer 1's keys and values cross stage
  2 to reach layer 3 on stage 3, back on rank 0; evaluation runs the forward-only V), "dense" alike, the per-layer
  inputs crossing every stage. What stays refused is a pipeline forward outside the schedule (RL rollouts, a
  distillation teacher), in one line.
Controls, each far off one process: at TP=2 with SP, the per-layer inputs' projections without their SP gradient sum,
and the MoE router's scales without theirs; at CP=2, the KV-sharing layers attending to their rank's part of the shared
keys and values only; at PP=2 ("dense", 2 + 2), the handed keys and values, or the per-layer inputs, detached (no
gradient back to stage 0).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_sft_layouts import STEPS, TOL, sft_config, train_layout

from shardlm.errors import UserError
from shardlm.parallel import ParallelContext

from agreement import assert_every_rank, assert_trained_but_off
from layouts import counting, layout, layout_context, spawn_layouts
from multiproc import check_result

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA = {"sandwich_norms": True, "qk_norm": True, "value_norm": True, "attention_scale": 1.0,
         "embedding_scale": True, "activation": "gelu_tanh", "head_dim": 8, "num_kv_heads": 2, "global_head_dim": 16,
         "global_kv_heads": 1, "attention_k_eq_v": True, "sliding_window": 5, "rope_theta": 100.0,
         "global_rope_theta": 1000.0, "global_rope_fraction": 0.5, "final_logit_softcap": 10.0,
         "layer_types": [SLIDING, FULL, SLIDING, FULL], "init_std": 0.05, "tie_embeddings": True}
LR, ADAM_EPS = 3e-4, 1e-3
"""AdamW's peak learning rate and epsilon (the layout tests' 3e-3 and 1e-6 elsewhere, OLMo 3's 1e-4 epsilon). Gemma's
block normalizes every sublayer's output and attends at a softmax scale of 1, and the first steps amplify the rounding
of another summation order: against one process, TP=2's step-1 gradient norm agrees within 1e-6, yet at 3e-3 and
1e-4 its step-2 one ends 1.2e-5 off (CP=2 alike); at 1e-3 and 1e-3 every case agrees on this
machine's AVX-512 kernels but not on the others (ATEN_CPU_CAPABILITY=default: step 4 2.5e-5 off at TP=2, CP=2, ZeRO-1
and FSDP; avx2: 2.3e-5 at TP=2 with LoRA); at 3e-4 and 1e-3 every case agrees within a third of 1e-5 on the
AVX-512, AVX2 and default kernels, and the controls still end far off (at epsilon 1e-2 the router's would not)."""
KINDS = {"dense": {"per_layer_input_size": 4, "kv_shared_layers": 2, "kv_shared_double_mlp": True},
         "moe": {"num_layers": 2, "layer_types": [SLIDING, FULL], "moe_num_experts": 4, "moe_top_k": 2,
                 "moe_ffn_hidden_size": 24, "moe_beside_mlp": True},
         "pp": {"kv_shared_layers": 1}}


def gemma4_config(kind: str = "dense", lora: int = 0, first: int | None = None, schedule: str = "1f1b", **kwargs):
    """`test_sft_layouts`' Llama run as Gemma 4 (`GEMMA` and `KINDS[kind]`); `lora`: adapters of that rank on every
    projection (the base frozen); under PP the first stage's layers (`first`; by default 1 for "pp", else an even
    split) and the schedule."""
    config = sft_config("llama", **kwargs)
    for key, value in (GEMMA | KINDS[kind]).items():
        setattr(config.model, key, value)
    config.train.adam_eps = ADAM_EPS
    config.train.lr = LR
    config.lora.rank, config.lora.alpha, config.lora.targets = lora, 8.0, ["all-linear"]
    if config.parallel.pipeline > 1:
        config.parallel.first_stage_layers = (1 if kind == "pp" else 0) if first is None else first
        config.parallel.pipeline_schedule = schedule
    return config


@contextlib.contextmanager
def broken(control: str | None):
    """"ple": the per-layer inputs' replicated projections not marked `sequence_parallel` (their partial gradients
    over the sequence chunks never summed over TP); "router": the same for the MoE router's weight and scales; "kv
    local": under CP the KV-sharing layers attend to their rank's own part of the shared keys and values only (as if
    shared keys needed no ring: the group they attend over is the TP group, of one rank); "detached kv" / "detached
    ple": a pipeline stage hands its keys and values / its per-layer inputs on detached (the later stages' gradients
    of them never reach stage 0)."""
    from shardlm.models import gemma, gemma_moe
    from shardlm.models.attention import causal_attention
    from shardlm.parallel import layers

    saved_linear, saved_router = layers.ReplicatedLinear.__init__, gemma_moe.GemmaRouter.__init__
    saved_core, saved_handoff = gemma.Gemma4Attention.core, gemma.Gemma4.stage_handoff

    def local_core(self, q, k, v, documents=None):
        if self.source is None:
            return saved_core(self, q, k, v, documents)
        return causal_attention(q, k, v, self.ctx.tp, scale=self.scale, window=self.window)

    def unmarked_linear(self, shape, std, seed, device, sequence_parallel):
        saved_linear(self, shape, std, seed, device, False)

    def unmarked_router(self, cfg, ctx, seed, prefix, sequence_parallel):
        saved_router(self, cfg, ctx, seed, prefix, False)

    if control == "ple":
        layers.ReplicatedLinear.__init__ = unmarked_linear
    if control == "router":
        gemma_moe.GemmaRouter.__init__ = unmarked_router
    if control == "kv local":
        gemma.Gemma4Attention.core = local_core
    def detached_handoff(self, carry, later_layer_ids):
        kv = 2 * len(self.handed_kinds(later_layer_ids))  # the keys and values come first, then the per-layer inputs
        return tuple(t.detach() if (i < kv) == (control == "detached kv") else t
                     for i, t in enumerate(saved_handoff(self, carry, later_layer_ids)))

    if control in ("detached kv", "detached ple"):
        gemma.Gemma4.stage_handoff = detached_handoff
    try:
        yield
    finally:
        layers.ReplicatedLinear.__init__, gemma_moe.GemmaRouter.__init__ = saved_linear, saved_router
        gemma.Gemma4Attention.core, gemma.Gemma4.stage_handoff = saved_core, saved_handoff


def run_layout(tp: int, pp: int, cp: int, ep: int, kind: str = "dense", lora: int = 0, control: str | None = None,
               **config) -> dict:
    with broken(control):
        return train_layout(layout_context(tp, pp, cp, ep), gemma4_config(kind, lora, tp=tp, pp=pp, cp=cp, ep=ep,
                                                                           **config))


WORLD2 = {
    "tp2 sp": layout(tp=2, sp=True),
    "cp2": layout(cp=2),
    "zero dp2": layout(distributed_optimizer=True),
    "fsdp dp2": layout(data_sharding="full"),
    "tp2 sp lora": layout(tp=2, sp=True, lora=4),
    "tp2 sp moe": layout(tp=2, sp=True, kind="moe"),
    "ep2 moe": layout(ep=2, kind="moe"),
    "pp2": layout(pp=2, kind="pp", micro=1),
    "pp2 split": layout(pp=2, kind="pp", micro=1, first=2),
    "pp2 dense": layout(pp=2, micro=1),
    "pp2 zbv": layout(pp=2, kind="pp", micro=1, schedule="zbv"),
    "pp2 dense zbv": layout(pp=2, micro=1, schedule="zbv"),
}
CONTROLS = {"control ple": layout(tp=2, sp=True, control="ple"),
            "control router": layout(tp=2, sp=True, kind="moe", control="router"),
            "control kv local": layout(cp=2, control="kv local"),
            "control detached kv": layout(pp=2, micro=1, control="detached kv"),
            "control detached ple": layout(pp=2, micro=1, control="detached ple")}


@pytest.fixture(scope="module")
def world2():
    return spawn_layouts(2, run_layout, WORLD2 | CONTROLS)


@pytest.fixture(scope="module")
def reference():
    """One process at micro-batch 8 of each kind, and with adapters."""
    ctx = ParallelContext.single()
    runs = {kind: train_layout(ctx, gemma4_config(kind, micro=8)) for kind in KINDS}
    return runs | {"lora": train_layout(ctx, gemma4_config(lora=4, micro=8))}


def kind_of(name: str) -> str:
    """The one-process run case `name` must equal."""
    case = WORLD2[name]
    return "lora" if case.get("lora") else case.get("kind", "dense")


@pytest.mark.parametrize("name", list(WORLD2))
def test_gemma4_at_two_ranks_equals_one_process(world2, reference, name):
    assert_every_rank(world2, name, reference[kind_of(name)], steps=STEPS, tol=TOL)


@pytest.mark.parametrize("control, part, kind", [("ple", ".ple_", "dense"), ("router", ".router.", "moe"),
                                                  ("kv local", ".attn.", "dense"),
                                                  ("detached kv", "layers.0.attn.k", "dense"),
                                                  ("detached ple", "ple_projection", "dense")])
def test_each_piece_without_its_fix_ends_far_off(world2, reference, control, part, kind):
    """Each TP rank keeping its own chunks' share of a replicated weight's gradient (the per-layer inputs'
    projections, the router's scales), the KV-sharing layers not going round the CP ring, and PP=2's stage 0
    without the gradients of the keys and values (or the per-layer inputs) it handed stage 1: finite losses, the
    producers' k weights (the per-layer inputs' projection) far from one process."""
    for value in check_result(world2, f"control {control}"):
        assert_trained_but_off(value["curve"], value["params"], reference[kind]["params"], STEPS, part)


def test_what_a_stage_hands_on_and_what_stays_refused():
    """A boundary hands on the keys and values of each kind whose producer is before it and a consumer after it (by
    kind name), then the later layers' per-layer inputs; every split trains, so the planner refuses none. A pipeline
    forward outside the schedule (RL rollouts, a distillation teacher: the hidden state only) stays refused in one
    line at the layer that misses its shared keys and values or its per-layer inputs."""
    from shardlm.models.gemma import Gemma4, SharedKV
    from shardlm.plan.gemma import gemma_pipeline_problem

    cfg = gemma4_config("dense").model  # layers 2 and 3 share 0's (sliding) and 1's (full)
    model = Gemma4(cfg, ParallelContext.single())
    assert [model.handed_kinds(later) for later in ([1, 2, 3], [2, 3], [3])] == [[SLIDING], [FULL, SLIDING], [FULL]]
    assert gemma_pipeline_problem(cfg, 2) is None and gemma_pipeline_problem(cfg, 4) is None
    tokens = torch.randint(0, cfg.vocab_size, (2, 6))
    x = model.embed(tokens)
    first = model.stage_carry((), [0, 1, 2, 3], tokens, x)
    first.states = {SLIDING: (torch.randn(2, 2, 6, 8),) * 2, FULL: (torch.randn(2, 1, 6, 16),) * 2}
    handed = model.stage_handoff(first, [2, 3])
    assert [tuple(t.shape) for t in handed] == [(2, 1, 6, 16)] * 2 + [(2, 2, 6, 8)] * 2 + [(2, 6, 2, 4)]
    carry = model.stage_carry(handed, [2, 3])
    assert torch.equal(carry.layer_inputs(3), first.layer_inputs(3)) and carry.states[FULL][0] is handed[0]
    for call, words in ((lambda: model.layers["3"].attn(x, None, None, SharedKV()), "layer 3 shares"),
                        (lambda: model.layers["0"](x, None, None, SharedKV()), "per-layer inputs")):
        with pytest.raises(UserError) as error:
            call()
        assert words in str(error.value) and "\n" not in str(error.value)


def test_sampling_under_a_split_it_cannot_hand_on_is_refused_before_the_run():
    """RL rollouts and on-policy distillation sample through stages that hand the hidden state only: a split that puts
    a KV-sharing layer on another stage than its producer, or any split with per-layer inputs, is one line at
    validation (`rl.sampling_split_problem`, called by `check_rl` and `check_distill`), not a failure mid-run."""
    from shardlm.rl import sampling_split_problem

    assert sampling_split_problem(gemma4_config("pp", pp=2, first=1)) is None  # layers 1-3, 3 reading 1, on stage 1
    crossing = sampling_split_problem(gemma4_config("pp", pp=2, first=2))
    assert "layer 3 shares layer 1's keys and values from another pipeline stage" in crossing
    assert "per-layer inputs" in sampling_split_problem(gemma4_config("dense", pp=2))
    assert sampling_split_problem(gemma4_config("dense")) is None  # one stage
    assert "\n" not in crossing


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_changes_no_bit(reference, mode, monkeypatch):
    """Whole layers recomputed in the backward (the KV-sharing layers' keys and values, handed on from a checkpointed
    producer, recomputed with it) or only the attention cores: the one-process run's losses, gradient norms and
    parameters, bitwise. The rerun happened: every layer (full) or attention core (selective) of every training
    micro-batch runs once more than in the plain run."""
    from shardlm.models.gemma import Gemma4Attention, Gemma4Block

    calls = {"layer": 0, "core": 0}
    monkeypatch.setattr(Gemma4Block, "forward", counting(Gemma4Block.forward, calls, "layer"))
    monkeypatch.setattr(Gemma4Attention, "core", counting(Gemma4Attention.core, calls, "core"))
    config = gemma4_config(micro=8)
    plain = train_layout(ParallelContext.single(), config)
    counts = dict(calls)
    calls.update(layer=0, core=0)
    config.train.recompute = mode
    run = train_layout(ParallelContext.single(), config)
    reruns = STEPS * (config.train.global_batch_size // 8) * config.model.num_layers
    rerun = "layer" if mode == "full" else "core"
    assert calls[rerun] - counts[rerun] == reruns, (calls, counts)
    assert plain["curve"] == reference["dense"]["curve"]
    assert run["curve"] == reference["dense"]["curve"]
    assert all(torch.equal(run["params"][name], value) for name, value in reference["dense"]["params"].items())
