"""The bytes of a LoRA or QLoRA run on one rank (`shardlm.plan.lora` counts what it holds).

- state: the trainable parameters' as any run's (`memory.state_memory`, `fsdp.fsdp_state_memory`: weights, fp32
  gradients, AdamW's moments and steps); the frozen base's fp32 elements, half elements (LoRA under autocast: its
  projection weights) and NF4 tensors among the parameters, with no gradient, moments or master copy;
- FSDP: the frozen base and the NF4 tensors are sharded with the adapters in the same units (a LoRA run marks them
  `frozen_base`): fp32 shards of 4 N / d, half ones of 2 N / d, NF4 bytes / d; a gathered layer holds its NF4
  tensors unsharded;
- activations: a GEMM saves its weight operand for the input's gradient. Under autocast those are half copies (the
  activation model's `weight_cast_bytes`; with half parameters of the frozen weights still in fp32 too, which full
  fine-tuning's half format does not count: `saved_weight_bytes`), except the projection weights stored in half
  (LoRA under autocast), saved as they are, and NF4 weights: dequantized straight into the autocast dtype
  (`nf4.compute_dtype`), they are no cast; dequantized NF4 weights are saved as references and
  dequantized again in the backward (`shardlm.lora.nf4.dequantize_again`), except in a layer recomputed under full
  recomputation, whose GEMMs save them in fp32. The largest layer's dequantized weights are the working copy,
  counted once in fp32 (`working_copy_bytes`; under autocast each is dequantized in fp32, then cast).

Not counted: the adapters' own activations (their r-wide intermediates; with `lora.dropout` the dropped inputs)
and what the frozen GEMMs no longer save (their inputs, needed only for weight gradients): activations are
counted as for full fine-tuning, plus `saved_weight_bytes`.
"""

from __future__ import annotations

from shardlm.config import LoraConfig
from shardlm.models.config import ModelConfig
from shardlm.plan.formats import NumericFormat
from shardlm.plan.fsdp import REDUCE_BYTES, fsdp_state_memory
from shardlm.plan.lora import BASE_BYTES, HALF_BYTES, LoraCount, layer_lora, lora_count
from shardlm.plan.memory import StateMemory, state_memory


def lora_state_memory(count: LoraCount, fmt: NumericFormat, dp: int = 1, distributed_optimizer: bool = False,
                      ep: int = 1) -> StateMemory:
    """Per-rank bytes without FSDP: the trainable parameters' state as any run's (`memory.state_memory`: DDP, or
    the master-weight buffers with half parameters or the distributed optimizer), plus the frozen base's fp32
    elements and NF4 tensors among the parameters (no gradient, no optimizer state)."""
    state = state_memory(count.trainable, fmt, dp, distributed_optimizer, ep=ep)
    return StateMemory(state.parameters + count.base_bytes(), state.gradients, state.optimizer)


def lora_fsdp_state_memory(count: LoraCount, shards: int, expert_shards: int | None = None) -> StateMemory:
    """Per-rank bytes under FSDP: the trainable parameters' fp32 shards, gradients, moments and steps
    (`fsdp.fsdp_state_memory`), and the frozen base sharded in the same units: its fp32 elements (4 / d bytes
    each), its half ones (2 / d) and its NF4 bytes / d, the routed experts' over the `expert_shards` expert-DP ranks
    at EP > 1. Rounded up per part (FSDP pads each tensor's rows to a multiple of d: exact when d divides them)."""
    state = fsdp_state_memory(count.trainable, shards, expert_shards)
    expert_fp32 = count.frozen_expert if expert_shards else 0
    expert_half = count.halved_expert if expert_shards else 0
    expert_nf4 = count.nf4_expert_bytes if expert_shards else 0

    def share(total: int, experts: int) -> int:
        return -(-(total - experts) // shards) + (-(-experts // expert_shards) if experts else 0)

    base = BASE_BYTES * share(count.frozen, expert_fp32) + HALF_BYTES * share(count.halved, expert_half) + \
        share(count.nf4_bytes, expert_nf4)
    return StateMemory(state.parameters + base, state.gradients, state.optimizer)


def lora_fsdp_gathered_bytes(count: LoraCount, gathered_bytes: int, accumulation: int, pipeline: bool = False) -> int:
    """`fsdp.fsdp_gathered_bytes` of a LoRA run: the root and two layers gathered (float elements at w =
    `gathered_bytes` each, a layer's NF4 tensors unsharded and its half projection weights at 2 bytes, as stored),
    unsharded fp32 gradients of the trainable elements only (one layer's, the root's at w; all of them with
    accumulation); with pipeline stages every unit gathered and every trainable gradient unsharded."""
    w = gathered_bytes
    trainable = count.trainable.total
    floats = count.frozen + trainable  # every element not in NF4 or half
    if pipeline:
        return floats * w + count.nf4_bytes + HALF_BYTES * count.halved + REDUCE_BYTES * trainable
    layer_floats, layer_stored, layer_trainable = count.gathered_layer
    root = (count.root_frozen + count.root_trainable) * w + count.root_nf4_bytes + HALF_BYTES * count.root_halved
    gathered = root + 2 * (layer_floats * w + layer_stored)
    if accumulation > 1:
        return gathered + REDUCE_BYTES * trainable
    return gathered + count.root_trainable * w + layer_trainable * REDUCE_BYTES


def saved_weight_bytes(cfg: ModelConfig, lora: LoraConfig, tp: int, ep: int, fmt: NumericFormat,
                       recompute: str = "none") -> int:
    """Bytes one layer's GEMMs save for the backward beyond what `memory.layer_activation_bytes` counts for full
    fine-tuning (whose autocast copies are `fmt.weight_cast_bytes`), of the model's largest layer on a (TP, EP) rank:

    - fp32 (no autocast) with full recomputation: QLoRA's dequantized weights, 4 bytes an NF4 element: a GEMM
      saves its weight operand for the input's gradient, here a new fp32 tensor rather than the parameter. Without
      full recomputation shardlm saves them as references and dequantizes again in the backward
      (`shardlm.lora.nf4.dequantize_again`): nothing;
    - half parameters under autocast: the frozen base's projection weights are stored in half (LoRA,
      `shardlm.lora.apply.store_base_in`) or NF4, dequantized in the autocast dtype (`nf4.compute_dtype`): both saved
      as references. Autocast casts the layer's other GEMM weights, still fp32 (those QLoRA leaves in fp32 too), and
      saves the half copies, `fmt.matmul_bytes` a matrix element;
    - fp32 parameters under autocast: the copies full fine-tuning counts, less the projections' (in half or NF4: no
      cast; negative).
    Under autocast with full recomputation the recomputed layer's GEMMs save the NF4 weights' half values."""
    kinds = {(cfg.is_linear_layer(i), cfg.is_moe_layer(i)): i for i in range(cfg.num_layers)}
    layers = [layer_lora(cfg, lora, i, tp, ep, fmt.half_gemms) for i in kinds.values()]
    if fmt.matmul_bytes == 4:
        if not lora.quantize or recompute != "full":
            return 0
        return BASE_BYTES * max(layer.quantized for layer in layers)
    kept = recompute == "full"  # the recomputed layer's GEMMs save the dequantized half weights themselves
    if fmt.weight_cast_bytes == 0:
        return fmt.matmul_bytes * max(layer.matrix - layer.halved - (0 if kept else layer.quantized)
                                      for layer in layers)
    return -fmt.weight_cast_bytes * min(layer.halved + (0 if kept else layer.quantized) for layer in layers)


def working_copy_bytes(count: LoraCount, fmt: NumericFormat, recompute: str) -> int:
    """The dequantized working copy on a rank: its largest layer's NF4 weights in fp32, counted once (one projection
    is dequantized at a time, in the forward and again in the backward); 0 in fp32 with full recomputation, where
    the recomputed layer's GEMMs save them (`saved_weight_bytes`)."""
    if fmt.matmul_bytes == 4 and recompute == "full":
        return 0
    return BASE_BYTES * count.layer_quantized


def lora_summary(cfg: ModelConfig, lora: LoraConfig, fmt: NumericFormat) -> dict:
    """The whole model's figures (TP = 1, EP = 1, every stage), in elements and bytes, for the report: the
    adapters, the trainable parameters and their AdamW moments, the frozen base (NF4, half and fp32 parts) and the
    largest layer's dequantized working copy."""
    count = lora_count(cfg, lora, 1, half_base=fmt.half_gemms)
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
            "modules_to_save": list(lora.modules_to_save), "quantize": lora.quantize,
            "adapter_parameters": count.adapters, "trainable_parameters": count.trainable.total,
            "trainable_bytes": fmt.weight_bytes * count.trainable.total,
            "adamw_moment_bytes": 8 * count.trainable.total,
            "nf4_parameters": count.quantized, "nf4_bytes": count.nf4_bytes,
            "base_bits_per_weight": count.bits_per_weight,
            "frozen_fp32_parameters": count.frozen, "frozen_fp32_bytes": BASE_BYTES * count.frozen,
            "frozen_half_parameters": count.halved, "frozen_half_bytes": HALF_BYTES * count.halved,
            "dequantized_layer_bytes": BASE_BYTES * count.layer_quantized,
            "dequantized_saved_when_recomputed": bool(lora.quantize) and fmt.matmul_bytes == 4}


def describe_lora(summary: dict) -> str:
    """One line of the plan's text output from `lora_summary`."""
    s, mib = summary, 2 ** 20
    saved = f" + {', '.join(s['modules_to_save'])}" if s["modules_to_save"] else ""
    line = (f"{'QLoRA' if s['quantize'] else 'LoRA'} r={s['rank']} on {', '.join(s['targets'])}{saved} (whole "
            f"model): adapters {s['adapter_parameters']:,} parameters; trained {s['trainable_parameters']:,}, "
            f"{s['trainable_bytes'] / mib:,.1f} MiB, their AdamW moments {s['adamw_moment_bytes'] / mib:,.1f} MiB; "
            "frozen base ")
    fp32 = f"{s['frozen_fp32_parameters']:,}"
    if not s["quantize"] and s["frozen_half_parameters"]:
        half = s["frozen_half_bytes"] / mib
        return line + (f"{s['frozen_half_parameters']:,} projection weights in half ({half:,.1f} MiB), the other "
                       f"{fp32} (embedding, output layer, norms) {s['frozen_fp32_bytes'] / mib:,.1f} MiB in fp32")
    if not s["quantize"]:
        return line + f"{fp32} parameters, {s['frozen_fp32_bytes'] / mib:,.1f} MiB in fp32"
    line += (f"{s['nf4_parameters']:,} projection weights in NF4 at {s['base_bits_per_weight']:.3f} bits a weight "
             f"({s['nf4_bytes'] / mib:,.1f} MiB), the other {fp32} (embedding, output layer, norms) "
             f"{s['frozen_fp32_bytes'] / mib:,.1f} MiB in fp32; the largest layer's weights dequantized (fp32) while "
             f"it computes, counted once: {s['dequantized_layer_bytes'] / mib:,.1f} MiB")
    if s["dequantized_saved_when_recomputed"]:
        line += " (in fp32 with full recomputation the recomputed layer's GEMMs save it: among the activations)"
    return line
