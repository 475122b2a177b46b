"""The FLOP count of MLA models (MFU in metrics and benchmarks) counts the matrices the model holds.

A dense Llama with MLA, with and without the query low-rank path: `flops_per_token` must equal
3 x (2 x the entries of every layer's matrices + the score and value products 2 s H (qk + v) per layer +
the output layer 2 h V), the matrices counted on the built model (norms and embeddings excluded).
"""

from __future__ import annotations

import pytest

from shardlm.models import build_model
from shardlm.models.config import ModelConfig
from shardlm.parallel import ParallelContext
from shardlm.plan.flops import flops_per_token, mla_weights


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_mla_flops_count_the_built_matrices(q_lora_rank):
    cfg = ModelConfig(arch="llama", attention="mla", num_layers=2, hidden_size=32, num_heads=4, seq_length=16,
                      vocab_size=100, dropout=0.0, ffn_hidden_size=48, q_lora_rank=q_lora_rank, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
    model = build_model(cfg, ParallelContext.single())
    attention = sum(p.numel() for name, p in model.named_parameters() if ".attn." in name and p.ndim == 2)
    matrices = sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers.") and p.ndim == 2)
    assert attention == cfg.num_layers * mla_weights(cfg)
    scores = cfg.num_layers * 2 * cfg.seq_length * cfg.num_heads * (8 + 4 + 12)
    assert flops_per_token(cfg) == 3 * (2 * matrices + scores + 2 * cfg.hidden_size * cfg.vocab_size)


def test_mtp_depths_add_their_built_matrices_and_an_output_head():
    """A dense MLA model with 2 multi-token-prediction depths: the count grows by 3 x (2 x the entries of the
    depths' matrices (eh_proj and each depth's layer) + each depth's score products + one output head each)."""
    cfg = ModelConfig(arch="llama", attention="mla", num_layers=2, hidden_size=32, num_heads=4, seq_length=16,
                      vocab_size=100, dropout=0.0, ffn_hidden_size=48, q_lora_rank=16, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, mtp_layers=2)
    model = build_model(cfg, ParallelContext.single())
    depth_matrices = sum(p.numel() for name, p in model.named_parameters() if name.startswith("mtp.") and p.ndim == 2)
    scores = 2 * 2 * cfg.seq_length * cfg.num_heads * (8 + 4 + 12)
    plain = ModelConfig(**{**cfg.__dict__, "mtp_layers": 0})
    assert flops_per_token(cfg) - flops_per_token(plain) == 3 * (2 * depth_matrices + scores
                                                                 + 2 * 2 * cfg.hidden_size * cfg.vocab_size)
