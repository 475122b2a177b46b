"""Adapters on MoE experts in peft's files: `target_parameters` on transformers' fused expert tensors.

peft adapts a layer's `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (3-D, one matrix per expert) with
lora_A (r E, in) and lora_B (out, r E); shardlm keeps them per expert as `shardlm.lora.experts.ExpertLoRA`'s stacks.
`experts_to_peft` / `experts_from_peft` convert one layer's; `expert_layout` says whether this model's experts
convert and how their tensors read (`ExpertLayout`: gpt-oss's gate and up rows interleave, Nemotron-H's ReLU^2
experts sit under `mixer.` with an `up_proj`); `expert_layers_of` /
`expert_parameters` read and write the `target_parameters` list, every MoE layer's or named layers'
(`lora.expert_layers`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

PREFIX = "base_model.model."
"""peft's prefix of every tensor name in an adapter file."""


@dataclass(frozen=True)
class ExpertLayout:
    """Where a family keeps its fused expert tensors and how their rows read: `module` ("mlp.experts", Nemotron-H's
    "mixer.experts", the same path in shardlm's model and in transformers'), `parameters` (the input side's tensor,
    then the output side's), `gated` (the input side stacks gate and up rows, else one ReLU^2 projection) and
    `interleaved` (gpt-oss's gate and up columns alternate)."""

    module: str = "mlp.experts"
    parameters: tuple[str, str] = ("gate_up_proj", "down_proj")
    gated: bool = True
    interleaved: bool = False

    @property
    def targets(self) -> list[str]:
        """peft's `target_parameters` for every MoE layer's experts."""
        return [f"{self.module}.{name}" for name in self.parameters]


GATED, INTERLEAVED = ExpertLayout(), ExpertLayout(interleaved=True)
RELU_SQUARED = ExpertLayout("mixer.experts", ("up_proj", "down_proj"), gated=False)
"""Nemotron-H's: `up_proj` (E, f, h) and `down_proj` (E, h, f), y = down(relu(up x)^2)."""
LAYOUTS = (GATED, RELU_SQUARED)
"""The distinct `target_parameters` lists (gpt-oss's names are GATED's)."""

EXPERT_PARAMETERS = GATED.targets
"""peft's `target_parameters` for the experts of every family but Nemotron-H (`RELU_SQUARED.targets`). peft nests one
wrapper per parameter in the order the experts module registers them, whatever the list's order (peft writes the list
through a set, so either order): `experts.base_layer.lora_*` adapts the input side (gate_up_proj, Nemotron-H's
up_proj), `experts.lora_*` down_proj."""

EXPERT_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "minimax_m2", "gpt_oss", "deepseek_v3", "deepseek_v2",
                   "mistral4", "deepseek_v32", "kimi_linear", "nemotron_h", "deepseek_v4")
"""The transformers families whose fused experts peft's expert adapters convert for (`hf_kind`'s names, Qwen3.5-MoE's
as "qwen3_moe", the latent attention's: DeepSeek-V3's, V2's and Mistral 4's, DeepSeek-V3.2's and GLM-5's sparse one
as "deepseek_v32", Kimi Linear's, Nemotron-H's and DeepSeek-V4's). Their gate_up_proj stacks the gate rows, then the
up rows (E, 2f, h), except gpt-oss's: (E, h, 2f), x @ W, the gate and up columns interleaved; Nemotron-H's experts are
not gated (`RELU_SQUARED`). peft's factors are the same for both orders of the matrix (A (r E, in), B (out, r E)); only
gpt-oss's B interleaves the gate's and the up's output rows."""
NAMES = ("Qwen3-MoE, Qwen3.5-MoE, Mixtral, GLM-4.5, GLM-5, MiniMax-M2, gpt-oss, DeepSeek-V2, DeepSeek-V3, "
         "DeepSeek-V3.2, DeepSeek-V4, Mistral 4, Kimi Linear and Nemotron-H")


def expert_layers_of(target_parameters: list[str], folder, layouts: tuple[ExpertLayout, ...] = LAYOUTS) -> list[int]:
    """The layers whose experts `target_parameters` adapts: [] for every MoE layer (one of `layouts`' names, or shorter
    suffixes of them, "experts.down_proj": peft matches suffixes), else the layers its entries name
    ("7.mlp.experts.gate_up_proj", as the gpt-oss fine-tuning recipes write them, or "model.layers.7. ..."). UserError
    (one line) unless both fused expert tensors of every named layer are there, in any order."""
    for layout in layouts:
        whole = [next((full for full in layout.targets if full == entry or full.endswith(f".{entry}")), None)
                 for entry in target_parameters]
        if None not in whole and set(whole) == set(layout.targets):
            return []
    for layout in layouts:
        names = "|".join(re.escape(name) for name in layout.targets)
        per_layer = [re.fullmatch(rf"(?:(?:model\.)?layers\.)?(\d+)\.({names})", entry) for entry in target_parameters]
        pairs = {(int(m[1]), m[2]) for m in per_layer if m}
        layers = sorted({layer for layer, _ in pairs})
        if None not in per_layer and layers and pairs == {(i, p) for i in layers for p in layout.targets}:
            return layers
    wanted = " or ".join(" and ".join(layout.targets) for layout in layouts)
    raise UserError(f"checkpoint.init_adapter={folder} adapts the parameters {target_parameters}; shardlm reads "
                    f"expert adapters on both {wanted} (in any order) of this model, of every MoE layer or of the "
                    "layers named (\"7.mlp.experts.gate_up_proj\")")


def expert_parameters(layers: list[int], layout: ExpertLayout = GATED) -> list[str]:
    """peft's `target_parameters` for the experts of `layers` ([]: every MoE layer's)."""
    return [f"{i}.{name}" for i in layers for name in layout.targets] if layers else layout.targets


def expert_keys(layer: int, layout: ExpertLayout = GATED) -> dict[str, str]:
    """peft's names of the expert adapters of layer `layer` (`EXPERT_PARAMETERS`' nesting)."""
    module = f"{PREFIX}model.layers.{layer}.{layout.module}"
    return {"A_in": f"{module}.base_layer.lora_A.weight", "B_in": f"{module}.base_layer.lora_B.weight",
            "A_down": f"{module}.lora_A.weight", "B_down": f"{module}.lora_B.weight"}


def expert_family(cfg: ModelConfig) -> str | None:
    """The transformers family whose fused experts `cfg`'s are (`EXPERT_FAMILIES`), None for others."""
    from shardlm.checkpoint.hf_llama import hf_kind

    if cfg.arch != "llama":  # GPT's experts
        return None
    if cfg.hc_mult:  # its fused experts are DeepSeek-V3's, clipped
        return "deepseek_v4"
    if cfg.layer_pattern:  # Mamba-2, attention, MLP and MoE blocks
        return "nemotron_h"
    # attention layers only, or Qwen3.5-MoE's Gated DeltaNet / Kimi Linear's KDA beside them
    types = set(cfg.layer_types) - {"full_attention", "sliding_attention"}
    linear = types == {"linear_attention"}
    if cfg.attention == "mla":
        if linear and cfg.linear_attention_rule == "kimi_delta":
            return "kimi_linear"
        if types:
            return None
        if cfg.index_topk:  # DeepSeek-V3.2's and GLM-5's experts are DeepSeek-V3's
            return "deepseek_v32"
        softmax = cfg.moe_score == "softmax"  # V2 keeps the top-k as scored, Mistral 4 renormalizes it
        return ("mistral4" if softmax and cfg.moe_norm_topk_prob else "deepseek_v2" if softmax
                else "deepseek_v3" if cfg.moe_score == "sigmoid" else None)
    if not types or (linear and cfg.linear_attention_rule == "gated_delta"):
        return hf_kind(cfg)
    return None


def expert_layout(cfg: ModelConfig) -> ExpertLayout:
    """UserError unless the checkpoint's experts are one of `EXPERT_FAMILIES`'; their `ExpertLayout`."""
    kind = expert_family(cfg)
    if kind not in EXPERT_FAMILIES:
        raise UserError(f"peft expert adapters convert for {NAMES} (transformers' fused expert tensors); this "
                        "checkpoint's experts are another kind")
    return RELU_SQUARED if kind == "nemotron_h" else INTERLEAVED if kind == "gpt_oss" else GATED


def experts_to_peft(layer: int, stacks: dict[str, torch.Tensor], layout: ExpertLayout = GATED
                    ) -> dict[str, torch.Tensor]:
    """One layer's expert adapters -> peft's (lora_A (r E, in) with expert e's rows e r .. e r + r - 1, lora_B (out,
    r E) with expert e's columns e, E + e, ...). Gated: {"A_in": (E, r, h), "B_gate", "B_up": (E, f, r), "A_down":
    (E, r, f), "B_down": (E, h, r)}; gate and up share A, their B rows gate first, or alternating gate, up when
    `layout.interleaved` (gpt-oss). Not gated: {"A_in", "B_fc", "A_proj", "B_proj"}."""
    keys = expert_keys(layer, layout)

    def flat_b(b: torch.Tensor) -> torch.Tensor:  # (E, out, r) -> (out, r E), column k E + e
        return b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()

    def flat_a(a: torch.Tensor) -> torch.Tensor:  # (E, r, in) -> (r E, in)
        return a.reshape(-1, a.shape[-1]).contiguous()

    if not layout.gated:
        return {keys["A_in"]: flat_a(stacks["A_in"]), keys["B_in"]: flat_b(stacks["B_fc"]),
                keys["A_down"]: flat_a(stacks["A_proj"]), keys["B_down"]: flat_b(stacks["B_proj"])}
    gate_up = (torch.stack([stacks["B_gate"], stacks["B_up"]], dim=2).flatten(1, 2) if layout.interleaved
               else torch.cat([stacks["B_gate"], stacks["B_up"]], dim=1))
    return {keys["A_in"]: flat_a(stacks["A_in"]), keys["B_in"]: flat_b(gate_up),
            keys["A_down"]: flat_a(stacks["A_down"]), keys["B_down"]: flat_b(stacks["B_down"])}


def experts_from_peft(layer: int, tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                      layout: ExpertLayout = GATED) -> dict[str, torch.Tensor]:
    """Inverse of `experts_to_peft`, as shardlm's per-expert tensors {"layers.i.<module>.lora.X.e": tensor}."""
    keys, experts, f = expert_keys(layer, layout), cfg.moe_num_experts, cfg.moe_ffn_size

    def stack_b(b: torch.Tensor) -> torch.Tensor:  # (out, r E) -> (E, out, r)
        return b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)

    a_in = tensors[keys["A_in"]].reshape(experts, -1, cfg.hidden_size)
    a_down, b_in = tensors[keys["A_down"]].reshape(experts, -1, f), stack_b(tensors[keys["B_in"]])
    b_down = stack_b(tensors[keys["B_down"]])
    if not layout.gated:
        stacks = {"A_in": a_in, "B_fc": b_in, "A_proj": a_down, "B_proj": b_down}
    else:
        gate, up = (b_in[:, 0::2], b_in[:, 1::2]) if layout.interleaved else (b_in[:, :f], b_in[:, f:])
        stacks = {"A_in": a_in, "B_gate": gate, "B_up": up, "A_down": a_down, "B_down": b_down}
    return {f"layers.{layer}.{layout.module}.lora.{name}.{e}": value[e].contiguous()
            for name, value in stacks.items() for e in range(experts)}
