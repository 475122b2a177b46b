"""A tiny DeepSeek-V3 training step on one CPU: shardlm against transformers' DeepseekV3ForCausalLM.

One small DeepSeek-V3 (`DS_BENCH`: multi-head latent attention with a query low-rank path, the first
layer dense, then MoE layers of routed SwiGLU experts chosen by sigmoid scores plus a fixed expert bias
(`e_score_correction_bias`), group-limited top-k, top-k renormalised and scaled by `routed_scaling`, one
shared expert; no multi-token prediction, no aux loss) trains as `shardlm.bench.hf_compare` describes:

- `shardlm`: a shardlm Trainer step on the converted checkpoint (grouped-GEMM experts, fp32 router).
- `hf` (transformers as shipped): `DeepseekV3ForCausalLM` with SDPA attention and its default experts
  implementation (reported: `grouped_mm` in transformers 5, the kernel shardlm uses).
- `hf_eager`: the same model with `experts_implementation="eager"`, transformers' per-expert loop.

with the fp32 loss check of steps 1 and 2 first, in fp32 and (where the CPU has native bf16) bf16 autocast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.bench import hf_compare
from shardlm.bench.hf_compare import HFModel


@dataclass(frozen=True)
class DeepSeekShape:
    """A DeepSeek-V3-shaped model and batch. Attention: per head a query/key of qk_nope_head_dim +
    qk_rope_head_dim channels and a value of v_head_dim; queries through (hidden -> q_lora_rank -> heads),
    keys and values through (hidden -> kv_lora_rank + qk_rope_head_dim -> heads). MLPs: `dense_layers`
    dense SwiGLU layers of width `dense_ffn`, then `num_experts` routed experts of width `expert_ffn`
    (top-`top_k` in the best `topk_groups` of `groups` groups) plus `shared_experts` shared ones."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    dense_layers: int = 1
    dense_ffn: int = 512
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    shared_experts: int = 1
    groups: int = 4
    topk_groups: int = 2
    routed_scaling: float = 2.5
    seq_length: int = 256
    micro_batch: int = 4
    vocab_size: int = 8192

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    def hf_config(self):
        """transformers' DeepseekV3Config of this shape (fp32, untied embeddings, no multi-token prediction)."""
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.dense_ffn,
            moe_intermediate_size=self.expert_ffn, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
            n_shared_experts=self.shared_experts, n_routed_experts=self.num_experts,
            routed_scaling_factor=self.routed_scaling, kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim, n_group=self.groups, topk_group=self.topk_groups,
            num_experts_per_tok=self.top_k, first_k_dense_replace=self.dense_layers, norm_topk_prob=True,
            max_position_embeddings=self.seq_length, rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_nextn_predict_layers=0, torch_dtype="float32")

    def describe(self) -> str:
        return (f"{self.num_layers} layers ({self.dense_layers} dense of width {self.dense_ffn}), hidden "
                f"{self.hidden_size}, {self.num_heads} MLA heads (q_lora_rank {self.q_lora_rank}, kv_lora_rank "
                f"{self.kv_lora_rank}, qk {self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v {self.v_head_dim}), "
                f"{self.num_experts} routed experts of width {self.expert_ffn} top-{self.top_k} (sigmoid + "
                f"expert bias, {self.groups} groups / top {self.topk_groups}, scaling {self.routed_scaling}) + "
                f"{self.shared_experts} shared, sequence {self.seq_length}, micro-batch {self.micro_batch}, "
                f"vocabulary {self.vocab_size}, no MTP, no aux loss")


DS_BENCH = DeepSeekShape()
DS_QUICK = DeepSeekShape(num_layers=2, hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=16,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, dense_ffn=128, num_experts=4,
                         expert_ffn=64, groups=2, topk_groups=1, seq_length=64, micro_batch=2, vocab_size=512)


def save_hf_model(shape: DeepSeekShape, folder: Path, seed: int = 0) -> Path:
    """A random fp32 DeepseekV3ForCausalLM of `shape` saved in `folder`, with a non-zero expert bias (drawn
    uniform in +-0.05, so that it moves the routing) and a router of std 0.1 (sharper than its 0.02 init)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(shape.hf_config()).float()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.1)
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(folder)
    return folder


DEEPSEEK = HFModel("DeepseekV3ForCausalLM", "DeepseekV3Experts", save_hf_model, attn_implementation="sdpa",
                   model_overrides={"moe_expert_bias": True, "moe_expert_bias_rate": 0.0, "moe_aux_loss_coeff": 0.0,
                                    "mtp_layers": 0})
"""The comparison's transformers side (SDPA attention) and shardlm's keys: the expert bias kept fixed, no aux
loss and no multi-token prediction, as transformers trains."""


def deepseek_bench(quick: bool, repeats: int) -> dict:
    """The `deepseek` section of `make bench`."""
    return hf_compare.single_process(DS_QUICK if quick else DS_BENCH, DEEPSEEK, repeats, warmup=0 if quick else 1)


def markdown_lines(d: dict) -> list[str]:
    """The `deepseek` section of BENCHMARKS.md."""
    return hf_compare.markdown_lines(d, "deepseek", "DeepSeek-V3 training step",
                                     "`DeepseekV3ForCausalLM` (SDPA attention)")
