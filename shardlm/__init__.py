"""shardlm: Megatron-style tensor x data parallel training of GPT and BERT in native PyTorch."""

__version__ = "0.1.0"
