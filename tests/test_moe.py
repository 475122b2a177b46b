"""The MoE layer in one process: routing math, the load-balancing losses, grouped GEMMs, training.

Routing and the losses are checked against formulas written out in the tests on small tensors; the
grouped-GEMM experts against the plain per-expert loop (outputs and gradients); tiny MoE GPT and Llama
models (Mixtral-style and DeepSeek-style routing) train for 8 steps with falling losses; bad MoE
configs stop with one-line errors.
"""

from __future__ import annotations

import pytest
import torch
from test_training import ADAM_EPS, VOCAB, synthetic_data

from shardlm.config import from_dict
from shardlm.errors import UserError
from shardlm.models import build_model
from shardlm.models.config import ModelConfig
from shardlm.models.moe import (
    PAD_ROWS,
    GroupedExperts,
    MoELayer,
    balance_losses,
    grouped_mm_applies,
    moe_layers,
    pad_expert_rows,
    route,
)
from shardlm.parallel import ParallelContext
from shardlm.plan.flops import flops_per_token
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from layouts import MIXTRAL, MOE

STEPS = 8


def moe_model_config(arch: str = "gpt", **moe) -> ModelConfig:
    keys = MOE | moe
    return ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=VOCAB,
                       dropout=0.0, **keys)


# ------------------------------------------------------------------------------------------- routing

def test_route_picks_the_top_k_scores_and_normalises_them():
    scores = torch.rand(16, 8, generator=torch.Generator().manual_seed(0)).softmax(-1)
    indices, weights = route(scores, top_k=3, norm_topk_prob=True, scaling=2.5)
    assert torch.equal(indices.sort(1).values, scores.topk(3, dim=1).indices.sort(1).values)
    torch.testing.assert_close(weights.sum(1), torch.full((16,), 2.5))
    expected = scores.gather(1, indices)
    torch.testing.assert_close(weights, 2.5 * expected / expected.sum(1, keepdim=True))
    _, raw = route(scores, top_k=3, norm_topk_prob=False)
    torch.testing.assert_close(raw, expected)


def test_expert_bias_changes_the_selection_but_not_the_weights():
    """A large bias on expert 5 makes every token choose it; its weight is still its unbiased score."""
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    scores = logits.sigmoid()
    bias = torch.zeros(8)
    bias[5] = 100.0
    indices, weights = route(scores, top_k=2, bias=bias, norm_topk_prob=False)
    assert (indices == 5).any(1).all()
    torch.testing.assert_close(weights, scores.gather(1, indices))
    plain, _ = route(scores, top_k=2, norm_topk_prob=False)
    assert not (plain == 5).any(1).all()


def test_group_limited_routing_picks_experts_of_the_best_groups_only():
    """8 experts in 4 groups of 2; a group's score is the sum of its 2 experts; experts come from the best 2 groups."""
    scores = torch.rand(32, 8, generator=torch.Generator().manual_seed(2))
    indices, _ = route(scores, top_k=3, groups=4, topk_groups=2)
    group_scores = scores.view(32, 4, 2).sum(-1)
    best = group_scores.topk(2, dim=1).indices
    for token in range(32):
        allowed = {2 * g + j for g in best[token].tolist() for j in range(2)}
        assert set(indices[token].tolist()) <= allowed
        eligible = torch.full((8,), -1.0)
        eligible[list(allowed)] = scores[token, list(allowed)]
        assert set(indices[token].tolist()) == set(eligible.topk(3).indices.tolist())


def test_aux_and_z_loss_equal_the_formula_computed_by_hand():
    """aux = c E sum_e (n_e / (N k)) (sum_t p_te / N), z = c_z mean_t logsumexp(logits_t)^2, on 5 tokens."""
    logits = torch.tensor([[0.1, 2.0, -1.0], [1.5, 0.2, 0.3], [0.0, 0.0, 3.0], [2.0, 1.0, 0.5], [-0.5, 0.4, 0.1]])
    probs = logits.softmax(-1)
    indices = probs.topk(2, dim=1).indices
    N, E, k = 5, 3, 2
    aux = 0.0
    for e in range(E):
        routed = sum(int(e in indices[t].tolist()) for t in range(N))
        aux += routed / (N * k) * sum(probs[t, e].item() for t in range(N)) / N
    z = sum(torch.logsumexp(logits[t], 0).item() ** 2 for t in range(N)) / N
    got = balance_losses(logits, probs, indices, aux_coeff=0.3, z_coeff=0.05)
    assert got.item() == pytest.approx(0.3 * E * aux + 0.05 * z, rel=1e-6)


def test_router_runs_in_fp32_under_autocast():
    ctx = ParallelContext.single()
    layer = MoELayer(moe_model_config(), ctx, 0, "layers.0.mlp", False, gated=False)
    x = torch.randn(2, 4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, weights, scores, logits = layer.router(x.reshape(-1, 32))
    assert logits.dtype == scores.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(logits, x.reshape(-1, 32) @ layer.router.weight.t())


# ------------------------------------------------------------------------------------------- experts

@pytest.mark.parametrize("gated,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
                         ids=["gelu", "swiglu", "swiglu-bf16"])
def test_grouped_mm_experts_equal_the_per_expert_loop(gated, dtype):
    """Outputs and the gradients of the input and every expert weight, with an expert that gets no token
    (bf16: same kernels' rounding aside, within bf16's resolution)."""
    ctx = ParallelContext.single()
    experts = GroupedExperts(moe_model_config(moe_num_experts=4), ctx, 5, "layers.0.mlp", gated).to(dtype)
    counts = torch.tensor([7, 0, 5, 4])
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    grad = torch.randn(16, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert grouped_mm_applies(x, *experts.parameters())
    results = []
    for grouped in (True, False):
        experts.grouped = grouped
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        out.backward(grad)
        results.append((out.detach(), xi.grad, [p.grad.clone() for p in experts.parameters()]))
    (out_g, dx_g, dw_g), (out_l, dx_l, dw_l) = results
    torch.testing.assert_close(out_g, out_l, **tol)
    torch.testing.assert_close(dx_g, dx_l, **tol)
    for a, b in zip(dw_g, dw_l):
        torch.testing.assert_close(a, b, **tol)
    assert all(w[1].abs().max() == 0 for w in dw_g)  # expert 1 had no token


def test_pad_expert_rows_puts_each_block_at_a_multiple():
    x = torch.arange(1, 11, dtype=torch.float32).view(10, 1)
    padded, counts, keep = pad_expert_rows(x, [3, 0, 4, 3], 4)
    assert counts == [4, 0, 4, 4] and keep.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert padded.view(-1).tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10, 0]
    same, counts, keep = pad_expert_rows(x[:8], [4, 0, 4], 4)  # already at the multiple: untouched
    assert same is x[:8] or torch.equal(same, x[:8])
    assert counts == [4, 0, 4] and keep is None


def expert_results(experts, x, counts, grad):
    experts.zero_grad()
    xi = x.clone().requires_grad_()
    out = experts(xi, counts)
    out.backward(grad)
    return [out.detach(), xi.grad] + [p.grad.clone() for p in experts.parameters()]


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("counts,multiple", [([70, 0, 64, 3], PAD_ROWS), ([7, 0, 5, 4], 16), ([16, 0, 32, 16], 16)],
                         ids=["default", "small", "at-the-multiple"])
def test_padded_expert_rows_change_no_bit(gated, counts, multiple):
    """bf16 grouped GEMMs on the CPU pad each expert's rows with zero rows (few shapes for oneDNN's
    kernel cache): outputs and the gradients of the input and every expert weight are bitwise those of the
    unpadded grouped GEMMs, with an expert that gets no token and blocks already at the multiple, and within
    bf16's resolution of the per-expert loop."""
    dtype = torch.bfloat16
    experts = GroupedExperts(moe_model_config(moe_num_experts=4), ParallelContext.single(), 5, "layers.0.mlp",
                             gated).to(dtype)
    M = sum(counts)
    x = torch.randn(M, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    grad = torch.randn(M, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    counts = torch.tensor(counts)
    assert experts.pad_rows == PAD_ROWS and grouped_mm_applies(x, *experts.parameters())
    experts.pad_rows = multiple
    padded = expert_results(experts, x, counts, grad)
    experts.pad_rows = 0
    unpadded = expert_results(experts, x, counts, grad)
    experts.grouped = False
    loop = expert_results(experts, x, counts, grad)
    for a, b, c in zip(padded, unpadded, loop):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=2e-2, atol=2e-2)
    assert all(w[1].abs().max() == 0 for w in padded[2:])  # expert 1 had no token


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_only_bf16_pads_expert_rows(dtype, monkeypatch):
    """fp32 and fp16 grouped GEMMs on the CPU build no kernel per shape: padding would only add rows."""
    import shardlm.models.moe as moe

    calls, pad = [], moe.pad_expert_rows
    monkeypatch.setattr(moe, "pad_expert_rows", lambda *args: calls.append(args) or pad(*args))
    experts = GroupedExperts(moe_model_config(moe_num_experts=4), ParallelContext.single(), 5, "layers.0.mlp",
                             True)
    x = torch.randn(16, 32)
    for dt in (dtype, torch.bfloat16):
        experts.to(dt)(x.to(dt), torch.tensor([7, 0, 5, 4]))
    assert len(calls) == 1 and calls[0][0].dtype == torch.bfloat16


def test_dispatch_gathers_and_its_gradient_equals_indexing():
    """The local dispatcher's permutations (`permute_rows`, `repeat_rows`, gathers both ways) give the outputs and
    input gradients plain indexing gives (whose backward scatters with accumulation)."""
    from shardlm.parallel.experts import LocalDispatcher

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(12, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    indices = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(12)])  # (12, 2), distinct
    dispatcher = LocalDispatcher(4)
    rows, counts, plan = dispatcher.dispatch(tokens, indices)
    out = dispatcher.combine(rows * torch.arange(1, 25, dtype=torch.float64)[:, None], plan)
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, tokens, grad_out)
    order = torch.argsort(indices.reshape(-1), stable=True)
    ref_rows = tokens[order // 2]
    ref_out = (ref_rows * torch.arange(1, 25, dtype=torch.float64)[:, None])[torch.argsort(order)]
    (ref_grad,) = torch.autograd.grad(ref_out, tokens, grad_out)
    assert torch.equal(rows, ref_rows) and torch.equal(out, ref_out) and counts.tolist() == torch.bincount(
        indices.reshape(-1), minlength=4).tolist()
    assert torch.allclose(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_expert_rows_and_their_gradient_equal_indexing():
    """`expert_rows` (gpt-oss's per-expert biases over each expert's block of rows, an empty block too) gives what
    indexing by each row's expert gives, and the same gradient, summed per block instead of scattered."""
    from shardlm.models.moe import expert_rows

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    counts = [2, 0, 5, 1]
    rows = expert_rows(values, counts)
    ref = values[torch.repeat_interleave(torch.arange(4), torch.tensor(counts))]
    grad_out = torch.randn(rows.shape, generator=generator, dtype=torch.float64)
    assert torch.equal(rows, ref)
    assert torch.allclose(torch.autograd.grad(rows, values, grad_out)[0], torch.autograd.grad(ref, values, grad_out)[0],
                          rtol=1e-12, atol=1e-12)


def test_moe_layer_equals_its_definition():
    """y = sum_j w_j expert_{i_j}(x) + shared(x), each expert an MLP of its own weights, computed token by token."""
    torch.manual_seed(0)
    ctx = ParallelContext.single()
    model = build_model(moe_model_config(moe_shared_experts=1), ctx, seed=3)
    layer = model.layers["0"].mlp
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        y = layer(x)
        indices, weights, _, _ = layer.router(x.reshape(-1, 32))
        fc, proj = layer.experts.fc, layer.experts.proj
        expected = []
        for t, token in enumerate(x.reshape(-1, 32)):
            out = sum(w * proj[e] @ torch.nn.functional.gelu(fc[e] @ token)
                      for e, w in zip(indices[t].tolist(), weights[t]))
            expected.append(out)
        expected = torch.stack(expected).view(2, 3, 32) + layer.shared(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_the_balance_losses_reach_the_gradient():
    """The router's gradient in training mode equals that of (output . g) + the aux + z losses computed explicitly."""
    ctx = ParallelContext.single()
    cfg = moe_model_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    layer = MoELayer(cfg, ctx, 0, "layers.0.mlp", False, gated=True)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
    g = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(6))
    layer.loss_scale = 0.25
    (layer(x) * g).sum().backward()
    attached = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.eval()  # no losses attached: add them by hand
    indices, _, scores, logits = layer.router(x.reshape(-1, 32))
    explicit = (layer(x) * g).sum() + 0.25 * balance_losses(logits, scores, indices, 0.5, 0.1)
    explicit.backward()
    torch.testing.assert_close(attached, layer.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert attached.norm() > 0


def test_dense_layers_and_interval_choose_the_moe_layers():
    cfg = ModelConfig(num_layers=6, moe_num_experts=4, moe_first_dense_layers=1, moe_layer_interval=2)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    model = build_model(moe_model_config(moe_first_dense_layers=1), ParallelContext.single())
    assert [type(b.mlp).__name__ for b in model.layers.values()] == ["ParallelMLP", "MoELayer"]


def test_flops_count_the_activated_experts_not_all_of_them():
    """Llama with 2 layers, the second MoE (8 experts of width 48, top-2, 1 shared): its MLP counts 3 experts'
    SwiGLU matrices and the router; the first layer's dense MLP is unchanged."""
    dense = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=VOCAB,
                        ffn_hidden_size=64)
    moe = ModelConfig(**{**vars(dense), "moe_num_experts": 8, "moe_top_k": 2, "moe_shared_experts": 1,
                         "moe_ffn_hidden_size": 48, "moe_first_dense_layers": 1})
    h = 32
    dense_mlp, moe_mlp = 2 * 3 * h * 64, 2 * (3 * h * 48 * 3 + h * 8)
    assert flops_per_token(moe) == pytest.approx(flops_per_token(dense) + 3 * (moe_mlp - dense_mlp))
    with_all = ModelConfig(**{**vars(moe), "moe_top_k": 8})
    assert flops_per_token(with_all) > flops_per_token(moe)


# ------------------------------------------------------------------------------------------- training

def moe_run_config(arch: str, **moe):
    return from_dict({
        "model": {"arch": arch, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                  "vocab_size": VOCAB, "dropout": 0.0, **MOE, **moe},
        "data": {"text_file": "unused"},
        "train": {"precision": "fp32", "micro_batch_size": 4, "global_batch_size": 8, "steps": STEPS, "lr": 3e-3,
                  "min_lr": 3e-4,
                  "warmup_steps": 2, "clip_grad": 0.5, "adam_eps": ADAM_EPS, "seed": 7},
    })


DEEPSEEK = {"moe_num_experts": 8, "moe_score": "sigmoid", "moe_expert_bias_rate": 0.01, "moe_shared_experts": 1,
            "moe_first_dense_layers": 1, "moe_groups": 4, "moe_topk_groups": 2, "moe_routed_scaling": 2.0}


@pytest.mark.parametrize("arch,moe", [("gpt", MIXTRAL), ("llama", MIXTRAL), ("llama", DEEPSEEK)],
                         ids=["gpt-mixtral", "llama-mixtral", "llama-deepseek"])
def test_tiny_moe_model_trains(arch, moe):
    """8 steps in one process: the loss falls, the aux loss is reported, expert biases move when enabled."""
    config = moe_run_config(arch, **moe)
    validate(config, 1, check_paths=False)
    trainer = Trainer(config, ParallelContext.single(), synthetic_data())
    metrics = [trainer.train_step() for _ in range(STEPS)]
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all("moe_aux_loss" in m and m["expert_load_max"] >= 1.0 for m in metrics)
    if "moe_aux_loss_coeff" in moe:
        assert metrics[0]["moe_aux_loss"] > 0
    routers = [layer.router for layer in moe_layers(trainer.model)]
    if moe.get("moe_expert_bias_rate"):
        assert all(r.expert_bias.abs().max() > 0 for r in routers)
        assert not any(r.expert_bias is p for r in routers for p in trainer.params)  # never in the optimizer


def run_curve(config, steps: int = STEPS):
    trainer = Trainer(config, ParallelContext.single(), synthetic_data())
    curve = [(m["loss"], m["grad_norm"], m["moe_aux_loss"]) for m in (trainer.train_step() for _ in range(steps))]
    return curve, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_trains_bitwise_like_none(recompute):
    """Recomputed MoE layers (DeepSeek-style: aux loss, expert bias) give the same losses, gradient norms,
    aux losses and final parameters, biases included, as no recomputation."""
    base = run_curve(moe_run_config("llama", **DEEPSEEK, moe_aux_loss_coeff=0.01), steps=4)
    config = moe_run_config("llama", **DEEPSEEK, moe_aux_loss_coeff=0.01)
    config.train.recompute = recompute
    curve, params = run_curve(config, steps=4)
    assert curve == base[0]
    assert all(torch.equal(params[name], base[1][name]) for name in params)


@pytest.mark.parametrize("param_dtype", ["fp32", "half"])
def test_bf16_moe_training_runs_with_an_fp32_router(param_dtype):
    """bf16 autocast (grouped bf16 GEMMs) with fp32 or bf16-stored parameters: 8 steps, the loss falls."""
    config = moe_run_config("llama", **MIXTRAL)
    config.train.precision, config.train.param_dtype = "bf16", param_dtype
    curve, _ = run_curve(config)
    assert all(torch.isfinite(torch.tensor(c)).all() for c in curve)
    assert curve[-1][0] < curve[0][0] - 0.3


def test_bf16_training_with_padded_expert_rows_is_bitwise_the_unpadded_one():
    """4 bf16 Trainer steps of a small Mixtral-shaped model (experts get 46-90 rows, padded to 64 and 128):
    every loss and every final parameter equal those of the same run with `pad_rows = 0`."""
    from shardlm.bench.moe import MOE_QUICK

    runs = []
    for pad in (PAD_ROWS, 0):
        trainer = MOE_QUICK.trainer(ParallelContext.single(), precision="bf16")
        for experts in trainer.model.modules():
            if isinstance(experts, GroupedExperts):
                experts.pad_rows = pad
        runs.append(([trainer.train_step()["loss"] for _ in range(4)], list(trainer.model.parameters())))
    (padded, params), (unpadded, reference) = runs
    assert padded == unpadded
    assert all(torch.equal(a, b) for a, b in zip(params, reference))


# ------------------------------------------------------------------------------------------- bad configs

@pytest.mark.parametrize("keys,world,message", [
    ({"moe_top_k": 5}, 1, "model.moe_top_k=5"),
    ({"moe_score": "relu"}, 1, "model.moe_score"),
    ({"moe_groups": 3}, 1, "model.moe_groups=3"),
    ({"moe_groups": 2, "moe_topk_groups": 3}, 1, "model.moe_topk_groups=3"),
    ({"parallel.expert": 3}, 2, "parallel.expert=3"),
    ({"parallel.expert": 2}, 1, "parallel.expert=2 does not divide the data-parallel size 1"),
    ({"parallel.expert": 4, "moe_num_experts": 6}, 2, "model.moe_num_experts=6"),
    ({"arch": "bert"}, 1, "model.moe_num_experts"),
])
def test_bad_moe_configs_give_one_line_errors(keys, world, message):
    config = moe_run_config("gpt")
    for key, value in keys.items():
        section, name = key.split(".") if "." in key else ("model", key)
        setattr(getattr(config, section), name, value)
    with pytest.raises(UserError) as error:
        validate(config, world, check_paths=False)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_expert_size_without_experts_is_refused():
    config = moe_run_config("gpt", moe_num_experts=0)
    config.parallel.expert = 2
    with pytest.raises(UserError, match="parallel.expert=2 needs an MoE model"):
        validate(config, 2, check_paths=False)
