"""Supervised fine-tuning on one CPU (`make bench` section `sft`): per-document attention and throughput vs TRL.

The data are real: the shared Dolly records (`chat/dolly-15k-first600.jsonl`) rendered and tokenized with the
shared Qwen3 tokenizer's chat template (`shardlm.sft.template`), packed into rows of T tokens by best-fit-decreasing
(`shardlm.sft.packing.PackedRows(strategy="bfd", seed=None)`, the rows TRL's `pack_dataset(strategy="bfd")` makes).

- `attention`: forward + backward of attention over `attention_rows` packed rows (B, H, T, D), fp32, spread evenly
  over bfd's rows (which go from a few long documents to dozens of short ones):
  `document_causal_attention` (`shardlm.models.documents`; causal SDPA on each document's slice, `cu_seqlens` from the
  packed rows) against one dense SDPA call with the (B, 1, T, T) block-causal boolean mask (the kernel of
  `reference_document_attention`; the mask is built once, outside the timing, its build time is reported on its
  own), and, for scale, plain causal SDPA over each whole row (what attention costs when documents are ignored).
  The three take turns in a new order every round (`common.interleaved`); `ratio_dense_over_per_document` is the
  dense call's time over the per-document one's, per round.
- `throughput`: a tiny random-init Qwen3 (`Qwen3ForCausalLM`, saved with the tokenizer into a temporary folder)
  fine-tuned on the same conversations and packing by TRL's `SFTTrainer` (`packing=True, packing_strategy="bfd",
  padding_free=True, assistant_only_loss=True`, SDPA attention; `sft_trl.py`) and by shardlm
  (`shardlm.training.run.train` with `[sft]` and `checkpoint.init_from` = that folder for the first `warmup_steps`
  steps, then `Trainer.train_step` of the trainer it returns). The two take turns, one optimizer step of
  `rows_per_step` rows each (a shardlm step right after each TRL step, outside TRL's clock), so that both see the
  same load on a shared machine; the first `warmup_steps` pairs are not counted. Step time: TRL's, from the end of
  its previous step to `on_step_end`; shardlm's, around `train_step`; both include data loading. tokens/s counts
  real (non-padding) tokens: TRL's padding-free batches hold only those (`state.num_input_tokens_seen`), shardlm's
  rows are padded to T and count their documents' tokens. `ratio`: shardlm's tokens/s over TRL's, per pair.
- `packing`: real tokens per row token (`PackStats.efficiency`) for bfd and for one conversation per row (`pad`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shardlm.bench.common import interleaved, median_cell, steady, summary, torch_threads

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass(frozen=True)
class SFTShape:
    """The tiny Qwen3 that both trainers fine-tune, their steps, and the attention benchmark's shape."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    ffn_hidden_size: int = 768
    seq_length: int = 2048
    rows_per_step: int = 1
    steps: int = 8
    warmup_steps: int = 2
    records: int | None = None
    """The first `records` Dolly records (None: all 600)."""
    attention_rows: int = 2
    attention_heads: int = 12
    attention_head_dim: int = 64

    def describe(self, vocab_size: int) -> str:
        return (f"Qwen3 {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads "
                f"({self.num_kv_heads} KV) x {self.head_dim}, MLP {self.ffn_hidden_size}, vocabulary {vocab_size}, "
                f"tied embeddings, random init, fp32; rows of {self.seq_length} tokens, {self.rows_per_step} per "
                f"step, {self.steps} steps of which the first {self.warmup_steps} are not counted")


SFT_BENCH = SFTShape()
SFT_QUICK = SFTShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                     seq_length=256, rows_per_step=1, steps=2, warmup_steps=1, records=24,
                     attention_rows=1, attention_heads=4, attention_head_dim=32)


def chat_data(data_dir: Path | None = None) -> tuple[Path, Path]:
    """The shared Dolly records file and Qwen3 tokenizer folder."""
    from shardlm.paths import shared_data_dir

    chat = Path(data_dir or shared_data_dir()) / "chat"
    return chat / "dolly-15k-first600.jsonl", chat / "qwen3"


def load_documents(shape: SFTShape, records_file: Path, tokenizer_dir: Path):
    """The conversations (the first `shape.records`) that fit in a row whole, and their tokenized documents."""
    from shardlm.sft.records import load_conversations
    from shardlm.sft.template import ChatTemplate, tokenize_conversations

    conversations = load_conversations(records_file, limit=shape.records)
    docs = tokenize_conversations(ChatTemplate.from_dir(tokenizer_dir), conversations)
    keep = [i for i, doc in enumerate(docs) if len(doc.input_ids) <= shape.seq_length]
    return [conversations[i] for i in keep], [docs[i] for i in keep]


def packing_efficiency(docs, seq_length: int) -> dict:
    """Rows and real tokens per row token of bfd packing and of one conversation per row."""
    from shardlm.sft.packing import PackedRows

    out = {}
    for strategy in ("bfd", "pad"):
        stats = PackedRows(docs, seq_length, strategy, seed=None).stats
        out[strategy] = {"rows": stats.rows, "tokens": stats.tokens, "efficiency": stats.efficiency}
    out["rows_ratio_pad_over_bfd"] = out["pad"]["rows"] / out["bfd"]["rows"]
    return out


def attention_speed(shape: SFTShape, docs, repeats: int, threads: int = 2) -> dict:
    """ms per forward + backward of per-document, dense block-causal and whole-row causal attention."""
    from shardlm.models.documents import document_causal_attention
    from shardlm.sft.packing import PackedRows

    batch, heads, length, dim = shape.attention_rows, shape.attention_heads, shape.seq_length, shape.attention_head_dim
    # bfd opens its rows longest documents first (2 in the first Dolly rows, dozens in the last ones): take
    # `batch` rows spread evenly over the plan
    plan = PackedRows(docs, length, "bfd", seed=None)
    count = len(plan.plan(0))
    rows = [plan.row(0, (2 * i + 1) * count // (2 * batch)) for i in range(batch)]
    cu_seqlens = [row.cu_seqlens.tolist() for row in rows]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, length, dim, generator=generator)
    start = time.perf_counter()
    mask = block_causal_mask(cu_seqlens, length)
    mask_ms = (time.perf_counter() - start) * 1e3

    def backward(attention):
        def run():
            for x in (q, k, v):
                x.grad = None
            attention().backward(grad)
        return run

    programs = {
        "per_document": backward(lambda: document_causal_attention(q, k, v, cu_seqlens)),
        "dense_mask": backward(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        "causal_row": backward(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    with torch_threads(threads):
        with torch.no_grad():
            difference = (document_causal_attention(q, k, v, cu_seqlens)
                          - F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).abs().max().item()
        times = interleaved(programs, repeats, warmup=1)
    lengths = [(row.cu_seqlens[1:] - row.cu_seqlens[:-1]).tolist() for row in rows]
    # causal (query, key) pairs of the documents (the padding tail is a segment too) over the whole row's
    work = sum(n * (n + 1) // 2 for row in lengths for n in row) / (batch * length * (length + 1) // 2)
    return {
        "config": f"{batch} packed rows x {length} tokens, {heads} heads x {dim}, fp32, forward + backward, "
                  f"{threads} threads",
        "documents_per_row": [len(row.documents) for row in rows],
        "real_tokens_per_row": [row.num_tokens for row in rows],
        "causal_pairs_fraction": work,
        "mask_build_ms": mask_ms,
        "max_abs_difference": difference,
        **{f"{name}_ms": summary([t * 1e3 for t in ts]) for name, ts in times.items()},
        "ratio_dense_over_per_document": summary([a / b for a, b in zip(times["dense_mask"], times["per_document"])]),
        "ratio_causal_over_per_document": summary([a / b for a, b in zip(times["causal_row"],
                                                                           times["per_document"])]),
    }


def block_causal_mask(offsets: list[list[int]], length: int) -> torch.Tensor:
    """(B, 1, T, T) bool from each row's document offsets `[0, ..., T]`: query t may attend to key s when both
    are in the same document and s <= t (the mask of `reference_document_attention`)."""
    masks = []
    for row in offsets:
        document = torch.repeat_interleave(torch.arange(len(row) - 1), torch.tensor(row[1:]) - torch.tensor(row[:-1]))
        masks.append(document[:, None] == document[None, :])
    return (torch.stack(masks) & torch.ones(length, length, dtype=torch.bool).tril()).unsqueeze(1)


def make_model_dir(shape: SFTShape, tokenizer_dir: Path, out: Path) -> tuple[Path, int]:
    """A random-init Qwen3 of `shape` saved with the tokenizer's files into `out`; returns (out, vocab size).

    The vocabulary is the tokenizer folder's `config.json` `vocab_size` when there is one (151936 for Qwen3),
    else the tokenizer's own size."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config_file = tokenizer_dir / "config.json"
    vocab = json.loads(config_file.read_text()).get("vocab_size") if config_file.is_file() else None
    if not vocab:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
                         num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                         num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         max_position_embeddings=max(shape.seq_length, 2048), rope_theta=1e6,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out, vocab


class ShardlmSteps:
    """shardlm's side: `shardlm.training.run.train` with `[sft]` for the first `warmup_steps` steps (setup, data,
    `checkpoint.init_from` import, metrics.jsonl in `run_dir`), then one more step of the trainer it returns per
    `step()` call, timed around `Trainer.train_step` (the loop body of `train`), with the real tokens it read.
    `extra`: more config overrides (the `lora` section's `[lora]`); `count_tokens(data, step, rows_per_step)`: the
    real tokens a step read (`real_tokens_per_step` by default)."""

    def __init__(self, shape: SFTShape, model_dir: Path, records_file: Path, run_dir: Path, threads: int = 2,
                 extra: list[str] = (), count_tokens=None):
        from shardlm.config import load_config
        from shardlm.training.run import train

        quote = json.dumps
        overrides = [f"sft.data=[{quote(str(records_file))}]", f"sft.tokenizer={quote(str(model_dir))}",
                     'sft.packing="bfd"', "sft.valid_fraction=0.0", f"checkpoint.init_from={quote(str(model_dir))}",
                     "checkpoint.save=false", "log.progress=false", "log.plot=false", "log.tensorboard=false",
                     "log.interval=1", f"train.steps={shape.warmup_steps}",
                     f"train.micro_batch_size={shape.rows_per_step}", f"train.global_batch_size={shape.rows_per_step}",
                     f"model.seq_length={shape.seq_length}", "train.lr=1e-4", 'train.device="cpu"',
                     'train.precision="fp32"', *extra]
        self.shape, self.threads, self.times, self.tokens, self.losses = shape, threads, [], [], []
        self.count_tokens = count_tokens or real_tokens_per_step
        with torch_threads(threads):
            self.trainer = train(load_config(None, overrides), run_dir=run_dir).trainer
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        self.warmup_step_s = [r["step_time_s"] for r in logged if "step_time_s" in r]

    def step(self) -> None:
        with torch_threads(self.threads):
            start = time.perf_counter()
            metrics = self.trainer.train_step()
            self.times.append(time.perf_counter() - start)
        self.tokens.append(self.count_tokens(self.trainer.train_data, metrics["step"], self.shape.rows_per_step))
        self.losses.append(metrics["loss"])


def real_tokens_per_step(data, step: int, rows_per_step: int) -> int:
    """Real tokens of the rows that step `step` (1, 2, ...) of one process read: samples (step - 1) x rows_per_step
    onwards of the packed dataset (`shardlm.sft.dataset.PackedDataset`, dicts of (T,) `input_ids` and
    `position_ids`). A row's padding tail is its last segment (positions restart at 0) when that segment is all
    the pad token."""
    pad_id = data.rows.pad_id
    total = 0
    for index in range((step - 1) * rows_per_step, step * rows_per_step):
        sample = data[index]
        ids, positions = torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["position_ids"])
        start = int((positions == 0).nonzero().max())
        total += start if start > 0 and bool((ids[start:] == pad_id).all()) else len(ids)
    return total


def throughput(shape: SFTShape, conversations, tokenizer_dir: Path, threads: int = 2) -> dict:
    """shardlm against TRL, one step each in turn: tokens/s, step ms and the ratio per pair of steps."""
    from shardlm.bench.sft_trl import trl_run

    with tempfile.TemporaryDirectory(prefix="shardlm-sft-bench-") as folder:
        folder = Path(folder)
        model_dir, vocab = make_model_dir(shape, tokenizer_dir, folder / "model")
        records = folder / "records.jsonl"  # the conversations both sides train on, as `messages` records
        records.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in conversations))
        ours = ShardlmSteps(shape, model_dir, records, folder / "shardlm", threads)
        theirs = trl_run(shape, model_dir, conversations, folder / "trl", threads, after_step=ours.step)
    mine = steady(ours.times, ours.tokens, shape.warmup_steps)
    rates = {"shardlm": [n / t for n, t in zip(mine["tokens"], mine["step_s"])],
             "trl": [n / t for n, t in zip(theirs["tokens"], theirs["step_s"])]}
    return {
        "config": f"{shape.describe(vocab)}, {threads} threads, {len(conversations)} Dolly conversations",
        "pairs": len(rates["trl"]),
        "shardlm_tokens_per_sec": summary(rates["shardlm"]), "trl_tokens_per_sec": summary(rates["trl"]),
        "shardlm_step_ms": summary([t * 1e3 for t in mine["step_s"]]),
        "trl_step_ms": summary([t * 1e3 for t in theirs["step_s"]]),
        "shardlm_real_tokens_per_step": summary(mine["tokens"]), "trl_real_tokens_per_step": summary(theirs["tokens"]),
        "ratio": summary([a / b for a, b in zip(rates["shardlm"], rates["trl"])]),
        "ratio_of_totals": mine["tokens_per_sec"] / theirs["tokens_per_sec"],
        "trl_lm_head_loss_fraction": theirs["lm_head_loss_fraction"],
        "shardlm_warmup_step_ms": [t * 1e3 for t in ours.warmup_step_s],
        "shardlm_losses": ours.losses, "trl_train_loss": theirs["train_loss"],
    }


def sft_bench(quick: bool, repeats: int, data_dir: Path | None = None) -> dict:
    """The `sft` section of `make bench`."""
    shape = SFT_QUICK if quick else SFT_BENCH
    records_file, tokenizer_dir = chat_data(data_dir)
    conversations, docs = load_documents(shape, records_file, tokenizer_dir)
    out: dict = {"packing": {"seq_length": shape.seq_length, "conversations": len(docs),
                             **packing_efficiency(docs, shape.seq_length)},
                 "attention": attention_speed(shape, docs, repeats)}
    try:
        out["throughput"] = throughput(shape, conversations, tokenizer_dir)
    except Exception as exc:  # noqa: BLE001 - the attention and packing figures still count
        out["throughput"] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return out


def markdown_lines(r: dict) -> list[str]:
    """The `sft` section of BENCHMARKS.md."""
    a, p = r["attention"], r["packing"]
    lines = ["## Supervised fine-tuning (`sft`)", "",
             f"Attention over packed rows of real documents (Dolly under the Qwen3 chat template, bfd packing): "
             f"{a['config']}; documents per row {a['documents_per_row']}, real tokens per row "
             f"{a['real_tokens_per_row']}; the documents' causal (query, key) pairs are "
             f"{a['causal_pairs_fraction']:.1%} of the whole rows'.", "",
             "| attention | ms per call | / per-document |", "|---|---|---|",
             f"| per-document SDPA (`document_causal_attention`) | {median_cell(a['per_document_ms'], digits=1)} | 1 |",
             f"| one dense SDPA, block-causal mask | {median_cell(a['dense_mask_ms'], digits=1)} | "
             f"**{median_cell(a['ratio_dense_over_per_document'])}** |",
             f"| causal SDPA over the whole row (documents ignored) | {median_cell(a['causal_row_ms'], digits=1)} | "
             f"{median_cell(a['ratio_causal_over_per_document'])} |", "",
             f"The mask ({a['mask_build_ms']:.1f} ms to build) is built once outside the timing; the per-document and "
             f"dense outputs differ by at most {a['max_abs_difference']:.1e}.", ""]
    t = r.get("throughput") or {}
    if "error" in t:
        lines += [f"SFT throughput against TRL: **not measured** ({t['error']}).", ""]
    elif t:
        lines += [f"SFT throughput against TRL's `SFTTrainer` (bfd packing, padding-free, assistant-only loss, SDPA): "
                  f"{t['config']}. The two trainers take turns, one optimizer step each; tokens/s counts real "
                  f"(non-padding) tokens; {t['pairs']} pairs of steps after the warm-up.", "",
                  "| trainer | real tokens/s | step ms | real tokens per step |", "|---|---|---|---|"]
        for name, label in (("shardlm", "shardlm (`train` with `[sft]`)"), ("trl", "TRL `SFTTrainer`")):
            lines.append(f"| {label} | {median_cell(t[f'{name}_tokens_per_sec'], digits=0)} | "
                         f"{median_cell(t[f'{name}_step_ms'], digits=0)} | "
                         f"{median_cell(t[f'{name}_real_tokens_per_step'], digits=0)} |")
        lines += ["", f"**shardlm / TRL tokens/s (`sft.throughput.ratio`, per pair of steps): "
                  f"{median_cell(t['ratio'])}**; total tokens over total seconds: {t['ratio_of_totals']:.2f}.", ""]
        if t.get("trl_lm_head_loss_fraction"):
            lines += [f"TRL computes the LM head and the per-token log-probabilities in vocabulary tiles "
                      f"(`trl.kernels.chunked_logprob`; without Triton, on a CPU, in torch operations): "
                      f"{t['trl_lm_head_loss_fraction']:.0%} of its step time here.", ""]
    bfd, pad = p["bfd"], p["pad"]
    lines += [f"Packing {p['conversations']} conversations into rows of {p['seq_length']} tokens: bfd "
              f"{bfd['rows']} rows, {bfd['efficiency']:.1%} of row tokens real; one conversation per row (`pad`) "
              f"{pad['rows']} rows, {pad['efficiency']:.1%} real ({p['rows_ratio_pad_over_bfd']:.1f}x the rows).", ""]
    return lines
