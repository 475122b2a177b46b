"""The suite on every kind of CPU shardlm runs on, from any machine.

Two things differ between CPU kinds. First, the flags: `train.precision = "auto"`, the precision warning and the
bench's precisions and goals decide by them. `SHARDLM_CPU_KIND` (`shardlm.cpu`) makes a process read the flags of
another kind, so the tests of that code take the `cpu_kind` fixture (tests/conftest.py) and run under every kind:
here the precision rules and a whole run with "auto" (a real bf16 run on the kinds that multiply bf16 natively),
in tests/test_bench_goals.py the goals and in tests/test_bench.py the report. `cpu_flags`' own parsing is tested
once on cpuinfo texts and against `lscpu` on this machine.

Second, the kernels: PyTorch picks its vector kernels by the CPU (`ATEN_CPU_CAPABILITY`: `default`, `avx2`,
`avx512`) and MKL its BLAS kernels (`MKL_ENABLE_INSTRUCTIONS`); each sums in its own order, so an fp32 bound that
holds with AVX-512's sums can fail with AVX2's (a bias at 1.1e-5 against 1e-5 on an AVX2-only EPYC, before
`agreement.trained_rel`). Here a representative set of the layout and oracle tests runs again in a fresh pytest
on the AVX2 kernels (`REPRESENTATIVE_TESTS`: LoRA on the experts at EP=2 and TP=2 with SP, QK-clip at TP, CP, PP,
DP, ZeRO-1 and FSDP and with sparse attention at TP and CP, DPO against TRL). Skipped where this process already
runs those kernels (an AVX2-only CPU, or the suite under `ATEN_CPU_CAPABILITY=avx2` or `default`), since the whole
suite is then the check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli_train import write_tiny_config

from shardlm.bench.common import cpu_features, native_precisions
from shardlm.cli import main
from shardlm.cpu import CPU_KIND_ENV, CPU_KINDS, cpu_flags, parse_cpuinfo, simulated_kind
from shardlm.training import cpu_precision

TESTS = Path(__file__).resolve().parent
REPRESENTATIVE_TESTS = [
    "test_qk_clip.py::test_qk_clip_at_two_ranks_equals_one_process",  # QK-clip at TP, CP, PP, DP, ZeRO-1 and FSDP
    # QK-clip with DeepSeek's sparse attention at TP=2 and CP=2: its indexer's norm bias once ended past the bound
    # on an AVX2-only EPYC, at the reach of the layouts' usual learning rate instead of its own
    "test_qk_clip_sparse.py::test_sparse_qk_clip_at_two_ranks_equals_one_process",
    "test_preference_trl.py::test_dpo_follows_trl_step_by_step",  # DPO's losses and rewards against TRL's
]
"""The layout and oracle tests whose fp32 bounds are rerun on the AVX2 kernels (about 20 s on 2 cores): each was
tuned on one kind of kernels and sums over many ranks or steps (TRL's fp32 sums of hundreds of token
log-probabilities, QK-clip's maxima over six layouts). A CI machine with AVX2 only runs the whole suite on these
kernels; this rerun is the developer's early warning on machines with wider units, who reruns the files a change
touches under `ATEN_CPU_CAPABILITY=avx2` by hand."""


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"),
                    reason="this process already runs the AVX2 (or the plain) kernels: the whole suite checks it")
def test_layout_bounds_hold_with_avx2_kernels():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(str(TESTS / test) for test in REPRESENTATIVE_TESTS)],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"under ATEN_CPU_CAPABILITY=avx2:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


# What each kind must give, written from the vendors' feature lists rather than from shardlm's tables:
# (matrix unit the bench names, the precision "auto" picks, whether fp16 matmuls are native)
EXPECTED = {
    "none": ("other", "fp32", False),
    "avx2": ("AVX2", "fp32", False),
    "avx512": ("AVX-512", "fp32", False),
    "avx512_bf16": ("AVX-512-BF16", "bf16", False),
    "amx": ("AMX", "bf16", True),  # Sapphire Rapids has AVX-512-FP16 beside AMX
}


def test_every_kind_has_its_expectation():
    assert set(EXPECTED) == set(CPU_KINDS)


# ------------------------------------------------------------------------------ reading the flags

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile
vmx flags\t: vnmi preemption_timer
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu sse
"""


def test_cpu_flags_reads_the_first_processors_flags_line(tmp_path, monkeypatch):
    monkeypatch.delenv(CPU_KIND_ENV, raising=False)
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_flags(str(path)) == {"fpu", "vme", "sse", "sse2", "avx", "avx2", "avx512f", "avx512_bf16",
                                    "amx_bf16", "amx_tile"}
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo(arm) is None  # ARM names them Features: no x86 flags
    assert cpu_flags(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file() or shutil.which("lscpu") is None,
                    reason="needs Linux's /proc/cpuinfo and lscpu")
def test_cpu_flags_of_this_machine_are_lscpus(monkeypatch):
    """The real parsing once, against another reader of the same CPU (util-linux's lscpu)."""
    monkeypatch.delenv(CPU_KIND_ENV, raising=False)
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"},
                           check=True).stdout.splitlines()
    listed = next((line.split(":", 1)[1].split() for line in lines if line.startswith("Flags:")), None)
    if listed is None:
        pytest.skip("lscpu lists no flags on this CPU")
    assert cpu_flags() == set(listed)


def test_a_simulated_kind_replaces_the_flags_and_a_misspelt_one_is_refused(cpu_kind, monkeypatch):
    assert simulated_kind() == cpu_kind and cpu_flags() == set(CPU_KINDS[cpu_kind])
    monkeypatch.setenv(CPU_KIND_ENV, "avx3")
    with pytest.raises(ValueError, match="SHARDLM_CPU_KIND='avx3' is not a CPU kind; use one of none, avx2"):
        cpu_flags()


def test_the_bench_reads_the_kinds_features_and_runs_bf16_only_where_native(cpu_kind):
    matrix, precision, _ = EXPECTED[cpu_kind]
    features = cpu_features()
    assert (features["matrix"], features["simulated"]) == (matrix, cpu_kind)
    assert features["amx"] == (cpu_kind == "amx") and features["native_bf16"] == (precision == "bf16")
    assert native_precisions(features) == (["fp32", "bf16"] if precision == "bf16" else ["fp32"])
    assert (features["bf16_note"] is None) == (precision == "bf16")


# ------------------------------------------------------------------------------ precision on CPUs

def test_auto_precision_is_bf16_exactly_where_the_cpu_multiplies_it_natively(cpu_kind):
    expected = EXPECTED[cpu_kind][1]
    precision, why = cpu_precision.auto_precision(torch.device("cpu"))
    assert precision == expected, (cpu_kind, why)
    assert ("natively" in why) == (expected == "bf16") and ("emulated" in why) == (expected == "fp32"), why
    # AMX-BF16 alone (a hypervisor that hides the AVX-512-BF16 flag) still multiplies bf16 in hardware
    assert cpu_precision.auto_precision(torch.device("cpu"), flags={"avx2", "avx512f", "amx_bf16"})[0] == "bf16"


def test_precision_warning_names_the_missing_feature_and_the_faster_precision(cpu_kind, monkeypatch):
    monkeypatch.setattr(cpu_precision, "matmul_slowdown", lambda precision: 30.0)
    _, auto, fp16_native = EXPECTED[cpu_kind]
    cpu = torch.device("cpu")
    bf16, fp16 = cpu_precision.precision_warning("bf16", cpu), cpu_precision.precision_warning("fp16", cpu)
    if auto == "bf16":
        assert bf16 is None
    else:
        assert "no native matrix support" in bf16 and "AVX-512-BF16 or AMX-BF16" in bf16 and "30x slower" in bf16
        assert "train.precision=fp32 is faster" in bf16
    if fp16_native:
        assert fp16 is None
    else:
        assert "AVX-512-FP16 or AMX-FP16" in fp16
        assert f"train.precision={'bf16' if auto == 'bf16' else 'fp32'} is faster" in fp16
    assert cpu_precision.precision_warning("fp32", cpu) is None
    assert cpu_precision.precision_warning("fp16", torch.device("cuda")) is None


def test_auto_precision_on_gpus_and_unreadable_cpus(monkeypatch):
    cuda = torch.device("cuda")
    assert cpu_precision.auto_precision(cuda, cuda_bf16=True)[0] == "bf16"
    assert cpu_precision.auto_precision(cuda, cuda_bf16=False)[0] == "fp32"
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: None)
    precision, why = cpu_precision.auto_precision(torch.device("cpu"))
    assert precision == "fp32" and "could not be read" in why


def test_resolve_precision_keeps_a_named_precision_and_fills_in_auto(cpu_kind):
    from shardlm.config import TrainConfig

    assert TrainConfig().precision == "auto"
    named = TrainConfig(precision="bf16")
    assert cpu_precision.resolve_precision(named, torch.device("cpu")) is None and named.precision == "bf16"
    auto, expected = TrainConfig(), EXPECTED[cpu_kind][1]
    line = cpu_precision.resolve_precision(auto, torch.device("cpu"))
    assert auto.precision == expected
    assert line.startswith(f'train.precision="auto": {expected}: this CPU '
                           + ("multiplies bf16 natively (" if expected == "bf16" else "has no AVX-512-BF16")), line


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, data_dir):
    return write_tiny_config(tmp_path_factory.mktemp("kinds"), data_dir, plot=False)


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if "loss" in record]


def test_a_run_with_auto_precision_says_its_choice_first_and_trains_in_it(cpu_kind, config_file, tmp_path, capsys):
    """A whole `shardlm train` with "auto" on each kind: the first line names the choice, config.json records it,
    and on the kinds with native bf16 the run really is a bf16 run (autocast in bf16: its loss differs from an
    fp32 run's on the same data, and stays finite)."""
    expected = EXPECTED[cpu_kind][1]
    run_dir = tmp_path / "run"
    assert main(["train", str(config_file), "parallel.tensor=1", "train.precision=auto", "train.steps=2",
                 "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f'shardlm: train.precision="auto": {expected}: this CPU'), out
    assert json.loads((run_dir / "config.json").read_text())["train"]["precision"] == expected
    losses = _losses(run_dir)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    if expected == "bf16":
        fp32_dir = tmp_path / "fp32"
        assert main(["train", str(config_file), "parallel.tensor=1", "train.precision=fp32", "train.steps=2",
                     "--run-dir", str(fp32_dir)]) == 0
        fp32 = _losses(fp32_dir)
        assert losses != fp32 and losses == pytest.approx(fp32, rel=0.05), (losses, fp32)


def test_train_in_fp16_on_a_cpu_without_fp16_matmuls_says_so_once_and_keeps_fp16(config_file, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv(CPU_KIND_ENV, "avx2")  # a CPU without the feature
    run_dir = tmp_path / "run"
    assert main(["train", str(config_file), "parallel.tensor=1", "train.precision=fp16", "train.steps=1",
                 "--run-dir", str(run_dir)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "no native matrix support" in line]
    assert warnings == [warnings[0]] and warnings[0].startswith('shardlm: train.precision="fp16"'), err
    assert json.loads((run_dir / "config.json").read_text())["train"]["precision"] == "fp16"


def _auto_precision_on_rank(kind_by_rank: list[str]) -> tuple[str, str]:
    """Worker: this rank's CPU is of kind `kind_by_rank[rank]`; the agreed (precision, line) of an "auto" config."""
    from shardlm.config import TrainConfig

    os.environ[CPU_KIND_ENV] = kind_by_rank[torch.distributed.get_rank()]
    train = TrainConfig()
    line = cpu_precision.resolve_precision(train, torch.device("cpu"), all_ranks=True)
    return train.precision, line


@pytest.mark.timeout(120)
def test_ranks_on_different_cpu_kinds_agree_on_auto_precision():
    """A job across machines of different CPU kinds trains in one precision: bf16 only where every rank multiplies
    it natively; a rank that could have used bf16 says why it did not."""
    from shardlm.parallel.spawn import run_workers

    for kinds, expected in ((["amx", "avx512_bf16", "amx"], "bf16"), (["amx", "avx2", "amx"], "fp32"),
                            (["avx512", "amx", "avx512_bf16"], "fp32")):
        results = run_workers(3, _auto_precision_on_rank, kinds)
        assert [precision for precision, _ in results] == [expected] * 3, (kinds, results)
        for (_, line), kind in zip(results, kinds):
            if expected == "fp32" and EXPECTED[kind][1] == "bf16":
                assert "another rank's device would emulate bf16" in line, line
            else:
                assert line.startswith(f'train.precision="auto": {expected}: this CPU'), line
