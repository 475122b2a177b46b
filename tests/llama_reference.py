"""The reference Llama of the Llama tests: a random `LlamaForCausalLM` (2 layers, hidden 96, 6 query heads,
2 KV heads, vocabulary 1000, which 128 does not divide), built offline, converted with `shardlm convert`'s
code, and the logits and greedy tokens that shardlm's loaded copy must give back."""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.checkpoint import load_model
from shardlm.checkpoint.hf import from_hf
from shardlm.eval.generate import SamplingConfig, generate_tokens
from shardlm.parallel import ParallelContext

HF_VOCAB, PROMPT, NEW_TOKENS = 1000, 6, 12
LOGIT_TOL = 1e-4


def hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=HF_VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                       rms_norm_eps=1e-6, rope_theta=500.0, tie_word_embeddings=False)



def hf_llama(root: Path) -> dict:
    """The HF model, its saved directory (under `root`), the converted shardlm file, and reference logits and
    tokens. Its q and k weights are scaled up so attention is sharp and a rotary-layout slip would show."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config()).eval()
    with torch.no_grad():  # sharp attention: positions (RoPE) then change the logits visibly
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(root / "hf")
    converted = from_hf(root / "hf", root / "llama.safetensors")
    tokens = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
        greedy = model.generate(tokens[:, :PROMPT], attention_mask=torch.ones(2, PROMPT, dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return {"model": model, "root": root, "converted": converted, "tokens": tokens, "logits": logits,
            "greedy": greedy[:, PROMPT:].tolist()}


def logits_and_greedy(path, ctx: ParallelContext, tokens: torch.Tensor):
    """(full logits of `tokens`, greedy continuations of their first PROMPT tokens) of the file at `path`."""
    model, _ = load_model(path, ctx)
    with torch.no_grad():
        logits = model.full_logits(model(tokens))
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, stop_at_eod=False)
    generated = generate_tokens(model, tokens[:, :PROMPT].tolist(), config)
    return logits, [g.tokens for g in generated]


def assert_round_trip(converted, saved_dir, out_dir, model_class, tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """`to_hf` of the converted file gives bitwise the tensors transformers saved in `saved_dir`, under the same
    names, and `model_class.from_pretrained` of it gives bitwise the reference `logits` of `tokens`."""
    from safetensors.torch import load_file

    from shardlm.checkpoint.hf import to_hf

    out = to_hf(converted, out_dir)
    original = load_file(str(saved_dir / "model.safetensors"))
    back = load_file(str(out / "model.safetensors"))
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(back[name], value), name
    reloaded = model_class.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, logits)
