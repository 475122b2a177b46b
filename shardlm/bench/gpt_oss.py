"""A tiny gpt-oss training step on one CPU: shardlm against transformers' GptOssForCausalLM.

One small gpt-oss (`OSS_BENCH`: grouped-query attention with q/k/v/o biases and a learned sink logit per
head, a sliding window of 128 tokens on alternate layers (sliding first) over a sequence of 512, YaRN
rotary embeddings, every layer an MoE of biased SwiGLU experts clamped at `swiglu_limit` behind a biased
router, top-k softmax over the chosen logits; no aux loss) trains as `shardlm.bench.hf_compare` describes,
with the fp32 loss check of steps 1 and 2 first, in fp32 and (where the CPU has native bf16) bf16 autocast:

- `shardlm`: a shardlm Trainer step on the converted checkpoint: attention in tiles of the window
  (`shardlm.parallel.tiled_attention`: key tiles wholly outside a query tile's window skipped, the sink
  merged by log-sum-exp), grouped-GEMM experts.
- `hf` (transformers as shipped): `GptOssForCausalLM` with its defaults. Its attention does not support SDPA
  (`_supports_sdpa = False`: SDPA has no sink), so as shipped it runs the eager attention (the whole (T, T)
  scores with the window as an additive mask, the sink concatenated as one more column); its experts run
  `grouped_mm` in transformers 5. Both implementations are measured and reported.
- `hf_eager`: the same model with `experts_implementation="eager"`, transformers' per-expert loop.

The random model's sinks (std 1), attention biases, router bias and expert biases (std 0.1, 0.5 and 0.05)
are drawn non-zero, and its router sharpened (std 0.1), so that every gpt-oss piece takes part in the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.bench import hf_compare
from shardlm.bench.hf_compare import HFModel


@dataclass(frozen=True)
class GptOssShape:
    """A gpt-oss-shaped model and batch: `num_heads` query heads and `num_kv_heads` KV heads of `head_dim`,
    a `window`-token sliding window on even layers (0, 2, ...), full causal attention on odd ones, YaRN by
    `yarn_factor` over seq_length / yarn_factor original positions; `num_experts` experts of width
    `expert_ffn`, top-`top_k`, SwiGLU clamped at `swiglu_limit`."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    window: int = 128
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    swiglu_limit: float = 7.0
    yarn_factor: float = 4.0
    seq_length: int = 512
    micro_batch: int = 2
    vocab_size: int = 8192

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    def hf_config(self):
        """transformers' GptOssConfig of this shape (fp32, untied embeddings, no router aux loss)."""
        from transformers import GptOssConfig

        rope = {"rope_type": "yarn", "factor": self.yarn_factor, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": int(self.seq_length / self.yarn_factor),
                "rope_theta": 150000.0}
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_layers)]
        return GptOssConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.expert_ffn,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, num_local_experts=self.num_experts,
            num_experts_per_tok=self.top_k, sliding_window=self.window, layer_types=layer_types,
            max_position_embeddings=self.seq_length, rope_parameters=rope, swiglu_limit=self.swiglu_limit,
            tie_word_embeddings=False, output_router_logits=False, router_aux_loss_coef=0.0,
            torch_dtype="float32")

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads ({self.num_kv_heads} "
                f"KV) of {self.head_dim} with q/k/v/o biases and sinks, a sliding window of {self.window} on "
                f"alternate layers, YaRN x{self.yarn_factor:g}, {self.num_experts} biased experts of width "
                f"{self.expert_ffn} top-{self.top_k} (clamped SwiGLU, limit {self.swiglu_limit:g}), sequence "
                f"{self.seq_length}, micro-batch {self.micro_batch}, vocabulary {self.vocab_size}, no aux loss")


OSS_BENCH = GptOssShape()
OSS_QUICK = GptOssShape(num_layers=2, hidden_size=64, num_heads=4, head_dim=16, window=32, num_experts=4,
                        expert_ffn=64, seq_length=128, micro_batch=2, vocab_size=512)


def save_hf_model(shape: GptOssShape, folder: Path, seed: int = 0) -> Path:
    """A random fp32 GptOssForCausalLM of `shape` saved in `folder`, its sinks, biases and router drawn as the
    module docstring says (transformers initializes the biases to zero)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(shape.hf_config()).float()
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.sinks.normal_(0, 1.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.normal_(0, 0.1)
            mlp.router.weight.normal_(0, 0.1)
            mlp.router.bias.normal_(0, 0.5)
            for bias in (mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias):
                bias.normal_(0, 0.05)
    model.save_pretrained(folder)
    return folder


GPT_OSS = HFModel("GptOssForCausalLM", "GptOssExperts", save_hf_model, attn_implementation=None,
                  model_overrides={"moe_aux_loss_coeff": 0.0})
"""The comparison's transformers side (its default attention, as shipped) and shardlm's keys: no aux loss, as
transformers trains without `output_router_logits`."""


def gpt_oss_bench(quick: bool, repeats: int) -> dict:
    """The `gpt_oss` section of `make bench`."""
    return hf_compare.single_process(OSS_QUICK if quick else OSS_BENCH, GPT_OSS, repeats, warmup=0 if quick else 1)


def markdown_lines(d: dict) -> list[str]:
    """The `gpt_oss` section of BENCHMARKS.md, with the attention transformers ran."""
    attention = d["fp32"]["hf_attn_implementation"]
    lines = hf_compare.markdown_lines(d, "gpt_oss", "gpt-oss training step",
                                      f"`GptOssForCausalLM` (attention as shipped: `{attention}`)")
    note = (f"transformers' gpt-oss attention does not support SDPA (no sink in SDPA), so as shipped it runs "
            f"`{attention}` attention: the whole (T, T) scores with the sliding window as an additive mask and the "
            "sink as one more column; shardlm computes only the tiles a window reaches (see the `window` section).")
    return lines + [note, ""]
