"""The reference Llama of the Llama tests: a random `LlamaForCausalLM` (2 layers, hidden 96, 6 query heads,
2 KV heads, vocabulary 1000, which 128 does not divide), built offline, converted with `shardlm convert`'s
code, and the logits and greedy tokens that shardlm's loaded copy must give back.

Also the one home of the test bodies every Hugging Face conversion test (`test_hf_*.py`) shares, on a reference
from `hf_reference`: the converted file (`assert_converted_matches`) and the HF directory read in place
(`assert_read_in_place`) give transformers' logits and greedy tokens in one process, so do both at TP=2 and
EP=2 (`layout_checks` in a world of 2, `assert_layout_matches`), and converting back is bitwise
(`assert_round_trip`)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.checkpoint import load_model
from shardlm.checkpoint.hf import from_hf
from shardlm.eval.generate import SamplingConfig, generate_tokens
from shardlm.parallel import ParallelContext

from multiproc import check_result, run_checks

HF_VOCAB, PROMPT, NEW_TOKENS = 1000, 6, 12
LOGIT_TOL = 1e-4
LAYOUTS = ("tp2", "ep2")


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
    tokens = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    return {"model": model, **hf_reference(model, root, tokens)}


def logits_and_greedy(path, ctx: ParallelContext, tokens: torch.Tensor):
    """(full logits of `tokens`, greedy continuations of their first PROMPT tokens) of the file at `path`."""
    model, _ = load_model(path, ctx)
    with torch.no_grad():
        logits = model.full_logits(model(tokens))
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, stop_at_eod=False)
    generated = generate_tokens(model, tokens[:, :PROMPT].tolist(), config)
    return logits, [g.tokens for g in generated]


def variant_logits(ref: dict, path: Path, change_tensors=None) -> torch.Tensor:
    """One process's logits of `ref["tokens"]` from a variant of the converted file: its tensors passed through
    `change_tensors(tensors)` (a dict it may change in place or replace), saved at `path`. The controls: a
    variant that a converter or a router could have produced by mistake must move the logits far beyond
    LOGIT_TOL."""
    import dataclasses

    from shardlm.checkpoint.files import write_consolidated
    from shardlm.checkpoint.state import load_consolidated

    config, tensors = load_consolidated(ref["converted"])
    if change_tensors:
        tensors = dict(tensors)
        tensors = change_tensors(tensors) or tensors  # changed in place, or replaced
    write_consolidated(path, {k: v.contiguous() for k, v in tensors.items()}, dataclasses.asdict(config))
    return logits_and_greedy(path, ParallelContext.single(), ref["tokens"])[0]


def is_norm_weight(name: str, param: torch.Tensor) -> bool:
    """A norm's scale, in transformers' names (`input_layernorm`, `q_norm`, `kv_a_layernorm`, `enorm`,
    `shared_head.norm`, ...) or shardlm's (`ln_1`, `ln_f`, `q_norm`, ...)."""
    module = name.rsplit(".", 2)[-2] if name.count(".") else ""
    return param.dim() == 1 and name.endswith("weight") and ("norm" in module or module.startswith("ln_"))


def spread_norm_weights(model: torch.nn.Module, seed: int = 0, prefix: str = "", low: float = 0.5, high: float = 2.0,
                        norms: tuple[str, ...] = ()) -> list[str]:
    """Every norm weight of `model` (under `prefix`; only the norms named in `norms`, such as ("q_norm", "k_norm"),
    when given) drawn from U(`low`, `high`), in place; returns their names. At their initial 1.0 two norms swapped
    by a name map (`input_layernorm` for `post_attention_layernorm`, `q_norm` for `k_norm`, `enorm` for `hnorm`)
    would give the same logits, and the round trip would pass; a norm left out would go unseen."""
    generator = torch.Generator().manual_seed(seed)
    names = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = name.rsplit(".", 2)[-2] if name.count(".") else ""
            if name.startswith(prefix) and is_norm_weight(name, param) and (not norms or module in norms):
                param.copy_(torch.rand(param.shape, generator=generator) * (high - low) + low)
                names.append(name)
    return names


def hf_reference(model, root: Path, tokens: torch.Tensor, norm_seed: int = 0) -> dict:
    """`model` (in eval mode), its norm weights spread (`spread_norm_weights(model, norm_seed)`), saved under
    `root / "hf"` and converted to `root / "model.safetensors"`, with `tokens`, transformers' logits of them and
    its greedy continuations of their first PROMPT tokens."""
    assert spread_norm_weights(model, norm_seed), "a reference model without norm weights"
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        logits = model(tokens).logits
        greedy = model.generate(tokens[:, :PROMPT], attention_mask=torch.ones(len(tokens), PROMPT, dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return {"root": root, "converted": from_hf(root / "hf", root / "model.safetensors"), "tokens": tokens,
            "logits": logits, "greedy": greedy[:, PROMPT:].tolist()}


def assert_matches_transformers(outputs, ref: dict) -> None:
    """Every (logits, greedy tokens) in `outputs` (one a rank) is transformers' in `ref`: the logits within
    LOGIT_TOL, the tokens exactly."""
    for logits, tokens in outputs:
        assert (logits - ref["logits"]).abs().max() < LOGIT_TOL
        assert tokens == ref["greedy"]


def assert_converted_matches(ref: dict, min_std: float = 0.1) -> list:
    """The converted file, loaded in one process, gives transformers' logits and greedy tokens, on reference
    logits spread enough (std above `min_std`) to tell layouts apart and greedy rows that differ from each other
    and are not one repeated token. Returns shardlm's greedy tokens."""
    logits, tokens = logits_and_greedy(ref["converted"], ParallelContext.single(), ref["tokens"])
    assert ref["logits"].std() > min_std, "reference logits too flat to tell layouts apart"
    greedy = ref["greedy"]  # a constant continuation would match a reordered or stalled one
    assert len({tuple(row) for row in greedy}) == len(greedy) and all(len(set(row)) > 1 for row in greedy), \
        f"reference greedy continuations too uniform to tell generations apart: {greedy}"
    assert_matches_transformers([(logits, tokens)], ref)
    return tokens


def assert_read_in_place(ref: dict) -> None:
    """What `checkpoint.init_from=DIR` and `--checkpoint DIR` read: the HF directory itself, not converted,
    gives transformers' logits and greedy tokens in one process."""
    outputs = logits_and_greedy(ref["root"] / "hf", ParallelContext.single(), ref["tokens"])
    assert_matches_transformers([outputs], ref)


def layout_context(layout: str) -> ParallelContext:
    """A world of 2 as TP=2 ("tp2") or as EP=2 ("ep2": DP=2 too, so both ranks see the same tokens and must
    give the same logits)."""
    if layout == "tp2":
        return ParallelContext.from_process_group(2)
    return ParallelContext.from_process_group(1, expert_parallel=2)


def layout_checks(paths: dict, tokens: torch.Tensor) -> dict:
    """Checks for `run_checks` in a world of 2: "<layout> <kind>", the logits and greedy tokens of `tokens`
    from `paths[kind]` at each of LAYOUTS."""
    def check(layout: str, path):
        return lambda: logits_and_greedy(path, layout_context(layout), tokens)

    return {f"{layout} {kind}": check(layout, path) for layout in LAYOUTS for kind, path in paths.items()}


def layout_worker(paths: dict, tokens: torch.Tensor) -> dict:
    """Worker body for `run_workers(2, ...)`: `run_checks` of `layout_checks(paths, tokens)`."""
    return run_checks(layout_checks(paths, tokens))


def assert_layout_matches(results: list, name: str, ref: dict) -> None:
    """Check `name` of `layout_checks` gave transformers' logits and greedy tokens on every rank."""
    assert_matches_transformers(check_result(results, name), ref)


def assert_round_trip(ref: dict, out_dir: Path, model_class) -> None:
    """`to_hf` of the converted file gives bitwise the tensors transformers saved, under the same names, and
    `model_class.from_pretrained` of it gives bitwise the reference logits."""
    from safetensors.torch import load_file

    from shardlm.checkpoint.hf import to_hf

    out = to_hf(ref["converted"], out_dir)
    original = load_file(str(ref["root"] / "hf" / "model.safetensors"))
    back = load_file(str(out / "model.safetensors"))
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(back[name], value), name
    reloaded = model_class.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ref["tokens"]).logits, ref["logits"])


def tiny_qwen3_chat(folder: Path, data_dir: Path, max_positions: int) -> Path:
    """A random one-layer Qwen3 (tied embeddings, the real 151,936-token vocabulary) saved in `folder` with the
    shared chat tokenizer beside it (its tokenizer_config.json holds the chat template): a chat model's HF
    directory for the CLI tests."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=max_positions, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "chat" / "qwen3" / name, folder / name)
    return folder


def tiny_qwen3_policy(folder: Path, data_dir: Path, seq: int, hidden: int, head_dim: int) -> Path:
    """A random two-layer Qwen3 (seed 0; the real 151,936-token vocabulary, tied embeddings, 4 heads over 2 KV
    heads, MLP 2 x hidden, norm weights spread) saved in `folder` with the shared chat tokenizer: the RL
    comparisons' policy."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=head_dim, max_position_embeddings=seq, tie_word_embeddings=True))
    assert spread_norm_weights(model)
    return save_with_chat_tokenizer(model, folder, data_dir)


def save_with_chat_tokenizer(model, folder: Path, data_dir: Path) -> Path:
    """`model.save_pretrained(folder)` with the shared chat tokenizer's files beside it (its tokenizer_config.json
    holds the chat template): a chat model's HF directory."""
    import shutil

    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "chat" / "qwen3" / name, folder / name)
    return folder


def tiny_qwen3_reward_model(folder: Path, data_dir: Path, max_positions: int, head_std: float, seed: int = 0) -> Path:
    """A random two-layer `Qwen3ForSequenceClassification` with one label (the real 151,936-token vocabulary, tied
    embeddings, the tokenizer's pad token `<|endoftext|>`), every norm weight spread (`spread_norm_weights`) and the
    score head drawn from N(0, head_std^2) so the sequences score apart, saved with the shared chat tokenizer."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions, tie_word_embeddings=True,
        num_labels=1, pad_token_id=151643))
    assert spread_norm_weights(model)  # a swapped or dropped norm shows
    with torch.no_grad():
        model.score.weight.normal_(0.0, head_std)
    return save_with_chat_tokenizer(model, folder, data_dir)


def assert_router_without_bias_exports(ref: dict, root: Path, model_class) -> None:
    """The converted file's routers without their expert bias (`moe_expert_bias = false`, the tensors dropped: a
    model trained without one) exports with a zero score-correction bias that `model_class` loads to shardlm's own
    logits of that model (within LOGIT_TOL), which are far from the reference's."""
    import dataclasses

    from shardlm.checkpoint.files import write_consolidated
    from shardlm.checkpoint.hf import to_hf
    from shardlm.checkpoint.state import load_consolidated

    config, tensors = load_consolidated(ref["converted"])
    config.model = dataclasses.replace(config.model, moe_expert_bias=False)
    kept = {name: value for name, value in tensors.items() if not name.endswith("router.expert_bias")}
    assert len(kept) < len(tensors), "the reference has no expert bias to drop"
    write_consolidated(root / "unbiased.safetensors", kept, dataclasses.asdict(config))
    ours = logits_and_greedy(root / "unbiased.safetensors", ParallelContext.single(), ref["tokens"])[0]
    assert (ours - ref["logits"]).abs().max() > 100 * LOGIT_TOL  # the bias mattered
    reloaded = model_class.from_pretrained(to_hf(root / "unbiased.safetensors", root / "hf-unbiased")).eval()
    with torch.no_grad():
        assert (reloaded(ref["tokens"]).logits - ours).abs().max() < LOGIT_TOL
