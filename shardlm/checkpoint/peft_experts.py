"""Adapters on MoE experts in peft's files: `target_parameters` on transformers' fused expert tensors.

peft adapts a layer's `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (3-D, one matrix per expert) with
lora_A (r E, in) and lora_B (out, r E); shardlm keeps them per expert as `shardlm.lora.experts.ExpertLoRA`'s stacks.
`experts_to_peft` / `experts_from_peft` convert one layer's; `check_expert_family` says whether this model's
experts convert (and whether their gate and up rows interleave, gpt-oss's); `expert_layers_of` /
`expert_parameters` read and write the `target_parameters` list, every MoE layer's or named layers'
(`lora.expert_layers`).
"""

from __future__ import annotations

import re

import torch

from shardlm.errors import UserError
from shardlm.models.config import ModelConfig

PREFIX = "base_model.model."
"""peft's prefix of every tensor name in an adapter file."""

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""peft's `target_parameters` for the experts: transformers' fused expert tensors (`EXPERT_FAMILIES`). peft nests
one wrapper per parameter in the order the experts module registers them, whatever the list's order (peft writes
the list through a set, so either order): `experts.base_layer.lora_*` adapts gate_up_proj, `experts.lora_*`
down_proj."""

EXPERT_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "minimax_m2", "gpt_oss", "deepseek_v3", "deepseek_v2",
                   "mistral4")
"""The transformers families whose fused experts peft's expert adapters convert for (`hf_kind`'s names, Qwen3.5-MoE's
as "qwen3_moe", and the latent attention's: DeepSeek-V3's, V2's and Mistral 4's). Their gate_up_proj stacks the gate
rows, then the up rows (E, 2f, h), except gpt-oss's: (E, h, 2f), x @ W, the gate and up columns interleaved. peft's
factors are the same for both orders of the matrix (A (r E, in), B (out, r E)); only gpt-oss's B interleaves the
gate's and the up's output rows."""


def expert_layers_of(target_parameters: list[str], folder) -> list[int]:
    """The layers whose experts `target_parameters` adapts: [] for every MoE layer (`EXPERT_PARAMETERS`' names or a
    shorter suffix of them, "experts.down_proj": peft matches suffixes), else the layers its entries name
    ("7.mlp.experts.gate_up_proj", as the gpt-oss fine-tuning recipes write them, or "model.layers.7. ..."). UserError
    (one line) unless both fused expert tensors of every named layer are there, in any order."""
    whole = [next((full for full in EXPERT_PARAMETERS if full == entry or full.endswith(f".{entry}")), None)
             for entry in target_parameters]
    if None not in whole and set(whole) == set(EXPERT_PARAMETERS):
        return []
    per_layer = [re.fullmatch(r"(?:(?:model\.)?layers\.)?(\d+)\.(mlp\.experts\.(?:gate_up_proj|down_proj))", entry)
                 for entry in target_parameters]
    pairs = {(int(m[1]), m[2]) for m in per_layer if m}
    layers = sorted({layer for layer, _ in pairs})
    if None in per_layer or not layers or pairs != {(i, p) for i in layers for p in EXPERT_PARAMETERS}:
        raise UserError(f"checkpoint.init_adapter={folder} adapts the parameters {target_parameters}; shardlm reads "
                        f"expert adapters on both {EXPERT_PARAMETERS[0]} and {EXPERT_PARAMETERS[1]} (in any order), "
                        "of every MoE layer or of the layers named (\"7.mlp.experts.gate_up_proj\")")
    return layers


def expert_parameters(layers: list[int]) -> list[str]:
    """peft's `target_parameters` for the experts of `layers` ([]: every MoE layer's)."""
    return [f"{i}.{name}" for i in layers for name in EXPERT_PARAMETERS] if layers else list(EXPERT_PARAMETERS)


def expert_keys(layer: int) -> dict[str, str]:
    """peft's names of the expert adapters of layer `layer` (`EXPERT_PARAMETERS`' nesting)."""
    module = f"{PREFIX}model.layers.{layer}.mlp.experts"
    return {"A_gate_up": f"{module}.base_layer.lora_A.weight", "B_gate_up": f"{module}.base_layer.lora_B.weight",
            "A_down": f"{module}.lora_A.weight", "B_down": f"{module}.lora_B.weight"}


def check_expert_family(cfg: ModelConfig) -> bool:
    """UserError unless the checkpoint's experts are one of `EXPERT_FAMILIES`'; whether their gate and up rows
    interleave (gpt-oss)."""
    from shardlm.checkpoint.hf_llama import hf_kind

    kind = None
    # attention layers only, or Qwen3.5-MoE's Gated DeltaNet beside them; Kimi Linear's KDA and Nemotron-H's Mamba-2
    # hybrids are not checked yet
    types = set(cfg.layer_types) - {"full_attention", "sliding_attention"}
    gated_delta = types == {"linear_attention"} and cfg.linear_attention_rule == "gated_delta"
    plain = cfg.arch == "llama" and not cfg.layer_pattern and (not types or gated_delta)
    if plain and cfg.attention == "mla" and not types:  # DeepSeek-V2 / V3, Mistral 4; V3.2's sparse one: not yet
        softmax = cfg.moe_score == "softmax"  # V2 keeps the top-k as scored, Mistral 4 renormalizes it
        kind = (None if cfg.index_topk else "mistral4" if softmax and cfg.moe_norm_topk_prob
                else "deepseek_v2" if softmax else "deepseek_v3" if cfg.moe_score == "sigmoid" else None)
    elif plain and cfg.attention != "mla":
        kind = hf_kind(cfg)
    if kind not in EXPERT_FAMILIES:
        raise UserError("peft expert adapters convert for Qwen3-MoE, Qwen3.5-MoE, Mixtral, GLM-4.5, MiniMax-M2, "
                        "gpt-oss, DeepSeek-V2, DeepSeek-V3 and Mistral 4 (transformers' gate_up_proj and down_proj); "
                        "this checkpoint's experts are another kind")
    return kind == "gpt_oss"


def experts_to_peft(layer: int, stacks: dict[str, torch.Tensor], interleaved: bool = False
                    ) -> dict[str, torch.Tensor]:
    """One layer's expert adapters ({"A_in": (E, r, h), "B_gate", "B_up": (E, f, r), "A_down": (E, r, f),
    "B_down": (E, h, r)}) -> peft's (lora_A (r E, in) with expert e's rows e r .. e r + r - 1, lora_B (out, r E)
    with expert e's columns e, E + e, ...; gate and up share A, their B rows gate first, or alternating gate, up
    when `interleaved` (gpt-oss))."""
    keys = expert_keys(layer)

    def flat_b(b: torch.Tensor) -> torch.Tensor:  # (E, out, r) -> (out, r E), column k E + e
        return b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()

    return {keys["A_gate_up"]: stacks["A_in"].reshape(-1, stacks["A_in"].shape[-1]).contiguous(),
            keys["B_gate_up"]: flat_b(torch.stack([stacks["B_gate"], stacks["B_up"]], dim=2).flatten(1, 2)
                                      if interleaved else torch.cat([stacks["B_gate"], stacks["B_up"]], dim=1)),
            keys["A_down"]: stacks["A_down"].reshape(-1, stacks["A_down"].shape[-1]).contiguous(),
            keys["B_down"]: flat_b(stacks["B_down"])}


def experts_from_peft(layer: int, tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                      interleaved: bool = False) -> dict[str, torch.Tensor]:
    """Inverse of `experts_to_peft`, as shardlm's per-expert tensors {"layers.i.mlp.experts.lora.X.e": tensor}."""
    keys, experts, f = expert_keys(layer), cfg.moe_num_experts, cfg.moe_ffn_size

    def stack_b(b: torch.Tensor) -> torch.Tensor:  # (out, r E) -> (E, out, r)
        return b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)

    a_in = tensors[keys["A_gate_up"]].reshape(experts, -1, cfg.hidden_size)
    b_gate_up = stack_b(tensors[keys["B_gate_up"]])
    gate, up = (b_gate_up[:, 0::2], b_gate_up[:, 1::2]) if interleaved else (b_gate_up[:, :f], b_gate_up[:, f:])
    stacks = {"A_in": a_in, "B_gate": gate, "B_up": up,
              "A_down": tensors[keys["A_down"]].reshape(experts, -1, f), "B_down": stack_b(tensors[keys["B_down"]])}
    return {f"layers.{layer}.mlp.experts.lora.{name}.{e}": value[e].contiguous()
            for name, value in stacks.items() for e in range(experts)}
