"""One CPU training step of each newer family against transformers as shipped: the `families` section of `make bench`.

Each family's small random model is saved by transformers, converted, and trained as `shardlm.bench.hf_compare`
describes (the fp32 loss check of steps 1 and 2 first, then fp32 and, where the CPU has native bf16, bf16 autocast,
taking turns in one run). Norm weights, routers and score-correction biases are drawn away from their initial values
so that every piece of the family takes part in the loss:

- Mistral Small 4 (`Mistral4ForCausalLM`): latent attention with Llama 4's query scaling, softmax routing over
  groups of experts, a shared expert, a dense first layer;
- OLMo 3 (`Olmo3ForCausalLM`): post-norms, QK-norm over whole projections, a sliding window on 3 of 4 layers (dense:
  no `hf_eager` program);
- MiniMax-M2 (`MiniMaxM2ForCausalLM`): whole-projection QK-norm, partial RoPE, sigmoid routing with the
  score-correction bias in every layer;
- Gemma 4 (`Gemma4ForCausalLM`, an E-series shape: dense): sandwich norms, sliding and full layers in turn (k = v
  and proportional RoPE on the full ones), the last (full) layer sharing the previous full layer's keys and values,
  per-layer inputs, the final soft-cap;
- Kimi Linear (`KimiLinearForCausalLM`): Kimi Delta Attention (per-channel decays from a low-rank gate, short
  convolutions, a gated output norm; transformers' PyTorch chunked rule, fla absent) on 3 of 4 layers and MLA
  without positions on the 4th, the first layer's MLP dense and the rest MoE (sigmoid routing with a
  score-correction bias, a shared expert);
- Nemotron-H (`NemotronHForCausalLM`): Mamba-2 mixers (transformers' PyTorch scan, mamba_ssm absent), attention
  without positions, ReLU^2 MLPs and Nemotron 3's ReLU^2 MoE ("E": grouped top-k over sigmoid scores with a
  score-correction bias, a shared expert), one mixer per block.

The linear-attention families' `A_log`, `dt_bias`, `D` and convolution biases are moved by N(0, 0.5) off their
initial values, and Kimi Linear's low-rank gate projections scaled by 4 (gates away from 1/2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardlm.bench import hf_compare
from shardlm.bench.common import median_cell
from shardlm.bench.hf_compare import HFModel


@dataclass(frozen=True)
class FamilyShape:
    """A small model of one family (`family`: transformers' model_type) and its batch; `experts` 0 for a dense one."""

    family: str
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    ffn: int = 512
    experts: int = 8
    top_k: int = 2
    expert_ffn: int = 128
    window: int = 128
    seq_length: int = 512
    micro_batch: int = 2
    vocab_size: int = 8192
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    def hf_config(self):
        """transformers' config of this shape (fp32, untied embeddings, no special tokens, no router aux loss)."""
        import transformers as tf

        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                      num_attention_heads=self.num_heads, max_position_embeddings=self.seq_length,
                      tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        if self.family == "mistral4":
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
                    "original_max_position_embeddings": self.seq_length // 4}
            return tf.Mistral4Config(**common, num_key_value_heads=self.num_heads, intermediate_size=self.ffn,
                                     moe_intermediate_size=self.expert_ffn, n_routed_experts=self.experts,
                                     n_shared_experts=1, n_group=2, topk_group=1, num_experts_per_tok=self.top_k,
                                     norm_topk_prob=True, routed_scaling_factor=1.0, kv_lora_rank=64, q_lora_rank=96,
                                     qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1,
                                     rope_parameters=rope)
        if self.family == "olmo3":
            layer_types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                           for i in range(self.num_layers)]
            rope = {kind: {"rope_type": "default", "rope_theta": 500000.0} for kind in set(layer_types)}
            return tf.Olmo3Config(**common, num_key_value_heads=self.num_kv_heads, intermediate_size=self.ffn,
                                  sliding_window=self.window, layer_types=layer_types, rope_parameters=rope)
        if self.family == "gemma4":
            sliding, full = "sliding_attention", "full_attention"
            layer_types = [full if i % 2 else sliding for i in range(self.num_layers)]  # the last: a shared full
            rope = {sliding: {"rope_type": "default", "rope_theta": 10000.0},
                    full: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
            return tf.Gemma4TextConfig(**(common | {"tie_word_embeddings": True}), intermediate_size=self.ffn,
                                       num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                                       global_head_dim=2 * self.head_dim, num_global_key_value_heads=1,
                                       attention_k_eq_v=True, num_kv_shared_layers=1, sliding_window=self.window,
                                       layer_types=layer_types, rope_parameters=rope, final_logit_softcapping=30.0,
                                       hidden_size_per_layer_input=16, vocab_size_per_layer_input=self.vocab_size)
        if self.family == "kimi_linear":
            return self._kimi_linear(tf, common)
        if self.family == "nemotron_h":
            return self._nemotron_h(tf, common)
        return tf.MiniMaxM2Config(**common, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                                  intermediate_size=self.expert_ffn, num_local_experts=self.experts,
                                  num_experts_per_tok=self.top_k, rotary_dim=self.head_dim // 2, rope_theta=5e6,
                                  router_aux_loss_coef=0.0, output_router_logits=False)

    def _kimi_linear(self, tf, common: dict):
        """KimiLinearConfig: KDA on 3 of 4 layers (`num_heads` heads of `head_dim`), MLA without positions on the
        4th; the first MLP dense (`ffn`), the rest `experts` experts and a shared one."""
        layer_types = ["full_attention" if (i + 1) % 4 == 0 or i == self.num_layers - 1 else "linear_attention"
                       for i in range(self.num_layers)]
        return tf.KimiLinearConfig(**common, num_key_value_heads=self.num_heads, kv_lora_rank=2 * self.head_dim,
                                   q_lora_rank=None, qk_nope_head_dim=self.head_dim,
                                   qk_rope_head_dim=self.head_dim // 2, v_head_dim=self.head_dim,
                                   intermediate_size=self.ffn, moe_intermediate_size=self.expert_ffn,
                                   num_local_experts=self.experts, num_experts_per_tok=self.top_k, n_shared_experts=1,
                                   routed_scaling_factor=2.0, linear_num_heads=self.num_heads,
                                   linear_head_dim=self.head_dim, linear_conv_kernel_dim=4, layer_types=layer_types,
                                   mlp_layer_types=["dense"] + ["sparse"] * (self.num_layers - 1))

    def _nemotron_h(self, tf, common: dict):
        """NemotronHConfig: the blocks `NEMOTRON_BLOCKS[:num_layers]`; Mamba-2 of `num_heads` heads of 2 x hidden /
        heads channels in 2 groups (state 2 x `head_dim`, chunks of seq / 4); attention `num_heads` over
        `num_kv_heads`; ReLU^2 MLP `ffn`, `experts` ReLU^2 experts in 2 groups beside a shared one."""
        common = {key: value for key, value in common.items() if key != "num_hidden_layers"}
        return tf.NemotronHConfig(**common, layers_block_type=list(NEMOTRON_BLOCKS[:self.num_layers]),
                                  num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                                  intermediate_size=self.ffn, mamba_num_heads=self.num_heads,
                                  mamba_head_dim=2 * self.hidden_size // self.num_heads,
                                  ssm_state_size=2 * self.head_dim, n_groups=2, conv_kernel=4,
                                  chunk_size=self.seq_length // 4, n_routed_experts=self.experts,
                                  num_experts_per_tok=self.top_k,
                                  moe_intermediate_size=self.expert_ffn,
                                  moe_shared_expert_intermediate_size=self.expert_ffn, n_group=2, topk_group=1,
                                  routed_scaling_factor=2.5)

    def describe(self) -> str:
        experts = (f", {self.experts} experts of width {self.expert_ffn} top-{self.top_k}" if self.experts else
                   f", MLP width {self.ffn}")
        return (f"{FAMILIES[self.family].causal_lm}: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"{self.num_heads} heads{experts}, sequence {self.seq_length}, micro-batch {self.micro_batch}, "
                f"vocabulary {self.vocab_size}")


NEMOTRON_BLOCKS = ("linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe")
"""Nemotron-H's block kinds in order (its pattern "ME*-ME" at 6 layers, "ME*-" at 4)."""
STATE_SPACE = ("A_log", "dt_bias", "mixer.D", "conv1d.bias")
"""Linear-attention parameters moved off their initial values (N(0, 0.5))."""


def save_hf_model(shape: FamilyShape, folder: Path, seed: int = 0) -> Path:
    """A random fp32 model of `shape` saved in `folder`: norm weights drawn around 1, routers sharpened (std 0.1)
    and score-correction biases drawn (+-0.05), which transformers initializes to ones and zeros; `STATE_SPACE`
    parameters moved and Kimi Linear's low-rank gates scaled by 4."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[shape.family].causal_lm)(shape.hf_config()).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.normal_(1.0, 0.1)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight", "mixer.gate.weight")):
                param.normal_(0, 0.1)
            elif name.endswith(STATE_SPACE):
                param.add_(torch.randn_like(param), alpha=0.5)
            elif name.endswith(("f_a_proj.weight", "g_a_proj.weight")):
                param.mul_(4.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(folder)
    return folder


FAMILIES = {
    "mistral4": HFModel("Mistral4ForCausalLM", "Mistral4Experts", save_hf_model,
                        model_overrides={"moe_aux_loss_coeff": 0.0, "mtp_layers": 0}),
    "olmo3": HFModel("Olmo3ForCausalLM", None, save_hf_model),
    "gemma4": HFModel("Gemma4ForCausalLM", None, save_hf_model),
    "minimax_m2": HFModel("MiniMaxM2ForCausalLM", "MiniMaxM2Experts", save_hf_model,
                          model_overrides={"moe_aux_loss_coeff": 0.0, "moe_expert_bias_rate": 0.0}),
    "kimi_linear": HFModel("KimiLinearForCausalLM", "KimiLinearExperts", save_hf_model,
                           model_overrides={"moe_aux_loss_coeff": 0.0, "moe_expert_bias_rate": 0.0}),
    "nemotron_h": HFModel("NemotronHForCausalLM", "NemotronHExperts", save_hf_model,
                          model_overrides={"moe_aux_loss_coeff": 0.0, "moe_expert_bias_rate": 0.0}),
}
"""Each family's transformers side (attention and experts as shipped) and shardlm's keys: no aux loss and a fixed
expert bias, as transformers trains."""

SHAPES = {"mistral4": FamilyShape("mistral4"), "olmo3": FamilyShape("olmo3", experts=0),
          "minimax_m2": FamilyShape("minimax_m2"), "gemma4": FamilyShape("gemma4", num_kv_heads=2, experts=0),
          "kimi_linear": FamilyShape("kimi_linear"), "nemotron_h": FamilyShape("nemotron_h", num_layers=6)}
QUICK = {name: FamilyShape(name, num_layers=4 if name in ("gemma4", "nemotron_h") else 2, hidden_size=64, num_heads=4,
                           num_kv_heads=2, head_dim=16, ffn=96, experts=shape.experts and 4, expert_ffn=32, window=16,
                           seq_length=64, vocab_size=512)
         for name, shape in SHAPES.items()}


def families_bench(quick: bool, repeats: int, only: list[str] | None = None) -> dict:
    """The `families` section of `make bench`: {family: `hf_compare.single_process`'s result}; a quick run (the
    harness's check) in fp32 only, without a warm-up round (its loss check ran every program twice)."""
    shapes = QUICK if quick else SHAPES
    return {name: hf_compare.single_process(shapes[name], FAMILIES[name], repeats, fp32_only=quick,
                                            warmup=0 if quick else 1)
            for name in shapes if not only or name in only}


def markdown_lines(d: dict) -> list[str]:
    """The `families` section of BENCHMARKS.md: one row per family."""
    lines = ["## Newer families' training steps (`families`)", "",
             "One process, fp32 and bf16 autocast (where the CPU has native bf16): shardlm (the converted checkpoint) "
             "against the family's transformers class as shipped, from the same saved weights on the same batch; "
             "`families.<family>.loss_check.match` is true when transformers' losses of steps 1 and 2 are within "
             "1e-4 of shardlm's. Goal: shardlm / transformers >= 1.2.", "",
             "| family | config | loss check | fp32 shardlm / hf (`families.<family>.fp32.ratio`) | "
             "bf16 shardlm / hf | hf attention, experts | goal |", "|---|---|---|---|---|---|---|"]
    for name, r in d.items():
        bf16 = median_cell(r["bf16"]["ratio"]) if "bf16" in r else "not run"
        ran = f"{r['fp32']['hf_attn_implementation']}, {r['fp32']['hf_experts_implementation'] or 'dense'}"
        met = "met" if r["goal"]["met"] else "not met"
        lines.append(f"| {name} | {r['config']} | {r['loss_check']['match']} | "
                     f"**{median_cell(r['fp32']['ratio'])}** | {bf16} | {ran} | {met} |")
    return lines + [""]
