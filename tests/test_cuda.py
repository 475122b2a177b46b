"""The CUDA path, for sessions with a GPU (skipped without one): the same tiny GPT trained for 6 steps on
the GPU and on the CPU gives fp32 losses within 1e-4 (relative, TF32 off), bf16 autocast trains (its last
loss below its first), and the fused output layer + cross-entropy equals the unfused computation on the
GPU, in one chunk and in several. Run with
`pytest tests/test_cuda.py` on a GPU machine. (Collectives of a one-GPU world are no-ops, so
checking NCCL itself needs a machine with two or more GPUs.)"""

from __future__ import annotations

import pytest
import torch
from test_linear_cross_entropy import _inputs, _run
from test_training import synthetic_data, tiny_config

import shardlm.parallel.linear_cross_entropy as fused_module
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 6


def losses(device: str, precision: str = "fp32") -> list[float]:
    ctx = ParallelContext.single(torch.device(device))
    trainer = Trainer(tiny_config(precision=precision), ctx, synthetic_data())
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


@pytest.fixture(autouse=True)
def exact_fp32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def test_fp32_training_on_the_gpu_matches_the_cpu():
    gpu, cpu = losses("cuda"), losses("cpu")
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(gpu, cpu)), (gpu, cpu)


def test_bf16_training_learns():
    bf16 = losses("cuda", "bf16")
    assert bf16[-1] < bf16[0], bf16


@pytest.mark.parametrize("rows_per_chunk", [None, 5])
def test_fused_linear_cross_entropy_on_the_gpu_equals_unfused(monkeypatch, rows_per_chunk):
    if rows_per_chunk:
        monkeypatch.setattr(fused_module, "_rows_per_chunk", lambda vocab, device: rows_per_chunk)
    inputs = [x.cuda() for x in _inputs(rows=64)]
    for a, b in zip(_run(True, *inputs, "fp32"), _run(False, *inputs, "fp32")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
