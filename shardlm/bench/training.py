"""Single-process training throughput: shardlm at TP=1 vs HuggingFace GPT2LMHeadModel (SDPA).

Every program runs forward + backward + global-norm clipping + fused AdamW on the same shape and
batch, fp32, with the same threads, alternated in a rotating order so machine noise hits all alike. All compute
the same function: GPT-2's tanh-approximated GeLU, SDPA attention, tied LM head, mean cross-entropy.

- `shardlm`: a real shardlm Trainer step (`model.activation = "gelu_tanh"`).
- `hf`: transformers as shipped: `GPT2Config` defaults (`activation_function="gelu_new"`, GPT-2's
  GeLU written as eight tensor ops in Python) and fused AdamW, the Trainer's default optimizer on
  torch >= 2.8. This is the headline ratio.
- `hf_fused_gelu`: the control: the same transformers model told to use PyTorch's one-kernel tanh
  GeLU (`activation_function="gelu_pytorch_tanh"`). It shows what is left of the ratio when both
  programs use the same kernels everywhere.
"""

from __future__ import annotations

import torch

from shardlm.bench.common import BenchShape, interleaved, summary

HF_VARIANTS = {"hf": "gelu_new", "hf_fused_gelu": "gelu_pytorch_tanh"}


def shardlm_step(shape: BenchShape):
    """A zero-argument function running one real shardlm training step (the Trainer's), and the trainer."""
    from shardlm.parallel import ParallelContext

    trainer = shape.trainer(ParallelContext.single())
    return trainer.train_step, trainer


def hf_step(shape: BenchShape, activation: str = "gelu_new", seed: int = 0):
    """One training step of transformers' GPT2LMHeadModel (SDPA attention) on the shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=shape.vocab_size, n_positions=shape.seq_length, n_embd=shape.hidden_size,
                        n_layer=shape.num_layers, n_head=shape.num_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, activation_function=activation, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
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
    """tokens/s of every program and the ratios shardlm / each, medians over interleaved repeats."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    programs = {"shardlm": shardlm_step(shape)[0]}
    programs.update({name: hf_step(shape, activation) for name, activation in HF_VARIANTS.items()})
    times = interleaved(programs, repeats)
    torch.set_num_threads(previous)
    tokens = {name: [shape.tokens / t for t in ts] for name, ts in times.items()}
    result = {"config": shape.describe() + f", {threads} threads", "threads": threads,
              "hf_activation": HF_VARIANTS}
    for name, values in tokens.items():
        result[f"{name}_tokens_per_sec"] = summary(values)
    result["ratio"] = summary([a / b for a, b in zip(tokens["shardlm"], tokens["hf"])])
    result["ratio_same_kernels"] = summary([a / b for a, b in zip(tokens["shardlm"], tokens["hf_fused_gelu"])])
    return result
