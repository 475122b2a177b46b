"""Generation: the key/value cache changes no token, batching and tensor parallelism change no token,
a seed fixes the samples, end-of-document stops a row, and each cached step is one position."""

from __future__ import annotations

import pytest
import torch
from test_eval import SuccessorModel

from shardlm.config import DataConfig
from shardlm.data.tokenizers import build_tokenizer_for
from shardlm.errors import UserError
from shardlm.eval.generate import SamplingConfig, choose_next, filter_logits, generate, generate_tokens
from shardlm.models.config import ModelConfig
from shardlm.models.gpt import GPT
from shardlm.parallel import ParallelContext

from multiproc import run_workers

VOCAB, SEQ = 300, 48
PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [99], [1, 2, 3, 4, 5, 6]]
SAMPLERS = {
    "greedy": SamplingConfig(max_new_tokens=12, temperature=0.0),
    "sample": SamplingConfig(max_new_tokens=12, temperature=0.9, seed=3),
    "top_k": SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=20, seed=4),
    "top_p": SamplingConfig(max_new_tokens=12, temperature=1.2, top_p=0.8, seed=5),
    "min_p penalty": SamplingConfig(max_new_tokens=12, temperature=1.0, min_p=0.05, repetition_penalty=1.3, seed=6),
    "greedy penalty": SamplingConfig(max_new_tokens=12, temperature=0.0, repetition_penalty=1.5),
}


def tiny_gpt(ctx: ParallelContext, seed: int = 5) -> GPT:
    # init_std 0.3 gives peaked, non-degenerate distributions (the default 0.02 is nearly uniform)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                      dropout=0.0, init_std=0.3)
    return GPT(cfg, ctx, seed=seed).eval()


def with_options(config: SamplingConfig, **changes) -> SamplingConfig:
    return SamplingConfig(**{**config.__dict__, **changes})


def all_generations(ctx: ParallelContext) -> dict:
    model = tiny_gpt(ctx)
    return {name: [g.tokens for g in generate_tokens(model, PROMPTS, config, eod=VOCAB - 1)]
            for name, config in SAMPLERS.items()}


def worker_tensor_parallel():
    return all_generations(ParallelContext.from_process_group(2))


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(ParallelContext.single())


@pytest.fixture(scope="module")
def reference():
    return all_generations(ParallelContext.single())


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, worker_tensor_parallel)


def test_kv_cache_forward_equals_full_forward(model):
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache()
        pieces = [model(tokens[:, :7], cache=cache), model(tokens[:, 7:12], cache=cache)]
        pieces += [model(tokens[:, t:t + 1], cache=cache) for t in range(12, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_cache_gives_the_same_tokens_as_recomputing(model, reference, name):
    without = generate_tokens(model, PROMPTS, with_options(SAMPLERS[name], use_cache=False), eod=VOCAB - 1)
    assert [g.tokens for g in without] == reference[name]
    assert all(len(tokens) == 12 for tokens in reference[name])


def test_generations_are_not_trivial(reference):
    assert reference["greedy"] != reference["sample"]
    assert reference["greedy penalty"] != reference["greedy"]  # the penalty reaches greedy decoding
    assert len({t for tokens in reference["sample"] for t in tokens}) > 10


def test_batched_prompts_equal_prompts_alone(model, reference):
    alone = [generate_tokens(model, [p], SAMPLERS["greedy"], eod=VOCAB - 1)[0].tokens for p in PROMPTS]
    assert alone == reference["greedy"]


def test_same_seed_same_tokens_other_seed_other_tokens(model, reference):
    again = generate_tokens(model, PROMPTS, SAMPLERS["sample"], eod=VOCAB - 1)
    other = generate_tokens(model, PROMPTS, with_options(SAMPLERS["sample"], seed=99), eod=VOCAB - 1)
    assert [g.tokens for g in again] == reference["sample"]
    assert [g.tokens for g in other] != reference["sample"]


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_tensor_parallel_generates_the_same_tokens(world2, reference, name):
    assert world2[0][name] == reference[name]
    assert world2[1][name] == reference[name], "both TP ranks continue with the same tokens"


def test_each_cached_step_is_one_position():
    successor = {t: t + 1 for t in range(40)}
    model = SuccessorModel(successor, vocab_size=64, padded_vocab_size=128)
    model.new_kv_cache = lambda capacity=None: object()  # a stand-in cache: only the call shapes matter
    generate_tokens(model, [[1, 2, 3], [10]], SamplingConfig(max_new_tokens=5, temperature=0.0))
    prefill, *steps = model.calls
    assert prefill == (2, 1) and steps == [(2, 1)] * (len(steps)) and len(steps) == 3 + 5 - 1 - 1
    model.calls.clear()
    generate_tokens(model, [[1, 2, 3], [10]], SamplingConfig(max_new_tokens=5, temperature=0.0, use_cache=False))
    assert [t for _, t in model.calls] == list(range(1, 8))


def test_end_of_document_stops_a_row_and_prompts_are_forced():
    eod = 63
    successor = {1: 2, 2: 3, 3: eod, 10: 11, 11: 12, 12: 13, 13: 14, 14: 15, 15: 16}
    model = SuccessorModel(successor, vocab_size=64, padded_vocab_size=128)
    config = SamplingConfig(max_new_tokens=4, temperature=0.0, use_cache=False)
    short, long = generate_tokens(model, [[1], [10, 20, 30]], config, eod=eod)
    assert (short.tokens, short.finish_reason) == ([2, 3], "eod")
    # the long prompt's own tokens are kept (20, 30), not the model's 11, 12; 30 -> 0 (default)
    assert (long.prompt_tokens, long.tokens, long.finish_reason) == ([10, 20, 30], [0, 0, 0, 0], "length")
    ignoring = generate_tokens(model, [[1]], with_options(config, stop_at_eod=False), eod=eod)[0]
    assert ignoring.tokens == [2, 3, eod, 0]


def test_sequence_length_ends_generation(model):
    result = generate_tokens(model, [[1] * (SEQ - 3)], SamplingConfig(max_new_tokens=10, temperature=0.0))[0]
    assert (len(result.tokens), result.finish_reason) == (3, "context")
    with pytest.raises(UserError, match=f"leaves no room in model.seq_length={SEQ}"):
        generate_tokens(model, [[1] * SEQ], SamplingConfig())


def test_top_k_and_top_p_keep_the_right_tokens():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept_k = filter_logits(logits, 1.0, 2, 1.0)
    torch.testing.assert_close(kept_k, torch.tensor([[0.0, 0.5, 0.0, 0.3]], dtype=torch.float64) / 0.8)
    # nucleus 0.7: 0.5 + 0.3 is the smallest most-likely set reaching 0.7
    kept_p = filter_logits(logits, 1.0, 0, 0.7)
    torch.testing.assert_close(kept_p, torch.tensor([[0.0, 0.5, 0.0, 0.3]], dtype=torch.float64) / 0.8)
    sharper = filter_logits(logits, 0.5, 0, 1.0)  # temperature 0.5 squares and renormalizes
    torch.testing.assert_close(sharper, (probs.double() ** 2) / (probs.double() ** 2).sum())


def test_inverse_cdf_sampling():
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log().repeat(4, 1)
    uniform = torch.tensor([0.0, 0.49, 0.51, 0.99], dtype=torch.float64)
    # sorted by probability: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05); cumulative 0.5, 0.8, 0.95, 1.0
    picked = choose_next(logits, uniform, SamplingConfig(temperature=1.0))
    assert picked.tolist() == [1, 1, 3, 0]
    assert choose_next(logits, uniform, SamplingConfig(temperature=1.0, top_k=1)).tolist() == [1] * 4


def test_sampling_config_errors():
    for bad, message in [({"top_p": 0.0}, "top_p=0.0"), ({"temperature": -1.0}, "temperature=-1.0"),
                         ({"max_new_tokens": 0}, "max_new_tokens=0"), ({"top_k": -2}, "top_k=-2"),
                         ({"min_p": 1.5}, "min_p=1.5"), ({"repetition_penalty": 0.0}, "repetition_penalty=0.0")]:
        with pytest.raises(UserError, match=message):
            SamplingConfig(**bad).validate()


def test_text_api_with_the_gpt2_tokenizer():
    tokenizer = build_tokenizer_for(DataConfig())
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_heads=4, seq_length=32, vocab_size=tokenizer.vocab_size,
                      dropout=0.0, init_std=0.3)
    model = GPT(cfg, ParallelContext.single(), seed=1).eval()
    results = generate(model, tokenizer, ["The cat sat", "Hello"], SamplingConfig(max_new_tokens=6, seed=2))
    for prompt, result in zip(["The cat sat", "Hello"], results):
        assert result.prompt_tokens == tokenizer.encode(prompt)
        assert result.text == tokenizer.decode(result.tokens)
        assert all(0 <= t < tokenizer.vocab_size for t in result.tokens)
