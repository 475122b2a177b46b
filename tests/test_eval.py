"""The paper's evaluations: windows score every token once, perplexity is exact on known models,
TP and DP change nothing, LAMBADA strict vs non-strict, and the WikiText detokenizer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardlm.config import DataConfig
from shardlm.data.tokenizers import build_tokenizer_for
from shardlm.errors import UserError
from shardlm.eval.detokenize import count_original_tokens, wikitext_detokenize
from shardlm.eval.head import logits_at
from shardlm.eval.lambada import evaluate_lambada, lambada_example, read_lambada
from shardlm.eval.perplexity import evaluate_stream
from shardlm.eval.vocab_parallel import vocab_parallel_argmax
from shardlm.eval.wikitext import evaluate_wikitext, read_text
from shardlm.eval.windows import evaluation_windows, num_windows
from shardlm.models.config import ModelConfig
from shardlm.models.gpt import GPT
from shardlm.parallel import ParallelContext, vocab_parallel_cross_entropy

from multiproc import run_workers

WIKI_LINES, LAMBADA_LINES, SEQ, STRIDE = 12, 24, 64, 16
TOL = 1e-5


# ---------------------------------------------------------------- models with known predictions

PADDING_LOGIT = 50.0  # far above every real logit: counting or predicting padding would show


class BigramModel(nn.Module):
    """A single-rank stand-in for GPT whose logits at a position depend only on that position's token:
    `table[token]` over the real vocabulary, then `padded - vocab` padding entries set to PADDING_LOGIT.
    Implements what the evaluators use: cfg, ctx, forward(tokens[, targets]), full_logits."""

    def __init__(self, table: torch.Tensor, padded_vocab_size: int, seq_length: int = 64):
        super().__init__()
        vocab = table.shape[1]
        self.cfg = SimpleNamespace(seq_length=seq_length, vocab_size=vocab)
        self.ctx = ParallelContext.single()
        padding = torch.full((table.shape[0], padded_vocab_size - vocab), PADDING_LOGIT)
        self.register_buffer("table", torch.cat([table.float(), padding], dim=1))
        self.calls: list[tuple[int, ...]] = []

    def forward(self, tokens, targets=None, ignore_index=-100, cache=None):
        self.calls.append(tuple(tokens.shape))
        logits = self.table[tokens]  # (B, T, V_padded)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.ctx.tp, vocab_size=self.cfg.vocab_size,
                                            ignore_index=ignore_index)

    def full_logits(self, local_logits):
        return local_logits[..., :self.cfg.vocab_size]


class SuccessorModel(BigramModel):
    """Predicts `successor[token]` with logit 10 (others 0), over a vocabulary of `vocab_size` ids."""

    def __init__(self, successor: dict[int, int], vocab_size: int, padded_vocab_size: int, default: int = 0,
                 seq_length: int = 64):
        nn.Module.__init__(self)
        self.cfg = SimpleNamespace(seq_length=seq_length, vocab_size=vocab_size)
        self.ctx = ParallelContext.single()
        self.padded = padded_vocab_size
        self.successor = successor
        self.default = default
        self.calls = []

    def forward(self, tokens, targets=None, ignore_index=-100, cache=None):
        self.calls.append(tuple(tokens.shape))
        predicted = tokens.clone().apply_(lambda t: self.successor.get(t, self.default))
        logits = torch.zeros(*tokens.shape, self.padded)
        logits.scatter_(-1, predicted.unsqueeze(-1), 10.0)
        logits[..., self.cfg.vocab_size:] = PADDING_LOGIT
        return logits


def wiki_file(data_dir):
    return data_dir / "wikitext" / "wikitext-103" / "wiki.test.tokens"


def lambada_file(data_dir):
    return data_dir / "lambada" / "lambada_test.jsonl"


def tiny_gpt(ctx: ParallelContext, vocab_size: int, seed: int = 11) -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=SEQ, vocab_size=vocab_size,
                      dropout=0.0, init_std=0.1)
    return GPT(cfg, ctx, seed=seed).eval()


def tied_logits(vocab: int, padded: int) -> torch.Tensor:
    """(4, padded) logits whose maximum is tied: between ids 5 and padded / 2 + 5 (in the two halves, so on
    two ranks at TP=2), between padded / 2 + 9 and padded / 2 + 7 (one rank), between vocab - 1 and 40 with a
    larger logit on every padding id, and everywhere (all zero)."""
    half = padded // 2
    logits = torch.zeros(4, padded)
    logits[0, [5, half + 5]] = 2.0
    logits[1, [half + 9, half + 7]] = 2.0
    logits[2, [vocab - 1, 40]] = 2.0
    logits[2, vocab:] = 3.0
    return logits


def all_evaluations(ctx, data_dir) -> dict:
    """Every evaluation of the tiny GPT (same seed) on this context, plus the uniform-logit model."""
    tokenizer = build_tokenizer_for(DataConfig())
    text = read_text(wiki_file(data_dir), WIKI_LINES)
    texts = read_lambada(lambada_file(data_dir), LAMBADA_LINES)
    model = tiny_gpt(ctx, tokenizer.vocab_size)
    out = {
        "wikitext": evaluate_wikitext(model, tokenizer, text, stride=STRIDE, batch_size=4).to_dict(),
        "lambada_strict": evaluate_lambada(model, tokenizer, texts, strict=True, batch_size=8).to_dict(),
        "lambada": evaluate_lambada(model, tokenizer, texts, strict=False, batch_size=8).to_dict(),
    }
    inputs = torch.randint(0, tokenizer.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        local = model(inputs)
        out["argmax"] = vocab_parallel_argmax(local, ctx.tp, tokenizer.vocab_size).tolist()
        out["full_argmax"] = model.full_logits(local).argmax(dim=-1).tolist()
        keep = inputs % 3 == 0
        # the selected rows' GEMM sums in another order than the whole batch's on some kernels (AVX2's): fp32 rounding
        out["scored_logits_match"] = torch.allclose(logits_at(model, inputs, keep), local[keep], rtol=1e-5, atol=1e-6)
        tied = tied_logits(tokenizer.vocab_size, model.padded_vocab_size)
        out["tied_argmax"] = vocab_parallel_argmax(tied.chunk(ctx.tp_size, dim=-1)[ctx.tp_rank], ctx.tp,
                                                   tokenizer.vocab_size).tolist()
    with torch.no_grad():
        model.wte.weight.zero_()  # every logit (padding included) is 0: a uniform model
    out["uniform"] = evaluate_wikitext(model, tokenizer, text, stride=STRIDE, batch_size=4).to_dict()
    out["padded_vocab_size"] = model.padded_vocab_size
    return out


def worker_layouts(data_dir) -> dict:
    """World of 2: TP=2 (one model over both ranks) and TP=1 x DP=2 (windows split over ranks)."""
    out = {}
    for tp in (2, 1):
        ctx = ParallelContext.from_process_group(tp)
        out[f"tp{tp}"] = all_evaluations(ctx, data_dir)
    return out


@pytest.fixture(scope="module")
def reference(data_dir):
    return all_evaluations(ParallelContext.single(), data_dir)


@pytest.fixture(scope="module")
def world2(data_dir):
    return run_workers(2, worker_layouts, data_dir)


# ------------------------------------------------------------------------------ window arithmetic

EDGE_CASES = [(n, context, stride) for context, stride in ((8, 3), (8, 8), (8, 1), (9, 4))
              for n in (1, 2, 3, stride, stride + 1, context - 1, context, context + 1, context + 2,
                        context + stride, context + stride + 1, 2 * context + 1, 40)]


@pytest.mark.parametrize("n,context,stride", EDGE_CASES)
def test_windows_score_every_token_once(n, context, stride):
    windows = evaluation_windows(n, context, stride)
    scored = [w.start + offset for w in windows for offset in range(w.first_scored, w.end - w.start)]
    assert scored == list(range(n - 1)), "targets 0..N-2 (tokens 1..N-1), each exactly once, in order"
    assert len(windows) == num_windows(n, context, stride)
    for k, w in enumerate(windows):
        assert 0 <= w.start < w.end <= n - 1 and w.end - w.start <= context
        assert w.num_scored >= 1
        if k > 0:  # later windows score at most `stride` targets, each with >= context - stride of history
            assert w.num_scored <= stride and w.first_scored == context - stride


def test_window_errors_name_the_fix():
    with pytest.raises(UserError, match="stride=0 must be between 1 and"):
        evaluation_windows(100, 8, 0)
    with pytest.raises(UserError, match="stride=9 must be between 1 and the context length 8"):
        evaluation_windows(100, 8, 9)
    model = BigramModel(torch.zeros(4, 4), padded_vocab_size=8, seq_length=16)
    with pytest.raises(UserError, match="context=17 is longer than the model's seq_length=16"):
        evaluate_stream(model, [1, 2, 3], context=17)


@pytest.mark.parametrize("n", [2, 17, 63, 64, 65, 66, 100, 131])
@pytest.mark.parametrize("context,stride,batch", [(16, 4, 3), (16, 16, 2), (7, 3, 5)])
def test_stream_loss_sums_each_target_once(n, context, stride, batch):
    """With logits that depend only on the current token, the windowed total must equal the plain sum
    of every target's cross-entropy, however the windows overlap and batch; padding never counts."""
    generator = torch.Generator().manual_seed(n)
    table = torch.randn(50, 50, generator=generator)
    tokens = torch.randint(0, 50, (n,), generator=generator)
    model = BigramModel(table, padded_vocab_size=128)
    expected = F.cross_entropy(table[tokens[:-1]], tokens[1:], reduction="sum").item()
    result = evaluate_stream(model, tokens.tolist(), stride=stride, context=context, batch_size=batch)
    assert result.scored_tokens == n - 1
    assert result.total_loss == pytest.approx(expected, rel=1e-6)
    assert all(t <= context for _, t in model.calls)


def test_gpt_stream_loss_equals_full_forward_of_each_window():
    """The evaluator runs the output layer on scored positions only; GPT.forward on whole windows,
    keeping each window's scored losses, must give the same total."""
    model = tiny_gpt(ParallelContext.single(), vocab_size=300)
    tokens = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(1))
    expected = 0.0
    for w in evaluation_windows(len(tokens), 32, 8):
        with torch.no_grad():
            losses = model(tokens[None, w.start:w.end], tokens[None, w.start + 1:w.end + 1])[0]
        expected += losses[w.first_scored:].double().sum().item()
    result = evaluate_stream(model, tokens.tolist(), stride=8, context=32, batch_size=3)
    assert result.total_loss == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------------ perplexity

def test_uniform_logits_give_the_vocabulary_size(reference, data_dir):
    """All logits equal: each token costs log V over the *real* vocabulary (padding excluded), so
    perplexity = V and the adjusted perplexity = V ** ((N - 1) / (T_orig - 1))."""
    tokenizer = build_tokenizer_for(DataConfig())
    uniform = reference["uniform"]
    vocab = tokenizer.vocab_size
    text = read_text(wiki_file(data_dir), WIKI_LINES)
    n = len(tokenizer.encode(wikitext_detokenize(text)))
    words = len(text.strip().split(" "))
    assert reference["padded_vocab_size"] > vocab
    assert (uniform["bpe_tokens"], uniform["original_tokens"], uniform["scored_tokens"]) == (n, words, n - 1)
    assert uniform["loss"] == pytest.approx(math.log(vocab), rel=1e-6)
    assert uniform["perplexity"] == pytest.approx(vocab, rel=1e-5)
    assert uniform["adjusted_perplexity"] == pytest.approx(vocab ** ((n - 1) / (words - 1)), rel=1e-5)


def test_uniform_logits_under_tensor_parallel(world2):
    tp2 = world2[0]["tp2"]
    assert tp2["padded_vocab_size"] != world2[0]["tp1"]["padded_vocab_size"]  # 256- vs 128-multiple
    for layout in ("tp2", "tp1"):
        uniform = world2[0][layout]["uniform"]
        assert uniform["perplexity"] == pytest.approx(50257, rel=1e-5), layout


@pytest.mark.parametrize("layout", ["tp2", "tp1"], ids=["TP=2", "TP=1xDP=2"])
@pytest.mark.parametrize("task", ["wikitext", "lambada_strict", "lambada"])
def test_parallel_layouts_give_the_same_numbers(world2, reference, layout, task):
    expected = reference[task]
    for rank in (0, 1):
        got = world2[rank][layout][task]
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), f"{task} {key} on rank {rank}"
            else:
                assert got[key] == value, f"{task} {key} on rank {rank}"


def test_vocab_parallel_argmax_and_scored_logits(world2, reference):
    """The argmax over vocabulary shards equals the argmax of the gathered logits, at TP=1 and TP=2;
    the output layer applied to selected positions gives those positions' logits."""
    for run in (reference, world2[0]["tp2"], world2[1]["tp2"], world2[0]["tp1"]):
        assert run["argmax"] == run["full_argmax"]
        assert run["scored_logits_match"]
    assert world2[0]["tp2"]["argmax"] == reference["argmax"]


def test_vocab_parallel_argmax_breaks_ties_to_the_smallest_id(world2, reference):
    """Tied maxima on two TP ranks, on one rank, and everywhere: the smallest tied id wins, as `torch.argmax`
    of the gathered real logits gives, and a padding id is never chosen even where its logit is the largest;
    at TP=1 and on both ranks of TP=2."""
    vocab = 50257
    for run in (reference, world2[0]["tp2"], world2[1]["tp2"], world2[0]["tp1"]):
        padded = run["padded_vocab_size"]  # a multiple of 128 x TP
        expected = [5, padded // 2 + 7, 40, 0]
        assert tied_logits(vocab, padded)[:, :vocab].argmax(dim=-1).tolist() == expected
        assert run["tied_argmax"] == expected


def test_wikitext_result_is_consistent(reference):
    r = reference["wikitext"]
    assert r["scored_tokens"] == r["bpe_tokens"] - 1
    assert r["windows"] == num_windows(r["bpe_tokens"], SEQ, STRIDE)
    assert r["perplexity"] == pytest.approx(math.exp(r["total_loss"] / (r["bpe_tokens"] - 1)))
    assert r["adjusted_perplexity"] == pytest.approx(math.exp(r["total_loss"] / (r["original_tokens"] - 1)))
    # the model is random: its loss is near log V but not exactly uniform
    assert 0.5 * math.log(50257) < r["loss"] < 2 * math.log(50257)


def test_whole_test_file_counts_match_the_reference(data_dir):
    """The reference counts 245,566 original tokens and 270,329 scored BPE tokens on WikiText-103 test."""
    tokenizer = build_tokenizer_for(DataConfig())
    raw = read_text(wiki_file(data_dir))
    assert count_original_tokens(raw) == 245_566
    assert len(tokenizer.encode(wikitext_detokenize(raw))) - 1 == 270_329


# ---------------------------------------------------------------------------------- detokenizer

def test_detokenizer_on_wikitext_lines(data_dir):
    lines = read_text(wiki_file(data_dir), 400).splitlines(keepends=True)
    heading = next(line for line in lines if line.startswith(" = = ") and not line.startswith(" = = = "))
    title = heading.strip().strip("= ").strip()
    assert wikitext_detokenize("\n" + heading) == f"\n== {title} ==\n"  # a line's leading space goes too
    first = lines[3]  # " Robert Boulter is an English film , television and theatre actor . He had a guest @-@ ..."
    detok = wikitext_detokenize(first)
    assert "film, television" in detok and "guest-starring" in detok and '"Craig"' in detok
    assert "Teddy's Story" in detok and "Long Firm; he" in detok
    numbers = next(line for line in lines if " @,@ " in line)
    left, right = numbers.split(" @,@ ", 1)
    assert f"{left.split()[-1]},{right.split()[0]}" in wikitext_detokenize(numbers)
    decimal = next(line for line in lines if " @.@ " in line)
    left, right = decimal.split(" @.@ ", 1)
    assert f"{left.split()[-1]}.{right.split()[0]}" in wikitext_detokenize(decimal)
    whole = wikitext_detokenize("".join(lines))
    for leftover in (" @-@ ", " @,@ ", " @.@ ", " , ", " . ", " 's", " \n", "\n ", "= = "):
        assert leftover not in whole, leftover
    # words survive: joining the detokenized text's characters loses nothing but spaces and @ markers
    assert whole.replace(" ", "").replace("\n", "") == "".join(lines).replace(" ", "").replace(
        "\n", "").replace("@", "")


# --------------------------------------------------------------------------------------- LAMBADA

def test_lambada_strict_and_non_strict_on_hand_made_examples():
    """" Boulter" is three BPE tokens. The model predicts " B" after " Robert", "oul" after " B" and
    "ter" after "oul" (anything else: token 0). So "...met Robert Boulter" is right in both modes,
    "...saw Boulter" only in non-strict mode (the first token, after " saw", is wrong) and
    "...met Robert Smith" in neither."""
    tokenizer = build_tokenizer_for(DataConfig())
    b, oul, ter = tokenizer.encode(" Boulter")
    robert = tokenizer.encode(" Robert")[0]
    model = SuccessorModel({robert: b, b: oul, oul: ter}, tokenizer.vocab_size, padded_vocab_size=50304)
    texts = ["He met Robert Boulter", "She saw Boulter", "He met Robert Smith"]
    context, target = lambada_example(tokenizer, texts[0], strict=True)
    assert (tokenizer.decode(context), target) == ("He met Robert", [b, oul, ter])
    assert lambada_example(tokenizer, texts[1], strict=False)[1] == [ter]
    strict = evaluate_lambada(model, tokenizer, texts, strict=True, batch_size=2)
    loose = evaluate_lambada(model, tokenizer, texts, strict=False, batch_size=2)
    assert (strict.correct, strict.examples, strict.accuracy) == (1, 3, pytest.approx(1 / 3))
    assert (loose.correct, loose.examples) == (2, 3)
    alone = [evaluate_lambada(model, tokenizer, [t], strict=True).correct for t in texts]
    assert alone == [1, 0, 0]


def test_lambada_truncates_long_contexts_to_the_sequence_length():
    tokenizer = build_tokenizer_for(DataConfig())
    b, oul, ter = tokenizer.encode(" Boulter")
    robert = tokenizer.encode(" Robert")[0]
    model = SuccessorModel({robert: b, b: oul, oul: ter}, tokenizer.vocab_size, padded_vocab_size=50304,
                           seq_length=8)
    result = evaluate_lambada(model, tokenizer, ["one two three four five six seven eight Robert Boulter"])
    assert (result.correct, result.truncated) == (1, 1)
    assert max(t for _, t in model.calls) == 8


def test_lambada_file_errors(tmp_path, data_dir):
    assert len(read_lambada(lambada_file(data_dir), 5)) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    with pytest.raises(UserError, match="line 2 is not"):
        read_lambada(bad)
    with pytest.raises(UserError, match="LAMBADA data not found"):
        read_lambada(tmp_path / "missing.jsonl")
