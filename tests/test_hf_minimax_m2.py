"""MiniMax-M2 (`MiniMaxM2ForCausalLM`) against transformers, and its training at every layout against one process.

What it computes (transformers 5's minimax_m2): pre-norm Llama blocks; q_norm one RMSNorm over all heads' queries and
k_norm one over all KV heads' keys, before RoPE (shardlm's `qk_norm_scope = "projection"`, the mean of squares
all-reduced over TP); RoPE on the first rotary_dim channels of each head, rotate-half within them (`rope_fraction`);
an MoE in every layer: sigmoid of the fp32 gate logits, the top-k chosen over sigmoid + e_score_correction_bias, the
weights the chosen sigmoids without the bias divided by their sum, no shared expert (`moe_score = "sigmoid"`,
`moe_expert_bias`, `moe_norm_topk_prob`); every norm at rms_norm_eps. Experts are per expert on disk (Mixtral's
block_sparse_moe.experts.e.w1/w3/w2), stacked in transformers' memory.

A random tiny MiniMaxM2 (2 layers, hidden 64, 4 query heads over 2 KV heads of 16 channels, RoPE on 8 of them, 8
experts top-2), with every norm weight drawn from U(0.5, 2), a visible score-correction bias, gate logits near the
sigmoid's slope (so the bias changes choices) and experts scaled up (so the choices change the logits):
- shardlm's logits equal transformers' within 1e-4 and its greedy tokens equal transformers' at TP=1, TP=2 (heads
  and the projection norms' weights split) and EP=2, from the converted file and from the directory read in place
  (also one saved under transformers' in-memory names, experts stacked); converting back gives transformers'
  tensors bitwise, and transformers loads them; a run started from the directory gives transformers' first loss;
- controls (one process): the bias dropped from the choice, RoPE over whole heads, per-head QK-norm move the logits
  by more than 100 x 1e-4;
- training started from the directory (`checkpoint.init_from`) on `test_sft_layouts`' packed SFT rows equals one
  process within 1e-5 (fp32: losses, gradient norms, the validation loss, every final parameter on every rank) at
  TP=2 with SP, EP=2, CP=2 and FSDP DP=2; the control, EP=2 with the bias dropped from the choice, ends far off;
- what shardlm does not compute is refused in one line, both ways.
Everything on 2 ranks runs in one world, spawned once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    assert_converted_matches,
    assert_layout_matches,
    assert_matches_transformers,
    assert_read_in_place,
    assert_round_trip,
    hf_reference,
    layout_checks,
    logits_and_greedy,
    variant_logits,
)
from test_sft_layouts import STEPS, TOL, train_data, valid_data
from test_training import VOCAB

from shardlm.checkpoint import hf_llama
from shardlm.errors import UserError
from shardlm.models import moe
from shardlm.parallel import ParallelContext

from agreement import assert_every_rank, assert_trained_but_off
from layouts import layout, layout_config, layout_context
from multiproc import check_result, run_checks, run_workers

SHAPE = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2)


def hf_config(**changes):
    """A tiny MiniMaxM2Config of `SHAPE` over `test_training.VOCAB` tokens and rows up to 32 (the SFT rows' length),
    rotary base 500, no special tokens (its defaults name ids of MiniMax's own vocabulary)."""
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(vocab_size=VOCAB, max_position_embeddings=32, rope_theta=500.0, rms_norm_eps=1e-6,
                           pad_token_id=None, bos_token_id=None, eos_token_id=None, **(SHAPE | changes))


def hf_model():
    """The random reference model: a large embedding (tokens decide the greedy continuation) and output layer (logits
    far from flat), gate logits of std ~1 (the sigmoid's slope, where a bias of std 0.5 changes the top-2) and
    experts 10 x their initial scale (at 0.02 their output is lost beside the embedding)."""
    from transformers import MiniMaxM2ForCausalLM

    torch.manual_seed(0)
    model = MiniMaxM2ForCausalLM(hf_config()).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30.0)
        model.lm_head.weight.mul_(10.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.15)
            layer.mlp.e_score_correction_bias.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj.mul_(10.0)
            layer.mlp.experts.down_proj.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    model = hf_model()
    return {"model": model, **hf_reference(model, tmp_path_factory.mktemp("minimax_m2"), tokens)}


# ------------------------------------------------------------------------------------------- training at layouts


def sft_run_config(hf_dir, tp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False, **train):
    """`test_sft_layouts`' packed-rows run (micro-batch 2: the MoE balance loss is per micro-batch) started from the
    MiniMax-M2 directory, its [model] section left empty."""
    return layout_config({}, micro=2, tp=tp, cp=cp, ep=ep, sp=sp,
                         sections={"data": {"text_file": "unused"}, "checkpoint": {"init_from": str(hf_dir)}},
                         steps=STEPS, eval_iters=64, **train)


@contextlib.contextmanager
def broken(control: str | None):
    """"no bias": the top-k chosen over the sigmoid scores alone (`moe.route` given no expert bias)."""
    route = moe.route
    if control == "no bias":
        moe.route = lambda scores, top_k, bias=None, *args, **kwargs: route(scores, top_k, None, *args, **kwargs)
    try:
        yield
    finally:
        moe.route = route


def train_from(hf_dir, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, control: str | None = None,
               **config) -> dict:
    """STEPS steps started from `hf_dir` at a layout: {"curve": [(loss, gradient norm)], "valid", "params"}."""
    from test_moe_parallel import stage_parameters

    from shardlm.checkpoint.init import init_weights, resolve_init
    from shardlm.training.trainer import Trainer
    from shardlm.validation import validate

    ctx = layout_context(tp, pp, cp, ep) if torch.distributed.is_initialized() else ParallelContext.single()
    ctx.rng = None
    run = sft_run_config(hf_dir, tp=tp, cp=cp, ep=ep, **config)
    with broken(control):
        source = resolve_init(run)
        validate(run, ctx.world_size, check_paths=False)
        trainer = Trainer(run, ctx, train_data(), valid_data())
        init_weights(trainer, source)
        curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(STEPS))]
        return {"curve": curve, "valid": trainer.evaluate(), "params": stage_parameters(trainer.model)}


LAYOUTS = {
    "train tp2 sp": layout(tp=2, sp=True),
    "train ep2": layout(ep=2),
    "train cp2": layout(cp=2),
    "train fsdp dp2": layout(data_sharding="full"),
}
CONTROLS = {"control ep2 no bias": layout(ep=2, control="no bias")}


def worker_world2(path, hf_dir, tokens: torch.Tensor) -> dict:
    """Every 2-rank check: logits and greedy tokens at TP=2 and EP=2, then training at each layout and the control."""
    checks = layout_checks({"minimax_m2": path}, tokens)
    checks |= {name: (lambda spec=spec: train_from(hf_dir, **spec)) for name, spec in (LAYOUTS | CONTROLS).items()}
    return run_checks(checks)


@pytest.fixture(scope="module")
def world2(reference):
    return run_workers(2, worker_world2, reference["converted"], reference["root"] / "hf", reference["tokens"],
                       timeout=600)


@pytest.fixture(scope="module")
def one_process(reference):
    return train_from(reference["root"] / "hf")


# ------------------------------------------------------------------------------------------- transformers


def test_conversion_reads_projection_norms_partial_rope_and_sigmoid_routing(reference):
    from safetensors.torch import load_file

    from shardlm.checkpoint.state import load_consolidated

    config, tensors = load_consolidated(reference["converted"])
    m = config.model
    assert (m.norm_placement, m.qk_norm, m.qk_norm_scope, m.rope_fraction, m.rope_theta, m.attention_head_dim) == (
        "pre", True, "projection", 0.5, 500.0, 16)
    assert (m.moe_num_experts, m.moe_top_k, m.moe_ffn_size, m.moe_score, m.moe_expert_bias, m.moe_norm_topk_prob,
            m.moe_routed_scaling, m.moe_shared_experts, m.moe_first_dense_layers) == (
        8, 2, 32, "sigmoid", True, True, 1.0, 0, 0)
    assert tensors["model/layers.0.attn.q_norm.weight"].shape == (64,)
    assert tensors["model/layers.0.attn.k_norm.weight"].shape == (32,)
    saved = load_file(str(reference["root"] / "hf" / "model.safetensors"))
    block = "model.layers.1.block_sparse_moe"
    assert torch.equal(tensors["model/layers.1.mlp.router.expert_bias"], saved[f"{block}.e_score_correction_bias"])
    assert torch.equal(tensors["model/layers.1.mlp.experts.up.5"], saved[f"{block}.experts.5.w3.weight"])


def test_tp1_logits_and_greedy_tokens_match_transformers(reference):
    assert_converted_matches(reference)


def test_the_hf_directory_itself_loads_without_converting(reference):
    assert_read_in_place(reference)


def test_a_directory_under_transformers_in_memory_names_reads_the_same(reference, tmp_path):
    """A directory holding the model's state_dict as is (`mlp.gate`, `mlp.e_score_correction_bias`, the experts
    stacked in gate_up_proj and down_proj, which transformers loads too) gives transformers' logits and tokens."""
    import shutil

    from safetensors.torch import save_file

    state = reference["model"].state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    folder = tmp_path / "in_memory"
    folder.mkdir()
    shutil.copy(reference["root"] / "hf" / "config.json", folder / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    assert_matches_transformers([logits_and_greedy(folder, ParallelContext.single(), reference["tokens"])], reference)


@pytest.mark.parametrize("layout_name", ["tp2", "ep2"])
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, reference, layout_name):
    assert_layout_matches(world2, f"{layout_name} minimax_m2", reference)


def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(reference, tmp_path):
    from transformers import MiniMaxM2ForCausalLM

    assert_round_trip(reference, tmp_path / "back", MiniMaxM2ForCausalLM)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["rotary_dim"], config["rope_parameters"]["partial_rotary_factor"]) == (
        "minimax_m2", 8, 0.5)


def test_a_run_started_from_the_directory_gives_transformers_first_loss(reference):
    from test_hf_start import BATCH, hf_loss, run_config, started_run
    from test_training import synthetic_data

    from shardlm.training.data import micro_batches

    batch = micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]
    expected = hf_loss(reference["model"], batch)
    run = started_run(ParallelContext.single(), run_config(reference["root"] / "hf"), steps=1)
    assert abs(run["curve"][0][0] - expected) <= 1e-5 * expected, (run["curve"][0][0], expected)


def without_bias(tensors: dict) -> dict:
    return {name: torch.zeros_like(v) if name.endswith("expert_bias") else v for name, v in tensors.items()}


def per_head_norms(tensors: dict) -> dict:
    return {name: v[:16] if name.endswith(("q_norm.weight", "k_norm.weight")) else v for name, v in tensors.items()}


def test_controls_move_the_logits_far(reference, tmp_path):
    """The same weights without the bias in the choice, with RoPE over each whole head, or with per-head QK-norm (the
    first head's weights shared by every head): the logits move by more than 100 x LOGIT_TOL."""
    from shardlm.checkpoint.files import write_consolidated
    from shardlm.checkpoint.state import load_consolidated

    def changed(name: str, change_tensors=None, **model) -> torch.Tensor:
        config, tensors = load_consolidated(reference["converted"])
        config.model = dataclasses.replace(config.model, **model)
        tensors = change_tensors(tensors) if change_tensors else tensors
        write_consolidated(tmp_path / name, {k: v.contiguous() for k, v in tensors.items()}, dataclasses.asdict(config))
        return logits_and_greedy(tmp_path / name, ParallelContext.single(), reference["tokens"])[0]

    moved = {"no bias": variant_logits(reference, tmp_path / "no_bias.safetensors", without_bias),
             "whole-head rope": changed("rope.safetensors", rope_fraction=1.0),
             "per-head norms": changed("heads.safetensors", per_head_norms, qk_norm_scope="head")}
    distances = {name: (logits - reference["logits"]).abs().max().item() for name, logits in moved.items()}
    assert min(distances.values()) > 100 * LOGIT_TOL, distances


# ------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_from_the_directory_at_two_ranks_equals_one_process(world2, one_process, name):
    assert_every_rank(world2, name, one_process, steps=STEPS, tol=TOL)


def test_expert_bias_dropped_from_the_choice_ends_far_off(world2, one_process):
    """EP=2 choosing by the sigmoid scores alone: finite losses, the experts far from one process."""
    for value in check_result(world2, "control ep2 no bias"):
        assert_trained_but_off(value["curve"], value["params"], one_process["params"], STEPS, ".mlp.")


# ------------------------------------------------------------------------------------------- refusals


def one_line_error(call) -> str:
    with pytest.raises(UserError) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


def test_an_older_config_json_reads_as_transformers_reads_it():
    """The released config.json's style: rotary_dim instead of partial_rotary_factor, rope_theta at the top; absent
    head_dim and rotary base take MiniMaxM2Config's defaults (128, 5e6), not hidden / heads and 1e4."""
    base = {k: v for k, v in hf_config().to_dict().items() if k not in ("rope_parameters", "head_dim")}
    older = base | {"rotary_dim": 64, "rope_theta": 1e4, "use_qk_norm": True, "qk_norm_type": "per_layer",
                    "scoring_func": "sigmoid", "shared_intermediate_size": 0, "attn_type_list": [1, 1]}
    read = hf_llama.model_config_from_hf(older)
    assert (read.attention_head_dim, read.rope_fraction, read.rope_theta) == (128, 0.5, 1e4)
    bare = hf_llama.model_config_from_hf({k: v for k, v in older.items() if k not in ("rotary_dim", "rope_theta")})
    assert (bare.rope_fraction, bare.rope_theta) == (1.0, 5e6)


def test_what_does_not_convert_fails_in_one_line():
    """Import: quantized weights, the released code's per-head or absent QK-norm, softmax scores, a shared expert,
    lightning-attention layers, router jitter, other rotary types. Export: what MiniMaxM2ForCausalLM does not have."""
    base = hf_config().to_dict()
    for change, words in (({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
                          ({"qk_norm_type": "per_head"}, "qk_norm_type"), ({"use_qk_norm": False}, "no QK-norm"),
                          ({"scoring_func": "softmax"}, "scoring_func"),
                          ({"shared_intermediate_size": 16}, "shared expert"),
                          ({"attn_type_list": [0, 1]}, "lightning"), ({"router_jitter_noise": 0.1}, "jitter"),
                          ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'")):
        message = one_line_error(lambda: hf_llama.model_config_from_hf(base | change))  # noqa: B023
        assert words in message, message
    cfg = hf_llama.model_config_from_hf(base)
    assert hf_llama.hf_kind(cfg) == "minimax_m2"
    for change, words in ((dict(moe_score="softmax"), "moe_score"), (dict(moe_shared_experts=1), "shared experts"),
                          (dict(moe_routed_scaling=2.0), "moe_routed_scaling"),
                          (dict(moe_norm_topk_prob=False), "moe_norm_topk_prob"),
                          (dict(moe_groups=2, moe_topk_groups=1), "group-limited"),
                          (dict(moe_first_dense_layers=1), "dense MLP layers"),
                          (dict(attention_bias=True), "attention biases"),
                          (dict(sliding_window=4), "sliding-window")):
        changed = dataclasses.replace(cfg, **change)
        message = one_line_error(lambda: hf_llama.hf_config_from_model(changed))  # noqa: B023
        assert message.startswith("MiniMaxM2ForCausalLM has no") and words in message, message
