"""The layout tests' bounds hold on the AVX2 kernels too, not only on the AVX-512 ones most of them were written on.

PyTorch picks its vector kernels by the CPU (`ATEN_CPU_CAPABILITY`: `default`, `avx2`, `avx512`) and MKL
its BLAS kernels (`MKL_ENABLE_INSTRUCTIONS`); each sums in its own order, so an fp32 bound that holds with
AVX-512's sums can fail with AVX2's (a bias at 1.1e-5 against 1e-5 on an AVX2-only EPYC, before
`agreement.trained_rel`). Here a representative set of the layout tests runs again in a fresh pytest on the
AVX2 kernels: the packed SFT rows at every layout and family (`test_sft_layouts`: DP, TP+SP (the paper's TP x
DP among them), PP with virtual stages, CP, FSDP, ZeRO, EP; GPT, Llama, MLA with MTP, gpt-oss). Skipped where
this process already runs those kernels (an AVX2-only CPU, or the suite under `ATEN_CPU_CAPABILITY=avx2` or
`default`), since the whole suite is then the check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
REPRESENTATIVE = ["test_sft_layouts.py"]


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"),
                    reason="this process already runs the AVX2 (or the plain) kernels: the whole suite checks it")
def test_layout_bounds_hold_with_avx2_kernels():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(str(TESTS / name) for name in REPRESENTATIVE)],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"under ATEN_CPU_CAPABILITY=avx2:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
