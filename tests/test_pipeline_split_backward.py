"""PyTorch's split backward (the input step, then the weight step, as the zero-bubble schedules run them) gives a
weight used twice on one path (x @ w @ w, pytorch #180952) and an embedding table that also multiplies the output
(the tied word embedding of a last stage that runs the multi-token-prediction depths) their gradients once, in fp64
within 1e-12 of a plain backward; a weight step that replays the saved gradients without PyTorch's guard counts a
share twice, which the check sees."""

from __future__ import annotations

import torch


class TwiceOnOnePath(torch.nn.Module):
    """x @ w @ w (pytorch #180952), and an embedding lookup feeding an output layer of the same table: the
    tied word embedding of a last stage that also runs the multi-token-prediction depths."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6, 6, generator=gen, dtype=torch.float64))
        self.table = torch.nn.Parameter(torch.randn(10, 6, generator=gen, dtype=torch.float64))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w @ self.w) + self.table[tokens]
        return torch.logsumexp(h @ self.table.t(), dim=-1).sum()


def split_gradients(replay_without_guard: bool = False) -> tuple[torch.Tensor, dict]:
    """The input's and the weights' gradients through PyTorch's split steps (`stage_backward_input`, then
    `stage_backward_weight`), or, with `replay_without_guard`, a weight step that replays the saved gradients
    at every meeting node without PyTorch's guard against counting a descendant's share twice (the bug)."""
    from torch.autograd.graph import GradientEdge
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    model = TwiceOnOnePath()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = model(x, torch.tensor([1, 3, 3, 7]))
    weights = list(model.parameters())
    (dx,), groups = stage_backward_input([loss], None, [x], iter(weights))
    if not replay_without_guard:
        stage_backward_weight(iter(weights), groups)
        return dx, {n: p.grad for n, p in model.named_parameters()}
    for group in groups:
        edges = [GradientEdge(node, i) for grads, node in zip(group["grads"], group["intermediates"])
                 for i, g in enumerate(grads) if g is not None]
        outputs = [g for grads in group["grads"] for g in grads if g is not None]
        params = list(group["params"])
        for node, grad in zip(params, torch.autograd.grad(edges, [GradientEdge(p, 0) for p in params], outputs)):
            owner = next(w for w in weights if w.view_as(w).grad_fn.next_functions[0][0] is node)
            owner.grad = grad if owner.grad is None else owner.grad + grad
    return dx, {n: p.grad for n, p in model.named_parameters()}


def test_split_backward_counts_a_weight_used_twice_once():
    model = TwiceOnOnePath()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model(x, torch.tensor([1, 3, 3, 7])).backward()
    dx, grads = split_gradients()
    assert torch.allclose(dx, x.grad, rtol=1e-12, atol=1e-12)
    for name, param in model.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-12, atol=1e-12), name
    _, unguarded = split_gradients(replay_without_guard=True)
    assert not torch.allclose(unguarded["w"], model.w.grad, rtol=1e-6), "the check could not see the double count"
