"""shardlm: Megatron-style tensor, pipeline, context, expert and data parallel training of GPT, BERT, Llama-family
and Mixture-of-Experts models in native PyTorch."""

__version__ = "0.1.0"
