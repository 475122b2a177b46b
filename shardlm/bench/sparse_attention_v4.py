"""A tiny DeepSeek-V4 training step on one CPU (`make bench` section `sparse_attention`, key `v4_train_vs_hf`).

`V4_BENCH`: 4 layers (HCA 128:1 twice, then CSA 4:1 with a lightning indexer choosing `index_topk` entries, then
HCA, transformers' default layer order), 4 hyper-connection streams, a sliding window of 64, per-head sinks, the
grouped output projection, 8 sqrt(softplus)-routed experts (the first layer hash-routed by a random fixed table)
and a shared one, clipped SwiGLU (`V4_QUICK`: HCA and CSA, 3 Sinkhorn iterations, 2 rows of 32 tokens). It
trains as `shardlm.bench.hf_compare.single_process` describes, fp32 only (as the V3.2 step): shardlm's Trainer on
the converted checkpoint against transformers' `DeepseekV4ForCausalLM` as shipped (`hf`) and with its per-expert
loop (`hf_eager`), same weights, same batch, the loss check of steps 1 and 2 first. Neither trains the indexer
(transformers gives its choice no gradient; shardlm freezes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.bench import hf_compare
from shardlm.bench.hf_compare import HFModel

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class V4Shape:
    """A DeepSeek-V4-shaped model and batch (the names of transformers' DeepseekV4Config, less its prefixes)."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    head_dim: int = 64
    q_lora_rank: int = 128
    rope_dim: int = 16
    hc_mult: int = 4
    sliding_window: int = 64
    output_groups: int = 4
    output_rank: int = 64
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_heads: int = 8
    index_head_dim: int = 32
    index_topk: int = 32
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    hash_layers: int = 1
    sinkhorn_iters: int = 20
    layer_types: tuple[str, ...] = ()
    """Each layer's attention (transformers' names); empty: transformers' default order (2 HCA, then CSA and HCA
    alternating)."""
    seq_length: int = 256
    micro_batch: int = 4
    vocab_size: int = 8192

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length

    def hf_config(self):
        """transformers' DeepseekV4Config of this shape: untied embeddings, one shared expert."""
        from transformers import DeepseekV4Config

        n = self.num_layers
        kinds = list(self.layer_types) or [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        return DeepseekV4Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, moe_intermediate_size=self.expert_ffn,
            num_hidden_layers=n, num_attention_heads=self.num_heads, head_dim=self.head_dim,
            q_lora_rank=self.q_lora_rank, partial_rotary_factor=self.rope_dim / self.head_dim,
            num_experts_per_tok=self.top_k, n_routed_experts=self.num_experts, n_shared_experts=1,
            routed_scaling_factor=1.5, max_position_embeddings=self.seq_length, layer_types=kinds,
            compress_rates={CSA: self.csa_ratio, HCA: self.hca_ratio},
            mlp_layer_types=["hash_moe"] * self.hash_layers + ["moe"] * (n - self.hash_layers), hc_mult=self.hc_mult,
            hc_sinkhorn_iters=self.sinkhorn_iters, sliding_window=self.sliding_window, o_groups=self.output_groups,
            o_lora_rank=self.output_rank,
            index_n_heads=self.index_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            swiglu_limit=10.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

    def describe(self) -> str:
        return (f"DeepSeek-V4: {self.num_layers} layers (HCA {self.hca_ratio}:1 and CSA {self.csa_ratio}:1 with an "
                f"indexer of {self.index_heads} heads of {self.index_head_dim} choosing {self.index_topk} entries), "
                f"hidden {self.hidden_size}, {self.hc_mult} hyper-connection streams, {self.num_heads} heads of "
                f"{self.head_dim} (q_lora_rank {self.q_lora_rank}, rotary {self.rope_dim}) over one shared key/value "
                f"head, window {self.sliding_window}, {self.output_groups} output groups of {self.output_rank}, "
                f"{self.num_experts} experts of {self.expert_ffn} top-{self.top_k} (sqrt-softplus, the first "
                f"{self.hash_layers} hash-routed) and a shared one; batch {self.micro_batch} x {self.seq_length}, "
                f"vocabulary {self.vocab_size}, fp32")


V4_BENCH = V4Shape()
V4_QUICK = V4Shape(num_layers=2, layer_types=(HCA, CSA), sinkhorn_iters=3, hidden_size=64, num_heads=4, head_dim=32,
                   q_lora_rank=32, rope_dim=8, hc_mult=2, sliding_window=8, output_groups=2, output_rank=16,
                   hca_ratio=8, index_heads=4, index_head_dim=16, index_topk=4, num_experts=4, expert_ffn=32,
                   seq_length=32, micro_batch=2,
                   vocab_size=512)


def save_hf_model(shape: V4Shape, folder: Path, seed: int = 0) -> Path:
    """A random fp32 DeepseekV4ForCausalLM of `shape` saved in `folder`: transformers' initialization, then the
    routers, expert biases, sinks, position biases and hash tables drawn so that routing and the compressors'
    pooling are not uniform."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(shape.hf_config()).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("position_bias", "sinks")) or name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.1)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.stack([torch.randperm(shape.num_experts)[:shape.top_k]
                                                for _ in range(shape.vocab_size)]))
            else:
                gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(folder)
    return folder


DEEPSEEK_V4 = HFModel("DeepseekV4ForCausalLM", "DeepseekV4Experts", save_hf_model,
                      model_overrides={"moe_expert_bias_rate": 0.0, "moe_aux_loss_coeff": 0.0,
                                       "index_loss_coeff": 0.0})
"""The comparison's transformers side (its default attention, as shipped) and shardlm's keys: the expert bias fixed,
no aux loss and no indexer loss (transformers' CSA indexer takes no gradient), as transformers trains."""


def v4_train_vs_hf(quick: bool, repeats: int, threads: int = 2) -> dict:
    """`hf_compare.single_process` of `V4_QUICK` or `V4_BENCH`, fp32 only."""
    shape = V4_QUICK if quick else V4_BENCH
    return hf_compare.single_process(shape, DEEPSEEK_V4, repeats, threads, fp32_only=True, warmup=0 if quick else 1)


def markdown_lines(d: dict) -> list[str]:
    """BENCHMARKS.md's lines of the V4 step (`sparse_attention.v4_train_vs_hf`)."""
    return hf_compare.markdown_lines(d, "sparse_attention.v4_train_vs_hf", "DeepSeek-V4 training step",
                                     f"`DeepseekV4ForCausalLM` ({d['fp32']['hf_attn_implementation']} attention)")
