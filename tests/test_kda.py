"""Kimi Delta Attention in one process: the chunked rule against transformers' PyTorch rules (outputs, end state and
gradients) and against its own token-by-token definition, the sub-blocked pairwise decay against its elementwise
definition, fast decays without subnormal GEMM operands (and the control without the floor), packed documents
against each document run alone (and the reset removed as the control), decoding against the full forward,
recomputation bitwise, and the one-line errors.

The model of these tests and of `test_kda_layouts.py` (`KIMI`): 4 layers alternating KDA (4 heads of 8 channels,
a kernel of 4) and MLA without positions (4 heads; latent 16, nope 8, rope 4, values 8), dense SwiGLU MLPs; the
MoE variant DeepSeek-style sigmoid routing with a shared expert."""

from __future__ import annotations

import pytest
import torch
from test_linear_attention import packed_rows
from test_training import VOCAB

from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.models import build_model
from shardlm.models.documents import Documents
from shardlm.models.kda_rule import chunk_kda_rule, l2norm, pairwise, recurrent_kda_rule
from shardlm.models.kimi_delta import KimiDeltaAttention
from shardlm.parallel import ParallelContext
from shardlm.validation import validate

from agreement import rel

KIMI = {"arch": "llama", "attention": "mla", "mla_nope": True, "num_layers": 4, "hidden_size": 32, "num_heads": 4,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "layer_types": ["linear_attention", "full_attention"] * 2, "linear_attention_rule": "kimi_delta",
        "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_conv_kernel": 4}
KIMI_MOE = {"moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "moe_shared_experts": 1,
            "moe_score": "sigmoid", "moe_expert_bias": True, "moe_routed_scaling": 2.0, "moe_first_dense_layers": 1}


def kimi_config(seq: int = 32, dropout: float = 0.0, moe: bool = False, **parallel):
    model = KIMI | {"seq_length": seq, "vocab_size": VOCAB, "dropout": dropout} | (KIMI_MOE if moe else {})
    return from_dict({"model": model, "parallel": parallel, "data": {"text_file": "unused"},
                      "train": {"precision": "fp32", "micro_batch_size": 2, "global_batch_size": 2, "steps": 1}})


def rule_inputs(B=2, H=3, T=150, dk=16, dv=24, seed=0, fast: bool = False):
    """Leaves (q, k normalized; v; g per key channel; beta), (B, H, T, .): decays of e^0 to e^-1 a token per channel,
    or with `fast` e^-0.7 to e^-31 (a random layer's: a chunk's decays reach e^-1000)."""
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, H, T, dk, generator=g))
    k = l2norm(torch.randn(B, H, T, dk, generator=g))
    v = torch.randn(B, H, T, dv, generator=g)
    decay = -(torch.rand(B, H, T, dk, generator=g) * 30.3 + 0.7) if fast else -torch.rand(B, H, T, dk, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def with_grads(rule, inputs, weights):
    """(out, state, gradients of sum(out * weights) + sum(state) over the inputs) of `rule(*inputs)`."""
    out, state = rule(*inputs)
    return out, state, torch.autograd.grad((out * weights).sum() + state.sum(), inputs)


def ours(rule, scale):
    return lambda q, k, v, g, beta: rule(q * scale, k, v, g, beta)


def theirs(rule):
    """transformers' rule on shardlm's (B, H, T, .) layout: it scales q itself and returns (B, T, H, d_v)."""
    def run(q, k, v, g, beta):
        out, state = rule(*(x.transpose(1, 2) for x in (q, k, v, g, beta)), initial_state=None,
                          output_final_state=True, use_qk_l2norm_in_kernel=False)
        return out.transpose(1, 2), state
    return run


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_the_rules_equal_transformers(kind):
    """100 tokens (two chunks of 64, the last padded), 3 heads of 16 key and 24 value channels: the chunked rule
    equals transformers' chunk_kimi_delta_attention within 1e-6, the recurrent one its recurrent rule within 1e-5,
    outputs, end states and the gradients of every input."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    inputs = rule_inputs(T=100)
    weights = torch.randn(2, 3, 100, 24, generator=torch.Generator().manual_seed(1))
    rule, reference, bound = ((chunk_kda_rule, hf.chunk_kimi_delta_attention, 1e-6) if kind == "chunk"
                              else (recurrent_kda_rule, hf.recurrent_kimi_delta_attention, 1e-5))
    mine = with_grads(ours(rule, 16 ** -0.5), inputs, weights)
    want = with_grads(theirs(reference), inputs, weights)
    for a, b in zip((mine[0], mine[1], *mine[2]), (want[0], want[1], *want[2])):
        assert (a - b).abs().max() <= bound * max(1.0, b.abs().max().item()), (a - b).abs().max()


@pytest.mark.parametrize("fast", [False, True])
def test_chunked_rule_equals_its_definition(fast):
    """The chunked rule against the token-by-token definition within 1e-5 (outputs, state) and 1e-4 (gradients), on
    slow and on fast decays (where a chunk's pairwise decays span e^0 to e^-1000), from a given incoming state."""
    inputs = rule_inputs(T=100, fast=fast)
    state = torch.randn(2, 3, 16, 24, generator=torch.Generator().manual_seed(2))
    weights = torch.randn(2, 3, 100, 24, generator=torch.Generator().manual_seed(1))
    mine = with_grads(lambda *x: chunk_kda_rule(*x, initial_state=state), inputs, weights)
    want = with_grads(lambda *x: recurrent_kda_rule(*x, initial_state=state), inputs, weights)
    assert rel(mine[0], want[0]) < 1e-5 and rel(mine[1], want[1]) < 1e-5
    assert all(rel(a, b) < 1e-4 for a, b in zip(mine[2], want[2]))


def test_pairwise_equals_its_elementwise_definition():
    """The sub-blocked pairwise decay (through each earlier sub-block's last token) equals sum_c a_i b_j
    exp(G_i - G_j) computed whole, strictly below the diagonal and with it."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 64, 8, generator=g), torch.randn(2, 64, 8, generator=g)
    decay = (-torch.rand(2, 64, 8, generator=g) * 2).cumsum(-2)
    full = (a.unsqueeze(-2) * b.unsqueeze(-3) * (decay.unsqueeze(-2) - decay.unsqueeze(-3)).clamp(max=0).exp()).sum(-1)
    for strict in (True, False):
        want = full.tril(-1 if strict else 0)
        assert (pairwise(a, b, decay, strict) - want).abs().max() < 1e-6


def test_span_summaries_compose_to_the_whole_sequence():
    """Three spans, each run from a zero state with its summary (the per-channel affine hand-over: P S_in +
    S_local), combined in order as CP ranks combine them, give the whole sequence's outputs and end state within
    1e-5, on fast decays too; dropping the incoming state (the hand-over) ends far off."""
    from shardlm.models.delta_rule import carry
    from shardlm.models.kda_rule import kda_span_summary

    for fast in (False, True):
        inputs = [x.detach() for x in rule_inputs(T=120, fast=fast)]
        whole, whole_state = chunk_kda_rule(*inputs)
        state, outputs, dropped = torch.zeros_like(whole_state), [], []
        for span in (slice(0, 50), slice(50, 70), slice(70, 120)):
            local, q_tilde, local_state, transition = kda_span_summary(*(x[:, :, span] for x in inputs))
            outputs.append(local + q_tilde @ state)
            dropped.append(local)
            state = carry(state, transition, local_state)
        assert rel(torch.cat(outputs, dim=2), whole) < 1e-5 and rel(state, whole_state) < 1e-5
        assert rel(torch.cat(dropped, dim=2), whole) > 1e-2 or fast


TINY = torch.finfo(torch.float32).tiny


def subnormal_operands(floor: bool = True) -> list[bool]:
    """The chunked rule, forward and backward, on fast decays: whether each operand of its GEMMs and triangular
    solves held a subnormal float. `floor=False` takes `decay_exp`'s floor out (the control)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardlm.models import delta_rule

    inputs = rule_inputs(B=1, H=2, T=128, fast=True)
    weights = torch.randn(1, 2, 128, 24, generator=torch.Generator().manual_seed(1))
    read = []

    class Operands(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("bmm", "mm", "linalg_solve_triangular"):
                read.extend(bool(((a != 0) & (a.abs() < TINY)).any()) for a in args[:2] if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    saved = delta_rule.DECAY_FLOOR
    delta_rule.DECAY_FLOOR = delta_rule.DECAY_FLOOR if floor else float("-inf")
    try:
        with Operands():
            with_grads(chunk_kda_rule, inputs, weights)
    finally:
        delta_rule.DECAY_FLOOR = saved
    return read


def test_fast_decays_give_no_subnormal_gemm_operands_and_the_control_does():
    """With decays of e^-0.7 to e^-31 a token per channel, no GEMM or triangular solve of the chunked rule, forward or
    backward, reads a subnormal float; with `decay_exp`'s floor taken out some do (the hook can see them)."""
    read = subnormal_operands()
    assert read and not any(read)
    assert sum(subnormal_operands(floor=False)) > 0


def packed_and_alone(model, reset: bool = True):
    """(packed loss, documents-alone loss, largest relative gradient difference) of `packed_rows`; `reset=False`
    runs the KDA layers as if the row were one document (the attention layers keep the documents)."""
    inputs, labels, positions = packed_rows()
    documents = Documents.from_positions(positions)
    core = KimiDeltaAttention.core
    if not reset:
        KimiDeltaAttention.core = lambda self, mixed, b, f, documents=None, cache=None: core(self, mixed, b, f, None,
                                                                                             cache)
    try:
        packed = model(inputs, labels, documents=documents).sum()
    finally:
        KimiDeltaAttention.core = core
    packed_grads = torch.autograd.grad(packed, list(model.parameters()))
    alone = sum(model(inputs[b:b + 1, s:e], labels[b:b + 1, s:e]).sum()
                for b, offsets in enumerate(documents.offsets) for s, e in zip(offsets, offsets[1:]))
    alone_grads = torch.autograd.grad(alone, list(model.parameters()))
    return packed.item(), alone.item(), max(rel(a, b) for a, b in zip(packed_grads, alone_grads))


def test_packed_documents_equal_each_document_alone_and_the_reset_is_needed():
    """The state and the convolution restart at every document: packed rows give the documents' losses and gradients
    run alone (within 1e-5); with the reset removed from the KDA layers they do not."""
    model = build_model(kimi_config(seq=64).model, ParallelContext.single(), seed=3)
    packed, alone, grads = packed_and_alone(model)
    assert abs(packed - alone) <= 1e-5 * abs(alone) and grads <= 1e-5
    packed, alone, grads = packed_and_alone(model, reset=False)
    assert abs(packed - alone) > 1e-4 * abs(alone) and grads > 1e-2


@pytest.mark.parametrize("moe", [False, True])
def test_decoding_token_by_token_equals_the_full_forward(moe):
    """A 70-token prompt (two chunks) then 10 tokens one at a time through the cache (the state and the
    convolution's window for KDA, latents for MLA): every logit within 1e-5 of one forward."""
    model = build_model(kimi_config(seq=96, moe=moe).model, ParallelContext.single(), seed=3).eval()
    tokens = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache()
        steps = [model(tokens[:, :70], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache) for t in range(70, 80)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5 * full.abs().max()
    assert cache.layers[0].state.shape == (2, 4, 8, 8) and cache.layers[0].conv.shape == (2, 3, 96)


def test_recomputation_is_bitwise(monkeypatch):
    """Selective recomputation (the convolution and the rule rerun in the backward) gives bitwise the loss and
    gradients of none, with dropout 0.1 on packed rows; the rerun happened: each KDA core ran twice as often."""
    from shardlm.models.kimi_delta import KimiDeltaAttention

    from layouts import counting

    inputs, labels, positions = packed_rows()
    results, calls, counts = [], {"core": 0}, {}
    monkeypatch.setattr(KimiDeltaAttention, "core", counting(KimiDeltaAttention.core, calls, "core"))
    for mode in ("none", "selective"):
        calls["core"] = 0
        model = build_model(kimi_config(seq=64, dropout=0.1).model, ParallelContext.single(), seed=3,
                            recompute=mode).train()
        torch.manual_seed(11)
        loss = model(inputs, labels, documents=Documents.from_positions(positions)).sum()
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
        counts[mode] = calls["core"]
    assert counts["none"] > 0 and counts["selective"] == 2 * counts["none"], counts
    (loss, grads), (again, regrads) = results
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, regrads))


@pytest.mark.parametrize("change,message", [
    ({"linear_attention_rule": "kda"}, 'must be "gated_delta" or "kimi_delta"'),
    ({"linear_num_key_heads": 2}, "needs as many key as value heads"),
    ({"linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 4}, "needs as many key"),
    ({"attention": "mha", "num_kv_heads": 0}, 'model.mla_nope needs model.attention="mla"'),
    ({"linear_num_key_heads": 3, "linear_num_value_heads": 3}, "must both divide by parallel.tensor=2"),
])
def test_bad_kda_settings_are_one_line_errors(change, message):
    config = kimi_config(tensor=2)
    for key, value in change.items():
        setattr(config.model, key, value)
    with pytest.raises(UserError, match=message) as error:
        validate(config, 2, check_paths=False)
    assert "\n" not in str(error.value)

