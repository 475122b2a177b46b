"""What an implementation's kernels and runtime change in the step time without changing the FLOP count.

The 2019 and SC21 runs (`SC21_KERNELS`) computed attention over the full s x s scores and ran every TP
collective between two GEMMs. Today's Megatron-Core and Meta's Llama 3 stack (`CORE_KERNELS`,
`--implementation megatron-core`) differ in three ways, each from a published description:

- causal flash attention (Dao 2023, FlashAttention-2, section 3.1.1 "causal masking": blocks whose
  keys all follow their queries are skipped, about half of them at long sequences) executes half of
  the attention core's 4 s^2 a FLOPs per layer and sequence (QK^T and PV) forward, and 2.5x that
  backward (it recomputes QK^T), at the kernel's own measured rates (`Calibration.attention_efficiency`,
  `attention_backward_efficiency`); the reported TFLOP/s still count the full square, 12 l a s per
  token, as PaLM's MFU (Chowdhery et al. 2023, appendix B) that the Llama 3 paper cites does;
- context parallelism by all-gathering K and V before attention and reduce-scattering their gradients,
  exposed (the Llama 3 paper, section 3.3.2, chose it over the ring for document masks; GQA keeps K and V
  small), instead of shardlm's ring hidden behind the attention blocks (`context.allgather_seconds`);
- the distributed optimizer's reduce-scatter overlapped with the backward also under a pipeline
  (Megatron-Core's `--overlap-grad-reduce` with interleaving; Meta's FSDP overlaps it too): the
  calibrated `dp_overlap` fraction hides behind the last micro-batch's backward, as without a pipeline.

- FlashAttention-2's backward under grouped-query attention writes dK and dV per query head and sums them
  afterwards (`gqa_expanded_bytes`), a memory-bound pass that grows with the keys a rank attends to.

The TP collectives stay on the critical path in both: Megatron-Core overlaps them only with
`--tp-comm-overlap` (off by default), and the Llama 3 paper describes no such overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.config import ModelConfig
from shardlm.plan.windows import attention_flops_per_key, causal_share, key_share


@dataclass(frozen=True)
class Kernels:
    """Time-relevant behaviour of one implementation's kernels and runtime."""

    causal_skip: bool = False
    """Attention skips the masked half of the s x s blocks (flash attention with a causal mask)."""
    cp_allgather: bool = False
    """Context parallelism all-gathers K and V before attention (exposed) instead of a ring hidden behind it."""
    dp_overlap_pipeline: bool = False
    """The gradient reduce-scatter overlaps the backward also with pipeline stages."""
    fp8_gemms: bool = False
    """The layers' GEMMs run in FP8 at DeepGEMM's measured rates (`fp8`), the rest at the BF16 rates."""
    dualpipe: bool = False
    """DeepSeek-V3's DualPipe schedule: the all-to-all and pipeline transfers hidden behind compute, its bubble
    (PP/2 - 1)(F&B + B - 3W), two copies of the parameters, PP + 1 micro-batches in flight."""
    compute_sm_share: float = 1.0
    """Share of the GPU's SMs left to compute while communication kernels run beside it."""
    moe_dispatch_bytes: float = 0.0
    """Bytes per element of the MoE dispatch (0: the residual dtype's); FP8 with its 1 x 128 scales: 1 + 4/128."""
    recompute_mla_up: bool = False
    """MLA's up-projections (q_b, kv_b) run again in the backward instead of keeping their outputs (with
    `fp8_gemms`, at DeepGEMM's rates)."""
    node_limited_routing: int = 0
    """Each token's experts lie on at most this many nodes and it crosses the network once per remote target
    node, then NVLink takes it to the experts there (DeepSeek-V3's node-limited routing); 0: off."""
    pad_values: bool = False
    """The attention kernel needs the values' head size equal to the queries' and keys' (FlashAttention-2's
    does), so MLA's values run zero-padded to qk_nope + qk_rope: the core executes 2 s^2 H (qk + qk) instead of
    2 s^2 H (qk + v) per layer and sequence (the counted FLOPs stay the model's). Not with sparse attention, whose
    absorbed core has the latents as values (`plan.sparse_attention`; its dense warm-up is padded)."""
    fp8_storage: bool = False
    """DeepSeek-V3's low-precision storage (its report, 3.3.4, and 3.2.3): the layers' saved activations as
    `fp8.fp8_layer_bytes` counts them, AdamW's moments in BF16, and the FP8 casts around the GEMMs
    (`fp8.cast_bytes_per_token`) as memory-bound passes of the step."""

    def counted_attention_flops(self, cfg: ModelConfig, global_batch: int, recompute: bool) -> float:
        """The attention core's FLOPs in `flops_per_step`: 4 s^2 a per layer and sequence forward (QK^T and PV,
        a = heads x head size; MLA: 2 s^2 H (qk + v)), 3x with the backward, 4x when the layers' forward is
        recomputed."""
        per_key = attention_flops_per_key(cfg)  # 4 a; MLA: 2 H (qk + v)
        full = (4 if recompute else 3) * global_batch * cfg.seq_length ** 2 * per_key * cfg.num_layers
        return full * key_share(cfg)  # a sliding layer counts s x min(s, w) (`windows`)

    def attention_seconds(self, cfg: ModelConfig, global_batch: int, recompute: bool, peak_flops: float,
                          forward_efficiency: float, backward_efficiency: float) -> float:
        """GPU-seconds of the step's attention core under a causal flash kernel (`causal_skip`): the forward
        executes half of 4 s^2 a per layer and sequence (w s - w^2 / 2 pairs on a sliding layer, `windows`; again
        when recomputing), at `forward_efficiency` x `peak_flops`; the backward 2.5x the forward's FLOPs (it
        recomputes QK^T: five GEMMs to the forward's two, Dao 2023, FlashAttention-2, section 3.1.2), at
        `backward_efficiency` x `peak_flops`."""
        forward = self.counted_attention_flops(cfg, global_batch, False) / 3 * causal_share(cfg)
        # sparse attention runs absorbed, the latents its values (no padding), except in its dense warm-up
        expanded = cfg.attention == "mla" and (not cfg.index_topk or cfg.index_stage == "warmup")
        if self.pad_values and expanded and cfg.v_head_dim < cfg.qk_nope_head_dim + cfg.qk_rope_head_dim:
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            forward *= 2 * qk / (qk + cfg.v_head_dim)
        passes = 2 if recompute else 1
        return passes * forward / (forward_efficiency * peak_flops) + 2.5 * forward / (backward_efficiency * peak_flops)

    def gqa_expanded_bytes(self, cfg: ModelConfig, tp: int, micro_batch: int, cp: int, element_bytes: int) -> int:
        """HBM bytes one layer's flash backward moves for one micro-batch on one rank beyond its FLOPs under
        grouped-query attention: FlashAttention-2's backward (`mha_bwd` in its `flash_api.cpp`) writes dK and dV per
        query head (`dk_expanded`, `dv_expanded`, b x keys x H/t x d each) and reads them back to sum the heads
        that share a KV head: 4 b keys (H/t) d elements. Keys: the sequence; with the all-gather context
        parallelism the rank's two query chunks attend to T (1 + 1 / 2C) keys in all (chunks r and 2C - 1 - r see
        r + 1 and 2C - r of the 2C chunks). 0 without the flash kernel (`causal_skip`) or without GQA."""
        if not self.causal_skip or cfg.arch != "llama" or cfg.attention == "mla":
            return 0
        heads = cfg.num_heads // tp
        if max(1, cfg.kv_heads // tp) >= heads:
            return 0
        keys = cfg.seq_length if cp == 1 else cfg.seq_length * (2 * cp + 1) // (2 * cp)
        return 4 * micro_batch * keys * heads * cfg.attention_head_dim * element_bytes


SC21_KERNELS = Kernels()
"""Megatron-LM 2019 / 2021 (and shardlm's planning today): full-square attention FLOPs, DP after the flush."""
CORE_KERNELS = Kernels(causal_skip=True, cp_allgather=True, dp_overlap_pipeline=True)
"""Megatron-Core (2024) and Meta's Llama 3 stack: causal flash attention, CP by an exposed K/V all-gather, the
gradient reduce-scatter overlapped."""
DEEPSEEK_KERNELS = Kernels(causal_skip=True, fp8_gemms=True, dualpipe=True, compute_sm_share=112 / 132,
                           moe_dispatch_bytes=1 + 4 / 128, node_limited_routing=4, recompute_mla_up=True,
                           pad_values=True, fp8_storage=True)
"""DeepSeek-V3's stack as its report describes it (sections 3.2 and 3.3): FP8 GEMMs (`fp8`); DualPipe; 20 of an
H800's 132 SMs kept for the all-to-all kernels that run beside the compute (3.2.2); node-limited routing, each
token to at most 4 nodes, sent once per node over InfiniBand and forwarded over NVLink (3.2.2); the dispatch in
FP8 with its scales, the combine in BF16 (3.3.4); MLA's up-projections recomputed in the backward (3.3.4); its
low-precision storage (3.3.4) and the FP8 casts around the GEMMs as separate passes over HBM (3.5.2 describes
them: "read 128 BF16 activation values ... for quantization, and the quantized FP8 values are then written back
to HBM"; in the backward the cached tiles are "read out, dequantized, transposed, re-quantized into 128x1 tiles,
and stored in HBM"). Its attention kernel is taken as a causal flash kernel at FlashAttention-2's measured rates
with the values padded to the keys' head size (the report names none; FlashAttention-2, the public kernel of
2024, takes one head size for q, k and v: Dao-AILab/flash-attention issues 753 and 914, and transformers'
DeepSeek-V3 pads the values the same way for it)."""
