"""What an implementation's kernels and runtime change in the step time without changing the FLOP count.

The 2019 and SC21 runs (`SC21_KERNELS`) computed attention over the full s x s scores and ran every TP
collective between two GEMMs. Today's Megatron-Core and Meta's Llama 3 stack (`CORE_KERNELS`,
`--implementation megatron-core`) differ in two ways, each from a published description:

- causal flash attention (Dao 2023, FlashAttention-2, section 3.1.1 "causal masking": blocks whose
  keys all follow their queries are skipped, about half of them at long sequences) executes half of
  the attention core's 4 s^2 a FLOPs per layer and sequence (QK^T and PV); the reported TFLOP/s still
  count all of them, as Meta's own count does (torchtitan's `get_num_flop_per_token`: 6 x the
  non-embedding parameters + 12 l a s per token, the full square);
- the distributed optimizer's reduce-scatter overlapped with the backward also under a pipeline
  (Megatron-Core's `--overlap-grad-reduce` with interleaving; Meta's FSDP overlaps it too): the
  calibrated `dp_overlap` fraction hides behind the last micro-batch's backward, as without a pipeline.

The TP collectives stay on the critical path in both: Megatron-Core overlaps them only with
`--tp-comm-overlap` (off by default), and the Llama 3 paper describes no such overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.config import ModelConfig


@dataclass(frozen=True)
class Kernels:
    """Time-relevant behaviour of one implementation's kernels and runtime."""

    causal_skip: bool = False
    """Attention skips the masked half of the s x s blocks (flash attention with a causal mask)."""
    dp_overlap_pipeline: bool = False
    """The gradient reduce-scatter overlaps the backward also with pipeline stages."""

    def attention_flops(self, cfg: ModelConfig, global_batch: int, recompute: bool) -> float:
        """FLOPs of the step's attention core the kernel executes (QK^T and PV, 4 s^2 a per layer and sequence
        forward, 3x with the backward, 4x when the layers' forward is recomputed), less the skipped half with
        `causal_skip`."""
        width = cfg.num_heads * cfg.attention_head_dim if cfg.arch == "llama" else cfg.hidden_size
        passes = 4 if recompute else 3
        full = passes * 4 * global_batch * cfg.seq_length ** 2 * width * cfg.num_layers
        return full / 2 if self.causal_skip else full

    def skipped_attention_flops(self, cfg: ModelConfig, global_batch: int, recompute: bool) -> float:
        """FLOPs of the step's attention core that the causal kernel does not execute: half of 4 s^2 a per
        layer and sequence forward (a = heads x head size), 3x that for forward and backward, 4x when the
        layers' forward is recomputed. 0 without `causal_skip`."""
        return self.attention_flops(cfg, global_batch, recompute) if self.causal_skip else 0.0


SC21_KERNELS = Kernels()
"""Megatron-LM 2019 / 2021 (and shardlm's planning today): full-square attention FLOPs, DP after the flush."""
CORE_KERNELS = Kernels(causal_skip=True, dp_overlap_pipeline=True)
"""Megatron-Core (2024) and Meta's Llama 3 stack: causal flash attention, the gradient reduce-scatter overlapped."""

