"""`train.compile` turns each transformer layer into one graph, forward and backward, at one process.

A call that TorchDynamo may not trace (a `torch.compiler.disable`d function) splits a layer into several graphs,
and each boundary costs copies of the activations that cross it and casts that no longer fuse. QK-clip's hook
did that to every attention layer while it tracked nothing, and made the GPT-2 1.5B step on an H200 5% slower
(issue 66: 768 extra copy kernels per optimizer step, 4 per layer per micro-batch) without any test noticing.
Here each family's layer (GPT; Llama with GQA and Qwen3's q/k norms; DeepSeek's MLA) is compiled as `train.compile`
does it and must run as one compiled function each way (no graph break), copy no more tensors than
the eager layer does, and give the eager layer's output and gradients within 1e-5 (fp32). With QK-clip
tracking on, the compiled layer records the eager layer's per-head maxima (its update stays outside the graph).
A world of one process; tensor parallelism's collectives are graph breaks by design and are not counted here.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from shardlm.config import from_dict
from shardlm.models import build_model
from shardlm.parallel import ParallelContext
from shardlm.training.parallelize import can_compile, inductor_cache_per_cpu_kind
from shardlm.training.qk_clip import attention_layers, track_max_logits

from multiproc import needs

pytestmark = [needs(can_compile(torch.device("cpu")), "a C++ compiler (torch.compile on the CPU)"),
              pytest.mark.timeout(300)]

HIDDEN, SEQ, TOL = 32, 16, 1e-5
BASE = {"num_layers": 1, "hidden_size": HIDDEN, "num_heads": 4, "seq_length": SEQ, "vocab_size": 64,
        "dropout": 0.0}
FAMILIES = {
    "gpt": {},
    "qwen3": {"arch": "llama", "num_kv_heads": 2, "qk_norm": True, "ffn_hidden_size": 64},
    "mla": {"arch": "llama", "attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8, "v_head_dim": 8, "ffn_hidden_size": 64},
}
COPIES = ("aten::copy_", "aten::clone", "aten::contiguous")


def one_layer(family: str) -> torch.nn.Module:
    """The first transformer layer of a one-layer model of `family`, in training mode."""
    cfg = from_dict({"model": {**BASE, **FAMILIES[family]}, "data": {"text_file": "unused"}}).model
    return next(iter(build_model(cfg, ParallelContext.single(), seed=3).layers.values())).train()


def step(layer, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The layer's output for x (B, T, h) and the gradients of a fixed functional of it (input and parameters),
    the parameters' gradients cleared first."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = layer(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), {"input": x.grad, **grads}


def counted(fn) -> dict[str, int]:
    """Operator name -> calls, for one run of `fn` under the profiler."""
    with profile() as prof:
        fn()
    return {event.key: event.count for event in prof.key_averages()}


@pytest.fixture(scope="module", params=list(FAMILIES))
def compiled(request):
    """(family, eager layer, compiled layer of the same module, input), the compiled one warmed up."""
    torch.manual_seed(0)
    layer = one_layer(request.param)
    x = torch.randn(2, SEQ, HIDDEN)
    torch._dynamo.reset()
    inductor_cache_per_cpu_kind()  # as `train.compile` does: a run under ATEN_CPU_CAPABILITY keeps its own kernels
    fn = torch.compile(layer)  # as `train.compile` does (`Module.compile`): a graph break would split it
    step(fn, x)
    return request.param, layer, fn, x


def test_a_layer_is_one_graph_each_way(compiled):
    family, _, fn, x = compiled
    calls = counted(lambda: step(fn, x))
    graphs = calls.get("CompiledFunction", 0), calls.get("CompiledFunctionBackward", 0)
    assert graphs == (1, 1), f"{family}: {graphs} compiled graphs (forward, backward) in one layer"


def test_a_compiled_layer_copies_no_more_than_eager(compiled):
    family, layer, fn, x = compiled
    step(layer, x)
    eager = counted(lambda: step(layer, x))
    ours = counted(lambda: step(fn, x))
    assert sum(ours.get(k, 0) for k in COPIES) <= sum(eager.get(k, 0) for k in COPIES), (family, ours, eager)


def test_a_compiled_layer_equals_eager(compiled):
    family, layer, fn, x = compiled
    (out, grads), (out_eager, grads_eager) = step(fn, x), step(layer, x)
    assert torch.allclose(out, out_eager, rtol=TOL, atol=TOL), family
    for name, grad in grads.items():
        assert torch.allclose(grad, grads_eager[name], rtol=TOL, atol=TOL * grad.abs().max()), (family, name)


@pytest.mark.parametrize("compiled", ["gpt"], indirect=True)
def test_qk_clip_tracking_still_records_under_compile(compiled):
    """The tracked maxima of the compiled layer equal the eager layer's (the update runs outside the graph, so the
    layer is compiled as `train.compile` does it, graph breaks allowed): GPT's layer, whose hook once split it (each
    family's tracking hook is the same function on its own scores, a compilation of its own here;
    `tests/test_qk_clip.py` tracks every family eagerly at every layout)."""
    family, layer, _, x = compiled
    attention = attention_layers(layer)
    maxima = []
    for run in (layer, torch.compile(layer)):
        track_max_logits(layer)
        step(run, x)
        maxima.append(torch.cat([m.max_logits.clone() for m in attention]))
        for m in attention:
            m.max_logits = None
    assert torch.isfinite(maxima[0]).all(), family
    assert torch.allclose(maxima[1], maxima[0], rtol=TOL, atol=TOL), (family, maxima)
