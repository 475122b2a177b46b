"""The MoE bench says which precision each program's experts ran in: measured in a training step, since
under autocast transformers' grouped-GEMM experts do not run in the autocast dtype."""

from __future__ import annotations

import pytest

from shardlm.bench.moe import (
    MOE_QUICK,
    all_to_all_formula,
    expert_gemm_dtypes,
    expert_parallel,
    hf_step,
    markdown_lines,
)
from shardlm.parallel import ParallelContext

pytest.importorskip("transformers")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_expert_gemm_dtypes_are_measured_in_a_step(precision):
    """shardlm's experts and transformers' per-expert loop run in the step's precision; transformers'
    `grouped_mm` experts cast their input to the (fp32) weights' dtype, so they run in fp32 in a bf16 step."""
    trainer = MOE_QUICK.trainer(ParallelContext.single(), precision=precision)
    hf, shipped = hf_step(MOE_QUICK, "grouped_mm", precision)
    eager, _ = hf_step(MOE_QUICK, "eager", precision)
    assert shipped == "grouped_mm"
    assert expert_gemm_dtypes(trainer.model, "GroupedExperts", trainer.train_step) == precision
    assert expert_gemm_dtypes(hf.model, "MixtralExperts", hf) == "fp32"
    assert expert_gemm_dtypes(eager.model, "MixtralExperts", eager) == precision


def test_the_report_states_the_experts_precision():
    rate = {"median": 1.0, "min": 1.0, "max": 1.0, "values": [1.0]}
    figures = {"shardlm_tokens_per_sec": rate, "hf_tokens_per_sec": rate, "hf_eager_tokens_per_sec": rate,
               "ratio": rate, "ratio_eager": rate, "hf_experts_implementation": "grouped_mm",
               "experts_dtype": {"shardlm": "bf16", "hf": "fp32", "hf_eager": "bf16"}}
    ep = {"config": "c", "one_process_tokens_per_sec": rate, "ep2_tokens_per_sec": rate, "ep2_efficiency": rate,
          "dp2_tokens_per_sec": rate, "dp2_efficiency": rate,
          "all_to_all": {"measured": {"bytes": 1, "calls_per_rank": [1, 1]}, "matches_formula": True,
                         "formula": {"bytes": 1, "bytes_per_layer": 1, "calls_per_rank": 1}}}
    lines = markdown_lines({"single_process": {"config": "c", "precisions": ["bf16"], "bf16": figures},
                            "expert_parallel": ep})
    assert any(line.startswith("| bf16 |") and line.endswith("| grouped_mm | bf16 / fp32 / bf16 |") for line in lines)


def test_bf16_expert_parallel_all_to_all_bytes_equal_the_formula():
    """Under bf16 autocast an EP=2 step dispatches its tokens in fp32 and combines the experts' outputs in
    bf16: the bytes summed over the group equal the formula with 4 and 2 bytes a value."""
    result = expert_parallel(MOE_QUICK, 1, "bf16")
    a2a = result["all_to_all"]
    assert result["precision"] == "bf16" and a2a["matches_formula"] is True, a2a
    assert a2a["measured"]["bytes"] == all_to_all_formula(MOE_QUICK, combine_bytes=2)["bytes"] \
        < all_to_all_formula(MOE_QUICK)["bytes"]
