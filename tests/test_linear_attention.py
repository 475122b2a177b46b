"""Gated DeltaNet in one process: the chunked delta rule against its definition and transformers' kernel, span
summaries composing to the whole sequence, the convolution against conv1d, packed documents against each document
run alone (and the reset removed as the control), decoding against the full forward, recomputation bitwise,
and the one-line errors.

The hybrid model of these tests and of `test_linear_attention_layouts.py`: 4 layers alternating Gated DeltaNet and
gated full attention (2 key heads, 4 value heads of 8 channels each, a kernel of 4; 4 query heads, 2 KV heads,
partial RoPE, zero-centred norms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_training import VOCAB

from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.models import build_model
from shardlm.models.delta_rule import (
    DECAY_FLOOR,
    carry,
    causal_conv,
    chunk_gated_delta_rule,
    decay_exp,
    l2_normalize,
    recurrent_gated_delta_rule,
    span_summary,
    unit_lower_solve,
)
from shardlm.models.documents import Documents
from shardlm.models.linear_attention import GatedDeltaNet
from shardlm.parallel import ParallelContext
from shardlm.validation import validate

from agreement import rel

HYBRID = {"arch": "llama", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
          "qk_norm": True, "rope_fraction": 0.5, "attention_output_gate": True, "norm_zero_centered": True,
          "layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel": 4}
HYBRID_MOE = {"moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "moe_shared_experts": 1,
              "moe_shared_ffn_hidden_size": 24, "moe_shared_expert_gate": True, "moe_aux_loss_coeff": 0.01}


def hybrid_config(seq: int = 32, dropout: float = 0.0, moe: bool = False, **parallel):
    model = HYBRID | {"seq_length": seq, "vocab_size": VOCAB, "dropout": dropout} | (HYBRID_MOE if moe else {})
    return from_dict({"model": model, "parallel": parallel, "data": {"text_file": "unused"},
                      "train": {"precision": "fp32", "micro_batch_size": 2, "global_batch_size": 2, "steps": 1}})


def rule_inputs(B=2, H=4, T=150, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, H, T, dk, generator=g)) * dk ** -0.5
    k = l2_normalize(torch.randn(B, H, T, dk, generator=g))
    v = torch.randn(B, H, T, dv, generator=g)
    decay = -torch.rand(B, H, T, generator=g) * 0.7
    beta = torch.rand(B, H, T, generator=g)
    return q, k, v, decay, beta


def test_chunked_rule_equals_its_definition_and_transformers_kernel():
    """150 tokens (three chunks of 64, the last padded): the chunked rule equals the token-by-token definition
    within 1e-5 and transformers' torch_chunk_gated_delta_rule (its own normalization and head repeat) within 1e-6."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, decay, beta = rule_inputs()
    out, state = chunk_gated_delta_rule(q, k, v, decay, beta)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, decay, beta)
    assert rel(out, ref_out) < 1e-5 and rel(state, ref_state) < 1e-5
    g = torch.Generator().manual_seed(3)  # raw q and k of 2 key heads for 4 value heads
    raw_q, raw_k = torch.randn(2, 150, 2, 16, generator=g), torch.randn(2, 150, 2, 16, generator=g)
    theirs, their_state = torch_chunk_gated_delta_rule(raw_q, raw_k, v.transpose(1, 2), decay.transpose(1, 2),
                                                       beta.transpose(1, 2), output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    ours_q = (l2_normalize(raw_q) * 16 ** -0.5).repeat_interleave(2, dim=2).transpose(1, 2)
    ours_k = l2_normalize(raw_k).repeat_interleave(2, dim=2).transpose(1, 2)
    ours, our_state = chunk_gated_delta_rule(ours_q, ours_k, v, decay, beta)
    assert (ours.transpose(1, 2) - theirs).abs().max() < 1e-6 and (our_state - their_state).abs().max() < 1e-6


TINY = torch.finfo(torch.float32).tiny


def _subnormal(x: torch.Tensor) -> bool:
    return bool(((x != 0) & (x.abs() < TINY)).any())


def fast_decay_rule(floor: bool = True, flush: bool = True) -> tuple[list[bool], tuple, tuple]:
    """The chunked rule forward and backward on decays of e^-0.7 to e^-31 a token (a random Qwen3.5 layer's), so
    that a chunk's decays reach e^-1000: whether each operand of its GEMMs and triangular solves held a subnormal
    float (a dispatch hook sees every `bmm`, `mm` and `linalg_solve_triangular`), the inputs, and the outputs
    (out, state, gradients). `floor=False` / `flush=False` take `decay_exp`'s floor or `unit_lower_solve`'s
    flush out (the controls)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardlm.models import delta_rule

    g = torch.Generator().manual_seed(5)
    B, H, T, d = 1, 4, 256, 16
    q = (F.normalize(torch.randn(B, H, T, d, generator=g), dim=-1) * d ** -0.5).requires_grad_()
    k = F.normalize(torch.randn(B, H, T, d, generator=g), dim=-1).requires_grad_()
    v = torch.randn(B, H, T, d, generator=g, requires_grad=True)
    decay = (-torch.rand(B, H, T, generator=g) * 30.3 - 0.7).requires_grad_()
    beta = torch.rand(B, H, T, generator=g, requires_grad=True)
    inputs = (q, k, v, decay, beta)
    weights = torch.randn(B, H, T, d, generator=g)
    read = []

    class Operands(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("bmm", "mm", "linalg_solve_triangular"):
                read.extend(_subnormal(a) for a in args[:2] if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    saved = delta_rule.DECAY_FLOOR, delta_rule._flush
    if not floor:
        delta_rule.DECAY_FLOOR = float("-inf")
    if not flush:
        delta_rule._flush = lambda x: x
    try:
        with Operands():
            out, state = chunk_gated_delta_rule(*inputs)
            grads = torch.autograd.grad((out * weights).sum() + state.sum(), inputs)
    finally:
        delta_rule.DECAY_FLOOR, delta_rule._flush = saved
    return read, (inputs, weights), (out, state, grads)


def test_fast_decays_give_the_definition_without_subnormal_gemm_operands():
    """With fast decays (`fast_decay_rule`) the chunked rule still equals the definition, forward and gradients,
    and none of its GEMMs or triangular solves, forward or backward, reads a subnormal float (an x86 CPU multiplies
    those about 20 times slower)."""
    read, (inputs, weights), (out, state, grads) = fast_decay_rule()
    assert read and not any(read)
    ref_out, ref_state = recurrent_gated_delta_rule(*inputs)
    ref_grads = torch.autograd.grad((ref_out * weights).sum() + ref_state.sum(), inputs)
    assert rel(out, ref_out) < 1e-5 and rel(state, ref_state) < 1e-5
    for ours, theirs in zip(grads, ref_grads):
        assert rel(ours, theirs) < 1e-4


@pytest.mark.parametrize("floor,flush", [(False, True), (True, False), (False, False)])
def test_without_the_floor_or_the_flush_the_hook_sees_subnormal_operands(floor, flush):
    """Control: the same rule with `decay_exp`'s floor or `unit_lower_solve`'s flush (or both) taken out gives GEMM
    or solve operands with subnormal floats, and the hook above sees them: its check can fail."""
    read, _, _ = fast_decay_rule(floor, flush)
    assert sum(read) > 0, f"{len(read)} operands, none subnormal"


def test_decay_exp_is_exp_down_to_the_floor_and_zero_below():
    x = torch.tensor([0.0, -1.0, DECAY_FLOOR + 1e-3, DECAY_FLOOR - 1e-3, -95.0, float("-inf")], requires_grad=True)
    y = decay_exp(x)
    assert torch.equal(y[:3], x[:3].exp()) and torch.equal(y[3:], torch.zeros(3))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad[:3], x[:3].exp()) and torch.equal(grad[3:], torch.zeros(3))


def test_unit_lower_solve_is_torchs_solve_with_subnormals_flushed():
    """In float64 (no subnormals in reach) the solve and its gradients are torch.linalg.solve_triangular's to
    1e-12; in float32 with values that underflow, the solution is torch's where that is normal and 0 where it is
    subnormal, and b's gradient has no subnormals either."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(3, 16, 16, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(3, 16, 5, generator=g, dtype=torch.float64)
    weights = torch.randn(3, 16, 5, generator=g, dtype=torch.float64)
    ours = [x.clone().requires_grad_() for x in (a, b)]
    theirs = [x.clone().requires_grad_() for x in (a, b)]
    x_ours = unit_lower_solve(*ours)
    x_theirs = torch.linalg.solve_triangular(*theirs, upper=False, unitriangular=True)
    assert (x_ours - x_theirs).abs().max() < 1e-12
    for one, two in zip(torch.autograd.grad((x_ours * weights).sum(), ours),
                        torch.autograd.grad((x_theirs * weights).sum(), theirs)):
        assert (one - two).abs().max() < 1e-12
    scale = torch.logspace(0, -45, 16, dtype=torch.float32).view(1, 16, 1)  # rows from 1 down to 1e-45
    small_a, small_b = (a.float() * scale).tril(-1), (b.float() * scale).requires_grad_()
    solved = unit_lower_solve(small_a, small_b)
    plain = torch.linalg.solve_triangular(small_a, small_b.detach(), upper=False, unitriangular=True)
    assert _subnormal(plain) and not _subnormal(solved)
    assert torch.equal(solved, plain.masked_fill(plain.abs() < TINY, 0.0))
    (grad_b,) = torch.autograd.grad((solved * weights.float() * 1e-30).sum(), small_b)
    assert not _subnormal(grad_b)


def test_span_summaries_compose_to_the_whole_sequence():
    """Three spans run from a zero state with their summaries, combined in order (what CP ranks do), give the
    whole sequence's outputs and end state; dropping the incoming state (the hand-over) does not."""
    q, k, v, decay, beta = rule_inputs(T=120)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, decay, beta)
    state, outputs, dropped = torch.zeros_like(whole_state), [], []
    for span in (slice(0, 50), slice(50, 70), slice(70, 120)):
        local, q_tilde, local_state, transition = span_summary(*(x[:, :, span] for x in (q, k, v, decay, beta)))
        outputs.append(local + q_tilde @ state)
        dropped.append(local)
        state = carry(state, transition, local_state)
    assert rel(torch.cat(outputs, dim=2), whole) < 1e-5 and rel(state, whole_state) < 1e-5
    assert rel(torch.cat(dropped, dim=2), whole) > 1e-2


def test_causal_conv_equals_depthwise_conv1d_and_reads_the_earlier_inputs():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 30, 12, generator=g), torch.randn(12, 4, generator=g)
    ref = F.silu(F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=3, groups=12)[..., :30]).transpose(1, 2)
    assert (causal_conv(x, weight) - ref).abs().max() < 1e-6
    split = torch.cat((causal_conv(x[:, :17], weight), causal_conv(x[:, 17:], weight, x[:, 14:17])), dim=1)
    assert (split - ref).abs().max() < 1e-6
    assert (torch.cat((causal_conv(x[:, :17], weight), causal_conv(x[:, 17:], weight)), dim=1) - ref).abs().max() > 0.1


def packed_rows():
    """3 packed rows of 40 tokens (documents of 3-25 tokens; every position trained) and their documents."""
    rng = np.random.default_rng(5)
    positions = torch.zeros(3, 40, dtype=torch.long)
    for b in range(3):
        start = 0
        while start < 40:
            length = min(int(rng.integers(3, 26)), 40 - start)
            positions[b, start:start + length] = torch.arange(length)
            start += length
    tokens = torch.from_numpy(rng.integers(0, VOCAB, size=(3, 41)))
    return tokens[:, :-1], tokens[:, 1:], positions


def packed_and_alone(model, ignore_documents_in_linear: bool = False):
    """(loss, gradients) of the packed rows in one forward and of their documents one by one."""
    inputs, labels, positions = packed_rows()
    documents = Documents.from_positions(positions)
    core = GatedDeltaNet.core
    if ignore_documents_in_linear:  # the control: attention keeps the documents, the recurrence does not
        GatedDeltaNet.core = lambda self, mixed, b, a, documents=None, cache=None: core(self, mixed, b, a, None, cache)
    try:
        packed = model(inputs, labels, documents=documents).sum()
    finally:
        GatedDeltaNet.core = core
    packed_grads = torch.autograd.grad(packed, list(model.parameters()))
    alone = sum(model(inputs[b:b + 1, s:e], labels[b:b + 1, s:e]).sum()
                for b, offsets in enumerate(documents.offsets) for s, e in zip(offsets, offsets[1:]))
    alone_grads = torch.autograd.grad(alone, list(model.parameters()))
    assert len(documents.offsets[0]) > 3
    return packed.item(), alone.item(), max(rel(a, b) for a, b in zip(packed_grads, alone_grads))


def test_packed_documents_equal_each_document_alone_and_the_reset_is_needed():
    """The recurrence and the convolution restart at every document: packed rows give the documents' losses
    and gradients run alone (within 1e-5); with the reset removed from the linear layers (attention still
    masked) they do not."""
    model = build_model(hybrid_config(seq=64).model, ParallelContext.single(), seed=3)
    packed, alone, grads = packed_and_alone(model)
    assert abs(packed - alone) <= 1e-5 * abs(alone) and grads <= 1e-5
    packed, alone, grads = packed_and_alone(model, ignore_documents_in_linear=True)
    assert abs(packed - alone) > 1e-4 * abs(alone) and grads > 1e-2


@pytest.mark.parametrize("moe", [False, True])
def test_decoding_token_by_token_equals_the_full_forward(moe):
    """A 70-token prompt (two chunks) then 10 tokens one at a time through the cache (state and convolution
    inputs for the linear layers, keys and values for the full ones): every logit within 1e-5 of one forward."""
    model = build_model(hybrid_config(seq=96, moe=moe).model, ParallelContext.single(), seed=3).eval()
    tokens = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache()
        steps = [model(tokens[:, :70], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache) for t in range(70, 80)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5 * full.abs().max()
    assert type(cache.layers[0]).__name__ == "LayerStateCache" and cache.layers[0].state.shape == (2, 4, 8, 8)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_is_bitwise(recompute):
    """Selective (the convolution and recurrence rerun in the backward) and full recomputation give bitwise the
    loss and gradients of no recomputation, with dropout 0.1 on packed rows."""
    inputs, labels, positions = packed_rows()
    results = []
    for mode in ("none", recompute):
        ctx = ParallelContext.single()
        model = build_model(hybrid_config(seq=64, dropout=0.1).model, ctx, seed=3, recompute=mode).train()
        torch.manual_seed(11)
        loss = model(inputs, labels, documents=Documents.from_positions(positions)).sum()
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    (loss, grads), (again, regrads) = results
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, regrads))


@pytest.mark.parametrize("change,message", [
    ({"linear_num_value_heads": 3}, "is not a multiple of model.linear_num_key_heads=2"),
    ({"linear_num_key_heads": 1, "linear_num_value_heads": 2}, "must both divide by parallel.tensor=2"),
    ({"layer_types": ["linear_attention", "recurrent"] * 2}, "model.layer_types must list 4 entries"),
    ({"linear_key_head_dim": 0}, "need model.linear_num_key_heads"),
    ({"hf_linear_projections": "fused"}, "must be \"separate\" or \"grouped\""),
])
def test_bad_linear_attention_settings_are_one_line_errors(change, message):
    config = hybrid_config(tensor=2)
    for key, value in change.items():
        setattr(config.model, key, value)
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as error:
        validate(config, 2, check_paths=False)
    assert "\n" not in str(error.value)


def test_context_parallel_chunks_shorter_than_the_convolution_are_refused():
    config = hybrid_config(seq=16, context=4)
    with pytest.raises(UserError, match="chunks of 2 tokens, fewer than the convolution's 3 earlier inputs"):
        validate(config, 4, check_paths=False)


def test_the_tiny_qwen35_moe_config_trains(data_dir, tmp_path, capsys):
    """`configs/tiny-qwen3.5-moe.toml` (packed documents) runs two steps from the CLI to finite losses."""
    import json

    from shardlm.cli import main

    text = tmp_path / "corpus.txt"
    text.write_text((data_dir / "corpus" / "tinyshakespeare.txt").read_text()[:20000])
    code = main(["train", "configs/tiny-qwen3.5-moe.toml", f"data.text_file={text}", "model.seq_length=96",
                 "train.steps=2", 'train.precision="fp32"', "train.eval_interval=0", "train.eval_iters=1",
                 "log.progress=false",
                 "log.plot=false", "log.tensorboard=false", "checkpoint.save=false",
                 "--run-dir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("loss" in m and np.isfinite(m["loss"]) for m in metrics) == 2
