"""Benchmarks of evaluation and generation on a small GPT (random weights; speed only).

`eval_throughput()` times the overlapping-window WikiText evaluation and reports scored tokens per
second (and window tokens per second: with stride s and context L each window runs L positions to
score s). `generation_latency()` times greedy generation with and without the key/value cache and
reports the median milliseconds per new token over repeats. Each function returns a dict of figures
and runs in well under 30 s on a laptop CPU. `python -m shardlm.eval.bench` prints both as JSON.
"""

from __future__ import annotations

import statistics
import time

import torch

from shardlm.models.config import ModelConfig
from shardlm.models.gpt import GPT
from shardlm.parallel import ParallelContext

GPT2_VOCAB = 50257


def bench_model(device: str = "cpu", num_layers: int = 4, hidden_size: int = 256, num_heads: int = 8,
                seq_length: int = 256, vocab_size: int = GPT2_VOCAB) -> GPT:
    """A small GPT-2-shaped model (single rank, eval mode) on `device`."""
    cfg = ModelConfig(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, seq_length=seq_length,
                      vocab_size=vocab_size, dropout=0.0)
    return GPT(cfg, ParallelContext.single(device), seed=0).eval()


def _describe(model: GPT) -> dict:
    cfg = model.cfg
    return {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
            "seq_length": cfg.seq_length, "vocab": cfg.vocab_size, "device": str(model.ctx.device),
            "threads": torch.get_num_threads()}


def _wikitext_tokens(count: int) -> list[int]:
    """The first `count` BPE tokens of the detokenized WikiText-103 test file (random ids without it)."""
    from shardlm.paths import shared_data_dir

    path = shared_data_dir() / "wikitext" / "wikitext-103" / "wiki.test.tokens"
    if path.is_file():
        from shardlm.config import DataConfig
        from shardlm.data.tokenizers import build_tokenizer_for
        from shardlm.eval.detokenize import wikitext_detokenize

        text = "".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[:400])
        tokens = build_tokenizer_for(DataConfig()).encode(wikitext_detokenize(text))
        if len(tokens) >= count:
            return tokens[:count]
    return torch.randint(0, GPT2_VOCAB, (count,), generator=torch.Generator().manual_seed(0)).tolist()


def eval_throughput(device: str = "cpu", num_tokens: int = 2048, stride: int = 32, batch_size: int = 8,
                    repeats: int = 3) -> dict:
    """Overlapping-window evaluation speed: median scored tokens/s over `repeats` runs."""
    from shardlm.eval.perplexity import evaluate_stream
    from shardlm.eval.windows import evaluation_windows

    model = bench_model(device)
    tokens = _wikitext_tokens(num_tokens)
    windows = evaluation_windows(len(tokens), model.cfg.seq_length, stride)
    evaluate_stream(model, tokens[:2 * model.cfg.seq_length], stride=stride, batch_size=batch_size)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = evaluate_stream(model, tokens, stride=stride, batch_size=batch_size)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    window_tokens = sum(w.end - w.start for w in windows)
    return {**_describe(model), "stride": stride, "batch_size": batch_size, "scored_tokens": result.scored_tokens,
            "windows": len(windows), "seconds": median, "tokens_per_second": result.scored_tokens / median,
            "window_tokens_per_second": window_tokens / median}


def generation_latency(device: str = "cpu", prompt_tokens: int = 32, new_tokens: int = 128, batch: int = 1,
                       repeats: int = 3) -> dict:
    """Greedy generation time per new token, with and without the key/value cache (medians)."""
    from shardlm.eval.generate import SamplingConfig, generate_tokens

    model = bench_model(device)
    prompts = torch.randint(0, GPT2_VOCAB, (batch, prompt_tokens), generator=torch.Generator().manual_seed(1))
    out = {**_describe(model), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "batch": batch}
    produced = {}
    for use_cache in (True, False):
        config = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop_at_eod=False, use_cache=use_cache)
        generate_tokens(model, prompts[:, :4].tolist(), SamplingConfig(max_new_tokens=4, temperature=0.0))  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            results = generate_tokens(model, prompts.tolist(), config)
            _sync(device)
            times.append(time.perf_counter() - start)
        produced[use_cache] = [r.tokens for r in results]
        key = "with_cache" if use_cache else "without_cache"
        out[f"ms_per_token_{key}"] = 1000 * statistics.median(times) / new_tokens
    out["cache_speedup"] = out["ms_per_token_without_cache"] / out["ms_per_token_with_cache"]
    out["same_tokens"] = produced[True] == produced[False]
    return out


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    import json

    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(json.dumps({"eval": eval_throughput(), "generation": generation_latency()}, indent=2))


if __name__ == "__main__":
    main()
