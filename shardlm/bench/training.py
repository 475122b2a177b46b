"""Single-process training throughput: shardlm at TP=1 vs HuggingFace GPT2LMHeadModel (SDPA).

Both run forward + backward + global-norm clipping + AdamW on the same shape and batch, fp32, with
the same number of threads, alternated A B A B so machine noise hits both alike.
"""

from __future__ import annotations

import torch

from shardlm.bench.common import BenchShape, interleaved, summary


def shardlm_step(shape: BenchShape):
    """A zero-argument function running one real shardlm training step (the Trainer's), and the trainer."""
    from shardlm.parallel import ParallelContext

    trainer = shape.trainer(ParallelContext.single())
    return trainer.train_step, trainer


def hf_step(shape: BenchShape, seed: int = 0):
    """One training step of transformers' GPT2LMHeadModel (SDPA attention, exact GeLU) on the shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=shape.vocab_size, n_positions=shape.seq_length, n_embd=shape.hidden_size,
                        n_layer=shape.num_layers, n_head=shape.num_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, activation_function="gelu", bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    batch = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length),
                          generator=torch.Generator().manual_seed(seed))

    def step():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def train_vs_hf(shape: BenchShape, repeats: int, threads: int = 2) -> dict:
    """tokens/s of both and their ratio (shardlm / HF), medians over interleaved repeats."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    ours, _ = shardlm_step(shape)
    theirs = hf_step(shape)
    times = interleaved({"shardlm": ours, "hf": theirs}, repeats)
    torch.set_num_threads(previous)
    tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
    ratios = [a / b for a, b in zip(tokens["shardlm"], tokens["hf"])]
    return {"config": shape.describe() + f", {threads} threads", "threads": threads,
            "shardlm_tokens_per_sec": summary(tokens["shardlm"]), "hf_tokens_per_sec": summary(tokens["hf"]),
            "ratio": summary(ratios)}
